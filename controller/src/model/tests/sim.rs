//! A small stand-in for the scheduler's allocator, following the documented
//! rules: an exclusive device is allocated at most once; a device's counters
//! are charged when it goes from unallocated to allocated (once, also for
//! `allowMultipleAllocations` devices) and returned when its last allocation
//! goes; each allocation of a multi-allocatable device consumes capacity per
//! its request policy; devices whose consumptions name compatibility
//! groups are co-allocated on a counter set only while the groups of every
//! device allocated there intersect (KEP-5963). It proves the model's
//! counters express what we intend; the real kube-scheduler tests
//! (publisher issue) prove the scheduler agrees.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use crate::model::quantity::parse_integer;

pub struct Sim {
    devices: BTreeMap<String, Device>,
    remaining: BTreeMap<String, BTreeMap<String, u64>>,
    allocations: BTreeMap<String, Vec<BTreeMap<String, u64>>>,
    /// Counters are checked (off: compatibility groups alone decide).
    counters: bool,
}

impl Sim {
    pub fn new(slices: &[ResourceSlice]) -> Self {
        let mut devices = BTreeMap::new();
        let mut remaining = BTreeMap::new();
        for slice in slices {
            for set in slice.spec.shared_counters.iter().flatten() {
                let counters = set
                    .counters
                    .iter()
                    .map(|(k, v)| (k.clone(), parse_integer(&v.value).unwrap()))
                    .collect();
                remaining.insert(set.name.clone(), counters);
            }
            for device in slice.spec.devices.iter().flatten() {
                devices.insert(device.name.clone(), device.clone());
            }
        }
        Sim {
            devices,
            remaining,
            allocations: BTreeMap::new(),
            counters: true,
        }
    }

    /// The same, deciding by compatibility groups alone.
    pub fn groups_only(slices: &[ResourceSlice]) -> Self {
        Sim {
            counters: false,
            ..Sim::new(slices)
        }
    }

    /// Whether `dev`'s groups intersect those of every device allocated on
    /// each counter set it consumes from; no groups match only no groups.
    fn groups_admit(&self, dev: &Device) -> bool {
        let groups = |d: &Device, set: &str| -> Option<Vec<String>> {
            let c = d
                .consumes_counters
                .iter()
                .flatten()
                .find(|c| c.counter_set == set)?;
            Some(c.compatibility_groups.clone().unwrap_or_default())
        };
        dev.consumes_counters.iter().flatten().all(|c| {
            let mine = groups(dev, &c.counter_set).unwrap_or_default();
            let mut common: Option<Vec<String>> = Some(mine.clone());
            for name in self.allocations.keys() {
                let Some(theirs) = groups(&self.devices[name], &c.counter_set) else {
                    continue;
                };
                if mine.is_empty() != theirs.is_empty() {
                    return false;
                }
                common = common.map(|g| g.into_iter().filter(|x| theirs.contains(x)).collect());
            }
            mine.is_empty() || common.is_some_and(|g| !g.is_empty())
        })
    }

    /// Allocates `device` for one claim asking for `request` capacity.
    pub fn allocate(&mut self, device: &str, request: &[(&str, u64)]) -> Result<(), String> {
        let dev = self
            .devices
            .get(device)
            .ok_or_else(|| format!("no device {device}"))?;
        let multiple = dev.allow_multiple_allocations == Some(true);
        let existing = self.allocations.get(device).map_or(0, Vec::len);
        if existing > 0 && !multiple {
            return Err(format!("{device} already allocated"));
        }
        let consumed = if multiple {
            consumed_capacity(dev, request)?
        } else {
            BTreeMap::new()
        };
        if multiple {
            for (name, amount) in &consumed {
                let total: u64 = self
                    .allocations
                    .get(device)
                    .into_iter()
                    .flatten()
                    .map(|a| a[name])
                    .sum();
                let value = parse_integer(&dev.capacity.as_ref().unwrap()[name].value).unwrap();
                if total + amount > value {
                    return Err(format!("{device}: {name} exhausted"));
                }
            }
        }
        if existing == 0 && !self.groups_admit(dev) {
            return Err(format!("{device}: no compatibility group in common"));
        }
        if existing == 0 && self.counters {
            for c in dev.consumes_counters.iter().flatten() {
                let set = self
                    .remaining
                    .get(&c.counter_set)
                    .ok_or_else(|| format!("no counter set {}", c.counter_set))?;
                for (name, amount) in &c.counters {
                    let amount = parse_integer(&amount.value).unwrap();
                    if set.get(name).copied().unwrap_or(0) < amount {
                        return Err(format!("{device}: insufficient counter {name}"));
                    }
                }
            }
            for c in dev.consumes_counters.iter().flatten() {
                let set = self.remaining.get_mut(&c.counter_set).unwrap();
                for (name, amount) in &c.counters {
                    *set.get_mut(name).unwrap() -= parse_integer(&amount.value).unwrap();
                }
            }
        }
        self.allocations
            .entry(device.to_string())
            .or_default()
            .push(consumed);
        Ok(())
    }

    /// Records an allocation that already exists (a claim holds `device`),
    /// charging its counters as the device is published now, the way the
    /// scheduler rebuilds its counter usage from the allocated claims and the
    /// current slices. Nothing is refused: held counters may exceed what is
    /// left (then nothing else fits).
    pub fn hold(&mut self, device: &str) {
        let Some(dev) = self.devices.get(device) else {
            return;
        };
        let consumed = if dev.allow_multiple_allocations == Some(true) {
            consumed_capacity(dev, &[]).unwrap_or_default()
        } else {
            BTreeMap::new()
        };
        if !self.allocations.contains_key(device) {
            for c in dev.consumes_counters.iter().flatten() {
                let set = self.remaining.entry(c.counter_set.clone()).or_default();
                for (name, amount) in &c.counters {
                    let left = set.entry(name.clone()).or_default();
                    *left = left.saturating_sub(parse_integer(&amount.value).unwrap());
                }
            }
        }
        self.allocations
            .entry(device.to_string())
            .or_default()
            .push(consumed);
    }

    /// Releases one allocation of `device`.
    pub fn release(&mut self, device: &str) {
        let allocs = self.allocations.get_mut(device).expect("allocated");
        allocs.pop().expect("allocated");
        if allocs.is_empty() {
            self.allocations.remove(device);
            let dev = &self.devices[device];
            for c in dev.consumes_counters.iter().flatten() {
                let set = self.remaining.get_mut(&c.counter_set).unwrap();
                for (name, amount) in &c.counters {
                    *set.get_mut(name).unwrap() += parse_integer(&amount.value).unwrap();
                }
            }
        }
    }

    pub fn device_names(&self) -> impl Iterator<Item = &String> {
        self.devices.keys()
    }
}

/// Capacity one claim consumes from a multi-allocatable device.
fn consumed_capacity(
    dev: &Device,
    request: &[(&str, u64)],
) -> Result<BTreeMap<String, u64>, String> {
    let mut out = BTreeMap::new();
    for (name, capacity) in dev.capacity.iter().flatten() {
        let value = parse_integer(&capacity.value).unwrap();
        let asked = request.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        let Some(policy) = &capacity.request_policy else {
            out.insert(name.clone(), asked.unwrap_or(value));
            continue;
        };
        let mut amount = asked
            .or_else(|| policy.default.as_ref().and_then(parse_integer))
            .unwrap_or(value);
        if let Some(range) = &policy.valid_range {
            let min = parse_integer(&range.min).unwrap();
            amount = amount.max(min);
            if let Some(step) = range.step.as_ref().and_then(parse_integer) {
                amount = min + (amount - min).div_ceil(step) * step;
            }
            if let Some(max) = range.max.as_ref().and_then(parse_integer)
                && amount > max
            {
                return Err(format!("{}: {name} request above max", dev.name));
            }
        }
        out.insert(name.clone(), amount);
    }
    Ok(out)
}
