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
//! * Atomic, for this boot: written to a temp file and renamed over, without
//!   fsync (see [`crate::cdi::write_for_this_boot`]: a killed process loses
//!   nothing, and what the record describes ends with the boot anyway).
//! * Migrated: version 1 kept every claim in one `checkpoint.json`; start-up
//!   splits it into records and removes it, so an upgrade keeps every
//!   prepared claim.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::cdi::write_for_this_boot;
use crate::claim_uid::ClaimUid;
use crate::sync::Locked;

const FORMAT_VERSION: u32 = 2;
/// The directory of records, under the state directory.
pub const RECORDS_DIR: &str = "prepared-claims";
const RECORD_SUFFIX: &str = ".json";
/// Version 1: every claim in one file, rewritten whole on each change.
const LEGACY_VERSION: u32 = 1;
const LEGACY_FILE: &str = "checkpoint.json";

/// Where the kernel publishes the current boot's random id.
pub const KERNEL_BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// One claim's record on disk.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Record {
    version: u32,
    boot_id: String,
    crc32: u32,
    entry: String,
}

/// Version 1's single file.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LegacyEnvelope {
    version: u32,
    boot_id: String,
    crc32: u32,
    claims: String,
}

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
const QUARANTINE_MARK: &str = ".corrupt-";
/// A moved-aside record whose claim the kubelet has since unprepared.
const RELEASED_MARK: &str = ".released-";
/// Attempts to read a record before start-up fails.
const READ_ATTEMPTS: u32 = 3;

/// What the records hold per claim.
pub trait Entry: Serialize + DeserializeOwned + Clone {
    /// What can still be read of an entry that does not decode whole (a
    /// damaged record), as a hint of what to release; `None` if nothing.
    fn salvage(_entry: &serde_json::Value) -> Option<Self> {
        None
    }
}

/// Claims whose records were moved aside (now or at an earlier start of
/// this boot): their Pods may still run, so what they may use stays until
/// the kubelet unprepares them.
#[derive(Debug, Clone)]
pub struct Lost<T> {
    /// Each lost claim, with its entry as far as the moved-aside bytes
    /// still decode (checksum not verified): a hint of what to release,
    /// never a record to answer from.
    pub claims: BTreeMap<ClaimUid, Option<T>>,
    /// Lost claims whose entries decoded only in part (or not at all):
    /// releasing what was salvaged may leave something behind.
    pub in_part: std::collections::BTreeSet<ClaimUid>,
    /// A moved-aside file names no claim (a version 1 file, a misnamed
    /// record): any claim the records do not know may be a lost one.
    pub unnamed: bool,
}

impl<T> Default for Lost<T> {
    fn default() -> Self {
        Lost {
            claims: BTreeMap::new(),
            in_part: Default::default(),
            unnamed: false,
        }
    }
}

impl<T> Lost<T> {
    /// Whether `claim` may be one whose record was lost.
    pub fn may_hold(&self, claim: &ClaimUid) -> bool {
        self.unnamed || self.claims.contains_key(claim)
    }
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
        let checkpoint = Checkpoint {
            dir: state_dir.join(RECORDS_DIR),
            boot_id,
            claims: Mutex::new(BTreeMap::new()),
            lost: Mutex::new(Lost::default()),
            unknown: Mutex::new(BTreeMap::new()),
        };
        let mut found = Found::default();
        checkpoint.migrate(&state_dir.join(LEGACY_FILE), &mut found)?;
        checkpoint.load(&mut found)?;
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
                    .push((quarantine(legacy, &self.boot_id)?, why));
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
                Err(RecordError::Invalid(why)) => found
                    .quarantined
                    .push((quarantine(&path, &self.boot_id)?, why)),
            }
        }
        Ok(())
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
            for moved in moved_files(&self.dir) {
                if moved.released || moved.claim().as_ref() != Some(claim) {
                    continue;
                }
                let released = moved.path.with_file_name(moved.name.replacen(
                    QUARANTINE_MARK,
                    RELEASED_MARK,
                    1,
                ));
                fs::rename(&moved.path, &released).map_err(|source| CheckpointError::Write {
                    path: moved.path.clone(),
                    source,
                })?;
            }
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
        let Some(old) = self.lock().remove(claim) else {
            return Ok(None);
        };
        let path = self.record_path(claim);
        match remove_if_present(&path) {
            Ok(()) => {
                self.unknown_lock().remove(claim);
                Ok(Some(old))
            }
            Err(source) => {
                self.lock().insert(claim.clone(), old);
                Err(CheckpointError::Write { path, source })
            }
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
        write_for_this_boot(&path, &encode_record(&self.boot_id, entry)).map_err(failed)
    }
}

fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A moved-aside file: `<name>.corrupt-<stamp>[.<boot id>]` (`.released-`
/// once its claim was unprepared). Versions before the boot id in the name
/// left it out.
struct Moved {
    name: String,
    path: PathBuf,
    /// The moved-aside file's own name before the mark (`<uid>.json`).
    stem: String,
    stamp: u64,
    /// The boot it was moved aside in, when its name says.
    boot: Option<String>,
    released: bool,
}

impl Moved {
    fn parse(name: &str, path: PathBuf) -> Option<Moved> {
        let (stem, rest, released) = match name.split_once(QUARANTINE_MARK) {
            Some((stem, rest)) => (stem, rest, false),
            None => {
                let (stem, rest) = name.split_once(RELEASED_MARK)?;
                (stem, rest, true)
            }
        };
        let (stamp, boot) = match rest.split_once('.') {
            Some((stamp, boot)) => (stamp, Some(boot.to_owned())),
            None => (rest, None),
        };
        Some(Moved {
            name: name.to_owned(),
            path,
            stem: stem.to_owned(),
            stamp: stamp.parse().ok()?,
            boot,
            released,
        })
    }

    /// The claim of a moved-aside record, if its name names one.
    fn claim(&self) -> Option<ClaimUid> {
        let uid = self.stem.strip_suffix(RECORD_SUFFIX)?;
        ClaimUid::parse(uid).ok()
    }
}

/// The claims of the moved-aside files in `dir` (and a moved-aside
/// version 1 file in `state_dir`) of this boot, except those whose bytes
/// still say they are of another boot; and the files that say so.
fn find_lost<T: Entry>(
    dir: &Path,
    state_dir: &Path,
    boot_id: &str,
) -> (Lost<T>, std::collections::BTreeSet<PathBuf>) {
    let mut lost = Lost::default();
    let mut marking = std::collections::BTreeSet::new();
    let of_this_boot = |m: &Moved| !m.released && m.boot.as_deref().is_none_or(|b| b == boot_id);
    for moved in moved_files(state_dir) {
        lost.unnamed |= moved.stem == LEGACY_FILE && of_this_boot(&moved);
    }
    for moved in moved_files(dir).into_iter().filter(of_this_boot) {
        let Some(claim) = moved.claim() else {
            lost.unnamed = true;
            marking.insert(moved.path);
            continue;
        };
        let bytes = fs::read(&moved.path).unwrap_or_else(|e| {
            tracing::warn!(
                "cannot read the moved-aside record {}: {e}; its claim is lost with nothing salvaged",
                moved.path.display()
            );
            Vec::new()
        });
        match salvage::<T>(&bytes, boot_id) {
            Salvage::OtherBoot => continue,
            Salvage::Whole(entry) => {
                lost.claims.insert(claim, Some(entry));
            }
            Salvage::InPart(entry) => {
                lost.claims.insert(claim.clone(), entry);
                lost.in_part.insert(claim);
            }
        }
        marking.insert(moved.path);
    }
    (lost, marking)
}

/// What can still be read from a moved-aside record.
enum Salvage<T> {
    /// Its own bytes say it is of another boot: nothing it names exists.
    OtherBoot,
    /// The entry decodes (its checksum is not trusted).
    Whole(T),
    /// Only parts of it decode ([`Entry::salvage`]), or nothing.
    InPart(Option<T>),
}

fn salvage<T: Entry>(bytes: &[u8], boot_id: &str) -> Salvage<T> {
    let Ok(record) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return Salvage::InPart(None);
    };
    if record["bootId"].as_str().is_some_and(|b| b != boot_id) {
        return Salvage::OtherBoot;
    }
    let Some(text) = record["entry"].as_str() else {
        return Salvage::InPart(None);
    };
    if let Ok(entry) = serde_json::from_str::<T>(text) {
        return Salvage::Whole(entry);
    }
    let parts = serde_json::from_str::<serde_json::Value>(text).ok();
    Salvage::InPart(parts.as_ref().and_then(T::salvage))
}

/// Moved-aside files in `dir`, oldest first.
fn moved_files(dir: &Path) -> Vec<Moved> {
    let Ok(listing) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<Moved> = listing
        .filter_map(Result::ok)
        .filter_map(|e| Moved::parse(e.file_name().to_str()?, e.path()))
        .collect();
    files.sort_by(|a, b| (a.stamp, &a.name).cmp(&(b.stamp, &b.name)));
    files
}

/// Removes all but the newest `keep` moved-aside records of those that no
/// longer say a claim is lost (`marking` are those that do).
fn prune_quarantined(dir: &Path, keep: usize, marking: &std::collections::BTreeSet<PathBuf>) {
    let files: Vec<Moved> = (moved_files(dir).into_iter())
        .filter(|m| !marking.contains(&m.path))
        .collect();
    let excess = files.len().saturating_sub(keep);
    for moved in files.into_iter().take(excess) {
        if let Err(e) = remove_if_present(&moved.path) {
            tracing::warn!(
                "cannot remove the old moved-aside record {}: {e}",
                moved.path.display()
            );
        }
    }
}

/// Moves an unreadable file aside for inspection, naming the boot it was
/// found in; where it went.
fn quarantine(path: &Path, boot_id: &str) -> Result<PathBuf, CheckpointError> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let mut moved_to = path.as_os_str().to_owned();
    moved_to.push(format!("{QUARANTINE_MARK}{stamp}.{boot_id}"));
    let moved_to = PathBuf::from(moved_to);
    fs::rename(path, &moved_to).map_err(|source| CheckpointError::Quarantine {
        path: path.to_owned(),
        source,
    })?;
    Ok(moved_to)
}

fn encode_record<T: Serialize>(boot_id: &str, entry: &T) -> Vec<u8> {
    // Serializing plain data structs into JSON cannot fail.
    let entry = serde_json::to_string(entry).expect("checkpoint entries serialize");
    let record = Record {
        version: FORMAT_VERSION,
        boot_id: boot_id.to_owned(),
        crc32: crc32fast::hash(entry.as_bytes()),
        entry,
    };
    serde_json::to_vec(&record).expect("checkpoint record serializes")
}

/// Checks a version and a checksum; `Err` carries a human-readable reason.
fn verify(version: u32, expected: u32, crc32: u32, text: &str) -> Result<(), String> {
    if version != expected {
        return Err(format!(
            "checkpoint version {version} is not supported here (expected version {expected})"
        ));
    }
    let actual = crc32fast::hash(text.as_bytes());
    if actual != crc32 {
        return Err(format!(
            "checksum mismatch: recorded {crc32:08x}, computed {actual:08x}"
        ));
    }
    Ok(())
}

/// Why a record was not read.
#[derive(Debug)]
enum RecordError {
    /// Reading the file failed (EIO, EMFILE, ...): its bytes may be fine.
    Io(std::io::Error),
    /// The bytes are not a valid record; the reason.
    Invalid(String),
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::Io(e) => write!(f, "cannot read it: {e}"),
            RecordError::Invalid(why) => f.write_str(why),
        }
    }
}

/// One record as read.
struct ReadRecord<T> {
    claim: ClaimUid,
    boot: String,
    entry: T,
    /// Fields of the entry this version does not know.
    unknown: Vec<String>,
}

/// Reads the record file `path` named `<stem>.json`: its claim (the file
/// name), boot and entry.
fn read_record<T: DeserializeOwned + Serialize>(
    stem: &str,
    path: &Path,
) -> Result<ReadRecord<T>, RecordError> {
    let claim = ClaimUid::parse(stem).map_err(|e| RecordError::Invalid(e.to_string()))?;
    let bytes = read_retrying(path).map_err(RecordError::Io)?;
    let (boot, entry, unknown) = decode_known(&bytes).map_err(RecordError::Invalid)?;
    Ok(ReadRecord {
        claim,
        boot,
        entry,
        unknown,
    })
}

/// Reads a file, trying again after a failure that may pass (a process
/// out of file descriptors, an interrupted or timed-out device read).
fn read_retrying(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut attempt = 1;
    loop {
        match read_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound && attempt < READ_ATTEMPTS => {
                tracing::warn!("reading {} failed (attempt {attempt}): {e}", path.display());
                std::thread::sleep(std::time::Duration::from_millis(20 << attempt));
                attempt += 1;
            }
            read => return read,
        }
    }
}

#[cfg(not(test))]
fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    fs::read(path)
}

#[cfg(test)]
thread_local! {
    /// Errors the next reads of records on this thread fail with, in order.
    static READ_FAULTS: std::cell::RefCell<std::collections::VecDeque<i32>> =
        Default::default();
}

#[cfg(test)]
fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    match READ_FAULTS.with(|f| f.borrow_mut().pop_front()) {
        Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
        None => fs::read(path),
    }
}

/// Decodes one claim's record: its boot and entry.
pub(crate) fn decode_record<T: DeserializeOwned + Serialize>(
    bytes: &[u8],
) -> Result<(String, T), String> {
    decode_known(bytes).map(|(boot, entry, _)| (boot, entry))
}

/// Decodes one claim's record: its boot, its entry, and the fields of the
/// entry this version does not know (ignored by the decode).
fn decode_known<T: DeserializeOwned + Serialize>(
    bytes: &[u8],
) -> Result<(String, T, Vec<String>), String> {
    let record: Record =
        serde_json::from_slice(bytes).map_err(|e| format!("not a checkpoint record: {e}"))?;
    verify(record.version, FORMAT_VERSION, record.crc32, &record.entry)?;
    let written: serde_json::Value = serde_json::from_str(&record.entry)
        .map_err(|e| format!("checkpoint entry does not decode: {e}"))?;
    let entry: T = serde_json::from_value(written.clone())
        .map_err(|e| format!("checkpoint entry does not decode: {e}"))?;
    let known = serde_json::to_value(&entry).unwrap_or_default();
    let mut unknown = Vec::new();
    unknown_fields(&written, &known, "entry", &mut unknown);
    Ok((record.boot_id, entry, unknown))
}

/// Paths of what `written` has and `known` (the same entry as this version
/// decoded it and would write it) lacks: fields, or list items, a newer
/// version added. Empty values are what this version leaves out itself.
fn unknown_fields(
    written: &serde_json::Value,
    known: &serde_json::Value,
    path: &str,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    match (written, known) {
        (Value::Object(w), Value::Object(k)) => {
            for (key, value) in w {
                let here = format!("{path}.{key}");
                match k.get(key) {
                    Some(known) => unknown_fields(value, known, &here, out),
                    None if is_empty(value) => {}
                    None => out.push(here),
                }
            }
        }
        (Value::Array(w), Value::Array(k)) if w.len() == k.len() => {
            for (i, (value, known)) in w.iter().zip(k).enumerate() {
                unknown_fields(value, known, &format!("{path}[{i}]"), out);
            }
        }
        (Value::Array(w), Value::Array(k)) => out.push(format!(
            "{path} ({} of {} items)",
            w.len().saturating_sub(k.len()),
            w.len()
        )),
        (Value::Array(w), _) if !w.is_empty() => out.push(path.to_owned()),
        (Value::Object(w), _) if !w.is_empty() => out.push(path.to_owned()),
        _ => {}
    }
}

fn is_empty(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Null => true,
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// Decodes a version 1 file: its boot and every claim's entry.
pub(crate) fn decode_legacy<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<(String, BTreeMap<ClaimUid, T>), String> {
    let envelope: LegacyEnvelope =
        serde_json::from_slice(bytes).map_err(|e| format!("not a checkpoint envelope: {e}"))?;
    verify(
        envelope.version,
        LEGACY_VERSION,
        envelope.crc32,
        &envelope.claims,
    )?;
    let claims = serde_json::from_str(&envelope.claims)
        .map_err(|e| format!("checkpoint entries do not decode: {e}"))?;
    Ok((envelope.boot_id, claims))
}

/// The records as found on disk, read without the state lock and without
/// changing anything (`tessera status` beside a running node process; the
/// node process replaces a record by rename, so a read sees one whole
/// version of each).
#[derive(Debug, Clone)]
pub struct Snapshot<T> {
    /// Entries of the boot asked for (of any boot when none was given).
    pub claims: BTreeMap<ClaimUid, T>,
    /// Records of other boots, not listed (a node process removes them at
    /// its next start).
    pub other_boots: usize,
    /// Records that could not be read, each with the reason.
    pub unreadable: Vec<String>,
}

/// Reads the records under `state_dir` (and a version 1 file not yet
/// migrated), keeping those of boot `boot_id` (all when `None`).
pub fn read_snapshot<T: DeserializeOwned + Serialize>(
    state_dir: &Path,
    boot_id: Option<&str>,
) -> Result<Snapshot<T>, String> {
    let mut read: Vec<(String, ClaimUid, T)> = Vec::new();
    let mut unreadable = Vec::new();
    let legacy = state_dir.join(LEGACY_FILE);
    match fs::read(&legacy) {
        Ok(bytes) => match decode_legacy::<T>(&bytes) {
            Ok((boot, claims)) => {
                read.extend(claims.into_iter().map(|(c, e)| (boot.clone(), c, e)));
            }
            Err(why) => unreadable.push(format!("{}: {why}", legacy.display())),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot read {}: {e}", legacy.display())),
    }
    for (stem, path) in record_files(&state_dir.join(RECORDS_DIR))? {
        match read_record::<T>(&stem, &path) {
            Ok(r) => read.push((r.boot, r.claim, r.entry)),
            // Removed by the node process between listing and reading.
            Err(_) if !path.exists() => {}
            Err(why) => unreadable.push(format!("{}: {why}", path.display())),
        }
    }
    let (mine, other): (Vec<_>, Vec<_>) = read
        .into_iter()
        .partition(|(boot, _, _)| boot_id.is_none_or(|b| b == boot));
    Ok(Snapshot {
        claims: mine.into_iter().map(|(_, c, e)| (c, e)).collect(),
        other_boots: other.len(),
        unreadable,
    })
}

/// The record files in `dir` (no temp files, nothing moved aside): each
/// file's name without the suffix, and its path.
fn record_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let listing = match fs::read_dir(dir) {
        Ok(listing) => listing,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot list {}: {e}", dir.display())),
    };
    let mut files = Vec::new();
    for file in listing {
        let path = file
            .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if let Some(stem) = name.strip_suffix(RECORD_SUFFIX)
            && !name.starts_with('.')
        {
            files.push((stem.to_owned(), path));
        }
    }
    Ok(files)
}

/// Fuzzing entry point: decoding arbitrary bytes, as a record or as a
/// version 1 file, must never panic.
#[doc(hidden)]
pub fn fuzz_decode(bytes: &[u8]) {
    let _ = decode_record::<serde_json::Value>(bytes);
    let _ = decode_legacy::<serde_json::Value>(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Entry {
        device: String,
    }

    impl super::Entry for Entry {}

    struct Fixture {
        dir: tempfile::TempDir,
        boot: PathBuf,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let boot = dir.path().join("boot_id");
            fs::write(&boot, "boot-a\n").unwrap();
            Fixture { dir, boot }
        }
        fn state(&self) -> PathBuf {
            self.dir.path().join("state")
        }
        fn open(&self) -> (Checkpoint<Entry>, LoadOutcome) {
            Checkpoint::open(&self.state(), &self.boot).unwrap()
        }
        fn record(&self, claim: &ClaimUid) -> PathBuf {
            self.state()
                .join(RECORDS_DIR)
                .join(format!("{}.json", claim.as_str()))
        }
        /// Records claims 1 (`gpu-0`) and 2 (`gpu-1`), then flips one byte
        /// inside the first's embedded entry (valid JSON, bad checksum, the
        /// entry still decodes as `gpu-9`); the first's record path.
        fn two_claims_first_flipped(&self) -> PathBuf {
            let (cp, _) = self.open();
            cp.put(uid(1), entry("gpu-0")).unwrap();
            cp.put(uid(2), entry("gpu-1")).unwrap();
            let path = self.record(&uid(1));
            let text = fs::read_to_string(&path).unwrap().replace("gpu-0", "gpu-9");
            fs::write(&path, text).unwrap();
            path
        }
    }

    fn entry(device: &str) -> Entry {
        Entry {
            device: device.into(),
        }
    }

    fn uid(n: u8) -> ClaimUid {
        ClaimUid::parse(&format!("{n:08x}-0000-4000-8000-000000000000")).unwrap()
    }

    #[test]
    fn entries_survive_restart_in_same_boot() {
        let f = Fixture::new();
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Fresh);
        cp.put(uid(1), entry("gpu-0")).unwrap();
        cp.put(uid(2), entry("gpu-1")).unwrap();
        cp.remove(&uid(2)).unwrap();
        assert!(!f.record(&uid(2)).exists(), "unprepare leaves no record");
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
        assert_eq!(cp.lock()[&uid(1)].device, "gpu-0");
        assert!(!cp.lock().contains_key(&uid(2)));
    }

    #[test]
    fn a_change_writes_only_its_claims_record() {
        let f = Fixture::new();
        let (cp, _) = f.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        let first = fs::read(f.record(&uid(1))).unwrap();
        for n in 2..50 {
            cp.put(uid(n), entry(&format!("gpu-{n}"))).unwrap();
        }
        // The record of claim 1 is as written, whatever came after.
        assert_eq!(fs::read(f.record(&uid(1))).unwrap(), first);
        assert!(first.len() < 200, "{} bytes", first.len());
    }

    #[test]
    fn concurrent_changes_are_all_on_disk_when_acknowledged() {
        let f = Fixture::new();
        let shared = std::sync::Arc::new(f.open().0);
        let threads: Vec<_> = (0..32u8)
            .map(|n| {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    shared.put(uid(n), entry(&format!("gpu-{n}"))).unwrap();
                    if n % 2 == 1 {
                        assert!(shared.remove(&uid(n)).unwrap().is_some());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 16 });
        for n in 0..32u8 {
            assert_eq!(cp.lock().contains_key(&uid(n)), n % 2 == 0, "claim {n}");
        }
        assert_eq!(shared.remove(&uid(1)).unwrap(), None);
    }

    #[test]
    fn a_failed_write_undoes_the_change_in_memory() {
        let f = Fixture::new();
        let (cp, _) = f.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        // The records directory becomes a file: every write fails.
        let records = f.state().join(RECORDS_DIR);
        fs::remove_dir_all(&records).unwrap();
        fs::write(&records, "").unwrap();
        assert!(matches!(
            cp.put(uid(2), entry("gpu-1")),
            Err(CheckpointError::Write { .. })
        ));
        assert!(matches!(
            cp.put(uid(1), entry("gpu-7")),
            Err(CheckpointError::Write { .. })
        ));
        assert!(cp.remove(&uid(1)).is_err());
        let claims = cp.lock();
        assert!(
            !claims.contains_key(&uid(2)),
            "a change that failed to persist stays"
        );
        assert_eq!(claims[&uid(1)].device, "gpu-0");
    }

    #[test]
    fn a_staged_entry_is_seen_at_once_and_written_with_the_claim() {
        let f = Fixture::new();
        let (cp, _) = f.open();
        cp.stage(uid(1), entry("held"));
        assert_eq!(cp.lock()[&uid(1)].device, "held");
        assert!(!f.record(&uid(1)).exists());
        cp.put(uid(1), entry("done")).unwrap();
        assert_eq!(f.open().0.lock()[&uid(1)].device, "done");
    }

    #[test]
    fn reboot_discards_entries() {
        let f = Fixture::new();
        let (cp, _) = f.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        fs::write(&f.boot, "boot-b\n").unwrap();
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::PreviousBoot { claims: 1 });
        assert!(cp.lock().is_empty());
        assert!(!f.record(&uid(1)).exists());
        // A complete account: no claim of this boot is lost.
        let lost = cp.lost();
        assert!(lost.claims.is_empty() && !lost.unnamed);
        assert_eq!(f.open().1, LoadOutcome::Fresh);
    }

    #[test]
    fn corruption_is_quarantined_not_fatal() {
        let f = Fixture::new();
        let path = f.two_claims_first_flipped();
        let (cp, outcome) = f.open();
        let LoadOutcome::Quarantined {
            reason,
            moved_to,
            restored,
        } = &outcome
        else {
            panic!("expected quarantine, got {outcome:?}");
        };
        assert!(reason.contains("checksum mismatch"), "{reason}");
        assert!(reason.contains(uid(1).as_str()), "{reason}");
        assert_eq!(moved_to.len(), 1);
        assert!(moved_to[0].exists());
        assert!(!path.exists());
        assert_eq!(*restored, 1, "the other claim's record is intact");
        assert_eq!(cp.lock().keys().collect::<Vec<_>>(), [&uid(2)]);
        // Not a complete account: the claim of the moved-aside record may
        // still be prepared.
        assert!(cp.lost().may_hold(&uid(1)));
        // Moved aside for good: the next start finds only the intact one.
        assert_eq!(f.open().1, LoadOutcome::Restored { claims: 1 });
    }

    #[test]
    fn a_lost_claim_stays_lost_across_restarts_until_released() {
        let f = Fixture::new();
        f.two_claims_first_flipped();
        let (cp, _) = f.open();
        let lost = cp.lost();
        assert!(!lost.unnamed);
        // Salvaged as the bytes say, checksum or not: a hint of what to
        // release, never a record.
        assert_eq!(lost.claims[&uid(1)], Some(entry("gpu-9")));
        assert!(lost.may_hold(&uid(1)) && !lost.may_hold(&uid(2)));
        assert!(!cp.lock().contains_key(&uid(1)));

        // The next start (same boot) still knows it is lost.
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
        assert!(cp.lost().may_hold(&uid(1)));
        assert_eq!(
            cp.release_lost(&uid(1)).unwrap(),
            Some(Some(entry("gpu-9")))
        );
        assert!(!cp.lost().may_hold(&uid(1)));
        assert_eq!(cp.release_lost(&uid(1)).unwrap(), None);
    }

    #[test]
    fn lost_records_of_another_boot_or_without_a_name_are_told_apart() {
        let f = Fixture::new();
        let records = f.state().join(RECORDS_DIR);
        fs::create_dir_all(&records).unwrap();
        let foreign = r#"{"version":2,"bootId":"boot-z","crc32":1,"entry":"{}"}"#;
        fs::write(records.join(format!("{}.json", uid(1).as_str())), foreign).unwrap();
        fs::write(
            records.join(format!("{}.json", uid(2).as_str())),
            b"{\"vers",
        )
        .unwrap();
        let (cp, _) = f.open();
        let lost = cp.lost();
        // Its own bytes say it is of another boot: nothing it named exists.
        assert!(!lost.may_hold(&uid(1)));
        // Unreadable: lost, with nothing salvaged.
        assert_eq!(lost.claims.get(&uid(2)), Some(&None));
        assert!(!lost.unnamed);
        fs::write(records.join("not-a-uid.json"), b"{}").unwrap();
        assert!(f.open().0.lost().unnamed);
    }

    /// A moved-aside record's name, as start-up gives it in `boot`.
    fn moved_name(claim: &ClaimUid, stamp: u64, boot: &str) -> String {
        format!("{}.json{QUARANTINE_MARK}{stamp}.{boot}", claim.as_str())
    }

    #[test]
    fn moved_aside_records_that_mark_no_lost_claim_are_pruned_to_the_newest() {
        let f = Fixture::new();
        let records = f.state().join(RECORDS_DIR);
        fs::create_dir_all(&records).unwrap();
        let total = QUARANTINE_KEPT + 5;
        // Of an earlier boot: nothing they name exists.
        for n in 0..total {
            let name = moved_name(&uid(1), 1000 + n as u64, "boot-old");
            fs::write(records.join(name), b"x").unwrap();
        }
        f.open();
        let left = moved_files(&records);
        assert_eq!(left.len(), QUARANTINE_KEPT);
        assert_eq!(left[0].stamp, 1005, "the oldest go first");
    }

    #[test]
    fn seventy_moved_aside_records_are_seventy_lost_claims_across_restarts() {
        let f = Fixture::new();
        let records = f.state().join(RECORDS_DIR);
        fs::create_dir_all(&records).unwrap();
        for n in 0..70u8 {
            fs::write(
                f.record(&uid(n)),
                b"{\"version\":2,\"bootId\":\"boot-a\",\"crc",
            )
            .unwrap();
        }
        let (cp, outcome) = f.open();
        assert!(
            matches!(outcome, LoadOutcome::Quarantined { .. }),
            "{outcome:?}"
        );
        assert_eq!(cp.lost().claims.len(), 70);
        let (cp, _) = f.open();
        assert_eq!(cp.lost().claims.len(), 70, "none pruned at the next start");
        assert_eq!(moved_files(&records).len(), 70);
    }

    #[test]
    fn seventy_records_with_a_newer_field_are_kept_with_what_is_known() {
        let f = Fixture::new();
        let (cp, _) = f.open();
        for n in 0..70u8 {
            cp.put(uid(n), entry(&format!("gpu-{n}"))).unwrap();
        }
        drop(cp);
        // What a newer version writes: the same version, one more field.
        for n in 0..70u8 {
            let text = format!(r#"{{"device":"gpu-{n}","partition":{{"slices":2}}}}"#);
            let record = serde_json::json!({
                "version": FORMAT_VERSION,
                "bootId": "boot-a",
                "crc32": crc32fast::hash(text.as_bytes()),
                "entry": text,
            });
            fs::write(f.record(&uid(n)), record.to_string()).unwrap();
        }
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 70 });
        assert_eq!(cp.lock()[&uid(7)], entry("gpu-7"));
        let lost = cp.lost();
        assert!(lost.claims.is_empty() && !lost.unnamed);
        let newer = cp.with_unknown_fields();
        assert_eq!(newer.len(), 70);
        assert_eq!(newer[&uid(7)], ["entry.partition"]);
        assert!(cp.remove(&uid(7)).unwrap().is_some());
        assert_eq!(cp.unknown_fields(&uid(7)), None);
    }

    #[test]
    fn a_record_that_cannot_be_read_is_retried_and_never_lost() {
        let f = Fixture::new();
        let (cp, _) = f.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        drop(cp);
        let fail_next = |errnos: &[i32]| READ_FAULTS.with(|q| q.borrow_mut().extend(errnos));

        // Out of file descriptors once: read again.
        fail_next(&[libc::EMFILE]);
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
        assert!(cp.lost().claims.is_empty());
        drop(cp);

        // The disk keeps failing: start-up fails, the record stays as it is.
        fail_next(&[libc::EIO; READ_ATTEMPTS as usize]);
        let err = Checkpoint::<Entry>::open(&f.state(), &f.boot).unwrap_err();
        assert!(matches!(err, CheckpointError::Read { .. }), "{err}");
        assert!(err.to_string().contains(uid(1).as_str()), "{err}");
        assert!(f.record(&uid(1)).exists());
        assert!(moved_files(&f.state().join(RECORDS_DIR)).is_empty());

        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
        assert!(!cp.lost().may_hold(&uid(1)));
    }

    #[test]
    fn a_released_lost_claim_stays_released_after_a_restart() {
        let f = Fixture::new();
        f.two_claims_first_flipped();
        let (cp, _) = f.open();
        assert_eq!(
            cp.release_lost(&uid(1)).unwrap(),
            Some(Some(entry("gpu-9")))
        );
        let (cp, _) = f.open();
        assert!(!cp.lost().may_hold(&uid(1)), "released for this boot");
        // Still there for inspection.
        let moved = moved_files(&f.state().join(RECORDS_DIR));
        assert!(moved.len() == 1 && moved[0].released, "{:?}", moved[0].name);
    }

    #[test]
    fn a_record_moved_aside_in_an_earlier_boot_marks_no_claim_lost() {
        let f = Fixture::new();
        let records = f.state().join(RECORDS_DIR);
        fs::create_dir_all(&records).unwrap();
        // Unreadable bytes: only the name tells the boot.
        fs::write(records.join(moved_name(&uid(1), 5, "boot-old")), b"\xff").unwrap();
        fs::write(records.join(moved_name(&uid(2), 5, "boot-a")), b"\xff").unwrap();
        let lost = f.open().0.lost();
        assert!(!lost.may_hold(&uid(1)));
        assert_eq!(lost.claims.get(&uid(2)), Some(&None));
        assert!(lost.in_part.contains(&uid(2)));
    }

    #[test]
    fn truncated_foreign_and_misnamed_records_are_quarantined() {
        for (name, content) in [
            (
                format!("{}.json", uid(1).as_str()),
                &b"{\"version\":2,\"bootId\":\"boot-a\",\"crc"[..],
            ),
            (
                format!("{}.json", uid(1).as_str()),
                b"{\"version\":7,\"bootId\":\"boot-a\",\"crc32\":0,\"entry\":\"{}\"}",
            ),
            (format!("{}.json", uid(1).as_str()), b"\xff\xfe"),
            ("not-a-uid.json".to_owned(), b"{}"),
        ] {
            let f = Fixture::new();
            let records = f.state().join(RECORDS_DIR);
            fs::create_dir_all(&records).unwrap();
            fs::write(records.join(&name), content).unwrap();
            let (_, outcome) = f.open();
            assert!(
                matches!(outcome, LoadOutcome::Quarantined { .. }),
                "{name}: {outcome:?}"
            );
        }
    }

    #[test]
    fn a_version_1_file_is_split_into_records() {
        let f = Fixture::new();
        let claims = BTreeMap::from([(uid(1), entry("gpu-0")), (uid(2), entry("gpu-1"))]);
        let text = serde_json::to_string(&claims).unwrap();
        let legacy = serde_json::json!({
            "version": 1,
            "bootId": "boot-a",
            "crc32": crc32fast::hash(text.as_bytes()),
            "claims": text,
        });
        fs::create_dir_all(f.state()).unwrap();
        fs::write(f.state().join(LEGACY_FILE), legacy.to_string()).unwrap();
        let snapshot = read_snapshot::<Entry>(&f.state(), Some("boot-a")).unwrap();
        assert_eq!(
            snapshot.claims, claims,
            "status reads a file not yet migrated"
        );

        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 2 });
        assert_eq!(*cp.lock(), claims);
        assert!(!f.state().join(LEGACY_FILE).exists());
        assert!(f.record(&uid(2)).exists());
        assert_eq!(*f.open().0.lock(), claims);
    }

    #[test]
    fn a_snapshot_keeps_the_boot_asked_for() {
        let f = Fixture::new();
        let (cp, _) = f.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        let records = f.state().join(RECORDS_DIR);
        fs::write(
            records.join(format!("{}.json", uid(3).as_str())),
            "nonsense",
        )
        .unwrap();
        fs::write(records.join(".x.json.tmp-1"), "half").unwrap();
        let mine = read_snapshot::<Entry>(&f.state(), Some("boot-a")).unwrap();
        assert_eq!(mine.claims.keys().collect::<Vec<_>>(), [&uid(1)]);
        assert_eq!(mine.unreadable.len(), 1, "{:?}", mine.unreadable);
        let other = read_snapshot::<Entry>(&f.state(), Some("boot-b")).unwrap();
        assert!(other.claims.is_empty());
        assert_eq!(other.other_boots, 1);
        let none = read_snapshot::<Entry>(&f.dir.path().join("nowhere"), None).unwrap();
        assert!(none.claims.is_empty() && none.unreadable.is_empty());
    }

    #[test]
    fn legacy_entries_with_crafted_uids_are_rejected() {
        let claims = r#"{"../../etc/passwd":{"device":"gpu-0"}}"#;
        let envelope = format!(
            r#"{{"version":1,"bootId":"boot-a","crc32":{},"claims":{}}}"#,
            crc32fast::hash(claims.as_bytes()),
            serde_json::to_string(claims).unwrap()
        );
        let err = decode_legacy::<Entry>(envelope.as_bytes()).unwrap_err();
        assert!(err.contains("not a Kubernetes UID"), "{err}");
    }

    #[test]
    fn decoder_never_panics_on_noise() {
        // Deterministic xorshift noise plus mutations of a valid record.
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let valid = encode_record("b", &entry("gpu-0"));
        for _ in 0..2000 {
            let mut bytes = valid.clone();
            for _ in 0..(next() % 4 + 1) {
                let i = (next() as usize) % bytes.len();
                bytes[i] = next() as u8;
            }
            fuzz_decode(&bytes);
            let noise: Vec<u8> = (0..next() % 64).map(|_| next() as u8).collect();
            fuzz_decode(&noise);
        }
    }
}
