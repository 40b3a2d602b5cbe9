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
//! Devices a claim holds (passed in as "held") stay published even when the
//! policy no longer offers them, because dropping an allocated device lets
//! the scheduler over-commit its counters (kubernetes#140806). Physical
//! impossibility is never overridden.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::Device;
use tessera_api::inventory::{Gpu, Inventory, Mig, MigInstance, MigPlacement, MigProfile};

use super::counters::GpuCounters;
use super::devices::{self, DeviceKind, DeviceRef, GpuFacts, IsolationLevel, MigSpec};
use super::naming;
use super::policy::{GpuPolicy, Mode, StaticMode};
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

fn overlaps(a: MigPlacement, b: MigPlacement) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

impl GpuInput<'_> {
    /// Whether the driver may switch this GPU's MIG mode at prepare.
    fn switchable(&self) -> bool {
        !matches!(self.gpu.mig, Mig::NotSupported)
            && self.policy.mig_mode_switch
            && mig_switch_without_reset(&self.gpu.architecture)
    }

    fn reference(&self, kind: DeviceKind) -> DeviceRef {
        DeviceRef {
            gpu_uuid: self.gpu.uuid.clone(),
            gpu_index: self.index,
            kind,
        }
    }

    fn offered(&self, mode: Mode, name: &str) -> bool {
        self.policy.allows(mode) || self.held.contains(name)
    }

    fn profile_of(&self, instance: &MigInstance) -> Option<&MigProfile> {
        self.gpu
            .mig
            .profiles()
            .iter()
            .find(|p| p.id == instance.profile_id && p.placements.contains(&instance.placement))
    }

    /// Splits existing instances into (owned, foreign). An owned instance
    /// whose profile/placement the inventory does not list cannot be
    /// matched to a placement device and is treated as foreign.
    fn split_instances(&self, notes: &mut Vec<Note>) -> (Vec<&MigInstance>, Vec<&MigInstance>) {
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
}

/// The full model: whole GPU, two share devices, static and dynamic MIG,
/// tied together by the GPU's counter set.
pub fn plan_full(input: &GpuInput<'_>, notes: &mut Vec<Note>) -> GpuOutput {
    let gpu = input.gpu;
    let n = input.index;
    let facts = GpuFacts::new(input.inventory, gpu, notes);
    let switchable = input.switchable();
    let (owned, foreign) = input.split_instances(notes);

    let non_mig_possible = match &gpu.mig {
        Mig::NotSupported | Mig::Disabled { .. } => true,
        Mig::Enabled { .. } => foreign.is_empty() && switchable,
    };
    let dynamic_possible = match &gpu.mig {
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

    // Dynamic placements: (profile, placement) pairs, in profile-id then
    // start order.
    let mut dynamic: Vec<(&MigProfile, MigPlacement)> = Vec::new();
    if dynamic_possible {
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
                let name = naming::mig_device(n, &profile.name, placement.start);
                let offered = (input.policy.allows(Mode::Mig)
                    && input.policy.allows_profile(&profile.name))
                    || input.held.contains(&name)
                    || owned
                        .iter()
                        .any(|i| i.profile_id == profile.id && i.placement == placement);
                let blocked = foreign.iter().any(|i| overlaps(i.placement, placement));
                if offered && !blocked {
                    dynamic.push((profile, placement));
                }
            }
        }
    }

    let whole_name = naming::whole_device(n);
    let offer_whole = non_mig_possible && input.offered(Mode::Whole, &whole_name);
    let share_levels: Vec<IsolationLevel> = if non_mig_possible {
        [
            (IsolationLevel::Isolated, Mode::Isolated),
            (IsolationLevel::Shared, Mode::Shared),
        ]
        .into_iter()
        .filter(|(level, mode)| input.offered(*mode, &naming::share_device(n, level.slug())))
        .map(|(level, _)| level)
        .collect()
    } else {
        Vec::new()
    };

    let counters = if offer_whole || !share_levels.is_empty() || !dynamic.is_empty() {
        let mut dynamic_profiles: Vec<&MigProfile> = dynamic.iter().map(|(p, _)| *p).collect();
        dynamic_profiles.dedup_by_key(|p| p.id);
        Some(GpuCounters::new(n, gpu.mig.profiles(), &dynamic_profiles))
    } else {
        None
    };

    let mut out = Vec::new();
    if offer_whole && let Some(c) = &counters {
        out.push(Planned {
            device: devices::whole(&whole_name, gpu, &facts, Some(c.everything())),
            reference: input.reference(DeviceKind::Whole),
        });
    }
    for level in share_levels {
        let name = naming::share_device(n, level.slug());
        let consumes = counters.as_ref().map(GpuCounters::everything);
        match devices::share(&name, gpu, &facts, level, &input.policy, consumes) {
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
    out.extend(static_mig(input, &facts, &foreign));
    if let Some(c) = &counters {
        for (profile, placement) in dynamic {
            let name = naming::mig_device(n, &profile.name, placement.start);
            let existing = owned
                .iter()
                .find(|i| i.profile_id == profile.id && i.placement == placement)
                .map(|i| i.uuid.clone());
            out.push(Planned {
                device: devices::mig(
                    &name,
                    gpu,
                    &facts,
                    &MigSpec::from_profile(profile),
                    Some(c.mig(profile, placement)),
                ),
                reference: input.reference(DeviceKind::Mig {
                    profile_id: profile.id,
                    profile: profile.name.clone(),
                    placement,
                    existing,
                    dynamic: true,
                }),
            });
        }
    }
    if out.is_empty() {
        notes.push(Note::gpu(gpu, "no device offered (policy or MIG state)"));
    }
    GpuOutput {
        index: n,
        counters,
        devices: out,
        mig_managed: switchable,
    }
}

fn share_kind(level: IsolationLevel, policy: &GpuPolicy) -> DeviceKind {
    DeviceKind::Share {
        level,
        provider: (level == IsolationLevel::Isolated).then_some(policy.isolation_provider),
        time_slice: (level == IsolationLevel::Shared).then_some(policy.time_slice),
    }
}

/// Existing instances as static devices, without counters. Instances that
/// share a GPU instance (several compute instances) get a `-ci<id>` suffix.
/// Only instances the policy offers (or a claim holds) are published; the
/// others still block whatever they overlap.
fn static_mig(input: &GpuInput<'_>, facts: &GpuFacts, instances: &[&MigInstance]) -> Vec<Planned> {
    let n = input.index;
    let mut sorted: Vec<&MigInstance> = instances.to_vec();
    sorted.sort_by_key(|i| (i.placement, i.profile_id, i.compute_instance_id));
    let mut out = Vec::new();
    for instance in &sorted {
        let shared_gi = sorted
            .iter()
            .filter(|o| o.placement == instance.placement)
            .count()
            > 1;
        let mut name = naming::mig_device(n, &instance.profile, instance.placement.start);
        if shared_gi {
            name = format!("{name}-ci{}", instance.compute_instance_id);
        }
        let offered = (input.policy.allows(Mode::Mig)
            && input.policy.allows_profile(&instance.profile))
            || input.held.contains(&name);
        if !offered {
            continue;
        }
        out.push(Planned {
            device: devices::mig(
                &name,
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

/// Static (degraded) mode: one mode per GPU from policy, no counters.
pub fn plan_static(
    input: &GpuInput<'_>,
    capabilities: &Capabilities,
    notes: &mut Vec<Note>,
) -> GpuOutput {
    let gpu = input.gpu;
    let n = input.index;
    let facts = GpuFacts::new(input.inventory, gpu, notes);
    let instances: Vec<&MigInstance> = gpu.mig.instances().iter().collect();
    let mig_possible = !instances.is_empty();
    let non_mig_possible = match &gpu.mig {
        Mig::NotSupported | Mig::Disabled { .. } => true,
        Mig::Enabled { .. } => instances.is_empty() && input.switchable(),
    };

    let mode = resolve_static_mode(input, mig_possible, non_mig_possible, notes);
    let mut out = Vec::new();
    match mode {
        None => {}
        Some(Mode::Mig) => {
            // Static mode publishes what exists; the profile filter still
            // applies but the `modes` list does not (the mode was chosen).
            let mut policy = input.policy.clone();
            policy.modes = vec![Mode::Mig];
            let scoped = GpuInput { policy, ..*input };
            out.extend(static_mig(&scoped, &facts, &instances));
        }
        Some(Mode::Whole) => out.push(Planned {
            device: devices::whole(&naming::whole_device(n), gpu, &facts, None),
            reference: input.reference(DeviceKind::Whole),
        }),
        Some(Mode::Isolated) | Some(Mode::Shared) => {
            let level = if mode == Some(Mode::Isolated) {
                IsolationLevel::Isolated
            } else {
                IsolationLevel::Shared
            };
            out.extend(static_shares(input, &facts, level, capabilities, notes));
        }
    }
    if out.is_empty() {
        notes.push(Note::gpu(gpu, "no device offered in static mode"));
    }
    GpuOutput {
        index: n,
        counters: None,
        devices: out,
        mig_managed: input.switchable(),
    }
}

fn resolve_static_mode(
    input: &GpuInput<'_>,
    mig_possible: bool,
    non_mig_possible: bool,
    notes: &mut Vec<Note>,
) -> Option<Mode> {
    let gpu = input.gpu;
    let first_non_mig = || {
        [Mode::Whole, Mode::Isolated, Mode::Shared]
            .into_iter()
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
        .map(|i| {
            let name = naming::replica_device(n, level.slug(), i);
            let share = share_kind(level, &input.policy);
            let (provider, time_slice) = match share {
                DeviceKind::Share {
                    provider,
                    time_slice,
                    ..
                } => (provider, time_slice),
                _ => (None, None),
            };
            Planned {
                device: devices::replica(&name, gpu, facts, level, &input.policy, replicas),
                reference: input.reference(DeviceKind::Replica {
                    level,
                    index: i,
                    replicas,
                    memory_bytes: devices::replica_memory(gpu, replicas),
                    cores: devices::replica_cores(replicas),
                    provider,
                    time_slice,
                }),
            }
        })
        .collect()
}
