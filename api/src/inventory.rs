//! What a node has: physical GPUs, their MIG capabilities and the MIG
//! instances that exist right now.
//!
//! Data flows one way: NVML -> [`Inventory`] -> ResourceSlices. The driver
//! fills this in through nvml-wrapper only; everything downstream reads it and
//! never talks to NVML itself. Field names serialize in camelCase because
//! operators read this as YAML/JSON (`tessera inventory`).

use serde::{Deserialize, Serialize};

/// Everything discovered on one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Inventory {
    /// Kernel driver version as NVML reports it, e.g. `550.90.07`.
    pub driver_version: String,
    /// Highest CUDA version the driver supports, `major.minor`, e.g. `12.4`.
    pub cuda_driver_version: String,
    /// Physical GPUs in NVML index order.
    pub gpus: Vec<Gpu>,
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    /// `GPU-xxxxxxxx-...`; the stable identity of the card.
    pub uuid: String,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: String,
    /// Brand, lower case as NVIDIA's DRA driver publishes it, e.g. `nvidia`, `tesla`.
    pub brand: String,
    /// Architecture, lower case, e.g. `turing`, `ampere`, `ada`, `hopper`.
    pub architecture: String,
    /// CUDA compute capability `major.minor`, e.g. `9.0`.
    pub cuda_compute_capability: String,
    /// PCI bus id in the kernel's (sysfs) form, which is what the
    /// `resource.kubernetes.io/pciBusID` attribute takes: lower case, 4-digit
    /// domain, e.g. `0000:1b:00.0` (NVML itself reports `00000000:1B:00.0`).
    pub pci_bus_id: String,
    /// Total framebuffer memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessor count.
    pub multiprocessors: u32,
    /// Device minor number (`/dev/nvidiaN`). Needed for device nodes at
    /// prepare time; never published as an attribute because it is not stable.
    pub minor: u32,
    /// MIG capability and state.
    pub mig: Mig,
}

/// MIG state of one GPU. A GPU that cannot do MIG at all is a distinct state
/// from one that can but has it switched off: the first is never offered MIG
/// devices, the second may be (dynamic MIG) where policy allows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "camelCase")]
pub enum Mig {
    /// NVML answered NOT_SUPPORTED (e.g. T4, L4).
    NotSupported,
    /// MIG capable, mode off.
    #[serde(rename_all = "camelCase")]
    Disabled { profiles: Vec<MigProfile> },
    /// MIG mode on; `instances` are the MIG devices that exist now.
    #[serde(rename_all = "camelCase")]
    Enabled {
        profiles: Vec<MigProfile>,
        instances: Vec<MigInstance>,
    },
}

impl Mig {
    /// Profiles this GPU supports (empty when MIG is not supported).
    pub fn profiles(&self) -> &[MigProfile] {
        match self {
            Mig::NotSupported => &[],
            Mig::Disabled { profiles } | Mig::Enabled { profiles, .. } => profiles,
        }
    }

    /// MIG devices that exist now (empty unless MIG mode is on).
    pub fn instances(&self) -> &[MigInstance] {
        match self {
            Mig::Enabled { instances, .. } => instances,
            _ => &[],
        }
    }
}

/// A GPU instance profile (a full-GPU-instance compute profile), e.g. `1g.10gb`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    /// NVML GPU instance profile id (`nvmlGpuInstanceProfileInfo_t.id`).
    pub id: u32,
    /// Canonical name, e.g. `1g.10gb`, `1g.10gb+me`.
    pub name: String,
    /// Compute slices (GPCs) it takes, the `N` of `Ng`. The memory slices it
    /// takes are its placements' `size` (e.g. 4 for `3g.20gb` on an A100).
    pub slices: u32,
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    pub engines: MigEngines,
    /// How many instances of this profile fit on an empty GPU.
    pub max_instances: u32,
    /// Every valid placement on the GPU.
    pub placements: Vec<MigPlacement>,
}

/// Hardware engines owned by a MIG profile or instance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigEngines {
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
}

/// A range of memory slices on the GPU, `[start, start+size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigPlacement {
    pub start: u32,
    pub size: u32,
}

/// A MIG device that exists (GPU instance + its compute instance).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigInstance {
    /// `MIG-xxxxxxxx-...`.
    pub uuid: String,
    /// Name of the profile it was created from, e.g. `3g.40gb`; prefixed with
    /// `<n>c.` (`1c.3g.40gb`) when its compute instance spans only part of
    /// the GPU instance.
    pub profile: String,
    /// NVML GPU instance profile id.
    pub profile_id: u32,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    /// Where its GPU instance sits, in memory slices.
    pub placement: MigPlacement,
    pub memory_bytes: u64,
    /// SMs of its compute instance.
    pub multiprocessors: u32,
    pub engines: MigEngines,
}
