//! What both planners know about one GPU before deciding: its facts,
//! its existing MIG instances split into owned and foreign, and what is held.

use std::collections::BTreeSet;

use tessera_api::inventory::MigInstance;

use super::{Context, GpuInput};
use crate::model::Note;
use crate::model::devices::GpuFacts;
use crate::model::held::HeldOnGpu;
use crate::model::naming;

impl<'a> GpuInput<'a> {
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

    pub(super) fn context(&self, notes: &mut Vec<Note>) -> Context<'a> {
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
}

/// Names of the devices of existing instances: the placement's name, with
/// `-ci<id>` where several compute instances share one GPU instance, or
/// where a claim holds that suffixed name (its GPU instance once had more
/// compute instances): a held device keeps its name.
pub(super) fn instance_devices<'g>(
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
