//! The journal of retired records: `<records dir>/retired.log`.
//!
//! An unprepare that answers before its claim's files go must leave a mark
//! a restart reads, so that start-up recovery finishes what the answer
//! promised. Re-encoding the record with the mark and writing it over the
//! old one was a third of the node's CPU in a burst of unprepares (the
//! encoding, the open, the write); a line appended to one open file is a
//! single `write` of 45 bytes.
//!
//! A line is `retired <claim UID>` or `prepared <claim UID>`; a claim's last
//! line says what its record is. `prepared` is written only when a claim is
//! recorded again while a `retired` line of it is in the journal (the
//! kubelet prepared it anew before its old record went), after the new
//! record: a kill in between leaves the new record marked, which is right,
//! since that prepare never answered. The journal is emptied whenever no
//! retired record is left on disk (the end of each burst), and rewritten
//! with only those when it grows past [`MAX_LINES`] meanwhile.
//!
//! A line is one `write` to a file opened `O_APPEND`. A kill can stop a
//! `write` that crosses a page between the two (never within one), leaving
//! a part of the line without its newline: that names nothing, which is
//! right, since that unprepare never answered. Start-up reads the journal,
//! marks the records it names, and rewrites it with those, so no part of a
//! line is ever followed by another. Like the records, the journal
//! describes this boot only and is not synced.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard};

use crate::cdi::write_for_this_boot;
use crate::claim_uid::ClaimUid;
use crate::sync::{Locked, ReadWrite};

/// The journal's name in the records directory: no `.json`, so no record
/// reader (this version's, an older one's) takes it for a record.
pub(super) const JOURNAL_FILE: &str = "retired.log";

/// Lines the journal may hold before it is rewritten with only the claims
/// whose retired records are still on disk (under a steady stream of
/// unprepares it is never empty): about 180 KiB.
pub(super) const MAX_LINES: usize = 4096;

const RETIRED: &str = "retired";
const PREPARED: &str = "prepared";

/// The journal, and what its lines say.
#[derive(Debug)]
pub(super) struct Journal {
    path: PathBuf,
    /// Opened at the first append. Appends share it, each line one `write`
    /// (concurrent appends to one file stay whole), and hold it until their
    /// line is counted; emptying or rewriting the file takes it alone, so
    /// no line in flight is lost. Taken before `lines`.
    file: RwLock<Option<File>>,
    lines: Mutex<Lines>,
}

#[derive(Debug, Default)]
struct Lines {
    /// In the file.
    count: usize,
    /// Claims whose last line is `retired`.
    retired: HashSet<ClaimUid>,
    /// Of those, the ones whose record is still on disk.
    on_disk: HashSet<ClaimUid>,
}

impl Journal {
    /// The journal of `dir`, not read yet.
    pub(super) fn new(dir: &Path) -> Journal {
        Journal {
            path: dir.join(JOURNAL_FILE),
            file: RwLock::new(None),
            lines: Mutex::new(Lines::default()),
        }
    }

    /// Start-up: the journal as `on_disk` leaves it, exactly those claims
    /// (each with a record), the rest of what it held dropped.
    pub(super) fn reset(&self, on_disk: HashSet<ClaimUid>) -> io::Result<()> {
        self.rewrite(&mut self.file.writing(), &mut self.lock(), on_disk)
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Marks `claim`'s record retired; the record must be on disk.
    pub(super) fn retire(&self, claim: &ClaimUid) -> io::Result<()> {
        let _appended = self.append(RETIRED, claim)?;
        let mut lines = self.lock();
        lines.count += 1;
        lines.retired.insert(claim.clone());
        lines.on_disk.insert(claim.clone());
        Ok(())
    }

    /// `claim` was recorded anew: a `retired` line of it no longer holds.
    pub(super) fn recorded(&self, claim: &ClaimUid) -> io::Result<()> {
        if !self.lock().retired.contains(claim) {
            return Ok(());
        }
        let _appended = self.append(PREPARED, claim)?;
        let mut lines = self.lock();
        lines.count += 1;
        lines.retired.remove(claim);
        lines.on_disk.remove(claim);
        Ok(())
    }

    /// `claim`'s record is gone: once no retired record is left on disk,
    /// the journal is emptied.
    pub(super) fn removed(&self, claim: &ClaimUid) -> io::Result<()> {
        {
            let mut lines = self.lock();
            if !lines.on_disk.remove(claim) || !lines.on_disk.is_empty() {
                return Ok(());
            }
        }
        let file = self.file.writing();
        let mut lines = self.lock();
        // A retire came in between: its line stays.
        if !lines.on_disk.is_empty() {
            return Ok(());
        }
        match &*file {
            Some(file) => file.set_len(0)?,
            // Written at start-up, not opened since.
            None => crate::cdi::remove_if_present(&self.path)?,
        }
        lines.count = 0;
        lines.retired.clear();
        Ok(())
    }

    /// Appends one line, the journal rewritten first when it is long;
    /// what it returns keeps the file from being emptied until the caller
    /// has counted the line.
    fn append(
        &self,
        verb: &str,
        claim: &ClaimUid,
    ) -> io::Result<RwLockReadGuard<'_, Option<File>>> {
        if self.lock().count >= MAX_LINES {
            let mut file = self.file.writing();
            let mut lines = self.lock();
            if lines.count >= MAX_LINES {
                let on_disk = lines.on_disk.clone();
                self.rewrite(&mut file, &mut lines, on_disk)?;
            }
        }
        let line = format!("{verb} {claim}\n");
        loop {
            let file = self.file.reading();
            if let Some(open) = &*file {
                if let Err(e) = write_line(open, &line) {
                    // A part of the line may be there (a full disk): the
                    // next append rewrites the journal before its own.
                    self.lock().count = MAX_LINES;
                    return Err(e);
                }
                return Ok(file);
            }
            drop(file);
            let mut file = self.file.writing();
            if file.is_none() {
                *file = Some(open_for_append(&self.path)?);
            }
        }
    }

    /// Replaces the file with one `retired` line per claim of `on_disk`
    /// (none: no file), atomically.
    fn rewrite(
        &self,
        file: &mut Option<File>,
        lines: &mut Lines,
        on_disk: HashSet<ClaimUid>,
    ) -> io::Result<()> {
        *file = None;
        if on_disk.is_empty() {
            crate::cdi::remove_if_present(&self.path)?;
        } else {
            let text: String = (on_disk.iter())
                .map(|claim| format!("{RETIRED} {claim}\n"))
                .collect();
            write_for_this_boot(&self.path, text.as_bytes())?;
        }
        lines.count = on_disk.len();
        lines.retired = on_disk.clone();
        lines.on_disk = on_disk;
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Lines> {
        self.lines.locked()
    }
}

/// One line in one call: a second write after a kill would be a torn line.
fn write_line(mut file: &File, line: &str) -> io::Result<()> {
    match file.write(line.as_bytes())? {
        n if n == line.len() => Ok(()),
        n => Err(io::Error::other(format!(
            "appended {n} of {} bytes",
            line.len()
        ))),
    }
}

fn open_for_append(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// The claims the journal in `dir` names retired (by their last line);
/// none when there is no journal.
pub(super) fn read_retired(dir: &Path) -> io::Result<HashSet<ClaimUid>> {
    let text = match fs::read(dir.join(JOURNAL_FILE)) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(HashSet::new()),
        Err(e) => return Err(e),
    };
    let mut last: BTreeMap<ClaimUid, bool> = BTreeMap::new();
    let mut lines: Vec<&[u8]> = text.split(|b| *b == b'\n').collect();
    // What follows the last newline: nothing, or a line a power loss tore.
    lines.pop();
    for line in lines {
        let Some((verb, claim)) = std::str::from_utf8(line)
            .ok()
            .and_then(|line| line.split_once(' '))
        else {
            continue;
        };
        let Ok(claim) = ClaimUid::parse(claim) else {
            continue;
        };
        match verb {
            RETIRED => last.insert(claim, true),
            PREPARED => last.insert(claim, false),
            _ => None,
        };
    }
    Ok((last.into_iter())
        .filter_map(|(claim, retired)| retired.then_some(claim))
        .collect())
}
