//! Devices: count, ordinals, names, UUIDs, memory and attributes.

use std::ffi::{c_char, c_int};
use std::ptr;

use crate::codes::*;
use crate::{
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, CU_DEVICE_ATTRIBUTE_INTEGRATED,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, CUdevice, CUdevice_attribute, CUuuid, ffi, put,
    with_session,
};

/// The 16 bytes of a UUID string: its 32 hex digits when it is
/// `GPU-`/`MIG-` + `8-4-4-4-12` hex, else a stable hash of it.
pub fn uuid_bytes(uuid: &str) -> [u8; 16] {
    let body = uuid
        .strip_prefix("GPU-")
        .or_else(|| uuid.strip_prefix("MIG-"))
        .unwrap_or("");
    let groups: Vec<&str> = body.split('-').collect();
    let well_formed = groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()));
    let mut out = [0u8; 16];
    if well_formed {
        let hex: String = groups.concat();
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
        }
        return out;
    }
    // FNV-1a, twice with different seeds.
    for (half, seed) in [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142]
        .iter()
        .enumerate()
    {
        let mut h = *seed;
        for b in uuid.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        out[half * 8..half * 8 + 8].copy_from_slice(&h.to_be_bytes());
    }
    out
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    ffi(|| {
        let n = with_session(|s| Ok(s.devices.len() as c_int))?;
        // SAFETY: CUDA contract: null or valid for an int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    ffi(|| {
        with_session(|s| s.device(ordinal).map(|_| ()))?;
        // SAFETY: CUDA contract: null or valid for a CUdevice.
        unsafe { put(device, ordinal) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    ffi(|| {
        let text = with_session(|s| Ok(s.device(dev)?.physical.name.clone()))?;
        if name.is_null() || len <= 0 {
            return Err(INVALID_VALUE);
        }
        // Truncated to the buffer, always NUL-terminated.
        let n = text.len().min(len as usize - 1);
        // SAFETY: CUDA contract: `name` is valid for `len` bytes, and
        // `n + 1 <= len`.
        unsafe {
            ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

fn uuid_of(uuid: *mut CUuuid, dev: CUdevice, own: bool) -> CUresult {
    ffi(|| {
        let text = with_session(|s| {
            let p = &s.device(dev)?.physical;
            Ok(if own {
                p.uuid.clone()
            } else {
                p.gpu_uuid.clone()
            })
        })?;
        let bytes = uuid_bytes(&text).map(|b| b as c_char);
        // SAFETY: CUDA contract: null or valid for a CUuuid.
        unsafe { put(uuid, CUuuid { bytes }) }
    })
}

/// The physical GPU's UUID (for a MIG device, its parent's).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    uuid_of(uuid, dev, false)
}

/// The device's own UUID (for a MIG device, the MIG device's).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    uuid_of(uuid, dev, true)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    ffi(|| {
        let total = with_session(|s| Ok(s.device(dev)?.physical.memory_bytes))?;
        // SAFETY: CUDA contract: null or valid for a size_t.
        unsafe { put(bytes, total as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: CUdevice_attribute,
    dev: CUdevice,
) -> CUresult {
    ffi(|| {
        let v = with_session(|s| {
            let d = s.device(dev)?;
            let p = &d.physical;
            let v = match attribute {
                CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
                CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => d.multiprocessors as c_int,
                CU_DEVICE_ATTRIBUTE_INTEGRATED => 0,
                CU_DEVICE_ATTRIBUTE_COMPUTE_MODE => p.compute_mode as c_int,
                CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => p.pci.1 as c_int,
                CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID => p.pci.2 as c_int,
                CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID => p.pci.0 as c_int,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => p.compute_capability.0,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => p.compute_capability.1,
                _ => return Err(INVALID_VALUE),
            };
            Ok(v)
        })?;
        // SAFETY: CUDA contract: null or valid for an int.
        unsafe { put(value, v) }
    })
}
