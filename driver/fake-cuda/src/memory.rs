//! Memory: what a context may allocate, and allocations.

use crate::codes::*;
use crate::{Allocation, CUdeviceptr, MIB, ffi, put, with_session};

/// Allocation granularity.
const GRANULE: u64 = 2 * MIB;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    ffi(|| {
        let (f, t) = with_session(|s| {
            let (_, ctx) = s.current()?;
            Ok((
                s.free_on(ctx.device),
                s.devices[ctx.device].physical.memory_bytes,
            ))
        })?;
        if free.is_null() || total.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: CUDA contract: both valid for a size_t (checked non-null).
        unsafe {
            put(free, f as usize)?;
            put(total, t as usize)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(address: *mut CUdeviceptr, bytes: usize) -> CUresult {
    ffi(|| {
        with_session(|s| {
            let (id, ctx) = s.current()?;
            if address.is_null() || bytes == 0 {
                return Err(INVALID_VALUE);
            }
            let rounded = (bytes as u64)
                .checked_next_multiple_of(GRANULE)
                .ok_or(OUT_OF_MEMORY)?;
            if rounded > s.free_on(ctx.device) {
                return Err(OUT_OF_MEMORY);
            }
            s.devices[ctx.device].allocated += rounded;
            s.publish_load();
            let at = s.next_address;
            s.next_address += rounded;
            s.allocations.insert(
                at,
                Allocation {
                    context: id,
                    device: ctx.device,
                    bytes: rounded,
                },
            );
            // SAFETY: CUDA contract: valid for a CUdeviceptr (checked non-null).
            unsafe { put(address, at) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(address: CUdeviceptr) -> CUresult {
    ffi(|| {
        with_session(|s| {
            s.current()?;
            let a = s.allocations.remove(&address).ok_or(INVALID_VALUE)?;
            s.devices[a.device].allocated -= a.bytes;
            s.publish_load();
            Ok(())
        })
    })
}
