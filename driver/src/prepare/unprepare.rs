//! NodeUnprepareResources: a claim's side effects are undone, newest
//! first, each through the enforcer that made it; then its spec and its
//! record go. The MIG modes no claim holds any more are settled after the
//! answer, together with those of other unprepares; a claim without side
//! effects answers once its record is gone, and its spec goes when the
//! unprepares pause.

use std::collections::BTreeSet;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

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
const SETTLE_AFTER: Duration = Duration::from_millis(20);

/// Specs of unprepared claims are removed once no unprepare came for this
/// long...
const SPECS_QUIET: Duration = Duration::from_millis(20);
/// ...or this long after the first of them, whichever comes first.
const SPECS_AT_MOST: Duration = Duration::from_secs(1);

/// The fix of an unprepare that failed part way.
const RETRIED: &str = "see the driver's log; the kubelet retries";

impl Preparer {
    /// validate -> mark `Unpreparing` -> undo -> forget its Pods and
    /// status -> release what a lost record of it still holds.
    pub(super) async fn unprepare_one(self: &Arc<Self>, claim: &ClaimRef) -> ClaimResult<()> {
        let uid = validate(claim)?;
        let _guard = self.locks.lock(&uid).await;
        let side_effects = (self.checkpoint.lock().get(&uid)).map(ClaimEntry::has_side_effects);
        let removed = match side_effects {
            // Unknown: nothing of ours, except maybe a stray spec, or what
            // a claim whose record was lost may still hold.
            None => {
                let this = self.clone();
                let id = uid.clone();
                return blocking(move || this.release_lost(&id))
                    .await
                    .map_err(|e| ClaimError::new(claim, e.to_string()).fix(RETRIED));
            }
            // The record's own entry, moved out as it goes: copying every
            // device's answer and edits only to read two names from was a
            // tenth of an unprepare's CPU.
            Some(false) => self.undo_holds(&uid),
            Some(true) => self.undo_side_effects(&uid).await,
        };
        let entry = removed.map_err(|e| ClaimError::new(claim, e.to_string()).fix(RETRIED))?;
        self.reserved_for.forget(&uid);
        if let Some(entry) = entry
            && !entry.status.is_empty()
            && let Some(writer) = &self.deps.status
        {
            writer.remove(&entry.namespace, &entry.name, uid.as_str());
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

    /// Marks a claim with side effects `Unpreparing` (a crash between
    /// removing its spec and its record then leaves an entry start-up
    /// recovery finishes: without the mark, a complete entry whose spec
    /// recovery writes again, and the kubelet's retry removes both), then
    /// undoes it; its entry, for what the caller still has to forget.
    async fn undo_side_effects(
        self: &Arc<Self>,
        uid: &ClaimUid,
    ) -> Result<Option<ClaimEntry>, UndoError> {
        let Some(mut entry) = self.entry(uid) else {
            return Ok(None);
        };
        if entry.state == EntryState::Completed {
            entry.state = EntryState::Unpreparing;
            let (this, id, marked) = (self.clone(), uid.clone(), entry.clone());
            blocking(move || this.checkpoint.put(id, marked))
                .await
                .map_err(UndoError::Mark)?;
        }
        self.clone().undo(uid.clone(), entry.clone()).await?;
        Ok(Some(entry))
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

    /// Undoes a claim that did nothing but hold MIG modes: its record is
    /// named retired in the records' journal (start-up reads it as
    /// `Unpreparing`), here on the async worker (one appended line, cheaper
    /// than a hand-over to a blocking thread and back). Its spec and record
    /// go once the unprepares pause, and the settling its holds allow (the
    /// hardware lock, an NVML read) runs after the answer. A crash in
    /// between leaves an `Unpreparing` record, which start-up recovery
    /// finishes as it does any other (so does an older version).
    fn undo_holds(self: &Arc<Self>, uid: &ClaimUid) -> Result<Option<ClaimEntry>, UndoError> {
        let entry = (self.checkpoint).retire(uid).map_err(UndoError::Record)?;
        self.changed(NodeChange::Records);
        self.remove_files_later(uid.clone());
        if let Some(entry) = &entry {
            self.settle_later(entry.mig_mode_holds().map(str::to_owned));
        }
        Ok(entry)
    }

    /// Removes the spec and the retired record of an unprepared claim once
    /// no unprepare came for [`SPECS_QUIET`] (at most [`SPECS_AT_MOST`]
    /// later): the kubelet no longer uses them, and a burst of unprepares
    /// answers without the renames.
    fn remove_files_later(self: &Arc<Self>, uid: ClaimUid) {
        let mut unsettled = self.unsettled();
        unsettled.files.push(uid);
        unsettled.last_unprepared = Some(Instant::now());
        if unsettled.removing {
            return;
        }
        unsettled.removing = true;
        let this = self.clone();
        tokio::spawn(async move { this.remove_files_when_quiet().await });
    }

    async fn remove_files_when_quiet(self: Arc<Self>) {
        let began = Instant::now();
        loop {
            let last = self.unsettled().last_unprepared.unwrap_or(began);
            let quiet_at = (last + SPECS_QUIET).min(began + SPECS_AT_MOST);
            if Instant::now() >= quiet_at {
                break;
            }
            tokio::time::sleep_until(quiet_at.into()).await;
        }
        self.remove_unprepared_files().await;
    }

    /// Removes now the specs and records of unprepared claims still to
    /// remove (the node stopping: none is left for the next start).
    pub async fn remove_unprepared_files(&self) {
        loop {
            let claims = {
                let mut unsettled = self.unsettled();
                if unsettled.files.is_empty() {
                    unsettled.removing = false;
                    return;
                }
                std::mem::take(&mut unsettled.files)
            };
            for uid in claims {
                self.remove_unheld_files(&uid).await;
            }
        }
    }

    /// Removes `uid`'s spec, then its retired record, unless the claim was
    /// prepared again meanwhile. What is left on a failure, start-up
    /// recovery removes: the record says `Unpreparing`.
    async fn remove_unheld_files(&self, uid: &ClaimUid) {
        let _guard = self.locks.lock(uid).await;
        if self.checkpoint.lock().contains_key(uid) {
            return;
        }
        let removed = (self.specs.remove(uid).map_err(UndoError::Spec))
            .and_then(|()| self.checkpoint.drop_retired(uid).map_err(UndoError::Record));
        if let Err(e) = removed {
            warn!(claim = %uid, "{e} (start-up recovery finishes the unprepare)");
        }
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

    /// Whether released MIG mode holds are still to settle, or specs of
    /// unprepared claims to remove (tests).
    #[cfg(test)]
    pub(super) fn settling(&self) -> bool {
        let unsettled = self.unsettled();
        unsettled.running || !unsettled.gpus.is_empty() || unsettled.removing
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

/// What unprepares that answered left to do: GPUs to settle (and whether
/// a blocking thread is settling them), specs to remove (and whether a
/// task waits to remove them).
#[derive(Debug, Default)]
pub(super) struct Unsettled {
    gpus: BTreeSet<String>,
    running: bool,
    /// Claims whose spec and retired record are still to remove.
    files: Vec<ClaimUid>,
    /// When the last of them was unprepared.
    last_unprepared: Option<Instant>,
    removing: bool,
}
