//! Spare files: a removed file (a claim's record, its CDI spec) is kept
//! under a hidden name, and the next one written goes into it and is then
//! renamed into place.
//!
//! Creating a file is the dearest part of such a write on many file
//! systems (an inode allocated; on ext4 without a journal also a scan of
//! the inodes freed in the last minutes: 0.34 ms for a 1 KiB file against
//! 0.02 ms into a spare, measured on this project's CI machine), and
//! unlinking one costs again later. A node whose claims come and go
//! reuses files instead: an unprepare renames its claim's files to spares,
//! a prepare writes into spares and renames them over its claim's names.
//! Both renames are atomic, as the temp-file write they replace: readers
//! see the old file, the new one or none, never a part.
//!
//! Spares are named `.<prefix>spare-<pid>-<n>`: a leading dot and no
//! `.json` or `.yaml`, so no reader (a container runtime's CDI cache, this
//! version's or an older one's record reader, `tessera status`) takes one
//! for a spec or a record. A spare's content is a removed file's or a
//! half-written one's and is never read; it is overwritten and cut to
//! length before reuse. Spares left by an earlier process are adopted at
//! start.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cdi::{remove_if_present, write_for_this_boot};
use crate::sync::Locked;

/// Spares kept at most per directory: a burst of unprepares beyond it
/// unlinks. A few hundred bytes to a few kilobytes each.
pub const MAX_SPARES: usize = 256;

/// The spare files of one directory.
#[derive(Debug)]
pub struct Spares {
    dir: PathBuf,
    /// `.<prefix>spare-`: what names a spare here.
    stem: String,
    free: Mutex<Vec<PathBuf>>,
    named: AtomicU64,
}

impl Spares {
    /// The spares of `dir` named after `prefix`, those an earlier process
    /// left adopted (beyond [`MAX_SPARES`], removed).
    pub fn adopt(dir: &Path, prefix: &str) -> Spares {
        let stem = format!(".{prefix}spare-");
        let mut free: Vec<PathBuf> = fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_str().is_some_and(|n| is_spare(n, &stem)))
            .map(|e| e.path())
            .collect();
        for extra in free.split_off(free.len().min(MAX_SPARES)) {
            let _ = fs::remove_file(extra);
        }
        Spares {
            dir: dir.to_owned(),
            stem,
            free: Mutex::new(free),
            named: AtomicU64::new(0),
        }
    }

    /// Writes `bytes` to `path` (in this directory) for this boot, into a
    /// spare when there is one (see [`write_for_this_boot`] otherwise).
    pub fn write(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        while let Some(spare) = self.take() {
            let Ok((mut file, old_len)) = open_spare(&spare) else {
                // Gone or replaced by something else: never written to.
                continue;
            };
            // Over the old content, cut only if that was longer: the file
            // keeps its blocks, and most writes (a spec or record of the
            // same kind of claim) have the same length, where a truncate
            // costs more than the write.
            let len = bytes.len() as u64;
            let written = file
                .write_all(bytes)
                .and_then(|()| {
                    if old_len > len {
                        file.set_len(len)
                    } else {
                        Ok(())
                    }
                })
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
    pub fn remove(&self, path: &Path) -> io::Result<()> {
        if self.free.locked().len() >= MAX_SPARES {
            return remove_if_present(path);
        }
        let n = self.named.fetch_add(1, Ordering::Relaxed);
        let spare = (self.dir).join(format!("{}{}-{n}", self.stem, std::process::id()));
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
    pub fn count(&self) -> usize {
        self.free.locked().len()
    }
}

/// Whether a file name is a spare's (named from `stem`).
pub fn is_spare(name: &str, stem: &str) -> bool {
    name.starts_with(stem) && !name.ends_with(".json") && !name.ends_with(".yaml")
}

/// Opens a spare for writing from its start, without creating one and
/// without following a link put in its place; with its length now, to know
/// whether the write must cut it.
fn open_spare(spare: &Path) -> io::Result<(File, u64)> {
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(spare)?;
    let meta = file.metadata()?;
    if meta.is_file() {
        Ok((file, meta.len()))
    } else {
        Err(io::Error::other("not a regular file"))
    }
}
