//! Spare record files: a removed record's file is kept under a hidden name
//! and the next record written goes into it, then is renamed into place.
//!
//! Creating a file is the dearest thing a record write does on many file
//! systems (an inode allocated, on ext4 a scan of the inodes freed in the
//! last minutes), and unlinking one costs the same again later. A node
//! whose claims come and go therefore reuses files instead: an unprepare
//! renames its claim's record to a spare, a prepare writes into a spare
//! and renames it over its claim's name. Both renames are atomic, as the
//! temp-file write they replace: readers see the old record, the new one
//! or none, never a part.
//!
//! Spares are named `.spare-<pid>-<n>`: a leading dot and no `.json`, so no
//! reader of records (this version's, an older one's, `tessera status`)
//! takes one for a record. A spare's content is a removed record's or a
//! half-written one's and is never read; it is truncated before reuse.
//! Spares left by an earlier process are adopted at start.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::remove_if_present;
use crate::cdi::write_for_this_boot;
use crate::sync::Locked;

const SPARE_PREFIX: &str = ".spare-";
/// Spares kept at most: a burst of unprepares beyond it unlinks.
pub(super) const MAX_SPARES: usize = 128;

/// The spare files of one directory.
#[derive(Debug)]
pub(super) struct Spares {
    dir: PathBuf,
    free: Mutex<Vec<PathBuf>>,
    named: AtomicU64,
}

impl Spares {
    /// The spares of `dir`, those an earlier process left adopted (beyond
    /// [`MAX_SPARES`], removed).
    pub(super) fn adopt(dir: &Path) -> Spares {
        let mut free: Vec<PathBuf> = fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(is_spare))
            .map(|e| e.path())
            .collect();
        for extra in free.split_off(free.len().min(MAX_SPARES)) {
            let _ = fs::remove_file(extra);
        }
        Spares {
            dir: dir.to_owned(),
            free: Mutex::new(free),
            named: AtomicU64::new(0),
        }
    }

    /// Writes `bytes` to `path` (in this directory) for this boot, into a
    /// spare when there is one (see [`write_for_this_boot`] otherwise).
    pub(super) fn write(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        while let Some(spare) = self.take() {
            let Ok(mut file) = open_spare(&spare) else {
                // Gone or replaced by something else: never written to.
                continue;
            };
            let written = file
                .write_all(bytes)
                .and_then(|()| fs::rename(&spare, path));
            if written.is_err() {
                let _ = fs::remove_file(&spare);
            }
            return written;
        }
        write_for_this_boot(path, bytes)
    }

    /// Removes `path` (absent is fine), keeping its file as a spare while
    /// there are fewer than [`MAX_SPARES`].
    pub(super) fn remove(&self, path: &Path) -> io::Result<()> {
        if self.free.locked().len() >= MAX_SPARES {
            return remove_if_present(path);
        }
        let n = self.named.fetch_add(1, Ordering::Relaxed);
        let spare = self
            .dir
            .join(format!("{SPARE_PREFIX}{}-{n}", std::process::id()));
        match fs::rename(path, &spare) {
            Ok(()) => {
                self.free.locked().push(spare);
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn take(&self) -> Option<PathBuf> {
        self.free.locked().pop()
    }

    /// How many spares are kept now (tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.free.locked().len()
    }
}

/// Whether a file name is a spare's.
pub(super) fn is_spare(name: &str) -> bool {
    name.starts_with(SPARE_PREFIX) && !name.ends_with(".json")
}

/// Opens a spare for writing from its start, without creating one and
/// without following a link put in its place.
fn open_spare(spare: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(spare)?;
    if file.metadata()?.is_file() {
        Ok(file)
    } else {
        Err(io::Error::other("not a regular file"))
    }
}
