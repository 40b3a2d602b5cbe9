//! Start-up recovery: whatever the last run left is rolled back, finished
//! or restored before the first kubelet call is served.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use tracing::{error, info, warn};

use super::{Preparer, blocking};
use crate::claim_uid::ClaimUid;
use crate::state::checkpoint::{CheckpointError, LoadOutcome, Lost, QUARANTINE_KEPT};
use crate::state::records::{ClaimEntry, DeviceStatus, EntryState};

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
    #[error(
        "cannot write the driver's CDI spec {path}: {source} (fix: make its directory writable)"
    )]
    DriverSpec {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A claim prepared before, for its status write to resume: its UID,
/// namespace, name and devices.
type PreparedStatus = (String, String, String, Vec<DeviceStatus>);

impl Preparer {
    /// What the load found is told -> temp files of interrupted writes go
    /// -> each record is replayed (rolled back, finished, or its spec
    /// restored) -> status writes resume, keeping lost claims' -> CDI specs
    /// no record accounts for go, unless a lost record may own them.
    pub(super) async fn recover(
        self: Arc<Self>,
        outcome: LoadOutcome,
    ) -> Result<Recovery, SetupError> {
        let mut recovery = Recovery {
            outcome: outcome.clone(),
            rolled_back: Vec::new(),
            unprepared: Vec::new(),
            specs_restored: Vec::new(),
            orphans_removed: Vec::new(),
            problems: Vec::new(),
        };
        self.tell_load(&outcome).await;
        self.tell_newer_fields().await;
        self.remove_stale_temp(&mut recovery).await;
        let prepared_status = self.replay_records(&mut recovery).await;
        // Claims whose records were lost (now or earlier in this boot) may
        // still run: their specs, daemons and status entries stay.
        let lost = self.checkpoint.lost();
        self.resume_status(prepared_status, &lost);
        if !lost.unnamed {
            recovery.orphans_removed = self.remove_orphan_specs(lost).await?;
        } else {
            warn!("a moved-aside record names no claim: orphaned CDI specs are left in place");
        }
        for p in &recovery.problems {
            error!("start-up recovery: {p}");
        }
        Ok(recovery)
    }

    /// Logs how the records were found; records moved aside are also a
    /// Node Event.
    async fn tell_load(&self, outcome: &LoadOutcome) {
        match outcome {
            LoadOutcome::Quarantined {
                reason,
                moved_to,
                restored,
            } => {
                let moved: Vec<String> = moved_to.iter().map(|p| p.display().to_string()).collect();
                let message = format!(
                    "{} prepared-claim record(s) were unreadable ({reason}) and were moved to {}; \
                     {restored} other claim(s) restored. What the claims of the unreadable \
                     records may still use (CDI specs, MPS daemons, MIG devices, status \
                     entries) is kept until the kubelet unprepares them; moved-aside records \
                     stay while their claims are lost, and the most recent {QUARANTINE_KEPT} \
                     of the others are kept for inspection",
                    moved.len(),
                    moved.join(", ")
                );
                error!("{message}");
                if let Some(events) = &self.deps.events {
                    events
                        .warning("CheckpointQuarantined", "LoadCheckpoint", &message)
                        .await;
                }
            }
            LoadOutcome::PreviousBoot { claims } => {
                info!("checkpoint records of a previous boot ({claims} claims) removed");
            }
            LoadOutcome::Restored { claims } => info!("checkpoint restored: {claims} claims"),
            LoadOutcome::Fresh => info!("no checkpoint yet"),
        }
    }

    /// Warns of records a newer version wrote, with the fields this one
    /// does not know.
    async fn tell_newer_fields(&self) {
        let newer = self.checkpoint.with_unknown_fields();
        if newer.is_empty() {
            return;
        }
        let claims: Vec<String> = (newer.iter())
            .map(|(uid, fields)| format!("{uid} ({})", fields.join(", ")))
            .collect();
        let message = format!(
            "{} prepared-claim record(s) were written by a newer version of the driver with \
             fields this one does not know: {}. The claims are kept with what this version \
             knows; what the unknown fields describe is not undone at their unprepare. Fix: \
             roll forward, or finish the rollback once those claims are unprepared",
            newer.len(),
            claims.join("; ")
        );
        warn!("{message}");
        if let Some(events) = &self.deps.events {
            events
                .warning("CheckpointNewerFields", "LoadCheckpoint", &message)
                .await;
        }
    }

    /// Removes temp files of writes a kill interrupted (specs, records).
    async fn remove_stale_temp(self: &Arc<Self>, recovery: &mut Recovery) {
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
    }

    /// Rolls back claims left `Started`, finishes those left
    /// `Unpreparing`, and checks and restores the `Completed` ones; the
    /// status writes of the latter.
    async fn replay_records(self: &Arc<Self>, recovery: &mut Recovery) -> Vec<PreparedStatus> {
        let mut prepared_status = Vec::new();
        for (uid, entry) in self.entries() {
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
                    // The status write runs in the background after
                    // prepare; a kill may have cut it short.
                    prepared_status.push((
                        uid.to_string(),
                        entry.namespace.clone(),
                        entry.name.clone(),
                        entry.status.clone(),
                    ));
                    self.restore_completed(uid, entry, recovery).await;
                }
            }
        }
        prepared_status
    }

    /// A `Completed` claim: its devices are checked and its spec restored.
    async fn restore_completed(
        self: &Arc<Self>,
        uid: ClaimUid,
        entry: ClaimEntry,
        recovery: &mut Recovery,
    ) {
        // What the claim was prepared with is the driver's (the model
        // publishes it as such); a device that vanished (a GPU reset, a
        // hand-made change) is reported.
        for provider in self.enforcers.iter() {
            recovery.problems.extend(provider.check(&uid, &entry));
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

    /// Resumes the status writes of prepared claims. Markers of claims not
    /// in the records are removals still to make, unless their records
    /// were lost.
    fn resume_status(&self, prepared_status: Vec<PreparedStatus>, lost: &Lost<ClaimEntry>) {
        if let Some(writer) = &self.deps.status {
            writer.resume(prepared_status, !lost.unnamed, |uid| {
                ClaimUid::parse(uid).is_ok_and(|c| lost.may_hold(&c))
            });
        }
    }

    /// Removes CDI specs that neither a record nor a lost record accounts
    /// for; what was removed.
    async fn remove_orphan_specs(
        self: &Arc<Self>,
        lost: Lost<ClaimEntry>,
    ) -> Result<Vec<ClaimUid>, SetupError> {
        let this = self.clone();
        let removed = blocking(move || {
            let known: BTreeSet<ClaimUid> = this.checkpoint.lock().keys().cloned().collect();
            this.specs
                .remove_orphans(|c| known.contains(c) || lost.claims.contains_key(c))
        })
        .await
        .map_err(|source| SetupError::CdiDir {
            dir: self.config.cdi_dir.clone(),
            source,
        })?;
        if !removed.is_empty() {
            info!(count = removed.len(), "removed orphaned CDI specs");
        }
        Ok(removed)
    }

    /// Writes the driver's spec again if it is gone (a cleared CDI
    /// directory): without it no container of a claim prepared since
    /// could start. One `stat` when it is there.
    pub(super) fn restore_driver_spec(&self) -> std::io::Result<()> {
        if !self.specs.driver_path().exists() {
            self.specs.write_driver(&self.driver_spec)?;
        }
        Ok(())
    }

    /// Rewrites the spec of a completed claim if it is missing or differs.
    pub(super) fn restore_spec(&self, uid: &ClaimUid, entry: &ClaimEntry) -> std::io::Result<bool> {
        let Some(spec) = &entry.spec else {
            return Ok(false);
        };
        if crate::cdi::read(&self.specs.spec_path(uid)).as_ref() == Some(spec) {
            return Ok(false);
        }
        self.specs.write(uid, spec)?;
        Ok(true)
    }
}
