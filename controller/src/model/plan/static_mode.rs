//! Static (degraded) mode of one GPU: one mode, no counters.

use tessera_api::inventory::{Mig, MigInstance};

use super::{Context, GpuInput, GpuOutput, Planned, share_kind, static_mig};
use crate::model::devices::{self, DeviceKind, GpuFacts, IsolationLevel};
use crate::model::held::Use;
use crate::model::naming;
use crate::model::policy::{Mode, StaticMode};
use crate::model::{Capabilities, Note};

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
