//! Records moved aside: an unreadable record is renamed, never deleted,
//! and its claim is lost (its Pods may still run) until the kubelet
//! unprepares it. What a moved-aside record still says is salvaged as a
//! hint of what to release.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use super::{CheckpointError, Entry, LEGACY_FILE, RECORD_SUFFIX, remove_if_present};
use crate::claim_uid::ClaimUid;

/// The mark of a moved-aside record: `<name>.corrupt-<stamp>.<boot id>`.
pub(super) const QUARANTINE_MARK: &str = ".corrupt-";
/// A moved-aside record whose claim the kubelet has since unprepared.
const RELEASED_MARK: &str = ".released-";

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
    pub in_part: BTreeSet<ClaimUid>,
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
/// A moved-aside file: `<name>.corrupt-<stamp>[.<boot id>]` (`.released-`
/// once its claim was unprepared). Versions before the boot id in the name
/// left it out.
pub(super) struct Moved {
    pub(super) name: String,
    pub(super) path: PathBuf,
    /// The moved-aside file's own name before the mark (`<uid>.json`).
    pub(super) stem: String,
    pub(super) stamp: u64,
    /// The boot it was moved aside in, when its name says.
    pub(super) boot: Option<String>,
    pub(super) released: bool,
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
pub(super) fn find_lost<T: Entry>(
    dir: &Path,
    state_dir: &Path,
    boot_id: &str,
) -> (Lost<T>, BTreeSet<PathBuf>) {
    let mut lost = Lost::default();
    let mut marking = BTreeSet::new();
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
pub(super) fn moved_files(dir: &Path) -> Vec<Moved> {
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
pub(super) fn prune_quarantined(dir: &Path, keep: usize, marking: &BTreeSet<PathBuf>) {
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

/// Marks the moved-aside records of `claim` in `dir` released (the
/// kubelet unprepared it), so the next start of this boot does not find it
/// lost again.
pub(super) fn mark_released(dir: &Path, claim: &ClaimUid) -> Result<(), CheckpointError> {
    for moved in moved_files(dir) {
        if moved.released || moved.claim().as_ref() != Some(claim) {
            continue;
        }
        let released =
            (moved.path).with_file_name(moved.name.replacen(QUARANTINE_MARK, RELEASED_MARK, 1));
        fs::rename(&moved.path, &released).map_err(|source| CheckpointError::Write {
            path: moved.path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// Moves an unreadable file aside for inspection, naming the boot it was
/// found in; where it went.
pub(super) fn quarantine(path: &Path, boot_id: &str) -> Result<PathBuf, CheckpointError> {
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
