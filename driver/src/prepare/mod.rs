//! NodePrepareResources / NodeUnprepareResources: claims -> CDI specs.
//!
//! Claims of a kubelet call are prepared concurrently (claims never wait on
//! each other; calls for the same claim are serialized by a per-claim lock).
//! One claim walks [`Preparer::prepare_one`]:
//!
//! 1. **validate** what the kubelet sent ([`validate`]);
//! 2. a claim with a `Completed` record gets its recorded answer again,
//!    without any API call or side effect (idempotence);
//! 3. **fetch** the ResourceClaim from the API server;
//! 4. **resolve** it: the results of this driver in this node's pool
//!    ([`claims::select`]), each device through the slice model
//!    ([`resolve`]), their configs merged
//!    ([`tessera_api::config::resolve_claim`]);
//! 5. **effects**: the record is written `Started` with every enforcer's
//!    planned side effects ([`enforce`]), then each enforcer makes its own
//!    (MIG modes and devices, the time slice, the claim's MPS daemons);
//! 6. **edits** and **spec**: each enforcer adds its container edits, and
//!    the claim's CDI spec is written ([`spec`]);
//! 7. **record**: the entry becomes `Completed` with the answer and the
//!    spec; `status.devices` is written in the background ([`status`]).
//!
//! Any failure rolls back what was done, newest first, each action through
//! the enforcer that made it. Unprepare ([`unprepare`]) marks the entry
//! `Unpreparing`, undoes the side effects the same way, removes the spec and
//! the entry. Unknown claims succeed. At start-up ([`recovery`]) entries
//! left `Started` are rolled back, `Unpreparing` ones finished, lost specs
//! of `Completed` ones rewritten, and CDI specs of claims the checkpoint
//! does not know are deleted (only when the checkpoint could be read: after
//! a quarantine a running Pod's spec may be among them).
//!
//! One bad claim never fails the others: every claim gets its own answer.

mod ahead;
pub mod claims;
pub mod enforce;
mod lost;
mod make;
mod recovery;
mod reserved_for;
pub mod resolve;
pub mod spec;
pub mod status;
mod unprepare;
mod validate;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_api::config::resolve_claim;
use tracing::{info, warn};

use crate::cdi::{self, SpecDir};
use crate::claim_uid::ClaimUid;
use crate::state::checkpoint::{Checkpoint, CheckpointError};
use crate::sync::Locked;

use crate::host::driver_root::Layout;
use crate::host::port::{MigManager, MpsControl, TimeSliceControl};
use crate::state::catalog::DeviceCatalog;
use crate::state::events::NodeEvents;
use crate::state::records::{Action, ClaimEntry, EntryState, PreparedDevice};
use claims::{ClaimError, ClaimRef, ClaimSource, FetchError};
use enforce::{Device, EnforceError, Enforcers, Hosts};
use status::StatusWriter;
use validate::validate;

use make::{Origin, PhaseClock};
pub use recovery::{Recovery, SetupError};
use reserved_for::ReservedFor;
pub use reserved_for::{PodRef, consumer_pods, consumers};
use unprepare::Unsettled;

/// Settings of a [`Preparer`].
#[derive(Debug, Clone)]
pub struct PrepareConfig {
    /// The DRA driver name (results and configs of other drivers are not ours).
    pub driver: String,
    /// This node; also the name of its pool.
    pub node: String,
    /// CDI spec directory (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// Directory of the checkpoint.
    pub state_dir: PathBuf,
    /// The file holding the kernel's boot id.
    pub boot_id_file: PathBuf,
    /// Where the driver's files and device nodes are.
    pub layout: Layout,
}

/// What prepare needs from outside.
pub struct Dependencies {
    pub claims: Arc<dyn ClaimSource>,
    pub catalog: Arc<DeviceCatalog>,
    /// The claims' own MPS daemons.
    pub mps: Arc<dyn MpsControl>,
    /// The GPUs' compute time slice.
    pub time_slice: Arc<dyn TimeSliceControl>,
    /// MIG mode and MIG devices.
    pub mig: Arc<dyn MigManager>,
    /// Writes `status.devices`; `None` leaves the status alone.
    pub status: Option<Arc<StatusWriter>>,
    /// Receives the quarantine Event; `None` only logs.
    pub events: Option<NodeEvents>,
    /// Called after the checkpoint or the GPUs changed (a claim prepared or
    /// unprepared), so the node's published view follows.
    pub on_change: Option<Arc<dyn Fn(NodeChange) + Send + Sync>>,
}

/// What changed on the node, so its view is read again no more than needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeChange {
    /// Only records: which claims hold which devices, or a GPU's health.
    /// The GPUs need not be read again.
    Records,
    /// The GPUs themselves (MIG mode, MIG devices): NVML is read again.
    Gpus,
}

impl NodeChange {
    fn gpus_if(changed: bool) -> Self {
        if changed {
            NodeChange::Gpus
        } else {
            NodeChange::Records
        }
    }
}

/// Told how each claim went (the node's metrics implement it).
pub trait PrepareObserver: Send + Sync {
    /// One claim prepared (`ok`) or failed, and how long it took.
    fn prepared(&self, took: Duration, ok: bool);
    /// One claim unprepared (`ok`) or failed.
    fn unprepared(&self, took: Duration, ok: bool);
    /// One claim read from the API server.
    fn claim_read(&self, took: Duration);
    /// One step of a prepare that went that far, and how long it took.
    fn prepare_phase(&self, _phase: Phase, _took: Duration) {}
}

/// The steps of a prepare the node's metrics time apart (the claim read is
/// [`PrepareObserver::claim_read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the claim's lock, and its recorded answer looked up.
    Recorded,
    /// The claim's devices resolved through the slice model.
    Resolve,
    /// From the hand-over to a blocking thread until it runs.
    HandOver,
    /// The enforcers' side effects (MIG, time slice, MPS daemons).
    Effects,
    /// The CDI spec built and written.
    Spec,
    /// The completed record written.
    Record,
    /// Everything but the claim read: the node process's own time.
    AfterRead,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Recorded => "recorded",
            Phase::Resolve => "resolve",
            Phase::HandOver => "handover",
            Phase::Effects => "effects",
            Phase::Spec => "spec",
            Phase::Record => "record",
            Phase::AfterRead => "after_read",
        }
    }
}

/// Held for writing while prepare changes the GPUs' MIG layout and records
/// it, and for reading while the node looks at the GPUs and the checkpoint
/// together: a MIG device the driver created is never seen without the
/// record saying so.
pub type HardwareLock = Arc<RwLock<()>>;

/// How long prepare waits for the node's first slice model.
const CATALOG_WAIT: Duration = Duration::from_secs(10);

/// Why undoing a claim's record failed; the record stays for a retry.
#[derive(Debug, thiserror::Error)]
pub enum UndoError {
    #[error("undoing {action:?}: {source}")]
    Action {
        action: Box<Action>,
        #[source]
        source: EnforceError,
    },
    #[error("cannot record it in the checkpoint: {0}")]
    Mark(#[source] CheckpointError),
    #[error("removing its CDI spec: {0}")]
    Spec(#[source] std::io::Error),
    #[error("removing its checkpoint entry: {0}")]
    Record(#[source] CheckpointError),
    #[error("stopping the MPS daemons of a claim whose record was lost: {0}")]
    LostDaemons(#[source] crate::host::port::HostError),
}

/// The prepare/unprepare engine.
pub struct Preparer {
    config: PrepareConfig,
    deps: Dependencies,
    enforcers: Enforcers,
    checkpoint: Checkpoint<ClaimEntry>,
    specs: SpecDir,
    /// The driver's own CDI spec, which every claim's devices reference.
    driver_spec: cdi::Spec,
    locks: ClaimLocks,
    /// The Pods each prepared claim was reserved for when it was fetched:
    /// kept in memory only (the metrics' attribution reads the API server
    /// for a claim it finds none of), so records stay readable by older
    /// versions.
    reserved_for: ReservedFor,
    hardware: HardwareLock,
    /// GPUs whose MIG mode holds were released by unprepares that have
    /// answered, still to settle ([`Preparer::settle_later`]).
    unsettled: Mutex<Unsettled>,
    observer: OnceLock<Arc<dyn PrepareObserver>>,
    /// Claims the kubelet unprepared lately: never prepared ahead again.
    released: Mutex<ahead::Released>,
    /// Devices that could not be made ahead lately.
    not_made: Mutex<ahead::NotMade>,
    /// What was told to the operator (tests).
    #[cfg(test)]
    reported: Mutex<Vec<enforce::Report>>,
}

/// One claim's answer.
pub type ClaimResult<T> = Result<T, ClaimError>;

impl Preparer {
    /// Loads the checkpoint and recovers from whatever the last run left.
    pub async fn open(
        config: PrepareConfig,
        deps: Dependencies,
    ) -> Result<(Arc<Preparer>, Recovery), SetupError> {
        let (checkpoint, outcome) = {
            let (dir, boot) = (config.state_dir.clone(), config.boot_id_file.clone());
            blocking(move || Checkpoint::<ClaimEntry>::open(&dir, &boot)).await?
        };
        let specs = SpecDir::new(&config.cdi_dir);
        let driver_spec = spec::driver_spec(&config.layout);
        {
            let (dir, driver) = (specs.clone(), driver_spec.clone());
            blocking(move || dir.write_driver(&driver))
                .await
                .map_err(|source| SetupError::DriverSpec {
                    path: specs.driver_path(),
                    source,
                })?;
        }
        let enforcers = Enforcers::new(Hosts {
            mps: deps.mps.clone(),
            time_slice: deps.time_slice.clone(),
            mig: deps.mig.clone(),
        });
        let preparer = Arc::new(Preparer {
            config,
            deps,
            enforcers,
            checkpoint,
            specs,
            driver_spec,
            locks: ClaimLocks::default(),
            unsettled: Mutex::default(),
            reserved_for: ReservedFor::default(),
            hardware: HardwareLock::default(),
            observer: OnceLock::new(),
            released: Mutex::default(),
            not_made: Mutex::default(),
            #[cfg(test)]
            reported: Mutex::default(),
        });
        let recovery = preparer.clone().recover(outcome).await?;
        Ok((preparer, recovery))
    }

    pub fn config(&self) -> &PrepareConfig {
        &self.config
    }

    /// Reports each claim's prepare/unprepare latency and result from now on.
    pub fn observe(&self, observer: Arc<dyn PrepareObserver>) {
        let _ = self.observer.set(observer);
    }

    /// The lock to hold (for reading) while looking at the GPUs and
    /// [`Self::entries`] together.
    pub fn hardware_lock(&self) -> HardwareLock {
        self.hardware.clone()
    }

    fn changed(&self, what: NodeChange) {
        if let Some(f) = &self.deps.on_change {
            f(what);
        }
    }

    /// The checkpoint entry of a claim (tests, diagnostics).
    pub fn entry(&self, uid: &ClaimUid) -> Option<ClaimEntry> {
        self.checkpoint.lock().get(uid).cloned()
    }

    /// Every checkpoint entry (after start-up recovery: only `Completed`
    /// ones). Side-effect owners use it to reconcile their own state at
    /// start, e.g. MPS daemons of claims that are no longer prepared.
    pub fn entries(&self) -> Vec<(ClaimUid, ClaimEntry)> {
        self.checkpoint
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// GPUs whose MIG mode the driver manages go back to MIG off once no
    /// claim holds them and no MIG device is on them.
    pub fn settle_mig_modes<'a>(&self, gpus: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let (problems, switched) =
            (self.enforcers.mig()).settle(&self.checkpoint, &self.hardware, gpus);
        if switched {
            self.changed(NodeChange::Gpus);
        }
        problems
    }

    /// Prepares every claim; one result per claim, in order.
    pub async fn prepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, ClaimResult<Vec<PreparedDevice>>)> {
        let _status_writes_wait = self.deps.status.as_ref().map(|w| w.call_started());
        let futures = claims.into_iter().map(|claim| async move {
            let began = Instant::now();
            let result = self.prepare_one(&claim).await;
            if let Some(o) = self.observer.get() {
                o.prepared(began.elapsed(), result.is_ok());
            }
            match &result {
                Ok(devices) => info!(claim = %claim, devices = devices.len(), "prepared"),
                Err(e) => warn!("prepare failed: {e}"),
            }
            (claim, result)
        });
        futures::future::join_all(futures).await
    }

    /// Unprepares every claim; one result per claim, in order.
    pub async fn unprepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, ClaimResult<()>)> {
        let _status_writes_wait = self.deps.status.as_ref().map(|w| w.call_started());
        let futures = claims.into_iter().map(|claim| async move {
            let began = Instant::now();
            self.released.locked().note(&claim.uid);
            let result = self.unprepare_one(&claim).await;
            if let Some(o) = self.observer.get() {
                o.unprepared(began.elapsed(), result.is_ok());
            }
            match &result {
                Ok(()) => info!(claim = %claim, "unprepared"),
                Err(e) => warn!("unprepare failed: {e}"),
            }
            (claim, result)
        });
        futures::future::join_all(futures).await
    }

    /// validate -> (recorded answer) -> fetch -> resolve -> effects -> edits
    /// -> spec -> record.
    async fn prepare_one(self: &Arc<Self>, claim: &ClaimRef) -> ClaimResult<Vec<PreparedDevice>> {
        self.prepare_for(claim, Origin::Kubelet).await
    }

    async fn prepare_for(
        self: &Arc<Self>,
        claim: &ClaimRef,
        origin: Origin,
    ) -> ClaimResult<Vec<PreparedDevice>> {
        let began = Instant::now();
        let mut clock = PhaseClock::new(self.observer.get());
        let uid = validate(claim)?;
        let _guard = self.locks.lock(&uid).await;
        if let Some(devices) = self.recorded(claim, &uid, origin).await? {
            return Ok(devices);
        }
        clock.lap(Phase::Recorded);
        let object = self.fetch(claim).await?;
        let read = clock.skip();
        let devices = self.resolve(claim, &object).await?;
        clock.lap(Phase::Resolve);
        let (entry, change) = match self.enforce_here(claim, &uid, devices, origin) {
            Ok(made) => made?,
            Err(devices) => {
                let this = self.clone();
                let (who, id) = (claim.clone(), uid.clone());
                let handed = Instant::now();
                tokio::task::spawn_blocking(move || {
                    this.phase(Phase::HandOver, handed.elapsed());
                    this.enforce(&who, &id, devices, origin)
                })
                .await
                .unwrap_or_else(|e| Err(ClaimError::new(claim, format!("prepare panicked: {e}"))))?
            }
        };
        self.reserved_for.remember(&uid, consumer_pods(&object));
        self.changed(change);
        if let Some(writer) = &self.deps.status {
            writer.write(&claim.namespace, &claim.name, &claim.uid, entry.status);
        }
        self.phase(Phase::AfterRead, began.elapsed().saturating_sub(read));
        Ok(entry.devices)
    }

    fn phase(&self, phase: Phase, took: Duration) {
        if let Some(o) = self.observer.get() {
            o.prepare_phase(phase, took);
        }
    }

    /// The answer of a claim prepared before; an unfinished earlier
    /// prepare or unprepare is undone first.
    async fn recorded(
        self: &Arc<Self>,
        claim: &ClaimRef,
        uid: &ClaimUid,
        origin: Origin,
    ) -> ClaimResult<Option<Vec<PreparedDevice>>> {
        let Some(entry) = self.entry(uid) else {
            return Ok(None);
        };
        if entry.state != EntryState::Completed {
            self.clone().undo(uid.clone(), entry).await.map_err(|e| {
                ClaimError::new(
                    claim,
                    format!("cannot undo an earlier, unfinished prepare/unprepare: {e}"),
                )
                .fix("see the driver's log; the kubelet retries")
            })?;
            return Ok(None);
        }
        if entry.namespace != claim.namespace || entry.name != claim.name {
            return Err(ClaimError::new(
                claim,
                format!(
                    "this UID was prepared as claim {}/{}",
                    entry.namespace, entry.name
                ),
            )
            .field("uid")
            .fix("the kubelet's request is inconsistent; restart the kubelet"));
        }
        if entry.ahead && origin == Origin::Kubelet {
            self.kubelet_took_over(claim, uid, &entry)?;
        }
        // A spec lost from the CDI directory is written again.
        let (this, id, recorded) = (self.clone(), uid.clone(), entry.clone());
        blocking(move || this.restore_spec(&id, &recorded))
            .await
            .map_err(|e| ClaimError::new(claim, format!("cannot restore its CDI spec: {e}")))?;
        Ok(Some(entry.devices))
    }

    /// The ResourceClaim from the API server.
    async fn fetch(&self, claim: &ClaimRef) -> ClaimResult<ResourceClaim> {
        let reading = Instant::now();
        let object = self.deps.claims.get(&claim.namespace, &claim.name).await;
        if let Some(o) = self.observer.get() {
            o.claim_read(reading.elapsed());
        }
        object.map_err(|e| match e {
            FetchError::NotFound => ClaimError::new(claim, "the ResourceClaim does not exist")
                .fix("it was deleted; delete the Pod that references it"),
            FetchError::Failed(why) => {
                ClaimError::new(claim, format!("cannot read the ResourceClaim: {why}"))
                    .fix("check the API server and the driver's RBAC; the kubelet retries")
            }
        })
    }

    /// This node's devices of the claim, resolved, with their configs.
    async fn resolve(&self, claim: &ClaimRef, object: &ResourceClaim) -> ClaimResult<Vec<Device>> {
        let allocation = claims::select(claim, object, &self.config.driver, &self.config.node)?;
        let catalog = self
            .deps
            .catalog
            .ready(CATALOG_WAIT)
            .await
            .map_err(|e| ClaimError::new(claim, e.to_string()).fix("the kubelet retries"))?;
        let resolved: Vec<_> = allocation
            .devices
            .iter()
            .map(|d| resolve::resolve(claim, d, &catalog))
            .collect::<Result<_, _>>()?;
        let targets: Vec<_> = resolved.iter().map(|r| r.target.clone()).collect();
        let configs = resolve_claim(&claim.to_string(), &allocation.configs, &targets)
            .map_err(|e| ClaimError::preformatted(claim, e.to_string()))?;
        Ok((resolved.into_iter().zip(configs))
            .map(|(resolved, config)| Device {
                resolved,
                config,
                mps: None,
            })
            .collect())
    }
}

/// Fuzzing entry point: decoding a checkpoint file with the plugin's real
/// entry type must never panic, whatever the bytes.
#[doc(hidden)]
pub fn fuzz_decode_checkpoint(bytes: &[u8]) {
    let _ = crate::state::checkpoint::decode_legacy::<ClaimEntry>(bytes);
    let _ = crate::state::checkpoint::decode_record::<ClaimEntry>(bytes);
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// One async lock per claim UID; entries disappear when unused.
#[derive(Default)]
struct ClaimLocks(Mutex<HashMap<ClaimUid, Weak<tokio::sync::Mutex<()>>>>);

impl ClaimLocks {
    async fn lock(&self, uid: &ClaimUid) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut map = self.0.locked();
            map.retain(|_, w| w.strong_count() > 0);
            match map.get(uid).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(tokio::sync::Mutex::new(()));
                    map.insert(uid.clone(), Arc::downgrade(&lock));
                    lock
                }
            }
        };
        lock.lock_owned().await
    }
}

#[cfg(test)]
mod tests;
