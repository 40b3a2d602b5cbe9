//! Device memory allocated to prepared claims, per physical GPU, from the
//! checkpoint entries: what `tessera_gpu_memory_allocated_bytes` and
//! `tessera status` report next to the memory NVML says is used.
//!
//! Per device of a `Completed` entry (its recorded `status.devices` data):
//!
//! * a whole GPU: the GPU's memory;
//! * a MIG device: the MIG device's memory (the instance NVML lists, else
//!   its profile's memory on that GPU);
//! * a share: the memory the allocation consumed (`consumed.memoryBytes`;
//!   accounting only for `Shared` shares, a limit for `Isolated` ones).

use std::collections::BTreeMap;

use tessera_api::inventory::{Gpu, Inventory};

use crate::state::records::{ClaimEntry, DeviceData, EntryState};

/// Bytes allocated per GPU UUID. Every GPU of `inventory` is present (0
/// when nothing is allocated on it); GPUs that only the checkpoint knows
/// (gone from NVML) are present too.
pub fn allocated_by_gpu<'a>(
    entries: impl IntoIterator<Item = &'a ClaimEntry>,
    inventory: &Inventory,
) -> BTreeMap<String, u64> {
    let mut allocated: BTreeMap<String, u64> =
        inventory.gpus.iter().map(|g| (g.uuid.clone(), 0)).collect();
    for entry in entries {
        if entry.state != EntryState::Completed {
            continue;
        }
        for device in &entry.status {
            let bytes = device_memory(&device.data, inventory);
            *allocated.entry(device.data.gpu_uuid.clone()).or_default() += bytes;
        }
    }
    allocated
}

/// The memory one prepared device holds (0 when it cannot be told: a GPU
/// NVML no longer lists).
pub fn device_memory(data: &DeviceData, inventory: &Inventory) -> u64 {
    let gpu = inventory.gpus.iter().find(|g| g.uuid == data.gpu_uuid);
    match data.device_type.as_str() {
        "gpu" => gpu.map_or(0, |g| g.memory_bytes),
        "mig" => gpu.map_or(0, |g| mig_memory(g, data)),
        _ => data
            .consumed
            .as_ref()
            .map(|c| c.memory_bytes)
            .or_else(|| data.limits.as_ref().map(|l| l.memory_bytes))
            .unwrap_or(0),
    }
}

fn mig_memory(gpu: &Gpu, data: &DeviceData) -> u64 {
    let instance = data
        .mig_uuid
        .as_deref()
        .and_then(|uuid| gpu.mig.instances().iter().find(|i| i.uuid == uuid));
    if let Some(instance) = instance {
        return instance.memory_bytes;
    }
    data.profile
        .as_deref()
        .and_then(|name| gpu.mig.profiles().iter().find(|p| p.name == name))
        .map_or(0, |p| p.memory_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::records::{ConsumedData, DeviceStatus};
    use tessera_api::inventory::{Mig, MigEngines, MigInstance, MigPlacement, MigProfile};

    const GIB: u64 = 1 << 30;

    fn gpu(uuid: &str, memory: u64, mig: Mig) -> Gpu {
        Gpu {
            uuid: uuid.into(),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            brand: "Nvidia".into(),
            architecture: "hopper".into(),
            cuda_compute_capability: "9.0".into(),
            pci_bus_id: "0000:07:00.0".into(),
            memory_bytes: memory,
            multiprocessors: 132,
            minor: 0,
            mig,
        }
    }

    fn profile(name: &str, memory: u64) -> MigProfile {
        MigProfile {
            id: 9,
            name: name.into(),
            slices: 3,
            memory_bytes: memory,
            multiprocessors: 60,
            engines: MigEngines::default(),
            max_instances: 2,
            placements: vec![MigPlacement { start: 0, size: 4 }],
        }
    }

    fn data(kind: &str, gpu: &str) -> DeviceData {
        DeviceData {
            device_type: kind.into(),
            gpu_uuid: gpu.into(),
            mig_uuid: None,
            profile: None,
            isolation_level: None,
            sharing: None,
            time_slice: None,
            limits: None,
            consumed: None,
            isolation_provider: None,
        }
    }

    fn entry(state: EntryState, devices: Vec<DeviceData>) -> ClaimEntry {
        ClaimEntry {
            namespace: "ns".into(),
            name: "claim".into(),
            state,
            actions: Vec::new(),
            devices: Vec::new(),
            spec: None,
            status: devices
                .into_iter()
                .map(|data| DeviceStatus {
                    pool: "node".into(),
                    device: "dev".into(),
                    share_id: None,
                    data,
                    conditions: Vec::new(),
                })
                .collect(),
            ahead: false,
        }
    }

    fn inventory() -> Inventory {
        let mig_instance = MigInstance {
            uuid: "MIG-1".into(),
            profile: "3g.40gb".into(),
            profile_id: 9,
            gpu_instance_id: 1,
            compute_instance_id: 0,
            placement: MigPlacement { start: 0, size: 4 },
            memory_bytes: 39 * GIB,
            multiprocessors: 60,
            engines: MigEngines::default(),
        };
        Inventory {
            driver_version: "580".into(),
            cuda_driver_version: "13.0".into(),
            gpus: vec![
                gpu("GPU-whole", 80 * GIB, Mig::NotSupported),
                gpu(
                    "GPU-mig",
                    80 * GIB,
                    Mig::Enabled {
                        profiles: vec![profile("3g.40gb", 40 * GIB)],
                        instances: vec![mig_instance],
                    },
                ),
                gpu("GPU-shared", 24 * GIB, Mig::NotSupported),
                gpu("GPU-idle", 16 * GIB, Mig::NotSupported),
            ],
        }
    }

    #[test]
    fn whole_gpus_mig_devices_and_shares_are_counted_on_their_gpu() {
        let share = |bytes| DeviceData {
            isolation_level: Some("Isolated".into()),
            consumed: Some(ConsumedData {
                memory_bytes: bytes,
                cores_percent: 25,
            }),
            ..data("share", "GPU-shared")
        };
        let existing_mig = DeviceData {
            mig_uuid: Some("MIG-1".into()),
            profile: Some("3g.40gb".into()),
            ..data("mig", "GPU-mig")
        };
        // A MIG device NVML does not list (any more): its profile's memory.
        let listed_by_profile = DeviceData {
            mig_uuid: Some("MIG-gone".into()),
            profile: Some("3g.40gb".into()),
            ..data("mig", "GPU-mig")
        };
        let entries = [
            entry(EntryState::Completed, vec![data("gpu", "GPU-whole")]),
            entry(EntryState::Completed, vec![existing_mig, listed_by_profile]),
            entry(EntryState::Completed, vec![share(2 * GIB)]),
            entry(EntryState::Completed, vec![share(4 * GIB)]),
            // Not (or no longer) holding anything.
            entry(EntryState::Started, vec![data("gpu", "GPU-idle")]),
            entry(EntryState::Unpreparing, vec![share(8 * GIB)]),
        ];
        let allocated = allocated_by_gpu(&entries, &inventory());
        assert_eq!(
            allocated,
            [
                ("GPU-idle".to_owned(), 0),
                ("GPU-mig".to_owned(), 39 * GIB + 40 * GIB),
                ("GPU-shared".to_owned(), 6 * GIB),
                ("GPU-whole".to_owned(), 80 * GIB),
            ]
            .into_iter()
            .collect()
        );
    }

    #[test]
    fn a_gpu_only_the_checkpoint_knows_is_reported() {
        let share = DeviceData {
            consumed: Some(ConsumedData {
                memory_bytes: GIB,
                cores_percent: 10,
            }),
            ..data("share", "GPU-vanished")
        };
        let entries = [
            entry(EntryState::Completed, vec![share]),
            entry(EntryState::Completed, vec![data("gpu", "GPU-vanished-too")]),
        ];
        let allocated = allocated_by_gpu(&entries, &Inventory::default());
        assert_eq!(allocated.get("GPU-vanished"), Some(&GIB));
        assert_eq!(allocated.get("GPU-vanished-too"), Some(&0));
    }
}
