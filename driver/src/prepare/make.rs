//! Making a claim's devices: the effects, the CDI spec and the completed
//! record, on a blocking thread or, for a claim that changes nothing on the
//! host, on the async worker that got it.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tracing::error;

use super::claims::{ClaimError, ClaimRef};
use super::enforce::{Device, Effects, EnforceError};
use super::{ClaimResult, NodeChange, Phase, PrepareObserver, Preparer, spec};
use crate::claim_uid::ClaimUid;
use crate::state::records::{ClaimEntry, DeviceCondition, EntryState};

impl Preparer {
    /// [`Self::enforce`] on this async worker, for a claim that changes
    /// nothing on the host (a whole GPU in the mode it is in): no hand-over
    /// to a blocking thread, only two small file writes. The devices come
    /// back, untouched on disk, when the claim needs more (planned side
    /// effects, a host change an enforcer finds, the hardware lock taken).
    pub(super) fn enforce_here(
        &self,
        claim: &ClaimRef,
        uid: &ClaimUid,
        mut devices: Vec<Device>,
        origin: Origin,
    ) -> Result<ClaimResult<(ClaimEntry, NodeChange)>, Vec<Device>> {
        let mut entry = self.started(claim, &devices, origin);
        if !entry.actions.is_empty() {
            return Err(devices);
        }
        let Ok(held) = self.hardware.try_write() else {
            return Err(devices);
        };
        let made = self.make(claim, uid, &mut entry, &mut devices, None);
        drop(held);
        match made {
            Err(Made::WouldBlock) => Err(devices),
            made => Ok(self.settle_made(claim, uid, entry, made)),
        }
    }

    /// The claim's entry before any effect: `Started`, with the planned
    /// side effects, and whether the kubelet asked (it owns the claim's
    /// unprepare) or the node makes it ahead of the pod's binding.
    fn started(&self, claim: &ClaimRef, devices: &[Device], origin: Origin) -> ClaimEntry {
        ClaimEntry {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: EntryState::Started,
            actions: self.enforcers.plan(devices),
            devices: Vec::new(),
            spec: None,
            status: Vec::new(),
            ahead: origin == Origin::Binding,
        }
    }

    /// effects -> edits -> spec -> record, on a blocking thread; a failure
    /// rolls back what was recorded.
    pub(super) fn enforce(
        &self,
        claim: &ClaimRef,
        uid: &ClaimUid,
        mut devices: Vec<Device>,
        origin: Origin,
    ) -> ClaimResult<(ClaimEntry, NodeChange)> {
        let mut entry = self.started(claim, &devices, origin);
        // Recorded before any side effect it must undo (MIG changes are
        // recorded by their enforcer, before each one). A claim without
        // one (a whole GPU, a share without MPS or time slice) is recorded
        // once, complete: a crash before that leaves at most its spec,
        // which start-up recovery removes as an orphan.
        if !entry.actions.is_empty() {
            self.checkpoint
                .put(uid.clone(), entry.clone())
                .map_err(|e| {
                    ClaimError::new(claim, format!("cannot record it in the checkpoint: {e}"))
                })?;
        }
        let made = self.make(claim, uid, &mut entry, &mut devices, Some(&self.hardware));
        self.settle_made(claim, uid, entry, made)
    }

    /// A failed make rolls back what was recorded.
    fn settle_made(
        &self,
        claim: &ClaimRef,
        uid: &ClaimUid,
        entry: ClaimEntry,
        made: Result<(ClaimEntry, NodeChange), Made>,
    ) -> ClaimResult<(ClaimEntry, NodeChange)> {
        let made = made.map_err(|e| match e {
            Made::Failed(e) => e,
            Made::WouldBlock => EnforceError::WouldBlock.for_claim(claim),
        });
        if made.is_err() {
            let recorded = self.entry(uid).unwrap_or(entry);
            if let Err(undo) = self.undo_now(uid, &recorded) {
                error!(claim = %claim, "rollback after a failed prepare failed (retried at the next call and at start-up): {undo}");
            }
        }
        made
    }

    /// `hardware`: the lock to take when an enforcer needs it, or `None`
    /// when this thread holds it and must not wait (see [`Effects::new`]).
    fn make(
        &self,
        claim: &ClaimRef,
        uid: &ClaimUid,
        entry: &mut ClaimEntry,
        devices: &mut [Device],
        hardware: Option<&RwLock<()>>,
    ) -> Result<(ClaimEntry, NodeChange), Made> {
        let mut clock = PhaseClock::new(self.observer.get());
        let mut cx = Effects::new(claim, uid, entry, &self.checkpoint, hardware);
        let mut gpus_changed = false;
        for enforcer in self.enforcers.iter() {
            gpus_changed |= enforcer.apply(&mut cx, devices).map_err(|e| match e {
                EnforceError::WouldBlock => Made::WouldBlock,
                e => Made::Failed(e.for_claim(claim)),
            })?;
        }
        clock.lap(Phase::Effects);
        let built = spec::build(claim, uid, &self.config.layout, &self.enforcers, devices)?;
        let unwritable = |what: &str| {
            let what = what.to_owned();
            move |e: std::io::Error| {
                ClaimError::new(claim, format!("cannot write {what}: {e}")).fix(format!(
                    "check that {} is writable",
                    self.config.cdi_dir.display()
                ))
            }
        };
        self.restore_driver_spec()
            .map_err(unwritable("the driver's CDI spec"))?;
        self.specs
            .write(uid, &built.spec)
            .map_err(unwritable("its CDI spec"))?;
        clock.lap(Phase::Spec);
        entry.state = EntryState::Completed;
        entry.devices = built.answer;
        entry.spec = Some(built.spec);
        entry.status = built.status;
        if entry.ahead {
            let made = DeviceCondition::made(&self.config.node);
            for status in &mut entry.status {
                status.conditions = vec![made.clone()];
            }
        }
        self.checkpoint
            .put(uid.clone(), entry.clone())
            .map_err(|e| {
                ClaimError::new(claim, format!("cannot record it in the checkpoint: {e}"))
            })?;
        clock.lap(Phase::Record);
        Ok((entry.clone(), NodeChange::gpus_if(gpus_changed)))
    }
}

/// Who asked for a claim's devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The kubelet, for a pod bound to the node.
    Kubelet,
    /// The scheduler's binding conditions (through `tessera binder`),
    /// before the pod binds.
    Binding,
}

/// How making a claim's devices ended, short of success.
enum Made {
    Failed(ClaimError),
    /// An enforcer needs to wait where nothing may (see [`Effects::new`]);
    /// nothing was changed.
    WouldBlock,
}

impl From<ClaimError> for Made {
    fn from(e: ClaimError) -> Self {
        Made::Failed(e)
    }
}

/// Times consecutive phases of one prepare for its observer.
pub(super) struct PhaseClock<'a> {
    observer: Option<&'a Arc<dyn PrepareObserver>>,
    since: Instant,
}

impl<'a> PhaseClock<'a> {
    pub(super) fn new(observer: Option<&'a Arc<dyn PrepareObserver>>) -> Self {
        PhaseClock {
            observer,
            since: Instant::now(),
        }
    }

    /// `phase` ended now; the next one starts.
    pub(super) fn lap(&mut self, phase: Phase) {
        let took = self.skip();
        if let Some(o) = self.observer {
            o.prepare_phase(phase, took);
        }
    }

    /// What passed since the last lap, not reported (timed elsewhere).
    pub(super) fn skip(&mut self) -> Duration {
        let now = Instant::now();
        let took = now - self.since;
        self.since = now;
        took
    }
}
