//! The full model of one GPU: whole GPU, two share devices, static and
//! dynamic MIG, tied together by the GPU's counter set.

use tessera_api::inventory::{Mig, MigPlacement, MigProfile};

use super::{Context, GpuInput, GpuOutput, Planned, share_kind, static_mig};
use crate::model::Note;
use crate::model::counters::GpuCounters;
use crate::model::devices::{self, DeviceKind, IsolationLevel};
use crate::model::held::overlaps;
use crate::model::naming;
use crate::model::policy::Mode;

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
