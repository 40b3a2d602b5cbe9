//! Exports only this library's own `cu*` functions from the cdylib.
//!
//! Rust exports every `#[no_mangle]` function a cdylib links in, including
//! the fake NVML's `nvml*` functions from its rlib. A `libcuda.so.1` that
//! also defines `nvmlInit_v2` and friends could shadow the real (or fake)
//! `libnvidia-ml.so.1` of a process that loads both globally, so symbols
//! that come from static archives (the rlibs) stay local to the library.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs=ALL");
}
