//! The node-local record of prepared claims.
//!
//! The kubelet may call prepare again after a plugin restart and expects the
//! same answer; unprepare must undo exactly what prepare did. Both need to know
//! what was prepared before the process died, so every change is persisted
//! before it is acknowledged.
//!
//! File format (one JSON object):
//! `{"version":1,"bootId":"…","crc32":N,"claims":"<JSON text of the entries>"}`.
//! The entries are embedded as text so the checksum covers exactly the bytes
//! that were written, independent of JSON formatting.
//!
//! * Versioned: an unknown version is treated like corruption, never guessed at.
//! * Checksummed: a torn or bit-flipped file is detected, moved aside and
//!   reported; the daemon starts empty instead of crash-looping.
//! * Boot-scoped: CDI specs live on tmpfs and MIG instances and MPS daemons do
//!   not survive a reboot, so a checkpoint from another boot describes nothing
//!   that still exists and is discarded.
//! * Atomic, for this boot: written to a temp file and renamed over, without
//!   fsync (see [`crate::cdi::write_for_this_boot`]: a killed process loses
//!   nothing, and what the file describes ends with the boot anyway).
//! * Group-committed when shared ([`SharedCheckpoint`]): claims prepared
//!   at the same time wait for one write that holds all their changes,
//!   instead of queueing one fsync each behind a lock.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::cdi::write_for_this_boot;
use crate::claim_uid::ClaimUid;

const FORMAT_VERSION: u32 = 1;
const FILE_NAME: &str = "checkpoint.json";

/// Where the kernel publishes the current boot's random id.
pub const KERNEL_BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Envelope {
    version: u32,
    boot_id: String,
    crc32: u32,
    claims: String,
}

/// How the checkpoint was found at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadOutcome {
    /// No checkpoint yet (first start on this node).
    Fresh,
    /// Entries restored from this boot.
    Restored { claims: usize },
    /// Written in an earlier boot; nothing it describes survives a reboot.
    PreviousBoot { claims: usize },
    /// Unreadable: moved aside to `moved_to`; the daemon starts empty.
    Quarantined { reason: String, moved_to: PathBuf },
}

impl LoadOutcome {
    /// Whether the entries are a complete account of what this driver has
    /// prepared, so CDI specs not in it are leftovers that may be deleted.
    /// After quarantine they are not: a running pod's spec may be among them.
    pub fn knows_all_prepared_claims(&self) -> bool {
        !matches!(self, LoadOutcome::Quarantined { .. })
    }
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

/// Persistent map of claim UID -> entry `T` (defined by the prepare logic).
#[derive(Debug)]
pub struct Checkpoint<T> {
    path: PathBuf,
    boot_id: String,
    claims: BTreeMap<ClaimUid, T>,
    /// Counts changes in memory (see [`SharedCheckpoint`]).
    generation: u64,
}

impl<T: Serialize + DeserializeOwned + Clone> Checkpoint<T> {
    /// Open the checkpoint in `dir` for the boot identified by the contents of
    /// `boot_id_file` (normally [`KERNEL_BOOT_ID`]).
    pub fn open(dir: &Path, boot_id_file: &Path) -> Result<(Self, LoadOutcome), CheckpointError> {
        let boot_id = fs::read_to_string(boot_id_file)
            .map_err(|source| CheckpointError::BootId {
                path: boot_id_file.to_owned(),
                source,
            })?
            .trim()
            .to_owned();
        let path = dir.join(FILE_NAME);
        let mut checkpoint = Checkpoint {
            path,
            boot_id,
            claims: BTreeMap::new(),
            generation: 0,
        };
        let outcome = checkpoint.load()?;
        Ok((checkpoint, outcome))
    }

    fn load(&mut self) -> Result<LoadOutcome, CheckpointError> {
        let bytes = match fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(LoadOutcome::Fresh),
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        match decode::<T>(&bytes) {
            Ok((boot_id, claims)) if boot_id == self.boot_id => {
                let count = claims.len();
                self.claims = claims;
                Ok(LoadOutcome::Restored { claims: count })
            }
            Ok((_, claims)) => Ok(LoadOutcome::PreviousBoot {
                claims: claims.len(),
            }),
            Err(reason) => {
                let moved_to = self.quarantine()?;
                Ok(LoadOutcome::Quarantined { reason, moved_to })
            }
        }
    }

    fn quarantine(&self) -> Result<PathBuf, CheckpointError> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let moved_to = self.path.with_extension(format!("json.corrupt-{stamp}"));
        fs::rename(&self.path, &moved_to).map_err(|source| CheckpointError::Quarantine {
            path: self.path.clone(),
            source,
        })?;
        Ok(moved_to)
    }

    pub fn get(&self, claim: &ClaimUid) -> Option<&T> {
        self.claims.get(claim)
    }

    pub fn contains(&self, claim: &ClaimUid) -> bool {
        self.claims.contains_key(claim)
    }

    pub fn entries(&self) -> impl Iterator<Item = (&ClaimUid, &T)> {
        self.claims.iter()
    }

    pub fn len(&self) -> usize {
        self.claims.len()
    }

    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }

    /// Record `entry` for `claim` and persist before returning. On a write
    /// failure the in-memory state is left as it was, so memory never claims
    /// more than the disk does.
    pub fn put(&mut self, claim: ClaimUid, entry: T) -> Result<(), CheckpointError> {
        let previous = self.claims.insert(claim.clone(), entry);
        self.persist().inspect_err(|_| match previous {
            Some(old) => {
                self.claims.insert(claim, old);
            }
            None => {
                self.claims.remove(&claim);
            }
        })
    }

    /// Forget `claim` and persist; forgetting an unknown claim is a no-op.
    pub fn remove(&mut self, claim: &ClaimUid) -> Result<Option<T>, CheckpointError> {
        let Some(old) = self.claims.remove(claim) else {
            return Ok(None);
        };
        match self.persist() {
            Ok(()) => Ok(Some(old)),
            Err(e) => {
                self.claims.insert(claim.clone(), old);
                Err(e)
            }
        }
    }

    /// Write the current state (also used after start to drop a previous
    /// boot's file).
    pub fn persist(&self) -> Result<(), CheckpointError> {
        write_file(&self.path, &encode(&self.boot_id, &self.claims))
    }

    /// Counts a change made in memory; its generation.
    fn changed(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let failed = |source| CheckpointError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(failed)?;
    }
    write_for_this_boot(path, bytes).map_err(failed)
}

fn encode<T: Serialize>(boot_id: &str, claims: &BTreeMap<ClaimUid, T>) -> Vec<u8> {
    // Serializing plain data structs into JSON cannot fail.
    let claims = serde_json::to_string(claims).expect("checkpoint entries serialize");
    let envelope = Envelope {
        version: FORMAT_VERSION,
        boot_id: boot_id.to_owned(),
        crc32: crc32fast::hash(claims.as_bytes()),
        claims,
    };
    serde_json::to_vec(&envelope).expect("checkpoint envelope serializes")
}

/// Decode a checkpoint file; `Err` carries a human-readable reason.
pub(crate) fn decode<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<(String, BTreeMap<ClaimUid, T>), String> {
    let envelope: Envelope =
        serde_json::from_slice(bytes).map_err(|e| format!("not a checkpoint envelope: {e}"))?;
    if envelope.version != FORMAT_VERSION {
        return Err(format!(
            "checkpoint version {} is not supported (this driver reads version {FORMAT_VERSION})",
            envelope.version
        ));
    }
    let actual = crc32fast::hash(envelope.claims.as_bytes());
    if actual != envelope.crc32 {
        return Err(format!(
            "checksum mismatch: recorded {:08x}, computed {actual:08x}",
            envelope.crc32
        ));
    }
    let claims = serde_json::from_str(&envelope.claims)
        .map_err(|e| format!("checkpoint entries do not decode: {e}"))?;
    Ok((envelope.boot_id, claims))
}

/// A [`Checkpoint`] shared by claims prepared concurrently.
///
/// A change is made in memory under a short lock, then made durable by
/// group commit: whoever holds the writer lock writes everything changed so
/// far, so the claims that queued behind it find their change already on
/// disk. A change is acknowledged only once a write that holds it succeeded;
/// a failed write undoes the change in memory before the writer lock is
/// released, so no later write can carry it to disk.
#[derive(Debug)]
pub struct SharedCheckpoint<T> {
    state: Mutex<Checkpoint<T>>,
    /// Generation of the state last written to disk.
    written: Mutex<u64>,
}

impl<T: Serialize + DeserializeOwned + Clone> SharedCheckpoint<T> {
    pub fn new(checkpoint: Checkpoint<T>) -> Self {
        SharedCheckpoint {
            state: Mutex::new(checkpoint),
            written: Mutex::new(0),
        }
    }

    /// The entries in memory, for reading (every acknowledged change, and
    /// changes being written).
    pub fn lock(&self) -> MutexGuard<'_, Checkpoint<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `entry` for `claim` and returns once it is on disk.
    pub fn put(&self, claim: ClaimUid, entry: T) -> Result<(), CheckpointError> {
        let (previous, generation) = {
            let mut cp = self.lock();
            let previous = cp.claims.insert(claim.clone(), entry);
            (previous, cp.changed())
        };
        self.commit(generation, || {
            let mut cp = self.lock();
            match previous {
                Some(old) => cp.claims.insert(claim, old),
                None => cp.claims.remove(&claim),
            };
            cp.changed();
        })
    }

    /// Records `entry` for `claim` in memory only: it reaches the disk with
    /// the next write of anyone's change. For a change whose loss in a crash
    /// is harmless but which other claims must see now.
    pub fn stage(&self, claim: ClaimUid, entry: T) {
        let mut cp = self.lock();
        cp.claims.insert(claim, entry);
        cp.changed();
    }

    /// Forgets `claim` and returns once that is on disk; forgetting an
    /// unknown claim is a no-op.
    pub fn remove(&self, claim: &ClaimUid) -> Result<Option<T>, CheckpointError> {
        let (old, generation) = {
            let mut cp = self.lock();
            let Some(old) = cp.claims.remove(claim) else {
                return Ok(None);
            };
            (old, cp.changed())
        };
        let undo = old.clone();
        self.commit(generation, || {
            let mut cp = self.lock();
            cp.claims.insert(claim.clone(), undo);
            cp.changed();
        })?;
        Ok(Some(old))
    }

    /// Makes generation `generation` durable, writing it (and whatever
    /// changed since) unless a write already did; `undo` runs under the
    /// writer lock when the write fails.
    fn commit(&self, generation: u64, undo: impl FnOnce()) -> Result<(), CheckpointError> {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        if *written >= generation {
            return Ok(());
        }
        let (bytes, snapshot, path) = {
            let cp = self.lock();
            (
                encode(&cp.boot_id, &cp.claims),
                cp.generation,
                cp.path.clone(),
            )
        };
        match write_file(&path, &bytes) {
            Ok(()) => {
                *written = snapshot;
                Ok(())
            }
            Err(e) => {
                undo();
                Err(e)
            }
        }
    }
}

/// A checkpoint as found on disk, read without the state lock and without
/// changing anything (`tessera status` beside a running node process; the
/// node process replaces the file by rename, so a read sees one whole
/// version).
#[derive(Debug, Clone)]
pub struct Snapshot<T> {
    /// The boot the file was written in.
    pub boot_id: String,
    pub claims: BTreeMap<ClaimUid, T>,
}

/// Reads the checkpoint in `dir`: `Ok(None)` when there is none; `Err` with
/// a reason when it cannot be read or decoded.
pub fn read_snapshot<T: DeserializeOwned>(dir: &Path) -> Result<Option<Snapshot<T>>, String> {
    let path = dir.join(FILE_NAME);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let (boot_id, claims) = decode(&bytes).map_err(|why| format!("{}: {why}", path.display()))?;
    Ok(Some(Snapshot { boot_id, claims }))
}

/// Fuzzing entry point: decoding arbitrary bytes must never panic.
#[doc(hidden)]
pub fn fuzz_decode(bytes: &[u8]) {
    let _ = decode::<serde_json::Value>(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Entry {
        device: String,
    }

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
        fn open(&self) -> (Checkpoint<Entry>, LoadOutcome) {
            Checkpoint::open(&self.dir.path().join("state"), &self.boot).unwrap()
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
        let (mut cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Fresh);
        cp.put(uid(1), entry("gpu-0")).unwrap();
        cp.put(uid(2), entry("gpu-1")).unwrap();
        cp.remove(&uid(2)).unwrap();
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
        assert_eq!(cp.get(&uid(1)).unwrap().device, "gpu-0");
        assert!(!cp.contains(&uid(2)));
    }

    #[test]
    fn concurrent_changes_are_all_on_disk_when_acknowledged() {
        let f = Fixture::new();
        let shared = std::sync::Arc::new(SharedCheckpoint::new(f.open().0));
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
            assert_eq!(cp.contains(&uid(n)), n % 2 == 0, "claim {n}");
        }
        assert_eq!(shared.remove(&uid(1)).unwrap(), None);
    }

    #[test]
    fn a_failed_write_undoes_the_change_in_memory() {
        let f = Fixture::new();
        let shared = SharedCheckpoint::new(f.open().0);
        shared.put(uid(1), entry("gpu-0")).unwrap();
        // The state directory becomes a file: every write fails.
        let state = f.dir.path().join("state");
        fs::remove_dir_all(&state).unwrap();
        fs::write(&state, "").unwrap();
        assert!(matches!(
            shared.put(uid(2), entry("gpu-1")),
            Err(CheckpointError::Write { .. })
        ));
        assert!(shared.remove(&uid(1)).is_err());
        let cp = shared.lock();
        assert!(
            !cp.contains(&uid(2)),
            "a change that failed to persist stays"
        );
        assert_eq!(cp.get(&uid(1)).unwrap().device, "gpu-0");
    }

    #[test]
    fn reboot_discards_entries() {
        let f = Fixture::new();
        let (mut cp, _) = f.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        fs::write(&f.boot, "boot-b\n").unwrap();
        let (cp, outcome) = f.open();
        assert_eq!(outcome, LoadOutcome::PreviousBoot { claims: 1 });
        assert!(cp.is_empty());
        assert!(outcome.knows_all_prepared_claims());
    }

    #[test]
    fn corruption_is_quarantined_not_fatal() {
        let f = Fixture::new();
        let (mut cp, _) = f.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        let path = cp.path().to_owned();
        // Flip one byte inside the embedded entries: valid JSON, bad checksum.
        let text = fs::read_to_string(&path).unwrap().replace("gpu-0", "gpu-9");
        fs::write(&path, text).unwrap();
        let (cp, outcome) = f.open();
        let LoadOutcome::Quarantined { reason, moved_to } = &outcome else {
            panic!("expected quarantine, got {outcome:?}");
        };
        assert!(reason.contains("checksum mismatch"), "{reason}");
        assert!(moved_to.exists());
        assert!(!path.exists());
        assert!(cp.is_empty());
        assert!(!outcome.knows_all_prepared_claims());
    }

    #[test]
    fn truncated_and_foreign_versions_are_quarantined() {
        for content in [
            &b"{\"version\":1,\"bootId\":\"boot-a\",\"crc"[..],
            b"{\"version\":7,\"bootId\":\"boot-a\",\"crc32\":0,\"claims\":\"{}\"}",
            b"\xff\xfe",
        ] {
            let f = Fixture::new();
            fs::create_dir_all(f.dir.path().join("state")).unwrap();
            fs::write(f.dir.path().join("state").join(FILE_NAME), content).unwrap();
            let (_, outcome) = f.open();
            assert!(
                matches!(outcome, LoadOutcome::Quarantined { .. }),
                "{outcome:?}"
            );
        }
    }

    #[test]
    fn entries_with_crafted_uids_are_rejected() {
        let claims = r#"{"../../etc/passwd":{"device":"gpu-0"}}"#;
        let envelope = format!(
            r#"{{"version":1,"bootId":"boot-a","crc32":{},"claims":{}}}"#,
            crc32fast::hash(claims.as_bytes()),
            serde_json::to_string(claims).unwrap()
        );
        let err = decode::<Entry>(envelope.as_bytes()).unwrap_err();
        assert!(err.contains("not a Kubernetes UID"), "{err}");
    }

    #[test]
    fn decoder_never_panics_on_noise() {
        // Deterministic xorshift noise plus mutations of a valid file.
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let valid = encode("b", &BTreeMap::from([(uid(1), entry("gpu-0"))]));
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
