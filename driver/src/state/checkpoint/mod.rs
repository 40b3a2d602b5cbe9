//! The node-local record of prepared claims.
//!
//! The kubelet may call prepare again after a plugin restart and expects the
//! same answer; unprepare must undo exactly what prepare did. Both need to know
//! what was prepared before the process died, so every change is persisted
//! before it is acknowledged.
//!
//! One file per claim, `<state dir>/prepared-claims/<claim UID>.json`:
//! `{"version":2,"bootId":"…","crc32":N,"entry":"<JSON text of the entry>"}`.
//! A change costs the same however many claims are prepared: prepare writes
//! its claim's file, unprepare removes it, and claims never wait for each
//! other's writes. The entry is embedded as text so the checksum covers
//! exactly the bytes that were written, independent of JSON formatting.
//!
//! * Versioned: an unknown version is treated like corruption, never guessed at.
//!   Within a version a newer release may add fields an older one does not
//!   know (a rollback): the older one keeps the claim with what it knows and
//!   reports the rest ([`Checkpoint::unknown_fields`]) instead of losing
//!   every claim. A change an older version must not ignore bumps the
//!   version.
//! * Checksummed: a torn or bit-flipped record is detected, moved aside and
//!   reported; the daemon starts without it instead of crash-looping. A
//!   record that cannot be *read* (an I/O error) is not moved aside: start-up
//!   retries it, then fails, so a valid record is never lost to a passing
//!   fault.
//! * Boot-scoped: CDI specs live on tmpfs and MIG instances and MPS daemons do
//!   not survive a reboot, so a record from another boot describes nothing
//!   that still exists and is removed.
//! * Atomic, for this boot: written to a temp file (or a spare, the file of
//!   a removed record: [`crate::cdi::spare`]) and renamed over, without fsync (see
//!   [`crate::cdi::write_for_this_boot`]: a killed process loses nothing,
//!   and what the record describes ends with the boot anyway). One change
//!   is not written to the record at all: a record retired by an unprepare
//!   is named in the journal of retired records ([`retired`]), which
//!   start-up reads to mark it for recovery to finish
//!   ([`Checkpoint::retire`]); its file goes later.
//! * Migrated: version 1 kept every claim in one `checkpoint.json`; start-up
//!   splits it into records and removes it, so an upgrade keeps every
//!   prepared claim.

mod lost;
mod record;
mod retired;
mod snapshot;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::claim_uid::ClaimUid;
use crate::sync::Locked;

use crate::cdi::remove_if_present;
use crate::cdi::spare::Spares;
pub use lost::Lost;
use lost::{find_lost, mark_released, prune_quarantined, quarantine};
pub use record::RecordError;
pub(crate) use record::{decode_legacy, decode_record};
use record::{encode_record, read_record};
use retired::{Journal, read_retired};
use snapshot::record_files;
pub use snapshot::{Snapshot, SnapshotError, fuzz_decode, read_snapshot};

/// The directory of records, under the state directory.
pub const RECORDS_DIR: &str = "prepared-claims";
const RECORD_SUFFIX: &str = ".json";
/// Version 1's file: every claim in one file, rewritten whole on each change.
const LEGACY_FILE: &str = "checkpoint.json";

/// Where the kernel publishes the current boot's random id.
pub const KERNEL_BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// How the records were found at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadOutcome {
    /// No records yet (first start on this node, or nothing prepared).
    Fresh,
    /// Records restored from this boot.
    Restored { claims: usize },
    /// Records written in an earlier boot, removed: nothing they describe
    /// survives a reboot.
    PreviousBoot { claims: usize },
    /// Some records were unreadable and moved aside (the others restored).
    Quarantined {
        reason: String,
        moved_to: Vec<PathBuf>,
        restored: usize,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read boot id from {path}: {source}")]
    BootId {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read checkpoint {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot move corrupted checkpoint {path} aside: {source}")]
    Quarantine {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write checkpoint {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How many moved-aside records that no longer mark a lost claim (released,
/// or of another boot) are kept for inspection; the oldest go first. Those
/// of claims still lost are always kept: they are what says so.
pub const QUARANTINE_KEPT: usize = 64;

/// What the records hold per claim.
pub trait Entry: Serialize + DeserializeOwned + Clone {
    /// What can still be read of an entry that does not decode whole (a
    /// damaged record), as a hint of what to release; `None` if nothing.
    fn salvage(_entry: &serde_json::Value) -> Option<Self> {
        None
    }

    /// Marks the entry as one an unprepare answered for and start-up
    /// recovery is to finish ([`Checkpoint::retire`]).
    fn retire(&mut self);
}

/// Persistent map of claim UID -> entry `T` (defined by the prepare logic),
/// shared by claims prepared concurrently. Callers serialize changes of
/// one claim (the per-claim lock); changes of different claims write
/// different files and never wait for each other.
#[derive(Debug)]
pub struct Checkpoint<T> {
    dir: PathBuf,
    boot_id: String,
    claims: Mutex<BTreeMap<ClaimUid, T>>,
    lost: Mutex<Lost<T>>,
    /// Restored claims whose records have fields this version does not
    /// know (written by a newer one), with those fields.
    unknown: Mutex<BTreeMap<ClaimUid, Vec<String>>>,
    /// Files of removed records, reused by the next writes.
    spares: Spares,
    /// Which records on disk are retired.
    journal: Journal,
}

/// What start-up found, before it becomes a [`LoadOutcome`].
#[derive(Default)]
struct Found {
    restored: usize,
    previous_boot: usize,
    quarantined: Vec<(PathBuf, String)>,
}

impl<T: Entry> Checkpoint<T> {
    /// Open the records under `state_dir` for the boot identified by the
    /// contents of `boot_id_file` (normally [`KERNEL_BOOT_ID`]).
    pub fn open(
        state_dir: &Path,
        boot_id_file: &Path,
    ) -> Result<(Self, LoadOutcome), CheckpointError> {
        let boot_id = fs::read_to_string(boot_id_file)
            .map_err(|source| CheckpointError::BootId {
                path: boot_id_file.to_owned(),
                source,
            })?
            .trim()
            .to_owned();
        let dir = state_dir.join(RECORDS_DIR);
        let checkpoint = Checkpoint {
            spares: Spares::adopt(&dir, ""),
            journal: Journal::new(&dir),
            dir,
            boot_id,
            claims: Mutex::new(BTreeMap::new()),
            lost: Mutex::new(Lost::default()),
            unknown: Mutex::new(BTreeMap::new()),
        };
        let mut found = Found::default();
        checkpoint.migrate(&state_dir.join(LEGACY_FILE), &mut found)?;
        checkpoint.load(&mut found)?;
        checkpoint.mark_retired()?;
        // The lost claims first: pruning never removes what says a claim
        // is lost, however many there are (a rollback may move aside every
        // record of the node).
        let (lost, marking) = find_lost(&checkpoint.dir, state_dir, &checkpoint.boot_id);
        prune_quarantined(&checkpoint.dir, QUARANTINE_KEPT, &marking);
        *checkpoint.lost.locked() = lost;
        let outcome = match found {
            Found { quarantined, .. } if !quarantined.is_empty() => LoadOutcome::Quarantined {
                reason: (quarantined.iter())
                    .map(|(path, why)| format!("{}: {why}", path.display()))
                    .collect::<Vec<_>>()
                    .join("; "),
                moved_to: quarantined.into_iter().map(|(path, _)| path).collect(),
                restored: found.restored,
            },
            Found {
                restored: 0,
                previous_boot: 0,
                ..
            } => LoadOutcome::Fresh,
            Found {
                restored: 0,
                previous_boot,
                ..
            } => LoadOutcome::PreviousBoot {
                claims: previous_boot,
            },
            Found { restored, .. } => LoadOutcome::Restored { claims: restored },
        };
        Ok((checkpoint, outcome))
    }

    /// Splits a version 1 file into records (this boot's) and removes it.
    fn migrate(&self, legacy: &Path, found: &mut Found) -> Result<(), CheckpointError> {
        let bytes = match fs::read(legacy) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: legacy.to_owned(),
                    source,
                });
            }
        };
        match decode_legacy::<T>(&bytes) {
            Ok((boot_id, claims)) if boot_id == self.boot_id => {
                for (claim, entry) in claims {
                    self.write(&claim, &entry)?;
                }
            }
            Ok((_, claims)) => found.previous_boot += claims.len(),
            Err(why) => {
                found
                    .quarantined
                    .push((quarantine(legacy, &self.boot_id)?, why.to_string()));
                return Ok(());
            }
        }
        fs::remove_file(legacy).map_err(|source| CheckpointError::Write {
            path: legacy.to_owned(),
            source,
        })
    }

    /// Reads every record of this boot into memory; removes other boots'.
    fn load(&self, found: &mut Found) -> Result<(), CheckpointError> {
        let files = record_files(&self.dir).map_err(|why| CheckpointError::Read {
            path: self.dir.clone(),
            source: std::io::Error::other(why),
        })?;
        let mut claims = self.lock();
        for (stem, path) in files {
            match read_record::<T>(&stem, &path) {
                Ok(read) if read.boot == self.boot_id => {
                    if !read.unknown.is_empty() {
                        self.unknown_lock().insert(read.claim.clone(), read.unknown);
                    }
                    claims.insert(read.claim, read.entry);
                    found.restored += 1;
                }
                Ok(_) => {
                    remove_if_present(&path).map_err(|source| CheckpointError::Write {
                        path: path.clone(),
                        source,
                    })?;
                    found.previous_boot += 1;
                }
                // Gone between listing and reading: nothing to restore.
                Err(RecordError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
                // The record may be valid: never moved aside for a fault of
                // the disk or the process (EIO, EMFILE). Start-up fails and
                // is retried; the claim is not lost.
                Err(RecordError::Io(source)) => return Err(CheckpointError::Read { path, source }),
                Err(why) => found
                    .quarantined
                    .push((quarantine(&path, &self.boot_id)?, why.to_string())),
            }
        }
        Ok(())
    }

    /// Marks the loaded records the journal names retired, and leaves the
    /// journal naming only those.
    fn mark_retired(&self) -> Result<(), CheckpointError> {
        let cannot = |source| CheckpointError::Read {
            path: self.journal.path().to_owned(),
            source,
        };
        let named = read_retired(&self.dir).map_err(cannot)?;
        let mut claims = self.lock();
        let on_disk = (named.into_iter())
            .filter(|claim| claims.get_mut(claim).map(Entry::retire).is_some())
            .collect();
        (self.journal.reset(on_disk)).map_err(|e| self.journal_failed(e))
    }

    fn unknown_lock(&self) -> MutexGuard<'_, BTreeMap<ClaimUid, Vec<String>>> {
        self.unknown.locked()
    }

    /// Restored claims whose records a newer version wrote with fields this
    /// one does not know, with those fields (`entry.actions (1 of 3 items)`):
    /// kept with what is known; what the rest describes is not undone here.
    pub fn with_unknown_fields(&self) -> BTreeMap<ClaimUid, Vec<String>> {
        self.unknown_lock().clone()
    }

    /// The fields of `claim`'s record this version does not know.
    pub fn unknown_fields(&self, claim: &ClaimUid) -> Option<Vec<String>> {
        self.unknown_lock().get(claim).cloned()
    }

    /// The entries in memory, for reading (every acknowledged change, and
    /// changes being written).
    pub fn lock(&self) -> MutexGuard<'_, BTreeMap<ClaimUid, T>> {
        self.claims.locked()
    }

    /// Where the records are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Claims whose records were moved aside and not yet released.
    pub fn lost(&self) -> Lost<T> {
        self.lost.locked().clone()
    }

    /// Whether a moved-aside record names `claim`.
    pub fn is_lost(&self, claim: &ClaimUid) -> bool {
        (self.lost.locked()).claims.contains_key(claim)
    }

    /// Takes `claim` out of the lost ones (the kubelet unprepared it) and
    /// returns what was salvaged of its entry; `None` if it was not lost.
    /// Its moved-aside records are marked released first, so the next start
    /// of this boot does not find it lost again.
    pub fn release_lost(&self, claim: &ClaimUid) -> Result<Option<Option<T>>, CheckpointError> {
        let mut lost = self.lost.locked();
        if lost.claims.contains_key(claim) {
            mark_released(&self.dir, claim)?;
        }
        lost.in_part.remove(claim);
        let salvaged = lost.claims.remove(claim);
        Ok(salvaged.or_else(|| lost.unnamed.then_some(None)))
    }

    /// Records `entry` for `claim` and returns once it is on disk. Other
    /// claims see it at once; on a failed write the previous entry is put
    /// back, so memory never claims more than the disk does.
    pub fn put(&self, claim: ClaimUid, entry: T) -> Result<(), CheckpointError> {
        let previous = self.lock().insert(claim.clone(), entry.clone());
        self.write(&claim, &entry).inspect_err(|_| {
            let mut claims = self.lock();
            match previous {
                Some(old) => claims.insert(claim, old),
                None => claims.remove(&claim),
            };
        })
    }

    /// Records `entry` for `claim` in memory only: it reaches the disk with
    /// the claim's next write. For a change whose loss in a crash is
    /// harmless but which other claims must see now.
    pub fn stage(&self, claim: ClaimUid, entry: T) {
        self.lock().insert(claim, entry);
    }

    /// Forgets `claim` and returns once that is on disk; forgetting an
    /// unknown claim is a no-op.
    pub fn remove(&self, claim: &ClaimUid) -> Result<Option<T>, CheckpointError> {
        let removed = self.forget(claim, |entry| {
            let path = self.record_path(claim);
            match self.spares.remove(&path) {
                Ok(()) => Ok(entry),
                Err(source) => Err((entry, CheckpointError::Write { path, source })),
            }
        })?;
        if removed.is_some() {
            self.journal_removed(claim)?;
        }
        Ok(removed)
    }

    /// Forgets `claim` in memory and names its record retired in the
    /// journal (a line appended: start-up marks the entry with
    /// [`Entry::retire`] and recovery finishes it, should the process die),
    /// returning the marked entry once that is on disk. The record goes
    /// later, with [`Self::drop_retired`], unchanged until then (fields of
    /// a newer version included). On a failed write the marked entry is
    /// kept in memory, so a retry finds it.
    pub fn retire(&self, claim: &ClaimUid) -> Result<Option<T>, CheckpointError> {
        self.forget(claim, |mut entry| {
            entry.retire();
            match self.journal.retire(claim) {
                Ok(()) => Ok(entry),
                Err(source) => Err((entry, self.journal_failed(source))),
            }
        })
    }

    /// Takes `claim`'s entry out of memory and lets `change` record that;
    /// the entry `change` returns is returned, or the one it hands back
    /// with its error put back.
    fn forget(
        &self,
        claim: &ClaimUid,
        change: impl FnOnce(T) -> Result<T, (T, CheckpointError)>,
    ) -> Result<Option<T>, CheckpointError> {
        let Some(entry) = self.lock().remove(claim) else {
            return Ok(None);
        };
        match change(entry) {
            Ok(entry) => {
                self.unknown_lock().remove(claim);
                Ok(Some(entry))
            }
            Err((entry, e)) => {
                self.lock().insert(claim.clone(), entry);
                Err(e)
            }
        }
    }

    /// Removes the record [`Self::retire`] left of `claim`, unless the
    /// claim was recorded again meanwhile (the caller holds its lock).
    pub fn drop_retired(&self, claim: &ClaimUid) -> Result<(), CheckpointError> {
        if self.lock().contains_key(claim) {
            return Ok(());
        }
        let path = self.record_path(claim);
        (self.spares.remove(&path)).map_err(|source| CheckpointError::Write { path, source })?;
        self.journal_removed(claim)
    }

    /// `claim`'s record is gone: the journal may be emptied.
    fn journal_removed(&self, claim: &ClaimUid) -> Result<(), CheckpointError> {
        (self.journal.removed(claim)).map_err(|e| self.journal_failed(e))
    }

    fn journal_failed(&self, source: std::io::Error) -> CheckpointError {
        CheckpointError::Write {
            path: self.journal.path().to_owned(),
            source,
        }
    }

    fn record_path(&self, claim: &ClaimUid) -> PathBuf {
        self.dir.join(format!("{}{RECORD_SUFFIX}", claim.as_str()))
    }

    fn write(&self, claim: &ClaimUid, entry: &T) -> Result<(), CheckpointError> {
        let path = self.record_path(claim);
        let failed = |source| CheckpointError::Write {
            path: path.clone(),
            source,
        };
        (self.spares)
            .write(&path, &encode_record(&self.boot_id, entry))
            .map_err(failed)?;
        // After the record: a kill in between leaves it marked retired,
        // and the prepare that wrote it unanswered.
        (self.journal.recorded(claim)).map_err(|e| self.journal_failed(e))
    }
}

#[cfg(test)]
mod tests;
