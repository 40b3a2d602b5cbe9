//! The NVML GPU/compute instance calls nvml-wrapper 0.13 does not wrap, made
//! through its raw bindings (`Nvml::lib()`). Each function is one NVML call
//! (or the usual count-then-fill pair) with its safety argument; the logic
//! lives in the parent module.
//!
//! GPU and compute instance handles are plain values NVML hands out and
//! never needs released; they are only valid while the instance exists and
//! while `nvml` is initialized, which the `'nvml` lifetime of the wrappers
//! below ties them to.

use std::ffi::c_uint;
use std::marker::PhantomData;
use std::mem::zeroed;
use std::ptr;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::*;

/// A GPU instance handle, valid while `nvml` lives.
#[derive(Clone, Copy)]
pub struct GpuInstance<'nvml> {
    handle: nvmlGpuInstance_t,
    _nvml: PhantomData<&'nvml Nvml>,
}

/// A compute instance handle, valid while `nvml` lives.
#[derive(Clone, Copy)]
pub struct ComputeInstance<'nvml> {
    handle: nvmlComputeInstance_t,
    _nvml: PhantomData<&'nvml Nvml>,
}

fn gi(handle: nvmlGpuInstance_t) -> GpuInstance<'static> {
    GpuInstance {
        handle,
        _nvml: PhantomData,
    }
}

/// NVML's answer for "no such profile on this GPU" or "not in this mode":
/// such profiles are skipped, not failures.
fn absent(e: &NvmlError) -> bool {
    matches!(e, NvmlError::NotSupported | NvmlError::InvalidArg)
}

/// GPU instance profile info for `NVML_GPU_INSTANCE_PROFILE_*` `index`, or
/// `None` where the GPU has no such profile.
pub fn gpu_instance_profile(
    nvml: &Nvml,
    device: &Device,
    index: u32,
) -> Result<Option<nvmlGpuInstanceProfileInfo_t>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceProfileInfo.as_ref())?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { zeroed() };
    // SAFETY: the device handle belongs to `nvml`; `info` is a live struct
    // of the type the (unversioned) call fills.
    match nvml_try(unsafe { sym(device.handle(), index, &mut info) }) {
        Ok(()) => Ok(Some(info)),
        Err(e) if absent(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// GPU instances of profile `profile_id`; `capacity` is the profile's
/// `instanceCount`, which bounds how many can exist (NVML's contract for the
/// array).
pub fn gpu_instances<'nvml>(
    nvml: &'nvml Nvml,
    device: &Device<'nvml>,
    profile_id: u32,
    capacity: u32,
) -> Result<Vec<GpuInstance<'nvml>>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstances.as_ref())?;
    let mut handles: Vec<nvmlGpuInstance_t> = vec![ptr::null_mut(); capacity.max(1) as usize];
    let mut count: c_uint = 0;
    // SAFETY: the array has at least `instanceCount` elements, as NVML
    // requires; `count` is a live c_uint.
    nvml_try(unsafe {
        sym(
            device.handle(),
            profile_id,
            handles.as_mut_ptr(),
            &mut count,
        )
    })?;
    handles.truncate((count as usize).min(handles.len()));
    Ok(handles.into_iter().map(gi).collect())
}

pub fn gpu_instance_by_id<'nvml>(
    nvml: &'nvml Nvml,
    device: &Device<'nvml>,
    id: u32,
) -> Result<GpuInstance<'nvml>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    let mut handle: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: the device handle belongs to `nvml`; the out-pointer is live.
    nvml_try(unsafe { sym(device.handle(), id, &mut handle) })?;
    Ok(gi(handle))
}

pub fn gpu_instance_info(
    nvml: &Nvml,
    instance: GpuInstance<'_>,
) -> Result<nvmlGpuInstanceInfo_t, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: nvmlGpuInstanceInfo_t = unsafe { zeroed() };
    // SAFETY: the handle came from NVML for this session; `info` is live.
    nvml_try(unsafe { sym(instance.handle, &mut info) })?;
    Ok(info)
}

pub fn create_gpu_instance<'nvml>(
    nvml: &'nvml Nvml,
    device: &Device<'nvml>,
    profile_id: u32,
    start: u32,
    size: u32,
) -> Result<GpuInstance<'nvml>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?;
    let placement = nvmlGpuInstancePlacement_t { start, size };
    let mut handle: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: the device handle belongs to `nvml`; `placement` and the
    // out-pointer are live for the call.
    nvml_try(unsafe { sym(device.handle(), profile_id, &placement, &mut handle) })?;
    Ok(gi(handle))
}

pub fn destroy_gpu_instance(nvml: &Nvml, instance: GpuInstance<'_>) -> Result<(), NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlGpuInstanceDestroy.as_ref())?;
    // SAFETY: the handle came from NVML for this session.
    nvml_try(unsafe { sym(instance.handle) })
}

/// Compute instance profile info for `NVML_COMPUTE_INSTANCE_PROFILE_*`
/// `index` (shared engines), or `None` where the GPU instance has none.
pub fn compute_instance_profile(
    nvml: &Nvml,
    instance: GpuInstance<'_>,
    index: u32,
) -> Result<Option<nvmlComputeInstanceProfileInfo_t>, NvmlError> {
    let sym = nvml_sym(
        nvml.lib()
            .nvmlGpuInstanceGetComputeInstanceProfileInfo
            .as_ref(),
    )?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { zeroed() };
    // SAFETY: the handle came from NVML for this session; `info` is a live
    // struct of the type the (unversioned) call fills.
    let ret = unsafe {
        sym(
            instance.handle,
            index,
            NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            &mut info,
        )
    };
    match nvml_try(ret) {
        Ok(()) => Ok(Some(info)),
        Err(e) if absent(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Compute instances of compute profile `profile_id` in a GPU instance;
/// `capacity` is that profile's `instanceCount`.
pub fn compute_instances<'nvml>(
    nvml: &'nvml Nvml,
    instance: GpuInstance<'nvml>,
    profile_id: u32,
    capacity: u32,
) -> Result<Vec<ComputeInstance<'nvml>>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlGpuInstanceGetComputeInstances.as_ref())?;
    let mut handles: Vec<nvmlComputeInstance_t> = vec![ptr::null_mut(); capacity.max(1) as usize];
    let mut count: c_uint = 0;
    // SAFETY: the array has at least `instanceCount` elements, as NVML
    // requires; `count` is a live c_uint.
    nvml_try(unsafe {
        sym(
            instance.handle,
            profile_id,
            handles.as_mut_ptr(),
            &mut count,
        )
    })?;
    handles.truncate((count as usize).min(handles.len()));
    Ok(handles
        .into_iter()
        .map(|handle| ComputeInstance {
            handle,
            _nvml: PhantomData,
        })
        .collect())
}

pub fn compute_instance_info(
    nvml: &Nvml,
    instance: ComputeInstance<'_>,
) -> Result<nvmlComputeInstanceInfo_t, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlComputeInstanceGetInfo_v2.as_ref())?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: nvmlComputeInstanceInfo_t = unsafe { zeroed() };
    // SAFETY: the handle came from NVML for this session; `info` is live.
    nvml_try(unsafe { sym(instance.handle, &mut info) })?;
    Ok(info)
}

pub fn create_compute_instance<'nvml>(
    nvml: &'nvml Nvml,
    instance: GpuInstance<'nvml>,
    profile_id: u32,
) -> Result<ComputeInstance<'nvml>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlGpuInstanceCreateComputeInstance.as_ref())?;
    let mut handle: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: the handle came from NVML for this session; the out-pointer
    // is live.
    nvml_try(unsafe { sym(instance.handle, profile_id, &mut handle) })?;
    Ok(ComputeInstance {
        handle,
        _nvml: PhantomData,
    })
}

pub fn destroy_compute_instance(
    nvml: &Nvml,
    instance: ComputeInstance<'_>,
) -> Result<(), NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlComputeInstanceDestroy.as_ref())?;
    // SAFETY: the handle came from NVML for this session.
    nvml_try(unsafe { sym(instance.handle) })
}

/// (GPU instance id, compute instance id) of a MIG device handle.
pub fn mig_device_ids(nvml: &Nvml, mig_device: &Device) -> Result<(u32, u32), NvmlError> {
    let gi_sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
    let ci_sym = nvml_sym(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref())?;
    let (mut gi, mut ci): (c_uint, c_uint) = (0, 0);
    // SAFETY: the handle belongs to `nvml`; both out-pointers are live.
    unsafe {
        nvml_try(gi_sym(mig_device.handle(), &mut gi))?;
        nvml_try(ci_sym(mig_device.handle(), &mut ci))?;
    }
    Ok((gi, ci))
}
