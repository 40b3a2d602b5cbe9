//! What the published slices say about devices and GPUs: which devices
//! claims hold, which a new model drops, and the GPU numbering in use.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use tessera_api::names::{attr, device_type};

use crate::model::naming::GpuIndices;

/// Published devices: name -> UUID of the GPU they belong to.
pub type Published = BTreeMap<String, Option<String>>;

/// Names of the devices of pool `node` of `driver` that `claims` hold.
pub fn held_in(claims: &[ResourceClaim], driver: &str, node: &str) -> BTreeSet<String> {
    claims
        .iter()
        .filter_map(|c| c.status.as_ref()?.allocation.as_ref()?.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == driver && r.pool == node)
        .map(|r| r.device.clone())
        .collect()
}

/// The devices of `slices`, each with the UUID of its GPU.
pub fn published_devices(slices: &[ResourceSlice]) -> Published {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| (d.name.clone(), gpu_of(d)))
        .collect()
}

/// Devices of `before` that `after` lacks, or publishes for another GPU
/// (a vanished GPU's number taken by a new one): for a claim holding one,
/// either would be a device dropped under it.
pub fn dropped_devices(before: &Published, after: &Published) -> BTreeSet<String> {
    before
        .iter()
        .filter(|(name, gpu)| after.get(*name) != Some(*gpu))
        .map(|(name, _)| name.clone())
        .collect()
}

/// The card a published device belongs to: `parentUUID` on share and MIG
/// devices, `uuid` on whole GPUs.
fn gpu_of(device: &k8s_openapi::api::resource::v1::Device) -> Option<String> {
    let attrs = device.attributes.as_ref();
    let get = |key: &str| {
        attrs
            .and_then(|a| a.get(key))
            .and_then(|v| v.string.clone())
    };
    get(attr::PARENT_UUID).or_else(|| {
        (get(attr::TYPE).as_deref() == Some(device_type::GPU))
            .then(|| get(attr::UUID))
            .flatten()
    })
}

/// The GPU numbering the published slices use, read back from device names
/// (`gpu-<n>...`) and the card UUID they carry (`parentUUID` on share and
/// MIG devices, `uuid` on whole GPUs). This keeps a GPU's number across a
/// restart even if another GPU vanished meanwhile.
pub fn indices_from_slices(slices: &[ResourceSlice]) -> GpuIndices {
    let mut indices = GpuIndices::new();
    let mut taken = BTreeSet::new();
    for device in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
        let Some(n) = device
            .name
            .strip_prefix("gpu-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(uuid) = gpu_of(device)
            && !indices.contains_key(&uuid)
            && taken.insert(n)
        {
            indices.insert(uuid, n);
        }
    }
    indices
}
