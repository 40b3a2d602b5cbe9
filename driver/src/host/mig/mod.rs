//! Dynamic MIG and MIG mode: GPU instances created at prepare and
//! destroyed at unprepare, and the MIG mode switch on GPUs that allow it
//! without a reset.
//!
//! nvml-wrapper 0.13 does not wrap GPU/compute instance creation, so this
//! module makes those NVML calls through its raw bindings ([`raw`]) and
//! offers safe operations:
//!
//! - [`check_free`]: what occupies a placement's memory slices, if anything.
//! - [`create`]: a GPU instance of a profile at an exact placement
//!   (`nvmlDeviceCreateGpuInstanceWithPlacement`), then one compute instance
//!   spanning it (the GPU instance's largest compute profile,
//!   `nvmlGpuInstanceCreateComputeInstance`), then the MIG device's UUID.
//! - [`destroy`]: the GPU instance a claim created, identified by the ids
//!   and MIG UUID recorded after [`create`], with its compute instances (or
//!   left without them by an interrupted destroy). Something already gone
//!   is success; something else at the placement is left alone.
//! - [`list`]: every GPU instance with its compute instances and MIG UUIDs.
//! - [`mig_enabled`] / [`set_mig_mode`].
//!
//! **Nothing is adopted.** [`create`] refuses any GPU instance at or
//! overlapping the placement, even one of the same profile: NVML cannot say
//! who made an instance, so the caller records (checkpoint) the placement
//! after [`check_free`] and before [`create`], and the instance ids and MIG
//! UUID right after. Undo destroys the recorded instance only. With only
//! the placement recorded (a crash between the two writes) nothing is
//! destroyed: another actor may have made an instance there after the free
//! check, and NVML cannot tell the two apart. A [`create`] that fails after
//! creating the GPU instance destroys that GPU instance again, so a failure
//! leaves nothing behind ([`MigError::LeftBehind`] where even that fails),
//! and a failure because something else is there destroys nothing.

mod manager;
pub mod raw;
mod state;

pub use manager::NvmlMig;

use crate::sync::Locked;
use state::{
    Profile, compute_instances, compute_profiles, gpu, gpu_instances, mig_devices, mig_uuid,
    overlaps, profiles, require_mig,
};

use std::sync::Mutex;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES as INSUFFICIENT_RESOURCES;
use serde::{Deserialize, Serialize};
pub use tessera_api::inventory::MigPlacement;

/// A MIG device made of one GPU instance and one compute instance spanning
/// it, as [`create`] made (or found) it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedMig {
    pub gpu_uuid: String,
    /// NVML GPU instance profile id.
    pub profile_id: u32,
    pub placement: MigPlacement,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    /// NVML compute instance profile id of the spanning compute instance.
    pub compute_profile_id: u32,
    /// `MIG-…`, what `CUDA_VISIBLE_DEVICES`/`NVIDIA_VISIBLE_DEVICES` name.
    pub mig_uuid: String,
    /// SMs of the compute instance.
    pub multiprocessors: u32,
}

/// What [`destroy`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destroyed {
    /// The GPU instance (and its compute instances) were destroyed now.
    Destroyed,
    /// Nothing was at the placement.
    AlreadyGone,
}

/// A GPU instance as [`list`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInstanceState {
    pub gpu_instance_id: u32,
    pub profile_id: u32,
    pub placement: MigPlacement,
    pub compute_instances: Vec<ComputeInstanceState>,
}

/// A compute instance as [`list`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeInstanceState {
    pub compute_instance_id: u32,
    pub profile_id: u32,
    /// Compute slices it spans.
    pub slices: u32,
    /// The MIG device's UUID, when NVML lists the device.
    pub mig_uuid: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum MigError {
    #[error(
        "MIG on {gpu}: switching MIG mode {} would take effect only after a GPU reset \
         (NVML activation status {status}); the mode was left as it was. Fix: set \
         migModeSwitch: false for this GPU in the node policy, or switch it yourself (nvidia-smi \
         -i <gpu> -mig 0|1) while it is idle",
        if *.enabled { "on" } else { "off" }
    )]
    NeedsReset {
        gpu: String,
        enabled: bool,
        status: String,
    },
    #[error("MIG on {gpu}: no GPU with this UUID")]
    GpuNotFound { gpu: String },
    #[error(
        "MIG on {gpu}: MIG mode is off; fix: enable it (nvidia-smi -i <gpu> -mig 1, then a GPU \
         reset) or do not offer dynamic MIG devices on this GPU"
    )]
    MigDisabled { gpu: String },
    #[error("MIG on {gpu}: the GPU has no GPU instance profile with id {profile_id}")]
    UnknownProfile { gpu: String, profile_id: u32 },
    #[error(
        "MIG on {gpu}: profile {profile_id} cannot be placed at {}:{} (NVML: {error}); the \
         placement must be one the profile lists (nvidia-smi mig -lgipp)",
        placement.start, placement.size
    )]
    BadPlacement {
        gpu: String,
        profile_id: u32,
        placement: MigPlacement,
        error: NvmlError,
    },
    #[error(
        "MIG on {gpu}: memory slices {}:{} for profile {profile_id} are taken by {by}; it was not \
         created by this claim and is left alone",
        placement.start, placement.size
    )]
    Occupied {
        gpu: String,
        profile_id: u32,
        placement: MigPlacement,
        by: String,
    },
    #[error(
        "MIG on {gpu}: no room for profile {profile_id} at {}:{} (NVML: insufficient \
         resources); another GPU instance or the compute slices are in use",
        placement.start, placement.size
    )]
    NoRoom {
        gpu: String,
        profile_id: u32,
        placement: MigPlacement,
    },
    #[error(
        "MIG on {gpu}: GPU instance {gpu_instance_id} was created but its MIG device does not \
         show up in NVML's device list"
    )]
    DeviceMissing { gpu: String, gpu_instance_id: u32 },
    #[error(
        "MIG on {gpu}: {cause}; destroying the half-made {instance} failed too ({cleanup}), so it \
         is still there. Fix: once nothing uses it, destroy it (nvidia-smi mig -lgi lists it; \
         -dci then -dgi with its -gi id)"
    )]
    LeftBehind {
        gpu: String,
        instance: String,
        cause: Box<MigError>,
        cleanup: Box<MigError>,
    },
    #[error("MIG on {gpu}: {what} failed: {error}")]
    Nvml {
        gpu: String,
        what: &'static str,
        error: NvmlError,
    },
}

fn nvml_err(gpu: &str, what: &'static str) -> impl FnOnce(NvmlError) -> MigError {
    let gpu = gpu.to_owned();
    move |error| MigError::Nvml { gpu, what, error }
}

/// NVML allows concurrent instance creation, but the check-then-create of
/// [`create`] and the find-then-destroy of [`destroy`] must not interleave
/// with each other within this process.
static MUTATIONS: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    MUTATIONS.locked()
}

/// Create a GPU instance of `profile_id` at `placement` on `gpu_uuid` with
/// one compute instance spanning it; see the module documentation for what
/// happens when (part of) it already exists.
pub fn create(
    nvml: &Nvml,
    gpu_uuid: &str,
    profile_id: u32,
    placement: MigPlacement,
) -> Result<CreatedMig, MigError> {
    let _guard = lock();
    let device = gpu(nvml, gpu_uuid)?;
    require_mig(&device, gpu_uuid)?;
    let Some(profile) = profiles(nvml, &device, gpu_uuid)?
        .into_iter()
        .find(|p| p.id == profile_id)
    else {
        return Err(MigError::UnknownProfile {
            gpu: gpu_uuid.to_owned(),
            profile_id,
        });
    };

    check_free_on(nvml, &device, gpu_uuid, profile_id, placement)?;
    let instance =
        raw::create_gpu_instance(nvml, &device, profile_id, placement.start, placement.size)
            .map_err(|error| match error {
                NvmlError::InvalidArg => MigError::BadPlacement {
                    gpu: gpu_uuid.to_owned(),
                    profile_id,
                    placement,
                    error,
                },
                NvmlError::UnexpectedVariant(INSUFFICIENT_RESOURCES) => MigError::NoRoom {
                    gpu: gpu_uuid.to_owned(),
                    profile_id,
                    placement,
                },
                error => nvml_err(gpu_uuid, "creating the GPU instance")(error),
            })?;
    let gpu_instance_id = match raw::gpu_instance_info(nvml, instance) {
        Ok(info) => info.id,
        Err(e) => {
            let cause = nvml_err(gpu_uuid, "reading the new GPU instance")(e);
            let what = format!(
                "GPU instance of profile {profile_id} at {}:{}",
                placement.start, placement.size
            );
            return Err(undo_partial(nvml, gpu_uuid, instance, what, cause));
        }
    };

    match complete(
        nvml,
        &device,
        gpu_uuid,
        instance,
        gpu_instance_id,
        profile.slices,
    ) {
        Ok(c) => Ok(CreatedMig {
            gpu_uuid: gpu_uuid.to_owned(),
            profile_id,
            placement,
            gpu_instance_id,
            compute_instance_id: c.id,
            compute_profile_id: c.profile.id,
            mig_uuid: c.mig_uuid,
            multiprocessors: c.profile.multiprocessors,
        }),
        Err(e) => {
            let what = format!("GPU instance {gpu_instance_id}");
            Err(undo_partial(nvml, gpu_uuid, instance, what, e))
        }
    }
}

/// Destroys the GPU instance a failed [`create`] made, so that the failure
/// leaves nothing behind; where that fails too, the error says what is left.
fn undo_partial(
    nvml: &Nvml,
    gpu_uuid: &str,
    instance: raw::GpuInstance<'_>,
    what: String,
    cause: MigError,
) -> MigError {
    match destroy_instance(nvml, gpu_uuid, instance) {
        Ok(()) => cause,
        Err(cleanup) => MigError::LeftBehind {
            gpu: gpu_uuid.to_owned(),
            instance: what,
            cause: Box::new(cause),
            cleanup: Box::new(cleanup),
        },
    }
}

impl MigError {
    /// Whether the failed call left the GPU as it was. Only a [`create`]
    /// whose own cleanup failed leaves something.
    pub fn made_nothing(&self) -> bool {
        !matches!(self, MigError::LeftBehind { .. })
    }
}

/// Fails with [`MigError::Occupied`] if any GPU instance sits on the memory
/// slices of `placement`.
pub fn check_free(
    nvml: &Nvml,
    gpu_uuid: &str,
    profile_id: u32,
    placement: MigPlacement,
) -> Result<(), MigError> {
    let _guard = lock();
    let device = gpu(nvml, gpu_uuid)?;
    require_mig(&device, gpu_uuid)?;
    check_free_on(nvml, &device, gpu_uuid, profile_id, placement)
}

fn check_free_on(
    nvml: &Nvml,
    device: &Device,
    gpu_uuid: &str,
    profile_id: u32,
    placement: MigPlacement,
) -> Result<(), MigError> {
    match gpu_instances(nvml, device, gpu_uuid)?
        .into_iter()
        .find(|g| overlaps(g.placement, placement))
    {
        None => Ok(()),
        Some(g) => Err(MigError::Occupied {
            gpu: gpu_uuid.to_owned(),
            profile_id,
            placement,
            by: format!(
                "GPU instance {} (profile {} at {}:{})",
                g.id, g.profile_id, g.placement.start, g.placement.size
            ),
        }),
    }
}

/// The spanning compute instance of a GPU instance and its MIG device.
struct Completed {
    id: u32,
    profile: Profile,
    mig_uuid: String,
}

/// Create the compute instance spanning a new GPU instance of `gi_slices`
/// compute slices, and find its MIG device.
fn complete<'n>(
    nvml: &'n Nvml,
    device: &Device<'n>,
    gpu_uuid: &str,
    instance: raw::GpuInstance<'n>,
    gpu_instance_id: u32,
    gi_slices: u32,
) -> Result<Completed, MigError> {
    // The full compute profile: the most slices (never more than the GPU
    // instance has); among equals (a revision of the same size) the lowest id.
    let full = compute_profiles(nvml, instance, gpu_uuid)?
        .into_iter()
        .filter(|p| p.slices <= gi_slices.max(1))
        .min_by_key(|p| (std::cmp::Reverse(p.slices), p.id));
    let Some(profile) = full else {
        return Err(MigError::Nvml {
            gpu: gpu_uuid.to_owned(),
            what: "finding a compute instance profile for the GPU instance",
            error: NvmlError::NotSupported,
        });
    };
    let ci = raw::create_compute_instance(nvml, instance, profile.id)
        .map_err(nvml_err(gpu_uuid, "creating the compute instance"))?;
    let id = raw::compute_instance_info(nvml, ci)
        .map_err(nvml_err(gpu_uuid, "reading the new compute instance"))?
        .id;
    let mig_uuid = mig_uuid(&mig_devices(nvml, device, gpu_uuid)?, gpu_instance_id, id)
        .ok_or_else(|| MigError::DeviceMissing {
            gpu: gpu_uuid.to_owned(),
            gpu_instance_id,
        })?;
    Ok(Completed {
        id,
        profile,
        mig_uuid,
    })
}

/// Destroy every compute instance of a GPU instance, then the GPU instance.
fn destroy_instance(
    nvml: &Nvml,
    gpu_uuid: &str,
    instance: raw::GpuInstance<'_>,
) -> Result<(), MigError> {
    for ci in compute_instances(nvml, instance, gpu_uuid)? {
        match raw::destroy_compute_instance(nvml, ci.handle) {
            // Gone between listing and destroying.
            Ok(()) | Err(NvmlError::NotFound | NvmlError::InvalidArg) => {}
            Err(e) => return Err(nvml_err(gpu_uuid, "destroying a compute instance")(e)),
        }
    }
    match raw::destroy_gpu_instance(nvml, instance) {
        Ok(()) | Err(NvmlError::NotFound) => Ok(()),
        Err(e) => Err(nvml_err(gpu_uuid, "destroying the GPU instance")(e)),
    }
}

/// The GPU instance [`destroy`] may remove: as recorded after [`create`]
/// made it. Its GPU instance id and the MIG UUID of its compute instance
/// must both match, which no instance made by someone else does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded<'a> {
    pub gpu_instance_id: u32,
    pub mig_uuid: &'a str,
}

/// Destroy the GPU instance of `profile_id` at `placement` on `gpu_uuid`
/// that `recorded` identifies, with its compute instances. Nothing there,
/// or only something that is not it, is [`Destroyed::AlreadyGone`]: it is
/// left alone.
pub fn destroy(
    nvml: &Nvml,
    gpu_uuid: &str,
    profile_id: u32,
    placement: MigPlacement,
    recorded: Recorded<'_>,
) -> Result<Destroyed, MigError> {
    let _guard = lock();
    let device = match gpu(nvml, gpu_uuid) {
        Ok(d) => d,
        // The GPU is gone (or was never here): so is anything on it.
        Err(MigError::GpuNotFound { .. }) => return Ok(Destroyed::AlreadyGone),
        Err(e) => return Err(e),
    };
    if require_mig(&device, gpu_uuid).is_err() {
        // With MIG off no GPU instance can exist.
        return Ok(Destroyed::AlreadyGone);
    }
    let found = gpu_instances(nvml, &device, gpu_uuid)?
        .into_iter()
        .find(|g| g.placement == placement && g.profile_id == profile_id);
    let Some(g) = found else {
        return Ok(Destroyed::AlreadyGone);
    };
    // Ours: the recorded GPU instance holding the recorded MIG device, or
    // holding nothing any more (a destroy interrupted between the compute
    // instance and the GPU instance).
    let ours = g.id == recorded.gpu_instance_id
        && (compute_instances(nvml, g.handle, gpu_uuid)?.is_empty()
            || mig_devices(nvml, &device, gpu_uuid)?
                .iter()
                .any(|d| d.gpu_instance_id == g.id && d.uuid == recorded.mig_uuid));
    if !ours {
        return Ok(Destroyed::AlreadyGone);
    }
    destroy_instance(nvml, gpu_uuid, g.handle)?;
    Ok(Destroyed::Destroyed)
}

/// Whether MIG mode is on now (`false` on GPUs without MIG).
pub fn mig_enabled(nvml: &Nvml, gpu_uuid: &str) -> Result<bool, MigError> {
    let device = gpu(nvml, gpu_uuid)?;
    match device.mig_mode() {
        Ok(mode) => Ok(mode.current == 1),
        Err(NvmlError::NotSupported) => Ok(false),
        Err(e) => Err(nvml_err(gpu_uuid, "reading the MIG mode")(e)),
    }
}

/// Switch MIG mode so that it is in effect now. Where the GPU reports the
/// new mode only as pending (it needs a reset: Ampere, or a GPU in use) the
/// pending mode is put back and the call fails, so the GPU is left as it
/// was.
pub fn set_mig_mode(nvml: &Nvml, gpu_uuid: &str, enabled: bool) -> Result<(), MigError> {
    let _guard = lock();
    let device = gpu(nvml, gpu_uuid)?;
    let before = device
        .mig_mode()
        .map_err(nvml_err(gpu_uuid, "reading the MIG mode"))?;
    let want = u32::from(enabled);
    if before.current == want {
        return Ok(());
    }
    let status = device
        .set_mig_mode(enabled)
        .map_err(nvml_err(gpu_uuid, "switching the MIG mode"))?;
    let after = device
        .mig_mode()
        .map_err(nvml_err(gpu_uuid, "reading the MIG mode"))?;
    if after.current == want {
        return Ok(());
    }
    let _ = device.set_mig_mode(before.current == 1);
    Err(MigError::NeedsReset {
        gpu: gpu_uuid.to_owned(),
        enabled,
        status: format!("{status:?}"),
    })
}

/// Every GPU instance on `gpu_uuid` with its compute instances and MIG
/// UUIDs, ordered by GPU instance id. A GPU with MIG off has none.
pub fn list(nvml: &Nvml, gpu_uuid: &str) -> Result<Vec<GpuInstanceState>, MigError> {
    let device = gpu(nvml, gpu_uuid)?;
    if require_mig(&device, gpu_uuid).is_err() {
        return Ok(Vec::new());
    }
    let devices = mig_devices(nvml, &device, gpu_uuid)?;
    let mut out = Vec::new();
    for g in gpu_instances(nvml, &device, gpu_uuid)? {
        let compute_instances = compute_instances(nvml, g.handle, gpu_uuid)?
            .into_iter()
            .map(|c| ComputeInstanceState {
                compute_instance_id: c.id,
                profile_id: c.profile_id,
                slices: c.slices,
                mig_uuid: mig_uuid(&devices, g.id, c.id),
            })
            .collect();
        out.push(GpuInstanceState {
            gpu_instance_id: g.id,
            profile_id: g.profile_id,
            placement: g.placement,
            compute_instances,
        });
    }
    Ok(out)
}
