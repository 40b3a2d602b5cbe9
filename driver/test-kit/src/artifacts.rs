//! The binaries and libraries tests run: `tessera`, the simulated NVML and
//! CUDA libraries, `fake-mps-control` and the `nvidia-smi` stand-in.
//!
//! A test crate cannot depend on a binary, so each is built with cargo on
//! first use (a no-op when it is fresh), once per process, and its path is
//! taken from cargo's own report rather than guessed. A simulated library
//! the test crate depends on is already built beside the test binary and is
//! taken from there. `TESSERA_BIN` and `TESSERA_FAKE_NVML_LIB` point at prebuilt
//! ones instead.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

use serde_json::Value;

/// What of a package to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    /// A binary, by its name.
    Bin(&'static str),
    /// The package's library, as a shared object (its cdylib).
    Cdylib,
}

/// The artifact of `target` in `package`, built by cargo on first use in
/// this process (cargo also places it in `<target dir>/<profile>`).
pub fn built(package: &'static str, target: Target) -> &'static Path {
    static BUILT: OnceLock<Mutex<BTreeMap<(&str, Target), &'static Path>>> = OnceLock::new();
    let cache = BUILT.get_or_init(Mutex::default);
    if let Some(path) = cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&(package, target))
    {
        return path;
    }
    let path: &'static Path = Box::leak(build(package, target).into_boxed_path());
    cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert((package, target), path);
    path
}

/// The `tessera` executable (or `TESSERA_BIN`).
pub fn tessera() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::var_os("TESSERA_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| built("tessera-driver", Target::Bin("tessera")).to_owned())
    })
}

/// The simulated NVML's cdylib (or `TESSERA_FAKE_NVML_LIB`), for
/// `--nvml-library`.
pub fn fake_nvml_lib() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::var_os("TESSERA_FAKE_NVML_LIB")
            .map(PathBuf::from)
            .unwrap_or_else(|| dependency_cdylib("tessera-fake-nvml"))
    })
}

/// A directory holding the simulated NVML as `libnvidia-ml.so.1`, for
/// `LD_LIBRARY_PATH`.
pub fn fake_nvml_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| under_soname(fake_nvml_lib(), "fake-nvml", "libnvidia-ml.so.1"))
}

/// The simulated CUDA driver's cdylib.
pub fn fake_cuda_lib() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| dependency_cdylib("tessera-fake-cuda"))
}

/// A directory holding the simulated CUDA driver as `libcuda.so.1`, for
/// `LD_LIBRARY_PATH`.
pub fn fake_cuda_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| under_soname(fake_cuda_lib(), "fake-cuda", "libcuda.so.1"))
}

/// The simulated `nvidia-cuda-mps-control`.
pub fn fake_mps_control() -> &'static Path {
    built("tessera-fake-nvml", Target::Bin("fake-mps-control"))
}

/// The `nvidia-smi` stand-in (answers from the simulated NVML).
pub fn fake_nvidia_smi() -> &'static Path {
    built("tessera-fake-nvml", Target::Bin("nvidia-smi"))
}

/// `package`'s cdylib: beside the test binary when the test crate depends
/// on it (cargo built it with the test), else built now.
fn dependency_cdylib(package: &'static str) -> PathBuf {
    beside_test(&format!("lib{}.so", package.replace('-', "_")))
        .unwrap_or_else(|| built(package, Target::Cdylib).to_owned())
}

/// `file` where cargo put the test binary's dependencies, if it is there.
fn beside_test(file: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    [deps, deps.parent()?]
        .into_iter()
        .map(|d| d.join(file))
        .find(|p| p.is_file())
}

/// `cargo build --workspace <target>`, and the artifact of `package` cargo
/// reports. The whole workspace is the selection, as for the `cargo build
/// --workspace` and `cargo test --workspace` around the tests: a narrower
/// one unifies dependency features differently and rebuilds shared
/// libraries in place, under the feet of the cargo that runs the tests.
fn build(package: &str, target: Target) -> PathBuf {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--workspace", "--message-format=json"]);
    match target {
        Target::Bin(name) => cmd.args(["--bin", name]),
        Target::Cdylib => cmd.arg("--lib"),
    };
    let out = cmd
        .current_dir(crate::repo_root())
        .stderr(Stdio::inherit())
        .output()
        .expect("running cargo build");
    assert!(
        out.status.success(),
        "cargo build --workspace ({package} {target:?}) failed"
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && of_package(m, package))
        .find_map(|m| artifact(&m, package, target))
        .unwrap_or_else(|| panic!("cargo reported no {target:?} artifact of {package}"))
}

/// Whether a `compiler-artifact` message is of `package` (its package id
/// names it: `path+file:///...#tessera-driver@0.1.0` or `...#0.1.0` after
/// a directory of that name).
fn of_package(message: &Value, package: &str) -> bool {
    let Some((url, fragment)) = message["package_id"]
        .as_str()
        .and_then(|id| id.split_once('#'))
    else {
        return false;
    };
    match fragment.split_once('@') {
        Some((name, _version)) => name == package,
        None => url.rsplit('/').next() == Some(package),
    }
}

/// The path of `target` in one `compiler-artifact` message, if it is that.
fn artifact(message: &Value, package: &str, target: Target) -> Option<PathBuf> {
    match target {
        Target::Bin(name) if message["target"]["name"] == name => {
            message["executable"].as_str().map(PathBuf::from)
        }
        Target::Cdylib if message["target"]["name"] == package.replace('-', "_") => {
            message["filenames"]
                .as_array()?
                .iter()
                .filter_map(Value::as_str)
                .find(|f| f.ends_with(".so"))
                .map(PathBuf::from)
        }
        _ => None,
    }
}

/// A directory beside `lib` holding it under `soname`, the name the
/// dynamic loader looks for.
fn under_soname(lib: &Path, dir: &str, soname: &str) -> PathBuf {
    let dir = lib.parent().unwrap_or(Path::new(".")).join(dir);
    std::fs::create_dir_all(&dir).expect("creating a library directory");
    // Replace atomically: another test binary may use the link now.
    let tmp = dir.join(format!(".{soname}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(lib, &tmp).expect("linking a simulated library");
    std::fs::rename(&tmp, dir.join(soname)).expect("placing a simulated library");
    dir
}

/// The three a test that runs Tessera as a process needs at once.
pub struct Binaries {
    /// The `tessera` executable.
    pub tessera: PathBuf,
    /// The fake NVML cdylib, for `--nvml-library`.
    pub fake_nvml: PathBuf,
    /// A directory holding it as `libnvidia-ml.so.1`, for `LD_LIBRARY_PATH`.
    pub fake_nvml_dir: PathBuf,
}

/// [`tessera`], [`fake_nvml_lib`] and [`fake_nvml_dir`] together.
pub fn binaries() -> &'static Binaries {
    static BINS: OnceLock<Binaries> = OnceLock::new();
    BINS.get_or_init(|| Binaries {
        tessera: tessera().to_owned(),
        fake_nvml: fake_nvml_lib().to_owned(),
        fake_nvml_dir: fake_nvml_dir().to_owned(),
    })
}

/// Builds everything `conformance/cluster.sh node-start` runs and returns
/// cargo's directory of the profile (`<target dir>/debug`) that holds them,
/// where the script looks.
pub fn node_start_profile_dir() -> &'static Path {
    for lib in ["tessera-fake-nvml", "tessera-fake-cuda"] {
        built(lib, Target::Cdylib);
    }
    fake_mps_control();
    fake_nvidia_smi();
    built("tessera-test-kit", Target::Bin("tessera-kit"));
    let tessera = built("tessera-driver", Target::Bin("tessera"));
    tessera
        .parent()
        .expect("cargo puts binaries in a profile directory")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cargo_reports_are_read_for_the_target_asked() {
        let bin = serde_json::json!({"reason": "compiler-artifact",
            "target": {"name": "fake-mps-control"}, "executable": "/t/debug/fake-mps-control",
            "filenames": ["/t/debug/fake-mps-control"]});
        let lib = serde_json::json!({"reason": "compiler-artifact",
            "target": {"name": "tessera_fake_nvml"}, "executable": null,
            "filenames": ["/t/debug/libtessera_fake_nvml.rlib", "/t/debug/libtessera_fake_nvml.so"]});
        let mps = Target::Bin("fake-mps-control");
        assert_eq!(
            artifact(&bin, "tessera-fake-nvml", mps),
            Some(PathBuf::from("/t/debug/fake-mps-control"))
        );
        assert_eq!(artifact(&lib, "tessera-fake-nvml", mps), None);
        assert_eq!(
            artifact(&lib, "tessera-fake-nvml", Target::Cdylib),
            Some(PathBuf::from("/t/debug/libtessera_fake_nvml.so"))
        );
        assert_eq!(artifact(&lib, "tessera-fake-cuda", Target::Cdylib), None);
    }

    #[test]
    fn an_artifact_is_taken_only_from_its_package() {
        let of = |id: &str| serde_json::json!({ "package_id": id });
        let driver = of("path+file:///src/driver#tessera-driver@0.1.0");
        assert!(of_package(&driver, "tessera-driver"));
        assert!(!of_package(&driver, "tessera"));
        assert!(of_package(
            &of("path+file:///src/tessera-api#0.1.0"),
            "tessera-api"
        ));
        assert!(!of_package(
            &of("path+file:///src/api#tessera-api@0.1.0"),
            "api"
        ));
    }

    #[test]
    fn a_simulated_library_is_found_under_its_soname() {
        let lib = fake_nvml_lib();
        let link = fake_nvml_dir().join("libnvidia-ml.so.1");
        assert_eq!(
            std::fs::canonicalize(link).unwrap(),
            std::fs::canonicalize(lib).unwrap()
        );
    }
}
