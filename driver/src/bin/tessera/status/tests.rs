use std::collections::BTreeMap;

use tessera_api::inventory::{Gpu, Inventory, Mig};
use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::state::records::{
    ClaimEntry, ConsumedData, DeviceData, DeviceStatus, EntryState, LimitsData,
};

use super::api::ApiView;
use super::report::build;
use super::text::text;

const GIB: u64 = 1 << 30;

#[test]
fn a_gpu_before_volta_says_why_it_has_no_isolated_shares() {
    let gpu = |uuid: &str, architecture: &str, capability: &str| Gpu {
        uuid: uuid.into(),
        product_name: format!("a {architecture} GPU"),
        brand: "Nvidia".into(),
        architecture: architecture.into(),
        cuda_compute_capability: capability.into(),
        pci_bus_id: "0000:07:00.0".into(),
        memory_bytes: 16 * GIB,
        multiprocessors: 56,
        minor: 0,
        mig: Mig::NotSupported,
    };
    let inventory = Inventory {
        driver_version: "535".into(),
        cuda_driver_version: "12.2".into(),
        gpus: vec![gpu("GPU-p", "pascal", "6.1"), gpu("GPU-v", "volta", "7.0")],
    };
    let report = build("cp".into(), &[], &inventory, &BTreeMap::new(), Vec::new());
    let why = report.gpus[0].isolated_shares.as_deref().unwrap();
    assert!(
        why.contains("compute capability 6.1 is before Volta"),
        "{why}"
    );
    assert_eq!(report.gpus[1].isolated_shares, None);
    let shown = text(&report);
    assert!(shown.contains(&format!("  {why}\n")), "{shown}");
    assert_eq!(shown.matches("no Isolated shares").count(), 1, "{shown}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["gpus"][0]["isolatedShares"], why);
    assert!(json["gpus"][1].get("isolatedShares").is_none());
}

#[test]
fn claims_are_listed_under_their_gpu_with_allocated_and_used_memory() {
    let gpu = Gpu {
        uuid: "GPU-0".into(),
        product_name: "NVIDIA L4".into(),
        brand: "Nvidia".into(),
        architecture: "ada".into(),
        cuda_compute_capability: "8.9".into(),
        pci_bus_id: "0000:07:00.0".into(),
        memory_bytes: 24 * GIB,
        multiprocessors: 58,
        minor: 0,
        mig: Mig::NotSupported,
    };
    let inventory = Inventory {
        driver_version: "580".into(),
        cuda_driver_version: "13.0".into(),
        gpus: vec![gpu],
    };
    let share = DeviceStatus {
        pool: "node".into(),
        device: "gpu-0-isolated".into(),
        share_id: Some("s".into()),
        data: DeviceData {
            device_type: "share".into(),
            gpu_uuid: "GPU-0".into(),
            mig_uuid: None,
            profile: None,
            isolation_level: Some("Isolated".into()),
            sharing: None,
            time_slice: None,
            limits: Some(LimitsData {
                memory: "2Gi".into(),
                memory_bytes: 2 * GIB,
                compute_percent: 25,
            }),
            consumed: Some(ConsumedData {
                memory_bytes: 2 * GIB,
                cores_percent: 25,
            }),
            isolation_provider: Some("hami-core".into()),
        },
        conditions: Vec::new(),
    };
    let uid_text = "0b5c7a62-6b5e-4c3c-9d7e-6c1f6f0d2a11";
    let uid = ClaimUid::parse(uid_text).unwrap();
    let entries = vec![(
        uid,
        ClaimEntry {
            namespace: "team".into(),
            name: "train".into(),
            state: EntryState::Completed,
            actions: Vec::new(),
            devices: Vec::new(),
            spec: None,
            status: vec![share],
            ahead: false,
        },
    )];
    let used = [("GPU-0".to_owned(), GIB)].into_iter().collect();
    let report = build("cp".into(), &entries, &inventory, &used, Vec::new());
    assert_eq!(report.gpus.len(), 1);
    let g = &report.gpus[0];
    assert_eq!(g.mig_mode, "notSupported");
    assert_eq!(g.memory_allocated_bytes, 2 * GIB);
    assert_eq!(g.memory_used_bytes, Some(GIB));
    assert_eq!(g.claims.len(), 1);
    assert_eq!(g.claims[0].name, "train");
    assert_eq!(g.claims[0].memory_bytes, 2 * GIB);
    assert_eq!(g.mode, "isolated/hami-core");
    let mut unknown = report.clone();
    unknown.api_unavailable = Some("no kubeconfig".into());
    let shown = text(&unknown);
    assert!(shown.contains("pods and health unknown: no API server read (no kubeconfig)"));
    assert!(shown.contains("MIG notSupported  mode isolated/hami-core  health unknown"));
    assert!(shown.contains("allocated 2.0 GiB, used 1.0 GiB (NVML), total 24.0 GiB"));
    assert!(
        shown.contains("team/train  gpu-0-isolated  share  Completed  2.0 GiB  ?     Isolated/hami-core, memory 2Gi, compute 25%"),
        "{shown}"
    );

    let mut known = report;
    known.apply(&ApiView {
        pods: [(uid_text.to_owned(), vec!["team/trainer-0".to_owned()])].into(),
        unhealthy: [("GPU-0".to_owned(), "xid-79".to_owned())].into(),
    });
    let shown = text(&known);
    assert!(shown.contains("health unhealthy (xid-79)"), "{shown}");
    assert!(
        shown.contains("Completed  2.0 GiB  team/trainer-0  Isolated/hami-core"),
        "{shown}"
    );
    let json = serde_json::to_value(&known).unwrap();
    assert_eq!(json["gpus"][0]["claims"][0]["pods"][0], "team/trainer-0");
}
