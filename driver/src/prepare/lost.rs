//! Claims whose records were lost: moved aside as unreadable at start-up
//! ([`crate::state::checkpoint::Lost`]). Their Pods may still run, so what they
//! may use stays published and in place until the kubelet unprepares them;
//! then it is released like a record's side effects.

use tracing::info;

use super::enforce::{Report, Undo};
use super::{Preparer, UndoError};
use crate::claim_uid::ClaimUid;
use crate::state::checkpoint::Lost;
use crate::state::records::ClaimEntry;

impl Preparer {
    /// Claims whose records were lost (moved aside as unreadable) and not
    /// yet unprepared: what they may use is kept.
    pub fn lost_claims(&self) -> Lost<ClaimEntry> {
        self.checkpoint.lost()
    }

    /// MIG devices the driver created (recorded in the checkpoint, or
    /// named by a lost record).
    pub fn created_mig(&self) -> std::collections::BTreeSet<String> {
        self.held(|e| e.created_mig().map(str::to_owned).collect())
    }

    /// Names of the devices of prepared claims (and of lost records).
    pub fn prepared_devices(&self) -> std::collections::BTreeSet<String> {
        self.held(|e| e.device_names().map(str::to_owned).collect())
    }

    /// What `f` finds in the entries of prepared claims and in what was
    /// salvaged of lost records (their Pods may still run).
    fn held(&self, f: impl Fn(&ClaimEntry) -> Vec<String>) -> std::collections::BTreeSet<String> {
        let lost = self.checkpoint.lost();
        let records = self.checkpoint.lock();
        (records.values())
            .chain(lost.claims.values().flatten())
            .flat_map(f)
            .collect()
    }

    /// Unprepare of a claim the records do not know. If its record was
    /// lost, what it may still hold goes now: every MPS daemon of the claim,
    /// what the salvaged entry names (undone as a record would be: a MIG
    /// device only where its GPU instance id and UUID both match), its CDI
    /// spec and its status entries; then it is no longer lost, for good,
    /// and its GPUs' MIG modes are settled without its holds. What could not
    /// be read of its record is reported (a Node Event). Otherwise only a
    /// stray spec.
    pub(super) fn release_lost(&self, uid: &ClaimUid) -> Result<(), UndoError> {
        let lost = self.checkpoint.lost();
        if !lost.may_hold(uid) {
            return self.specs.remove(uid).map_err(UndoError::Spec);
        }
        (self.deps.mps.release_claim(uid)).map_err(UndoError::LostDaemons)?;
        let salvaged = lost.claims.get(uid).cloned().flatten();
        let cx = Undo::new(uid, &self.checkpoint, &self.hardware);
        for action in salvaged.iter().flat_map(|e| e.actions.iter().rev()) {
            (self.enforcers.undo(&cx, action)).map_err(|source| UndoError::Action {
                action: Box::new(action.clone()),
                source,
            })?;
        }
        self.specs.remove(uid).map_err(UndoError::Spec)?;
        if let Some(writer) = &self.deps.status {
            writer.remove_marked(uid.as_str());
        }
        if lost.claims.contains_key(uid) && (salvaged.is_none() || lost.in_part.contains(uid)) {
            cx.report(unreadable_part(uid));
        }
        self.checkpoint
            .release_lost(uid)
            .map_err(UndoError::Record)?;
        // Its holds are gone only now: settle what no claim holds any more.
        if let Some(entry) = &salvaged {
            self.release(&cx, entry);
        }
        self.tell_operator(cx.into_reports());
        info!(claim = %uid, "released what a claim whose record was lost held");
        Ok(())
    }
}

/// What a lost claim may have held beyond what could be read of its record.
fn unreadable_part(uid: &ClaimUid) -> Report {
    Report {
        reason: "LostClaimPartlyReleased",
        action: format!("ReleaseLostClaim {uid}"),
        message: format!(
            "claim {uid}: its record was unreadable and decoded only in part (or not at all); \
             its MPS daemons, CDI spec, status entries and whatever the readable part named \
             were released, but it may also have held a MIG device it created, a GPU's MIG \
             mode or a GPU's time slice. Fix: list MIG devices no Pod uses (nvidia-smi mig \
             -lgi) and destroy them, and reset time slices no claim needs (nvidia-smi \
             compute-policy --set-timeslice=0)"
        ),
    }
}
