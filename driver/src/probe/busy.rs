//! `tessera probe --busy SECONDS`: load on every device, for as long as
//! asked, so that monitoring sees a real workload.
//!
//! Per device the probe retains the primary context, allocates `--alloc`
//! (held until the end), loads [`SPIN_PTX`] and then, round after round,
//! launches its kernel on every device and waits for each: every kernel
//! spins about [`SPIN_CYCLES`] GPU clock cycles (some milliseconds), so the
//! devices stay busy and the probe's own CPU mostly waits. At the end the
//! memory is freed and the contexts released; the report counts the
//! kernels run per device. The PTX is compiled by the CUDA driver at load
//! (any GPU since Maxwell, a driver for CUDA 11 or later); the simulated
//! libcuda takes the same calls.

use std::ffi::{c_int, c_ulonglong, c_void};
use std::time::{Duration, Instant};

use super::{CuContext, Cuda, CudaError, Kernels, ProbeDevice};

/// A kernel that spins until `cycles` clock cycles have passed.
pub const SPIN_PTX: &str = "\
.version 7.0
.target sm_50
.address_size 64

.visible .entry tessera_spin(
    .param .u64 tessera_spin_cycles
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [tessera_spin_cycles];
    mov.u64 %rd2, %clock64;
$Lspin:
    mov.u64 %rd3, %clock64;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $Lspin;
    ret;
}
\0";

/// How long one kernel spins: about 10 ms at 2 GHz.
pub const SPIN_CYCLES: u64 = 20_000_000;

/// One device being kept busy.
struct Held {
    index: usize,
    /// The kernel launch API, which `hold` found.
    api: Kernels,
    device: c_int,
    context: CuContext,
    memory: Option<c_ulonglong>,
    function: *mut c_void,
    kernels: u64,
}

/// Keeps every device of `devices` that probed without error busy for
/// `duration`, holding `alloc` bytes on each; records the kernels run, or
/// the call that failed, on each device.
pub(super) fn run(
    cuda: &Cuda,
    devices: &mut [ProbeDevice],
    alloc: Option<u64>,
    duration: Duration,
) {
    let mut held = Vec::new();
    for (index, d) in devices.iter_mut().enumerate() {
        if d.error.is_some() {
            continue;
        }
        match hold(cuda, index, d.ordinal, alloc) {
            Ok(h) => held.push(h),
            Err(e) => d.error = Some(e.to_string()),
        }
    }
    let deadline = Instant::now() + duration;
    while !held.is_empty() && Instant::now() < deadline {
        let round = held
            .iter_mut()
            .try_for_each(|h| launch(cuda, h))
            .and_then(|()| held.iter().try_for_each(|h| synchronize(cuda, h)));
        if let Err(e) = round {
            for h in &held {
                devices[h.index].error.get_or_insert_with(|| e.to_string());
            }
            break;
        }
    }
    for h in held {
        let index = h.index;
        let kernels = h.kernels;
        devices[index].kernels = Some(kernels);
        if let Err(e) = release(cuda, h) {
            devices[index].error.get_or_insert(e.to_string());
        }
    }
}

fn hold(cuda: &Cuda, index: usize, ordinal: c_int, alloc: Option<u64>) -> Result<Held, CudaError> {
    let k = cuda.kernels.ok_or_else(|| CudaError::NoKernelApi {
        library: cuda.library.clone(),
    })?;
    let mut device = 0;
    let mut context: CuContext = std::ptr::null_mut();
    // SAFETY (every call below): out-pointers valid for their types, a
    // NUL-terminated PTX image and kernel name, as cuda.h documents.
    cuda.check("cuDeviceGet", unsafe {
        (cuda.device_get)(&mut device, ordinal)
    })?;
    cuda.check("cuDevicePrimaryCtxRetain", unsafe {
        (cuda.primary_ctx_retain)(&mut context, device)
    })?;
    let mut h = Held {
        index,
        api: k,
        device,
        context,
        memory: None,
        function: std::ptr::null_mut(),
        kernels: 0,
    };
    let ready = (|| {
        cuda.check("cuCtxSetCurrent", unsafe {
            (cuda.ctx_set_current)(context)
        })?;
        if let Some(bytes) = alloc {
            let mut ptr: c_ulonglong = 0;
            let size = usize::try_from(bytes).map_err(|_| CudaError::TooLargeToHold { bytes })?;
            cuda.check("cuMemAlloc_v2", unsafe { (cuda.mem_alloc)(&mut ptr, size) })?;
            h.memory = Some(ptr);
        }
        let mut module: *mut c_void = std::ptr::null_mut();
        cuda.check("cuModuleLoadData", unsafe {
            (k.module_load_data)(&mut module, SPIN_PTX.as_ptr().cast())
        })?;
        cuda.check("cuModuleGetFunction", unsafe {
            (k.module_get_function)(&mut h.function, module, c"tessera_spin".as_ptr())
        })
    })();
    match ready {
        Ok(()) => Ok(h),
        Err(e) => {
            let _ = release(cuda, h);
            Err(e)
        }
    }
}

fn launch(cuda: &Cuda, h: &mut Held) -> Result<(), CudaError> {
    let mut cycles: u64 = SPIN_CYCLES;
    let mut params = [(&raw mut cycles).cast::<c_void>()];
    // SAFETY: a context and function the library handed out; one block of
    // 32 threads on the default stream; the kernel's one parameter.
    cuda.check("cuCtxSetCurrent", unsafe {
        (cuda.ctx_set_current)(h.context)
    })?;
    cuda.check("cuLaunchKernel", unsafe {
        (h.api.launch_kernel)(
            h.function,
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            std::ptr::null_mut(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })?;
    h.kernels += 1;
    Ok(())
}

fn synchronize(cuda: &Cuda, h: &Held) -> Result<(), CudaError> {
    // SAFETY: plain calls on a context the library handed out.
    cuda.check("cuCtxSetCurrent", unsafe {
        (cuda.ctx_set_current)(h.context)
    })?;
    cuda.check("cuCtxSynchronize", unsafe { (h.api.ctx_synchronize)() })
}

/// Frees the memory and releases the context (its module goes with it).
fn release(cuda: &Cuda, h: Held) -> Result<(), CudaError> {
    // SAFETY: plain calls on what the library handed out.
    let freed = match h.memory {
        Some(ptr) => cuda
            .check("cuCtxSetCurrent", unsafe {
                (cuda.ctx_set_current)(h.context)
            })
            .and_then(|()| cuda.check("cuMemFree_v2", unsafe { (cuda.mem_free)(ptr) })),
        None => Ok(()),
    };
    unsafe { (cuda.ctx_set_current)(std::ptr::null_mut()) };
    let released = cuda.check("cuDevicePrimaryCtxRelease_v2", unsafe {
        (cuda.primary_ctx_release)(h.device)
    });
    freed.and(released)
}
