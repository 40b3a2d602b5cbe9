//! The claim's CDI spec, the kubelet's answer and the status data, from its
//! devices once every provider's effects are made.
//!
//! # CDI layout
//!
//! One spec per claim (`gpu.tessera.dev-claim_<uid>.json`), one CDI device
//! per *request* of the claim, named `<request>_<claim uid>` (a subrequest
//! `gpu/large` becomes `gpu.large`; request names are DNS labels, so `.`
//! cannot clash). The kubelet hands each allocated device the CDI id of its
//! request, and gives a container the CDI ids of the devices of the requests
//! it references (`resources.claims[].request`), so a container sees the
//! GPUs of its requests and nothing else:
//!
//! * per request: `NVIDIA_VISIBLE_DEVICES` and `CUDA_VISIBLE_DEVICES` set to
//!   exactly the request's GPU / MIG UUIDs, then each provider's edits
//!   ([`super::provider`]): device nodes, MIG capability nodes, the MPS
//!   client settings, HAMi-core's library and limits;
//! * per spec (any request): `/dev/nvidiactl`, `/dev/nvidia-uvm`,
//!   `/dev/nvidia-uvm-tools` and the driver's libraries and tools from the
//!   driver root.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_api::config::{EffectiveConfig, Sharing as ConfigSharing};

use super::claims::{ClaimError, ClaimRef};
use super::provider::{Device, Providers, Request};
use super::resolve::Kind;
use super::state::{ConsumedData, DeviceData, DeviceStatus, PreparedDevice};
use crate::cdi::{self, ContainerEdits, DeviceNode, Mount, Spec};
use crate::claim_uid::ClaimUid;

/// Where the NVIDIA driver's files are on this host.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Root of the driver installation (`/`, or `/run/nvidia/driver` for a
    /// containerized driver): libraries, tools, `/proc/driver/nvidia`.
    pub driver_root: PathBuf,
    /// Where the device nodes are (`/dev` below this root).
    pub dev_root: PathBuf,
    /// Driver libraries and tools mounted into every container with a
    /// claim (see [`discover_driver_files`]).
    pub driver_files: Vec<Mount>,
    /// Where HAMi-core's `libvgpu.so` and `ld.so.preload` are on this host
    /// (Isolated shares whose provider is `hami-core`).
    pub hami_core_dir: PathBuf,
}

impl Layout {
    pub fn node(&self, container_path: &str) -> DeviceNode {
        let host = host_path(&self.dev_root, container_path);
        DeviceNode {
            path: container_path.to_owned(),
            host_path: (host.to_str() != Some(container_path))
                .then(|| host.to_string_lossy().into_owned()),
            permissions: None,
        }
    }

    pub fn exists(&self, container_path: &str) -> bool {
        host_path(&self.dev_root, container_path).exists()
    }
}

fn host_path(root: &Path, container_path: &str) -> PathBuf {
    root.join(container_path.trim_start_matches('/'))
}

/// The CDI device name of a request of a claim.
pub fn cdi_device_name(request: &str, claim: &ClaimUid) -> String {
    format!("{}_{}", request.replace('/', "."), claim.as_str())
}

/// What prepare hands out for a claim.
pub struct Built {
    pub spec: Spec,
    pub answer: Vec<PreparedDevice>,
    pub status: Vec<DeviceStatus>,
}

/// Builds the claim's CDI spec, the kubelet's answer and the status data.
pub fn build(
    claim: &ClaimRef,
    uid: &ClaimUid,
    layout: &Layout,
    providers: &Providers,
    devices: &[Device],
) -> Result<Built, ClaimError> {
    // Requests in order of first appearance.
    let mut requests: Vec<&str> = Vec::new();
    for d in devices {
        if !requests.contains(&d.resolved.selected.request.as_str()) {
            requests.push(&d.resolved.selected.request);
        }
    }

    let mut cdi_devices = Vec::new();
    let mut ids: BTreeMap<&str, String> = BTreeMap::new();
    for name in &requests {
        let cdi_name = cdi_device_name(name, uid);
        let members: Vec<&Device> = devices
            .iter()
            .filter(|d| d.resolved.selected.request == *name)
            .collect();
        let mut visible: Vec<String> = Vec::new();
        for d in &members {
            let uuid = d.resolved.visible_uuid();
            if !visible.iter().any(|v| v == uuid) {
                visible.push(uuid.to_owned());
            }
        }
        let request = Request {
            claim,
            name,
            cdi_name: &cdi_name,
            devices: members,
            visible,
            layout,
        };
        let mut edits = ContainerEdits::default();
        let list = request.visible.join(",");
        edits.env.push(format!("NVIDIA_VISIBLE_DEVICES={list}"));
        edits.env.push(format!("CUDA_VISIBLE_DEVICES={list}"));
        for provider in providers.iter() {
            provider
                .edits(&request, &mut edits)
                .map_err(|e| e.for_claim(claim))?;
        }
        ids.insert(name, cdi::qualified_name(&cdi_name));
        cdi_devices.push(cdi::Device {
            name: cdi_name,
            container_edits: edits,
        });
    }

    let answer = devices
        .iter()
        .map(|d| PreparedDevice {
            request_names: vec![d.resolved.selected.request.clone()],
            pool_name: d.resolved.selected.pool.clone(),
            device_name: d.resolved.selected.device.clone(),
            cdi_device_ids: vec![ids[d.resolved.selected.request.as_str()].clone()],
        })
        .collect();
    let status = devices.iter().map(|d| status_of(providers, d)).collect();
    Ok(Built {
        spec: Spec::for_claim(cdi_devices, common_edits(layout, devices)),
        answer,
        status,
    })
}

/// What every container with the claim gets. A claim of monitoring devices
/// only gets what NVML needs: no UVM nodes (CUDA cannot start without
/// them), no CUDA libraries.
fn common_edits(layout: &Layout, devices: &[Device]) -> ContainerEdits {
    let mut common = ContainerEdits::default();
    let monitor_only = devices
        .iter()
        .all(|d| matches!(d.resolved.kind, Kind::Monitor));
    for node in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
        if node == "/dev/nvidiactl" || (!monitor_only && layout.exists(node)) {
            common.device_nodes.push(layout.node(node));
        }
    }
    common.mounts = layout
        .driver_files
        .iter()
        .filter(|m| !monitor_only || is_nvml_file(&m.container_path))
        .cloned()
        .collect();
    common
}

/// Whether a driver file is one a monitoring agent needs: NVML and
/// `nvidia-smi`.
fn is_nvml_file(container_path: &str) -> bool {
    let name = container_path.rsplit('/').next().unwrap_or_default();
    name.starts_with("libnvidia-ml.so") || name == "nvidia-smi"
}

/// Which device the claim got, then what each provider enforces on it.
fn status_of(providers: &Providers, device: &Device) -> DeviceStatus {
    let d = &device.resolved;
    let sharing = match device.config {
        EffectiveConfig::Gpu { sharing } | EffectiveConfig::Mig { sharing } => {
            Some(match sharing {
                ConfigSharing::None => "None",
                ConfigSharing::TimeSlicing { .. } => "TimeSlicing",
                ConfigSharing::Mps { .. } => "MPS",
            })
        }
        EffectiveConfig::Share { .. } | EffectiveConfig::Monitor => None,
    };
    let (profile, isolation_level, consumed) = match &d.kind {
        Kind::Whole | Kind::Monitor => (None, None, None),
        Kind::Mig { profile, .. } => (Some(profile.clone()), None, None),
        Kind::Share {
            level, consumed, ..
        } => (
            None,
            Some(level.as_str().to_owned()),
            Some(ConsumedData {
                memory_bytes: consumed.memory_bytes,
                cores_percent: consumed.compute_percent,
            }),
        ),
    };
    let mut data = DeviceData {
        device_type: d.target.device_type.as_str().to_owned(),
        gpu_uuid: d.gpu.uuid.clone(),
        mig_uuid: d.mig_instance().map(|i| i.uuid.clone()),
        profile,
        isolation_level,
        sharing: sharing.map(str::to_owned),
        time_slice: None,
        limits: None,
        consumed,
        isolation_provider: None,
    };
    for provider in providers.iter() {
        provider.describe(device, &mut data);
    }
    DeviceStatus {
        pool: d.selected.pool.clone(),
        device: d.selected.device.clone(),
        share_id: d.selected.share_id.clone(),
        data,
    }
}

/// The driver's user-space files to mount into containers: the libraries
/// CUDA programs load and the tools operators expect (`nvidia-smi`), found
/// below `root` in the usual library and binary directories. Each file is
/// mounted read-only at the same path inside the container; a versioned
/// library reached through its soname link (`libcuda.so.1 ->
/// libcuda.so.550.90.07`) is mounted under both names.
pub fn discover_driver_files(root: &Path) -> Vec<Mount> {
    const LIB_DIRS: &[&str] = &[
        "usr/lib/x86_64-linux-gnu",
        "usr/lib/aarch64-linux-gnu",
        "usr/lib64",
        "usr/lib",
        "lib64",
        "lib/x86_64-linux-gnu",
    ];
    const LIB_PREFIXES: &[&str] = &[
        "libcuda.so",
        "libcudadebugger.so",
        "libnvidia-ml.so",
        "libnvidia-ptxjitcompiler.so",
        "libnvidia-nvvm.so",
        "libnvidia-opencl.so",
        "libnvidia-cfg.so",
        "libnvidia-allocator.so",
        "libnvidia-gpucomp.so",
    ];
    const BIN_DIRS: &[&str] = &["usr/bin", "bin"];
    const TOOLS: &[&str] = &["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"];
    let mut mounts: Vec<Mount> = Vec::new();
    let mut add = |host: &Path, container: String| {
        if mounts.iter().any(|m| m.container_path == container) {
            return;
        }
        mounts.push(Mount {
            host_path: host.to_string_lossy().into_owned(),
            container_path: container,
            options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
            mount_type: None,
        });
    };
    for dir in LIB_DIRS {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| LIB_PREFIXES.iter().any(|p| n.starts_with(p)))
            .collect();
        names.sort();
        for name in names {
            let host = root.join(dir).join(&name);
            // Resolve links so the mount source is a file; skip dangling ones.
            let Ok(real) = std::fs::canonicalize(&host) else {
                continue;
            };
            // `libcuda.so` (no version) is for linking only.
            if name.ends_with(".so") {
                continue;
            }
            add(&real, format!("/{dir}/{name}"));
        }
    }
    for dir in BIN_DIRS {
        for tool in TOOLS {
            let host = root.join(dir).join(tool);
            if let Ok(real) = std::fs::canonicalize(&host) {
                add(&real, format!("/usr/bin/{tool}"));
            }
        }
    }
    mounts
}

#[cfg(test)]
mod tests;
