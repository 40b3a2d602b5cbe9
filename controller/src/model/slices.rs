//! Packing devices and counter sets into ResourceSlices within the API
//! limits, and checking a pool against those limits.
//!
//! Layout of the node's pool (pool name = node name):
//!
//! 1. Counter slices: the GPUs' counter sets, at most `max_counter_sets` per
//!    slice, in GPU order. Since 1.35 a slice carries either `sharedCounters`
//!    or `devices`, never both.
//! 2. Device slices: every device of the node in the order a claim most
//!    likely wants it, whole GPUs first, then shares, then MIG devices, then
//!    the monitoring devices (each group in GPU order), packed as full as
//!    the limits allow (64 devices when any consumes counters or carries a
//!    taint, 128 otherwise).
//!
//! Why that order: the scheduler's allocator walks a pool's device slices
//! by name and each slice's devices in order, and for every device not in
//! use it decodes the device and evaluates the class's CEL selector. With a
//! GPU's 29 devices together, a claim for a whole GPU evaluated the 28
//! others of every GPU before a free one: on 24 GPUs with 12 taken, 336
//! evaluations and about 7 ms per pod per node, against one evaluation
//! past the taken GPUs (which it skips without evaluating) now. Any change
//! rewrites every slice with the next pool generation anyway, so grouping
//! by GPU saved no writes.
//!
//! Slice `k` is named `<node>-<driver>-<k>` with `k` of at least three
//! digits, so that name order is slice order; every slice carries the same
//! pool generation and the total slice count.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    CounterSet, Device, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::devices::DeviceKind;
use super::naming::{self, DriverName};
use super::plan::{GpuOutput, Planned};
use super::{ModelError, SliceLimits, quantity};

/// What goes into one slice.
enum Content {
    Counters(Vec<CounterSet>),
    Devices(Vec<Device>),
}

/// Identity and metadata shared by all slices of the pool.
pub struct PoolIdentity<'a> {
    pub node: &'a str,
    pub driver: &'a DriverName,
    pub generation: i64,
    pub owner: Option<&'a OwnerReference>,
}

/// Packs the planned GPUs into slices.
pub fn assemble(
    pool: &PoolIdentity<'_>,
    limits: &SliceLimits,
    gpus: Vec<GpuOutput>,
) -> Vec<ResourceSlice> {
    let mut contents = Vec::new();

    let counter_sets: Vec<CounterSet> = gpus
        .iter()
        .filter_map(|g| g.counters.as_ref().map(|c| c.to_counter_set()))
        .collect();
    for chunk in counter_sets.chunks(limits.max_counter_sets.max(1)) {
        contents.push(Content::Counters(chunk.to_vec()));
    }
    let devices = gpus.into_iter().flat_map(|g| g.devices).collect();
    contents.extend(
        pack_devices(limits, devices)
            .into_iter()
            .map(Content::Devices),
    );

    let count = i64::try_from(contents.len()).unwrap_or(i64::MAX);
    contents
        .into_iter()
        .enumerate()
        .map(|(k, content)| {
            let (devices, shared_counters) = match content {
                Content::Counters(sets) => (None, Some(sets)),
                Content::Devices(devices) => (Some(devices), None),
            };
            ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(naming::slice_name(pool.node, pool.driver, k)),
                    owner_references: pool.owner.map(|o| vec![o.clone()]),
                    ..ObjectMeta::default()
                },
                spec: ResourceSliceSpec {
                    driver: pool.driver.as_str().to_string(),
                    node_name: Some(pool.node.to_string()),
                    pool: ResourcePool {
                        name: pool.node.to_string(),
                        generation: pool.generation,
                        resource_slice_count: count,
                    },
                    devices,
                    shared_counters,
                    ..ResourceSliceSpec::default()
                },
            }
        })
        .collect()
}

/// Where a device comes in the allocator's walk: what most claims ask for
/// first (see the module docs).
fn walk_rank(kind: &DeviceKind) -> u8 {
    match kind {
        DeviceKind::Whole => 0,
        DeviceKind::Share { .. } | DeviceKind::Replica { .. } => 1,
        DeviceKind::Mig { .. } => 2,
        DeviceKind::Monitor => 3,
    }
}

/// The devices (in GPU order) in walk order, cut into slices as full as
/// the limits allow.
fn pack_devices(limits: &SliceLimits, mut devices: Vec<Planned>) -> Vec<Vec<Device>> {
    // Stable: each group keeps GPU order and each GPU's own order.
    devices.sort_by_key(|p| walk_rank(&p.reference.kind));
    let mut slices: Vec<Vec<Device>> = Vec::new();
    let mut advanced = false;
    for device in devices.into_iter().map(|p| p.device) {
        let with = advanced || uses_advanced_features(&device);
        let room = if with {
            limits.max_devices_with_counters
        } else {
            limits.max_devices
        };
        match slices.last_mut() {
            Some(slice) if slice.len() < room.max(1) => {
                slice.push(device);
                advanced = with;
            }
            _ => {
                advanced = uses_advanced_features(&device);
                slices.push(vec![device]);
            }
        }
    }
    slices
}

fn consumes_counters(device: &Device) -> bool {
    device
        .consumes_counters
        .as_ref()
        .is_some_and(|c| !c.is_empty())
}

/// Whether the device counts toward the lower per-slice limit: it consumes
/// counters or carries taints (the API server's "advanced features").
fn uses_advanced_features(device: &Device) -> bool {
    consumes_counters(device) || device.taints.as_ref().is_some_and(|t| !t.is_empty())
}

/// Whether two sets of slices of one pool publish the same thing: same
/// names, owners and specs, ignoring the pool generation and everything the
/// server adds to metadata (uid, resourceVersion, managedFields, ...). The
/// publisher writes only when this is false, then with the next generation.
pub fn same_content(desired: &[ResourceSlice], existing: &[ResourceSlice]) -> bool {
    let key = |s: &ResourceSlice| {
        let mut spec = s.spec.clone();
        spec.pool.generation = 0;
        (
            s.metadata.name.clone(),
            s.metadata.owner_references.clone(),
            spec,
        )
    };
    let mut a: Vec<_> = desired.iter().map(key).collect();
    let mut b: Vec<_> = existing.iter().map(key).collect();
    a.sort_by(|x, y| x.0.cmp(&y.0));
    b.sort_by(|x, y| x.0.cmp(&y.0));
    a == b
}

/// Checks a pool's slices against the limits and the invariants the API
/// server and scheduler rely on: names valid and unique, either counters or
/// devices per slice, one pool generation and slice count, every counter
/// consumption pointing at an existing counter with enough capacity.
pub fn check_pool(slices: &[ResourceSlice], limits: &SliceLimits) -> Result<(), ModelError> {
    let mut counter_sets: BTreeMap<&str, &CounterSet> = BTreeMap::new();
    let mut device_names = BTreeSet::new();
    let mut slice_names = BTreeSet::new();
    for slice in slices {
        let name = slice.metadata.name.as_deref().unwrap_or_default();
        if !naming::is_dns_subdomain(name) || !slice_names.insert(name) {
            return fail(format!("slice name {name:?} invalid or duplicate"));
        }
        check_pool_identity(name, slice, slices)?;
        let spec = &slice.spec;
        if spec.devices.is_some() && spec.shared_counters.is_some() {
            return fail(format!("{name}: both devices and sharedCounters"));
        }
        if let Some(sets) = &spec.shared_counters {
            check_counter_sets(name, sets, limits, &mut counter_sets)?;
        }
        if let Some(devices) = &spec.devices {
            check_devices(name, devices, limits, &mut device_names)?;
        }
    }
    check_consumptions(slices, &counter_sets)
}

fn fail<T>(message: String) -> Result<T, ModelError> {
    Err(ModelError::Limit(message))
}

/// Every slice names the same pool generation and slice count, and the
/// count is the number of slices.
fn check_pool_identity(
    name: &str,
    slice: &ResourceSlice,
    slices: &[ResourceSlice],
) -> Result<(), ModelError> {
    let pool = &slice.spec.pool;
    if *pool != slices[0].spec.pool
        || usize::try_from(pool.resource_slice_count) != Ok(slices.len())
    {
        return fail(format!("{name}: pool identity differs between slices"));
    }
    Ok(())
}

/// A slice's counter sets are within the limits, valid and defined once
/// in the pool; collects them into `defined`.
fn check_counter_sets<'s>(
    name: &str,
    sets: &'s [CounterSet],
    limits: &SliceLimits,
    defined: &mut BTreeMap<&'s str, &'s CounterSet>,
) -> Result<(), ModelError> {
    if sets.len() > limits.max_counter_sets {
        return fail(format!("{name}: {} counter sets", sets.len()));
    }
    for set in sets {
        if !naming::is_dns_label(&set.name)
            || set.counters.is_empty()
            || set.counters.len() > limits.max_counters_per_set
            || !set.counters.keys().all(|c| naming::is_dns_label(c))
        {
            return fail(format!("{name}: counter set {} invalid", set.name));
        }
        if defined.insert(&set.name, set).is_some() {
            return fail(format!("counter set {} defined twice", set.name));
        }
    }
    Ok(())
}

/// A slice's devices are within the limits, valid and unique in the pool.
fn check_devices<'s>(
    name: &str,
    devices: &'s [Device],
    limits: &SliceLimits,
    seen: &mut BTreeSet<&'s str>,
) -> Result<(), ModelError> {
    let max = if devices.iter().any(uses_advanced_features) {
        limits.max_devices_with_counters
    } else {
        limits.max_devices
    };
    if devices.len() > max {
        return fail(format!("{name}: {} devices, limit {max}", devices.len()));
    }
    for device in devices {
        check_device(name, device, limits)?;
        if !seen.insert(device.name.as_str()) {
            return fail(format!("device {} published twice", device.name));
        }
    }
    Ok(())
}

/// Every counter consumption points at a counter set of the pool and
/// stays within the counter's capacity.
fn check_consumptions(
    slices: &[ResourceSlice],
    counter_sets: &BTreeMap<&str, &CounterSet>,
) -> Result<(), ModelError> {
    for device in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
        for consumption in device.consumes_counters.iter().flatten() {
            let Some(set) = counter_sets.get(consumption.counter_set.as_str()) else {
                return fail(format!(
                    "device {} consumes from unknown counter set {}",
                    device.name, consumption.counter_set
                ));
            };
            for (counter, amount) in &consumption.counters {
                let capacity = set
                    .counters
                    .get(counter)
                    .and_then(|c| quantity::parse_integer(&c.value));
                let amount = quantity::parse_integer(&amount.value);
                match (capacity, amount) {
                    (Some(cap), Some(a)) if a <= cap => {}
                    _ => {
                        return fail(format!(
                            "device {} consumes {counter} beyond {}",
                            device.name, consumption.counter_set
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn check_device(slice: &str, device: &Device, limits: &SliceLimits) -> Result<(), ModelError> {
    let fail = |msg: String| {
        Err(ModelError::Limit(format!(
            "{slice}: device {}: {msg}",
            device.name
        )))
    };
    if !naming::is_dns_label(&device.name) {
        return fail("name is not a DNS label".into());
    }
    let attrs = device.attributes.as_ref().map_or(0, BTreeMap::len);
    let caps = device.capacity.as_ref().map_or(0, BTreeMap::len);
    if attrs + caps > limits.max_attributes_and_capacities {
        return fail(format!("{} attributes and capacities", attrs + caps));
    }
    for (key, value) in device.attributes.iter().flatten() {
        let set = [
            value.bool.is_some(),
            value.int.is_some(),
            value.string.is_some(),
            value.version.is_some(),
        ]
        .iter()
        .filter(|s| **s)
        .count();
        let long = value
            .string
            .as_ref()
            .or(value.version.as_ref())
            .is_some_and(|s| s.len() > 64);
        if set != 1 || long {
            return fail(format!("attribute {key} invalid"));
        }
    }
    let multiple = device.allow_multiple_allocations == Some(true);
    for (key, capacity) in device.capacity.iter().flatten() {
        if capacity.request_policy.is_some() && !multiple {
            return fail(format!(
                "capacity {key} has a requestPolicy on an exclusive device"
            ));
        }
    }
    let taints = device.taints.as_deref().unwrap_or_default();
    if taints.len() > limits.max_taints_per_device {
        return fail(format!("{} taints", taints.len()));
    }
    for t in taints {
        let (prefix, name) = t.key.split_once('/').unwrap_or(("", &t.key));
        let value = t.value.as_deref().unwrap_or_default();
        let label_value = |v: &str| {
            v.len() <= 63
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
                && (v.is_empty()
                    || (v.starts_with(|c: char| c.is_ascii_alphanumeric())
                        && v.ends_with(|c: char| c.is_ascii_alphanumeric())))
        };
        if (!prefix.is_empty() && !naming::is_dns_subdomain(prefix))
            || name.is_empty()
            || !label_value(name)
            || !label_value(value)
            || !matches!(t.effect.as_str(), "None" | "NoSchedule" | "NoExecute")
        {
            return fail(format!("taint {}={value}:{} invalid", t.key, t.effect));
        }
    }
    let consumptions = device.consumes_counters.as_ref().map_or(0, Vec::len);
    if consumptions > limits.max_consumptions_per_device {
        return fail(format!("{consumptions} counter consumptions"));
    }
    for c in device.consumes_counters.iter().flatten() {
        if c.counters.is_empty() || c.counters.len() > limits.max_counters_per_consumption {
            return fail(format!("consumes {} counters", c.counters.len()));
        }
    }
    Ok(())
}
