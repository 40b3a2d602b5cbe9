//! Which claims have our entries on the API server, kept across restarts
//! (and reboots: a claim prepared before one still has its entries there).
//!
//! One append-only file, `<state dir>/claim-status.jsonl`: a line per
//! change (entries written for a claim, or removed), replayed at start.
//! Appending to an open file costs no directory change: a marker file per
//! claim cost a file creation for each written status and an unlink for
//! each removal, in the directory every prepare also creates files in.
//! When dead lines outnumber the live ones the file is rewritten with the
//! live ones alone (atomically, so a crash leaves the old or the new file).
//!
//! Every line is on disk (fsynced, and the directory once the file is
//! created) before the next one is written: the ledger must survive a
//! reboot or power loss, unlike the records of prepared claims, since the
//! entries it names stay on the API server. The status writer reads and
//! changes it in memory ([`SharedLedger`]) and one thread of its own
//! appends the lines, in the order of the changes: no prepare, unprepare or
//! write waits for an fsync. A change the process did not get on disk
//! before it died is made again at start, as after a torn line.
//!
//! A line torn by a crash is dropped at replay: a torn `written` means the
//! entries are written again (an apply is idempotent), a torn `removed`
//! that they are removed again; neither loses anything.
//!
//! Markers of earlier versions (a file per claim in `claim-status/`) are
//! taken over at start, then deleted.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, mpsc};

use crate::sync::Locked;

use serde::{Deserialize, Serialize};
use tracing::warn;

/// The ledger's file under the state directory.
pub const LEDGER_FILE: &str = "claim-status.jsonl";
/// Where earlier versions kept a marker file per claim.
const LEGACY_MARKER_DIR: &str = "claim-status";
/// Dead lines tolerated before a rewrite, however few claims are live.
const MIN_DEAD_LINES: usize = 1024;

/// The claim whose entries are on the API server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marked {
    pub namespace: String,
    pub name: String,
}

/// One change, one line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
enum Line {
    Written {
        uid: String,
        #[serde(flatten)]
        marked: Marked,
    },
    Removed {
        uid: String,
    },
}

pub struct Ledger {
    path: PathBuf,
    marked: HashMap<String, Marked>,
    /// Open for appending; `None` until the first append (or after a
    /// failed one: the next one opens it again).
    file: Option<File>,
    lines: usize,
    /// The file ends in a torn line: the next append starts a new one.
    torn: bool,
}

impl Ledger {
    /// The ledger of `state_dir`, replayed; earlier versions' markers
    /// taken over. Never fails: what cannot be read is logged, and the
    /// claims it named are treated as without entries.
    pub fn open(state_dir: &Path) -> Self {
        let path = state_dir.join(LEDGER_FILE);
        let replayed = replay(&path);
        let mut ledger = Ledger {
            path,
            marked: replayed.marked,
            file: None,
            lines: replayed.lines,
            torn: replayed.torn,
        };
        let legacy = state_dir.join(LEGACY_MARKER_DIR);
        if legacy.is_dir() {
            ledger.take_over(&legacy);
        }
        ledger
    }

    /// Claims with entries on the API server (tests).
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Marked)> {
        self.marked.iter()
    }

    /// The claim's entries are on the API server.
    pub fn written(&mut self, uid: &str, marked: Marked) -> std::io::Result<()> {
        if self.marked.get(uid) == Some(&marked) {
            return Ok(());
        }
        let line = Line::Written {
            uid: uid.to_owned(),
            marked: marked.clone(),
        };
        self.marked.insert(uid.to_owned(), marked);
        self.append(&line)
    }

    /// The claim's entries are gone from the API server.
    pub fn removed(&mut self, uid: &str) -> std::io::Result<()> {
        if self.marked.remove(uid).is_none() {
            return Ok(());
        }
        self.append(&Line::Removed {
            uid: uid.to_owned(),
        })
    }

    fn append(&mut self, line: &Line) -> std::io::Result<()> {
        if self.lines >= MIN_DEAD_LINES.max(2 * self.marked.len()) {
            return self.rewrite();
        }
        let mut bytes = Vec::from(if self.torn { &b"\n"[..] } else { b"" });
        encode(&mut bytes, line)?;
        let file = match &mut self.file {
            Some(file) => file,
            None => self.file.insert(open_for_append(&self.path)?),
        };
        // One write per line: with O_APPEND it lands whole after the last.
        let written = file.write_all(&bytes).and_then(|()| sync(file));
        if written.is_err() {
            self.file = None;
        }
        written?;
        self.torn = false;
        self.lines += 1;
        Ok(())
    }

    /// Replaces the file with one line per live claim.
    fn rewrite(&mut self) -> std::io::Result<()> {
        let mut bytes = Vec::new();
        for (uid, marked) in &self.marked {
            let line = Line::Written {
                uid: uid.clone(),
                marked: marked.clone(),
            };
            encode(&mut bytes, &line)?;
        }
        self.file = None;
        crate::cdi::write_atomically(&self.path, &bytes)?;
        self.lines = self.marked.len();
        self.torn = false;
        Ok(())
    }

    /// Reads the marker files of an earlier version into the ledger, then
    /// deletes them (after the ledger has them).
    fn take_over(&mut self, dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let mut files = Vec::new();
        for entry in entries.filter_map(Result::ok) {
            let uid = entry.file_name().to_string_lossy().into_owned();
            let marked = std::fs::read(entry.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<Marked>(&b).ok());
            match marked {
                Some(m) if !uid.starts_with('.') => {
                    self.marked.insert(uid, m);
                }
                _ => {
                    warn!(file = %entry.path().display(), "unreadable claim status marker; removed")
                }
            }
            files.push(entry.path());
        }
        if let Err(e) = self.rewrite() {
            warn!(
                "cannot write {}: {e}; claim status markers kept",
                self.path.display()
            );
            return;
        }
        for file in files {
            let _ = std::fs::remove_file(file);
        }
        let _ = std::fs::remove_dir(dir);
    }
}

/// The ledger as the status writer shares it: what it names, changed and
/// read in memory at once, and its file, appended behind (module
/// documentation).
pub struct SharedLedger {
    marked: Mutex<HashMap<String, Marked>>,
    appends: mpsc::Sender<Change>,
}

/// One change for the appending thread.
enum Change {
    Line(Line),
    /// Answered once every change before it is on disk (tests).
    #[cfg(test)]
    Flushed(mpsc::Sender<()>),
}

impl SharedLedger {
    /// The ledger of `state_dir` (see [`Ledger::open`]) and its appending
    /// thread, which ends with the last handle.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let ledger = Ledger::open(state_dir);
        let marked = ledger.marked.clone();
        let (appends, changes) = mpsc::channel();
        std::thread::Builder::new()
            .name("claim-status-ledger".into())
            .spawn(move || append_all(ledger, changes))?;
        Ok(SharedLedger {
            marked: Mutex::new(marked),
            appends,
        })
    }

    pub fn get(&self, uid: &str) -> Option<Marked> {
        self.marked.locked().get(uid).cloned()
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.marked.locked().contains_key(uid)
    }

    /// Claims with entries on the API server, now.
    pub fn marked(&self) -> Vec<(String, Marked)> {
        let marked = self.marked.locked();
        marked.iter().map(|(u, m)| (u.clone(), m.clone())).collect()
    }

    /// The claim's entries are on the API server.
    pub fn written(&self, uid: &str, marked: Marked) {
        let mut all = self.marked.locked();
        if all.get(uid) == Some(&marked) {
            return;
        }
        all.insert(uid.to_owned(), marked.clone());
        // Sent under the lock: the file gets the changes in their order.
        self.append(Line::Written {
            uid: uid.to_owned(),
            marked,
        });
    }

    /// The claim's entries are gone from the API server.
    pub fn removed(&self, uid: &str) {
        let mut all = self.marked.locked();
        if all.remove(uid).is_some() {
            self.append(Line::Removed {
                uid: uid.to_owned(),
            });
        }
    }

    fn append(&self, line: Line) {
        if self.appends.send(Change::Line(line)).is_err() {
            warn!("the claim status ledger's thread has ended; the change is made again at start");
        }
    }

    /// Waits until every change made so far is on disk (tests).
    #[cfg(test)]
    pub fn flush(&self) {
        let (done, flushed) = mpsc::channel();
        self.appends
            .send(Change::Flushed(done))
            .expect("the thread runs");
        flushed.recv().expect("the thread answers");
    }
}

/// The appending thread: each change on disk before the next.
fn append_all(mut ledger: Ledger, changes: mpsc::Receiver<Change>) {
    for change in changes {
        let (uid, done) = match change {
            Change::Line(Line::Written { uid, marked }) => {
                let done = ledger.written(&uid, marked);
                (uid, done)
            }
            Change::Line(Line::Removed { uid }) => {
                let done = ledger.removed(&uid);
                (uid, done)
            }
            #[cfg(test)]
            Change::Flushed(answer) => {
                let _ = answer.send(());
                continue;
            }
        };
        if let Err(e) = done {
            warn!(claim_uid = %uid, "cannot record a change of the claim's status entries in {}: {e}; it is made again at start", ledger.path.display());
        }
    }
}

/// `line` as one line of the file.
fn encode(bytes: &mut Vec<u8>, line: &Line) -> std::io::Result<()> {
    serde_json::to_writer(&mut *bytes, line).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    Ok(())
}

/// Opens the file for appending; a file it creates is made durable in its
/// directory too.
fn open_for_append(path: &Path) -> std::io::Result<File> {
    let existed = path.exists();
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    if !existed && let Some(dir) = path.parent() {
        sync(&File::open(dir)?)?;
    }
    Ok(file)
}

/// fsync: what was written survives a power loss.
fn sync(file: &File) -> std::io::Result<()> {
    #[cfg(test)]
    tests::SYNCS.with(|n| n.set(n.get() + 1));
    file.sync_all()
}

/// What the file at `path` says: the live claims, how many lines it has,
/// and whether its end is torn (no newline after the last line).
fn replay(path: &Path) -> Replayed {
    let mut replayed = Replayed::default();
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return replayed,
        Err(e) => {
            warn!(
                "cannot read {}: {e}; claims it names keep their status entries",
                path.display()
            );
            return replayed;
        }
    };
    replayed.torn = bytes.last().is_some_and(|&b| b != b'\n');
    for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        replayed.lines += 1;
        match serde_json::from_slice::<Line>(line) {
            Ok(Line::Written { uid, marked }) => {
                replayed.marked.insert(uid, marked);
            }
            Ok(Line::Removed { uid }) => {
                replayed.marked.remove(&uid);
            }
            // A crash mid-append tears the last line at most.
            Err(_) => {
                warn!(file = %path.display(), line = replayed.lines, "unreadable claim status line; skipped")
            }
        }
    }
    replayed
}

#[derive(Default)]
struct Replayed {
    marked: HashMap<String, Marked>,
    lines: usize,
    torn: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// fsyncs made on this thread.
        pub(super) static SYNCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    #[test]
    fn every_change_is_synced_before_it_counts() {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::open(dir.path());
        let before = SYNCS.with(|n| n.get());
        ledger.written("a", marked("a")).unwrap();
        let after_write = SYNCS.with(|n| n.get());
        // The line, and the directory entry of the new file.
        assert_eq!(after_write - before, 2);
        ledger.removed("a").unwrap();
        assert_eq!(SYNCS.with(|n| n.get()) - after_write, 1);
    }

    #[test]
    fn a_shared_ledger_changes_at_once_and_syncs_on_its_own_thread() {
        let dir = tempfile::tempdir().unwrap();
        let shared = SharedLedger::open(dir.path()).unwrap();
        let before = SYNCS.with(|n| n.get());
        shared.written("a", marked("a"));
        shared.written("b", marked("b"));
        shared.removed("a");
        // Seen at once by readers ...
        assert!(!shared.contains("a") && shared.contains("b"));
        // ... and no fsync on the caller's thread.
        assert_eq!(SYNCS.with(|n| n.get()), before);
        shared.flush();
        let reopened = Ledger::open(dir.path());
        assert_eq!(live(&reopened), ["b"]);
        assert_eq!(reopened.lines, 3, "each change a line, in order");
    }

    fn marked(name: &str) -> Marked {
        Marked {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    fn live(ledger: &Ledger) -> Vec<&str> {
        let mut uids: Vec<&str> = ledger.iter().map(|(u, _)| u.as_str()).collect();
        uids.sort();
        uids
    }

    #[test]
    fn what_was_written_and_not_removed_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::open(dir.path());
        ledger.written("a", marked("a")).unwrap();
        ledger.written("b", marked("b")).unwrap();
        ledger.removed("a").unwrap();
        ledger.written("c", marked("c")).unwrap();
        drop(ledger);

        let ledger = Ledger::open(dir.path());
        assert_eq!(live(&ledger), ["b", "c"]);
        assert_eq!(ledger.marked.get("b"), Some(&marked("b")));
    }

    #[test]
    fn a_torn_last_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::open(dir.path());
        ledger.written("a", marked("a")).unwrap();
        drop(ledger);
        let path = dir.path().join(LEDGER_FILE);
        let mut file = open_for_append(&path).unwrap();
        file.write_all(br#"{"written":{"uid":"b","names"#).unwrap();
        drop(file);

        let mut ledger = Ledger::open(dir.path());
        assert_eq!(live(&ledger), ["a"]);
        ledger.written("c", marked("c")).unwrap();
        drop(ledger);
        // The torn line ended without a newline: the next append must not
        // be glued to it.
        assert_eq!(live(&Ledger::open(dir.path())), ["a", "c"]);
    }

    #[test]
    fn dead_lines_are_dropped_by_a_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = Ledger::open(dir.path());
        ledger.written("kept", marked("kept")).unwrap();
        for i in 0..(2 * MIN_DEAD_LINES) {
            let uid = format!("c{i}");
            ledger.written(&uid, marked(&uid)).unwrap();
            ledger.removed(&uid).unwrap();
        }
        drop(ledger);
        let text = std::fs::read_to_string(dir.path().join(LEDGER_FILE)).unwrap();
        assert!(
            text.lines().count() <= MIN_DEAD_LINES + 1,
            "{} lines",
            text.lines().count()
        );
        assert_eq!(live(&Ledger::open(dir.path())), ["kept"]);
    }

    #[test]
    fn an_earlier_versions_markers_are_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let legacy = dir.path().join(LEGACY_MARKER_DIR);
        std::fs::create_dir_all(&legacy).unwrap();
        std::fs::write(legacy.join("a"), serde_json::to_vec(&marked("a")).unwrap()).unwrap();
        std::fs::write(legacy.join("b"), b"not json").unwrap();

        let ledger = Ledger::open(dir.path());
        assert_eq!(live(&ledger), ["a"]);
        assert!(!legacy.exists(), "markers deleted once taken over");
        assert_eq!(live(&Ledger::open(dir.path())), ["a"]);
    }
}
