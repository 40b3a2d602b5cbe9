//! MIG: mode, profiles, placements and MIG device handles.

use std::ffi::c_uint;
use std::ptr;

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::machine::Machine;
use crate::machine::handles::{DeviceRef, Kind};
use crate::topology::{self, Profile};
use crate::{
    ffi, fill_name, gpu_handle, handle, put, put_array, struct_version, with_machine,
    with_machine_mut,
};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current_mode: *mut c_uint,
    pending_mode: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if current_mode.is_null() || pending_mode.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (c, p) = with_machine(|m| {
            let DeviceRef::Gpu(g) = m.live_device(device.addr())? else {
                return Err(NOT_SUPPORTED);
            };
            let mig = m.mig(g)?;
            Ok((c_uint::from(mig.enabled), c_uint::from(mig.pending)))
        })?;
        // SAFETY: NVML contract: both valid for an unsigned int (checked non-null).
        unsafe {
            put(current_mode, c)?;
            put(pending_mode, p)
        }
    })
}

/// Switches MIG mode. The simulated GPU applies it at once (no reset
/// needed); turning MIG off while GPU instances exist answers IN_USE.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activation_status: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    ffi(|| {
        if activation_status.is_null() || mode > 1 {
            return Err(INVALID_ARGUMENT);
        }
        let status = with_machine_mut(|m| {
            let g = m.live_gpu(device.addr())?;
            // Hopper and newer take a new MIG mode at once; older boards
            // only at the next GPU reset (the mode stays pending, as in a
            // VM where NVML cannot reset the GPU itself).
            let immediate = matches!(
                m.gpus[g].card.model.architecture,
                topology::Architecture::Hopper | topology::Architecture::Blackwell
            );
            let mig = m.mig_mut(g)?;
            if mode == 0 && !mig.gpu_instances.is_empty() {
                return Err(IN_USE);
            }
            mig.pending = mode == 1;
            if immediate || mig.pending == mig.enabled {
                mig.enabled = mig.pending;
                Ok(SUCCESS)
            } else {
                Ok(nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED)
            }
        })?;
        // SAFETY: NVML contract: valid for a return code (checked non-null).
        unsafe { put(activation_status, status) }
    })
}

/// The GPU's profile for an `NVML_GPU_INSTANCE_PROFILE_*` index.
fn profile_by_index(m: &Machine, device: nvmlDevice_t, index: c_uint) -> Result<Profile, Ret> {
    let g = m.live_gpu(device.addr())?;
    let mig = m.mig(g)?;
    if index >= NVML_GPU_INSTANCE_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    mig.cap
        .profiles
        .iter()
        .find(|p| p.index == index)
        .cloned()
        .ok_or(NOT_SUPPORTED)
}

/// The GPU's profile with NVML profile id `id`.
pub(super) fn profile_by_id(
    m: &Machine,
    device: nvmlDevice_t,
    id: c_uint,
) -> Result<(usize, Profile), Ret> {
    let g = m.live_gpu(device.addr())?;
    let mig = m.mig(g)?;
    let p = mig.cap.profiles.iter().find(|p| p.id == id).cloned();
    Ok((g, p.ok_or(INVALID_ARGUMENT)?))
}

fn profile_info_v1(p: &Profile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: c_uint::from(p.p2p),
        sliceCount: p.slices,
        instanceCount: p.instances,
        multiprocessorCount: p.multiprocessors,
        copyEngineCount: p.engines.copy,
        decoderCount: p.engines.decoders,
        encoderCount: p.engines.encoders,
        jpegCount: p.engines.jpeg,
        ofaCount: p.engines.ofa,
        memorySizeMB: p.memory_mib,
    }
}

/// Writes a v2 or v3 profile info, whichever the caller's version word asks for.
///
/// # Safety
/// `info` is null or valid for the struct version its `version` word names.
unsafe fn put_profile_info_versioned(
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
    p: &Profile,
) -> Result<(), Ret> {
    if info.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null; both versions start with the version word.
    let version = unsafe { ptr::addr_of!((*info).version).read_unaligned() };
    let v1 = profile_info_v1(p);
    let name = format!("MIG {}", p.name);
    if version == struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2) {
        let mut out = nvmlGpuInstanceProfileInfo_v2_t {
            version,
            id: v1.id,
            isP2pSupported: v1.isP2pSupported,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            copyEngineCount: v1.copyEngineCount,
            decoderCount: v1.decoderCount,
            encoderCount: v1.encoderCount,
            jpegCount: v1.jpegCount,
            ofaCount: v1.ofaCount,
            memorySizeMB: v1.memorySizeMB,
            name: [0; 96],
        };
        fill_name(&mut out.name, &name);
        // SAFETY: the caller declared a v2 struct.
        unsafe { put(info, out) }
    } else if version == struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3) {
        let mut out = nvmlGpuInstanceProfileInfo_v3_t {
            version,
            id: v1.id,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            copyEngineCount: v1.copyEngineCount,
            decoderCount: v1.decoderCount,
            encoderCount: v1.encoderCount,
            jpegCount: v1.jpegCount,
            ofaCount: v1.ofaCount,
            memorySizeMB: v1.memorySizeMB,
            name: [0; 96],
            capabilities: if p.p2p {
                NVML_GPU_INSTANCE_PROFILE_CAPS_P2P
            } else {
                0
            },
        };
        fill_name(&mut out.name, &name);
        // SAFETY: the caller declared a v3 struct (larger than v2).
        unsafe { put(info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(), out) }
    } else {
        Err(ARGUMENT_VERSION_MISMATCH)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let p = with_machine(|m| profile_by_index(m, device, profile))?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, profile_info_v1(&p)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        let p = with_machine(|m| profile_by_index(m, device, profile))?;
        // SAFETY: NVML contract: null or valid for the version it names.
        unsafe { put_profile_info_versioned(info, &p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profile_id: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, p) = with_machine(|m| profile_by_id(m, device, profile_id))?;
        // SAFETY: NVML contract: null or valid for the version it names.
        unsafe { put_profile_info_versioned(info, &p) }
    })
}

/// Every placement of a profile, whatever MIG mode is (as NVML documents).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, p) = with_machine(|m| profile_by_id(m, device, profile_id))?;
        let items: Vec<nvmlGpuInstancePlacement_t> = p
            .placements
            .starts
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.placements.size,
            })
            .collect();
        // SAFETY: NVML contract on `placements`/`count`.
        unsafe { put_array(placements, count, &items) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| {
            let (g, p) = profile_by_id(m, device, profile_id)?;
            m.mig_enabled(g)?;
            Ok(m.gpu_instance_room(g, &p).0)
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| {
            let g = m.live_gpu(device.addr())?;
            Ok(m.mig(g)?.cap.max_devices)
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let h = with_machine(|m| {
            let g = m.live_gpu(device.addr())?;
            let mig = m.mig_enabled(g)?;
            if index >= mig.cap.max_devices {
                return Err(INVALID_ARGUMENT);
            }
            let (gi, ci) = *m.mig_devices(g).get(index as usize).ok_or(NOT_FOUND)?;
            Ok(handle(Kind::Device, g, Some(gi), Some(ci)))
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(mig_device, h) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig_device: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let is_mig =
            with_machine(|m| Ok(matches!(m.device(device.addr())?, DeviceRef::Mig { .. })))?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(is_mig_device, c_uint::from(is_mig)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let g = with_machine(|m| match m.live_device(mig_device.addr())? {
            DeviceRef::Mig { gpu, .. } => Ok(gpu),
            DeviceRef::Gpu(_) => Err(INVALID_ARGUMENT),
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(device, gpu_handle(g)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let gi = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Mig { gi, .. } => Ok(gi),
            DeviceRef::Gpu(_) => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(id, gi) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let ci = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Mig { ci, .. } => Ok(ci),
            DeviceRef::Gpu(_) => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(id, ci) }
    })
}
