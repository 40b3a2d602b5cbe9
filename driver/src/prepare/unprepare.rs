//! NodeUnprepareResources: a claim's side effects are undone, newest
//! first, each through the enforcer that made it; then its spec and its
//! record go. The MIG modes no claim holds any more are settled after the
//! answer, together with those of other unprepares.

use std::collections::BTreeSet;
use std::sync::{Arc, MutexGuard};

use tracing::warn;

use super::claims::{ClaimError, ClaimRef};
use super::enforce::{self, Undo};
use super::validate::validate;
use super::{ClaimResult, NodeChange, Preparer, UndoError, blocking};
use crate::claim_uid::ClaimUid;
use crate::state::records::{Action, ClaimEntry, EntryState};
use crate::sync::Locked;

/// How long after an unprepare released a MIG mode hold the GPU is
/// settled: the releases of a burst of unprepares are settled together.
const SETTLE_AFTER: std::time::Duration = std::time::Duration::from_millis(20);

/// The fix of an unprepare that failed part way.
const RETRIED: &str = "see the driver's log; the kubelet retries";

impl Preparer {
    /// validate -> mark `Unpreparing` -> undo -> forget its Pods and
    /// status -> release what a lost record of it still holds.
    pub(super) async fn unprepare_one(self: &Arc<Self>, claim: &ClaimRef) -> ClaimResult<()> {
        let uid = validate(claim)?;
        let _guard = self.locks.lock(&uid).await;
        let Some(mut entry) = self.entry(&uid) else {
            // Unknown: nothing of ours, except maybe a stray spec, or what
            // a claim whose record was lost may still hold.
            let this = self.clone();
            let id = uid.clone();
            return blocking(move || this.release_lost(&id))
                .await
                .map_err(|e| ClaimError::new(claim, e.to_string()).fix(RETRIED));
        };
        let written_status = !entry.status.is_empty();
        // Only side effects need the mark: without one, a crash between
        // removing the spec and the entry leaves a complete entry whose
        // spec start-up recovery writes again, and the kubelet's retry
        // removes both.
        if entry.state == EntryState::Completed && entry.has_side_effects() {
            entry.state = EntryState::Unpreparing;
            let (this, id, marked) = (self.clone(), uid.clone(), entry.clone());
            blocking(move || this.checkpoint.put(id, marked))
                .await
                .map_err(|e| {
                    ClaimError::new(claim, format!("cannot record it in the checkpoint: {e}"))
                })?;
        }
        let (namespace, name) = (entry.namespace.clone(), entry.name.clone());
        let undone = if !entry.has_side_effects() {
            self.undo_holds(&uid, &entry)
        } else {
            self.clone().undo(uid.clone(), entry).await
        };
        undone.map_err(|e| ClaimError::new(claim, e.to_string()).fix(RETRIED))?;
        self.reserved_for.forget(&uid);
        if written_status && let Some(writer) = &self.deps.status {
            writer.remove(&namespace, &name, uid.as_str());
        }
        if self.checkpoint.is_lost(&uid) {
            // Prepared again after its record was lost: the lost record
            // may name more (a MIG device of the first prepare).
            let this = self.clone();
            let id = uid.clone();
            blocking(move || this.release_lost(&id))
                .await
                .map_err(|e| ClaimError::new(claim, e.to_string()).fix(RETRIED))?;
        }
        Ok(())
    }

    /// [`Self::undo_now`] on a blocking thread.
    pub(super) async fn undo(
        self: Arc<Self>,
        uid: ClaimUid,
        entry: ClaimEntry,
    ) -> Result<(), UndoError> {
        blocking(move || self.undo_now(&uid, &entry)).await
    }

    /// Undoes an entry's side effects (newest first, each through its
    /// enforcer), removes its spec and the entry, then lets the enforcers
    /// settle what no claim holds any more. Idempotent; on failure the
    /// entry stays for a later retry.
    pub(super) fn undo_now(&self, uid: &ClaimUid, entry: &ClaimEntry) -> Result<(), UndoError> {
        let cx = Undo::new(uid, &self.checkpoint, &self.hardware);
        if let Some(fields) = self.checkpoint.unknown_fields(uid) {
            cx.report(newer_fields(uid, &fields));
        }
        for action in entry.actions.iter().rev() {
            self.enforcers
                .undo(&cx, action)
                .map_err(|source| UndoError::Action {
                    action: Box::new(action.clone()),
                    source,
                })?;
        }
        self.remove_files(uid)?;
        self.release(&cx, entry);
        self.tell_operator(cx.into_reports());
        Ok(())
    }

    /// The claim's spec, then its record.
    fn remove_files(&self, uid: &ClaimUid) -> Result<(), UndoError> {
        self.specs.remove(uid).map_err(UndoError::Spec)?;
        self.checkpoint.remove(uid).map_err(UndoError::Record)?;
        Ok(())
    }

    /// After a claim's record is gone: the enforcers settle what no claim
    /// holds any more (a GPU left in MIG mode without a hold), reporting
    /// through `cx`, the undo's context.
    pub(super) fn release(&self, cx: &Undo<'_>, entry: &ClaimEntry) {
        let mut gpus_changed = entry.actions.iter().any(Action::changes_gpus);
        for enforcer in self.enforcers.iter() {
            gpus_changed |= enforcer.released(cx, entry);
        }
        self.changed(NodeChange::gpus_if(gpus_changed));
    }

    /// Undoes a claim that did nothing but hold MIG modes: its spec and
    /// record go here, on the async worker (two unlinks cost less than a
    /// hand-over to a blocking thread and back); the settling its holds
    /// allow (the hardware lock, an NVML read) runs after the answer.
    fn undo_holds(self: &Arc<Self>, uid: &ClaimUid, entry: &ClaimEntry) -> Result<(), UndoError> {
        self.remove_files(uid)?;
        self.changed(NodeChange::Records);
        self.settle_later(entry.mig_mode_holds().map(str::to_owned));
        Ok(())
    }

    /// Settles `gpus` on a blocking thread [`SETTLE_AFTER`] from now,
    /// together with whatever other unprepares release meanwhile: a burst
    /// of them costs one pass under the hardware lock (which prepares would
    /// otherwise find taken), not one each. A settle reads the holds under
    /// that lock, so a prepare that came first keeps its GPU as it needs
    /// it; one lost to a crash is settled at the next start.
    fn settle_later(self: &Arc<Self>, gpus: impl IntoIterator<Item = String>) {
        let mut unsettled = self.unsettled();
        unsettled.gpus.extend(gpus);
        if unsettled.running || unsettled.gpus.is_empty() {
            return;
        }
        unsettled.running = true;
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(SETTLE_AFTER).await;
            let _ = tokio::task::spawn_blocking(move || this.settle_unsettled()).await;
        });
    }

    /// Settles the released GPUs until none are left to settle.
    fn settle_unsettled(&self) {
        loop {
            let gpus = {
                let mut unsettled = self.unsettled();
                if unsettled.gpus.is_empty() {
                    unsettled.running = false;
                    return;
                }
                std::mem::take(&mut unsettled.gpus)
            };
            self.settle_mig_modes(gpus.iter().map(String::as_str));
        }
    }

    fn unsettled(&self) -> MutexGuard<'_, Unsettled> {
        self.unsettled.locked()
    }

    /// Whether released MIG mode holds are still to settle (tests).
    #[cfg(test)]
    pub(super) fn settling(&self) -> bool {
        let unsettled = self.unsettled();
        unsettled.running || !unsettled.gpus.is_empty()
    }

    /// Logs each report and records it as a Node Event (in the background:
    /// this runs on a blocking thread of the runtime).
    pub(super) fn tell_operator(&self, reports: Vec<enforce::Report>) {
        #[cfg(test)]
        self.reported.locked().extend(reports.iter().cloned());
        for report in reports {
            warn!(reason = report.reason, "{}", report.message);
            if let (Some(events), Ok(runtime)) = (
                self.deps.events.clone(),
                tokio::runtime::Handle::try_current(),
            ) {
                runtime.spawn(async move {
                    (events.warning(report.reason, &report.action, &report.message)).await
                });
            }
        }
    }
}

/// A record a newer version wrote: what this one did not know of it stays.
fn newer_fields(uid: &ClaimUid, fields: &[String]) -> enforce::Report {
    enforce::Report {
        reason: "NewerRecordFieldsLeft",
        action: format!("UnprepareClaim {uid}"),
        message: format!(
            "claim {uid}: its record was written by a newer version of the driver with fields \
             this one does not know ({}); what they describe, if anything, was not undone. \
             Fix: roll forward to the version that wrote it, or check the claim's GPUs by hand \
             (nvidia-smi)",
            fields.join(", ")
        ),
    }
}

/// GPUs to settle after unprepares that answered, and whether a blocking
/// thread is settling them.
#[derive(Debug, Default)]
pub(super) struct Unsettled {
    gpus: BTreeSet<String>,
    running: bool,
}
