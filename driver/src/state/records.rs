//! What the checkpoint records per claim, and the claim status data.
//!
//! An entry moves `Started` -> `Completed` -> (`Unpreparing` ->) gone:
//!
//! * `Started` is written before any side effect, with the side effects
//!   about to be made ([`Action`]). Work left in this state (a crash, or an
//!   error part way) is rolled back: undo every action, remove the CDI spec.
//! * `Completed` carries the answer given to the kubelet and the CDI spec, so
//!   a repeated prepare returns exactly the same answer without redoing work
//!   (and a spec lost from the CDI directory can be written again).
//! * `Unpreparing` is written before unprepare removes anything, so a crash
//!   in the middle of an unprepare is finished at start-up rather than
//!   leaving a `Completed` entry whose spec is gone.
//!
//! Fields are added, never repurposed: an older version reading a newer
//! entry (a rollback) ignores the fields, actions and spec it does not know
//! and keeps the claim with the rest; the checkpoint reports what it
//! ignored ([`crate::state::checkpoint::Checkpoint::unknown_fields`]).

use serde::{Deserialize, Serialize};
use tessera_api::config::{Limits, Quantity};
use tessera_api::inventory::MigPlacement;

use crate::cdi::Spec;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EntryState {
    Started,
    Completed,
    Unpreparing,
}

/// One prepared (or being prepared) claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    pub namespace: String,
    pub name: String,
    pub state: EntryState,
    /// Side effects made (or about to be made) for this claim, in order.
    /// Kinds a newer version added are left out here.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "known_actions"
    )]
    pub actions: Vec<Action>,
    /// The answer returned to the kubelet (set when `Completed`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<PreparedDevice>,
    /// The CDI spec written for the claim (set when `Completed`); `None`
    /// where a newer version wrote one this version cannot read.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "known_spec"
    )]
    pub spec: Option<Spec>,
    /// What was (or will be) written to `status.devices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub status: Vec<DeviceStatus>,
    /// Prepared before its pod was bound, at the scheduler's request
    /// (binding conditions), and not asked for by the kubelet yet: if the
    /// allocation goes away first, the node unprepares it itself.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ahead: bool,
}

/// A side effect of prepare that unprepare (or rollback) must undo.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum Action {
    /// The claim's own MPS daemon for one request on a GPU (or MIG
    /// device). Without a request: a reference on the per-device daemon an
    /// earlier version shared between claims (retired at start; nothing of
    /// the claim's own to stop).
    Mps {
        gpu_uuid: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig_uuid: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request: Option<String>,
    },
    /// The GPU's compute time slice was changed.
    TimeSlice { gpu_uuid: String },
    /// The claim needs the GPU in this MIG mode (on a GPU whose mode the
    /// driver manages; the driver switched it if it was not). Undoing it
    /// drops the claim's hold; a GPU nobody holds goes back to MIG off.
    MigMode { gpu_uuid: String, enabled: bool },
    /// A MIG device created for the claim: recorded after its memory slices
    /// were seen free and before NVML was asked, and again with what NVML
    /// made (`instance`). Undo destroys only that instance.
    MigCreate {
        gpu_uuid: String,
        profile_id: u32,
        placement: MigPlacement,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        instance: Option<MigRecord>,
    },
}

/// The identity of a MIG device the driver created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigRecord {
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub mig_uuid: String,
}

/// The actions this version knows; the others (a newer version's) are
/// reported by the checkpoint as unknown and left alone.
fn known_actions<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Action>, D::Error> {
    let items = Vec::<serde_json::Value>::deserialize(d)?;
    Ok(items.into_iter().filter_map(decoded).collect())
}

fn known_spec<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Spec>, D::Error> {
    Ok(Option::<serde_json::Value>::deserialize(d)?.and_then(decoded))
}

fn decoded<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Option<T> {
    serde_json::from_value(value).ok()
}

/// Each item of the list `field` that decodes.
fn items<T: serde::de::DeserializeOwned>(entry: &serde_json::Value, field: &str) -> Vec<T> {
    let items = entry.get(field).and_then(serde_json::Value::as_array);
    (items.into_iter().flatten())
        .filter_map(|v| decoded(v.clone()))
        .collect()
}

impl crate::state::checkpoint::Entry for ClaimEntry {
    /// Of a damaged entry: the actions, devices and status entries that
    /// still decode one by one (what to release), never its spec.
    fn salvage(entry: &serde_json::Value) -> Option<Self> {
        let text = |field: &str| {
            let value = entry.get(field).and_then(serde_json::Value::as_str);
            value.unwrap_or_default().to_owned()
        };
        entry.as_object()?;
        Some(ClaimEntry {
            namespace: text("namespace"),
            name: text("name"),
            state: (entry.get("state").cloned().and_then(decoded)).unwrap_or(EntryState::Completed),
            actions: items(entry, "actions"),
            devices: items(entry, "devices"),
            spec: None,
            status: items(entry, "status"),
            ahead: false,
        })
    }

    fn retire(&mut self) {
        self.state = EntryState::Unpreparing;
    }
}

impl Action {
    /// Whether undoing it changes the GPUs themselves (a MIG device goes).
    pub fn changes_gpus(&self) -> bool {
        matches!(self, Action::MigCreate { .. })
    }
}

impl ClaimEntry {
    /// Whether undoing the claim does anything besides removing its spec
    /// and record: a MIG mode hold is released by removing the record
    /// (the mode is settled after).
    pub fn has_side_effects(&self) -> bool {
        (self.actions.iter()).any(|a| !matches!(a, Action::MigMode { .. }))
    }

    /// MIG devices this claim's prepare created (and recorded).
    pub fn created_mig(&self) -> impl Iterator<Item = &str> {
        self.actions.iter().filter_map(|a| match a {
            Action::MigCreate {
                instance: Some(r), ..
            } => Some(r.mig_uuid.as_str()),
            _ => None,
        })
    }

    /// GPUs whose MIG mode this claim holds.
    pub fn mig_mode_holds(&self) -> impl Iterator<Item = &str> {
        self.actions.iter().filter_map(|a| match a {
            Action::MigMode { gpu_uuid, .. } => Some(gpu_uuid.as_str()),
            _ => None,
        })
    }

    /// Names of the devices the claim was prepared with.
    pub fn device_names(&self) -> impl Iterator<Item = &str> {
        self.devices.iter().map(|d| d.device_name.as_str())
    }
}

/// One entry of the kubelet's answer: a device and its CDI ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
}

/// One `status.devices[]` entry of ours.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceStatus {
    pub pool: String,
    pub device: String,
    #[serde(rename = "shareID", default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    pub data: DeviceData,
    /// The device's conditions: `DeviceMade` for one made ahead of its
    /// pod's binding (binding conditions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<DeviceCondition>,
}

/// One `status.devices[].conditions` entry (a `metav1.Condition`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceCondition {
    #[serde(rename = "type")]
    pub kind: String,
    /// `True` or `False`.
    pub status: String,
    pub reason: String,
    pub message: String,
    /// RFC 3339, when the condition last changed.
    pub last_transition_time: String,
}

impl DeviceCondition {
    /// `DeviceMade=True`: the node made the device; the pod may bind.
    pub fn made(node: &str) -> Self {
        DeviceCondition::now(
            tessera_api::names::binding::MADE,
            "Made",
            format!("made on node {node} before the pod was bound"),
        )
    }

    /// `DeviceNotMade=True` with the reason the node could not make it.
    pub fn not_made(why: String) -> Self {
        DeviceCondition::now(tessera_api::names::binding::NOT_MADE, "MakeFailed", why)
    }

    fn now(kind: &str, reason: &str, message: String) -> Self {
        let now = k8s_openapi::jiff::Timestamp::now().round(k8s_openapi::jiff::Unit::Second);
        DeviceCondition {
            kind: kind.to_owned(),
            status: "True".to_owned(),
            reason: reason.to_owned(),
            // The API server takes at most 32768 bytes.
            message: message.chars().take(4096).collect(),
            last_transition_time: now.map(|t| t.to_string()).unwrap_or_default(),
        }
    }
}

/// `status.devices[].data`: which physical device the claim got and what is
/// enforced on it. Answers "which GPU did my pod get" from
/// `kubectl get resourceclaim -o yaml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceData {
    /// `gpu`, `mig` or `share`.
    #[serde(rename = "type")]
    pub device_type: String,
    /// The physical GPU.
    #[serde(rename = "gpuUUID")]
    pub gpu_uuid: String,
    /// The MIG device, for MIG allocations.
    #[serde(rename = "migUUID", default, skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
    /// MIG profile, for MIG allocations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// `Isolated` or `Shared`, for shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation_level: Option<String>,
    /// Sharing among the claim's consumers: `None`, `TimeSlicing`, `MPS`
    /// (whole GPUs and MIG devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<String>,
    /// Time-slice interval, with `TimeSlicing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slice: Option<String>,
    /// Limits enforced per process (Isolated shares, MPS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsData>,
    /// For shares: the capacity the claim consumed (accounting for Shared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumed: Option<ConsumedData>,
    /// For Isolated shares: who enforces `limits` (`mps`, `hami-core`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation_provider: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LimitsData {
    /// Device memory per process, as a quantity (`4Gi`).
    pub memory: String,
    pub memory_bytes: u64,
    /// Compute per process, percent of the device.
    pub compute_percent: u32,
}

impl From<&Limits> for LimitsData {
    fn from(l: &Limits) -> Self {
        LimitsData {
            memory: Quantity::from_bytes(l.memory_bytes).to_string(),
            memory_bytes: l.memory_bytes,
            compute_percent: l.compute_percent,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumedData {
    pub memory_bytes: u64,
    pub cores_percent: u32,
}
