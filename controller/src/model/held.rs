//! What the devices claims hold stand for, per GPU.
//!
//! The caller passes only names (from allocated ResourceClaims and the
//! node's checkpoint). A name is resolved by comparing it with the names
//! this GPU could have published in any model (full or static, any policy):
//! `gpu-<n>`, `gpu-<n>-<level>`, the replicas `gpu-<n>-<level>-<i>`, the
//! devices of the MIG instances that exist, and every MIG placement of the
//! GPU's profiles. Nothing else is read out of a name. The monitoring
//! device `gpu-<n>-monitor` uses nothing and is published in every case:
//! holding it decides nothing. See [`super::plan`]
//! for what the planners do with the result.

use std::collections::{BTreeMap, BTreeSet};

use tessera_api::inventory::{Gpu, MigInstance, MigPlacement, MigProfile};

use super::Note;
use super::devices::IsolationLevel;
use super::naming;
use super::policy::Mode;

/// How a held device uses its GPU. Devices of different uses must never be
/// allocatable on one GPU at the same time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Use {
    Whole,
    Mig,
    Share(IsolationLevel),
}

impl Use {
    /// The policy mode of the same name.
    pub fn mode(self) -> Mode {
        match self {
            Use::Whole => Mode::Whole,
            Use::Mig => Mode::Mig,
            Use::Share(IsolationLevel::Isolated) => Mode::Isolated,
            Use::Share(IsolationLevel::Shared) => Mode::Shared,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Use::Whole => "whole GPU",
            Use::Mig => "MIG",
            Use::Share(IsolationLevel::Isolated) => "Isolated shares",
            Use::Share(IsolationLevel::Shared) => "Shared shares",
        }
    }
}

/// The held devices of one GPU, by what they stand for.
#[derive(Debug, Default)]
pub struct HeldOnGpu<'a> {
    /// Every held name of this GPU, resolved or not.
    pub names: BTreeSet<String>,
    /// `gpu-<n>`.
    pub whole: bool,
    /// Multi-allocatable share devices `gpu-<n>-<level>`.
    pub shares: BTreeSet<IsolationLevel>,
    /// Static-mode replicas `gpu-<n>-<level>-<i>`: level -> indices.
    pub replicas: BTreeMap<IsolationLevel, BTreeSet<u32>>,
    /// Devices of existing MIG instances, by name.
    pub instances: BTreeMap<String, &'a MigInstance>,
    /// MIG placements no existing instance's device is named after
    /// (dynamic devices not created yet, or an instance that went).
    pub placements: BTreeMap<String, (&'a MigProfile, MigPlacement)>,
    /// Names that stand for nothing on this GPU any more.
    pub unmatched: BTreeSet<String>,
}

impl<'a> HeldOnGpu<'a> {
    /// Resolves the held names of GPU `n`. `instances` are the devices of
    /// the GPU's existing instances, by the names they are published under.
    pub fn classify(
        gpu: &'a Gpu,
        n: u32,
        held: &BTreeSet<String>,
        instances: &[(String, &'a MigInstance)],
    ) -> Self {
        let mut out = HeldOnGpu::default();
        let whole = naming::whole_device(n);
        let prefix = format!("{whole}-");
        let monitor = naming::monitor_device(n);
        for name in held
            .iter()
            .filter(|h| **h == whole || h.starts_with(&prefix))
        {
            // Published whatever else is: it uses nothing of the GPU.
            if *name == monitor {
                continue;
            }
            out.names.insert(name.clone());
            if *name == whole {
                out.whole = true;
                continue;
            }
            if let Some(level) = LEVELS
                .into_iter()
                .find(|l| *name == naming::share_device(n, l.slug()))
            {
                out.shares.insert(level);
                continue;
            }
            if let Some((level, i)) = replica_of(n, name) {
                out.replicas.entry(level).or_default().insert(i);
                continue;
            }
            if let Some((_, instance)) = instances.iter().find(|(d, _)| d == name) {
                out.instances.insert(name.clone(), *instance);
                continue;
            }
            if let Some(found) = placement_of(gpu, n, name) {
                out.placements.insert(name.clone(), found);
                continue;
            }
            out.unmatched.insert(name.clone());
        }
        out
    }

    /// Notes for the names that stand for nothing on this GPU.
    pub fn note_unmatched(&self, gpu: &Gpu, notes: &mut Vec<Note>) {
        for name in &self.unmatched {
            notes.push(Note::gpu(
                gpu,
                format!(
                    "held device {name} matches no device of this GPU (a MIG instance that is gone, \
                     or a profile the GPU no longer lists): not published"
                ),
            ));
        }
    }

    /// The uses of the GPU the held devices imply; `owned` says whether MIG
    /// instances Tessera created for claims exist on it (they are in use).
    pub fn uses(&self, owned: bool) -> BTreeSet<Use> {
        let mut uses = BTreeSet::new();
        if self.whole {
            uses.insert(Use::Whole);
        }
        for level in &self.shares {
            uses.insert(Use::Share(*level));
        }
        for (level, indices) in &self.replicas {
            if !indices.is_empty() {
                uses.insert(Use::Share(*level));
            }
        }
        if owned || !self.instances.is_empty() || !self.placements.is_empty() {
            uses.insert(Use::Mig);
        }
        uses
    }

    /// Held names that resolved, for notes.
    pub fn listed(&self) -> String {
        let names: Vec<&str> = self
            .names
            .iter()
            .filter(|n| !self.unmatched.contains(*n))
            .map(String::as_str)
            .collect();
        names.join(", ")
    }

    pub fn has_replicas(&self) -> bool {
        self.replicas.values().any(|r| !r.is_empty())
    }

    /// Whether a MIG placement overlaps a held placement.
    pub fn overlaps_placement(&self, placement: MigPlacement) -> Option<&str> {
        self.placements
            .iter()
            .find(|(_, (_, p))| overlaps(*p, placement))
            .map(|(name, _)| name.as_str())
    }
}

const LEVELS: [IsolationLevel; 2] = [IsolationLevel::Isolated, IsolationLevel::Shared];

fn replica_of(n: u32, name: &str) -> Option<(IsolationLevel, u32)> {
    LEVELS.into_iter().find_map(|level| {
        let rest = name.strip_prefix(&naming::share_device(n, level.slug()))?;
        let i: u32 = rest.strip_prefix('-')?.parse().ok()?;
        (naming::replica_device(n, level.slug(), i) == name).then_some((level, i))
    })
}

fn placement_of<'a>(gpu: &'a Gpu, n: u32, name: &str) -> Option<(&'a MigProfile, MigPlacement)> {
    gpu.mig.profiles().iter().find_map(|profile| {
        profile
            .placements
            .iter()
            .filter(|p| p.size > 0)
            .find(|p| naming::mig_device(n, &profile.name, p.start) == name)
            .map(|p| (profile, *p))
    })
}

pub fn overlaps(a: MigPlacement, b: MigPlacement) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

/// Held names whose GPU is not in the inventory: nothing describes them,
/// so they cannot be published. One note each.
pub fn note_vanished(
    held: &BTreeSet<String>,
    present: &BTreeSet<u32>,
    previous: &naming::GpuIndices,
    notes: &mut Vec<Note>,
) {
    for name in held {
        let Some(n) = naming::gpu_index_of(name) else {
            notes.push(Note {
                gpu: None,
                message: format!("held device {name} is not a device name of this driver: ignored"),
            });
            continue;
        };
        if present.contains(&n) {
            continue;
        }
        let uuid = previous
            .iter()
            .find(|(_, i)| **i == n)
            .map(|(uuid, _)| uuid.clone());
        notes.push(Note {
            gpu: uuid,
            message: format!(
                "held device {name}: its GPU ({}) is not in the inventory; it cannot be published \
                 until the GPU is back (its number stays reserved)",
                naming::whole_device(n)
            ),
        });
    }
}
