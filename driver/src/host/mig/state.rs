//! What NVML says is on a GPU: its GPU and compute instance profiles, the
//! instances that exist and their MIG devices, read through the raw
//! bindings.

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT, NVML_GPU_INSTANCE_PROFILE_COUNT,
};

use super::{MigError, MigPlacement, nvml_err, raw};

pub(super) fn gpu<'n>(nvml: &'n Nvml, gpu_uuid: &str) -> Result<Device<'n>, MigError> {
    match nvml.device_by_uuid(gpu_uuid) {
        Ok(d) => Ok(d),
        Err(NvmlError::NotFound | NvmlError::InvalidArg) => Err(MigError::GpuNotFound {
            gpu: gpu_uuid.to_owned(),
        }),
        Err(e) => Err(nvml_err(gpu_uuid, "looking the GPU up")(e)),
    }
}

pub(super) fn require_mig(device: &Device, gpu_uuid: &str) -> Result<(), MigError> {
    match device.mig_mode() {
        Ok(mode) if mode.current == 1 => Ok(()),
        Ok(_) | Err(NvmlError::NotSupported) => Err(MigError::MigDisabled {
            gpu: gpu_uuid.to_owned(),
        }),
        Err(e) => Err(nvml_err(gpu_uuid, "reading the MIG mode")(e)),
    }
}

/// A GPU or compute instance profile of NVML's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Profile {
    pub(super) id: u32,
    /// Compute slices.
    pub(super) slices: u32,
    /// How many can exist (bounds NVML's list arrays).
    pub(super) capacity: u32,
    pub(super) multiprocessors: u32,
}

/// A GPU instance that exists.
pub(super) struct GpuInstanceRow<'n> {
    pub(super) handle: raw::GpuInstance<'n>,
    pub(super) id: u32,
    pub(super) profile_id: u32,
    pub(super) placement: MigPlacement,
}

/// A compute instance that exists.
pub(super) struct ComputeInstanceRow<'n> {
    pub(super) handle: raw::ComputeInstance<'n>,
    pub(super) id: u32,
    pub(super) profile_id: u32,
    pub(super) slices: u32,
}

/// A MIG device NVML lists on the GPU.
pub(super) struct MigDevice {
    pub(super) gpu_instance_id: u32,
    pub(super) compute_instance_id: u32,
    pub(super) uuid: String,
}

/// GPU instance profiles of the GPU.
pub(super) fn profiles(
    nvml: &Nvml,
    device: &Device,
    gpu_uuid: &str,
) -> Result<Vec<Profile>, MigError> {
    distinct_profiles(NVML_GPU_INSTANCE_PROFILE_COUNT, |index| {
        let info = raw::gpu_instance_profile(nvml, device, index)
            .map_err(nvml_err(gpu_uuid, "reading GPU instance profiles"))?;
        Ok(info.map(|info| Profile {
            id: info.id,
            slices: info.sliceCount,
            capacity: info.instanceCount,
            multiprocessors: info.multiprocessorCount,
        }))
    })
}

/// The profiles `read` finds at indices `0..count`, each id once (the first).
fn distinct_profiles(
    count: u32,
    mut read: impl FnMut(u32) -> Result<Option<Profile>, MigError>,
) -> Result<Vec<Profile>, MigError> {
    let mut out: Vec<Profile> = Vec::new();
    for index in 0..count {
        if let Some(p) = read(index)?
            && !out.iter().any(|o| o.id == p.id)
        {
            out.push(p);
        }
    }
    Ok(out)
}

/// Every GPU instance, by id.
pub(super) fn gpu_instances<'n>(
    nvml: &'n Nvml,
    device: &Device<'n>,
    gpu_uuid: &str,
) -> Result<Vec<GpuInstanceRow<'n>>, MigError> {
    let mut out = Vec::new();
    for profile in profiles(nvml, device, gpu_uuid)? {
        let handles = raw::gpu_instances(nvml, device, profile.id, profile.capacity)
            .map_err(nvml_err(gpu_uuid, "listing GPU instances"))?;
        for handle in handles {
            let info = raw::gpu_instance_info(nvml, handle)
                .map_err(nvml_err(gpu_uuid, "reading a GPU instance"))?;
            out.push(GpuInstanceRow {
                handle,
                id: info.id,
                profile_id: info.profileId,
                placement: MigPlacement {
                    start: info.placement.start,
                    size: info.placement.size,
                },
            });
        }
    }
    out.sort_by_key(|g| g.id);
    Ok(out)
}

/// Compute instance profiles of a GPU instance.
pub(super) fn compute_profiles(
    nvml: &Nvml,
    instance: raw::GpuInstance<'_>,
    gpu_uuid: &str,
) -> Result<Vec<Profile>, MigError> {
    distinct_profiles(NVML_COMPUTE_INSTANCE_PROFILE_COUNT, |index| {
        let info = raw::compute_instance_profile(nvml, instance, index)
            .map_err(nvml_err(gpu_uuid, "reading compute instance profiles"))?;
        Ok(info.map(|info| Profile {
            id: info.id,
            slices: info.sliceCount,
            capacity: info.instanceCount,
            multiprocessors: info.multiprocessorCount,
        }))
    })
}

/// Compute instances of a GPU instance, by id.
pub(super) fn compute_instances<'n>(
    nvml: &'n Nvml,
    instance: raw::GpuInstance<'n>,
    gpu_uuid: &str,
) -> Result<Vec<ComputeInstanceRow<'n>>, MigError> {
    let mut out = Vec::new();
    for profile in compute_profiles(nvml, instance, gpu_uuid)? {
        let handles = raw::compute_instances(nvml, instance, profile.id, profile.capacity)
            .map_err(nvml_err(gpu_uuid, "listing compute instances"))?;
        for handle in handles {
            let info = raw::compute_instance_info(nvml, handle)
                .map_err(nvml_err(gpu_uuid, "reading a compute instance"))?;
            out.push(ComputeInstanceRow {
                handle,
                id: info.id,
                profile_id: info.profileId,
                slices: profile.slices,
            });
        }
    }
    out.sort_by_key(|c| c.id);
    Ok(out)
}

/// The GPU's MIG devices as NVML lists them.
pub(super) fn mig_devices(
    nvml: &Nvml,
    device: &Device,
    gpu_uuid: &str,
) -> Result<Vec<MigDevice>, MigError> {
    // nvmlDeviceGetMaxMigDeviceCount: the bound on MIG device indices.
    let max = device
        .mig_device_count()
        .map_err(nvml_err(gpu_uuid, "reading the MIG device count"))?;
    let mut out = Vec::new();
    for index in 0..max {
        let mig = match device.mig_device_by_index(index) {
            Ok(m) => m,
            // Indices past the last device.
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => return Err(nvml_err(gpu_uuid, "listing MIG devices")(e)),
        };
        let (gpu_instance_id, compute_instance_id) = raw::mig_device_ids(nvml, &mig)
            .map_err(nvml_err(gpu_uuid, "reading a MIG device's instance ids"))?;
        let uuid = mig
            .uuid()
            .map_err(nvml_err(gpu_uuid, "reading a MIG device's UUID"))?;
        out.push(MigDevice {
            gpu_instance_id,
            compute_instance_id,
            uuid,
        });
    }
    Ok(out)
}

pub(super) fn mig_uuid(
    devices: &[MigDevice],
    gpu_instance_id: u32,
    compute_instance_id: u32,
) -> Option<String> {
    devices
        .iter()
        .find(|d| {
            d.gpu_instance_id == gpu_instance_id && d.compute_instance_id == compute_instance_id
        })
        .map(|d| d.uuid.clone())
}

pub(super) fn overlaps(a: MigPlacement, b: MigPlacement) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}
