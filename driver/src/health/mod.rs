//! Device health: NVML XID events become the health of every device the node
//! publishes, served to the kubelet as the `DRAResourceHealth` stream.
//!
//! ```text
//! NVML event set (CRITICAL_XID_ERROR, every GPU) ──blocking thread──> HealthTracker
//!     per GPU: Healthy | Unhealthy {xid} | Unknown {reason}, and since when
//! HealthTracker + catalog (published device -> GPU) ──> NodeWatchResources stream
//! HealthTracker ──> node view (unhealthy GPUs) ──> slice model: device taints
//!               ──> Events on the Node, metrics
//! ```
//!
//! * **What is watched**: XID critical errors of every GPU NVML lists when the
//!   process starts (registered on the GPU: NVML reports a MIG device's XIDs
//!   on its parent GPU, so a MIG device's error marks its GPU). A GPU whose
//!   XID events cannot be registered is reported `Unknown`, as is a GPU that
//!   appears after the start.
//! * **Fatal XIDs** ([`FATAL_XIDS`]) make the GPU Unhealthy; **benign** ones
//!   (`--benign-xids`, default [`DEFAULT_BENIGN_XIDS`]: errors of the
//!   application, not the GPU) are logged at info; any other XID is logged
//!   as a warning and changes nothing. A fatal XID is fatal even if listed as
//!   benign.
//! * **Recovery**: with `--xid-recovery-seconds 0` (the default) an Unhealthy
//!   GPU stays Unhealthy while the process runs (the fatal XIDs need a GPU
//!   reset or a reboot, which restarts the plugin: a restart starts
//!   Healthy). With `N > 0`, a GPU becomes Healthy again `N` seconds after
//!   its last fatal XID.
//! * **Slices, Events, metrics**: the GPUs held Unhealthy go into the
//!   node's view ([`unhealthy_gpus`], read by the node's observer, which a
//!   [`spawn_follower`] task pokes at every change) and from there into the
//!   slice model, which taints their devices (`<driver>/unhealthy=xid-<n>`,
//!   `NoSchedule`; see `tessera_controller::model::taints`). Each GPU turning
//!   Unhealthy, Healthy again or unwatched is an Event on the Node
//!   ([`Transition`]); the metrics count devices by health and XIDs seen.
//! * **What the kubelet gets**: every device of this node's pool (the
//!   catalog prepare resolves names through: whole GPUs, shares, MIG
//!   devices) with its GPU's health, first at once, then at every change,
//!   and at least every [`RESEND`] (the kubelet treats a device it has not
//!   heard of for [`HEALTH_CHECK_TIMEOUT_SECONDS`] as Unknown).

mod monitor;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tracing::{info, warn};

use tessera_controller::model::Unhealthy;

use crate::state::catalog::{Catalog, DeviceCatalog};
use crate::state::events::NodeEvents;
use crate::sync::Locked;

pub use monitor::spawn_monitor;

/// XIDs that make a GPU Unhealthy, with what they mean. Each needs at least
/// a GPU reset (or a node drain) before the GPU can be trusted again.
pub const FATAL_XIDS: &[(u64, &str)] = &[
    (48, "double-bit ECC error"),
    (63, "ECC page retirement or row remapping event"),
    (64, "ECC page retirement or row remapping failure"),
    (74, "NVLink error"),
    (79, "GPU has fallen off the bus"),
    (92, "high single-bit ECC error rate"),
    (94, "contained ECC error"),
    (95, "uncontained ECC error"),
    (119, "GSP RPC timeout"),
    (120, "GSP error"),
];

/// XIDs logged only, by default: errors caused by the application (graphics
/// engine exception, memory page fault, stopped processing, preemptive
/// cleanup, video processor exception), not by the GPU.
pub const DEFAULT_BENIGN_XIDS: &[u64] = &[13, 31, 43, 45, 68];

/// How long the kubelet may trust a report (it resends every [`RESEND`]).
pub const HEALTH_CHECK_TIMEOUT_SECONDS: i64 = 60;

/// The stream repeats the full picture at least this often.
pub const RESEND: Duration = Duration::from_secs(10);

/// How an XID is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidClass {
    /// The GPU becomes Unhealthy.
    Fatal,
    /// Logged at info.
    Benign,
    /// In neither list (or NVML could not say which XID): logged as a
    /// warning, health unchanged.
    Unlisted,
}

/// Which XIDs are fatal and which benign.
#[derive(Debug, Clone)]
pub struct XidPolicy {
    benign: BTreeSet<u64>,
}

impl XidPolicy {
    pub fn new(benign: impl IntoIterator<Item = u64>) -> Self {
        XidPolicy {
            benign: benign.into_iter().collect(),
        }
    }

    /// `None`: NVML reported an XID critical error without its number.
    pub fn classify(&self, xid: Option<u64>) -> XidClass {
        match xid {
            Some(x) if fatal_meaning(x).is_some() => XidClass::Fatal,
            Some(x) if self.benign.contains(&x) => XidClass::Benign,
            _ => XidClass::Unlisted,
        }
    }
}

impl Default for XidPolicy {
    fn default() -> Self {
        XidPolicy::new(DEFAULT_BENIGN_XIDS.iter().copied())
    }
}

pub fn fatal_meaning(xid: u64) -> Option<&'static str> {
    FATAL_XIDS.iter().find(|(x, _)| *x == xid).map(|(_, m)| *m)
}

/// A GPU's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Healthy,
    /// The last fatal XID.
    Unhealthy {
        xid: u64,
    },
    /// Not watched (the reason says why).
    Unknown {
        reason: String,
    },
}

/// A GPU's health and when it was determined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHealth {
    pub health: Health,
    /// When this health was last determined (start, the last fatal XID,
    /// recovery).
    pub since: SystemTime,
    /// While Unhealthy: when it became so (later fatal XIDs keep it; the
    /// taint's `timeAdded`).
    pub unhealthy_since: Option<SystemTime>,
}

/// GPU UUID -> health.
pub type HealthMap = BTreeMap<String, GpuHealth>;

/// Per-GPU health, changed by XID events and recovery.
pub struct HealthTracker {
    policy: XidPolicy,
    recovery: Option<Duration>,
    state: watch::Sender<Arc<HealthMap>>,
    /// XID events seen, by (GPU UUID, XID; 0 when NVML could not say).
    xids: std::sync::Mutex<BTreeMap<(String, u64), u64>>,
}

impl HealthTracker {
    /// `recovery`: how long after its last fatal XID a GPU is Healthy again
    /// (`None`: not while the process runs).
    pub fn new(policy: XidPolicy, recovery: Option<Duration>) -> Self {
        HealthTracker {
            policy,
            recovery,
            state: watch::Sender::new(Arc::new(HealthMap::new())),
            xids: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// Every XID event seen so far: (GPU UUID, XID) -> count (the metrics).
    pub fn xid_counts(&self) -> BTreeMap<(String, u64), u64> {
        self.xids.locked().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<HealthMap>> {
        self.state.subscribe()
    }

    pub fn current(&self) -> Arc<HealthMap> {
        self.state.borrow().clone()
    }

    fn set(&self, uuid: &str, health: Health, at: SystemTime) -> bool {
        self.state.send_if_modified(|map| {
            if map.get(uuid).is_some_and(|g| g.health == health) {
                return false;
            }
            let unhealthy_since = matches!(health, Health::Unhealthy { .. }).then_some(at);
            Arc::make_mut(map).insert(
                uuid.to_owned(),
                GpuHealth {
                    health,
                    since: at,
                    unhealthy_since,
                },
            );
            true
        })
    }

    /// The GPU's XID events are watched: Healthy.
    pub fn watching(&self, uuid: &str, at: SystemTime) {
        self.set(uuid, Health::Healthy, at);
    }

    /// The GPU's XID events cannot be watched: Unknown.
    pub fn not_watched(&self, uuid: &str, reason: String, at: SystemTime) {
        warn!(gpu = %uuid, "GPU health not watched: {reason}; its devices are reported Unknown");
        self.set(uuid, Health::Unknown { reason }, at);
    }

    /// An XID event on GPU `uuid` (a MIG device's arrive on its GPU).
    pub fn xid(&self, uuid: &str, xid: Option<u64>, at: SystemTime) -> XidClass {
        *self
            .xids
            .locked()
            .entry((uuid.to_owned(), xid.unwrap_or(0)))
            .or_default() += 1;
        let class = self.policy.classify(xid);
        let shown = xid.map_or_else(|| "unknown".to_owned(), |x| x.to_string());
        match (class, xid) {
            (XidClass::Fatal, Some(x)) => {
                warn!(
                    gpu = %uuid,
                    "XID {x} ({}): GPU marked Unhealthy",
                    fatal_meaning(x).unwrap_or_default()
                );
                // A later fatal XID restarts the recovery clock.
                self.state.send_modify(|map| {
                    let unhealthy_since =
                        map.get(uuid).and_then(|g| g.unhealthy_since).unwrap_or(at);
                    Arc::make_mut(map).insert(
                        uuid.to_owned(),
                        GpuHealth {
                            health: Health::Unhealthy { xid: x },
                            since: at,
                            unhealthy_since: Some(unhealthy_since),
                        },
                    );
                });
            }
            (XidClass::Benign, _) => {
                info!(gpu = %uuid, "XID {shown} (benign: an application error)")
            }
            _ => warn!(
                gpu = %uuid,
                "XID {shown}: neither fatal nor listed as benign; health unchanged"
            ),
        }
        class
    }

    /// GPUs Unhealthy for the recovery time become Healthy; returns them.
    pub fn recover(&self, now: SystemTime) -> Vec<String> {
        let Some(after) = self.recovery else {
            return Vec::new();
        };
        let due: Vec<String> = self
            .current()
            .iter()
            .filter(|(_, g)| {
                matches!(g.health, Health::Unhealthy { .. })
                    && now.duration_since(g.since).is_ok_and(|d| d >= after)
            })
            .map(|(uuid, _)| uuid.clone())
            .collect();
        for uuid in &due {
            info!(gpu = %uuid, "no fatal XID for {after:?}: GPU Healthy again");
            self.set(uuid, Health::Healthy, now);
        }
        due
    }
}

/// The GPUs `map` holds Unhealthy, as the slice model taints them: value
/// `xid-<n>`, since when the GPU has been Unhealthy.
pub fn unhealthy_gpus(map: &HealthMap) -> BTreeMap<String, Unhealthy> {
    map.iter()
        .filter_map(|(uuid, g)| match g.health {
            Health::Unhealthy { xid } => Some((
                uuid.clone(),
                Unhealthy {
                    reason: format!("xid-{xid}"),
                    since: unix_seconds(g.unhealthy_since.unwrap_or(g.since)),
                },
            )),
            _ => None,
        })
        .collect()
}

fn unix_seconds(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// A change of one GPU's health worth an Event on the Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// It became Unhealthy, or its fatal XID changed.
    Unhealthy { gpu: String, xid: u64 },
    /// Healthy again after being Unhealthy.
    Recovered { gpu: String },
    /// Its XID events cannot be watched.
    NotWatched { gpu: String, reason: String },
}

/// What changed from `before` to `after`.
pub fn transitions(before: &HealthMap, after: &HealthMap) -> Vec<Transition> {
    let mut out = Vec::new();
    for (gpu, now) in after {
        let was = before.get(gpu).map(|g| &g.health);
        match (&now.health, was) {
            (Health::Unhealthy { xid }, Some(Health::Unhealthy { xid: old })) if old == xid => {}
            (Health::Unhealthy { xid }, _) => out.push(Transition::Unhealthy {
                gpu: gpu.clone(),
                xid: *xid,
            }),
            (Health::Healthy, Some(Health::Unhealthy { .. })) => {
                out.push(Transition::Recovered { gpu: gpu.clone() })
            }
            (Health::Unknown { reason }, was) if !matches!(was, Some(Health::Unknown { .. })) => {
                out.push(Transition::NotWatched {
                    gpu: gpu.clone(),
                    reason: reason.clone(),
                })
            }
            _ => {}
        }
    }
    out
}

/// `gpu-<n> (GPU-…)`, or the UUID alone before the first model.
fn gpu_label(catalog: Option<&Catalog>, uuid: &str) -> String {
    catalog
        .and_then(|c| c.devices().find(|(_, d)| d.gpu_uuid == uuid))
        .map_or_else(
            || uuid.to_owned(),
            |(_, d)| format!("gpu-{} ({uuid})", d.gpu_index),
        )
}

/// The Node event of a transition.
#[derive(Debug, PartialEq, Eq)]
pub struct HealthEvent {
    pub warning: bool,
    pub reason: &'static str,
    /// What was done to which GPU: repeats of it count as one Event.
    pub action: String,
    pub note: String,
}

/// The Node event of a transition.
pub fn event(
    transition: &Transition,
    catalog: Option<&Catalog>,
    taint_key: &str,
    recovery: Option<Duration>,
) -> HealthEvent {
    let (warning, reason, action, note) = match transition {
        Transition::Unhealthy { gpu, xid } => (
            true,
            "GpuUnhealthy",
            format!("Taint {gpu} XID {xid}"),
            format!(
                "GPU {}: XID {xid} ({}): its devices are reported Unhealthy to the kubelet and \
                 tainted {taint_key}=xid-{xid}:NoSchedule where the API server serves device \
                 taints, so new claims do not get them; running Pods are not evicted. {}",
                gpu_label(catalog, gpu),
                fatal_meaning(*xid).unwrap_or("fatal"),
                match recovery {
                    Some(after) => format!(
                        "It counts as Healthy again {}s after its last fatal XID.",
                        after.as_secs()
                    ),
                    None => "Drain the node and reset the GPU (or reboot); the restarted \
                             driver starts it Healthy."
                        .to_owned(),
                }
            ),
        ),
        Transition::Recovered { gpu } => (
            false,
            "GpuHealthy",
            format!("Untaint {gpu}"),
            format!(
                "GPU {} is Healthy again: no fatal XID for {}s; its taint {taint_key} is removed",
                gpu_label(catalog, gpu),
                recovery.map_or(0, |d| d.as_secs())
            ),
        ),
        Transition::NotWatched { gpu, reason } => (
            true,
            "GpuHealthUnknown",
            format!("WatchHealth {gpu}"),
            format!(
                "GPU {}: health not watched ({reason}); its devices are reported Unknown and \
                 never tainted",
                gpu_label(catalog, gpu)
            ),
        ),
    };
    HealthEvent {
        warning,
        reason,
        action,
        note,
    }
}

/// Follows the tracker for the life of the process: every change calls
/// `on_change` (the node's observer, which puts the unhealthy GPUs into the
/// view the publisher turns into slices), and every [`Transition`] becomes
/// an Event on the Node.
pub fn spawn_follower(
    tracker: Arc<HealthTracker>,
    events: Option<NodeEvents>,
    catalog: Arc<DeviceCatalog>,
    taint_key: String,
    on_change: impl Fn() + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let recovery = tracker.recovery;
    let mut rx = tracker.subscribe();
    tokio::spawn(async move {
        // What happened before this task ran (a GPU already Unhealthy or
        // not watched) is a transition too, and reaches the view.
        let mut before = Arc::new(HealthMap::new());
        on_change();
        loop {
            let transitions = {
                let now = rx.borrow_and_update().clone();
                let t = transitions(&before, &now);
                if unhealthy_gpus(&before) != unhealthy_gpus(&now) {
                    on_change();
                }
                before = now;
                t
            };
            if let Some(events) = &events {
                let cat = catalog.subscribe().borrow().clone();
                for t in &transitions {
                    let e = event(t, cat.as_deref(), &taint_key, recovery);
                    if e.warning {
                        events.warning(e.reason, &e.action, &e.note).await;
                    } else {
                        events.normal(e.reason, &e.action, &e.note).await;
                    }
                }
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests;
