//! Hand-built inventories of real machines (values as NVML reports them on
//! an H100 80GB HBM3, A100-SXM4-40GB and Tesla T4 with driver 550.90.07).

use tessera_api::inventory::{
    Gpu, Inventory, Mig, MigEngines, MigInstance, MigPlacement, MigProfile,
};

const MIB: u64 = 1024 * 1024;

pub fn inventory(gpus: Vec<Gpu>) -> Inventory {
    Inventory {
        driver_version: "550.90.07".into(),
        cuda_driver_version: "12.4".into(),
        gpus,
    }
}

/// One row of `nvidia-smi mig -lgip` / `-lgipp`: id, name, compute slices,
/// memory slices per placement, memory MiB, SMs, engines (CE, DEC, ENC,
/// JPEG, OFA), max instances, placement starts.
type Row = (
    u32,
    &'static str,
    u32,
    u32,
    u64,
    u32,
    [u32; 5],
    u32,
    &'static [u32],
);

const ONES: &[u32] = &[0, 1, 2, 3, 4, 5, 6];

#[rustfmt::skip]
const H100: &[Row] = &[
    (19, "1g.10gb",    1, 1,  9984,  16, [1, 1, 0, 1, 0], 7, ONES),
    (20, "1g.10gb+me", 1, 1,  9984,  16, [1, 7, 0, 7, 1], 1, ONES),
    (15, "1g.20gb",    1, 2, 20096,  26, [1, 1, 0, 1, 0], 4, &[0, 2, 4, 6]),
    (14, "2g.20gb",    2, 2, 20096,  32, [2, 2, 0, 2, 0], 3, &[0, 2, 4]),
    (9,  "3g.40gb",    3, 4, 40448,  60, [3, 3, 0, 3, 0], 2, &[0, 4]),
    (5,  "4g.40gb",    4, 4, 40448,  64, [4, 4, 0, 4, 0], 1, &[0]),
    (0,  "7g.80gb",    7, 8, 81152, 132, [8, 7, 0, 7, 1], 1, &[0]),
];

#[rustfmt::skip]
const A100: &[Row] = &[
    (19, "1g.5gb",    1, 1,  4864, 14, [1, 0, 0, 0, 0], 7, ONES),
    (20, "1g.5gb+me", 1, 1,  4864, 14, [1, 1, 0, 1, 1], 1, ONES),
    (15, "1g.10gb",   1, 2,  9856, 14, [1, 1, 0, 0, 0], 4, &[0, 2, 4, 6]),
    (14, "2g.10gb",   2, 2,  9856, 28, [2, 1, 0, 0, 0], 3, &[0, 2, 4]),
    (9,  "3g.20gb",   3, 4, 19968, 42, [3, 2, 0, 0, 0], 2, &[0, 4]),
    (5,  "4g.20gb",   4, 4, 19968, 56, [4, 2, 0, 0, 0], 1, &[0]),
    (0,  "7g.40gb",   7, 8, 40192, 98, [7, 5, 0, 1, 1], 1, &[0]),
];

fn profiles(rows: &[Row]) -> Vec<MigProfile> {
    rows.iter()
        .map(
            |&(id, name, slices, size, mib, sms, e, max, starts)| MigProfile {
                id,
                name: name.into(),
                slices,
                memory_bytes: mib * MIB,
                multiprocessors: sms,
                engines: MigEngines {
                    copy_engines: e[0],
                    decoders: e[1],
                    encoders: e[2],
                    jpeg_engines: e[3],
                    ofa_engines: e[4],
                },
                max_instances: max,
                placements: starts
                    .iter()
                    .map(|&start| MigPlacement { start, size })
                    .collect(),
            },
        )
        .collect()
}

pub fn h100_profiles() -> Vec<MigProfile> {
    profiles(H100)
}

pub fn a100_profiles() -> Vec<MigProfile> {
    profiles(A100)
}

/// H100 80GB HBM3 number `i` (PCI bus 0x18 + 0x10*i), MIG as given.
pub fn h100(i: u8, mig: Mig) -> Gpu {
    Gpu {
        uuid: format!("GPU-{i:02x}a1b2c3-0000-4000-8000-00000000h100"),
        product_name: "NVIDIA H100 80GB HBM3".into(),
        brand: "nvidia".into(),
        architecture: "hopper".into(),
        cuda_compute_capability: "9.0".into(),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + 0x10 * u32::from(i)),
        memory_bytes: 81559 * MIB,
        multiprocessors: 132,
        minor: u32::from(i),
        mig,
    }
}

pub fn h100_mig_disabled(i: u8) -> Gpu {
    h100(
        i,
        Mig::Disabled {
            profiles: h100_profiles(),
        },
    )
}

pub fn a100(mig: Mig) -> Gpu {
    Gpu {
        uuid: "GPU-a100a100-1111-4111-8111-000000000001".into(),
        product_name: "NVIDIA A100-SXM4-40GB".into(),
        brand: "nvidia".into(),
        architecture: "ampere".into(),
        cuda_compute_capability: "8.0".into(),
        pci_bus_id: "00000000:07:00.0".into(),
        memory_bytes: 40960 * MIB,
        multiprocessors: 108,
        minor: 0,
        mig,
    }
}

/// A100 with MIG on and an operator-made layout: 3g.20gb at slices 4-7,
/// 2g.10gb at 0-1, and a 1g.5gb at 2.
pub fn a100_with_instances() -> Gpu {
    let profiles = a100_profiles();
    let instance = |uuid: &str, pid: u32, gi: u32, start: u32| {
        let p = profiles.iter().find(|p| p.id == pid).unwrap();
        MigInstance {
            uuid: uuid.into(),
            profile: p.name.clone(),
            profile_id: pid,
            gpu_instance_id: gi,
            compute_instance_id: 0,
            placement: MigPlacement {
                start,
                size: p.placements[0].size,
            },
            memory_bytes: p.memory_bytes,
            multiprocessors: p.multiprocessors,
            engines: p.engines,
        }
    };
    let instances = vec![
        instance("MIG-00000000-aaaa-4aaa-8aaa-000000000003", 9, 2, 4),
        instance("MIG-00000000-aaaa-4aaa-8aaa-000000000001", 14, 3, 0),
        instance("MIG-00000000-aaaa-4aaa-8aaa-000000000002", 19, 9, 2),
    ];
    a100(Mig::Enabled {
        profiles,
        instances,
    })
}

pub fn t4() -> Gpu {
    Gpu {
        uuid: "GPU-7474t4t4-2222-4222-8222-000000000001".into(),
        product_name: "Tesla T4".into(),
        brand: "nvidia".into(),
        architecture: "turing".into(),
        cuda_compute_capability: "7.5".into(),
        pci_bus_id: "00000000:3B:00.0".into(),
        memory_bytes: 15360 * MIB,
        multiprocessors: 40,
        minor: 0,
        mig: Mig::NotSupported,
    }
}

/// A MIG instance of an H100 profile, as the driver would see it after
/// creating it.
pub fn h100_instance(uuid: &str, profile_name: &str, start: u32) -> MigInstance {
    let p = h100_profiles()
        .into_iter()
        .find(|p| p.name == profile_name)
        .unwrap();
    MigInstance {
        uuid: uuid.into(),
        profile: p.name.clone(),
        profile_id: p.id,
        gpu_instance_id: 1,
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

/// A Tesla P100 16GB (Pascal, compute capability 6.0): MPS there gives
/// its clients neither address spaces of their own nor limits.
pub fn p100() -> Gpu {
    Gpu {
        uuid: "GPU-0100p100-3333-4333-8333-000000000001".into(),
        product_name: "Tesla P100-PCIE-16GB".into(),
        brand: "tesla".into(),
        architecture: "pascal".into(),
        cuda_compute_capability: "6.0".into(),
        pci_bus_id: "00000000:04:00.0".into(),
        memory_bytes: 16384 * MIB,
        multiprocessors: 56,
        minor: 0,
        mig: Mig::NotSupported,
    }
}
