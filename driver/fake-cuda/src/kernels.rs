//! Modules and kernel launches: how a process keeps a device busy.
//!
//! `cuModuleLoadData` takes PTX text (NUL-terminated, with `.version`,
//! `.target` and its `.entry` kernels; anything else, a cubin or fatbin
//! included, answers `CUDA_ERROR_INVALID_IMAGE`: this driver compiles no
//! binary) into the current context. `cuModuleGetFunction` finds an entry
//! by name (`CUDA_ERROR_NOT_FOUND` otherwise). `cuLaunchKernel` checks the
//! function, its module's context being current, the grid and block (no
//! zero dimension, at most 1024 threads a block) and the stream (only the
//! default stream, null, exists here), and queues the kernel: each runs for
//! [`KERNEL_TIME`] of simulated time after the one before it.
//! `cuCtxSynchronize` returns when the current context's device has run
//! what was queued. Kernel code is never executed.
//!
//! While kernels run, the process's load record says the device is busy
//! (renewed at most every [`LEASE`]/2, so a tight launch loop costs a few
//! writes a second); an idle device stops counting as busy within
//! [`LEASE`].

use std::ffi::{CStr, c_char, c_uint, c_void};
use std::ptr;
use std::time::{Duration, Instant};

use tessera_fake_nvml::load::now_ms;

use crate::codes::*;
use crate::{Session, ffi, put, with_session};

/// How long one simulated kernel runs.
pub const KERNEL_TIME: Duration = Duration::from_millis(10);
/// How long a launch keeps the device busy in the load record (ms).
pub const LEASE: u64 = 1000;

/// Most threads a block may have.
const MAX_BLOCK_THREADS: u64 = 1024;

const MODULE_MAGIC: u64 = 0x7E5D << 48;
const FUNCTION_MAGIC: u64 = 0x7E5F << 48;

/// The opaque structs `CUmodule` and `CUfunction` point to.
#[repr(C)]
pub struct CUmod_st {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct CUfunc_st {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct CUstream_st {
    _opaque: [u8; 0],
}

pub type CUmodule = *mut CUmod_st;
pub type CUfunction = *mut CUfunc_st;
pub type CUstream = *mut CUstream_st;

/// A loaded module: the context it belongs to and its kernels' names.
#[derive(Debug, Clone)]
pub struct Module {
    context: u32,
    entries: Vec<String>,
}

/// The kernels a PTX text defines; `None` when it is not PTX.
fn ptx_entries(text: &str) -> Option<Vec<String>> {
    let directive = |name: &str| text.split_whitespace().any(|w| w == name);
    if !directive(".version") || !directive(".target") {
        return None;
    }
    let mut entries = Vec::new();
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == ".entry" {
            let name = words.next()?;
            let name = name.split('(').next()?;
            if name.is_empty() {
                return None;
            }
            entries.push(name.to_owned());
        }
    }
    Some(entries)
}

impl Session {
    /// Unloads the modules of a context that is going away.
    pub(crate) fn unload_context_modules(&mut self, context: u32) {
        self.modules.retain(|_, m| m.context != context);
    }

    fn module_handle(&self, id: u32) -> CUmodule {
        let value = MODULE_MAGIC | u64::from(self.generation) << 32 | u64::from(id);
        ptr::without_provenance_mut(value as usize)
    }

    fn module_id(&self, handle: usize) -> Option<u32> {
        let value = handle as u64;
        let id = value as u32;
        (value & (0xFFFF << 48) == MODULE_MAGIC
            && (value >> 32) & 0xFFFF == u64::from(self.generation)
            && self.modules.contains_key(&id))
        .then_some(id)
    }

    fn function_handle(&self, module: u32, entry: usize) -> CUfunction {
        let value = FUNCTION_MAGIC
            | u64::from(self.generation) << 32
            | u64::from(module) << 12
            | entry as u64;
        ptr::without_provenance_mut(value as usize)
    }

    /// The module and entry a function handle names.
    fn function(&self, handle: usize) -> Option<(u32, usize)> {
        let value = handle as u64;
        if value & (0xFFFF << 48) != FUNCTION_MAGIC
            || (value >> 32) & 0xFFFF != u64::from(self.generation)
        {
            return None;
        }
        let module = ((value >> 12) & 0xF_FFFF) as u32;
        let entry = (value & 0xFFF) as usize;
        let m = self.modules.get(&module)?;
        (entry < m.entries.len()).then_some((module, entry))
    }

    /// Queues one kernel on `device`; renews the busy lease when it runs
    /// out within half of it.
    fn queue_kernel(&mut self, device: usize) {
        let now = Instant::now();
        let d = &mut self.devices[device];
        let start = d.in_flight_until.filter(|t| *t > now).unwrap_or(now);
        d.in_flight_until = Some(start + KERNEL_TIME);
        let now_ms = now_ms();
        if d.busy_until_ms < now_ms + LEASE / 2 {
            d.busy_until_ms = now_ms + LEASE;
            self.publish_load();
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    ffi(|| {
        with_session(|s| {
            let (context, _) = s.current()?;
            if module.is_null() || image.is_null() {
                return Err(INVALID_VALUE);
            }
            // SAFETY: CUDA contract: a PTX image is a NUL-terminated string
            // (a binary image is read only up to its first NUL byte).
            let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) };
            let entries = text
                .to_str()
                .ok()
                .and_then(ptx_entries)
                .ok_or(INVALID_IMAGE)?;
            let id = s.next_module;
            s.next_module += 1;
            s.modules.insert(id, Module { context, entries });
            // SAFETY: CUDA contract: valid for a CUmodule (checked non-null).
            unsafe { put(module, s.module_handle(id)) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: CUmodule) -> CUresult {
    ffi(|| {
        with_session(|s| {
            let id = s.module_id(module.addr()).ok_or(INVALID_HANDLE)?;
            s.modules.remove(&id);
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut CUfunction,
    module: CUmodule,
    name: *const c_char,
) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if function.is_null() || name.is_null() {
                return Err(INVALID_VALUE);
            }
            let id = s.module_id(module.addr()).ok_or(INVALID_HANDLE)?;
            // SAFETY: CUDA contract: a NUL-terminated string.
            let name = unsafe { CStr::from_ptr(name) }.to_str().ok();
            let entry = s.modules[&id]
                .entries
                .iter()
                .position(|e| Some(e.as_str()) == name)
                .ok_or(NOT_FOUND)?;
            // SAFETY: CUDA contract: valid for a CUfunction (checked non-null).
            unsafe { put(function, s.function_handle(id, entry)) }
        })
    })
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn cuLaunchKernel(
    function: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    _shared_mem_bytes: c_uint,
    stream: CUstream,
    _kernel_params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    ffi(|| {
        with_session(|s| {
            let (module, _) = s.function(function.addr()).ok_or(INVALID_HANDLE)?;
            let (context, ctx) = s.current()?;
            if s.modules[&module].context != context {
                return Err(INVALID_CONTEXT);
            }
            let dims = [grid_x, grid_y, grid_z, block_x, block_y, block_z];
            let threads = u64::from(block_x) * u64::from(block_y) * u64::from(block_z);
            if dims.contains(&0) || threads > MAX_BLOCK_THREADS {
                return Err(INVALID_VALUE);
            }
            if !stream.is_null() {
                return Err(INVALID_HANDLE);
            }
            s.queue_kernel(ctx.device);
            Ok(())
        })
    })
}

/// Waits, without holding the library, until the current context's device
/// has run every kernel queued so far.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    ffi(|| {
        let until = with_session(|s| {
            let (_, ctx) = s.current()?;
            Ok(s.devices[ctx.device].in_flight_until)
        })?;
        if let Some(left) = until.and_then(|t| t.checked_duration_since(Instant::now())) {
            // The simulated GPU at work, not a synchronization of this
            // library's own.
            std::thread::sleep(left);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_names_its_entries_and_other_images_are_refused() {
        let ptx = ".version 7.0\n.target sm_50\n.address_size 64\n\
                   .visible .entry spin(\n.param .u64 cycles\n)\n{ ret; }\n\
                   .visible .entry other() { ret; }\n";
        assert_eq!(
            ptx_entries(ptx),
            Some(vec!["spin".to_owned(), "other".to_owned()])
        );
        assert_eq!(ptx_entries("\x7fELF"), None);
        assert_eq!(ptx_entries(".version 7.0\n.entry x() {}"), None);
    }
}
