//! Names every Tessera crate must spell the same way: the driver name, the
//! device attributes and capacities published in ResourceSlices, and their
//! well-known values.
//!
//! Attribute names that NVIDIA's own DRA driver also publishes keep its
//! spelling so that users' CEL selectors carry over. In CEL they are read as
//! `device.attributes["gpu.tessera.dev"].productName`; fully qualified names
//! (with a `/`) stand on their own, e.g.
//! `device.attributes["resource.kubernetes.io"].pciBusID`.

/// Default driver name: the `driver` of our ResourceSlices, DeviceClass
/// selectors and opaque configs, and the domain of our unqualified
/// attribute names. Deployments may override it (one name per install).
pub const DEFAULT_DRIVER_NAME: &str = "gpu.tessera.dev";

/// Attribute names (keys of `devices[].attributes`).
pub mod attr {
    /// Device type, a string: [`super::device_type::GPU`],
    /// [`super::device_type::MIG`], [`super::device_type::SHARE`] or
    /// [`super::device_type::MONITOR`].
    pub const TYPE: &str = "type";
    /// UUID of the device: `GPU-…` for whole GPUs and share devices (the
    /// physical card), `MIG-…` for MIG devices that exist.
    pub const UUID: &str = "uuid";
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub const PRODUCT_NAME: &str = "productName";
    /// Brand, lower case, e.g. `nvidia`, `tesla`.
    pub const BRAND: &str = "brand";
    /// Architecture, lower case, e.g. `ampere`, `hopper`.
    pub const ARCHITECTURE: &str = "architecture";
    /// CUDA compute capability, a semantic version (`9.0.0`).
    pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
    /// Kernel driver version, a semantic version.
    pub const DRIVER_VERSION: &str = "driverVersion";
    /// Highest CUDA version the driver supports, a semantic version.
    pub const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
    /// PCI bus id of the physical card (Kubernetes' standard attribute, so
    /// fully qualified).
    pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
    /// The same PCI bus id under the name NVIDIA's DRA driver publishes it
    /// (so claims written for it carry over): on whole GPUs, and on MIG
    /// devices as the physical card's.
    pub const PCIE_BUS_ID: &str = "pcieBusID";
    /// For MIG and share devices: UUID of the physical GPU they live on.
    pub const PARENT_UUID: &str = "parentUUID";
    /// For MIG devices: the MIG profile, e.g. `1g.10gb`.
    pub const PROFILE: &str = "profile";
    /// For share devices: [`super::isolation_level::ISOLATED`] or
    /// [`super::isolation_level::SHARED`].
    pub const ISOLATION_LEVEL: &str = "isolationLevel";
    /// For isolated share devices: what enforces the limits,
    /// [`super::isolation_provider::MPS`] or
    /// [`super::isolation_provider::HAMI_CORE`].
    pub const ISOLATION_PROVIDER: &str = "isolationProvider";
}

/// Capacity names (keys of `devices[].capacity`).
pub mod capacity {
    /// Device memory, a quantity in bytes.
    pub const MEMORY: &str = "memory";
    /// Streaming multiprocessors.
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    /// Share devices: compute in percent of the card (0–100), consumable.
    pub const CORES: &str = "cores";
    /// MIG devices: copy engines.
    pub const COPY_ENGINES: &str = "copyEngines";
    /// MIG devices: video decoders.
    pub const DECODERS: &str = "decoders";
    /// MIG devices: video encoders.
    pub const ENCODERS: &str = "encoders";
    /// MIG devices: JPEG engines.
    pub const JPEG_ENGINES: &str = "jpegEngines";
    /// MIG devices: optical flow accelerators.
    pub const OFA_ENGINES: &str = "ofaEngines";
}

/// Values of [`attr::TYPE`].
pub mod device_type {
    /// A whole physical GPU, allocated exclusively.
    pub const GPU: &str = "gpu";
    /// A MIG instance (static, or created at prepare for dynamic MIG).
    pub const MIG: &str = "mig";
    /// A share of a physical GPU (`allowMultipleAllocations`).
    pub const SHARE: &str = "share";
    /// Read-only access to a physical GPU for monitoring agents (DCGM
    /// exporter, `nvidia-smi`): consumes nothing, allocated only to claims
    /// with `adminAccess: true`.
    pub const MONITOR: &str = "monitor";
}

/// Values of [`attr::ISOLATION_LEVEL`].
pub mod isolation_level {
    /// Memory and compute limits enforced per claim.
    pub const ISOLATED: &str = "Isolated";
    /// Burstable time-slicing; capacity is accounting only.
    pub const SHARED: &str = "Shared";
}

/// Values of [`attr::ISOLATION_PROVIDER`].
pub mod isolation_provider {
    /// NVIDIA Multi-Process Service, supervised by the driver (default).
    pub const MPS: &str = "mps";
    /// HAMi-core's CUDA interception library, where the node has it.
    pub const HAMI_CORE: &str = "hami-core";
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names the API server validates: C identifiers of at most 32
    /// characters, optionally behind a DNS-subdomain domain and `/`.
    #[test]
    fn attribute_and_capacity_names_are_valid_qualified_names() {
        let all = [
            attr::TYPE,
            attr::UUID,
            attr::PRODUCT_NAME,
            attr::BRAND,
            attr::ARCHITECTURE,
            attr::CUDA_COMPUTE_CAPABILITY,
            attr::DRIVER_VERSION,
            attr::CUDA_DRIVER_VERSION,
            attr::PCI_BUS_ID,
            attr::PCIE_BUS_ID,
            attr::PARENT_UUID,
            attr::PROFILE,
            attr::ISOLATION_LEVEL,
            attr::ISOLATION_PROVIDER,
            capacity::MEMORY,
            capacity::MULTIPROCESSORS,
            capacity::CORES,
            capacity::COPY_ENGINES,
            capacity::DECODERS,
            capacity::ENCODERS,
            capacity::JPEG_ENGINES,
            capacity::OFA_ENGINES,
        ];
        for name in all {
            let id = name.rsplit('/').next().unwrap();
            assert!(!id.is_empty() && id.len() <= 32, "{name}");
            assert!(
                id.chars().next().unwrap().is_ascii_alphabetic()
                    && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{name}"
            );
        }
    }
}

/// Binding conditions (KEP-5007) of devices the node makes before the pod
/// binds: the types of the `status.devices[].conditions` the scheduler
/// waits on.
pub mod binding {
    /// True once the node made the device for the claim: the pod may bind.
    pub const MADE: &str = "DeviceMade";
    /// True when the node could not make it: the scheduler frees the
    /// allocation and places the pod again.
    pub const NOT_MADE: &str = "DeviceNotMade";

    /// Label of the ConfigMaps the binder writes: the driver they are for.
    pub const DRIVER_LABEL: &str = "binding.tessera.dev/driver";

    /// The ConfigMap (in the driver's namespace) through which `tessera
    /// binder` asks `node` to make its devices of `driver` ahead: one key
    /// per claim UID, `{"namespace":..,"name":..}`.
    pub fn requests(driver: &str, node: &str) -> String {
        format!("binding.{driver}.{node}")
    }

    /// One request: the claim to prepare ahead.
    #[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct Request {
        pub namespace: String,
        pub name: String,
    }
}
