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
//! * from the driver's own spec ([`driver_spec`], written at start), whose
//!   CDI id every device of the claim is also answered with: `cuda`
//!   (`/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` and the
//!   driver's libraries and tools from the driver root), or `nvml` for a
//!   claim of monitoring devices only. Kept out of the claim's spec: the
//!   runtime parses every spec again after each change.

use std::collections::BTreeMap;

use tessera_api::config::{EffectiveConfig, Sharing as ConfigSharing};

use super::claims::{ClaimError, ClaimRef};
use super::enforce::{Device, Enforcers, Request};
use super::resolve::Kind;
use crate::cdi::{self, ContainerEdits, DriverDevice, Spec};
use crate::claim_uid::ClaimUid;
use crate::host::driver_root::{Layout, is_nvml_file};
use crate::state::records::{ConsumedData, DeviceData, DeviceStatus, PreparedDevice};

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
    enforcers: &Enforcers,
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
        for provider in enforcers.iter() {
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

    let driver = driver_device(devices).qualified_name();
    let answer = devices
        .iter()
        .map(|d| PreparedDevice {
            request_names: vec![d.resolved.selected.request.clone()],
            pool_name: d.resolved.selected.pool.clone(),
            device_name: d.resolved.selected.device.clone(),
            cdi_device_ids: vec![
                ids[d.resolved.selected.request.as_str()].clone(),
                driver.clone(),
            ],
        })
        .collect();
    let status = devices.iter().map(|d| status_of(enforcers, d)).collect();
    Ok(Built {
        spec: Spec::for_claim(cdi_devices),
        answer,
        status,
    })
}

/// Which of the driver spec's devices every container with the claim
/// gets: a claim of monitoring devices only gets what NVML needs, no UVM
/// nodes (CUDA cannot start without them) and no CUDA libraries.
fn driver_device(devices: &[Device]) -> DriverDevice {
    if devices
        .iter()
        .all(|d| matches!(d.resolved.kind, Kind::Monitor))
    {
        DriverDevice::Nvml
    } else {
        DriverDevice::Cuda
    }
}

/// The driver's spec for the node's driver root (see the module
/// documentation).
pub fn driver_spec(layout: &Layout) -> Spec {
    Spec::for_driver(
        driver_edits(layout, DriverDevice::Cuda),
        driver_edits(layout, DriverDevice::Nvml),
    )
}

/// The edits of one of the driver spec's devices.
fn driver_edits(layout: &Layout, which: DriverDevice) -> ContainerEdits {
    let mut common = ContainerEdits::default();
    let monitor_only = which == DriverDevice::Nvml;
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

/// Which device the claim got, then what each provider enforces on it.
fn status_of(enforcers: &Enforcers, device: &Device) -> DeviceStatus {
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
    for provider in enforcers.iter() {
        provider.describe(device, &mut data);
    }
    DeviceStatus {
        pool: d.selected.pool.clone(),
        device: d.selected.device.clone(),
        share_id: d.selected.share_id.clone(),
        data,
        conditions: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
