use std::sync::Arc;

use tessera_api::config::{
    DeviceTarget, DeviceType, Holdings, IsolationLevel, Limits, Sharing as ConfigSharing,
};
use tessera_api::inventory::{Gpu, Mig, MigEngines, MigInstance, MigPlacement};
use tessera_controller::model::policy::IsolationProvider;

use super::*;
use crate::host::driver_root::discover_driver_files;
use crate::host::port::{MpsClient, Unsupported};
use crate::prepare::claims::Selected;
use crate::prepare::enforce::{Hosts, mig_caps, mps};
use crate::prepare::resolve::Resolved;
use crate::state::records::Action;
use std::path::PathBuf;

fn enforcers() -> Enforcers {
    Enforcers::new(Hosts {
        mps: Arc::new(Unsupported),
        time_slice: Arc::new(Unsupported),
        mig: Arc::new(Unsupported),
    })
}

type Answer = (Spec, Vec<PreparedDevice>, Vec<DeviceStatus>);

fn build_all(layout: &Layout, devices: &[Device]) -> Result<Answer, ClaimError> {
    let built = build(&claim(), &uid(), layout, &enforcers(), devices)?;
    Ok((built.spec, built.answer, built.status))
}

fn actions(device: &Device) -> Vec<Action> {
    enforcers().plan(std::slice::from_ref(device))
}

const GIB: u64 = 1 << 30;

fn gpu(uuid: &str, minor: u32, mig: Mig) -> Gpu {
    Gpu {
        uuid: uuid.into(),
        product_name: "NVIDIA H100 80GB HBM3".into(),
        brand: "Nvidia".into(),
        architecture: "hopper".into(),
        cuda_compute_capability: "9.0".into(),
        pci_bus_id: format!("0000:{minor:02x}:00.0"),
        memory_bytes: 80 * GIB,
        multiprocessors: 132,
        minor,
        mig,
    }
}

fn claim() -> ClaimRef {
    ClaimRef {
        namespace: "team".into(),
        name: "train".into(),
        uid: UID.into(),
    }
}

const UID: &str = "0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e";

/// A node root with `/dev/nvidia<minor>` for minors 0..4 and a
/// HAMi-core directory (library and preload file) unless `hami` is off.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new(hami: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("root/dev");
        std::fs::create_dir_all(&dev).unwrap();
        for n in ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"] {
            std::fs::write(dev.join(n), "").unwrap();
        }
        let hami_dir = dir.path().join("vgpu");
        std::fs::create_dir_all(&hami_dir).unwrap();
        if hami {
            std::fs::write(hami_dir.join("libvgpu.so"), "").unwrap();
            std::fs::write(
                hami_dir.join("ld.so.preload"),
                "/usr/local/vgpu/libvgpu.so\n",
            )
            .unwrap();
        }
        Node { dir }
    }

    fn layout(&self) -> Layout {
        let root = self.dir.path().join("root");
        Layout {
            driver_root: root.clone(),
            dev_root: root,
            driver_files: Vec::new(),
            hami_core_dir: self.hami_dir(),
        }
    }

    fn hami_dir(&self) -> PathBuf {
        self.dir.path().join("vgpu")
    }

    fn host(&self, file: &str) -> String {
        self.hami_dir().join(file).to_string_lossy().into_owned()
    }
}

fn selected(index: usize, request: &str, device: &str) -> Selected {
    Selected {
        index,
        request: request.into(),
        pool: "node-a".into(),
        device: device.into(),
        share_id: Some(format!("share-{index}")),
        consumed: BTreeMap::new(),
        admin_access: false,
    }
}

/// An Isolated share of `memory` and `cores` on `gpu`, enforced by
/// `provider`, as prepare resolves it (limits = consumed capacity).
fn share(
    index: usize,
    request: &str,
    gpu: Gpu,
    provider: IsolationProvider,
    memory_bytes: u64,
    cores: u32,
) -> Device {
    let consumed = Holdings {
        memory_bytes,
        compute_percent: cores,
    };
    let device = format!("gpu-{}-isolated", gpu.minor);
    let resolved = Resolved {
        selected: selected(index, request, &device),
        kind: Kind::Share {
            level: IsolationLevel::Isolated,
            consumed,
            time_slice: None,
            provider: Some(provider),
        },
        target: DeviceTarget {
            request: request.into(),
            device,
            device_type: DeviceType::Share(IsolationLevel::Isolated),
            holds: consumed,
        },
        gpu,
        mig_mode: None,
    };
    let config = EffectiveConfig::Share {
        limits: Some(Limits {
            memory_bytes,
            compute_percent: cores,
            shared_memory_bytes: None,
        }),
    };
    let mut device = Device {
        resolved,
        config,
        mps: None,
    };
    device.mps = mps::limits(&device).map(|limits| MpsClient {
        pipe_dir: PathBuf::from("/run/tessera/mps/pipe"),
        shm_dir: PathBuf::from("/run/tessera/mps/shm"),
        limits,
    });
    device
}

fn hami(index: usize, request: &str, gpu: Gpu, memory_bytes: u64, cores: u32) -> Device {
    share(
        index,
        request,
        gpu,
        IsolationProvider::HamiCore,
        memory_bytes,
        cores,
    )
}

/// An Isolated share of 2 GiB and 20 % of `GPU-a` in request `gpus`,
/// enforced by MPS.
fn mps_share_of_gpu_a() -> Device {
    share(
        0,
        "gpus",
        gpu("GPU-a", 0, Mig::NotSupported),
        IsolationProvider::Mps,
        2 * GIB,
        20,
    )
}

fn env_of(spec: &Spec, device: usize) -> Vec<&str> {
    spec.devices[device]
        .container_edits
        .env
        .iter()
        .map(String::as_str)
        .collect()
}

fn mounts_of(spec: &Spec, device: usize) -> Vec<(&str, &str, String)> {
    spec.devices[device]
        .container_edits
        .mounts
        .iter()
        .map(|m| {
            (
                m.host_path.as_str(),
                m.container_path.as_str(),
                m.options.join(","),
            )
        })
        .collect()
}

fn uid() -> ClaimUid {
    ClaimUid::parse(UID).unwrap()
}

#[test]
fn hami_core_shares_on_two_gpus_get_limits_at_the_index_the_container_sees() {
    let node = Node::new(true);
    // Allocated in this order: the container enumerates GPU-b as 0.
    let devices = [
        hami(0, "gpus", gpu("GPU-b", 3, Mig::NotSupported), 8 * GIB, 25),
        hami(
            1,
            "gpus",
            gpu("GPU-a", 1, Mig::NotSupported),
            4 * GIB + 5,
            50,
        ),
    ];
    // No host action: no MPS daemon, nothing recorded.
    for d in &devices {
        assert!(actions(d).is_empty());
        assert!(d.mps.is_none());
    }
    let (spec, answer, status) = build_all(&node.layout(), &devices).unwrap();
    assert_eq!(spec.devices.len(), 1);
    assert_eq!(spec.devices[0].name, format!("gpus_{UID}"));
    assert_eq!(
        env_of(&spec, 0),
        [
            "NVIDIA_VISIBLE_DEVICES=GPU-b,GPU-a",
            "CUDA_VISIBLE_DEVICES=GPU-b,GPU-a",
            "CUDA_DEVICE_MEMORY_LIMIT_0=8192m",
            "CUDA_DEVICE_SM_LIMIT_0=25",
            "CUDA_DEVICE_MEMORY_LIMIT_1=4096m",
            "CUDA_DEVICE_SM_LIMIT_1=50",
            &format!("CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/tessera-vgpu-gpus_{UID}.cache"),
        ]
    );
    let ro = "ro,nosuid,nodev,bind".to_owned();
    assert_eq!(
        mounts_of(&spec, 0),
        [
            (
                node.host("libvgpu.so").as_str(),
                "/usr/local/vgpu/libvgpu.so",
                ro.clone()
            ),
            (
                node.host("ld.so.preload").as_str(),
                "/etc/ld.so.preload",
                ro
            ),
        ]
    );
    let nodes: Vec<&str> = spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(nodes, ["/dev/nvidia3", "/dev/nvidia1"]);
    assert_eq!(answer.len(), 2);
    let data = &status[1].data;
    assert_eq!(data.isolation_provider.as_deref(), Some("hami-core"));
    let limits = data.limits.as_ref().unwrap();
    assert_eq!(
        (limits.memory_bytes, limits.compute_percent),
        (4 * GIB + 5, 50)
    );
}

#[test]
fn each_request_counts_its_own_devices_from_zero() {
    let node = Node::new(true);
    let devices = [
        hami(0, "a", gpu("GPU-a", 0, Mig::NotSupported), 2 * GIB, 10),
        hami(1, "b", gpu("GPU-b", 1, Mig::NotSupported), 3 * GIB, 20),
    ];
    let (spec, _, _) = build_all(&node.layout(), &devices).unwrap();
    let env: Vec<Vec<&str>> = (0..2).map(|i| env_of(&spec, i)).collect();
    assert!(
        env[0].contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=2048m"),
        "{env:?}"
    );
    assert!(
        env[1].contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=3072m"),
        "{env:?}"
    );
    assert!(env[1].contains(&"CUDA_DEVICE_SM_LIMIT_0=20"), "{env:?}");
    assert!(
        !env.concat().iter().any(|e| e.contains("_LIMIT_1")),
        "{env:?}"
    );
}

#[test]
fn a_mig_device_beside_a_hami_core_share_keeps_its_index_and_gets_no_limit() {
    let node = Node::new(true);
    let root = node.dir.path().join("root");
    // The driver's capability files for GI 1 / CI 0 on GPU minor 2 and
    // the nodes already made.
    let caps = mig_caps::caps_dir(&root, 2).join("gi1");
    std::fs::create_dir_all(caps.join("ci0")).unwrap();
    std::fs::write(
        caps.join("access"),
        "DeviceFileMinor: 21\nDeviceFileMode: 292\n",
    )
    .unwrap();
    std::fs::write(
        caps.join("ci0/access"),
        "DeviceFileMinor: 22\nDeviceFileMode: 292\n",
    )
    .unwrap();
    std::fs::write(
        root.join("proc/devices"),
        "Character devices:\n237 nvidia-caps\n",
    )
    .unwrap();
    let instance = MigInstance {
        uuid: "MIG-1".into(),
        profile: "3g.40gb".into(),
        profile_id: 9,
        gpu_instance_id: 1,
        compute_instance_id: 0,
        placement: MigPlacement { start: 0, size: 4 },
        memory_bytes: 40 * GIB,
        multiprocessors: 60,
        engines: MigEngines::default(),
    };
    let parent = gpu(
        "GPU-m",
        2,
        Mig::Enabled {
            profiles: Vec::new(),
            instances: vec![instance.clone()],
        },
    );
    let mig = Device {
        resolved: Resolved {
            selected: selected(0, "gpus", "gpu-2-mig-3g.40gb-0"),
            kind: Kind::Mig {
                profile: "3g.40gb".into(),
                instance: Some(instance),
                create: None,
            },
            target: DeviceTarget {
                request: "gpus".into(),
                device: "gpu-2-mig-3g.40gb-0".into(),
                device_type: DeviceType::Mig,
                holds: Holdings {
                    memory_bytes: 40 * GIB,
                    compute_percent: 100,
                },
            },
            gpu: parent,
            mig_mode: None,
        },
        config: EffectiveConfig::Mig {
            sharing: ConfigSharing::None,
        },
        mps: None,
    };
    let devices = [
        mig,
        hami(1, "gpus", gpu("GPU-a", 0, Mig::NotSupported), 6 * GIB, 30),
    ];
    let (spec, _, status) = build_all(&node.layout(), &devices).unwrap();
    assert_eq!(
        env_of(&spec, 0),
        [
            "NVIDIA_VISIBLE_DEVICES=MIG-1,GPU-a",
            "CUDA_VISIBLE_DEVICES=MIG-1,GPU-a",
            "CUDA_DEVICE_MEMORY_LIMIT_1=6144m",
            "CUDA_DEVICE_SM_LIMIT_1=30",
            &format!("CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/tessera-vgpu-gpus_{UID}.cache"),
        ]
    );
    let nodes: Vec<&str> = spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidia2",
            "/dev/nvidia0",
            "/dev/nvidia-caps/nvidia-cap21",
            "/dev/nvidia-caps/nvidia-cap22",
        ]
    );
    assert_eq!(status[0].data.isolation_provider, None);
    assert_eq!(mounts_of(&spec, 0).len(), 2);
}

#[test]
fn two_hami_core_shares_of_one_gpu_in_a_request_add_up() {
    let node = Node::new(true);
    let devices = [
        hami(0, "gpus", gpu("GPU-a", 0, Mig::NotSupported), 2 * GIB, 60),
        hami(1, "gpus", gpu("GPU-a", 0, Mig::NotSupported), 3 * GIB, 60),
    ];
    let (spec, _, _) = build_all(&node.layout(), &devices).unwrap();
    let env = env_of(&spec, 0);
    assert!(env.contains(&"CUDA_VISIBLE_DEVICES=GPU-a"), "{env:?}");
    assert!(env.contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=5120m"), "{env:?}");
    assert!(env.contains(&"CUDA_DEVICE_SM_LIMIT_0=100"), "{env:?}");
}

#[test]
fn without_the_library_a_hami_core_share_is_refused_not_weakened() {
    let node = Node::new(false);
    let devices = [hami(0, "gpus", gpu("GPU-a", 0, Mig::NotSupported), GIB, 10)];
    let err = build_all(&node.layout(), &devices).unwrap_err().to_string();
    assert!(err.contains("team/train"), "{err}");
    assert!(err.contains(&node.host("libvgpu.so")), "{err}");
    assert!(err.contains("--hami-core-dir"), "{err}");
    assert!(err.contains("isolationProvider: mps"), "{err}");
}

#[test]
fn an_mps_share_is_untouched_by_hami_core() {
    let node = Node::new(true);
    let d = mps_share_of_gpu_a();
    assert!(matches!(actions(&d).as_slice(), [Action::Mps { .. }]));
    let (spec, _, status) = build_all(&node.layout(), &[d]).unwrap();
    assert_eq!(
        env_of(&spec, 0),
        [
            "NVIDIA_VISIBLE_DEVICES=GPU-a",
            "CUDA_VISIBLE_DEVICES=GPU-a",
            "CUDA_MPS_PIPE_DIRECTORY=/run/tessera/mps/pipe",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20",
        ]
    );
    assert_eq!(status[0].data.isolation_provider.as_deref(), Some("mps"));
}

#[test]
fn driver_files_are_found_below_the_root_and_mounted_at_their_paths() {
    let root = tempfile::tempdir().unwrap();
    let lib = root.path().join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(root.path().join("usr/bin")).unwrap();
    std::fs::write(lib.join("libcuda.so.550.90.07"), "").unwrap();
    std::os::unix::fs::symlink("libcuda.so.550.90.07", lib.join("libcuda.so.1")).unwrap();
    std::os::unix::fs::symlink("libcuda.so.1", lib.join("libcuda.so")).unwrap();
    std::os::unix::fs::symlink("missing.so.1", lib.join("libnvidia-ml.so.1")).unwrap();
    std::fs::write(lib.join("libunrelated.so.1"), "").unwrap();
    std::fs::write(root.path().join("usr/bin/nvidia-smi"), "").unwrap();

    let mounts = discover_driver_files(root.path());
    let real = std::fs::canonicalize(lib.join("libcuda.so.550.90.07")).unwrap();
    let got: Vec<(&str, &str)> = mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    let real = real.to_str().unwrap();
    let smi = std::fs::canonicalize(root.path().join("usr/bin/nvidia-smi")).unwrap();
    assert_eq!(
        got,
        vec![
            (real, "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
            (real, "/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07"),
            (smi.to_str().unwrap(), "/usr/bin/nvidia-smi"),
        ]
    );
    assert!(mounts.iter().all(|m| m.options.contains(&"ro".to_owned())));
}

#[test]
fn cdi_names_keep_subrequests_apart() {
    let uid = ClaimUid::parse("0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e").unwrap();
    assert_eq!(
        cdi_device_name("gpu/large", &uid),
        "gpu.large_0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e"
    );
    assert_ne!(cdi_device_name("a-b", &uid), cdi_device_name("a/b", &uid));
}

/// The driver's files and nodes are in its own spec, not the claim's: each
/// device is answered with the claim's CDI id and the driver's `cuda`
/// device, whose edits CUDA needs; `nvml` has what NVML needs only.
#[test]
fn common_edits_are_the_drivers_spec_not_the_claims() {
    let node = Node::new(true);
    let d = mps_share_of_gpu_a();
    let (spec, answer, _) = build_all(&node.layout(), &[d]).unwrap();
    assert!(spec.container_edits.is_empty(), "{spec:?}");
    assert_eq!(
        answer[0].cdi_device_ids,
        [
            format!("gpu.tessera.dev/claim=gpus_{UID}"),
            "gpu.tessera.dev/driver=cuda".to_owned()
        ]
    );

    let root = node.dir.path().join("root");
    std::fs::write(root.join("dev/nvidia-uvm"), "").unwrap();
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libcuda.so.1"), "").unwrap();
    std::fs::write(lib.join("libnvidia-ml.so.1"), "").unwrap();
    let layout = Layout {
        driver_files: discover_driver_files(&root),
        ..node.layout()
    };
    let driver = driver_spec(&layout);
    assert_eq!(driver.kind, "gpu.tessera.dev/driver");
    let edits = |name: &str| -> (Vec<String>, Vec<String>) {
        let d = driver.devices.iter().find(|d| d.name == name).unwrap();
        let nodes = d.container_edits.device_nodes.iter();
        let mounts = d.container_edits.mounts.iter();
        (
            nodes.map(|n| n.path.clone()).collect(),
            mounts.map(|m| m.container_path.clone()).collect(),
        )
    };
    let (cuda_nodes, cuda_mounts) = edits("cuda");
    assert_eq!(cuda_nodes, ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
    assert!(cuda_mounts.iter().any(|m| m.ends_with("libcuda.so.1")));
    let (nvml_nodes, nvml_mounts) = edits("nvml");
    assert_eq!(nvml_nodes, ["/dev/nvidiactl"]);
    assert!(
        nvml_mounts.iter().all(|m| m.contains("nvidia-ml")),
        "{nvml_mounts:?}"
    );
    assert!(!nvml_mounts.is_empty());
}
