//! The devices published per physical GPU: attributes, capacities and the
//! API objects.
//!
//! Attribute names follow NVIDIA's own DRA driver where it has one, so CEL
//! selectors carry over. Unqualified names live in the driver's domain
//! (`device.attributes["gpu.tessera.dev"].type`).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
};
use tessera_api::inventory::{Gpu, Inventory, MigEngines, MigInstance, MigPlacement, MigProfile};
use tessera_api::names::device_type;

use super::counters::Consumption;
use super::naming::{self, normalize_pci_bus_id};
use super::policy::{GpuPolicy, IsolationProvider, TimeSlice};
use super::{Note, quantity, version};

/// Attribute names: the shared vocabulary of `tessera_api::names`, plus
/// the one attribute only the model publishes.
pub mod attr {
    pub use tessera_api::names::attr::*;
    /// `Default` | `Short` | `Medium` | `Long`, on `Shared` share devices:
    /// the node policy's time-slice interval for that GPU.
    pub const TIME_SLICE: &str = "timeSlice";
}

/// Capacity names.
pub use tessera_api::names::capacity as cap;

/// Granularity of share memory requests: requests round up to a multiple.
pub const SHARE_MEMORY_STEP: u64 = 256 * 1024 * 1024;

pub use tessera_api::config::IsolationLevel;

/// What a published device stands for; the driver resolves an allocated
/// device name to physical resources through this, never by parsing names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRef {
    /// UUID of the physical GPU.
    pub gpu_uuid: String,
    /// Stable index `n` of the GPU.
    pub gpu_index: u32,
    pub kind: DeviceKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKind {
    /// The whole GPU, exclusive. With MIG mode on, prepare must switch it off
    /// (only published where that needs no reset).
    Whole,
    /// A MIG device. `existing` is the MIG UUID when the instance exists;
    /// `dynamic` devices are created at prepare and destroyed at unprepare.
    Mig {
        profile_id: u32,
        profile: String,
        placement: MigPlacement,
        existing: Option<String>,
        dynamic: bool,
    },
    /// A multi-allocatable share device (consumable `memory` and `cores`).
    Share {
        level: IsolationLevel,
        provider: Option<IsolationProvider>,
        time_slice: Option<TimeSlice>,
    },
    /// One of `replicas` exclusive share devices (static mode without
    /// consumable capacity): `memory_bytes` and `cores` percent each.
    Replica {
        level: IsolationLevel,
        index: u32,
        replicas: u32,
        memory_bytes: u64,
        cores: u32,
        provider: Option<IsolationProvider>,
        time_slice: Option<TimeSlice>,
    },
    /// The GPU's monitoring device, published in every model: no counters,
    /// no capacity, so a claim with `adminAccess` (which the scheduler lets
    /// share any device but still charges counters for) gets it whatever
    /// holds the GPU. Prepare refuses it to claims without admin access and
    /// gives the container what NVML needs, nothing to run work with.
    Monitor,
}

/// Attributes every device of a GPU carries.
#[derive(Debug, Clone)]
pub struct GpuFacts {
    common: BTreeMap<String, DeviceAttribute>,
    pci_bus_id: Option<String>,
}

impl GpuFacts {
    pub fn new(inventory: &Inventory, gpu: &Gpu, notes: &mut Vec<Note>) -> Self {
        let mut common = BTreeMap::new();
        put_string(
            &mut common,
            attr::PRODUCT_NAME,
            &gpu.product_name,
            gpu,
            notes,
        );
        put_string(&mut common, attr::BRAND, &gpu.brand, gpu, notes);
        put_string(
            &mut common,
            attr::ARCHITECTURE,
            &gpu.architecture,
            gpu,
            notes,
        );
        put_version(
            &mut common,
            attr::CUDA_COMPUTE_CAPABILITY,
            &gpu.cuda_compute_capability,
            gpu,
            notes,
        );
        put_version(
            &mut common,
            attr::DRIVER_VERSION,
            &inventory.driver_version,
            gpu,
            notes,
        );
        put_version(
            &mut common,
            attr::CUDA_DRIVER_VERSION,
            &inventory.cuda_driver_version,
            gpu,
            notes,
        );
        let pci_bus_id = normalize_pci_bus_id(&gpu.pci_bus_id);
        if pci_bus_id.is_none() {
            notes.push(Note::gpu(
                gpu,
                format!(
                    "PCI bus id {:?} is not dddd:bb:dd.f; {} omitted",
                    gpu.pci_bus_id,
                    attr::PCI_BUS_ID
                ),
            ));
        }
        GpuFacts { common, pci_bus_id }
    }

    fn base(&self, kind: &str) -> BTreeMap<String, DeviceAttribute> {
        let mut attrs = self.common.clone();
        attrs.insert(attr::TYPE.into(), string(kind));
        attrs
    }
}

/// The whole GPU.
pub fn whole(name: &str, gpu: &Gpu, facts: &GpuFacts, consumes: Option<Consumption>) -> Device {
    let mut attributes = facts.base(device_type::GPU);
    attributes.insert(attr::UUID.into(), string(&gpu.uuid));
    if let Some(bus) = &facts.pci_bus_id {
        attributes.insert(attr::PCI_BUS_ID.into(), string(bus));
        attributes.insert(attr::PCIE_BUS_ID.into(), string(bus));
    }
    let mut capacity = BTreeMap::new();
    capacity.insert(cap::MEMORY.into(), fixed(quantity::bytes(gpu.memory_bytes)));
    capacity.insert(
        cap::MULTIPROCESSORS.into(),
        fixed(quantity::count(gpu.multiprocessors.into())),
    );
    device(name, attributes, capacity, consumes, false)
}

/// The GPU's monitoring device: the card's `uuid`, no capacity, no
/// counters, exclusive (admin access ignores that: any number of adminAccess
/// claims can have it, a claim without admin access is refused at prepare).
pub fn monitor(name: &str, gpu: &Gpu, facts: &GpuFacts) -> Device {
    let mut attributes = facts.base(device_type::MONITOR);
    attributes.insert(attr::UUID.into(), string(&gpu.uuid));
    attributes.insert(attr::PARENT_UUID.into(), string(&gpu.uuid));
    let mut device = device(name, attributes, BTreeMap::new(), None, false);
    device.capacity = None;
    device
}

/// The most claims one share device can hold: each consumes at least one
/// percent of its `cores` (and at least one memory step).
pub const MAX_SHARE_CLAIMS: u64 = 100;

/// GPU memory an MPS server of a claim of `level` takes beside the claim:
/// the policy's reserve for an Isolated share served by MPS, nothing
/// otherwise (HAMi-core and Shared shares run no server).
pub fn server_reserve(level: IsolationLevel, policy: &GpuPolicy) -> u64 {
    match (level, policy.isolation_provider) {
        (IsolationLevel::Isolated, IsolationProvider::Mps) => policy.mps_server_reserve_bytes,
        _ => 0,
    }
}

/// Most claims a share device publishing `memory` bytes can hold at once.
pub fn max_share_claims(memory: u64) -> u64 {
    (memory / SHARE_MEMORY_STEP).min(MAX_SHARE_CLAIMS)
}

/// The `memory` an Isolated share device publishes on a GPU of
/// `gpu_memory` bytes when each claim's MPS server takes `reserve` bytes
/// that no counter sees: the most, in whole steps, such that the claims
/// the scheduler can place (their consumed memory adding up to at most
/// that, each at least one step and one percent of cores) fit together
/// with a server each. The claims still get all the memory they consume.
///
/// Two bounds, each safe on its own, the larger one is the answer: at most
/// [`MAX_SHARE_CLAIMS`] servers (capacity + 100 reserves), or at most one
/// server per step (capacity x (1 + reserve / step)).
/// Without a reserve it is the GPU's memory.
pub fn isolated_share_memory(gpu_memory: u64, reserve: u64) -> u64 {
    if reserve == 0 {
        return gpu_memory;
    }
    let step = SHARE_MEMORY_STEP;
    let whole_steps = |bytes: u64| bytes / step * step;
    let by_cores = whole_steps(gpu_memory.saturating_sub(MAX_SHARE_CLAIMS * reserve));
    let by_steps =
        u128::from(gpu_memory) * u128::from(step) / (u128::from(step) + u128::from(reserve));
    by_cores.max(whole_steps(by_steps as u64))
}

/// A share device of `level`, multi-allocatable, with consumable `memory`
/// (bytes, in steps of [`SHARE_MEMORY_STEP`]) and `cores` (percent, 1..=100).
/// A claim that names neither consumes the policy's default share of both.
/// An Isolated share served by MPS publishes less memory than the GPU has:
/// what its claims' servers take is kept out ([`isolated_share_memory`]).
/// Returns `None` when that leaves too little memory for one step.
pub fn share(
    name: &str,
    gpu: &Gpu,
    facts: &GpuFacts,
    level: IsolationLevel,
    policy: &GpuPolicy,
    consumes: Option<Consumption>,
) -> Option<Device> {
    let step = SHARE_MEMORY_STEP;
    let memory = isolated_share_memory(gpu.memory_bytes, server_reserve(level, policy));
    // The API wants min + step <= capacity.
    if memory < 2 * step {
        return None;
    }
    let max = memory / step * step;
    let pct = u64::from(policy.default_share_percent.clamp(1, 100));
    let share = u64::try_from(u128::from(gpu.memory_bytes) * u128::from(pct) / 100).unwrap_or(max);
    let default_memory = (share / step * step).clamp(step, max);

    let mut attributes = facts.base(device_type::SHARE);
    share_attributes(&mut attributes, gpu, level, policy);
    let mut capacity = BTreeMap::new();
    capacity.insert(
        cap::MEMORY.into(),
        DeviceCapacity {
            value: quantity::bytes(memory),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(quantity::bytes(default_memory)),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: quantity::bytes(step),
                    max: Some(quantity::bytes(max)),
                    step: Some(quantity::bytes(step)),
                }),
                valid_values: None,
            }),
        },
    );
    capacity.insert(
        cap::CORES.into(),
        DeviceCapacity {
            value: quantity::count(100),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(quantity::count(pct)),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: quantity::count(1),
                    max: Some(quantity::count(100)),
                    step: Some(quantity::count(1)),
                }),
                valid_values: None,
            }),
        },
    );
    Some(device(name, attributes, capacity, consumes, true))
}

/// Static-mode replica `index` of `replicas`: exclusive, an even split of
/// memory and compute as (informational) capacity.
pub fn replica(
    name: &str,
    gpu: &Gpu,
    facts: &GpuFacts,
    level: IsolationLevel,
    policy: &GpuPolicy,
    replicas: u32,
) -> Device {
    let mut attributes = facts.base(device_type::SHARE);
    share_attributes(&mut attributes, gpu, level, policy);
    let mut capacity = BTreeMap::new();
    capacity.insert(
        cap::MEMORY.into(),
        fixed(quantity::bytes(replica_memory(
            gpu,
            replicas,
            server_reserve(level, policy),
        ))),
    );
    capacity.insert(
        cap::CORES.into(),
        fixed(quantity::count(replica_cores(replicas).into())),
    );
    device(name, attributes, capacity, None, false)
}

/// Memory of one replica: an even split, less what the replica's MPS
/// server takes beside it (`reserve`, see [`server_reserve`]), rounded
/// down to whole MiB.
pub fn replica_memory(gpu: &Gpu, replicas: u32, reserve: u64) -> u64 {
    let mib = 1024 * 1024;
    (gpu.memory_bytes / u64::from(replicas.max(1))).saturating_sub(reserve) / mib * mib
}

/// Compute percent of one replica.
pub fn replica_cores(replicas: u32) -> u32 {
    (100 / replicas.max(1)).max(1)
}

fn share_attributes(
    attributes: &mut BTreeMap<String, DeviceAttribute>,
    gpu: &Gpu,
    level: IsolationLevel,
    policy: &GpuPolicy,
) {
    // Per the shared vocabulary a share device carries the card's UUID both
    // as `uuid` and as `parentUUID`, so selectors written either way work.
    attributes.insert(attr::UUID.into(), string(&gpu.uuid));
    attributes.insert(attr::PARENT_UUID.into(), string(&gpu.uuid));
    attributes.insert(attr::ISOLATION_LEVEL.into(), string(level.as_str()));
    match level {
        IsolationLevel::Isolated => {
            attributes.insert(
                attr::ISOLATION_PROVIDER.into(),
                string(policy.isolation_provider.as_str()),
            );
        }
        IsolationLevel::Shared => {
            attributes.insert(attr::TIME_SLICE.into(), string(policy.time_slice.as_str()));
        }
    }
}

/// A MIG device: a dynamic placement (`uuid` = `None`) or an existing
/// instance (`uuid` = its MIG UUID).
pub struct MigSpec<'a> {
    pub profile: &'a str,
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    pub engines: MigEngines,
    pub uuid: Option<&'a str>,
}

impl<'a> MigSpec<'a> {
    pub fn from_profile(profile: &'a MigProfile) -> Self {
        MigSpec {
            profile: &profile.name,
            memory_bytes: profile.memory_bytes,
            multiprocessors: profile.multiprocessors,
            engines: profile.engines,
            uuid: None,
        }
    }

    pub fn from_instance(instance: &'a MigInstance) -> Self {
        MigSpec {
            profile: &instance.profile,
            memory_bytes: instance.memory_bytes,
            multiprocessors: instance.multiprocessors,
            engines: instance.engines,
            uuid: Some(&instance.uuid),
        }
    }
}

pub fn mig(
    name: &str,
    gpu: &Gpu,
    facts: &GpuFacts,
    spec: &MigSpec<'_>,
    consumes: Option<Consumption>,
) -> Device {
    let mut attributes = facts.base(device_type::MIG);
    attributes.insert(attr::PARENT_UUID.into(), string(&gpu.uuid));
    attributes.insert(attr::PROFILE.into(), string(spec.profile));
    if let Some(bus) = &facts.pci_bus_id {
        // NVIDIA's name only: the standard attribute means "this device is
        // that PCI function", which a MIG device is not.
        attributes.insert(attr::PCIE_BUS_ID.into(), string(bus));
    }
    if let Some(uuid) = spec.uuid {
        attributes.insert(attr::UUID.into(), string(uuid));
    }
    let e = spec.engines;
    let mut capacity = BTreeMap::new();
    for (key, value) in [
        (cap::MEMORY, quantity::bytes(spec.memory_bytes)),
        (
            cap::MULTIPROCESSORS,
            quantity::count(spec.multiprocessors.into()),
        ),
        (cap::COPY_ENGINES, quantity::count(e.copy_engines.into())),
        (cap::DECODERS, quantity::count(e.decoders.into())),
        (cap::ENCODERS, quantity::count(e.encoders.into())),
        (cap::JPEG_ENGINES, quantity::count(e.jpeg_engines.into())),
        (cap::OFA_ENGINES, quantity::count(e.ofa_engines.into())),
    ] {
        capacity.insert(key.to_string(), fixed(value));
    }
    device(name, attributes, capacity, consumes, false)
}

fn device(
    name: &str,
    attributes: BTreeMap<String, DeviceAttribute>,
    capacity: BTreeMap<String, DeviceCapacity>,
    consumes: Option<Consumption>,
    multiple: bool,
) -> Device {
    debug_assert!(naming::is_dns_label(name), "{name}");
    Device {
        name: name.to_string(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        consumes_counters: consumes.map(|c| vec![c.to_api()]),
        allow_multiple_allocations: multiple.then_some(true),
        ..Device::default()
    }
}

fn fixed(value: k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value,
        request_policy: None,
    }
}

fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_string()),
        ..DeviceAttribute::default()
    }
}

/// Attribute strings are limited to 64 bytes; longer values are cut at a
/// character boundary (and noted) rather than failing the whole node.
fn put_string(
    attrs: &mut BTreeMap<String, DeviceAttribute>,
    key: &str,
    value: &str,
    gpu: &Gpu,
    notes: &mut Vec<Note>,
) {
    let value = value.trim();
    if value.is_empty() {
        return;
    }
    let mut cut = value.len().min(64);
    while !value.is_char_boundary(cut) {
        cut -= 1;
    }
    if cut < value.len() {
        notes.push(Note::gpu(gpu, format!("{key} truncated to 64 bytes")));
    }
    attrs.insert(key.to_string(), string(&value[..cut]));
}

fn put_version(
    attrs: &mut BTreeMap<String, DeviceAttribute>,
    key: &str,
    raw: &str,
    gpu: &Gpu,
    notes: &mut Vec<Note>,
) {
    match version::semver(raw) {
        Some(v) => {
            attrs.insert(
                key.to_string(),
                DeviceAttribute {
                    version: Some(v),
                    ..DeviceAttribute::default()
                },
            );
        }
        None => notes.push(Note::gpu(
            gpu,
            format!("{key} {raw:?} is not a version; attribute omitted"),
        )),
    }
}
