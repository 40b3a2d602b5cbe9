//! NodePrepareResources / NodeUnprepareResources: claims -> CDI specs.
//!
//! For each claim of a kubelet call, concurrently (claims never wait on each
//! other; calls for the same claim are serialized by a per-claim lock):
//!
//! 1. A claim with a `Completed` checkpoint entry gets its recorded answer
//!    again, without any API call or side effect (idempotence).
//! 2. Otherwise the ResourceClaim is read from the API server and checked
//!    ([`claims::select`]): UID, allocation, results of this driver in this
//!    node's pool, opaque configs of this driver.
//! 3. Devices are resolved through the slice model ([`catalog`]) and their
//!    configs merged ([`tessera_api::config::resolve_claim`]).
//! 4. The checkpoint entry is written `Started` with the side effects about
//!    to be made; then MIG devices are created, MPS daemons acquired, the
//!    CDI spec written ([`enforcement`]); then the entry becomes `Completed` with
//!    the answer and the spec. Any failure rolls back what was done.
//! 5. `status.devices` is written in the background ([`status`]).
//!
//! Unprepare marks the entry `Unpreparing`, undoes the side effects, removes
//! the spec and the entry. Unknown claims succeed.
//!
//! At start-up ([`Preparer::open`]) entries left `Started` are rolled back,
//! `Unpreparing` ones finished, lost specs of `Completed` ones rewritten, and
//! CDI specs of claims the checkpoint does not know are deleted, but only
//! when the checkpoint could be read (after a quarantine a running Pod's
//! spec may be among them).
//!
//! One bad claim never fails the others: every claim gets its own answer.

pub mod catalog;
pub mod claims;
pub mod enforcement;
pub mod hami_core;
pub mod mig_caps;
pub mod sharing;
pub mod state;
pub mod status;
pub mod time_slice;

use std::collections::HashMap;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock, Weak};

use tessera_api::config::{EffectiveConfig, resolve_claim};
use tracing::{error, info, warn};

use crate::cdi::SpecDir;
use crate::checkpoint::{Checkpoint, CheckpointError, LoadOutcome};
use crate::claim_uid::ClaimUid;

use catalog::DeviceCatalog;
use claims::{ClaimError, ClaimRef, ClaimSource, FetchError};
use enforcement::{Built, Layout, Resolved};
use sharing::{MigManager, SharingControl};
use state::{Action, ClaimEntry, EntryState, MigRecord, PreparedDevice};
use status::{NodeEvents, StatusWriter};

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
    pub sharing: Arc<dyn SharingControl>,
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

/// Held for writing while prepare changes the GPUs' MIG layout and records
/// it, and for reading while the node looks at the GPUs and the checkpoint
/// together: a MIG device the driver created is never seen without the
/// record saying so.
pub type HardwareLock = Arc<RwLock<()>>;

/// How long prepare waits for the node's first slice model.
const CATALOG_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// What start-up recovery found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    pub outcome: LoadOutcome,
    /// Claims left `Started` and rolled back.
    pub rolled_back: Vec<ClaimUid>,
    /// Claims left `Unpreparing` and finished.
    pub unprepared: Vec<ClaimUid>,
    /// `Completed` claims whose CDI spec was missing or altered and was written again.
    pub specs_restored: Vec<ClaimUid>,
    /// CDI specs no checkpoint entry accounts for, deleted.
    pub orphans_removed: Vec<ClaimUid>,
    /// Problems that did not stop start-up.
    pub problems: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("cannot list CDI specs in {dir}: {source}")]
    CdiDir {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// The prepare/unprepare engine.
pub struct Preparer {
    config: PrepareConfig,
    deps: Dependencies,
    checkpoint: Checkpoint<ClaimEntry>,
    specs: SpecDir,
    locks: ClaimLocks,
    hardware: HardwareLock,
    /// Per-claim latency and results; unset in tests.
    metrics: std::sync::OnceLock<Arc<crate::metrics::Metrics>>,
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
        let preparer = Arc::new(Preparer {
            config,
            deps,
            checkpoint,
            specs,
            locks: ClaimLocks::default(),
            hardware: HardwareLock::default(),
            metrics: std::sync::OnceLock::new(),
        });
        let recovery = preparer.clone().recover(outcome).await?;
        Ok((preparer, recovery))
    }

    pub fn config(&self) -> &PrepareConfig {
        &self.config
    }

    /// Records each claim's prepare/unprepare latency and result from now on.
    pub fn set_metrics(&self, metrics: Arc<crate::metrics::Metrics>) {
        let _ = self.metrics.set(metrics);
    }

    /// The lock to hold (for reading) while looking at the GPUs and
    /// [`Self::entries`] together.
    pub fn hardware_lock(&self) -> HardwareLock {
        self.hardware.clone()
    }

    fn hardware_write(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.hardware.write().unwrap_or_else(|p| p.into_inner())
    }

    fn changed(&self, what: NodeChange) {
        if let Some(f) = &self.deps.on_change {
            f(what);
        }
    }

    async fn recover(self: Arc<Self>, outcome: LoadOutcome) -> Result<Recovery, SetupError> {
        let mut recovery = Recovery {
            outcome: outcome.clone(),
            rolled_back: Vec::new(),
            unprepared: Vec::new(),
            specs_restored: Vec::new(),
            orphans_removed: Vec::new(),
            problems: Vec::new(),
        };
        match &outcome {
            LoadOutcome::Quarantined {
                reason,
                moved_to,
                restored,
            } => {
                let moved: Vec<String> = moved_to.iter().map(|p| p.display().to_string()).collect();
                let message = format!(
                    "{} prepared-claim record(s) were unreadable ({reason}) and were moved to {}; \
                     {restored} other claim(s) restored. CDI specs of running Pods are kept; \
                     the claims of the unreadable records will be prepared again when their Pods restart",
                    moved.len(),
                    moved.join(", ")
                );
                error!("{message}");
                if let Some(events) = &self.deps.events {
                    events.warning("CheckpointQuarantined", &message).await;
                }
            }
            LoadOutcome::PreviousBoot { claims } => {
                info!("checkpoint records of a previous boot ({claims} claims) removed");
            }
            LoadOutcome::Restored { claims } => info!("checkpoint restored: {claims} claims"),
            LoadOutcome::Fresh => info!("no checkpoint yet"),
        }

        // Temp files of writes a kill interrupted (specs, checkpoint).
        let this = self.clone();
        let stale = blocking(move || {
            let mut stale = this.specs.remove_stale_temp_files()?;
            stale.extend(crate::cdi::remove_stale_temp_files(
                this.checkpoint.dir(),
                "",
            )?);
            Ok::<_, std::io::Error>(stale)
        })
        .await;
        match stale {
            Ok(stale) if !stale.is_empty() => {
                info!(
                    count = stale.len(),
                    "removed temp files of interrupted writes"
                )
            }
            Ok(_) => {}
            Err(e) => recovery
                .problems
                .push(format!("removing temp files of interrupted writes: {e}")),
        }

        let entries: Vec<(ClaimUid, ClaimEntry)> = self
            .lock_checkpoint()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (uid, entry) in entries {
            match entry.state {
                EntryState::Started => match self.clone().undo(uid.clone(), entry).await {
                    Ok(()) => recovery.rolled_back.push(uid),
                    Err(e) => recovery
                        .problems
                        .push(format!("rolling back claim {uid}: {e}")),
                },
                EntryState::Unpreparing => match self.clone().undo(uid.clone(), entry).await {
                    Ok(()) => recovery.unprepared.push(uid),
                    Err(e) => recovery
                        .problems
                        .push(format!("finishing unprepare of claim {uid}: {e}")),
                },
                EntryState::Completed => {
                    // What the claim was prepared with is the driver's (the
                    // model publishes it as such); a device that vanished
                    // (a GPU reset, a hand-made change) is reported.
                    for problem in self.missing_mig(&uid, &entry) {
                        recovery.problems.push(problem);
                    }
                    // The status write runs in the background after prepare;
                    // a kill may have lost it. Applying it again is
                    // idempotent (server-side apply of the same content).
                    if let Some(writer) = &self.deps.status
                        && !entry.status.is_empty()
                    {
                        writer.spawn(
                            &entry.namespace,
                            &entry.name,
                            uid.as_str(),
                            entry.status.clone(),
                        );
                    }
                    let this = self.clone();
                    let id = uid.clone();
                    match blocking(move || this.restore_spec(&id, &entry)).await {
                        Ok(true) => recovery.specs_restored.push(uid),
                        Ok(false) => {}
                        Err(e) => recovery
                            .problems
                            .push(format!("restoring the CDI spec of claim {uid}: {e}")),
                    }
                }
            }
        }

        if outcome.knows_all_prepared_claims() {
            let this = self.clone();
            let removed = blocking(move || {
                let known: BTreeSet<ClaimUid> = this.lock_checkpoint().keys().cloned().collect();
                this.specs.remove_orphans(|c| known.contains(c))
            })
            .await
            .map_err(|source| SetupError::CdiDir {
                dir: self.config.cdi_dir.clone(),
                source,
            })?;
            if !removed.is_empty() {
                info!(count = removed.len(), "removed orphaned CDI specs");
            }
            recovery.orphans_removed = removed;
        } else {
            warn!("checkpoint was quarantined: orphaned CDI specs are left in place");
        }
        for p in &recovery.problems {
            error!("start-up recovery: {p}");
        }
        Ok(recovery)
    }

    /// Rewrites the spec of a completed claim if it is missing or differs.
    fn restore_spec(&self, uid: &ClaimUid, entry: &ClaimEntry) -> std::io::Result<bool> {
        let Some(spec) = &entry.spec else {
            return Ok(false);
        };
        let current = std::fs::read(self.specs.spec_path(uid))
            .ok()
            .and_then(|b| serde_json::from_slice::<crate::cdi::Spec>(&b).ok());
        if current.as_ref() == Some(spec) {
            return Ok(false);
        }
        self.specs.write(uid, spec)?;
        Ok(true)
    }

    fn lock_checkpoint(&self) -> std::sync::MutexGuard<'_, BTreeMap<ClaimUid, ClaimEntry>> {
        self.checkpoint.lock()
    }

    /// The checkpoint entry of a claim (tests, diagnostics).
    pub fn entry(&self, uid: &ClaimUid) -> Option<ClaimEntry> {
        self.lock_checkpoint().get(uid).cloned()
    }

    /// Every checkpoint entry (after start-up recovery: only `Completed`
    /// ones). Side-effect owners use it to reconcile their own state at
    /// start, e.g. MPS references of claims that are no longer prepared.
    pub fn entries(&self) -> Vec<(ClaimUid, ClaimEntry)> {
        self.lock_checkpoint()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Prepares every claim; one result per claim, in order.
    pub async fn prepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, ClaimResult<Vec<PreparedDevice>>)> {
        let futures = claims.into_iter().map(|claim| {
            let this = self.clone();
            async move {
                let began = std::time::Instant::now();
                let result = this.prepare_one(&claim).await;
                if let Some(m) = this.metrics.get() {
                    m.prepared(began.elapsed(), result.is_ok());
                }
                match &result {
                    Ok(devices) => info!(claim = %claim, devices = devices.len(), "prepared"),
                    Err(e) => warn!("prepare failed: {e}"),
                }
                (claim, result)
            }
        });
        futures::future::join_all(futures).await
    }

    /// Unprepares every claim; one result per claim, in order.
    pub async fn unprepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, ClaimResult<()>)> {
        let futures = claims.into_iter().map(|claim| {
            let this = self.clone();
            async move {
                let began = std::time::Instant::now();
                let result = this.unprepare_one(&claim).await;
                if let Some(m) = this.metrics.get() {
                    m.unprepared(began.elapsed(), result.is_ok());
                }
                match &result {
                    Ok(()) => info!(claim = %claim, "unprepared"),
                    Err(e) => warn!("unprepare failed: {e}"),
                }
                (claim, result)
            }
        });
        futures::future::join_all(futures).await
    }

    async fn prepare_one(self: &Arc<Self>, claim: &ClaimRef) -> ClaimResult<Vec<PreparedDevice>> {
        let uid = validate(claim)?;
        let _guard = self.locks.lock(&uid).await;

        if let Some(entry) = self.entry(&uid) {
            match entry.state {
                EntryState::Completed => {
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
                    // A spec lost from the CDI directory is written again.
                    let this = self.clone();
                    let id = uid.clone();
                    let recorded = entry.clone();
                    blocking(move || this.restore_spec(&id, &recorded))
                        .await
                        .map_err(|e| {
                            ClaimError::new(claim, format!("cannot restore its CDI spec: {e}"))
                        })?;
                    return Ok(entry.devices);
                }
                EntryState::Started | EntryState::Unpreparing => {
                    self.clone().undo(uid.clone(), entry).await.map_err(|e| {
                        ClaimError::new(
                            claim,
                            format!("cannot undo an earlier, unfinished prepare/unprepare: {e}"),
                        )
                        .fix("see the driver's log; the kubelet retries")
                    })?;
                }
            }
        }

        let reading = std::time::Instant::now();
        let object = self.deps.claims.get(&claim.namespace, &claim.name).await;
        if let Some(m) = self.metrics.get() {
            m.claim_read(reading.elapsed());
        }
        let object = object.map_err(|e| match e {
            FetchError::NotFound => ClaimError::new(claim, "the ResourceClaim does not exist")
                .fix("it was deleted; delete the Pod that references it"),
            FetchError::Failed(why) => {
                ClaimError::new(claim, format!("cannot read the ResourceClaim: {why}"))
                    .fix("check the API server and the driver's RBAC; the kubelet retries")
            }
        })?;
        let allocation = claims::select(claim, &object, &self.config.driver, &self.config.node)?;

        let catalog = self
            .deps
            .catalog
            .ready(CATALOG_WAIT)
            .await
            .map_err(|e| ClaimError::new(claim, e.to_string()).fix("the kubelet retries"))?;
        let resolved: Vec<Resolved> = allocation
            .devices
            .iter()
            .map(|d| enforcement::resolve(claim, d, &catalog))
            .collect::<Result<_, _>>()?;
        let targets: Vec<_> = resolved.iter().map(|r| r.target.clone()).collect();
        let configs = resolve_claim(&claim.to_string(), &allocation.configs, &targets)
            .map_err(|e| ClaimError::preformatted(claim, e.to_string()))?;

        let mut actions: Vec<Action> = Vec::new();
        for action in resolved
            .iter()
            .zip(&configs)
            .flat_map(|(d, c)| enforcement::actions(d, c))
        {
            // Two shares of one GPU in a claim hold its time slice (and, in
            // one request, its MPS daemon) once.
            if !actions.contains(&action) {
                actions.push(action);
            }
        }
        let started = ClaimEntry {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: EntryState::Started,
            actions,
            devices: Vec::new(),
            spec: None,
            status: Vec::new(),
        };
        // Recorded before any side effect it must undo (MIG mode and MIG
        // devices are recorded by the hardware step, before each change).
        // A claim without one (a whole GPU, a share without MPS or time
        // slice) is recorded once, complete: a crash before that leaves at
        // most its spec, which start-up recovery removes as an orphan.
        if !started.actions.is_empty() {
            self.put(&uid, started.clone()).await.map_err(|e| {
                ClaimError::new(claim, format!("cannot record it in the checkpoint: {e}"))
            })?;
        }

        let this = self.clone();
        let (id, who, entry) = (uid.clone(), claim.clone(), started.clone());
        let done =
            tokio::task::spawn_blocking(move || this.make(&who, &id, entry, resolved, configs))
                .await
                .unwrap_or_else(|e| Err(ClaimError::new(claim, format!("prepare panicked: {e}"))));
        match done {
            Ok((entry, change)) => {
                self.changed(change);
                if let Some(writer) = &self.deps.status {
                    writer.spawn(
                        &claim.namespace,
                        &claim.name,
                        &claim.uid,
                        entry.status.clone(),
                    );
                }
                Ok(entry.devices)
            }
            Err(e) => {
                let recorded = self.entry(&uid).unwrap_or(started);
                if let Err(undo) = self.clone().undo(uid.clone(), recorded).await {
                    error!(claim = %claim, "rollback after a failed prepare failed (retried at the next call and at start-up): {undo}");
                }
                Err(e)
            }
        }
    }

    /// Makes the side effects, writes the spec, completes the entry.
    /// Runs on a blocking thread.
    fn make(
        &self,
        claim: &ClaimRef,
        uid: &ClaimUid,
        mut entry: ClaimEntry,
        mut resolved: Vec<Resolved>,
        configs: Vec<EffectiveConfig>,
    ) -> ClaimResult<(ClaimEntry, NodeChange)> {
        let fail = |what: String| ClaimError::new(claim, what);

        let change =
            NodeChange::gpus_if(self.prepare_hardware(claim, uid, &mut entry, &mut resolved)?);

        let mut built = Vec::with_capacity(resolved.len());
        for (device, config) in resolved.into_iter().zip(configs) {
            // Recorded (a `TimeSlice` action) before it is made; under the
            // hardware lock so it cannot cross another claim's reset.
            if let Some(interval) = enforcement::time_slice(&device, &config) {
                let _hardware = self.hardware_write();
                self.deps
                    .sharing
                    .set_time_slice(uid, &device.gpu.uuid, interval)
                    .map_err(|e| {
                        fail(format!(
                            "cannot set the time slice of GPU {}: {e}",
                            device.gpu.uuid
                        ))
                    })?;
            }
            built.push(Built {
                device,
                config,
                mps: None,
            });
        }
        // One daemon per request and device, its limits those of the
        // request's shares of the device together.
        for (target, limits) in enforcement::mps_daemons(&built) {
            let client = self
                .deps
                .sharing
                .mps_acquire(uid, &target, &limits)
                .map_err(|e| {
                    let device = target.mig_uuid.as_ref().unwrap_or(&target.gpu_uuid);
                    fail(format!(
                        "cannot start MPS for request {} on {device}: {e}",
                        target.request
                    ))
                })?;
            for b in built.iter_mut() {
                if enforcement::mps_limits(&b.device, &b.config).is_some()
                    && enforcement::mps_target(&b.device) == target
                {
                    b.mps = Some(client.clone());
                }
            }
        }

        let (spec, devices, status) = enforcement::build(claim, uid, &self.config.layout, &built)?;
        self.specs.write(uid, &spec).map_err(|e| {
            fail(format!("cannot write its CDI spec: {e}")).fix(format!(
                "check that {} is writable",
                self.config.cdi_dir.display()
            ))
        })?;
        entry.state = EntryState::Completed;
        entry.devices = devices;
        entry.spec = Some(spec);
        entry.status = status;
        self.put_blocking(uid, entry.clone())
            .map_err(|e| fail(format!("cannot record it in the checkpoint: {e}")))?;
        Ok((entry, change))
    }

    /// MIG mode and dynamic MIG, under the hardware lock, each change
    /// recorded before it is made (and a created device right after).
    /// Whether it changed the GPUs (switched a MIG mode, created a device).
    fn prepare_hardware(
        &self,
        claim: &ClaimRef,
        uid: &ClaimUid,
        entry: &mut ClaimEntry,
        resolved: &mut [Resolved],
    ) -> ClaimResult<bool> {
        let fail = |what: String| ClaimError::new(claim, what);
        let record = |entry: &ClaimEntry| {
            self.put_blocking(uid, entry.clone())
                .map_err(|e| fail(format!("cannot update its checkpoint entry: {e}")))
        };
        let changes_gpus = resolved.iter().any(|d| {
            d.mig_mode.is_some()
                || matches!(
                    d.kind,
                    enforcement::Kind::Mig {
                        create: Some(_),
                        ..
                    }
                )
        });
        if !changes_gpus {
            return Ok(false);
        }
        let mut changed = false;
        let _hardware = self.hardware_write();
        for device in resolved.iter() {
            let Some(enabled) = device.mig_mode else {
                continue;
            };
            let gpu = &device.gpu.uuid;
            let current = self.deps.mig.mig_enabled(gpu).map_err(|e| fail(e.0))?;
            if !entry.mig_mode_holds().any(|g| g == gpu) {
                entry.actions.push(Action::MigMode {
                    gpu_uuid: gpu.clone(),
                    enabled,
                });
                // The hold must be seen by other claims before the lock is
                // released; it must be durable only before a switch (one to
                // roll back). Otherwise the claim's completion writes it.
                if current == enabled {
                    self.checkpoint.stage(uid.clone(), entry.clone());
                } else {
                    record(entry)?;
                }
            }
            if current != enabled {
                self.deps.mig.set_mig_mode(gpu, enabled).map_err(|e| {
                    fail(format!(
                        "cannot prepare device {}: {e}",
                        device.selected.device
                    ))
                })?;
                info!(claim = %claim, gpu = %gpu, enabled, "switched MIG mode");
                changed = true;
            }
        }
        for device in resolved.iter_mut() {
            let enforcement::Kind::Mig {
                instance,
                create: Some((profile_id, placement)),
                ..
            } = &mut device.kind
            else {
                continue;
            };
            let (gpu, name) = (device.gpu.uuid.clone(), &device.selected.device);
            let cannot = |e: sharing::SharingError| {
                fail(format!("cannot create MIG device {name} on GPU {gpu}: {e}"))
            };
            self.deps
                .mig
                .check_free(&gpu, *profile_id, *placement)
                .map_err(cannot)?;
            entry.actions.push(Action::MigCreate {
                gpu_uuid: gpu.clone(),
                profile_id: *profile_id,
                placement: *placement,
                instance: None,
            });
            record(entry)?;
            let created = self
                .deps
                .mig
                .create(&gpu, *profile_id, *placement)
                .map_err(cannot)?;
            for action in entry.actions.iter_mut() {
                match action {
                    Action::MigCreate {
                        gpu_uuid,
                        placement: at,
                        instance: recorded @ None,
                        ..
                    } if *gpu_uuid == gpu && at == placement => {
                        *recorded = Some(MigRecord {
                            gpu_instance_id: created.gpu_instance_id,
                            compute_instance_id: created.compute_instance_id,
                            mig_uuid: created.uuid.clone(),
                        });
                    }
                    // MPS on this MIG device names it by its new UUID.
                    Action::Mps {
                        gpu_uuid, mig_uuid, ..
                    } if *gpu_uuid == gpu && mig_uuid.is_none() => {
                        *mig_uuid = Some(created.uuid.clone());
                    }
                    _ => {}
                }
            }
            *instance = Some(created);
            record(entry)?;
            changed = true;
        }
        Ok(changed)
    }

    /// GPUs whose MIG mode the driver manages go back to MIG off once no
    /// claim holds them and no MIG device is on them.
    pub fn settle_mig_modes<'a>(&self, gpus: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let mut gpus = gpus.into_iter().peekable();
        if gpus.peek().is_none() {
            return Vec::new();
        }
        let _hardware = self.hardware_write();
        let held: BTreeSet<String> = self
            .lock_checkpoint()
            .values()
            .flat_map(|e| e.mig_mode_holds().map(str::to_owned))
            .collect();
        let mut problems = Vec::new();
        let mut switched = false;
        for gpu in gpus {
            if held.contains(gpu) {
                continue;
            }
            let idle_on = self
                .deps
                .mig
                .mig_enabled(gpu)
                .and_then(|on| Ok(on && !self.deps.mig.has_instances(gpu)?));
            match idle_on {
                Ok(false) => {}
                Ok(true) => match self.deps.mig.set_mig_mode(gpu, false) {
                    Ok(()) => {
                        info!(gpu = %gpu, "switched MIG mode off (no claim holds the GPU)");
                        switched = true;
                    }
                    Err(e) => problems.push(format!("switching MIG mode off on {gpu}: {e}")),
                },
                Err(e) => problems.push(format!("reading the MIG mode of {gpu}: {e}")),
            }
        }
        for p in &problems {
            warn!("{p}");
        }
        if switched {
            self.changed(NodeChange::Gpus);
        }
        problems
    }

    /// Recorded MIG devices of a prepared claim that NVML no longer has.
    fn missing_mig(&self, uid: &ClaimUid, entry: &ClaimEntry) -> Vec<String> {
        let mut problems = Vec::new();
        for action in &entry.actions {
            let Action::MigCreate {
                gpu_uuid,
                instance: Some(record),
                ..
            } = action
            else {
                continue;
            };
            match self.deps.mig.exists(gpu_uuid, record) {
                Ok(true) => {}
                Ok(false) => problems.push(format!(
                    "claim {}/{} (uid {uid}): its MIG device {} on GPU {gpu_uuid} is gone (GPU \
                     reset or removed by hand); its containers cannot use it: delete its Pod",
                    entry.namespace, entry.name, record.mig_uuid
                )),
                Err(e) => problems.push(format!(
                    "claim {uid}: cannot check its MIG device {}: {e}",
                    record.mig_uuid
                )),
            }
        }
        problems
    }

    /// Whether a claim other than `uid` holds a changed time slice on `gpu`.
    fn time_slice_held_by_other(&self, uid: &ClaimUid, gpu: &str) -> bool {
        self.lock_checkpoint().iter().any(|(id, e)| {
            id != uid
                && e.actions
                    .iter()
                    .any(|a| matches!(a, Action::TimeSlice { gpu_uuid } if gpu_uuid == gpu))
        })
    }

    /// MIG devices the driver created (recorded in the checkpoint).
    pub fn created_mig(&self) -> BTreeSet<String> {
        self.lock_checkpoint()
            .values()
            .flat_map(|e| e.created_mig().map(str::to_owned))
            .collect()
    }

    /// Names of the devices of prepared claims.
    pub fn prepared_devices(&self) -> BTreeSet<String> {
        self.lock_checkpoint()
            .values()
            .flat_map(|e| e.device_names().map(str::to_owned))
            .collect()
    }

    async fn unprepare_one(self: &Arc<Self>, claim: &ClaimRef) -> ClaimResult<()> {
        let uid = validate(claim)?;
        let _guard = self.locks.lock(&uid).await;
        let Some(mut entry) = self.entry(&uid) else {
            // Unknown: nothing of ours, except maybe a stray spec.
            let this = self.clone();
            let id = uid.clone();
            return blocking(move || this.specs.remove(&id))
                .await
                .map_err(|e| ClaimError::new(claim, format!("cannot remove its CDI spec: {e}")));
        };
        let written_status = !entry.status.is_empty();
        // Only side effects need the mark: without one, a crash between
        // removing the spec and the entry leaves a complete entry whose
        // spec start-up recovery writes again, and the kubelet's retry
        // removes both.
        if entry.state == EntryState::Completed && entry.has_side_effects() {
            entry.state = EntryState::Unpreparing;
            self.put(&uid, entry.clone()).await.map_err(|e| {
                ClaimError::new(claim, format!("cannot record it in the checkpoint: {e}"))
            })?;
        }
        let (namespace, name) = (entry.namespace.clone(), entry.name.clone());
        self.clone().undo(uid.clone(), entry).await.map_err(|e| {
            ClaimError::new(claim, e).fix("see the driver's log; the kubelet retries")
        })?;
        if written_status && let Some(writer) = &self.deps.status {
            writer.spawn(&namespace, &name, uid.as_str(), Vec::new());
        }
        Ok(())
    }

    /// Undoes an entry's side effects (newest first), removes its spec and
    /// the entry. Idempotent; on failure the entry stays for a later retry.
    async fn undo(self: Arc<Self>, uid: ClaimUid, entry: ClaimEntry) -> Result<(), String> {
        blocking(move || {
            for action in entry.actions.iter().rev() {
                let done = match action {
                    Action::Mps {
                        gpu_uuid,
                        mig_uuid,
                        request: Some(request),
                    } => self.deps.sharing.mps_release(
                        &uid,
                        &sharing::MpsTarget {
                            request: request.clone(),
                            gpu_uuid: gpu_uuid.clone(),
                            mig_uuid: mig_uuid.clone(),
                        },
                    ),
                    // A shared daemon of an earlier version: retired by the
                    // supervisor, nothing of this claim's own.
                    Action::Mps { request: None, .. } => Ok(()),
                    // Reset with the GPU's last holder: another claim's
                    // recorded action keeps the slice (checked and reset
                    // under the hardware lock, as prepare sets it).
                    Action::TimeSlice { gpu_uuid } => {
                        let _hardware = self.hardware_write();
                        if self.time_slice_held_by_other(&uid, gpu_uuid) {
                            Ok(())
                        } else {
                            self.deps.sharing.reset_time_slice(&uid, gpu_uuid)
                        }
                    }
                    // The hold goes with the entry; settled below.
                    Action::MigMode { .. } => Ok(()),
                    Action::MigCreate {
                        gpu_uuid,
                        profile_id,
                        placement,
                        instance,
                    } => {
                        let _hardware = self.hardware_write();
                        self.deps
                            .mig
                            .destroy(gpu_uuid, *profile_id, *placement, instance.as_ref())
                    }
                };
                done.map_err(|e| format!("undoing {action:?}: {e}"))?;
            }
            self.specs
                .remove(&uid)
                .map_err(|e| format!("removing its CDI spec: {e}"))?;
            self.checkpoint
                .remove(&uid)
                .map_err(|e| format!("removing its checkpoint entry: {e}"))?;
            self.settle_mig_modes(entry.mig_mode_holds());
            let destroyed = (entry.actions.iter()).any(|a| matches!(a, Action::MigCreate { .. }));
            self.changed(NodeChange::gpus_if(destroyed));
            Ok(())
        })
        .await
    }

    async fn put(
        self: &Arc<Self>,
        uid: &ClaimUid,
        entry: ClaimEntry,
    ) -> Result<(), CheckpointError> {
        let this = self.clone();
        let uid = uid.clone();
        blocking(move || this.put_blocking(&uid, entry)).await
    }

    fn put_blocking(&self, uid: &ClaimUid, entry: ClaimEntry) -> Result<(), CheckpointError> {
        self.checkpoint.put(uid.clone(), entry)
    }
}

/// Fuzzing entry point: decoding a checkpoint file with the plugin's real
/// entry type must never panic, whatever the bytes.
#[doc(hidden)]
pub fn fuzz_decode_checkpoint(bytes: &[u8]) {
    let _ = crate::checkpoint::decode_legacy::<ClaimEntry>(bytes);
    let _ = crate::checkpoint::decode_record::<ClaimEntry>(bytes);
}

/// Checks what the kubelet sent before it is used in a path or a URL.
fn validate(claim: &ClaimRef) -> ClaimResult<ClaimUid> {
    let uid = ClaimUid::parse(&claim.uid)
        .map_err(|e| ClaimError::new(claim, e.to_string()).field("uid"))?;
    if !is_dns_label(&claim.namespace) {
        return Err(ClaimError::new(
            claim,
            format!(
                "namespace {:?} is not a valid namespace name",
                claim.namespace
            ),
        )
        .field("namespace")
        .fix("namespaces are DNS labels (lower-case letters, digits, '-', at most 63)"));
    }
    if !is_dns_subdomain(&claim.name) {
        return Err(ClaimError::new(
            claim,
            format!("name {:?} is not a valid ResourceClaim name", claim.name),
        )
        .field("name")
        .fix(
            "claim names are DNS subdomains (lower-case letters, digits, '-', '.', at most 253)",
        ));
    }
    Ok(uid)
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
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
            let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
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
