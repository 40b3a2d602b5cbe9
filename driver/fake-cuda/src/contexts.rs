//! Contexts: created and primary, and the calling thread's current one.

use std::ffi::c_uint;
use std::ptr;

use crate::codes::*;
use crate::{CURRENT, CUcontext, CUdevice, Context, ffi, put, with_session};

/// The `cuCtxCreate` flags that exist (scheduling, map host, local memory
/// resize, coredump, sync memops).
const CTX_FLAGS: c_uint = 0xFF;
const CTX_SCHED_MASK: c_uint = 0x07;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    context: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if context.is_null()
                || flags & !CTX_FLAGS != 0
                || !matches!(flags & CTX_SCHED_MASK, 0 | 1 | 2 | 4)
            {
                return Err(INVALID_VALUE);
            }
            let device = s.usable(dev)?;
            let id = s.next_context;
            s.next_context += 1;
            s.contexts.insert(
                id,
                Context {
                    device,
                    primary: false,
                },
            );
            let handle = s.handle(id);
            CURRENT.with(|c| c.set(handle.addr()));
            // SAFETY: CUDA contract: valid for a CUcontext (checked non-null).
            unsafe { put(context, handle) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(context: CUcontext) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if context.is_null() {
                return Err(INVALID_VALUE);
            }
            let id = s.context_id(context.addr()).ok_or(INVALID_CONTEXT)?;
            if s.contexts[&id].primary {
                return Err(INVALID_CONTEXT);
            }
            s.free_context_memory(id);
            s.unload_context_modules(id);
            s.contexts.remove(&id);
            CURRENT.with(|c| {
                if c.get() == context.addr() {
                    c.set(0);
                }
            });
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(context: CUcontext) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if !context.is_null() {
                s.context_id(context.addr()).ok_or(INVALID_CONTEXT)?;
            }
            CURRENT.with(|c| c.set(context.addr()));
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut CUcontext) -> CUresult {
    ffi(|| {
        let current =
            with_session(|s| Ok(s.current().map_or(ptr::null_mut(), |(id, _)| s.handle(id))))?;
        // SAFETY: CUDA contract: null or valid for a CUcontext.
        unsafe { put(context, current) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    ffi(|| {
        let d = with_session(|s| Ok(s.current()?.1.device as CUdevice))?;
        // SAFETY: CUDA contract: null or valid for a CUdevice.
        unsafe { put(device, d) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut CUcontext,
    dev: CUdevice,
) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if context.is_null() {
                return Err(INVALID_VALUE);
            }
            let device = s.usable(dev)?;
            let id = device as u32 + 1;
            s.devices[device].primary_refs += 1;
            s.contexts.insert(
                id,
                Context {
                    device,
                    primary: true,
                },
            );
            // SAFETY: CUDA contract: valid for a CUcontext (checked non-null).
            unsafe { put(context, s.handle(id)) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    ffi(|| {
        with_session(|s| {
            s.device(dev)?;
            let device = dev as usize;
            let id = device as u32 + 1;
            match s.devices[device].primary_refs {
                0 => Err(INVALID_CONTEXT),
                1 => {
                    s.devices[device].primary_refs = 0;
                    s.free_context_memory(id);
                    s.unload_context_modules(id);
                    s.contexts.remove(&id);
                    Ok(())
                }
                _ => {
                    s.devices[device].primary_refs -= 1;
                    Ok(())
                }
            }
        })
    })
}
