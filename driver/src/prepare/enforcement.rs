//! The enforcement plan: from allocated devices and their effective config
//! to side effects ([`Action`]), a CDI spec and the claim status data.
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
//! * per device: its `/dev/nvidia<minor>`, for MIG devices also the GPU
//!   instance and compute instance capability nodes;
//! * per request: `NVIDIA_VISIBLE_DEVICES` and `CUDA_VISIBLE_DEVICES` set to
//!   exactly the request's GPU / MIG UUIDs, and the MPS client settings when
//!   its devices run under MPS, or HAMi-core's library, preload file and
//!   per-device limits when its Isolated shares are on a GPU whose policy
//!   names `isolationProvider: hami-core` ([`super::hami_core`]);
//! * per spec (any request): `/dev/nvidiactl`, `/dev/nvidia-uvm`,
//!   `/dev/nvidia-uvm-tools` and the driver's libraries and tools from the
//!   driver root.
//!
//! A request with devices on two GPUs that each need their own MPS daemon
//! cannot be served (a CUDA process talks to one MPS pipe directory); that
//! is a per-claim error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_api::config::{
    DeviceTarget, DeviceType, EffectiveConfig, Holdings, IsolationLevel, Limits, Quantity,
    Sharing as ConfigSharing, TimeSliceInterval,
};
use tessera_api::inventory::{Gpu, MigInstance, MigPlacement};
use tessera_api::names;
use tessera_controller::model::DeviceKind;
use tessera_controller::model::policy::{IsolationProvider, TimeSlice};

use super::catalog::Catalog;
use super::claims::{ClaimError, ClaimRef, Selected};
use super::hami_core;
use super::mig_caps;
use super::sharing::{MpsClient, MpsTarget};
use super::state::{Action, ConsumedData, DeviceData, DeviceStatus, LimitsData, PreparedDevice};
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
    fn node(&self, container_path: &str) -> DeviceNode {
        let host = host_path(&self.dev_root, container_path);
        DeviceNode {
            path: container_path.to_owned(),
            host_path: (host.to_str() != Some(container_path))
                .then(|| host.to_string_lossy().into_owned()),
            permissions: None,
        }
    }

    fn exists(&self, container_path: &str) -> bool {
        host_path(&self.dev_root, container_path).exists()
    }
}

fn host_path(root: &Path, container_path: &str) -> PathBuf {
    root.join(container_path.trim_start_matches('/'))
}

/// What an allocated device is, resolved through the catalog.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub selected: Selected,
    pub gpu: Gpu,
    pub kind: Kind,
    pub target: DeviceTarget,
    /// The MIG mode the GPU must be in, where the driver switches it.
    pub mig_mode: Option<bool>,
}

#[derive(Debug, Clone)]
pub enum Kind {
    Whole,
    Mig {
        profile: String,
        /// The existing instance, or `None` until a dynamic one is created.
        instance: Option<MigInstance>,
        /// For dynamic MIG: what to create.
        create: Option<(u32, MigPlacement)>,
    },
    Share {
        level: IsolationLevel,
        consumed: Holdings,
        /// The node policy's time slice for Shared shares of the GPU.
        time_slice: Option<TimeSliceInterval>,
        /// Who enforces an Isolated share's limits, as published.
        provider: Option<IsolationProvider>,
    },
    /// The GPU's monitoring device (adminAccess claims only).
    Monitor,
}

/// Resolves one allocated device.
pub fn resolve(
    claim: &ClaimRef,
    selected: &Selected,
    catalog: &Catalog,
) -> Result<Resolved, ClaimError> {
    let field = format!("status.allocation.devices.results[{}]", selected.index);
    let reference = catalog.resolve(&selected.device).ok_or_else(|| {
        ClaimError::new(
            claim,
            format!(
                "device {} of pool {} is not a device this node publishes",
                selected.device, selected.pool
            ),
        )
        .field(format!("{field}.device"))
        .fix("the GPU may have gone or the node policy changed since allocation: delete the Pod so the claim is allocated again")
    })?;
    let gpu = catalog.gpu(&reference.gpu_uuid).cloned().ok_or_else(|| {
        ClaimError::new(
            claim,
            format!(
                "GPU {} of device {} is not on this node any more",
                reference.gpu_uuid, selected.device
            ),
        )
        .field(format!("{field}.device"))
        .fix("check the GPU (tessera inventory, nvidia-smi); delete the Pod to allocate another device")
    })?;
    let (kind, device_type, holds) = match &reference.kind {
        DeviceKind::Whole => (
            Kind::Whole,
            DeviceType::Gpu,
            Holdings {
                memory_bytes: gpu.memory_bytes,
                compute_percent: 100,
            },
        ),
        DeviceKind::Mig {
            profile_id,
            profile,
            placement,
            existing,
            dynamic,
        } => {
            // A dynamic device is created for its claim, always: whatever
            // the model saw at its placement is not this claim's.
            let instance = match existing {
                Some(uuid) if !dynamic => Some(
                    gpu.mig
                        .instances()
                        .iter()
                        .find(|i| &i.uuid == uuid)
                        .cloned()
                        .ok_or_else(|| {
                            ClaimError::new(
                                claim,
                                format!(
                                    "MIG device {uuid} ({}) no longer exists on GPU {}",
                                    selected.device, gpu.uuid
                                ),
                            )
                            .field(format!("{field}.device"))
                            .fix("delete the Pod so the claim is allocated again")
                        })?,
                ),
                _ => None,
            };
            let memory_bytes = instance
                .as_ref()
                .map(|i| i.memory_bytes)
                .or_else(|| {
                    gpu.mig
                        .profiles()
                        .iter()
                        .find(|p| p.id == *profile_id)
                        .map(|p| p.memory_bytes)
                })
                .unwrap_or(gpu.memory_bytes);
            let create = instance.is_none().then_some((*profile_id, *placement));
            (
                Kind::Mig {
                    profile: profile.clone(),
                    instance,
                    create,
                },
                DeviceType::Mig,
                Holdings {
                    memory_bytes,
                    compute_percent: 100,
                },
            )
        }
        DeviceKind::Share {
            level,
            time_slice,
            provider,
        } => {
            let level = *level;
            let consumed = consumed_capacity(claim, selected, &field)?;
            (
                Kind::Share {
                    level,
                    consumed,
                    time_slice: policy_time_slice(level, *time_slice),
                    provider: *provider,
                },
                DeviceType::Share(level),
                consumed,
            )
        }
        DeviceKind::Monitor => {
            if !selected.admin_access {
                return Err(ClaimError::new(
                    claim,
                    format!(
                        "device {} is the monitoring device of GPU {}, which only a request with \
                         adminAccess gets, and request `{}` does not have admin access",
                        selected.device, gpu.uuid, selected.request
                    ),
                )
                .field(format!("{field}.adminAccess"))
                .fix(format!(
                    "set `adminAccess: true` in request `{}` (its namespace needs the label \
                     resource.kubernetes.io/admin-access=true), or ask for a device class that \
                     selects work devices (type gpu, mig or share), then delete the Pod so the \
                     claim is allocated again",
                    selected.request
                )));
            }
            (
                Kind::Monitor,
                DeviceType::Monitor,
                Holdings {
                    memory_bytes: 0,
                    compute_percent: 0,
                },
            )
        }
        DeviceKind::Replica {
            level,
            memory_bytes,
            cores,
            time_slice,
            provider,
            ..
        } => {
            let level = *level;
            let consumed = Holdings {
                memory_bytes: *memory_bytes,
                compute_percent: *cores,
            };
            (
                Kind::Share {
                    level,
                    consumed,
                    time_slice: policy_time_slice(level, *time_slice),
                    provider: *provider,
                },
                DeviceType::Share(level),
                consumed,
            )
        }
    };
    // A monitor watches the GPU in whatever mode it is.
    let mig_mode = (catalog.mig_managed(&gpu.uuid) && !matches!(kind, Kind::Monitor))
        .then_some(matches!(kind, Kind::Mig { .. }));
    Ok(Resolved {
        selected: selected.clone(),
        gpu,
        kind,
        mig_mode,
        target: DeviceTarget {
            request: selected.request.clone(),
            device: selected.device.clone(),
            device_type,
            holds,
        },
    })
}

/// The slice a Shared share sets on its GPU: the node policy's, unless it
/// is the driver's default (nothing to change then).
fn policy_time_slice(
    level: IsolationLevel,
    policy: Option<TimeSlice>,
) -> Option<TimeSliceInterval> {
    if level != IsolationLevel::Shared {
        return None;
    }
    match policy? {
        TimeSlice::Default => None,
        TimeSlice::Short => Some(TimeSliceInterval::Short),
        TimeSlice::Medium => Some(TimeSliceInterval::Medium),
        TimeSlice::Long => Some(TimeSliceInterval::Long),
    }
}

/// The time slice a device sets on its GPU: its config's `TimeSlicing`
/// interval (whole GPUs), or the node policy's for a Shared share.
pub fn time_slice(device: &Resolved, config: &EffectiveConfig) -> Option<TimeSliceInterval> {
    match (config, &device.kind) {
        (
            EffectiveConfig::Gpu {
                sharing: ConfigSharing::TimeSlicing { interval },
            },
            _,
        ) => Some(*interval),
        (EffectiveConfig::Share { .. }, Kind::Share { time_slice, .. }) => *time_slice,
        _ => None,
    }
}

fn consumed_capacity(
    claim: &ClaimRef,
    selected: &Selected,
    field: &str,
) -> Result<Holdings, ClaimError> {
    let get = |name: &str| {
        let raw = selected.consumed.get(name).ok_or_else(|| {
            ClaimError::new(
                claim,
                format!(
                    "share device {} has no consumed `{name}` capacity in its allocation",
                    selected.device
                ),
            )
            .field(format!("{field}.consumedCapacity.{name}"))
            .fix("the API server must serve consumable capacity (DRAConsumableCapacity) for share devices")
        })?;
        Quantity::parse(raw).map(Quantity::bytes).map_err(|e| {
            ClaimError::new(
                claim,
                format!("consumed capacity {raw:?} does not parse: {e}"),
            )
            .field(format!("{field}.consumedCapacity.{name}"))
        })
    };
    let memory_bytes = get(names::capacity::MEMORY)?;
    let cores = get(names::capacity::CORES)?;
    Ok(Holdings {
        memory_bytes,
        compute_percent: u32::try_from(cores.min(100)).unwrap_or(100),
    })
}

/// Side effects one device's config needs after its hardware is ready.
/// MIG mode holds and created MIG devices are recorded by prepare itself,
/// under the node's hardware lock, as they are made.
pub fn actions(device: &Resolved, config: &EffectiveConfig) -> Vec<Action> {
    let mut actions = Vec::new();
    if time_slice(device, config).is_some() {
        actions.push(Action::TimeSlice {
            gpu_uuid: device.gpu.uuid.clone(),
        });
    }
    if hami_core_limits(device, config).is_some() {
        // Nothing on the host: the library enforces inside the container.
        return actions;
    }
    if config_limits(config).is_some() {
        // A dynamic MIG device's UUID is filled in once it exists.
        let target = mps_target(device);
        actions.push(Action::Mps {
            gpu_uuid: target.gpu_uuid,
            mig_uuid: target.mig_uuid,
            request: Some(target.request),
        });
    }
    actions
}

fn mig_instance(device: &Resolved) -> Option<&MigInstance> {
    match &device.kind {
        Kind::Mig { instance, .. } => instance.as_ref(),
        _ => None,
    }
}

/// The MPS target of a device, once its MIG instance (if any) exists.
pub fn mps_target(device: &Resolved) -> MpsTarget {
    MpsTarget {
        request: device.selected.request.clone(),
        gpu_uuid: device.gpu.uuid.clone(),
        mig_uuid: mig_instance(device).map(|i| i.uuid.clone()),
    }
}

/// The MPS daemons a claim needs: one per request and device, with the
/// limits of the request's devices there added up (two shares of one GPU
/// in a request are one client's), compute capped at 100%.
pub fn mps_daemons(built: &[Built]) -> BTreeMap<MpsTarget, Limits> {
    let mut daemons: BTreeMap<MpsTarget, Limits> = BTreeMap::new();
    for b in built {
        let Some(l) = mps_limits(&b.device, &b.config) else {
            continue;
        };
        let at = daemons.entry(mps_target(&b.device)).or_insert(Limits {
            memory_bytes: 0,
            compute_percent: 0,
        });
        at.memory_bytes += l.memory_bytes;
        at.compute_percent = (at.compute_percent + l.compute_percent).min(100);
    }
    daemons
}

/// Per-process limits a device's config asks MPS to enforce (none for a
/// share whose limits HAMi-core enforces).
pub fn mps_limits(device: &Resolved, config: &EffectiveConfig) -> Option<Limits> {
    if hami_core_limits(device, config).is_some() {
        return None;
    }
    config_limits(config)
}

/// The limits HAMi-core enforces for a device: an Isolated share on a GPU
/// whose node policy names `isolationProvider: hami-core`.
pub fn hami_core_limits(device: &Resolved, config: &EffectiveConfig) -> Option<Limits> {
    match (&device.kind, config) {
        (
            Kind::Share {
                provider: Some(IsolationProvider::HamiCore),
                ..
            },
            EffectiveConfig::Share { limits },
        ) => *limits,
        _ => None,
    }
}

/// The limits a device's config asks for, whoever enforces them.
fn config_limits(config: &EffectiveConfig) -> Option<Limits> {
    match config {
        EffectiveConfig::Gpu {
            sharing: ConfigSharing::Mps { limits },
        }
        | EffectiveConfig::Mig {
            sharing: ConfigSharing::Mps { limits },
        } => Some(*limits),
        EffectiveConfig::Share { limits } => *limits,
        _ => None,
    }
}

/// A device with everything decided and every side effect made.
#[derive(Debug, Clone)]
pub struct Built {
    pub device: Resolved,
    pub config: EffectiveConfig,
    pub mps: Option<MpsClient>,
}

/// The CDI device name of a request of a claim.
pub fn cdi_device_name(request: &str, claim: &ClaimUid) -> String {
    format!("{}_{}", request.replace('/', "."), claim.as_str())
}

/// Builds the claim's CDI spec, the kubelet's answer and the status data.
pub fn build(
    claim: &ClaimRef,
    uid: &ClaimUid,
    layout: &Layout,
    devices: &[Built],
) -> Result<(Spec, Vec<PreparedDevice>, Vec<DeviceStatus>), ClaimError> {
    // Requests in order of first appearance.
    let mut requests: Vec<&str> = Vec::new();
    for d in devices {
        if !requests.contains(&d.device.selected.request.as_str()) {
            requests.push(&d.device.selected.request);
        }
    }

    let mut cdi_devices = Vec::new();
    let mut ids: BTreeMap<&str, String> = BTreeMap::new();
    for request in &requests {
        let members: Vec<&Built> = devices
            .iter()
            .filter(|d| d.device.selected.request == *request)
            .collect();
        let name = cdi_device_name(request, uid);
        ids.insert(request, cdi::qualified_name(&name));
        cdi_devices.push(cdi::Device {
            name,
            container_edits: request_edits(claim, uid, layout, request, &members)?,
        });
    }

    let mut common = ContainerEdits::default();
    // A claim of monitoring devices only gets what NVML needs: no UVM nodes
    // (CUDA cannot start without them), no CUDA libraries.
    let monitor_only = devices
        .iter()
        .all(|d| matches!(d.device.kind, Kind::Monitor));
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

    let answer = devices
        .iter()
        .map(|d| PreparedDevice {
            request_names: vec![d.device.selected.request.clone()],
            pool_name: d.device.selected.pool.clone(),
            device_name: d.device.selected.device.clone(),
            cdi_device_ids: vec![ids[d.device.selected.request.as_str()].clone()],
        })
        .collect();
    let status = devices.iter().map(status_of).collect();
    Ok((Spec::for_claim(cdi_devices, common), answer, status))
}

/// Whether a driver file is one a monitoring agent needs: NVML and
/// `nvidia-smi`.
fn is_nvml_file(container_path: &str) -> bool {
    let name = container_path.rsplit('/').next().unwrap_or_default();
    name.starts_with("libnvidia-ml.so") || name == "nvidia-smi"
}

fn request_edits(
    claim: &ClaimRef,
    uid: &ClaimUid,
    layout: &Layout,
    request: &str,
    members: &[&Built],
) -> Result<ContainerEdits, ClaimError> {
    let mut edits = ContainerEdits::default();
    let mut visible: Vec<String> = Vec::new();
    let push_node = |edits: &mut ContainerEdits, path: String| {
        if !edits.device_nodes.iter().any(|n| n.path == path) {
            edits.device_nodes.push(layout.node(&path));
        }
    };
    for m in members {
        let d = &m.device;
        let gpu_node = format!("/dev/nvidia{}", d.gpu.minor);
        if !layout.exists(&gpu_node) {
            return Err(ClaimError::new(
                claim,
                format!(
                    "device node {} of GPU {} does not exist under {}",
                    gpu_node,
                    d.gpu.uuid,
                    layout.dev_root.display()
                ),
            )
            .fix("load the NVIDIA driver (nvidia-modprobe), or point --dev-root/--driver-root at where its /dev is"));
        }
        push_node(&mut edits, gpu_node);
        let uuid = match mig_instance(d) {
            Some(instance) => {
                let caps = mig_caps::read(
                    &layout.driver_root,
                    d.gpu.minor,
                    instance.gpu_instance_id,
                    instance.compute_instance_id,
                )
                .map_err(|e| {
                    ClaimError::new(claim, e).field(format!(
                        "status.allocation.devices.results[{}]",
                        d.selected.index
                    ))
                })?;
                for minor in [caps.gpu_instance, caps.compute_instance] {
                    let device = mig_caps::device_path(minor);
                    mig_caps::ensure_node(&layout.dev_root, &layout.driver_root, &device, minor)
                        .map_err(|e| {
                            ClaimError::new(claim, e)
                                .fix("load the NVIDIA driver with MIG support, or point --dev-root at a writable /dev")
                        })?;
                    push_node(&mut edits, device);
                }
                instance.uuid.clone()
            }
            None => d.gpu.uuid.clone(),
        };
        if !visible.contains(&uuid) {
            visible.push(uuid);
        }
    }
    let list = visible.join(",");
    edits.env.push(format!("NVIDIA_VISIBLE_DEVICES={list}"));
    edits.env.push(format!("CUDA_VISIBLE_DEVICES={list}"));

    // MPS: one daemon per request at most.
    let mps: Vec<&Built> = members
        .iter()
        .copied()
        .filter(|m| m.mps.is_some())
        .collect();
    if let Some(first) = mps.first() {
        let client = first.mps.as_ref().expect("filtered");
        if mps.iter().any(|m| m.mps.as_ref() != Some(client)) || mps.len() != members.len() {
            return Err(ClaimError::new(
                claim,
                format!(
                    "request {request} has devices that would need different MPS daemons (or \
                     some under MPS and some not); a CUDA process can use one MPS daemon only"
                ),
            )
            .field(format!("spec.devices.requests[{request}]"))
            .fix("split the request into one request per GPU, or do not combine MPS and non-MPS devices"));
        }
        edits.env.push(format!(
            "CUDA_MPS_PIPE_DIRECTORY={}",
            client.pipe_dir.display()
        ));
        // The daemon's own limits, again where the client reads them (they
        // can only lower the daemon's).
        let limits = crate::mps::ClientLimits {
            memory_bytes: client.limits.memory_bytes,
            thread_percent: client.limits.compute_percent,
        };
        let env = crate::mps::client_limit_env(&visible[0], limits).map_err(|e| {
            ClaimError::new(claim, e.to_string()).field(format!("spec.devices.requests[{request}]"))
        })?;
        edits.env.extend(env);
        // The pipe directory, and the daemon's /dev/shm where the server
        // and its clients share memory; the daemon's logs stay on the host.
        let pipe = client.pipe_dir.to_string_lossy().into_owned();
        let shm = client.shm_dir.to_string_lossy().into_owned();
        for (host_path, container_path) in [(pipe.clone(), pipe), (shm, "/dev/shm".to_owned())] {
            edits.mounts.push(Mount {
                host_path,
                container_path,
                options: crate::mps::PIPE_MOUNT_OPTIONS.map(String::from).to_vec(),
                mount_type: None,
            });
        }
    }
    hami_core_edits(claim, uid, layout, request, members, &visible, &mut edits)?;
    Ok(edits)
}

/// HAMi-core for the request's devices it enforces: its library and the
/// preload file that makes the dynamic loader load it into every process,
/// both read-only, and per device the limits at the CUDA index the
/// container sees it under (its position in `CUDA_VISIBLE_DEVICES`). Two
/// shares of one GPU in a request add up at that index.
fn hami_core_edits(
    claim: &ClaimRef,
    uid: &ClaimUid,
    layout: &Layout,
    request: &str,
    members: &[&Built],
    visible: &[String],
    edits: &mut ContainerEdits,
) -> Result<(), ClaimError> {
    let mut limits: BTreeMap<usize, Limits> = BTreeMap::new();
    for m in members {
        let Some(l) = hami_core_limits(&m.device, &m.config) else {
            continue;
        };
        let index = visible
            .iter()
            .position(|u| *u == m.device.gpu.uuid)
            .expect("every member's GPU is visible");
        let at = limits.entry(index).or_insert(Limits {
            memory_bytes: 0,
            compute_percent: 0,
        });
        at.memory_bytes += l.memory_bytes;
        at.compute_percent = (at.compute_percent + l.compute_percent).min(100);
    }
    if limits.is_empty() {
        return Ok(());
    }
    let files = hami_core::check(&layout.hami_core_dir).map_err(|e| {
        ClaimError::new(claim, e.what)
            .field(format!("spec.devices.requests[{request}]"))
            .fix(e.fix)
    })?;
    for (index, l) in &limits {
        let vars = hami_core::limit_env(*index, l).map_err(|e| {
            ClaimError::new(claim, format!("request {request}: {e}"))
                .field(format!("spec.devices.requests[{request}]"))
                .fix("ask for at least 1Mi of memory and 1% of cores")
        })?;
        edits.env.extend(vars);
    }
    edits
        .env
        .push(hami_core::cache_env(&cdi_device_name(request, uid)));
    edits.mounts.extend(hami_core::mounts(&files));
    Ok(())
}

fn status_of(built: &Built) -> DeviceStatus {
    let d = &built.device;
    let hami = hami_core_limits(d, &built.config);
    let limits = hami
        .or_else(|| mps_limits(d, &built.config))
        .map(|l| LimitsData {
            memory: Quantity::from_bytes(l.memory_bytes).to_string(),
            memory_bytes: l.memory_bytes,
            compute_percent: l.compute_percent,
        });
    let (sharing, time_slice) = match built.config {
        EffectiveConfig::Gpu { sharing } | EffectiveConfig::Mig { sharing } => match sharing {
            ConfigSharing::None => (Some("None"), None),
            ConfigSharing::TimeSlicing { interval } => {
                (Some("TimeSlicing"), Some(format!("{interval:?}")))
            }
            ConfigSharing::Mps { .. } => (Some("MPS"), None),
        },
        EffectiveConfig::Share { .. } => {
            (None, time_slice(d, &built.config).map(|i| format!("{i:?}")))
        }
        EffectiveConfig::Monitor => (None, None),
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
    DeviceStatus {
        pool: d.selected.pool.clone(),
        device: d.selected.device.clone(),
        share_id: d.selected.share_id.clone(),
        data: DeviceData {
            device_type: d.target.device_type.as_str().to_owned(),
            gpu_uuid: d.gpu.uuid.clone(),
            mig_uuid: mig_instance(d).map(|i| i.uuid.clone()),
            profile,
            isolation_level,
            sharing: sharing.map(str::to_owned),
            time_slice,
            limits,
            consumed,
            isolation_provider: match &d.kind {
                Kind::Share {
                    level: IsolationLevel::Isolated,
                    provider,
                    ..
                } => Some(
                    provider
                        .unwrap_or(IsolationProvider::Mps)
                        .as_str()
                        .to_owned(),
                ),
                _ => None,
            },
        },
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
mod tests {
    use super::*;
    use tessera_api::inventory::{Mig, MigEngines};

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
    ) -> Built {
        let consumed = Holdings {
            memory_bytes,
            compute_percent: cores,
        };
        let device = format!("gpu-{}-isolated", gpu.minor);
        let device = Resolved {
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
            }),
        };
        let mps = mps_limits(&device, &config).map(|limits| MpsClient {
            pipe_dir: PathBuf::from("/run/tessera/mps/pipe"),
            shm_dir: PathBuf::from("/run/tessera/mps/shm"),
            limits,
        });
        Built {
            device,
            config,
            mps,
        }
    }

    fn hami(index: usize, request: &str, gpu: Gpu, memory_bytes: u64, cores: u32) -> Built {
        share(
            index,
            request,
            gpu,
            IsolationProvider::HamiCore,
            memory_bytes,
            cores,
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
            assert!(actions(&d.device, &d.config).is_empty());
            assert!(d.mps.is_none());
        }
        let (spec, answer, status) = build(&claim(), &uid(), &node.layout(), &devices).unwrap();
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
        let (spec, _, _) = build(&claim(), &uid(), &node.layout(), &devices).unwrap();
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
        let mig = Built {
            device: Resolved {
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
        let (spec, _, status) = build(&claim(), &uid(), &node.layout(), &devices).unwrap();
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
                "/dev/nvidia-caps/nvidia-cap21",
                "/dev/nvidia-caps/nvidia-cap22",
                "/dev/nvidia0"
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
        let (spec, _, _) = build(&claim(), &uid(), &node.layout(), &devices).unwrap();
        let env = env_of(&spec, 0);
        assert!(env.contains(&"CUDA_VISIBLE_DEVICES=GPU-a"), "{env:?}");
        assert!(env.contains(&"CUDA_DEVICE_MEMORY_LIMIT_0=5120m"), "{env:?}");
        assert!(env.contains(&"CUDA_DEVICE_SM_LIMIT_0=100"), "{env:?}");
    }

    #[test]
    fn without_the_library_a_hami_core_share_is_refused_not_weakened() {
        let node = Node::new(false);
        let devices = [hami(0, "gpus", gpu("GPU-a", 0, Mig::NotSupported), GIB, 10)];
        let err = build(&claim(), &uid(), &node.layout(), &devices)
            .unwrap_err()
            .to_string();
        assert!(err.contains("team/train"), "{err}");
        assert!(err.contains(&node.host("libvgpu.so")), "{err}");
        assert!(err.contains("--hami-core-dir"), "{err}");
        assert!(err.contains("isolationProvider: mps"), "{err}");
    }

    #[test]
    fn an_mps_share_is_untouched_by_hami_core() {
        let node = Node::new(true);
        let d = share(
            0,
            "gpus",
            gpu("GPU-a", 0, Mig::NotSupported),
            IsolationProvider::Mps,
            2 * GIB,
            20,
        );
        assert!(matches!(
            actions(&d.device, &d.config).as_slice(),
            [Action::Mps { .. }]
        ));
        let (spec, _, status) = build(&claim(), &uid(), &node.layout(), &[d]).unwrap();
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
}
