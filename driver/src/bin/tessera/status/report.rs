//! The report: per GPU, its claims and memory, from the checkpoint, the
//! inventory and NVML.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;
use tessera_api::inventory::{Inventory, Mig};
use tessera_controller::model::plan;
use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::host::mps::generation::IsolationSupport;
use tessera_driver::metrics::memory;
use tessera_driver::state::records::{ClaimEntry, EntryState, LimitsData};

use super::api::ApiView;

/// What `tessera status -o json` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// The checkpoint read.
    pub checkpoint: PathBuf,
    pub gpus: Vec<GpuStatus>,
    /// Why Pods and health are unknown (no API server read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_unavailable: Option<String>,
    /// What could not be read (the rest is still reported).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// How the node enforces Isolated shares, and whether it has the next
    /// generation's pieces (MPS v3 driver, cgroup dmem controller).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation: Option<IsolationSupport>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    pub uuid: String,
    /// Absent for a GPU only the checkpoint knows (NVML does not list it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product_name: Option<String>,
    /// `enabled`, `disabled`, `notSupported`, or `unknown`.
    pub mig_mode: String,
    /// What its prepared claims use it as: `idle`, `whole`, `mig`,
    /// `isolated/<provider>`, `shared` (`+`-joined if several).
    pub mode: String,
    /// `healthy`, or `unhealthy (<cause>)` from the node's device taints;
    /// absent when unknown (no API server read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_total_bytes: Option<u64>,
    /// Memory allocated to prepared claims (see `metrics::memory`).
    pub memory_allocated_bytes: u64,
    /// Memory NVML reports used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
    /// Why the node offers no Isolated shares served by MPS on this GPU
    /// (it predates Volta); absent where it offers them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolated_shares: Option<String>,
    pub claims: Vec<ClaimOnGpu>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimOnGpu {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// `Completed`, or `Started`/`Unpreparing` while a call is under way.
    pub state: String,
    /// The published device name.
    pub device: String,
    /// `gpu`, `mig` or `share`.
    pub kind: String,
    #[serde(rename = "migUUID", skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation_level: Option<String>,
    pub memory_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsData>,
    /// For Isolated shares: `mps` or `hami-core`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation_provider: Option<String>,
    /// The Pods the claim is reserved for (`status.reservedFor`); absent
    /// when unknown (no API server read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pods: Option<Vec<String>>,
}

impl Report {
    /// Adds what the API server said: Pods per claim, health per GPU.
    pub fn apply(&mut self, view: &ApiView) {
        for gpu in &mut self.gpus {
            gpu.health = Some(match view.unhealthy.get(&gpu.uuid) {
                Some(cause) => format!("unhealthy ({cause})"),
                None => "healthy".to_owned(),
            });
            for claim in &mut gpu.claims {
                claim.pods = Some(view.pods.get(&claim.uid).cloned().unwrap_or_default());
            }
        }
    }
}

/// What a GPU's claims use it as.
fn mode(claims: &[ClaimOnGpu]) -> String {
    let mut modes: Vec<String> = Vec::new();
    for c in claims {
        let m = match (c.kind.as_str(), c.isolation_level.as_deref()) {
            ("gpu", _) => "whole".to_owned(),
            ("mig", _) => "mig".to_owned(),
            ("share", Some("Isolated")) => format!(
                "isolated/{}",
                c.isolation_provider.as_deref().unwrap_or("mps")
            ),
            ("share", _) => "shared".to_owned(),
            // Monitoring devices watch; they do not use the GPU.
            _ => continue,
        };
        if !modes.contains(&m) {
            modes.push(m);
        }
    }
    if modes.is_empty() {
        "idle".to_owned()
    } else {
        modes.join("+")
    }
}

/// The report from the checkpoint entries, the inventory and NVML's used
/// memory per GPU.
pub fn build(
    checkpoint: PathBuf,
    entries: &[(ClaimUid, ClaimEntry)],
    inventory: &Inventory,
    used: &BTreeMap<String, u64>,
    problems: Vec<String>,
) -> Report {
    let allocated = memory::allocated_by_gpu(entries.iter().map(|(_, e)| e), inventory);
    let allocated = |uuid: &str| allocated.get(uuid).copied().unwrap_or(0);
    let mut claims = claims_by_gpu(entries, inventory);
    let mut gpus: Vec<GpuStatus> = (inventory.gpus.iter())
        .map(|g| GpuStatus {
            uuid: g.uuid.clone(),
            product_name: Some(g.product_name.clone()),
            mig_mode: mig_mode(&g.mig).to_owned(),
            memory_total_bytes: Some(g.memory_bytes),
            memory_allocated_bytes: allocated(&g.uuid),
            memory_used_bytes: used.get(&g.uuid).copied(),
            isolated_shares: plan::mps_isolation_unsupported(g),
            claims: claims.remove(g.uuid.as_str()).unwrap_or_default(),
            mode: String::new(),
            health: None,
        })
        .collect();
    // Claims on GPUs NVML does not list (gone, or NVML unreadable).
    for (uuid, on) in claims {
        gpus.push(GpuStatus {
            uuid: uuid.to_owned(),
            product_name: None,
            mig_mode: "unknown".into(),
            memory_total_bytes: None,
            memory_allocated_bytes: allocated(uuid),
            memory_used_bytes: None,
            isolated_shares: None,
            claims: on,
            mode: String::new(),
            health: None,
        });
    }
    for gpu in &mut gpus {
        gpu.mode = mode(&gpu.claims);
    }
    Report {
        checkpoint,
        gpus,
        api_unavailable: None,
        problems,
        isolation: None,
    }
}

/// Each prepared device of each claim, under the UUID of its GPU.
fn claims_by_gpu<'e>(
    entries: &'e [(ClaimUid, ClaimEntry)],
    inventory: &Inventory,
) -> BTreeMap<&'e str, Vec<ClaimOnGpu>> {
    let mut claims: BTreeMap<&str, Vec<ClaimOnGpu>> = BTreeMap::new();
    for (uid, entry) in entries {
        for device in &entry.status {
            let data = &device.data;
            claims
                .entry(data.gpu_uuid.as_str())
                .or_default()
                .push(ClaimOnGpu {
                    namespace: entry.namespace.clone(),
                    name: entry.name.clone(),
                    uid: uid.as_str().to_owned(),
                    state: format!("{:?}", entry.state),
                    device: device.device.clone(),
                    kind: data.device_type.clone(),
                    mig_uuid: data.mig_uuid.clone(),
                    profile: data.profile.clone(),
                    isolation_level: data.isolation_level.clone(),
                    memory_bytes: if entry.state == EntryState::Completed {
                        memory::device_memory(data, inventory)
                    } else {
                        0
                    },
                    limits: data.limits.clone(),
                    isolation_provider: data.isolation_provider.clone(),
                    pods: None,
                });
        }
    }
    claims
}

/// The MIG mode as the report says it.
fn mig_mode(mig: &Mig) -> &'static str {
    match mig {
        Mig::NotSupported => "notSupported",
        Mig::Disabled { .. } => "disabled",
        Mig::Enabled { .. } => "enabled",
    }
}
