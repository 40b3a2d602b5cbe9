//! The per-GPU shared counter set that makes the modes of one GPU mutually
//! exclusive.
//!
//! # Design
//!
//! Each physical GPU `n` gets one counter set, `gpu-<n>`, published in its own
//! ResourceSlice (the 1.35+ rule). Its counters:
//!
//! * `memory-slice-<i>`, value 1, for each MIG memory slice `i` of the GPU
//!   (8 on A100/H100). A GPU that offers no dynamic MIG has exactly one,
//!   `memory-slice-0`, standing for the whole framebuffer.
//! * `compute-slices`, value = the compute slices of the largest profile (7
//!   on A100/H100), when dynamic MIG is offered; each MIG device consumes its
//!   profile's compute slices (NVML `sliceCount`). On current GPUs disjoint
//!   memory slices already imply this fits; the counter states NVML's
//!   compute capacity explicitly instead of relying on that.
//! * `ofa-engines`, value = the GPU's optical-flow engines, when any offered
//!   MIG profile owns one. This is what stops two `+me` (media extension)
//!   instances at disjoint placements: only one instance can own the OFA.
//!   Decoder and JPEG counts are not used as counters: NVML reports the
//!   `+me` profile with all of them while the plain profiles also report
//!   theirs, so they do not add up to the GPU's total.
//! * `mig-<profile>-instances`, value = the profile's `maxInstances`, only for
//!   profiles whose NVML instance limit is lower than the number of disjoint
//!   placements (again `+me`): NVML's own limit, stated as a counter.
//!
//! Consumption:
//!
//! * Whole GPU: every counter, in full.
//! * Each of the two share devices (`Isolated`, `Shared`): every counter, in
//!   full. They are `allowMultipleAllocations` devices, and the scheduler
//!   charges a multi-allocatable device's counters once, at its first
//!   allocation; later claims on the same device only consume its
//!   capacity (`memory`, `cores`). So the first `Isolated` claim takes the
//!   whole counter set for the `Isolated` device: the whole GPU, every MIG
//!   device and the `Shared` device no longer fit, while further `Isolated`
//!   claims pack onto the same device until its capacity is used up. When the
//!   last claim goes, the counters come back and any mode can win again.
//! * A MIG device: the memory slices of its placement, its compute slices,
//!   its OFA engines, and
//!   one unit of its profile's instance counter where there is one. Disjoint
//!   placements coexist; overlapping ones, the whole GPU and the share
//!   devices (which need every slice) are excluded.
//!
//! Net effect, enforced by the stock scheduler: whole GPU never beside
//! anything; `Isolated` never beside `Shared`; shares of one level pack up to
//! capacity; MIG excludes whole and shares, and MIG devices only coexist in
//! placements NVML could create together.
//!
//! Memory in bytes is deliberately not a counter: the MIG profile sizes NVML
//! reports do not always add up to the card's total (rounding), and a byte
//! counter would then refuse valid MIG layouts.
//!
//! Pre-existing MIG instances (not created by Tessera) are published as
//! static devices without counters; they block whole/share devices and
//! overlapping placements by not publishing those at all (see `plan`).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Counter, CounterSet, DeviceCounterConsumption};
use tessera_api::inventory::{MigPlacement, MigProfile};

use super::{naming, quantity};

/// Counter name of memory slice `i`.
pub fn memory_slice(i: u32) -> String {
    format!("memory-slice-{i}")
}

/// Counter name of the compute slices.
pub const COMPUTE_SLICES: &str = "compute-slices";

/// Counter name of the optical-flow engines.
pub const OFA_ENGINES: &str = "ofa-engines";

/// Counter name of a profile's instance limit.
pub fn profile_instances(profile: &str) -> String {
    format!("mig-{}-instances", naming::slug(profile))
}

/// The counter set of one GPU and how its devices consume it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCounters {
    /// Counter-set name, `gpu-<n>`.
    pub name: String,
    /// Counter name -> capacity.
    pub counters: BTreeMap<String, u64>,
    /// Profile id -> its instance counter, where it has one.
    profile_counters: BTreeMap<u32, String>,
}

/// What one device consumes from one counter set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumption {
    pub counter_set: String,
    pub counters: BTreeMap<String, u64>,
}

impl GpuCounters {
    /// Counters for GPU `n`. `profiles` are all MIG profiles of the GPU
    /// (they fix the slice counts); `dynamic_profiles` those offered as
    /// dynamic MIG devices. Without dynamic MIG the set is a single
    /// `memory-slice-0` token standing for the whole framebuffer.
    pub fn new(n: u32, profiles: &[MigProfile], dynamic_profiles: &[&MigProfile]) -> Self {
        let mut counters = BTreeMap::new();
        let mut profile_counters = BTreeMap::new();
        if dynamic_profiles.is_empty() {
            counters.insert(memory_slice(0), 1);
            return GpuCounters {
                name: naming::counter_set(n),
                counters,
                profile_counters,
            };
        }
        for i in 0..memory_slice_count(profiles).max(1) {
            counters.insert(memory_slice(i), 1);
        }
        let compute = profiles.iter().map(|p| p.slices).max().unwrap_or(0);
        if compute > 0 {
            counters.insert(COMPUTE_SLICES.to_string(), u64::from(compute));
        }
        let ofa = profiles
            .iter()
            .map(|p| p.engines.ofa_engines)
            .max()
            .unwrap_or(0);
        if ofa > 0 && dynamic_profiles.iter().any(|p| p.engines.ofa_engines > 0) {
            counters.insert(OFA_ENGINES.to_string(), u64::from(ofa));
        }
        for profile in dynamic_profiles {
            if profile.max_instances > 0
                && profile.max_instances < max_disjoint(&profile.placements)
            {
                let name = profile_instances(&profile.name);
                counters.insert(name.clone(), u64::from(profile.max_instances));
                profile_counters.insert(profile.id, name);
            }
        }
        GpuCounters {
            name: naming::counter_set(n),
            counters,
            profile_counters,
        }
    }

    /// Everything, in full: the whole GPU and the share devices.
    pub fn everything(&self) -> Consumption {
        Consumption {
            counter_set: self.name.clone(),
            counters: self.counters.clone(),
        }
    }

    /// A MIG device of `profile` at `placement`.
    pub fn mig(&self, profile: &MigProfile, placement: MigPlacement) -> Consumption {
        let mut counters = BTreeMap::new();
        for i in placement.start..placement.start + placement.size {
            counters.insert(memory_slice(i), 1);
        }
        if profile.slices > 0 && self.counters.contains_key(COMPUTE_SLICES) {
            counters.insert(COMPUTE_SLICES.to_string(), u64::from(profile.slices));
        }
        if profile.engines.ofa_engines > 0 && self.counters.contains_key(OFA_ENGINES) {
            counters.insert(
                OFA_ENGINES.to_string(),
                u64::from(profile.engines.ofa_engines),
            );
        }
        if let Some(name) = self.profile_counters.get(&profile.id) {
            counters.insert(name.clone(), 1);
        }
        Consumption {
            counter_set: self.name.clone(),
            counters,
        }
    }

    /// The API object.
    pub fn to_counter_set(&self) -> CounterSet {
        CounterSet {
            name: self.name.clone(),
            counters: to_api_counters(&self.counters),
        }
    }
}

impl Consumption {
    /// The API object.
    pub fn to_api(&self) -> DeviceCounterConsumption {
        DeviceCounterConsumption {
            counter_set: self.counter_set.clone(),
            counters: to_api_counters(&self.counters),
            // Named by the model where the server keeps them (`groups`).
            compatibility_groups: None,
        }
    }
}

fn to_api_counters(counters: &BTreeMap<String, u64>) -> BTreeMap<String, Counter> {
    counters
        .iter()
        .map(|(name, value)| {
            (
                name.clone(),
                Counter {
                    value: quantity::count(*value),
                },
            )
        })
        .collect()
}

/// Number of memory slices a GPU has: the end of its furthest placement.
pub fn memory_slice_count(profiles: &[MigProfile]) -> u32 {
    profiles
        .iter()
        .flat_map(|p| &p.placements)
        .map(|pl| pl.start + pl.size)
        .max()
        .unwrap_or(0)
}

/// Most placements of one profile that fit together (interval scheduling:
/// greedily by end).
fn max_disjoint(placements: &[MigPlacement]) -> u32 {
    let mut sorted: Vec<_> = placements.iter().filter(|p| p.size > 0).collect();
    sorted.sort_by_key(|p| (p.start + p.size, p.start));
    let mut count = 0;
    let mut free_from = 0;
    for p in sorted {
        if p.start >= free_from {
            count += 1;
            free_from = p.start + p.size;
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pl(start: u32, size: u32) -> MigPlacement {
        MigPlacement { start, size }
    }

    #[test]
    fn disjoint_placements() {
        let ones: Vec<_> = (0..7).map(|s| pl(s, 1)).collect();
        assert_eq!(max_disjoint(&ones), 7);
        assert_eq!(max_disjoint(&[pl(0, 4), pl(4, 4)]), 2);
        assert_eq!(max_disjoint(&[pl(0, 8)]), 1);
        assert_eq!(max_disjoint(&[pl(0, 4), pl(2, 4), pl(4, 4)]), 2);
        assert_eq!(max_disjoint(&[]), 0);
    }
}
