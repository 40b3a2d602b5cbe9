//! `tessera inventory` against every shipped topology, and its failure modes.
//!
//! The expected figures are written out here independently of the topology
//! files (product names, memory, SMs, compute capabilities, MIG profiles and
//! placements as NVIDIA documents them), so a wrong topology, a wrong fake or
//! wrong discovery all fail these tests.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod common;

use common::*;
use tessera_api::inventory::{
    Gpu, Inventory, Mig, MigEngines, MigInstance, MigPlacement, MigProfile,
};

const MIB: u64 = 1024 * 1024;

/// Product facts of a GPU model.
struct Model {
    name: &'static str,
    brand: &'static str,
    architecture: &'static str,
    cc: &'static str,
    memory_mib: u64,
    sms: u32,
}

const T4: Model = Model {
    name: "Tesla T4",
    brand: "nvidia",
    architecture: "turing",
    cc: "7.5",
    memory_mib: 15360,
    sms: 40,
};
const L4: Model = Model {
    name: "NVIDIA L4",
    brand: "nvidia",
    architecture: "ada",
    cc: "8.9",
    memory_mib: 23034,
    sms: 58,
};
const A100_40GB: Model = Model {
    name: "NVIDIA A100-SXM4-40GB",
    brand: "nvidia",
    architecture: "ampere",
    cc: "8.0",
    memory_mib: 40960,
    sms: 108,
};
const H100_80GB: Model = Model {
    name: "NVIDIA H100 80GB HBM3",
    brand: "nvidia",
    architecture: "hopper",
    cc: "9.0",
    memory_mib: 81559,
    sms: 132,
};

fn gpu(model: &Model, uuid: &str, pci: &str, minor: u32, mig: Mig) -> Gpu {
    Gpu {
        uuid: uuid.into(),
        product_name: model.name.into(),
        brand: model.brand.into(),
        architecture: model.architecture.into(),
        cuda_compute_capability: model.cc.into(),
        pci_bus_id: pci.into(),
        memory_bytes: model.memory_mib * MIB,
        multiprocessors: model.sms,
        minor,
        mig,
    }
}

/// engines: [copy, decoders, encoders, jpeg, ofa]; placements: (size, starts).
#[allow(clippy::too_many_arguments)] // one row of a profile table
fn profile(
    id: u32,
    name: &str,
    slices: u32,
    memory_mib: u64,
    sms: u32,
    engines: [u32; 5],
    max_instances: u32,
    (size, starts): (u32, &[u32]),
) -> MigProfile {
    MigProfile {
        id,
        name: name.into(),
        slices,
        memory_bytes: memory_mib * MIB,
        multiprocessors: sms,
        engines: MigEngines {
            copy_engines: engines[0],
            decoders: engines[1],
            encoders: engines[2],
            jpeg_engines: engines[3],
            ofa_engines: engines[4],
        },
        max_instances,
        placements: starts
            .iter()
            .map(|&start| MigPlacement { start, size })
            .collect(),
    }
}

/// A100-SXM4-40GB profiles, in NVML profile-index order
/// (`nvidia-smi mig -lgip` / `-lgipp`).
fn a100_40gb_profiles() -> Vec<MigProfile> {
    vec![
        profile(
            19,
            "1g.5gb",
            1,
            4864,
            14,
            [1, 0, 0, 0, 0],
            7,
            (1, &[0, 1, 2, 3, 4, 5, 6]),
        ),
        profile(
            14,
            "2g.10gb",
            2,
            9856,
            28,
            [2, 1, 0, 0, 0],
            3,
            (2, &[0, 2, 4]),
        ),
        profile(9, "3g.20gb", 3, 19968, 42, [3, 2, 0, 0, 0], 2, (4, &[0, 4])),
        profile(5, "4g.20gb", 4, 19968, 56, [4, 2, 0, 0, 0], 1, (4, &[0])),
        profile(0, "7g.40gb", 7, 40192, 98, [7, 5, 0, 1, 1], 1, (8, &[0])),
        profile(
            20,
            "1g.5gb+me",
            1,
            4864,
            14,
            [1, 1, 0, 1, 1],
            1,
            (1, &[0, 1, 2, 3, 4, 5, 6]),
        ),
        profile(
            15,
            "1g.10gb",
            1,
            9856,
            14,
            [1, 1, 0, 0, 0],
            4,
            (2, &[0, 2, 4, 6]),
        ),
    ]
}

/// H100 80GB HBM3 profiles, in NVML profile-index order.
fn h100_80gb_profiles() -> Vec<MigProfile> {
    vec![
        profile(
            19,
            "1g.10gb",
            1,
            9984,
            16,
            [1, 1, 0, 1, 0],
            7,
            (1, &[0, 1, 2, 3, 4, 5, 6]),
        ),
        profile(
            14,
            "2g.20gb",
            2,
            20096,
            32,
            [2, 2, 0, 2, 0],
            3,
            (2, &[0, 2, 4]),
        ),
        profile(9, "3g.40gb", 3, 40448, 60, [3, 3, 0, 3, 0], 2, (4, &[0, 4])),
        profile(5, "4g.40gb", 4, 40448, 64, [4, 4, 0, 4, 0], 1, (4, &[0])),
        profile(0, "7g.80gb", 7, 81152, 132, [8, 7, 0, 7, 1], 1, (8, &[0])),
        profile(
            20,
            "1g.10gb+me",
            1,
            9984,
            16,
            [1, 1, 0, 1, 1],
            1,
            (1, &[0, 1, 2, 3, 4, 5, 6]),
        ),
        profile(
            15,
            "1g.20gb",
            1,
            20096,
            26,
            [1, 1, 0, 1, 0],
            4,
            (2, &[0, 2, 4, 6]),
        ),
    ]
}

/// A MIG device spanning its whole GPU instance.
fn instance(
    profiles: &[MigProfile],
    name: &str,
    uuid: &str,
    gpu_instance_id: u32,
    start: u32,
) -> MigInstance {
    let p = profiles
        .iter()
        .find(|p| p.name == name)
        .expect("known profile");
    MigInstance {
        uuid: uuid.into(),
        profile: name.into(),
        profile_id: p.id,
        gpu_instance_id,
        compute_instance_id: 0,
        placement: MigPlacement {
            start,
            size: p.placements[0].size,
        },
        memory_bytes: p.memory_bytes,
        multiprocessors: p.multiprocessors,
        engines: p.engines,
    }
}

/// Compares GPU by GPU so a failure names the GPU rather than dumping the
/// whole machine.
fn assert_inventory(got: &Inventory, want: &Inventory) {
    assert_eq!(got.driver_version, want.driver_version);
    assert_eq!(got.cuda_driver_version, want.cuda_driver_version);
    assert_eq!(got.gpus.len(), want.gpus.len(), "GPU count");
    for (i, (g, w)) in got.gpus.iter().zip(&want.gpus).enumerate() {
        let names = |m: &Mig| {
            m.profiles()
                .iter()
                .map(|p| p.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&g.mig), names(&w.mig), "GPU {i} MIG profile names");
        for (gp, wp) in g.mig.profiles().iter().zip(w.mig.profiles()) {
            assert_eq!(gp, wp, "GPU {i} MIG profile {}", wp.name);
        }
        let uuids = |m: &Mig| {
            m.instances()
                .iter()
                .map(|d| d.uuid.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(uuids(&g.mig), uuids(&w.mig), "GPU {i} MIG devices");
        for (gd, wd) in g.mig.instances().iter().zip(w.mig.instances()) {
            assert_eq!(gd, wd, "GPU {i} MIG device {}", wd.uuid);
        }
        assert_eq!(g, w, "GPU {i}");
    }
}

#[test]
fn t4() {
    let got = inventory(&topology("t4.yaml"));
    let want = Inventory {
        driver_version: "535.183.01".into(),
        cuda_driver_version: "12.2".into(),
        gpus: vec![gpu(
            &T4,
            "GPU-f53e3398-fd10-4ca7-aa75-e3657fc8c200",
            "0000:00:04.0",
            0,
            Mig::NotSupported,
        )],
    };
    assert_inventory(&got, &want);
}

#[test]
fn l4x2() {
    let got = inventory(&topology("l4x2.yaml"));
    let want = Inventory {
        driver_version: "550.90.07".into(),
        cuda_driver_version: "12.4".into(),
        gpus: vec![
            gpu(
                &L4,
                "GPU-8dd6fd61-889b-4983-9357-5764b3edc8e3",
                "0000:00:03.0",
                0,
                Mig::NotSupported,
            ),
            gpu(
                &L4,
                "GPU-f8f334ff-21f0-4f18-a6d7-5d98736b420c",
                "0000:00:04.0",
                1,
                Mig::NotSupported,
            ),
        ],
    };
    assert_inventory(&got, &want);
}

/// The MIG devices of GPU 0 in `a100-40gb-x2-mig.yaml`, with GPU instance
/// ids as NVML numbers these placements.
fn a100_gpu0_instances(p: &[MigProfile]) -> Vec<MigInstance> {
    let i = |name: &str, uuid: &str, gi: u32, start: u32| instance(p, name, uuid, gi, start);
    vec![
        i("2g.10gb", "MIG-004e26da-86c5-4f0b-984c-56d97a00b1b4", 5, 0),
        i("1g.5gb", "MIG-cc04a385-500f-4314-8218-133a4f8051b2", 13, 2),
        i("3g.20gb", "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f", 1, 4),
    ]
}

#[test]
fn a100_40gb_x2_mig() {
    let got = inventory(&topology("a100-40gb-x2-mig.yaml"));
    let p = a100_40gb_profiles();
    let want = Inventory {
        driver_version: "550.127.05".into(),
        cuda_driver_version: "12.4".into(),
        gpus: vec![
            gpu(
                &A100_40GB,
                "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10",
                "0000:07:00.0",
                0,
                Mig::Enabled {
                    profiles: p.clone(),
                    instances: a100_gpu0_instances(&p),
                },
            ),
            gpu(
                &A100_40GB,
                "GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee",
                "0000:0f:00.0",
                1,
                Mig::Disabled {
                    profiles: p.clone(),
                },
            ),
        ],
    };
    assert_inventory(&got, &want);
}

const H100_UUIDS: [&str; 8] = [
    "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f",
    "GPU-afcb4ada-dc9c-47a9-a925-5f30b2522d36",
    "GPU-56f203d4-e9c0-4708-918f-09c606609017",
    "GPU-3da2dd85-937c-4b64-b132-90c221b248d8",
    "GPU-02e615da-f25f-4ea9-a5a5-52fe2c2f6d4b",
    "GPU-c0d37911-d502-48e9-83f0-873be851b931",
    "GPU-6a95d30c-7bed-4130-9284-ecfbeee194ad",
    "GPU-6f0dbca5-e78f-45ee-b051-e3e0e1ade618",
];
/// DGX H100 GPU bus addresses, in the kernel's form.
const DGX_H100_PCI: [&str; 8] = [
    "0000:1b:00.0",
    "0000:43:00.0",
    "0000:52:00.0",
    "0000:61:00.0",
    "0000:9d:00.0",
    "0000:c3:00.0",
    "0000:d1:00.0",
    "0000:df:00.0",
];

#[test]
fn h100x8() {
    let got = inventory(&topology("h100x8.yaml"));
    let want = Inventory {
        driver_version: "570.133.20".into(),
        cuda_driver_version: "12.8".into(),
        gpus: (0..8)
            .map(|i| {
                gpu(
                    &H100_80GB,
                    H100_UUIDS[i],
                    DGX_H100_PCI[i],
                    i as u32,
                    Mig::Disabled {
                        profiles: h100_80gb_profiles(),
                    },
                )
            })
            .collect(),
    };
    assert_inventory(&got, &want);
}

#[test]
fn h100x8_mig() {
    let got = inventory(&topology("h100x8-mig.yaml"));
    let p = h100_80gb_profiles();
    let i = |name: &str, uuid: &str, gi: u32, start: u32| instance(&p, name, uuid, gi, start);
    let layouts: [(&str, Vec<MigInstance>); 8] = [
        (
            "GPU-f5d76e8b-97cf-4197-87a8-b1330122d060",
            vec![
                i("1g.10gb", "MIG-4ed9be02-ad66-4e46-883e-9be7143d655b", 11, 0),
                i("1g.10gb", "MIG-ce2ac4ee-76e2-4a1b-8249-31dfedf85138", 12, 1),
                i("1g.10gb", "MIG-382c1455-e515-4a0d-aae3-5f629b94eab3", 13, 2),
                i("1g.10gb", "MIG-0fa2167e-30fe-46af-9360-9d3864c5ef67", 14, 3),
                i("1g.10gb", "MIG-667eaf25-a4ba-4bce-b058-572c549fed82", 7, 4),
                i("1g.10gb", "MIG-3ecaf80a-ec06-4b8c-9394-60066abedefc", 8, 5),
                i("1g.10gb", "MIG-4ef7300a-df81-46d8-9cf0-e4734644d4c1", 9, 6),
            ],
        ),
        (
            "GPU-02a18fe8-f3f0-4d98-830e-abac0e9d75b7",
            vec![
                i("3g.40gb", "MIG-b03f316f-4f7b-4587-84ae-73d312a3b203", 2, 0),
                i("3g.40gb", "MIG-93d4d5a1-bb19-478d-8cbe-e396daf53f43", 1, 4),
            ],
        ),
        (
            "GPU-18978924-af58-48fb-ae56-00dca00e5904",
            vec![
                i("4g.40gb", "MIG-19050f2a-c8a9-4c88-ba02-ff1721a24e53", 2, 0),
                i("3g.40gb", "MIG-59f75683-5c3a-4697-af3e-1672ffef2d71", 1, 4),
            ],
        ),
        (
            "GPU-62a9e440-f0bc-4fdf-b835-596c0fab5bb5",
            vec![
                i("2g.20gb", "MIG-ad34de94-f579-45e1-a17d-ee5046ec6022", 5, 0),
                i("2g.20gb", "MIG-0d30fd90-3eae-4515-ad5c-3cb5dcaaab2d", 6, 2),
                i("2g.20gb", "MIG-f6f2face-a481-45eb-bb72-2557c947a765", 3, 4),
                i("1g.10gb", "MIG-5f8fc1e1-4346-42e9-af79-0d5a4998304c", 9, 6),
            ],
        ),
        (
            "GPU-3f2b46cc-1275-4ed1-bb07-2ee419bfd46c",
            vec![i(
                "7g.80gb",
                "MIG-10d71306-14d1-45dc-8a44-75400dc0c3b5",
                0,
                0,
            )],
        ),
        (
            "GPU-47ce9a49-bfa0-461d-aa18-aab62dfd0d45",
            vec![
                i("1g.20gb", "MIG-fba76968-95cd-45dc-bc8f-a544a250022b", 5, 0),
                i("1g.20gb", "MIG-a6d463e5-2639-451f-b152-93dd0edc7d19", 6, 2),
                i("1g.20gb", "MIG-5e4f8a1c-7d0b-4c25-9e6a-3b1f2d4c8e07", 3, 4),
                i("1g.20gb", "MIG-9a7c3e2d-1b5f-4e8a-b6d4-0c2e8f1a3b59", 4, 6),
            ],
        ),
        (
            "GPU-c1e8b7a2-4d3f-4a6e-9b05-7f2d1c8e3a64",
            vec![
                i(
                    "1g.10gb+me",
                    "MIG-2d9f4b1e-8c6a-4f37-a0e5-6b3c7d1e9f82",
                    11,
                    0,
                ),
                i("2g.20gb", "MIG-7b1e5c3a-9d2f-4e84-b6a0-1c8f3e5d7a26", 6, 2),
                i("3g.40gb", "MIG-e4a6c8b0-2f1d-4b39-8e57-9a0c3d5f1b74", 1, 4),
            ],
        ),
        ("GPU-8f3b2a6c-5e1d-4c7a-9f08-4d6b1e3a7c95", vec![]),
    ];
    let want = Inventory {
        driver_version: "570.133.20".into(),
        cuda_driver_version: "12.8".into(),
        gpus: layouts
            .into_iter()
            .enumerate()
            .map(|(n, (uuid, instances))| {
                gpu(
                    &H100_80GB,
                    uuid,
                    DGX_H100_PCI[n],
                    n as u32,
                    Mig::Enabled {
                        profiles: p.clone(),
                        instances,
                    },
                )
            })
            .collect(),
    };
    assert_inventory(&got, &want);
}

#[test]
fn profile_names_come_from_nvml_when_it_gives_them() {
    let text = std::fs::read_to_string(topology("h100x8.yaml")).unwrap();
    let renamed = text.replace("name: 7g.80gb,", "name: 7g.80gb.nvml,");
    assert_ne!(text, renamed);
    let inv = inventory(&write_topology("h100x8-renamed.yaml", &renamed));
    let names: Vec<&str> = inv.gpus[0]
        .mig
        .profiles()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "1g.10gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb.nvml",
            "1g.10gb+me",
            "1g.20gb"
        ]
    );
}

#[test]
fn yaml_is_the_default_output_and_says_the_same() {
    let out = tessera(&topology("a100-40gb-x2-mig.yaml"), &["inventory"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml: Inventory = serde_yaml::from_slice(&out.stdout).expect("YAML inventory");
    assert_eq!(yaml, inventory(&topology("a100-40gb-x2-mig.yaml")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("mode: enabled") && text.contains("mode: disabled"),
        "{text}"
    );
    // YAML 1.1 readers would take an unquoted 0000:07:00.0 for a base-60 number.
    assert!(text.contains("pciBusId: '0000:07:00.0'"), "{text}");
}

#[test]
fn the_library_can_be_named_explicitly() {
    let mut cmd = tessera_command();
    let lib = tessera_test_kit::artifacts::fake_nvml_lib();
    let out = cmd
        .args(["inventory", "--output", "json", "--nvml-library"])
        .arg(lib)
        .env(TOPOLOGY_ENV, topology("t4.yaml"))
        .env(STATE_ENV, fresh_state("named-library"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inv: Inventory = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(inv.gpus[0].product_name, "Tesla T4");
    // Beside the GPUs: how Isolated shares are enforced, and whether the
    // next generation's pieces are here (the fake driver is r580-like).
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let isolation = &report["isolation"];
    assert_eq!(isolation["enforcedBy"], "mps-daemon-per-claim", "{report}");
    assert!(matches!(
        isolation["cgroup"].as_str(),
        Some("v1" | "v2" | "hybrid")
    ));
    assert_eq!(isolation["mpsV3Driver"], false, "{report}");
}

/// `tessera` with a clean environment and no fake topology set.
fn tessera_command() -> std::process::Command {
    clean(std::process::Command::new(env!("CARGO_BIN_EXE_tessera")))
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_missing_library_is_a_clear_error() {
    let missing = scratch_dir("no-nvml").join("libnvidia-ml.so.1");
    let out = tessera_command()
        .args(["inventory", "--nvml-library"])
        .arg(&missing)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = stderr(&out);
    assert!(err.contains("cannot load the NVML library"), "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_nvml_init_failure_is_a_clear_error() {
    let text = std::fs::read_to_string(topology("t4.yaml")).unwrap();
    let path = write_topology(
        "t4-driver-not-loaded.yaml",
        &format!("faults:\n  init: DRIVER_NOT_LOADED\n{text}"),
    );
    let out = tessera(&path, &["inventory"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("failed to initialize"), "{err}");
    assert!(err.contains("driver is not loaded"), "{err}");
    assert_eq!(
        err.matches("driver is not loaded").count(),
        1,
        "said once: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_broken_simulation_setup_is_reported() {
    let out = tessera_command()
        .arg("inventory")
        .env("LD_LIBRARY_PATH", fake_nvml_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("TESSERA_FAKE_NVML_TOPOLOGY is not set"),
        "{err}"
    );
    assert!(err.contains("failed to initialize"), "{err}");
}

/// Writes `name`: topology `from` with the GPU at `pci_bus_id` fallen off
/// the bus.
fn lose_gpu(from: &str, pci_bus_id: &str, name: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(topology(from)).unwrap();
    let line = format!("    pciBusId: \"{pci_bus_id}\"");
    let lost = text.replace(&line, &format!("{line}\n    lost: true"));
    assert_ne!(text, lost, "{from} has no GPU at {pci_bus_id}");
    write_topology(name, &lost)
}

#[test]
fn a_lost_gpu_is_named_and_the_others_are_still_listed() {
    let path = lose_gpu("l4x2.yaml", "00000000:00:04.0", "l4x2-gpu1-lost.yaml");
    let out = tessera(&path, &["inventory", "--output", "json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a lost GPU must fail the command"
    );
    let inv: Inventory =
        serde_json::from_slice(&out.stdout).expect("the healthy GPU is still printed");
    assert_eq!(inv.gpus.len(), 1);
    assert_eq!(inv.gpus[0].uuid, "GPU-8dd6fd61-889b-4983-9357-5764b3edc8e3");
    let err = stderr(&out);
    assert!(err.contains("GPU 1"), "{err}");
    assert!(err.contains("fell off the bus"), "{err}");
}

#[test]
fn a_lost_mig_gpu_does_not_hide_the_mig_devices_of_the_others() {
    let path = lose_gpu(
        "a100-40gb-x2-mig.yaml",
        "00000000:0F:00.0",
        "a100-gpu1-lost.yaml",
    );
    let out = tessera(&path, &["inventory", "--output", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let inv: Inventory = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(inv.gpus.len(), 1);
    assert_eq!(inv.gpus[0].mig.instances().len(), 3);
    assert!(stderr(&out).contains("GPU 1"));
}

#[test]
fn a_split_gpu_instance_shows_one_mig_device_per_compute_instance() {
    let text = std::fs::read_to_string(topology("a100-40gb-x2-mig.yaml")).unwrap();
    let split = text.replace(
        "{ profile: 3g.20gb, start: 4, uuid: MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f }",
        "{ profile: 3g.20gb, start: 4, computeInstances: [
             { slices: 2, uuid: MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f },
             { slices: 1, uuid: MIG-7c0de5a1-2b3c-4d5e-8f90-a1b2c3d4e5f6 } ] }",
    );
    assert_ne!(text, split);
    let inv = inventory(&write_topology("a100-split-3g.yaml", &split));
    let p = a100_40gb_profiles();
    let three_g = p.iter().find(|p| p.name == "3g.20gb").unwrap();
    let part = |uuid: &str, ci: u32, name: &str, sms: u32| MigInstance {
        compute_instance_id: ci,
        profile: name.into(),
        multiprocessors: sms,
        ..instance(&p, "3g.20gb", uuid, 1, 4)
    };
    let mut want = a100_gpu0_instances(&p);
    want.truncate(2);
    want.extend([
        part(
            "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f",
            0,
            "2c.3g.20gb",
            28,
        ),
        part(
            "MIG-7c0de5a1-2b3c-4d5e-8f90-a1b2c3d4e5f6",
            1,
            "1c.3g.20gb",
            14,
        ),
    ]);
    assert_eq!(inv.gpus[0].mig.instances(), want.as_slice());
    // Both share the GPU instance's memory and engines.
    assert!(
        want[2..]
            .iter()
            .all(|d| d.memory_bytes == three_g.memory_bytes)
    );
}

#[test]
fn a_library_that_is_not_nvml_is_a_clear_error() {
    // Any shared library without nvmlInit_v2; the C library is always there.
    let out = tessera_command()
        .args(["inventory", "--nvml-library", "libc.so.6"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("it is not an NVML library"), "{err}");
}
