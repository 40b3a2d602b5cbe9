//! What the simulated GPUs are doing: the memory processes hold on them
//! and whether their kernels run, as the kernel driver knows it on a real
//! machine.
//!
//! The machine's state file is read-only in a container, so load has a
//! channel of its own that any process may write, the way any process
//! talks to the kernel driver: a load directory (`TESSERA_FAKE_NVML_LOAD`,
//! [`LOAD_ENV`]), writable in every container. The simulated libcuda keeps
//! one [`Record`] per process there (`<pid namespace inode>-<pid>.json`):
//! per device, the bytes it has allocated, how busy its kernels keep it,
//! and until when. The fake NVML reads the records for utilization,
//! per-process memory and used memory.
//!
//! A record names its process as the process itself sees it: the inode of
//! its pid namespace, its pid there and its start time. A reader finds the
//! process in its own `/proc` (the namespace inode and the last `NSpid`
//! entry match, the start time is the same): a process on the host finds
//! every container's processes under their host pids, as real NVML
//! reports them; a process in a container finds only its own container's.
//! Records of processes that are gone (no such process, or another one that
//! reused the pid) count for nothing; a reader in the host's pid namespace,
//! which can tell, removes them.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Environment variable naming the load directory; unset or empty: no
/// process records its load, and every GPU is idle.
pub const LOAD_ENV: &str = "TESSERA_FAKE_NVML_LOAD";

/// One process's load on the simulated GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Record {
    /// Inode of the process's pid namespace (`/proc/self/ns/pid`).
    pub pid_namespace: u64,
    /// Its pid in that namespace.
    pub pid: u32,
    /// Its start time, clock ticks after boot (`/proc/<pid>/stat` field
    /// 22): tells it from a later process given the same pid.
    pub start_time: u64,
    pub devices: Vec<DeviceLoad>,
}

/// What a process does on one device (a GPU or a MIG device).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceLoad {
    /// The device's UUID (`GPU-...` or `MIG-...`).
    pub uuid: String,
    /// Device memory it has allocated.
    pub memory_bytes: u64,
    /// Until when its kernels keep the device busy, milliseconds after the
    /// Unix epoch (0: it never launched one).
    #[serde(default)]
    pub busy_until_ms: u64,
    /// The share of the device's SMs its kernels occupy while busy, in
    /// percent: 100, or an MPS client's active thread percentage.
    pub sm_percent: u32,
}

impl Record {
    /// This process's identity, with no devices yet; `None` where `/proc`
    /// does not say.
    pub fn for_this_process() -> Option<Record> {
        let pid_namespace = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
        Some(Record {
            pid_namespace,
            pid: std::process::id(),
            start_time: start_time(Path::new("/proc/self"))?,
            devices: Vec::new(),
        })
    }

    /// The record's file name in the load directory.
    pub fn file_name(&self) -> String {
        format!("{}-{}.json", self.pid_namespace, self.pid)
    }

    /// Writes (or, with nothing left to say, removes) this record in `dir`,
    /// atomically: a reader never sees half of it.
    pub fn publish(&self, dir: &Path) -> std::io::Result<()> {
        let path = dir.join(self.file_name());
        let idle = self
            .devices
            .iter()
            .all(|d| d.memory_bytes == 0 && d.busy_until_ms <= now_ms());
        if idle {
            return match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
        }
        let tmp = dir.join(format!(".{}.tmp", self.file_name()));
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &path))
    }
}

/// Milliseconds after the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The load directory this process was given, if any.
pub fn dir_from_env() -> Option<PathBuf> {
    std::env::var_os(LOAD_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// A record whose process is running, under the pid this process's `/proc`
/// knows it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    pub pid: u32,
    pub record: Record,
}

/// Where a record's process was last found: (namespace, pid, start time)
/// to the pid in this process's `/proc`. Checked again on every use (the
/// start time must still match), so a stale entry is never trusted.
static FOUND: Mutex<BTreeMap<(u64, u32, u64), u32>> = Mutex::new(BTreeMap::new());

/// The records in `dir` of processes this process can see running, by
/// file name order. An unreadable directory or record counts for nothing
/// (a record being replaced is always whole: writers rename).
pub fn live(dir: &Path) -> Vec<Live> {
    live_in(dir, Path::new("/proc"))
}

fn live_in(dir: &Path, proc: &Path) -> Vec<Live> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut records: Vec<(PathBuf, Record)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .filter_map(|p| {
            let record = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
            Some((p, record))
        })
        .collect();
    if records.is_empty() {
        return Vec::new();
    }
    records.sort_by(|a, b| a.0.cmp(&b.0));
    let mut found = FOUND.lock().unwrap_or_else(PoisonError::into_inner);
    let key = |r: &Record| (r.pid_namespace, r.pid, r.start_time);
    let missing: BTreeSet<u64> = records
        .iter()
        .filter(|(_, r)| {
            found
                .get(&key(r))
                .is_none_or(|pid| start_time(&proc.join(pid.to_string())) != Some(r.start_time))
        })
        .map(|(_, r)| r.pid_namespace)
        .collect();
    if !missing.is_empty() {
        found.retain(|k, _| !missing.contains(&k.0));
        found.extend(scan(proc, &missing));
    }
    let sees_all = in_initial_namespace(proc);
    let mut live = Vec::new();
    for (path, record) in records {
        match found.get(&key(&record)) {
            Some(pid) => live.push(Live { pid: *pid, record }),
            // Gone: only a reader that sees every process can tell.
            None if sees_all => {
                let _ = std::fs::remove_file(path);
            }
            None => {}
        }
    }
    live
}

/// Processes below `proc` in one of `namespaces`: (namespace, pid there,
/// start time) to their pid in `proc`.
fn scan(proc: &Path, namespaces: &BTreeSet<u64>) -> BTreeMap<(u64, u32, u64), u32> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(proc) else {
        return out;
    };
    for entry in entries.filter_map(Result::ok) {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        let Ok(ns) = std::fs::metadata(dir.join("ns/pid")) else {
            continue;
        };
        if !namespaces.contains(&ns.ino()) {
            continue;
        }
        let (Some(inner), Some(started)) = (innermost_pid(&dir), start_time(&dir)) else {
            continue;
        };
        out.insert((ns.ino(), inner, started), pid);
    }
    out
}

/// The pid a process has in its own pid namespace: the last `NSpid` entry.
fn innermost_pid(dir: &Path) -> Option<u32> {
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// Whether this process's pid namespace is the machine's first (it has a
/// single `NSpid` entry), so it sees every process.
fn in_initial_namespace(proc: &Path) -> bool {
    std::fs::read_to_string(proc.join("self/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .map(|l| l.split_whitespace().count() == 1)
        })
        .unwrap_or(false)
}

/// Field 22 of `<dir>/stat`: the start time, clock ticks after boot.
fn start_time(dir: &Path) -> Option<u64> {
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(devices: Vec<DeviceLoad>) -> Record {
        Record {
            devices,
            ..Record::for_this_process().expect("/proc says who this process is")
        }
    }

    fn load(uuid: &str, memory_bytes: u64, busy_until_ms: u64) -> DeviceLoad {
        DeviceLoad {
            uuid: uuid.into(),
            memory_bytes,
            busy_until_ms,
            sm_percent: 100,
        }
    }

    #[test]
    fn a_running_process_is_found_under_its_pid() {
        let dir = tempfile_dir("found");
        let mine = record(vec![load("GPU-a", 1 << 30, 0)]);
        mine.publish(&dir).unwrap();
        let live = live(&dir);
        assert_eq!(
            live,
            vec![Live {
                pid: std::process::id(),
                record: mine.clone()
            }]
        );
        // Nothing left to say: the record goes.
        record(vec![load("GPU-a", 0, 0)]).publish(&dir).unwrap();
        assert!(!dir.join(mine.file_name()).exists());
        assert!(super::live(&dir).is_empty());
    }

    #[test]
    fn a_record_of_a_process_gone_counts_for_nothing() {
        let dir = tempfile_dir("gone");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let gone = Record {
            pid,
            ..record(vec![load("GPU-a", 1 << 30, now_ms() + 60_000)])
        };
        gone.publish(&dir).unwrap();
        // The same pid with another start time: a later process.
        let reused = Record {
            start_time: record(vec![]).start_time + 1,
            pid: std::process::id(),
            ..gone.clone()
        };
        std::fs::write(dir.join("1-1.json"), serde_json::to_vec(&reused).unwrap()).unwrap();
        assert!(live(&dir).is_empty());
    }

    #[test]
    fn start_time_reads_past_a_command_name_with_spaces() {
        let dir = tempfile_dir("stat");
        let mut fields = vec!["1".to_owned(), "(a) b (c)".to_owned()];
        fields.extend((3..=21).map(|i| i.to_string()));
        fields.push("123456".into());
        fields.push("99".into());
        std::fs::write(dir.join("stat"), fields.join(" ")).unwrap();
        assert_eq!(start_time(&dir), Some(123456));
    }

    fn tempfile_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "tessera-fake-nvml-load-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
