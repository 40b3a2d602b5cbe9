//! Names: driver, GPUs, devices, counter sets and slices.
//!
//! Every name here is a pure function of stable facts, so the same inventory
//! always yields the same objects (the basis of "zero writes on restart"):
//!
//! * GPU index `n` (device `gpu-<n>`): GPUs sorted by PCI bus id (then UUID),
//!   numbered from 0. PCI order follows the physical slot, survives reboots
//!   and driver reloads, and is how NVML and `CUDA_DEVICE_ORDER=PCI_BUS_ID`
//!   order GPUs, so `gpu-0` is what operators call GPU 0. The NVML minor
//!   number is not used (it is assigned at driver load). Because a GPU that
//!   falls off the bus would shift the numbers after it, callers can pass the
//!   previous assignment (persisted by the driver): known UUIDs keep their
//!   number and new GPUs take the lowest free ones, see [`assign_gpu_indices`].
//! * Devices: `gpu-<n>`, `gpu-<n>-isolated`, `gpu-<n>-shared`,
//!   `gpu-<n>-mig-<profile>-<start>` (profile slugged: `1g.10gb+me` ->
//!   `1g-10gb-me`; start = first memory slice of the placement), static-mode
//!   replicas `gpu-<n>-isolated-<i>` / `gpu-<n>-shared-<i>`, the monitoring
//!   device `gpu-<n>-monitor`. A MIG device is
//!   named by what it occupies, so an instance Tessera created for a claim
//!   and the placement device it came from have the same name. Compute
//!   instances sharing one GPU instance get `-ci<id>`; a held `-ci<id>` name
//!   is kept when its siblings go.
//! * A GPU that vanished keeps its number reserved while a claim holds one
//!   of its devices ([`assign_gpu_indices_reserving`]), so a new card never
//!   takes over a held device's name.
//! * Counter sets: `gpu-<n>`. Slices: `<node>-<driver>-<k>`.

use std::collections::{BTreeMap, BTreeSet};

use tessera_api::inventory::{Gpu, Inventory};

use super::ModelError;

/// Default DNS domain of the driver (the default driver name is
/// `gpu.<domain>`, `tessera_api::names::DEFAULT_DRIVER_NAME`).
pub const DEFAULT_DOMAIN: &str = "tessera.dev";

/// The DRA driver name, `gpu.<domain>` by default.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverName(String);

impl DriverName {
    /// `gpu.<domain>`.
    pub fn for_domain(domain: &str) -> Result<Self, ModelError> {
        Self::new(&format!("gpu.{domain}"))
    }

    /// Any name valid as a DRA driver name: a lower-case DNS subdomain of at
    /// most 63 characters (the API reuses the CSI driver name rules).
    pub fn new(name: &str) -> Result<Self, ModelError> {
        if name.len() > 63 || !is_dns_subdomain(name) {
            return Err(ModelError::InvalidName {
                what: "driver name",
                name: name.to_string(),
            });
        }
        Ok(DriverName(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for DriverName {
    fn default() -> Self {
        DriverName(tessera_api::names::DEFAULT_DRIVER_NAME.to_string())
    }
}

impl std::fmt::Display for DriverName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Stable GPU numbers, keyed by UUID.
pub type GpuIndices = BTreeMap<String, u32>;

/// Numbers the inventory's GPUs (see the module docs). `previous` may come
/// from an earlier run; entries for GPUs no longer present are dropped.
pub fn assign_gpu_indices(
    inventory: &Inventory,
    previous: &GpuIndices,
) -> Result<GpuIndices, ModelError> {
    assign_gpu_indices_reserving(inventory, previous, &BTreeSet::new())
}

/// As [`assign_gpu_indices`], but new GPUs never take a number in
/// `reserved` (numbers of GPUs that are gone while claims still hold their
/// devices: a new card under that name would hand those claims another
/// GPU).
pub fn assign_gpu_indices_reserving(
    inventory: &Inventory,
    previous: &GpuIndices,
    reserved: &BTreeSet<u32>,
) -> Result<GpuIndices, ModelError> {
    let mut seen = BTreeSet::new();
    for gpu in &inventory.gpus {
        if !seen.insert(gpu.uuid.as_str()) {
            return Err(ModelError::DuplicateGpu(gpu.uuid.clone()));
        }
    }
    let mut ordered: Vec<&Gpu> = inventory.gpus.iter().collect();
    ordered.sort_by(|a, b| {
        normalize_pci_bus_id(&a.pci_bus_id)
            .cmp(&normalize_pci_bus_id(&b.pci_bus_id))
            .then_with(|| a.uuid.cmp(&b.uuid))
    });

    let mut assigned = GpuIndices::new();
    let mut used = reserved.clone();
    for gpu in &ordered {
        if let Some(&n) = previous.get(&gpu.uuid)
            && used.insert(n)
        {
            assigned.insert(gpu.uuid.clone(), n);
        }
    }
    let mut next = 0u32;
    for gpu in &ordered {
        if assigned.contains_key(&gpu.uuid) {
            continue;
        }
        while used.contains(&next) {
            next += 1;
        }
        used.insert(next);
        assigned.insert(gpu.uuid.clone(), next);
    }
    Ok(assigned)
}

/// NVML's `00000000:18:00.0` or `0000:18:00.0` as the API's standard
/// `resource.kubernetes.io/pciBusID` form, `dddd:bb:dd.f` in lower-case hex.
/// Returns `None` when the id does not have that shape.
pub fn normalize_pci_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim().to_ascii_lowercase();
    let (domain, rest) = raw.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(domain) || !hex(bus) || !hex(device) || !hex(function) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16).ok()?;
    if domain > 0xffff || bus.len() != 2 || device.len() != 2 || function.len() != 1 {
        return None;
    }
    Some(format!("{domain:04x}:{bus}:{device}.{function}"))
}

/// The GPU number `n` of a device name `gpu-<n>` or `gpu-<n>-...`, for
/// held names whose GPU may be gone (nothing else describes them).
pub fn gpu_index_of(device: &str) -> Option<u32> {
    let rest = device.strip_prefix("gpu-")?;
    let digits = rest.split('-').next()?;
    let n: u32 = digits.parse().ok()?;
    (digits == n.to_string()).then_some(n)
}

pub fn whole_device(n: u32) -> String {
    format!("gpu-{n}")
}

pub fn counter_set(n: u32) -> String {
    format!("gpu-{n}")
}

pub fn share_device(n: u32, level_slug: &str) -> String {
    format!("gpu-{n}-{level_slug}")
}

pub fn replica_device(n: u32, level_slug: &str, replica: u32) -> String {
    format!("gpu-{n}-{level_slug}-{replica}")
}

/// The monitoring device of GPU `n` (adminAccess claims only).
pub fn monitor_device(n: u32) -> String {
    format!("gpu-{n}-monitor")
}

pub fn mig_device(n: u32, profile: &str, start: u32) -> String {
    format!("gpu-{n}-mig-{}-{start}", slug(profile))
}

/// Lower-case, every run of characters outside `[a-z0-9]` becomes one `-`,
/// no leading or trailing `-`: `1g.10gb+me` -> `1g-10gb-me`.
pub fn slug(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars().map(|c| c.to_ascii_lowercase()) {
        if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    while out.ends_with('-') {
        out.pop();
    }
    out
}

/// `<node>-<driver>-<k>`, `k` of at least three digits so that names sort
/// as the slices are ordered (the scheduler walks them by name). Names that
/// would exceed the 253 characters of a DNS subdomain keep a prefix of the
/// base and a hash of all of it (as its own DNS label), so they stay valid,
/// unique and stable.
pub fn slice_name(node: &str, driver: &DriverName, k: usize) -> String {
    let base = format!("{node}-{}", driver.as_str());
    let suffix = format!("-{k:03}");
    if base.len() + suffix.len() <= 253 {
        return format!("{base}{suffix}");
    }
    let hash = format!("{:016x}", fnv1a(base.as_bytes()));
    let keep = 253 - suffix.len() - hash.len() - 1;
    let mut prefix = base[..keep].to_string();
    while prefix.ends_with(['-', '.']) {
        prefix.pop();
    }
    format!("{prefix}.{hash}{suffix}")
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// RFC 1123 label: at most 63 of `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// RFC 1123 subdomain: dot-separated labels, at most 253 characters.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_bus_ids_are_normalized() {
        assert_eq!(
            normalize_pci_bus_id("00000000:18:00.0").as_deref(),
            Some("0000:18:00.0")
        );
        assert_eq!(
            normalize_pci_bus_id("0000:AF:00.0").as_deref(),
            Some("0000:af:00.0")
        );
        assert_eq!(
            normalize_pci_bus_id("0001:3b:1e.7").as_deref(),
            Some("0001:3b:1e.7")
        );
        assert_eq!(normalize_pci_bus_id("18:00.0"), None);
        assert_eq!(normalize_pci_bus_id("0000:18:00"), None);
        assert_eq!(normalize_pci_bus_id("100000:18:00.0"), None);
        assert_eq!(normalize_pci_bus_id("0000:g8:00.0"), None);
    }

    #[test]
    fn slugs_and_device_names_are_dns_labels() {
        assert_eq!(slug("1g.10gb+me"), "1g-10gb-me");
        assert_eq!(slug("7g.80gb"), "7g-80gb");
        assert_eq!(slug("+A.B+"), "a-b");
        let name = mig_device(7, "1g.10gb+me", 6);
        assert_eq!(name, "gpu-7-mig-1g-10gb-me-6");
        assert!(is_dns_label(&name));
    }

    #[test]
    fn driver_names_are_validated() {
        assert_eq!(DriverName::default().as_str(), "gpu.tessera.dev");
        assert_eq!(
            DriverName::for_domain(DEFAULT_DOMAIN).unwrap(),
            DriverName::default()
        );
        assert_eq!(
            DriverName::for_domain("example.com").unwrap().as_str(),
            "gpu.example.com"
        );
        assert!(DriverName::new("GPU.example.com").is_err());
        assert!(DriverName::new("gpu..example").is_err());
        assert!(DriverName::new(&format!("gpu.{}.com", "a".repeat(60))).is_err());
    }

    #[test]
    fn long_slice_names_stay_valid_and_distinct() {
        let driver = DriverName::default();
        assert_eq!(
            slice_name("node-1", &driver, 3),
            "node-1-gpu.tessera.dev-003"
        );
        let long_a = format!("{}.a", "n".repeat(60)).repeat(4);
        let long_b = format!("{}.b", "n".repeat(60)).repeat(4);
        let a = slice_name(&long_a, &driver, 0);
        let b = slice_name(&long_b, &driver, 0);
        assert!(a.len() <= 253 && is_dns_subdomain(&a), "{a}");
        assert_ne!(a, b);
        assert_eq!(a, slice_name(&long_a, &driver, 0));
    }
}
