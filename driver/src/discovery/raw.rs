//! The few NVML calls nvml-wrapper 0.13 does not wrap (or wraps wrongly),
//! made through its raw bindings (`Nvml::lib()`) behind safe functions.
//!
//! - `nvmlDeviceGetGpuInstanceProfileInfoV`: the only call that gives a
//!   profile's name (the wrapper uses the unversioned call, which has none).
//! - `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: the wrapper's
//!   `possible_placements` never sets its vector's length, so it always
//!   returns no placements.
//! - `nvmlDeviceGetGpuInstanceId`, `nvmlDeviceGetComputeInstanceId`,
//!   `nvmlDeviceGetGpuInstanceById`, `nvmlGpuInstanceGetInfo`: which GPU and
//!   compute instance a MIG device is, and where its GPU instance sits.

use std::ffi::{CStr, c_char, c_uint};
use std::mem::{size_of, zeroed};
use std::ptr;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::*;
use tessera_api::inventory::MigPlacement;

/// NVML's struct version word: size in the low bits, version in the top byte.
fn struct_version<T>(version: u32) -> c_uint {
    (size_of::<T>() as c_uint) | (version << 24)
}

const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
/// NVML_ERROR_ARGUMENT_VERSION_MISMATCH, which nvml-wrapper has no variant for.
const ARGUMENT_VERSION_MISMATCH: nvmlReturn_t =
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;

fn name_of(raw: &[c_char]) -> Option<String> {
    // c_char is i8 or u8 depending on the target; reinterpret each byte.
    let bytes: Vec<u8> = raw.iter().map(|c| *c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .ok()
        .and_then(|s| s.to_str().ok())
        .and_then(super::nvml_names::from_nvml)
}

/// The name NVML gives the GPU instance profile at `index`
/// (`NVML_GPU_INSTANCE_PROFILE_*`), or `None` where this NVML cannot tell
/// (no versioned call, or neither struct version accepted).
pub fn profile_name(nvml: &Nvml, device: &Device, index: u32) -> Result<Option<String>, NvmlError> {
    let Ok(sym) = nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV.as_ref() else {
        return Ok(None);
    };
    // SAFETY: the handle belongs to `nvml`, which outlives this call.
    let handle = unsafe { device.handle() };

    // Newest first: v3, then v2. Each attempt passes a struct of exactly the
    // version its version word names.
    // SAFETY: all-zero is a valid value of these plain C structs.
    let mut v3: nvmlGpuInstanceProfileInfo_v3_t = unsafe { zeroed() };
    v3.version = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
    // SAFETY: `sym` has the C signature of nvmlDeviceGetGpuInstanceProfileInfoV;
    // the pointer is to a live v3 struct whose version word says v3 (the
    // binding types the argument as v2, the header allows any version).
    let ret = unsafe { sym(handle, index, ptr::addr_of_mut!(v3).cast()) };
    match ret {
        SUCCESS => return Ok(name_of(&v3.name)),
        ARGUMENT_VERSION_MISMATCH => {}
        other => return ignorable(other),
    }

    // SAFETY: as above.
    let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { zeroed() };
    v2.version = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
    // SAFETY: as above, with a v2 struct.
    let ret = unsafe { sym(handle, index, &mut v2) };
    match ret {
        SUCCESS => Ok(name_of(&v2.name)),
        other => ignorable(other),
    }
}

/// Errors that mean "no name from this NVML" rather than a broken GPU.
fn ignorable(code: nvmlReturn_t) -> Result<Option<String>, NvmlError> {
    match nvml_try(code) {
        Ok(()) => Ok(None),
        Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::FunctionNotFound) => {
            Ok(None)
        }
        Err(NvmlError::UnexpectedVariant(ARGUMENT_VERSION_MISMATCH)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Every placement of the GPU instance profile with id `profile_id`.
pub fn possible_placements(
    nvml: &Nvml,
    device: &Device,
    profile_id: u32,
) -> Result<Vec<MigPlacement>, NvmlError> {
    let sym = nvml_sym(
        nvml.lib()
            .nvmlDeviceGetGpuInstancePossiblePlacements_v2
            .as_ref(),
    )?;
    // SAFETY: the handle belongs to `nvml`, which outlives this call.
    let handle = unsafe { device.handle() };
    let mut count: c_uint = 0;
    // SAFETY: a null array asks only for the count, written to `count`.
    nvml_try(unsafe { sym(handle, profile_id, ptr::null_mut(), &mut count) })?;
    let mut placements = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    let mut filled = count;
    // SAFETY: the array has `count` elements and `filled` says so.
    nvml_try(unsafe { sym(handle, profile_id, placements.as_mut_ptr(), &mut filled) })?;
    placements.truncate(filled.min(count) as usize);
    Ok(placements
        .into_iter()
        .map(|p| MigPlacement {
            start: p.start,
            size: p.size,
        })
        .collect())
}

/// (GPU instance id, compute instance id) of a MIG device.
pub fn instance_ids(nvml: &Nvml, mig_device: &Device) -> Result<(u32, u32), NvmlError> {
    let gi_sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
    let ci_sym = nvml_sym(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref())?;
    // SAFETY: the handle belongs to `nvml`, which outlives this call.
    let handle = unsafe { mig_device.handle() };
    let (mut gi, mut ci): (c_uint, c_uint) = (0, 0);
    // SAFETY: both out-pointers are to live c_uints.
    nvml_try(unsafe { gi_sym(handle, &mut gi) })?;
    // SAFETY: as above.
    nvml_try(unsafe { ci_sym(handle, &mut ci) })?;
    Ok((gi, ci))
}

/// Profile id and placement of GPU instance `id` on a physical GPU.
pub fn gpu_instance(
    nvml: &Nvml,
    device: &Device,
    id: u32,
) -> Result<(u32, MigPlacement), NvmlError> {
    let by_id = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    let get_info = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    // SAFETY: the handle belongs to `nvml`, which outlives this call.
    let handle = unsafe { device.handle() };
    let mut instance: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: the out-pointer is to a live handle variable.
    nvml_try(unsafe { by_id(handle, id, &mut instance) })?;
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: nvmlGpuInstanceInfo_t = unsafe { zeroed() };
    // SAFETY: `instance` was just returned by NVML; `info` is a live struct.
    // GPU instance handles need no release.
    nvml_try(unsafe { get_info(instance, &mut info) })?;
    Ok((
        info.profileId,
        MigPlacement {
            start: info.placement.start,
            size: info.placement.size,
        },
    ))
}
