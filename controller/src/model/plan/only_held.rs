//! What a GPU publishes around its held devices: exactly them, or the
//! existing instances that do not overlap them.

use std::collections::BTreeSet;

use tessera_api::inventory::{MigInstance, MigPlacement, MigProfile};

use super::{Context, GpuInput, Planned, share_kind, static_mig};
use crate::model::Note;
use crate::model::devices::{self, DeviceKind};
use crate::model::naming;
use crate::model::policy::GpuPolicy;

impl<'a> GpuInput<'a> {
    /// The owned instances and the held placements (no instance yet) as
    /// dynamic devices without counters, in the full model's order (profile
    /// id, then start), so an instance being created moves nothing.
    pub(super) fn dynamic_without_counters(&self, ctx: &Context<'_>) -> Vec<Planned> {
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

    /// Foreign instance devices that may be published beside the held
    /// devices. Physically they exist and have no counters, so one that
    /// overlaps a held device would be offered twice: while it is not held
    /// itself, it is left out (with a note). A held whole GPU or share
    /// overlaps every instance.
    pub(super) fn foreign_beside_held<'c>(
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
    pub(super) fn only_held(
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
