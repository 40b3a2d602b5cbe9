//! MIG: compute instances.

use std::ffi::c_uint;
use std::ptr;

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::machine::Machine;
use crate::machine::placements::{
    compute_instance_sizes, compute_placements, compute_profile_slices,
};
use crate::topology::Profile;
use crate::{
    ci_handle, ffi, fill_name, gi_handle, gpu_handle, put, put_array, put_instances,
    struct_version, with_machine, with_machine_mut,
};

/// Compute instance profile info for a GPU instance, as
/// (gpu, gi, slices, GPU instance profile).
fn compute_profile(
    m: &Machine,
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
) -> Result<(usize, u32, u32, Profile), Ret> {
    let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
    if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
        return Err(INVALID_ARGUMENT);
    }
    if profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    let slices = compute_profile_slices(profile).ok_or(NOT_SUPPORTED)?;
    let (_, p) = m.gpu_instance_profile(g, gi).ok_or(INVALID_ARGUMENT)?;
    if !compute_instance_sizes(p.slices).contains(&slices) {
        return Err(NOT_SUPPORTED);
    }
    Ok((g, gi, slices, p.clone()))
}

fn compute_profile_info(
    profile_id: u32,
    slices: u32,
    p: &Profile,
) -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        id: profile_id,
        sliceCount: slices,
        instanceCount: p.slices / slices,
        multiprocessorCount: p.multiprocessors * slices / p.slices.max(1),
        sharedCopyEngineCount: p.engines.copy,
        sharedDecoderCount: p.engines.decoders,
        sharedEncoderCount: p.engines.encoders,
        sharedJpegCount: p.engines.jpeg,
        sharedOfaCount: p.engines.ofa,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, _, slices, p) =
            with_machine(|m| compute_profile(m, gpu_instance, profile, eng_profile))?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, compute_profile_info(profile, slices, &p)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        if info.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (_, _, slices, p) =
            with_machine(|m| compute_profile(m, gpu_instance, profile, eng_profile))?;
        let v1 = compute_profile_info(profile, slices, &p);
        let name = if slices == p.slices {
            format!("MIG {}", p.name)
        } else {
            format!("MIG {slices}c.{}", p.name)
        };
        // SAFETY: non-null; both versions start with the version word.
        let version = unsafe { ptr::addr_of!((*info).version).read_unaligned() };
        let mut v2 = nvmlComputeInstanceProfileInfo_v2_t {
            version,
            id: v1.id,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            sharedCopyEngineCount: v1.sharedCopyEngineCount,
            sharedDecoderCount: v1.sharedDecoderCount,
            sharedEncoderCount: v1.sharedEncoderCount,
            sharedJpegCount: v1.sharedJpegCount,
            sharedOfaCount: v1.sharedOfaCount,
            name: [0; 96],
        };
        fill_name(&mut v2.name, &name);
        if version == struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) {
            // SAFETY: the caller declared a v2 struct.
            unsafe { put(info, v2) }
        } else if version == struct_version::<nvmlComputeInstanceProfileInfo_v3_t>(3) {
            let v3 = nvmlComputeInstanceProfileInfo_v3_t {
                version,
                id: v2.id,
                sliceCount: v2.sliceCount,
                instanceCount: v2.instanceCount,
                multiprocessorCount: v2.multiprocessorCount,
                sharedCopyEngineCount: v2.sharedCopyEngineCount,
                sharedDecoderCount: v2.sharedDecoderCount,
                sharedEncoderCount: v2.sharedEncoderCount,
                sharedJpegCount: v2.sharedJpegCount,
                sharedOfaCount: v2.sharedOfaCount,
                name: v2.name,
                capabilities: 0,
            };
            // SAFETY: the caller declared a v3 struct.
            unsafe { put(info.cast::<nvmlComputeInstanceProfileInfo_v3_t>(), v3) }
        } else {
            Err(ARGUMENT_VERSION_MISMATCH)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| {
            let (g, gi, slices, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            Ok(m.compute_instance_room(g, gi, slices).len() as c_uint)
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placements: *mut nvmlComputeInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, _, slices, p) = with_machine(|m| compute_profile(m, gpu_instance, profile_id, 0))?;
        let items: Vec<nvmlComputeInstancePlacement_t> = compute_placements(p.slices, slices)
            .into_iter()
            .map(|start| nvmlComputeInstancePlacement_t {
                start,
                size: slices,
            })
            .collect();
        // SAFETY: NVML contract on `placements`/`count`.
        unsafe { put_array(placements, count, &items) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if compute_instance.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (g, gi, ci) = with_machine_mut(|m| {
            let (g, gi, _, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            Ok((g, gi, m.create_compute_instance(g, gi, profile_id, None)?))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(compute_instance, ci_handle(g, gi, ci)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placement: *const nvmlComputeInstancePlacement_t,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if compute_instance.is_null() || placement.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null and valid for the struct by contract.
        let wanted = unsafe { placement.read_unaligned() };
        let (g, gi, ci) = with_machine_mut(|m| {
            let (g, gi, slices, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            if wanted.size != slices {
                return Err(INVALID_ARGUMENT);
            }
            Ok((
                g,
                gi,
                m.create_compute_instance(g, gi, profile_id, Some(wanted.start))?,
            ))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(compute_instance, ci_handle(g, gi, ci)) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(
    compute_instance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        with_machine_mut(|m| {
            let (g, gi, ci) = m.compute_instance_handle(compute_instance.addr())?;
            let mig = m.mig_enabled_mut(g)?;
            if let Some(inst) = mig.gpu_instances.get_mut(&gi) {
                inst.compute_instances.remove(&ci);
            }
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if compute_instances.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let handles = with_machine(|m| {
            let (g, gi, _, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            let (inst, _) = m.gpu_instance_profile(g, gi).ok_or(INVALID_ARGUMENT)?;
            Ok(inst
                .compute_instances
                .iter()
                .filter(|(id, c)| {
                    c.profile_id == profile_id && m.instance_visible(g, gi, Some(**id))
                })
                .map(|(id, _)| ci_handle(g, gi, *id))
                .collect::<Vec<_>>())
        })?;
        // SAFETY: checked non-null; NVML contract on the array's length.
        unsafe { put_instances(compute_instances, count, &handles) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: nvmlGpuInstance_t,
    id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let (g, gi) = with_machine(|m| {
            let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
            m.compute_instance(g, gi, id).ok_or(NOT_FOUND)?;
            Ok((g, gi))
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(compute_instance, ci_handle(g, gi, id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let out = with_machine(|m| {
            let (g, gi, ci) = m.compute_instance_handle(compute_instance.addr())?;
            let c = m.compute_instance(g, gi, ci).ok_or(INVALID_ARGUMENT)?;
            Ok(nvmlComputeInstanceInfo_t {
                device: gpu_handle(g),
                gpuInstance: gi_handle(g, gi),
                id: ci,
                profileId: c.profile_id,
                placement: nvmlComputeInstancePlacement_t {
                    start: c.start,
                    size: c.slices,
                },
            })
        })?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, out) }
    })
}
