//! The records read as they are, by a process that does not own them
//! (`tessera status`, a standby's pre-flight check).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::record::{decode_legacy, decode_record, read_record};
use super::retired::read_retired;
use super::{Entry, LEGACY_FILE, RECORD_SUFFIX, RECORDS_DIR};
use crate::claim_uid::ClaimUid;

/// Why the records could not be read at all (one unreadable record is
/// not this: it is listed in [`Snapshot::unreadable`]).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A version 1 file, or the journal of retired records, is there but
    /// cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The directory of records cannot be listed.
    #[error("cannot list {}: {source}", dir.display())]
    List {
        dir: PathBuf,
        source: std::io::Error,
    },
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
pub fn read_snapshot<T: Entry>(
    state_dir: &Path,
    boot_id: Option<&str>,
) -> Result<Snapshot<T>, SnapshotError> {
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
        Err(source) => {
            return Err(SnapshotError::Read {
                path: legacy,
                source,
            });
        }
    }
    let dir = state_dir.join(RECORDS_DIR);
    for (stem, path) in record_files(&dir)? {
        // This version replaces records only by rename; a node process of
        // an earlier one rewrites a retired record in place, which a read
        // may see half-written: read once more before calling it unreadable.
        match read_record::<T>(&stem, &path).or_else(|_| read_record::<T>(&stem, &path)) {
            Ok(r) => read.push((r.boot, r.claim, r.entry)),
            // Removed by the node process between listing and reading.
            Err(_) if !path.exists() => {}
            Err(why) => unreadable.push(format!("{}: {why}", path.display())),
        }
    }
    // Retired by an unprepare that answered: what start-up reads them as.
    let retired = read_retired(&dir).map_err(|source| SnapshotError::Read {
        path: dir.join(super::retired::JOURNAL_FILE),
        source,
    })?;
    for (_, claim, entry) in &mut read {
        if retired.contains(claim) {
            entry.retire();
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
pub(super) fn record_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, SnapshotError> {
    let cannot_list = |source| SnapshotError::List {
        dir: dir.to_owned(),
        source,
    };
    let listing = match fs::read_dir(dir) {
        Ok(listing) => listing,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(cannot_list(e)),
    };
    let mut files = Vec::new();
    for file in listing {
        let path = file.map_err(cannot_list)?.path();
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
