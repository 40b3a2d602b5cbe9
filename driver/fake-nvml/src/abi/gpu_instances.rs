//! MIG: GPU instances.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::{ffi, gi_handle, gpu_handle, put, put_instances, with_machine, with_machine_mut};

use super::mig_mode::profile_by_id;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if gpu_instance.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (g, gi) = with_machine_mut(|m| {
            let g = m.live_gpu(device.addr())?;
            Ok((g, m.create_gpu_instance(g, profile_id, None)?))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(gpu_instance, gi_handle(g, gi)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if gpu_instance.is_null() || placement.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null and valid for the struct by contract.
        let wanted = unsafe { placement.read_unaligned() };
        let (g, gi) = with_machine_mut(|m| {
            let (g, p) = profile_by_id(m, device, profile_id)?;
            if wanted.size != p.placements.size {
                return Err(INVALID_ARGUMENT);
            }
            Ok((g, m.create_gpu_instance(g, profile_id, Some(wanted.start))?))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(gpu_instance, gi_handle(g, gi)) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    ffi(|| {
        with_machine_mut(|m| {
            let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
            let mig = m.mig_enabled_mut(g)?;
            if mig
                .gpu_instances
                .get(&gi)
                .is_some_and(|i| !i.compute_instances.is_empty())
            {
                return Err(IN_USE);
            }
            mig.gpu_instances.remove(&gi);
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if gpu_instances.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let handles = with_machine(|m| {
            let (g, p) = profile_by_id(m, device, profile_id)?;
            Ok(m.mig_enabled(g)?
                .gpu_instances
                .iter()
                .filter(|(id, i)| i.profile_id == p.id && m.instance_visible(g, **id, None))
                .map(|(id, _)| gi_handle(g, *id))
                .collect::<Vec<_>>())
        })?;
        // SAFETY: checked non-null; NVML contract on the array's length.
        unsafe { put_instances(gpu_instances, count, &handles) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let g = with_machine(|m| {
            let g = m.live_gpu(device.addr())?;
            m.mig_enabled(g)?.gpu_instances.get(&id).ok_or(NOT_FOUND)?;
            if !m.instance_visible(g, id, None) {
                return Err(NOT_FOUND);
            }
            Ok(g)
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(gpu_instance, gi_handle(g, id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let out = with_machine(|m| {
            let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
            let (inst, _) = m.gpu_instance_profile(g, gi).ok_or(INVALID_ARGUMENT)?;
            Ok(nvmlGpuInstanceInfo_t {
                device: gpu_handle(g),
                id: gi,
                profileId: inst.profile_id,
                placement: nvmlGpuInstancePlacement_t {
                    start: inst.start,
                    size: inst.size,
                },
            })
        })?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, out) }
    })
}
