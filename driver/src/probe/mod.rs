//! `tessera probe`: what a CUDA process really gets.
//!
//! The probe loads the CUDA driver library (`libcuda.so.1`, or `--library`)
//! at run time, with no CUDA toolkit at build time, and reports as JSON
//! ([`ProbeReport`]) what this process gets through it: the CUDA driver
//! version and, per device it enumerates, its UUID, name, SMs (under MPS:
//! the client's share), total memory, the memory free to it under a
//! context (under MPS: its pinned limit), and, with `--alloc`, whether an
//! allocation of that size succeeds. The MPS-relevant environment it ran
//! with is echoed, so a reader sees what it asked for next to what it got.
//!
//! Per device it retains the primary context (the one the CUDA runtime
//! uses), makes it current, reads free memory, allocates and frees, and
//! releases the context again.
//!
//! With `--busy SECONDS` it then keeps every device busy that long (spin
//! kernels, see [`busy`]), holding `--alloc` on each: the load a monitoring
//! test watches.
//!
//! With `--cdi-device` it first makes itself the container that CDI device
//! describes (see [`container`]): how the GPU self-test probes a claim
//! prepared on a node without a kubelet.
//!
//! Exit status: 0 when every call worked (a refused `--alloc` is a result,
//! not a failure), 1 otherwise; a library that does not load, lacks a
//! function or fails `cuInit` gives a report with only `error` (naming the
//! library or call and the CUDA error name) beside the environment.

use std::ffi::{CStr, OsStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::time::Duration;

mod busy;
pub mod container;

/// The library loaded by default: the dynamic loader finds it as it would
/// for any CUDA program.
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

pub use tessera_api::probe::*;

/// Probes through `library`, allocating `alloc` bytes per device if given;
/// with `busy`, then keeps every device busy that long.
pub fn probe(library: &OsStr, alloc: Option<u64>, busy: Option<Duration>) -> ProbeReport {
    let mut report = ProbeReport {
        library: library.to_string_lossy().into_owned(),
        cuda_driver_version: None,
        environment: ProbeEnvironment::current(),
        container: None,
        devices: Vec::new(),
        error: None,
    };
    let cuda = match Cuda::load(library) {
        Ok(c) => c,
        Err(e) => {
            report.error = Some(e.to_string());
            return report;
        }
    };
    let mut version = 0;
    // SAFETY: a valid out-pointer.
    if let Err(e) = cuda.check("cuDriverGetVersion", unsafe {
        (cuda.driver_get_version)(&mut version)
    }) {
        report.error = Some(e.to_string());
        return report;
    }
    report.cuda_driver_version = Some(version);
    // SAFETY: a plain call.
    if let Err(e) = cuda.check("cuInit", unsafe { (cuda.init)(0) }) {
        report.error = Some(e.to_string());
        return report;
    }
    let mut count = 0;
    // SAFETY: a valid out-pointer.
    if let Err(e) = cuda.check("cuDeviceGetCount", unsafe {
        (cuda.device_get_count)(&mut count)
    }) {
        report.error = Some(e.to_string());
        return report;
    }
    report.devices = (0..count).map(|o| cuda.device(o, alloc)).collect();
    if let Some(duration) = busy {
        busy::run(&cuda, &mut report.devices, alloc, duration);
    }
    report
}

/// Why the CUDA driver library cannot be used at all. The report's
/// `error` is its Display, which names the library and says the loader's
/// reason (also kept as the source).
#[derive(Debug, thiserror::Error)]
enum LoadError {
    #[error("loading {library}: {source}")]
    Library {
        library: String,
        source: libloading::Error,
    },
    #[error("{library}: no {symbol}: {source}")]
    Symbol {
        library: String,
        symbol: &'static str,
        source: libloading::Error,
    },
}

/// A step on a device that failed; the report's `error` (the device's or
/// the whole report's) is its Display.
#[derive(Debug, thiserror::Error)]
enum CudaError {
    /// A driver API call that did not return `CUDA_SUCCESS`: the call and
    /// the library's name for the code.
    #[error("{call}: {name}")]
    Call {
        call: &'static str,
        code: CuResult,
        name: String,
    },
    /// `--alloc` beyond what this machine addresses.
    #[error("--alloc {bytes}: more than this machine can address")]
    Unaddressable { bytes: u64 },
    /// The same for the memory `--busy` holds.
    #[error("--alloc {bytes}: too large")]
    TooLargeToHold { bytes: u64 },
    /// `--busy` through a library that cannot launch kernels.
    #[error(
        "--busy: {library} has no kernel launch API (cuModuleLoadData, cuModuleGetFunction, \
         cuLaunchKernel, cuCtxSynchronize)"
    )]
    NoKernelApi { library: String },
}

/// A CUDA call's result: `CUresult`.
type CuResult = c_int;
type CuContext = *mut c_void;

#[repr(C)]
struct CuUuid {
    bytes: [u8; 16],
}

const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;

/// The driver API functions `--busy` calls (absent from a library that
/// cannot launch kernels).
#[derive(Clone, Copy)]
struct Kernels {
    module_load_data: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CuResult,
    module_get_function:
        unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        *mut c_void,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
}

/// The driver API functions the probe calls.
struct Cuda {
    /// The library as given.
    library: String,
    kernels: Option<Kernels>,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CuResult,
    device_get_uuid: unsafe extern "C" fn(*mut CuUuid, c_int) -> CuResult,
    device_get_uuid_v2: Option<unsafe extern "C" fn(*mut CuUuid, c_int) -> CuResult>,
    device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, c_int) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(c_int) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut c_ulonglong, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(c_ulonglong) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

impl Cuda {
    /// Loads the library and its functions. The library is never unloaded:
    /// a CUDA driver's threads outlive `dlclose`.
    fn load(library: &OsStr) -> Result<Cuda, LoadError> {
        let name = library.to_string_lossy();
        // SAFETY: loading the CUDA driver runs its initializers, which is
        // what every CUDA program does.
        let lib =
            unsafe { libloading::Library::new(library) }.map_err(|source| LoadError::Library {
                library: name.clone().into_owned(),
                source,
            })?;
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        macro_rules! get {
            ($symbol:literal) => {
                // SAFETY: the type is the function's signature in cuda.h.
                *unsafe { lib.get(concat!($symbol, "\0").as_bytes()) }.map_err(|source| {
                    LoadError::Symbol {
                        library: name.clone().into_owned(),
                        symbol: $symbol,
                        source,
                    }
                })?
            };
        }
        // SAFETY: each type is the function's signature in cuda.h.
        let kernels = unsafe {
            (|| {
                Some(Kernels {
                    module_load_data: *lib.get(b"cuModuleLoadData\0").ok()?,
                    module_get_function: *lib.get(b"cuModuleGetFunction\0").ok()?,
                    launch_kernel: *lib.get(b"cuLaunchKernel\0").ok()?,
                    ctx_synchronize: *lib.get(b"cuCtxSynchronize\0").ok()?,
                })
            })()
        };
        Ok(Cuda {
            library: name.clone().into_owned(),
            kernels,
            init: get!("cuInit"),
            driver_get_version: get!("cuDriverGetVersion"),
            device_get_count: get!("cuDeviceGetCount"),
            device_get: get!("cuDeviceGet"),
            device_get_name: get!("cuDeviceGetName"),
            device_get_uuid: get!("cuDeviceGetUuid"),
            // SAFETY: the type is the function's signature in cuda.h.
            device_get_uuid_v2: unsafe { lib.get(b"cuDeviceGetUuid_v2\0") }.ok().map(|f| *f),
            device_total_mem: get!("cuDeviceTotalMem_v2"),
            device_get_attribute: get!("cuDeviceGetAttribute"),
            primary_ctx_retain: get!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: get!("cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: get!("cuCtxSetCurrent"),
            mem_get_info: get!("cuMemGetInfo_v2"),
            mem_alloc: get!("cuMemAlloc_v2"),
            mem_free: get!("cuMemFree_v2"),
            get_error_name: get!("cuGetErrorName"),
        })
    }

    /// `CUDA_ERROR_...` for a result, from the library itself.
    fn error_name(&self, code: CuResult) -> String {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: a valid out-pointer; on success the library hands out a
        // static NUL-terminated string.
        match unsafe { (self.get_error_name)(code, &mut text) } {
            0 if !text.is_null() => unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned(),
            _ => format!("CUDA error {code}"),
        }
    }

    /// [`CudaError::Call`] unless `code` is CUDA_SUCCESS.
    fn check(&self, call: &'static str, code: CuResult) -> Result<(), CudaError> {
        if code == 0 {
            Ok(())
        } else {
            Err(CudaError::Call {
                call,
                code,
                name: self.error_name(code),
            })
        }
    }

    fn device(&self, ordinal: c_int, alloc: Option<u64>) -> ProbeDevice {
        let mut d = ProbeDevice {
            ordinal,
            uuid: String::new(),
            gpu_uuid: String::new(),
            name: String::new(),
            multiprocessors: 0,
            memory_total_bytes: 0,
            memory_free_bytes: None,
            allocation: None,
            kernels: None,
            error: None,
        };
        if let Err(e) = self.fill(&mut d, alloc) {
            d.error = Some(e.to_string());
        }
        d
    }

    fn fill(&self, d: &mut ProbeDevice, alloc: Option<u64>) -> Result<(), CudaError> {
        let mut dev = 0;
        // SAFETY (every call below): out-pointers valid for their types,
        // buffers for their lengths, as cuda.h documents.
        self.check("cuDeviceGet", unsafe {
            (self.device_get)(&mut dev, d.ordinal)
        })?;
        let mut name = [0 as c_char; 256];
        self.check("cuDeviceGetName", unsafe {
            (self.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev)
        })?;
        d.name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut gpu = CuUuid { bytes: [0; 16] };
        self.check("cuDeviceGetUuid", unsafe {
            (self.device_get_uuid)(&mut gpu, dev)
        })?;
        let own = match self.device_get_uuid_v2 {
            Some(f) => {
                let mut own = CuUuid { bytes: [0; 16] };
                self.check("cuDeviceGetUuid_v2", unsafe { f(&mut own, dev) })?;
                own.bytes
            }
            None => gpu.bytes,
        };
        d.gpu_uuid = format_uuid("GPU-", &gpu.bytes);
        d.uuid = if own == gpu.bytes {
            d.gpu_uuid.clone()
        } else {
            format_uuid("MIG-", &own)
        };
        self.check("cuDeviceGetAttribute", unsafe {
            (self.device_get_attribute)(
                &mut d.multiprocessors,
                CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                dev,
            )
        })?;
        let mut total = 0usize;
        self.check("cuDeviceTotalMem_v2", unsafe {
            (self.device_total_mem)(&mut total, dev)
        })?;
        d.memory_total_bytes = total as u64;

        let mut ctx: CuContext = std::ptr::null_mut();
        self.check("cuDevicePrimaryCtxRetain", unsafe {
            (self.primary_ctx_retain)(&mut ctx, dev)
        })?;
        let under_context = self.under_context(d, ctx, alloc);
        // SAFETY: plain calls on the context retained above.
        unsafe { (self.ctx_set_current)(std::ptr::null_mut()) };
        let released = self.check("cuDevicePrimaryCtxRelease_v2", unsafe {
            (self.primary_ctx_release)(dev)
        });
        under_context.and(released)
    }

    /// Free memory and the allocation, with `ctx` current.
    fn under_context(
        &self,
        d: &mut ProbeDevice,
        ctx: CuContext,
        alloc: Option<u64>,
    ) -> Result<(), CudaError> {
        // SAFETY (every call below): a context the library handed out and
        // out-pointers valid for their types.
        self.check("cuCtxSetCurrent", unsafe { (self.ctx_set_current)(ctx) })?;
        let (mut free, mut total) = (0usize, 0usize);
        self.check("cuMemGetInfo_v2", unsafe {
            (self.mem_get_info)(&mut free, &mut total)
        })?;
        d.memory_free_bytes = Some(free as u64);
        let Some(bytes) = alloc else {
            return Ok(());
        };
        let Ok(size) = usize::try_from(bytes) else {
            return Err(CudaError::Unaddressable { bytes });
        };
        let mut ptr: c_ulonglong = 0;
        match unsafe { (self.mem_alloc)(&mut ptr, size) } {
            0 => {
                d.allocation = Some(ProbeAllocation {
                    bytes,
                    ok: true,
                    error: None,
                });
                self.check("cuMemFree_v2", unsafe { (self.mem_free)(ptr) })
            }
            code => {
                d.allocation = Some(ProbeAllocation {
                    bytes,
                    ok: false,
                    error: Some(self.error_name(code)),
                });
                Ok(())
            }
        }
    }
}

/// `<prefix>xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi` prints it.
pub fn format_uuid(prefix: &str, bytes: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| -> String {
        bytes[r].iter().map(|b| format!("{b:02x}")).collect()
    };
    format!(
        "{prefix}{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_as_nvidia_smi_prints_them() {
        let bytes = [
            0x3d, 0x2a, 0x07, 0xe5, 0x04, 0xb3, 0x43, 0x12, 0x87, 0xc3, 0xc2, 0x3b, 0xe8, 0xaa,
            0xee, 0x0f,
        ];
        assert_eq!(
            format_uuid("GPU-", &bytes),
            "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f"
        );
    }

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let report = probe(OsStr::new("/nonexistent/libcuda.so.1"), None, None);
        let error = report.error.as_deref().unwrap();
        assert!(
            error.starts_with("loading /nonexistent/libcuda.so.1: "),
            "{error}"
        );
        assert!(report.devices.is_empty());
        assert!(!report.succeeded());
    }

    #[test]
    fn the_report_round_trips_with_its_field_names() {
        let report = ProbeReport {
            library: "libcuda.so.1".into(),
            cuda_driver_version: Some(12080),
            environment: ProbeEnvironment {
                cuda_visible_devices: Some("0".into()),
                ..ProbeEnvironment::default()
            },
            container: None,
            devices: vec![ProbeDevice {
                ordinal: 0,
                uuid: "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f".into(),
                gpu_uuid: "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                multiprocessors: 32,
                memory_total_bytes: 85520809984,
                memory_free_bytes: Some(8589934592),
                allocation: Some(ProbeAllocation {
                    bytes: 9663676416,
                    ok: false,
                    error: Some("CUDA_ERROR_OUT_OF_MEMORY".into()),
                }),
                kernels: None,
                error: None,
            }],
            error: None,
        };
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "library": "libcuda.so.1",
                "cudaDriverVersion": 12080,
                "environment": {
                    "CUDA_VISIBLE_DEVICES": "0",
                    "CUDA_MPS_PIPE_DIRECTORY": null,
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": null,
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": null,
                },
                "devices": [{
                    "ordinal": 0,
                    "uuid": "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f",
                    "gpuUuid": "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f",
                    "name": "NVIDIA H100 80GB HBM3",
                    "multiprocessors": 32,
                    "memoryTotalBytes": 85520809984u64,
                    "memoryFreeBytes": 8589934592u64,
                    "allocation": {
                        "bytes": 9663676416u64,
                        "ok": false,
                        "error": "CUDA_ERROR_OUT_OF_MEMORY",
                    },
                }],
            })
        );
        assert_eq!(serde_json::from_value::<ProbeReport>(json).unwrap(), report);
    }
}
