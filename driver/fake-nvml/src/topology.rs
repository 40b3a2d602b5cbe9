//! The topology file: what the simulated machine has.
//!
//! The schema is documented for humans in `topologies/README.md`; this module
//! is its single source of truth in code. Loading validates the file against
//! the rules real hardware obeys (placements from the profile's list, no
//! overlapping memory slices, compute slices and instance counts within the
//! profile's limits), so a typo in a topology fails loudly at `nvmlInit`
//! instead of producing a machine that cannot exist.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::codes;
use crate::machine::placements;

/// A whole simulated machine.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Topology {
    /// `nvmlSystemGetDriverVersion`, e.g. `550.127.05`.
    pub driver_version: String,
    /// Highest CUDA version the driver supports, `major.minor` (`12.4`);
    /// `nvmlSystemGetCudaDriverVersion_v2` reports it as `1000*major + 10*minor`.
    pub cuda_driver_version: String,
    /// `nvmlSystemGetNVMLVersion`; defaults to `<cuda major>.<driver version>`.
    #[serde(default)]
    pub nvml_version: Option<String>,
    #[serde(default)]
    pub faults: Faults,
    /// Free-form map of GPU models. Only there so cards can refer to a model
    /// through a YAML anchor (`model: *h100`); never read directly.
    #[serde(default)]
    pub models: Option<serde::de::IgnoredAny>,
    /// Physical GPUs in NVML index order.
    pub gpus: Vec<Card>,
}

/// Machine-wide faults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Faults {
    /// Every `nvmlInit*` call fails with this return code, by name
    /// (`DRIVER_NOT_LOADED`, `NVML_ERROR_NO_PERMISSION`, ...).
    #[serde(default)]
    pub init: Option<String>,
}

/// One physical GPU: a model plus what is particular to this card.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Card {
    pub model: Model,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// NVML's form, `00000000:18:00.0` (the 4-digit-domain form is accepted).
    pub pci_bus_id: String,
    /// `/dev/nvidiaN`; defaults to the card's index.
    #[serde(default)]
    pub minor: Option<u32>,
    /// The GPU has fallen off the bus: every query on it answers GPU_IS_LOST.
    #[serde(default)]
    pub lost: bool,
    /// MIG state; only for models with a `mig` capability. Absent means
    /// MIG disabled with no instances.
    #[serde(default)]
    pub mig: Option<CardMig>,
}

/// Facts shared by every card of one product.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Model {
    /// Marketing name as `nvmlDeviceGetName` returns it.
    pub name: String,
    pub brand: Brand,
    pub architecture: Architecture,
    /// `major.minor`, e.g. `8.0`.
    pub compute_capability: String,
    /// Combined device and vendor id, e.g. `0x20B010DE`.
    pub pci_device_id: u32,
    #[serde(default)]
    pub pci_sub_system_id: u32,
    /// Total framebuffer memory in MiB, as `nvidia-smi` prints it.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Memory the driver reserves (reported by `nvmlDeviceGetMemoryInfo_v2`).
    #[serde(default, rename = "reservedMemoryMiB")]
    pub reserved_memory_mib: u64,
    pub multiprocessors: u32,
    /// `nvmlDeviceGetNumGpuCores`.
    pub cuda_cores: u32,
    /// Absent: the product cannot do MIG (every MIG call answers NOT_SUPPORTED).
    #[serde(default)]
    pub mig: Option<MigCapability>,
}

/// `nvmlBrandType_t`, lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Brand {
    Unknown,
    Quadro,
    Tesla,
    Nvs,
    Grid,
    Geforce,
    Titan,
    NvidiaVapps,
    NvidiaVpc,
    NvidiaVcs,
    NvidiaVws,
    NvidiaCloudGaming,
    QuadroRtx,
    NvidiaRtx,
    Nvidia,
    GeforceRtx,
    TitanRtx,
}

impl Brand {
    pub fn nvml(self) -> u32 {
        match self {
            Brand::Unknown => 0,
            Brand::Quadro => 1,
            Brand::Tesla => 2,
            Brand::Nvs => 3,
            Brand::Grid => 4,
            Brand::Geforce => 5,
            Brand::Titan => 6,
            Brand::NvidiaVapps => 7,
            Brand::NvidiaVpc => 8,
            Brand::NvidiaVcs => 9,
            Brand::NvidiaVws => 10,
            Brand::NvidiaCloudGaming => 11,
            Brand::QuadroRtx => 12,
            Brand::NvidiaRtx => 13,
            Brand::Nvidia => 14,
            Brand::GeforceRtx => 15,
            Brand::TitanRtx => 16,
        }
    }
}

/// `nvmlDeviceArchitecture_t`, lower case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Kepler,
    Maxwell,
    Pascal,
    Volta,
    Turing,
    Ampere,
    Ada,
    Hopper,
    Blackwell,
}

impl Architecture {
    pub fn nvml(self) -> u32 {
        match self {
            Architecture::Kepler => 2,
            Architecture::Maxwell => 3,
            Architecture::Pascal => 4,
            Architecture::Volta => 5,
            Architecture::Turing => 6,
            Architecture::Ampere => 7,
            Architecture::Ada => 8,
            Architecture::Hopper => 9,
            Architecture::Blackwell => 10,
        }
    }
}

/// What a MIG-capable product offers.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigCapability {
    /// Memory slices a placement indexes (8 on A100/H100).
    #[serde(default = "default_memory_slices")]
    pub memory_slices: u32,
    /// Compute slices (GPCs) available to instances (7 on A100/H100).
    #[serde(default = "default_compute_slices")]
    pub compute_slices: u32,
    /// `nvmlDeviceGetMaxMigDeviceCount`.
    #[serde(default = "default_max_devices")]
    pub max_devices: u32,
    pub profiles: Vec<Profile>,
}

fn default_memory_slices() -> u32 {
    8
}
fn default_compute_slices() -> u32 {
    7
}
fn default_max_devices() -> u32 {
    7
}

/// A GPU instance profile, as `nvmlDeviceGetGpuInstanceProfileInfo*` reports it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Profile {
    /// The `NVML_GPU_INSTANCE_PROFILE_*` constant the profile is queried by
    /// (0 = 1 slice, 1 = 2 slices, 2 = 3, 3 = 4, 4 = 7, 7 = 1 slice rev1
    /// (+me), 9 = 1 slice rev2 (double memory), ...).
    pub index: u32,
    /// The profile id (`nvmlGpuInstanceProfileInfo_t.id`, the `ID` column of
    /// `nvidia-smi mig -lgip`).
    pub id: u32,
    /// Name without the `MIG ` prefix, e.g. `1g.5gb+me`.
    pub name: String,
    /// Compute slices.
    pub slices: u32,
    /// Instances that fit on an empty GPU.
    pub instances: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub engines: Engines,
    #[serde(default)]
    pub p2p: bool,
    pub placements: Placements,
}

/// Engine counts of a profile.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Engines {
    pub copy: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg: u32,
    pub ofa: u32,
}

/// Where a profile may be placed: every start in `starts`, `size` memory slices long.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Placements {
    pub size: u32,
    pub starts: Vec<u32>,
}

/// MIG state of one card.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CardMig {
    pub mode: MigMode,
    /// Mode after the next GPU reset; defaults to `mode`.
    #[serde(default)]
    pub pending: Option<MigMode>,
    /// MIG devices that exist: each is a GPU instance holding one compute
    /// instance that spans it.
    #[serde(default)]
    pub instances: Vec<Instance>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MigMode {
    Enabled,
    Disabled,
}

/// One existing MIG device.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Instance {
    /// Profile name (`3g.20gb`).
    pub profile: String,
    /// First memory slice; must be one of the profile's placement starts.
    pub start: u32,
    /// Defaults to the id NVML gives an instance at that placement.
    #[serde(default)]
    pub gpu_instance_id: Option<u32>,
    /// `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` of the MIG device, when the
    /// GPU instance holds one compute instance spanning it.
    #[serde(default)]
    pub uuid: Option<String>,
    /// Instead of `uuid`: the compute instances the GPU instance is split
    /// into, placed first-fit in this order (ids 0, 1, ...).
    #[serde(default)]
    pub compute_instances: Vec<ComputeInstanceSpec>,
}

/// One compute instance of a split GPU instance (one MIG device).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ComputeInstanceSpec {
    /// Compute slices, e.g. 1 for a `1c.3g.20gb`.
    pub slices: u32,
    pub uuid: String,
}

/// A compute instance as laid out in its GPU instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeLayout {
    pub slices: u32,
    pub start: u32,
    pub uuid: String,
}

impl Instance {
    /// Its compute instances, in id order.
    pub fn compute_layout(&self, profile: &Profile) -> Result<Vec<ComputeLayout>, String> {
        match (&self.uuid, self.compute_instances.as_slice()) {
            (Some(uuid), []) => Ok(vec![ComputeLayout {
                slices: profile.slices,
                start: 0,
                uuid: uuid.clone(),
            }]),
            (None, cis) if !cis.is_empty() => {
                let mut taken: Vec<(u32, u32)> = Vec::new();
                let mut out = Vec::new();
                for ci in cis {
                    let start = placements::compute_placements(profile.slices, ci.slices)
                        .into_iter()
                        .find(|&s| taken.iter().all(|&t| !placements::overlaps(t, (s, ci.slices))))
                        .ok_or_else(|| {
                            format!(
                                "no room for a {}-slice compute instance in a {}-slice GPU instance",
                                ci.slices, profile.slices
                            )
                        })?;
                    taken.push((start, ci.slices));
                    out.push(ComputeLayout {
                        slices: ci.slices,
                        start,
                        uuid: ci.uuid.clone(),
                    });
                }
                Ok(out)
            }
            _ => Err("give either uuid (one compute instance spanning the GPU instance) or computeInstances".into()),
        }
    }
}

/// A PCI address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
    pub function: u32,
}

impl PciAddress {
    /// Parses `DDDDDDDD:BB:DD.F` or `DDDD:BB:DD.F` (hex, any case).
    pub fn parse(s: &str) -> Option<PciAddress> {
        let (domain, rest) = s.trim().split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (device, function) = rest.split_once('.')?;
        let hex = |p: &str, max_len: usize| {
            if p.is_empty() || p.len() > max_len || !p.chars().all(|c| c.is_ascii_hexdigit()) {
                None
            } else {
                u32::from_str_radix(p, 16).ok()
            }
        };
        Some(PciAddress {
            domain: hex(domain, 8)?,
            bus: hex(bus, 2)?,
            device: hex(device, 2)?,
            function: hex(function, 1)?,
        })
    }

    /// NVML's `busId`: `%08X:%02X:%02X.0`.
    pub fn nvml(&self) -> String {
        format!(
            "{:08X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }

    /// NVML's `busIdLegacy`: `%04X:%02X:%02X.0`.
    pub fn legacy(&self) -> String {
        format!(
            "{:04X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl Topology {
    /// Parses and validates a topology.
    pub fn parse(text: &str) -> Result<Topology, String> {
        let topology: Topology = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        topology.validate()?;
        Ok(topology)
    }

    /// `1000*major + 10*minor`.
    pub fn cuda_version_number(&self) -> Result<i32, String> {
        let (major, minor) = parse_major_minor(&self.cuda_driver_version).ok_or_else(|| {
            format!(
                "cudaDriverVersion {:?} is not major.minor",
                self.cuda_driver_version
            )
        })?;
        Ok(major * 1000 + minor * 10)
    }

    fn validate(&self) -> Result<(), String> {
        self.cuda_version_number()?;
        if let Some(code) = &self.faults.init {
            codes::by_name(code)
                .ok_or_else(|| format!("faults.init: unknown NVML return code {code:?}"))?;
        }
        let mut uuids = BTreeSet::new();
        let mut buses = BTreeSet::new();
        for (index, card) in self.gpus.iter().enumerate() {
            let at = |msg: String| format!("gpus[{index}] ({}): {msg}", card.uuid);
            if !is_uuid(&card.uuid, "GPU-") {
                return Err(at(
                    "uuid must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".into(),
                ));
            }
            if !uuids.insert(card.uuid.clone()) {
                return Err(at("duplicate uuid".into()));
            }
            let bus = PciAddress::parse(&card.pci_bus_id).ok_or_else(|| {
                at(format!(
                    "pciBusId {:?} is not DDDDDDDD:BB:DD.F",
                    card.pci_bus_id
                ))
            })?;
            if !buses.insert(bus.nvml()) {
                return Err(at("duplicate pciBusId".into()));
            }
            let model = &card.model;
            if parse_major_minor(&model.compute_capability).is_none() {
                return Err(at(format!(
                    "computeCapability {:?} is not major.minor",
                    model.compute_capability
                )));
            }
            if model.reserved_memory_mib > model.memory_mib {
                return Err(at("reservedMemoryMiB exceeds memoryMiB".into()));
            }
            if let Some(cap) = &model.mig {
                validate_capability(cap).map_err(at)?;
            }
            if let Some(mig) = &card.mig {
                let cap = model.mig.as_ref().ok_or_else(|| {
                    at("mig state given for a model without a mig capability".into())
                })?;
                if mig.mode == MigMode::Disabled && !mig.instances.is_empty() {
                    return Err(at("MIG instances need mig.mode: enabled".into()));
                }
                validate_instances(cap, &mig.instances, &mut uuids).map_err(at)?;
            }
        }
        Ok(())
    }
}

fn validate_capability(cap: &MigCapability) -> Result<(), String> {
    let mut indices = BTreeSet::new();
    let mut ids = BTreeSet::new();
    let mut names = BTreeSet::new();
    for p in &cap.profiles {
        let at = |msg: &str| format!("mig profile {}: {msg}", p.name);
        if p.index >= nvml_wrapper_sys::bindings::NVML_GPU_INSTANCE_PROFILE_COUNT {
            return Err(at("index is not an NVML_GPU_INSTANCE_PROFILE_* constant"));
        }
        if !indices.insert(p.index) || !ids.insert(p.id) || !names.insert(p.name.clone()) {
            return Err(at("duplicate index, id or name"));
        }
        if p.slices == 0 || p.slices > cap.compute_slices {
            return Err(at("slices out of range"));
        }
        if p.placements.size == 0 || p.placements.starts.is_empty() {
            return Err(at("placements must not be empty"));
        }
        for s in &p.placements.starts {
            if s + p.placements.size > cap.memory_slices {
                return Err(at("a placement runs past the last memory slice"));
            }
        }
    }
    Ok(())
}

fn validate_instances(
    cap: &MigCapability,
    instances: &[Instance],
    uuids: &mut BTreeSet<String>,
) -> Result<(), String> {
    let mut used = vec![false; cap.memory_slices as usize];
    let mut compute = 0;
    let mut per_profile: BTreeMap<u32, u32> = BTreeMap::new();
    let mut gi_ids = BTreeSet::new();
    for inst in instances {
        let at = |msg: String| format!("mig instance {}@{}: {msg}", inst.profile, inst.start);
        let p = cap
            .profiles
            .iter()
            .find(|p| p.name == inst.profile)
            .ok_or_else(|| at("no such profile on this model".into()))?;
        if !p.placements.starts.contains(&inst.start) {
            return Err(at(format!(
                "start must be one of {:?}",
                p.placements.starts
            )));
        }
        for slot in inst.start..inst.start + p.placements.size {
            if std::mem::replace(&mut used[slot as usize], true) {
                return Err(at(format!(
                    "memory slice {slot} is already used by another instance"
                )));
            }
        }
        compute += p.slices;
        if compute > cap.compute_slices {
            return Err(at(
                "instances need more compute slices than the GPU has".into()
            ));
        }
        let n = per_profile.entry(p.id).or_default();
        *n += 1;
        if *n > p.instances {
            return Err(at(format!(
                "at most {} instances of this profile fit",
                p.instances
            )));
        }
        let gi = inst.gpu_instance_id.unwrap_or_else(|| {
            default_gpu_instance_id(cap.memory_slices, inst.start, p.placements.size)
        });
        if !gi_ids.insert(gi) {
            return Err(at(format!("gpu instance id {gi} used twice")));
        }
        for ci in inst.compute_layout(p).map_err(at)? {
            if !is_uuid(&ci.uuid, "MIG-") {
                return Err(at(format!(
                    "uuid {} must look like MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                    ci.uuid
                )));
            }
            if !uuids.insert(ci.uuid.clone()) {
                return Err(at(format!("duplicate uuid {}", ci.uuid)));
            }
        }
    }
    Ok(())
}

/// The GPU instance id NVML gives an instance at `start` spanning `size`
/// memory slices. NVML numbers the nodes of a binary tree over the memory
/// slices level by level, the upper half of each level first: on an 8-slice
/// GPU the whole GPU is 0, the halves at 4 and 0 are 1 and 2, the quarters at
/// 4, 6, 0, 2 are 3..6 and the single slices at 4..7, 0..3 are 7..14 (seen on
/// A100: `1g.5gb` at 0:1 is instance 11, `2g.10gb` at 2:2 is 6, `3g.20gb` at
/// 4:4 is 1). For slice counts that are not a power of two, fall back to
/// numbering by start.
pub fn default_gpu_instance_id(memory_slices: u32, start: u32, size: u32) -> u32 {
    if memory_slices.is_power_of_two()
        && size.is_power_of_two()
        && size <= memory_slices
        && start.is_multiple_of(size)
    {
        let nodes = memory_slices / size;
        (nodes - 1) + ((start / size + nodes / 2) % nodes)
    } else {
        start + 1
    }
}

fn parse_major_minor(s: &str) -> Option<(i32, i32)> {
    let (major, minor) = s.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// `major.minor` as two numbers.
pub fn compute_capability(model: &Model) -> (i32, i32) {
    parse_major_minor(&model.compute_capability).unwrap_or((0, 0))
}

fn is_uuid(s: &str, prefix: &str) -> bool {
    let Some(rest) = s.strip_prefix(prefix) else {
        return false;
    };
    let groups: Vec<&str> = rest.split('-').collect();
    let lens = [8, 4, 4, 4, 12];
    groups.len() == lens.len()
        && groups
            .iter()
            .zip(lens)
            .all(|(g, n)| g.len() == n && g.chars().all(|c| c.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests;
