//! Isolation enforcers: each way of enforcing a device is one module behind
//! [`Enforcer`], with its host effects (planned and recorded, made, undone,
//! checked at start) and its CDI edits.
//!
//! | Enforcer | Devices | Host effects | Container edits |
//! | --- | --- | --- | --- |
//! | [`whole::WholeGpu`] | every device | none | the GPU's device node |
//! | [`mig::Mig`] | MIG devices, GPUs whose MIG mode the driver manages | MIG mode holds, MIG devices created for the claim | capability nodes |
//! | [`time_slice::TimeSlice`] | `TimeSlicing` configs, Shared shares under a policy slice | the GPU's compute time slice | none |
//! | [`mps::Mps`] | Isolated shares (provider `mps`), `sharing.strategy: MPS` | the claim's own MPS control daemon per request and device | pipe directory, `/dev/shm`, limits |
//! | [`hami_core::HamiCore`] | Isolated shares (provider `hami-core`) | none | the library, the preload file, limits |
//!
//! Each enforcer decides for itself which devices are its own (by their kind
//! and effective config), so adding one is adding a module and a line in
//! [`Enforcers::new`]. Prepare runs them in that order: MIG first (an MPS
//! daemon of a dynamic MIG device needs the device), edits in the same order.

pub mod hami_core;
pub mod mig;
pub mod mig_caps;
pub mod mps;
pub mod time_slice;
pub mod whole;

use std::sync::{Arc, Mutex, RwLock, RwLockWriteGuard};

use tessera_api::config::EffectiveConfig;

use super::claims::{ClaimError, ClaimRef};
use super::resolve::Resolved;
use crate::cdi::ContainerEdits;
use crate::claim_uid::ClaimUid;
use crate::host::driver_root::Layout;
use crate::host::port::{HostError, MigManager, MpsClient, MpsControl, TimeSliceControl};
use crate::state::checkpoint::{Checkpoint, CheckpointError};
use crate::state::records::{Action, ClaimEntry, DeviceData};
use crate::sync::{Locked, ReadWrite};

/// One allocated device with its effective config, and what the enforcers
/// made for it.
#[derive(Debug, Clone)]
pub struct Device {
    pub resolved: Resolved,
    pub config: EffectiveConfig,
    /// The claim's MPS daemon serving this device, once started.
    pub mps: Option<MpsClient>,
}

/// One request of a claim, as its containers will see it.
pub struct Request<'a> {
    pub claim: &'a ClaimRef,
    pub name: &'a str,
    /// Its CDI device name (`<request>_<claim uid>`).
    pub cdi_name: &'a str,
    pub devices: Vec<&'a Device>,
    /// The GPU or MIG UUIDs the container sees, in CUDA index order.
    pub visible: Vec<String>,
    pub layout: &'a Layout,
}

/// One way of enforcing devices. Every method has a default that does
/// nothing, so an enforcer implements what it has.
pub trait Enforcer: Send + Sync {
    /// Side effects to record before any is made. Enforcers that record
    /// as they go (under the hardware lock) return none here.
    fn plan(&self, _devices: &[Device]) -> Vec<Action> {
        Vec::new()
    }

    /// Makes this enforcer's effects for the claim (on a blocking thread).
    /// Returns whether the GPUs themselves changed (MIG mode or devices).
    fn apply(&self, _cx: &mut Effects<'_>, _devices: &mut [Device]) -> Result<bool, EnforceError> {
        Ok(false)
    }

    /// Undoes `action` if it is this enforcer's; `None` if it is not.
    /// Idempotent: the action may have been undone already, or never made.
    fn undo(&self, _cx: &Undo<'_>, _action: &Action) -> Option<Result<(), EnforceError>> {
        None
    }

    /// After a claim's record is gone: settle what no claim holds any more.
    /// Returns whether the GPUs changed.
    fn released(&self, _cx: &Undo<'_>, _entry: &ClaimEntry) -> bool {
        false
    }

    /// Problems with what a prepared claim holds (checked at start-up).
    fn check(&self, _uid: &ClaimUid, _entry: &ClaimEntry) -> Vec<String> {
        Vec::new()
    }

    /// Adds this enforcer's container edits for one request.
    fn edits(
        &self,
        _request: &Request<'_>,
        _edits: &mut ContainerEdits,
    ) -> Result<(), EnforceError> {
        Ok(())
    }

    /// Fills in what this enforcer enforces on a device in the claim's
    /// `status.devices` data.
    fn describe(&self, _device: &Device, _data: &mut DeviceData) {}
}

/// The node's enforcers, in the order prepare runs them.
pub struct Enforcers {
    all: Vec<Arc<dyn Enforcer>>,
    mig: Arc<mig::Mig>,
}

/// The host backends the enforcers drive.
pub struct Hosts {
    pub mps: Arc<dyn MpsControl>,
    pub time_slice: Arc<dyn TimeSliceControl>,
    pub mig: Arc<dyn MigManager>,
}

impl Enforcers {
    pub fn new(hosts: Hosts) -> Self {
        let mig = Arc::new(mig::Mig::new(hosts.mig));
        let all: Vec<Arc<dyn Enforcer>> = vec![
            Arc::new(whole::WholeGpu),
            mig.clone(),
            Arc::new(time_slice::TimeSlice::new(hosts.time_slice)),
            Arc::new(mps::Mps::new(hosts.mps)),
            Arc::new(hami_core::HamiCore),
        ];
        Enforcers { all, mig }
    }

    pub fn iter(&self) -> impl Iterator<Item = &dyn Enforcer> {
        self.all.iter().map(|p| p.as_ref())
    }

    /// The MIG enforcer (MIG modes are also settled outside a claim).
    pub fn mig(&self) -> &mig::Mig {
        &self.mig
    }

    /// Every enforcer's actions for the claim, each once (two shares of
    /// one GPU in a claim hold its time slice, and in one request its MPS
    /// daemon, once).
    pub fn plan(&self, devices: &[Device]) -> Vec<Action> {
        let mut actions: Vec<Action> = Vec::new();
        for action in self.iter().flat_map(|p| p.plan(devices)) {
            if !actions.contains(&action) {
                actions.push(action);
            }
        }
        actions
    }

    /// Undoes one recorded action through the enforcer that owns it.
    pub fn undo(&self, cx: &Undo<'_>, action: &Action) -> Result<(), EnforceError> {
        self.iter()
            .find_map(|p| p.undo(cx, action))
            .unwrap_or(Ok(()))
    }
}

/// What an enforcer's [`Enforcer::apply`] works with: the claim, its
/// checkpoint entry (to record each effect before it is made) and the
/// node's hardware lock.
pub struct Effects<'a> {
    pub claim: &'a ClaimRef,
    pub uid: &'a ClaimUid,
    pub entry: &'a mut ClaimEntry,
    records: &'a Checkpoint<ClaimEntry>,
    /// `None`: the caller holds the write side and runs on a thread that
    /// must not wait (see [`Effects::may_block`]).
    hardware: Option<&'a RwLock<()>>,
}

impl<'a> Effects<'a> {
    /// `hardware`: the node's hardware lock to take when needed, or `None`
    /// when the caller already holds its write side on an async worker:
    /// then an enforcer that would change the hardware answers
    /// [`EnforceError::WouldBlock`] before doing anything, and the caller
    /// runs the claim again on a blocking thread.
    pub fn new(
        claim: &'a ClaimRef,
        uid: &'a ClaimUid,
        entry: &'a mut ClaimEntry,
        records: &'a Checkpoint<ClaimEntry>,
        hardware: Option<&'a RwLock<()>>,
    ) -> Self {
        Effects {
            claim,
            uid,
            entry,
            records,
            hardware,
        }
    }

    /// Writes the entry as it is now, durably.
    pub fn record(&self) -> Result<(), EnforceError> {
        Ok(self.records.put(self.uid.clone(), self.entry.clone())?)
    }

    /// Makes the entry as it is now visible to other claims, without a
    /// write (its loss in a crash is harmless).
    pub fn stage(&self) {
        self.records.stage(self.uid.clone(), self.entry.clone());
    }

    /// Held while changing what several claims share on a GPU (`None`: the
    /// caller holds it already).
    pub fn hardware(&self) -> Option<RwLockWriteGuard<'a, ()>> {
        self.hardware.map(write)
    }

    /// Whether an enforcer may wait here (a host change: a MIG mode switch,
    /// a MIG device made); if not, it answers [`EnforceError::WouldBlock`].
    pub fn may_block(&self) -> bool {
        self.hardware.is_some()
    }
}

/// Something an operator must hear of, as a Node Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub reason: &'static str,
    /// What was done, naming its subject (Events repeat per reason and
    /// action).
    pub action: String,
    pub message: String,
}

/// What [`Enforcer::undo`] and [`Enforcer::released`] work with.
pub struct Undo<'a> {
    pub uid: &'a ClaimUid,
    records: &'a Checkpoint<ClaimEntry>,
    hardware: &'a RwLock<()>,
    /// What an operator must hear of: things undo deliberately left in
    /// place.
    reports: Mutex<Vec<Report>>,
}

impl<'a> Undo<'a> {
    pub fn new(
        uid: &'a ClaimUid,
        records: &'a Checkpoint<ClaimEntry>,
        hardware: &'a RwLock<()>,
    ) -> Self {
        Undo {
            uid,
            records,
            hardware,
            reports: Mutex::new(Vec::new()),
        }
    }

    /// Tells the operator (a Node Event) of something left in place.
    pub fn report(&self, report: Report) {
        self.reports.locked().push(report);
    }

    /// What was reported, in order.
    pub fn into_reports(self) -> Vec<Report> {
        self.reports.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a claim other than this one has an action matching `f`: in
    /// its record, or in what was salvaged of its lost record (its Pod may
    /// still run).
    pub fn held_by_other(&self, f: impl Fn(&Action) -> bool) -> bool {
        let lost = self.records.lost();
        let records = self.records.lock();
        (records.iter())
            .chain(
                lost.claims
                    .iter()
                    .filter_map(|(id, e)| Some((id, e.as_ref()?))),
            )
            .any(|(id, e)| id != self.uid && e.actions.iter().any(&f))
    }

    pub fn hardware(&self) -> RwLockWriteGuard<'a, ()> {
        write(self.hardware)
    }
}

fn write(lock: &RwLock<()>) -> RwLockWriteGuard<'_, ()> {
    lock.writing()
}

/// Why an enforcer could not enforce a claim's devices. Each kind says
/// which part of the claim is at fault, so the user sees the field.
#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    /// A host operation failed (an MPS daemon, a time slice, MIG).
    #[error("cannot {what}: {source}")]
    Host {
        what: String,
        #[source]
        source: HostError,
    },
    /// A request cannot be served as written.
    #[error("{problem}")]
    Request {
        request: String,
        problem: String,
        fix: Option<String>,
    },
    /// One allocated device cannot be handed out.
    #[error("{problem}")]
    Device {
        index: usize,
        problem: String,
        fix: Option<String>,
    },
    /// Something the node lacks.
    #[error("{problem}")]
    Node { problem: String, fix: String },
    /// Recording an effect before it is made failed.
    #[error("cannot update its checkpoint entry: {0}")]
    Checkpoint(#[from] CheckpointError),
    /// A host change is needed where nothing may wait: nothing was done,
    /// the claim is made again on a blocking thread (never a user's error).
    #[error("a host change is needed; made on a blocking thread")]
    WouldBlock,
}

impl EnforceError {
    pub fn host(what: impl Into<String>) -> impl FnOnce(HostError) -> EnforceError {
        let what = what.into();
        move |source| EnforceError::Host { what, source }
    }

    /// The claim's error, naming the field at fault.
    pub fn for_claim(self, claim: &ClaimRef) -> ClaimError {
        let problem = self.to_string();
        match self {
            EnforceError::Host { .. } | EnforceError::Checkpoint(_) | EnforceError::WouldBlock => {
                ClaimError::new(claim, problem)
            }
            EnforceError::Request { request, fix, .. } => {
                with_fix(ClaimError::new(claim, problem), fix)
                    .field(format!("spec.devices.requests[{request}]"))
            }
            EnforceError::Device { index, fix, .. } => {
                with_fix(ClaimError::new(claim, problem), fix)
                    .field(format!("status.allocation.devices.results[{index}]"))
            }
            EnforceError::Node { fix, .. } => ClaimError::new(claim, problem).fix(fix),
        }
    }
}

fn with_fix(error: ClaimError, fix: Option<String>) -> ClaimError {
    match fix {
        Some(fix) => error.fix(fix),
        None => error,
    }
}
