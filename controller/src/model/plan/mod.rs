//! Per-GPU decisions: which devices a GPU offers, given its MIG state, the
//! node policy and what the API server can represent.
//!
//! # MIG state and mode switching
//!
//! Whole-GPU and share devices need MIG mode off; MIG devices need it on.
//! The counters guarantee that when a device of one mode is allocated nothing
//! of another mode is, so the driver may switch MIG mode at prepare time,
//! but only where that needs no GPU reset (Hopper and newer; Ampere needs
//! a reset) and policy allows it (`migModeSwitch`). Hence, in the full model:
//!
//! | MIG state                     | whole + shares         | dynamic MIG       |
//! |-------------------------------|------------------------|-------------------|
//! | not supported (T4, L4)        | yes                    | no                |
//! | disabled                      | yes                    | if switchable     |
//! | enabled, no foreign instances | if switchable          | yes               |
//! | enabled, foreign instances    | no                     | yes, not overlapping them |
//!
//! "Foreign" instances are MIG devices that exist but were not created by
//! Tessera for a claim (an operator made them, or `nvidia-smi` did): they are
//! published as static MIG devices, without counters. Nothing may be
//! published that would double-book them physically: no whole GPU, no share
//! devices, and no dynamic placement that overlaps one of their memory
//! slices. Instances Tessera created for claims (passed in by the caller as
//! "owned") are not foreign: they are the allocated dynamic device itself,
//! published unchanged, so creating one does not rewrite the slice.
//!
//! # Held devices
//!
//! Devices a claim holds (passed in as "held": allocated claims and the
//! node's checkpoint) stay published under their names when the policy, the
//! inventory or the API server's capabilities change, because dropping an
//! allocated device lets the scheduler over-commit (kubernetes#140806), and
//! nothing is published beside them that could double-book their GPU. A
//! held name is resolved against what the GPU could publish in any model
//! (`super::held`); what it stands for decides the GPU:
//!
//! | model  | held on the GPU | published on the GPU |
//! |--------|-----------------|----------------------|
//! | static | nothing (no owned instance) | the policy's static mode |
//! | static | devices of one use (whole, MIG, one share level) | that use, overriding `static.mode` (noted) |
//! | static | whole GPU | `gpu-<n>`, nothing else |
//! | static | MIG (held placements, held instances, owned instances) | held placements and owned instances as dynamic devices without counters, existing instances not overlapping a held placement |
//! | static | replicas `gpu-<n>-<level>-<i>`, all below `static.replicas` | the replica layout `0..replicas` of that level |
//! | static | replicas beyond `static.replicas` | only the held replicas (noted) |
//! | static | share device `gpu-<n>-<level>`, consumable capacity served | that share device (multi-allocatable, no counters), nothing else |
//! | static | share device, no consumable capacity | nothing at all: it cannot be represented (noted) |
//! | static | several uses (only after odd histories) | only the held devices that can be represented (noted) |
//! | full   | replicas | only the held devices, without counters, no counter set (noted) |
//! | full   | anything else | the full model; held devices also where MIG state or policy would not offer them (noted), their counters exclude the rest |
//!
//! In the full model a held whole GPU or share device published with
//! counters needs no special case: the scheduler charges the counters of
//! every allocated device as the device is published now (also one
//! allocated before it had counters), so everything else on the GPU no
//! longer fits. Pre-existing instances have no counters, so one that
//! overlaps a held device (a held placement, or any instance beside a held
//! whole GPU or share) is not published while it is not held itself.
//!
//! Held names that stand for nothing any more are not published, with a
//! note: a MIG instance device whose instance is gone and whose name is not
//! a placement of the GPU (a `-ci<id>` compute-instance device), a profile
//! the GPU no longer lists, a GPU that left the inventory (see
//! [`super::SliceModel::build`]). A held name that is a placement is kept as
//! that placement even when no instance exists: by name, a dynamic device
//! not created yet and an operator's instance that went cannot be told
//! apart, and the placement occupies exactly the memory slices the instance
//! did.

mod context;
mod full;
mod only_held;
mod static_mode;

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::Device;
use tessera_api::inventory::{Gpu, Inventory, Mig, MigInstance, MigPlacement, MigProfile};

use super::counters::GpuCounters;
use super::devices::{self, DeviceKind, DeviceRef, GpuFacts, IsolationLevel, MigSpec};
use super::held::HeldOnGpu;
use super::naming;
use super::policy::{GpuPolicy, IsolationProvider, Mode};

pub use full::plan_full;
pub use static_mode::plan_static;

/// Inputs for one GPU.
pub struct GpuInput<'a> {
    pub inventory: &'a Inventory,
    pub gpu: &'a Gpu,
    pub index: u32,
    pub policy: GpuPolicy,
    pub owned_mig: &'a BTreeSet<String>,
    pub held: &'a BTreeSet<String>,
}

/// One device to publish and what it stands for.
pub struct Planned {
    pub device: Device,
    pub reference: DeviceRef,
}

/// Everything one GPU publishes.
pub struct GpuOutput {
    pub index: u32,
    pub counters: Option<GpuCounters>,
    pub devices: Vec<Planned>,
    /// The driver switches this GPU's MIG mode at prepare (see the module
    /// docs): devices of both modes may be published for it.
    pub mig_managed: bool,
}

/// Architectures whose MIG mode can change without a GPU reset.
pub fn mig_switch_without_reset(architecture: &str) -> bool {
    matches!(
        architecture.to_ascii_lowercase().as_str(),
        "hopper" | "blackwell"
    )
}

/// The first compute capability (Volta) on which MPS gives each client an
/// address space of its own and applies execution and memory limits to it.
pub const MPS_ISOLATION_SINCE: (u32, u32) = (7, 0);

/// Why `gpu` gets no Isolated shares served by MPS, where it gets none:
/// before Volta MPS clients share one address space and run without
/// limits, so an "Isolated" share there would isolate nothing. A compute
/// capability that does not parse says nothing either way.
pub fn mps_isolation_unsupported(gpu: &Gpu) -> Option<String> {
    let (major, minor) = gpu.cuda_compute_capability.trim().split_once('.')?;
    let capability = (major.parse::<u32>().ok()?, minor.parse::<u32>().ok()?);
    (capability < MPS_ISOLATION_SINCE).then(|| {
        format!(
            "no Isolated shares: compute capability {}.{} is before Volta ({}.{}), where MPS \
             gives its clients neither address spaces of their own nor limits",
            capability.0, capability.1, MPS_ISOLATION_SINCE.0, MPS_ISOLATION_SINCE.1
        )
    })
}

/// What both planners know about one GPU before deciding.
struct Context<'a> {
    facts: GpuFacts,
    /// Instances Tessera created for claims (dynamic devices that exist).
    owned: Vec<&'a MigInstance>,
    /// Every other existing instance.
    foreign: Vec<&'a MigInstance>,
    /// The devices of the foreign instances, by the names they are
    /// published under (see [`context::instance_devices`]).
    foreign_devices: Vec<(String, &'a MigInstance)>,
    held: HeldOnGpu<'a>,
}

impl<'a> GpuInput<'a> {
    /// Whether the driver may switch this GPU's MIG mode at prepare.
    fn switchable(&self) -> bool {
        !matches!(self.gpu.mig, Mig::NotSupported)
            && self.policy.mig_mode_switch
            && mig_switch_without_reset(&self.gpu.architecture)
    }

    /// Why this GPU offers no Isolated shares although the policy allows
    /// them: the policy's provider is MPS and the GPU predates Volta.
    fn isolated_refused(&self) -> Option<String> {
        if self.policy.isolation_provider != IsolationProvider::Mps {
            return None;
        }
        mps_isolation_unsupported(self.gpu)
    }

    fn reference(&self, kind: DeviceKind) -> DeviceRef {
        DeviceRef {
            gpu_uuid: self.gpu.uuid.clone(),
            gpu_index: self.index,
            kind,
        }
    }

    fn profile_of(&self, instance: &MigInstance) -> Option<&'a MigProfile> {
        self.gpu
            .mig
            .profiles()
            .iter()
            .find(|p| p.id == instance.profile_id && p.placements.contains(&instance.placement))
    }

    /// A dynamic MIG device: a placement, created at prepare, or the
    /// instance Tessera created for it (`existing`). Without counters in
    /// static mode and where a GPU publishes only its held devices.
    fn dynamic(
        &self,
        facts: &GpuFacts,
        profile: &MigProfile,
        placement: MigPlacement,
        existing: Option<String>,
        counters: Option<&GpuCounters>,
    ) -> Planned {
        let name = naming::mig_device(self.index, &profile.name, placement.start);
        Planned {
            device: devices::mig(
                &name,
                self.gpu,
                facts,
                &MigSpec::from_profile(profile),
                counters.map(|c| c.mig(profile, placement)),
            ),
            reference: self.reference(DeviceKind::Mig {
                profile_id: profile.id,
                profile: profile.name.clone(),
                placement,
                existing,
                dynamic: true,
            }),
        }
    }

    /// Replica `index` of `replicas` of `level`.
    fn replica(&self, facts: &GpuFacts, level: IsolationLevel, i: u32, replicas: u32) -> Planned {
        let name = naming::replica_device(self.index, level.slug(), i);
        let (provider, time_slice) = match share_kind(level, &self.policy) {
            DeviceKind::Share {
                provider,
                time_slice,
                ..
            } => (provider, time_slice),
            _ => (None, None),
        };
        Planned {
            device: devices::replica(&name, self.gpu, facts, level, &self.policy, replicas),
            reference: self.reference(DeviceKind::Replica {
                level,
                index: i,
                replicas,
                memory_bytes: devices::replica_memory(
                    self.gpu,
                    replicas,
                    devices::server_reserve(level, &self.policy),
                ),
                cores: devices::replica_cores(replicas),
                provider,
                time_slice,
            }),
        }
    }
}

/// The GPU's monitoring device (every model, whatever is held: it consumes
/// nothing, so it can double-book nothing).
pub fn monitor(input: &GpuInput<'_>) -> Planned {
    // The notes about the GPU's facts were made when its devices were planned.
    let facts = GpuFacts::new(input.inventory, input.gpu, &mut Vec::new());
    Planned {
        device: devices::monitor(&naming::monitor_device(input.index), input.gpu, &facts),
        reference: input.reference(DeviceKind::Monitor),
    }
}

fn share_kind(level: IsolationLevel, policy: &GpuPolicy) -> DeviceKind {
    DeviceKind::Share {
        level,
        provider: (level == IsolationLevel::Isolated).then_some(policy.isolation_provider),
        time_slice: (level == IsolationLevel::Shared).then_some(policy.time_slice),
    }
}

/// Existing instances as static devices, without counters, under the
/// names [`context::instance_devices`] gave them. Only instances the
/// policy offers (or a claim holds) are published; the others still block
/// whatever they overlap.
fn static_mig(
    input: &GpuInput<'_>,
    facts: &GpuFacts,
    instances: &[(String, &MigInstance)],
) -> Vec<Planned> {
    let mut out = Vec::new();
    for (name, instance) in instances {
        let offered = (input.policy.allows(Mode::Mig)
            && input.policy.allows_profile(&instance.profile))
            || input.held.contains(name);
        if !offered {
            continue;
        }
        out.push(Planned {
            device: devices::mig(
                name,
                input.gpu,
                facts,
                &MigSpec::from_instance(instance),
                None,
            ),
            reference: input.reference(DeviceKind::Mig {
                profile_id: instance.profile_id,
                profile: instance.profile.clone(),
                placement: instance.placement,
                existing: Some(instance.uuid.clone()),
                dynamic: false,
            }),
        });
    }
    out
}
