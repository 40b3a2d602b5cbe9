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

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::Device;
use tessera_api::inventory::{Gpu, Inventory, Mig, MigInstance, MigPlacement, MigProfile};

use super::counters::GpuCounters;
use super::devices::{self, DeviceKind, DeviceRef, GpuFacts, IsolationLevel, MigSpec};
use super::held::{HeldOnGpu, Use, overlaps};
use super::naming;
use super::policy::{GpuPolicy, IsolationProvider, Mode, StaticMode};
use super::{Capabilities, Note};

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
    /// published under (see [`instance_devices`]).
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

    /// Splits existing instances into (owned, foreign). An owned instance
    /// whose profile/placement the inventory does not list cannot be
    /// matched to a placement device and is treated as foreign.
    fn split_instances(
        &self,
        notes: &mut Vec<Note>,
    ) -> (Vec<&'a MigInstance>, Vec<&'a MigInstance>) {
        let mut owned = Vec::new();
        let mut foreign = Vec::new();
        for instance in self.gpu.mig.instances() {
            if self.owned_mig.contains(&instance.uuid) {
                if self.profile_of(instance).is_some() {
                    owned.push(instance);
                } else {
                    notes.push(Note::gpu(
                        self.gpu,
                        format!(
                            "owned MIG instance {} ({}) matches no listed placement; published as static",
                            instance.uuid, instance.profile
                        ),
                    ));
                    foreign.push(instance);
                }
            } else {
                foreign.push(instance);
            }
        }
        (owned, foreign)
    }

    fn context(&self, notes: &mut Vec<Note>) -> Context<'a> {
        let facts = GpuFacts::new(self.inventory, self.gpu, notes);
        let (owned, foreign) = self.split_instances(notes);
        let all: Vec<&MigInstance> = self.gpu.mig.instances().iter().collect();
        let named = instance_devices(self.index, &all, self.held);
        let held = HeldOnGpu::classify(self.gpu, self.index, self.held, &named);
        held.note_unmatched(self.gpu, notes);
        let foreign_devices = named
            .into_iter()
            .filter(|(_, i)| foreign.iter().any(|f| f.uuid == i.uuid))
            .collect();
        Context {
            facts,
            owned,
            foreign,
            foreign_devices,
            held,
        }
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

    /// The owned instances and the held placements (no instance yet) as
    /// dynamic devices without counters, in the full model's order (profile
    /// id, then start), so an instance being created moves nothing.
    fn dynamic_without_counters(&self, ctx: &Context<'_>) -> Vec<Planned> {
        let mut found: Vec<(&MigProfile, MigPlacement, Option<String>)> = ctx
            .owned
            .iter()
            .filter_map(|i| Some((self.profile_of(i)?, i.placement, Some(i.uuid.clone()))))
            .chain(
                ctx.held
                    .placements
                    .values()
                    .map(|(profile, placement)| (*profile, *placement, None)),
            )
            .collect();
        found.sort_by_key(|(p, placement, _)| (p.id, *placement));
        found
            .into_iter()
            .map(|(profile, placement, existing)| {
                self.dynamic(&ctx.facts, profile, placement, existing, None)
            })
            .collect()
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

    /// Foreign instance devices that may be published beside the held
    /// devices. Physically they exist and have no counters, so one that
    /// overlaps a held device would be offered twice: while it is not held
    /// itself, it is left out (with a note). A held whole GPU or share
    /// overlaps every instance.
    fn foreign_beside_held<'c>(
        &self,
        ctx: &'c Context<'a>,
        notes: &mut Vec<Note>,
    ) -> Vec<(String, &'a MigInstance)> {
        let held = &ctx.held;
        let non_mig = held.whole || !held.shares.is_empty() || held.has_replicas();
        let mut out = Vec::new();
        for (name, instance) in &ctx.foreign_devices {
            if held.names.contains(name) {
                out.push((name.clone(), *instance));
                continue;
            }
            let blocker = if non_mig {
                Some(held.listed())
            } else {
                held.overlaps_placement(instance.placement)
                    .map(ToString::to_string)
            };
            match blocker {
                Some(by) => notes.push(Note::gpu(
                    self.gpu,
                    format!(
                        "MIG instance {} ({name}) overlaps held device(s) {by}: not offered while they are held",
                        instance.uuid
                    ),
                )),
                None => out.push((name.clone(), *instance)),
            }
        }
        out
    }

    /// Exactly the held devices (and the owned instances), without
    /// counters: what a GPU publishes when its held devices are of several
    /// uses, or of a kind the current model has no place for. A held share
    /// device needs consumable capacity; without it, it cannot be published
    /// and nothing else is.
    fn only_held(
        &self,
        ctx: &Context<'a>,
        consumable: bool,
        notes: &mut Vec<Note>,
    ) -> Vec<Planned> {
        let gpu = self.gpu;
        let n = self.index;
        let held = &ctx.held;
        let mut out = Vec::new();
        if held.whole {
            out.push(Planned {
                device: devices::whole(&naming::whole_device(n), gpu, &ctx.facts, None),
                reference: self.reference(DeviceKind::Whole),
            });
        }
        for level in &held.shares {
            let name = naming::share_device(n, level.slug());
            if !consumable {
                notes.push(Note::gpu(
                    gpu,
                    format!(
                        "held device {name} is a share device with consumable capacity, which this API \
                         server does not serve: it cannot be published, and nothing else is published \
                         on this GPU until it is released"
                    ),
                ));
                continue;
            }
            match devices::share(&name, gpu, &ctx.facts, *level, &self.policy, None) {
                Some(device) => out.push(Planned {
                    device,
                    reference: self.reference(share_kind(*level, &self.policy)),
                }),
                None => notes.push(Note::gpu(
                    gpu,
                    format!("held device {name}: too little memory for a share device"),
                )),
            }
        }
        for (level, indices) in &held.replicas {
            let replicas = replica_count(&self.policy, indices);
            for i in indices {
                out.push(self.replica(&ctx.facts, *level, *i, replicas));
            }
        }
        let held_foreign: Vec<(String, &MigInstance)> = ctx
            .foreign_devices
            .iter()
            .filter(|(name, _)| held.instances.contains_key(name))
            .map(|(name, i)| (name.clone(), *i))
            .collect();
        out.extend(static_mig(self, &ctx.facts, &held_foreign));
        out.extend(self.dynamic_without_counters(ctx));
        out
    }
}

/// Replicas a GPU's held replicas are described with: the policy's count,
/// or more where a held index lies beyond it.
fn replica_count(policy: &GpuPolicy, held: &BTreeSet<u32>) -> u32 {
    let beyond = held.iter().next_back().map_or(0, |i| i + 1);
    policy.replicas.max(1).max(beyond)
}

/// Names of the devices of existing instances: the placement's name, with
/// `-ci<id>` where several compute instances share one GPU instance, or
/// where a claim holds that suffixed name (its GPU instance once had more
/// compute instances): a held device keeps its name.
fn instance_devices<'g>(
    n: u32,
    instances: &[&'g MigInstance],
    held: &BTreeSet<String>,
) -> Vec<(String, &'g MigInstance)> {
    let mut sorted: Vec<&MigInstance> = instances.to_vec();
    sorted.sort_by_key(|i| (i.placement, i.profile_id, i.compute_instance_id));
    sorted
        .iter()
        .map(|instance| {
            let shared_gi = sorted
                .iter()
                .filter(|o| o.placement == instance.placement)
                .count()
                > 1;
            let base = naming::mig_device(n, &instance.profile, instance.placement.start);
            let suffixed = format!("{base}-ci{}", instance.compute_instance_id);
            let name = if shared_gi || (held.contains(&suffixed) && !held.contains(&base)) {
                suffixed
            } else {
                base
            };
            (name, *instance)
        })
        .collect()
}

/// The full model: whole GPU, two share devices, static and dynamic MIG,
/// tied together by the GPU's counter set.
pub fn plan_full(input: &GpuInput<'_>, notes: &mut Vec<Note>) -> GpuOutput {
    let switchable = input.switchable();
    let ctx = input.context(notes);
    if ctx.held.has_replicas() {
        return held_replicas_only(input, &ctx, switchable, notes);
    }
    let possible = possibilities(input, &ctx, switchable, notes);
    let dynamic = dynamic_placements(input, &ctx, possible.dynamic, notes);
    let offered = non_mig_offers(input, &ctx, possible.non_mig, notes);
    let counters = (offered.whole || !offered.shares.is_empty() || !dynamic.is_empty())
        .then(|| counter_set(input, &dynamic));
    let devices = full_devices(input, &ctx, offered, counters.as_ref(), dynamic, notes);
    if devices.is_empty() {
        notes.push(Note::gpu(
            input.gpu,
            "no device offered (policy or MIG state)",
        ));
    }
    GpuOutput {
        index: input.index,
        counters,
        devices,
        mig_managed: switchable,
    }
}

/// Static-mode replicas have no place in the full model: the GPU keeps
/// exactly its held devices, without counters, until they are released.
fn held_replicas_only(
    input: &GpuInput<'_>,
    ctx: &Context<'_>,
    switchable: bool,
    notes: &mut Vec<Note>,
) -> GpuOutput {
    notes.push(Note::gpu(
        input.gpu,
        format!(
            "held static-mode replica device(s) among {}: the full model has no replicas, so \
             this GPU publishes only its held devices, without counters, until they are released",
            ctx.held.listed()
        ),
    ));
    GpuOutput {
        index: input.index,
        counters: None,
        devices: input.only_held(ctx, true, notes),
        mig_managed: switchable,
    }
}

/// What the GPU's MIG state leaves possible (the module docs' table).
struct Possible {
    /// Whole GPU and share devices.
    non_mig: bool,
    /// Dynamic MIG devices.
    dynamic: bool,
}

fn possibilities(
    input: &GpuInput<'_>,
    ctx: &Context<'_>,
    switchable: bool,
    notes: &mut Vec<Note>,
) -> Possible {
    let gpu = input.gpu;
    let foreign = &ctx.foreign;
    let non_mig = match &gpu.mig {
        Mig::NotSupported | Mig::Disabled { .. } => true,
        Mig::Enabled { .. } => foreign.is_empty() && switchable,
    };
    let dynamic = match &gpu.mig {
        Mig::NotSupported => false,
        Mig::Disabled { .. } => switchable,
        Mig::Enabled { .. } => true,
    };
    if !foreign.is_empty() {
        notes.push(Note::gpu(
            gpu,
            format!(
                "{} pre-existing MIG instance(s): whole-GPU and share devices not offered",
                foreign.len()
            ),
        ));
    }
    Possible { non_mig, dynamic }
}

/// A dynamic MIG device: its profile, its placement, and the instance
/// Tessera created for it, if any.
type Placement<'a> = (&'a MigProfile, MigPlacement, Option<String>);

/// Dynamic placements in profile-id then start order: those offered where
/// no foreign instance overlaps them, the owned instances, and the held
/// placements whatever the MIG state or policy.
fn dynamic_placements<'a>(
    input: &GpuInput<'a>,
    ctx: &Context<'a>,
    dynamic_possible: bool,
    notes: &mut Vec<Note>,
) -> Vec<Placement<'a>> {
    let gpu = input.gpu;
    let mut dynamic = Vec::new();
    let mut profiles: Vec<&MigProfile> = gpu.mig.profiles().iter().collect();
    profiles.sort_by_key(|p| p.id);
    for profile in profiles {
        let mut placements: Vec<MigPlacement> = profile
            .placements
            .iter()
            .copied()
            .filter(|p| p.size > 0)
            .collect();
        placements.sort();
        placements.dedup();
        for placement in placements {
            let name = naming::mig_device(input.index, &profile.name, placement.start);
            let owned = ctx
                .owned
                .iter()
                .find(|i| i.profile_id == profile.id && i.placement == placement);
            let held_here = ctx.held.placements.contains_key(&name);
            let offered =
                input.policy.allows(Mode::Mig) && input.policy.allows_profile(&profile.name);
            let blocked = ctx.foreign.iter().any(|i| overlaps(i.placement, placement));
            if held_here && (!dynamic_possible || blocked) {
                notes.push(Note::gpu(
                    gpu,
                    format!("held device {name} stays published although this GPU's MIG state no longer offers it"),
                ));
            }
            if owned.is_some() || held_here || (dynamic_possible && offered && !blocked) {
                dynamic.push((profile, placement, owned.map(|i| i.uuid.clone())));
            }
        }
    }
    dynamic
}

/// The whole GPU and the share levels a GPU offers.
struct NonMig {
    whole: bool,
    shares: Vec<IsolationLevel>,
}

/// What the MIG state and policy allow of the whole GPU and the share
/// devices, plus what is held. No Isolated share where MPS cannot isolate.
fn non_mig_offers(
    input: &GpuInput<'_>,
    ctx: &Context<'_>,
    non_mig_possible: bool,
    notes: &mut Vec<Note>,
) -> NonMig {
    let gpu = input.gpu;
    let held = &ctx.held;
    let whole = held.whole || (non_mig_possible && input.policy.allows(Mode::Whole));
    let isolated_refused = input.isolated_refused();
    let shares: Vec<IsolationLevel> = [
        (IsolationLevel::Isolated, Mode::Isolated),
        (IsolationLevel::Shared, Mode::Shared),
    ]
    .into_iter()
    .filter(|(level, mode)| {
        let offered = non_mig_possible && input.policy.allows(*mode);
        let refused = *level == IsolationLevel::Isolated && isolated_refused.is_some();
        held.shares.contains(level) || (offered && !refused)
    })
    .map(|(level, _)| level)
    .collect();
    if let Some(why) = isolated_refused
        && non_mig_possible
        && input.policy.allows(Mode::Isolated)
    {
        let kept = if held.shares.contains(&IsolationLevel::Isolated) {
            " (the held Isolated share stays published until it is released)"
        } else {
            ""
        };
        notes.push(Note::gpu(gpu, format!("{why}{kept}")));
    }
    if !non_mig_possible && (held.whole || !held.shares.is_empty()) {
        notes.push(Note::gpu(
            gpu,
            format!(
                "held device(s) {} stay published although this GPU's MIG state no longer offers them",
                held.listed()
            ),
        ));
    }
    NonMig { whole, shares }
}

/// The GPU's counter set, with the profiles of its dynamic placements.
fn counter_set(input: &GpuInput<'_>, dynamic: &[Placement<'_>]) -> GpuCounters {
    let mut dynamic_profiles: Vec<&MigProfile> = dynamic.iter().map(|(p, _, _)| *p).collect();
    dynamic_profiles.dedup_by_key(|p| p.id);
    GpuCounters::new(input.index, input.gpu.mig.profiles(), &dynamic_profiles)
}

/// The devices of the full model in publishing order: whole GPU, shares,
/// existing instances, dynamic placements.
fn full_devices(
    input: &GpuInput<'_>,
    ctx: &Context<'_>,
    offered: NonMig,
    counters: Option<&GpuCounters>,
    dynamic: Vec<Placement<'_>>,
    notes: &mut Vec<Note>,
) -> Vec<Planned> {
    let gpu = input.gpu;
    let mut out = Vec::new();
    if offered.whole
        && let Some(c) = counters
    {
        out.push(Planned {
            device: devices::whole(
                &naming::whole_device(input.index),
                gpu,
                &ctx.facts,
                Some(c.everything()),
            ),
            reference: input.reference(DeviceKind::Whole),
        });
    }
    for level in offered.shares {
        let name = naming::share_device(input.index, level.slug());
        let consumes = counters.map(GpuCounters::everything);
        match devices::share(&name, gpu, &ctx.facts, level, &input.policy, consumes) {
            Some(device) => out.push(Planned {
                device,
                reference: input.reference(share_kind(level, &input.policy)),
            }),
            None => notes.push(Note::gpu(
                gpu,
                format!("too little memory for a {} share device", level.as_str()),
            )),
        }
    }
    let foreign_devices = input.foreign_beside_held(ctx, notes);
    out.extend(static_mig(input, &ctx.facts, &foreign_devices));
    if let Some(c) = counters {
        for (profile, placement, existing) in dynamic {
            out.push(input.dynamic(&ctx.facts, profile, placement, existing, Some(c)));
        }
    }
    out
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
/// names [`instance_devices`] gave them. Only instances the policy offers
/// (or a claim holds) are published; the others still block whatever they
/// overlap.
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

/// Static (degraded) mode: one mode per GPU, no counters. The mode is the
/// one the held devices use where a claim holds any (see the module docs),
/// else the policy's.
pub fn plan_static(
    input: &GpuInput<'_>,
    capabilities: &Capabilities,
    notes: &mut Vec<Note>,
) -> GpuOutput {
    let gpu = input.gpu;
    let n = input.index;
    let ctx = input.context(notes);
    let instances: Vec<&MigInstance> = gpu.mig.instances().iter().collect();
    let mig_possible = !instances.is_empty();
    let non_mig_possible = match &gpu.mig {
        Mig::NotSupported | Mig::Disabled { .. } => true,
        Mig::Enabled { .. } => instances.is_empty() && input.switchable(),
    };

    let uses = ctx.held.uses(!ctx.owned.is_empty());
    let mut out = Vec::new();
    if uses.is_empty() {
        let mode = resolve_static_mode(input, mig_possible, non_mig_possible, notes);
        out.extend(static_mode_devices(input, &ctx, mode, capabilities, notes));
    } else {
        let mut scratch = Vec::new();
        let policy_mode = resolve_static_mode(input, mig_possible, non_mig_possible, &mut scratch);
        let only = uses.iter().next().copied().filter(|_| uses.len() == 1);
        match only {
            Some(held_use) => {
                if policy_mode != Some(held_use.mode()) {
                    notes.push(Note::gpu(
                        gpu,
                        format!(
                            "static mode {} overridden: held device(s) {} use this GPU as {}",
                            policy_mode
                                .map_or("none".to_string(), |m| format!("{m:?}").to_lowercase()),
                            held_listed(&ctx),
                            held_use.describe()
                        ),
                    ));
                }
                out.extend(held_use_devices(input, &ctx, held_use, capabilities, notes));
            }
            None => {
                notes.push(Note::gpu(
                    gpu,
                    format!(
                        "held device(s) {} use this GPU in several ways ({}): only they are published",
                        held_listed(&ctx),
                        uses.iter().map(|u| u.describe()).collect::<Vec<_>>().join(", ")
                    ),
                ));
                out.extend(input.only_held(&ctx, capabilities.consumable_capacity, notes));
            }
        }
    }
    if out.is_empty() && uses.is_empty() {
        notes.push(Note::gpu(gpu, "no device offered in static mode"));
    }
    GpuOutput {
        index: n,
        counters: None,
        devices: out,
        mig_managed: input.switchable(),
    }
}

/// The held names for a note, with the owned instances.
fn held_listed(ctx: &Context<'_>) -> String {
    let mut listed = ctx.held.listed();
    for i in &ctx.owned {
        if !listed.is_empty() {
            listed.push_str(", ");
        }
        listed.push_str(&format!("MIG instance {} (ours)", i.uuid));
    }
    listed
}

/// The devices of the static mode the policy chose (nothing is held).
fn static_mode_devices(
    input: &GpuInput<'_>,
    ctx: &Context<'_>,
    mode: Option<Mode>,
    capabilities: &Capabilities,
    notes: &mut Vec<Note>,
) -> Vec<Planned> {
    let gpu = input.gpu;
    let n = input.index;
    match mode {
        None => Vec::new(),
        Some(Mode::Mig) => static_mig(&mig_scoped(input), &ctx.facts, &ctx.foreign_devices),
        Some(Mode::Whole) => vec![Planned {
            device: devices::whole(&naming::whole_device(n), gpu, &ctx.facts, None),
            reference: input.reference(DeviceKind::Whole),
        }],
        Some(Mode::Isolated) | Some(Mode::Shared) => {
            let level = if mode == Some(Mode::Isolated) {
                IsolationLevel::Isolated
            } else {
                IsolationLevel::Shared
            };
            static_shares(input, &ctx.facts, level, capabilities, notes)
        }
    }
}

/// Static mode publishes what exists; the profile filter still applies but
/// the `modes` list does not (the mode was chosen).
fn mig_scoped<'a>(input: &GpuInput<'a>) -> GpuInput<'a> {
    let mut policy = input.policy.clone();
    policy.modes = vec![Mode::Mig];
    GpuInput { policy, ..*input }
}

/// The devices of the one use the held devices make of a GPU, static mode.
fn held_use_devices<'a>(
    input: &GpuInput<'a>,
    ctx: &Context<'a>,
    held_use: Use,
    capabilities: &Capabilities,
    notes: &mut Vec<Note>,
) -> Vec<Planned> {
    let held = &ctx.held;
    match held_use {
        // MIG: the owned instances and held placements as dynamic devices
        // (without counters), and the existing instances as in the mig
        // mode, except those overlapping a held placement.
        Use::Mig => {
            let mut out = input.dynamic_without_counters(ctx);
            let foreign = input.foreign_beside_held(ctx, notes);
            out.extend(static_mig(&mig_scoped(input), &ctx.facts, &foreign));
            out
        }
        // Replicas only, all below the policy's count: the replica layout
        // stays (on any server: a claim holds one of them).
        Use::Share(level)
            if held.shares.is_empty()
                && held
                    .replicas
                    .get(&level)
                    .and_then(|r| r.iter().next_back())
                    .is_some_and(|last| *last < input.policy.replicas.max(1)) =>
        {
            let replicas = input.policy.replicas.max(1);
            (0..replicas)
                .map(|i| input.replica(&ctx.facts, level, i, replicas))
                .collect()
        }
        // A whole GPU, a share device, or replicas the policy's count no
        // longer covers: exactly the held devices.
        Use::Whole | Use::Share(_) => {
            if held.replicas.values().any(|r| {
                r.iter()
                    .next_back()
                    .is_some_and(|last| *last >= input.policy.replicas.max(1))
            }) {
                notes.push(Note::gpu(
                    input.gpu,
                    format!(
                        "held replica(s) {} lie beyond static.replicas ({}): only the held replicas are published until they are released",
                        held.listed(),
                        input.policy.replicas
                    ),
                ));
            }
            input.only_held(ctx, capabilities.consumable_capacity, notes)
        }
    }
}

fn resolve_static_mode(
    input: &GpuInput<'_>,
    mig_possible: bool,
    non_mig_possible: bool,
    notes: &mut Vec<Note>,
) -> Option<Mode> {
    let gpu = input.gpu;
    let isolated_refused = input.isolated_refused();
    let first_non_mig = || {
        [Mode::Whole, Mode::Isolated, Mode::Shared]
            .into_iter()
            .filter(|m| *m != Mode::Isolated || isolated_refused.is_none())
            .find(|m| input.policy.allows(*m))
    };
    let wanted = match input.policy.static_mode {
        StaticMode::Auto => {
            if mig_possible {
                if input.policy.allows(Mode::Mig) {
                    return Some(Mode::Mig);
                }
                notes.push(Note::gpu(
                    gpu,
                    "MIG instances exist but policy does not offer mig",
                ));
                return None;
            }
            if !non_mig_possible {
                notes.push(Note::gpu(
                    gpu,
                    "MIG mode is on without instances and cannot be switched off",
                ));
                return None;
            }
            return first_non_mig();
        }
        StaticMode::Mig => Mode::Mig,
        StaticMode::Whole => Mode::Whole,
        StaticMode::Isolated => Mode::Isolated,
        StaticMode::Shared => Mode::Shared,
    };
    match wanted {
        Mode::Isolated if isolated_refused.is_some() => {
            let why = isolated_refused.unwrap_or_default();
            notes.push(Note::gpu(gpu, format!("static mode isolated: {why}")));
            None
        }
        Mode::Mig if mig_possible => Some(Mode::Mig),
        Mode::Mig if non_mig_possible => {
            notes.push(Note::gpu(
                gpu,
                "static mode mig but no MIG instances exist; offering the whole GPU",
            ));
            Some(Mode::Whole)
        }
        Mode::Mig => None,
        other if non_mig_possible => Some(other),
        _ if mig_possible => {
            notes.push(Note::gpu(
                gpu,
                "MIG instances exist; static mode overridden to mig",
            ));
            Some(Mode::Mig)
        }
        _ => {
            notes.push(Note::gpu(
                gpu,
                "MIG mode is on without instances and cannot be switched off",
            ));
            None
        }
    }
}

fn static_shares(
    input: &GpuInput<'_>,
    facts: &GpuFacts,
    level: IsolationLevel,
    capabilities: &Capabilities,
    notes: &mut Vec<Note>,
) -> Vec<Planned> {
    let gpu = input.gpu;
    let n = input.index;
    if capabilities.consumable_capacity {
        // One multi-allocatable device of the chosen level; no counters are
        // needed because no other mode is offered on this GPU.
        let name = naming::share_device(n, level.slug());
        return match devices::share(&name, gpu, facts, level, &input.policy, None) {
            Some(device) => vec![Planned {
                device,
                reference: input.reference(share_kind(level, &input.policy)),
            }],
            None => {
                notes.push(Note::gpu(gpu, "too little memory for a share device"));
                Vec::new()
            }
        };
    }
    let replicas = input.policy.replicas.max(1);
    (0..replicas)
        .map(|i| input.replica(facts, level, i, replicas))
        .collect()
}
