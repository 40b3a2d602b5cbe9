use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tessera_api::inventory::{Gpu, Inventory, Mig};

use super::*;
use crate::model::desired_slices;

fn gpu(uuid: &str, pci: &str) -> Gpu {
    Gpu {
        uuid: uuid.into(),
        product_name: "NVIDIA L4".into(),
        brand: "nvidia".into(),
        architecture: "ada".into(),
        cuda_compute_capability: "8.9".into(),
        pci_bus_id: pci.into(),
        memory_bytes: 23034 * 1024 * 1024,
        multiprocessors: 58,
        minor: 0,
        mig: Mig::NotSupported,
    }
}

fn inventory(gpus: Vec<Gpu>) -> Inventory {
    Inventory {
        driver_version: "550.90.07".into(),
        cuda_driver_version: "12.4".into(),
        gpus,
    }
}

const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

#[test]
fn gpu_numbers_are_read_back_from_published_slices() {
    let inv = inventory(vec![gpu(A, "0000:01:00.0"), gpu(B, "0000:02:00.0")]);
    for caps in [Capabilities::full(), Capabilities::legacy()] {
        let slices = desired_slices(
            &inv,
            &NodePolicy::default(),
            caps,
            "node-a",
            &DriverName::default(),
        )
        .unwrap();
        let indices = indices_from_slices(&slices);
        assert_eq!(indices.get(A), Some(&0), "{caps:?}");
        assert_eq!(indices.get(B), Some(&1), "{caps:?}");
        assert_eq!(indices.len(), 2);
    }
}

#[test]
fn a_vanished_gpu_does_not_renumber_the_others() {
    // Published with both GPUs; A is gone at the next start. Read back, B
    // keeps gpu-1 (PCI order alone would make it gpu-0 and rewrite it).
    let both = inventory(vec![gpu(A, "0000:01:00.0"), gpu(B, "0000:02:00.0")]);
    let published = desired_slices(
        &both,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
        &DriverName::default(),
    )
    .unwrap();
    let only_b = inventory(vec![gpu(B, "0000:02:00.0")]);
    let model = SliceModel::new(
        &only_b,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
    )
    .previous_indices(indices_from_slices(&published))
    .build()
    .unwrap();
    assert!(model.devices.contains_key("gpu-1"));
    assert!(!model.devices.contains_key("gpu-0"));
}

fn claim(results: serde_json::Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {},
        "status": {"allocation": {"devices": {"results": results}}},
    }))
    .unwrap()
}

#[test]
fn held_devices_are_this_drivers_in_this_pool() {
    let claims = vec![
        claim(json!([
            {"request": "r", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-0-isolated"},
            {"request": "r", "driver": "gpu.tessera.dev", "pool": "node-b", "device": "gpu-1"},
            {"request": "r", "driver": "other.example.com", "pool": "node-a", "device": "gpu-2"},
        ])),
        claim(json!([
            {"request": "r", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-3-mig-1g-10gb-0"},
        ])),
        serde_json::from_value(json!({"metadata": {"name": "pending"}, "spec": {}})).unwrap(),
    ];
    let held = held_in(&claims, "gpu.tessera.dev", "node-a");
    assert_eq!(
        held.into_iter().collect::<Vec<_>>(),
        vec![
            "gpu-0-isolated".to_string(),
            "gpu-3-mig-1g-10gb-0".to_string()
        ]
    );
}

#[test]
fn write_counts_subtract() {
    let a = WriteCounts {
        creates: 5,
        updates: 3,
        deletes: 1,
    };
    let b = WriteCounts {
        creates: 2,
        updates: 3,
        deletes: 0,
    };
    assert_eq!(
        a - b,
        WriteCounts {
            creates: 3,
            updates: 0,
            deletes: 1
        }
    );
    assert_eq!((a - b).total(), 4);
}

#[test]
fn api_errors_read_as_the_servers_words() {
    let status = kube::core::Status {
        code: 422,
        reason: "Invalid".into(),
        message: "ResourceSlice.resource.k8s.io \"x\" is invalid: spec.devices: Too many".into(),
        ..Default::default()
    };
    let e = PublishError::api("applying slice x", kube::Error::Api(Box::new(status)));
    assert_eq!(
        e.to_string(),
        "applying slice x: ResourceSlice.resource.k8s.io \"x\" is invalid: spec.devices: Too many (422 Invalid)"
    );
}
