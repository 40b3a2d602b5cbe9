//! Resolve: what each allocated device is, through the node's slice model
//! ([`crate::state::catalog`]), before its config is merged and any enforcer runs.

use tessera_api::config::{
    DeviceTarget, DeviceType, Holdings, IsolationLevel, Quantity, TimeSliceInterval,
};
use tessera_api::inventory::{Gpu, MigInstance, MigPlacement};
use tessera_api::names;
use tessera_controller::model::policy::{IsolationProvider, TimeSlice};
use tessera_controller::model::{DeviceKind, DeviceRef};

use super::claims::{ClaimError, ClaimRef, Selected};
use crate::state::catalog::Catalog;

/// What an allocated device is, resolved through the catalog.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub selected: Selected,
    pub gpu: Gpu,
    pub kind: Kind,
    pub target: DeviceTarget,
    /// The MIG mode the GPU must be in, where the driver switches it.
    pub mig_mode: Option<bool>,
}

#[derive(Debug, Clone)]
pub enum Kind {
    Whole,
    Mig {
        profile: String,
        /// The existing instance, or `None` until a dynamic one is created.
        instance: Option<MigInstance>,
        /// For dynamic MIG: what to create.
        create: Option<(u32, MigPlacement)>,
    },
    Share {
        level: IsolationLevel,
        consumed: Holdings,
        /// The node policy's time slice for Shared shares of the GPU.
        time_slice: Option<TimeSliceInterval>,
        /// Who enforces an Isolated share's limits, as published.
        provider: Option<IsolationProvider>,
    },
    /// The GPU's monitoring device (adminAccess claims only).
    Monitor,
}

/// One allocated device as the claim's allocation names it, for the
/// errors that point at it.
struct Asked<'a> {
    claim: &'a ClaimRef,
    selected: &'a Selected,
    /// Where the device is in the claim: `status.allocation.devices.results[i]`.
    field: String,
}

/// What a device is, the type its config is checked against, and what it
/// holds of its GPU.
type Shape = (Kind, DeviceType, Holdings);

/// Resolves one allocated device: its reference and GPU in the catalog ->
/// what its kind makes it -> the MIG mode its GPU must be in.
pub fn resolve(
    claim: &ClaimRef,
    selected: &Selected,
    catalog: &Catalog,
) -> Result<Resolved, ClaimError> {
    let asked = Asked {
        claim,
        selected,
        field: format!("status.allocation.devices.results[{}]", selected.index),
    };
    let (reference, gpu) = reference(&asked, catalog)?;
    let (kind, device_type, holds) = match &reference.kind {
        DeviceKind::Whole => whole(&gpu),
        DeviceKind::Mig {
            profile_id,
            profile,
            placement,
            existing,
            dynamic,
        } => {
            // A dynamic device is created for its claim, always: whatever
            // the model saw at its placement is not this claim's.
            let existing = existing.as_deref().filter(|_| !dynamic);
            mig(&asked, &gpu, (*profile_id, profile, *placement), existing)?
        }
        DeviceKind::Share {
            level,
            time_slice,
            provider,
        } => {
            let consumed = consumed_capacity(claim, selected, &asked.field)?;
            share(*level, consumed, *time_slice, *provider)
        }
        DeviceKind::Monitor => monitor(&asked, &gpu)?,
        DeviceKind::Replica {
            level,
            memory_bytes,
            cores,
            time_slice,
            provider,
            ..
        } => {
            let consumed = Holdings {
                memory_bytes: *memory_bytes,
                compute_percent: *cores,
            };
            share(*level, consumed, *time_slice, *provider)
        }
    };
    let mig_mode = mig_mode(catalog, &gpu, &kind);
    Ok(Resolved {
        selected: selected.clone(),
        gpu,
        kind,
        mig_mode,
        target: DeviceTarget {
            request: selected.request.clone(),
            device: selected.device.clone(),
            device_type,
            holds,
        },
    })
}

/// The device's reference in the catalog, and its GPU.
fn reference<'c>(asked: &Asked, catalog: &'c Catalog) -> Result<(&'c DeviceRef, Gpu), ClaimError> {
    let (claim, selected, field) = (asked.claim, asked.selected, &asked.field);
    let reference = catalog.resolve(&selected.device).ok_or_else(|| {
        ClaimError::new(
            claim,
            format!(
                "device {} of pool {} is not a device this node publishes",
                selected.device, selected.pool
            ),
        )
        .field(format!("{field}.device"))
        .fix("the GPU may have gone or the node policy changed since allocation: delete the Pod so the claim is allocated again")
    })?;
    let gpu = catalog.gpu(&reference.gpu_uuid).cloned().ok_or_else(|| {
        ClaimError::new(
            claim,
            format!(
                "GPU {} of device {} is not on this node any more",
                reference.gpu_uuid, selected.device
            ),
        )
        .field(format!("{field}.device"))
        .fix("check the GPU (tessera inventory, nvidia-smi); delete the Pod to allocate another device")
    })?;
    Ok((reference, gpu))
}

/// The whole GPU: all of its memory and compute.
fn whole(gpu: &Gpu) -> Shape {
    let holds = Holdings {
        memory_bytes: gpu.memory_bytes,
        compute_percent: 100,
    };
    (Kind::Whole, DeviceType::Gpu, holds)
}

/// A MIG device: the instance `existing` names, or the one to create
/// (profile id, profile name, placement) for the claim.
fn mig(
    asked: &Asked,
    gpu: &Gpu,
    (profile_id, profile, placement): (u32, &str, MigPlacement),
    existing: Option<&str>,
) -> Result<Shape, ClaimError> {
    let instance = (existing.map(|uuid| existing_instance(asked, gpu, uuid))).transpose()?;
    let memory_bytes = instance
        .as_ref()
        .map(|i| i.memory_bytes)
        .or_else(|| {
            gpu.mig
                .profiles()
                .iter()
                .find(|p| p.id == profile_id)
                .map(|p| p.memory_bytes)
        })
        .unwrap_or(gpu.memory_bytes);
    let create = instance.is_none().then_some((profile_id, placement));
    let kind = Kind::Mig {
        profile: profile.to_owned(),
        instance,
        create,
    };
    let holds = Holdings {
        memory_bytes,
        compute_percent: 100,
    };
    Ok((kind, DeviceType::Mig, holds))
}

/// The MIG device `uuid` on `gpu`, which must still exist.
fn existing_instance(asked: &Asked, gpu: &Gpu, uuid: &str) -> Result<MigInstance, ClaimError> {
    let found = gpu.mig.instances().iter().find(|i| i.uuid == uuid);
    found.cloned().ok_or_else(|| {
        ClaimError::new(
            asked.claim,
            format!(
                "MIG device {uuid} ({}) no longer exists on GPU {}",
                asked.selected.device, gpu.uuid
            ),
        )
        .field(format!("{}.device", asked.field))
        .fix("delete the Pod so the claim is allocated again")
    })
}

/// A share of the GPU (a consumable share or one of its replicas):
/// `consumed` of it, isolated at `level`.
fn share(
    level: IsolationLevel,
    consumed: Holdings,
    time_slice: Option<TimeSlice>,
    provider: Option<IsolationProvider>,
) -> Shape {
    let kind = Kind::Share {
        level,
        consumed,
        time_slice: policy_time_slice(level, time_slice),
        provider,
    };
    (kind, DeviceType::Share(level), consumed)
}

/// The GPU's monitoring device, which only a request with admin access
/// gets; it holds nothing.
fn monitor(asked: &Asked, gpu: &Gpu) -> Result<Shape, ClaimError> {
    let selected = asked.selected;
    if !selected.admin_access {
        return Err(ClaimError::new(
            asked.claim,
            format!(
                "device {} is the monitoring device of GPU {}, which only a request with \
                 adminAccess gets, and request `{}` does not have admin access",
                selected.device, gpu.uuid, selected.request
            ),
        )
        .field(format!("{}.adminAccess", asked.field))
        .fix(format!(
            "set `adminAccess: true` in request `{}` (its namespace needs the label \
             resource.kubernetes.io/admin-access=true), or ask for a device class that \
             selects work devices (type gpu, mig or share), then delete the Pod so the \
             claim is allocated again",
            selected.request
        )));
    }
    let holds = Holdings {
        memory_bytes: 0,
        compute_percent: 0,
    };
    Ok((Kind::Monitor, DeviceType::Monitor, holds))
}

/// The MIG mode the driver switches the GPU to for this device, where it
/// manages the GPU's mode. A monitor watches the GPU in whatever mode it is.
fn mig_mode(catalog: &Catalog, gpu: &Gpu, kind: &Kind) -> Option<bool> {
    (catalog.mig_managed(&gpu.uuid) && !matches!(kind, Kind::Monitor))
        .then_some(matches!(kind, Kind::Mig { .. }))
}

/// The slice a Shared share sets on its GPU: the node policy's, unless it
/// is the driver's default (nothing to change then).
fn policy_time_slice(
    level: IsolationLevel,
    policy: Option<TimeSlice>,
) -> Option<TimeSliceInterval> {
    if level != IsolationLevel::Shared {
        return None;
    }
    match policy? {
        TimeSlice::Default => None,
        TimeSlice::Short => Some(TimeSliceInterval::Short),
        TimeSlice::Medium => Some(TimeSliceInterval::Medium),
        TimeSlice::Long => Some(TimeSliceInterval::Long),
    }
}

fn consumed_capacity(
    claim: &ClaimRef,
    selected: &Selected,
    field: &str,
) -> Result<Holdings, ClaimError> {
    let get = |name: &str| {
        let raw = selected.consumed.get(name).ok_or_else(|| {
            ClaimError::new(
                claim,
                format!(
                    "share device {} has no consumed `{name}` capacity in its allocation",
                    selected.device
                ),
            )
            .field(format!("{field}.consumedCapacity.{name}"))
            .fix("the API server must serve consumable capacity (DRAConsumableCapacity) for share devices")
        })?;
        Quantity::parse(raw).map(Quantity::bytes).map_err(|e| {
            ClaimError::new(
                claim,
                format!("consumed capacity {raw:?} does not parse: {e}"),
            )
            .field(format!("{field}.consumedCapacity.{name}"))
        })
    };
    let memory_bytes = get(names::capacity::MEMORY)?;
    let cores = get(names::capacity::CORES)?;
    Ok(Holdings {
        memory_bytes,
        compute_percent: u32::try_from(cores.min(100)).unwrap_or(100),
    })
}

impl Resolved {
    /// The MIG device, once it exists.
    pub fn mig_instance(&self) -> Option<&MigInstance> {
        match &self.kind {
            Kind::Mig { instance, .. } => instance.as_ref(),
            _ => None,
        }
    }

    /// What the container sees: the MIG device's UUID, else the GPU's.
    pub fn visible_uuid(&self) -> &str {
        self.mig_instance().map_or(&self.gpu.uuid, |i| &i.uuid)
    }
}
