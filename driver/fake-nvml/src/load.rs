//! What the simulated GPUs are doing: the memory processes hold on them
//! and whether their kernels run, as the kernel driver knows it on a real
//! machine.
//!
//! On a real GPU that knowledge lives in the kernel driver, per process:
//! no process can write another's, remove its own, or hide from NVML. The
//! simulated one keeps it where only the process itself can: each process
//! that uses the simulated libcuda holds its [`Record`] in an anonymous
//! memory file of its own ([`Channel`], a `memfd` named [`MEMFD_NAME`]),
//! and the fake NVML finds the records by walking `/proc/<pid>/fd`. A
//! record counts only when the process holding it is the process it names
//! (the inode of its pid namespace, its pid there and its start time), so
//! a process cannot speak for another (an inherited copy of the file names
//! the process that wrote it, not the holder), and nothing outside the
//! process can change or delete what it holds. It goes with the process:
//! a killed process's memory is freed, as on hardware.
//!
//! A reader sees the records of the processes its `/proc` shows and may
//! read: a process on the host finds every container's processes under
//! their host pids, as real NVML reports them; a process in a container
//! finds only its own container's. Files are opened through `/proc`
//! without blocking and must be small regular files: a holder cannot make
//! a reader hang or read without end.
//!
//! [`LOAD_ENV`] turns the channel on (any non-empty value) for writers and
//! readers alike: unset, no process records its load and every GPU is idle.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Environment variable that turns load recording on (any non-empty value;
/// the harness sets `1`). Unset or empty: every GPU is idle.
pub const LOAD_ENV: &str = "TESSERA_FAKE_NVML_LOAD";

/// The name every process's load file carries (`/memfd:<name> (deleted)`
/// in `/proc/<pid>/fd`).
pub const MEMFD_NAME: &str = "tessera-fake-gpu-load";

/// The largest record a reader takes: a process with hundreds of devices
/// stays far below it.
const MAX_RECORD_BYTES: u64 = 64 * 1024;

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
    /// It reaches the device as a client of an MPS server: NVML lists it
    /// among the MPS compute processes, not the plain ones.
    #[serde(default)]
    pub mps_client: bool,
}

impl Record {
    /// This process's identity, with no devices yet; `None` where `/proc`
    /// does not say.
    pub fn for_this_process() -> Option<Record> {
        Record::of_process(Path::new("/proc/self"))
    }

    /// The identity of the process `/proc/<pid>` (`dir`) describes, with no
    /// devices.
    pub fn of_process(dir: &Path) -> Option<Record> {
        Record::numbered(dir, None)
    }

    /// [`Record::of_process`], where `numbering` is the pid namespace whose
    /// pids name the directories of `dir`'s `/proc` (when known): a process
    /// in it has its directory's name as its own pid, and its `status`
    /// (long, and made by the kernel at each read) is not read.
    fn numbered(dir: &Path, numbering: Option<u64>) -> Option<Record> {
        let pid_namespace = std::fs::metadata(dir.join("ns/pid")).ok()?.ino();
        let named = dir.file_name()?.to_str()?.parse::<u32>().ok();
        let pid = match named {
            Some(pid) if numbering == Some(pid_namespace) => pid,
            _ => innermost_pid(dir)?,
        };
        Some(Record {
            pid_namespace,
            pid,
            start_time: start_time(dir)?,
            devices: Vec::new(),
        })
    }

    /// Nothing held and nothing running: the record says nothing.
    fn idle(&self) -> bool {
        let now = now_ms();
        self.devices
            .iter()
            .all(|d| d.memory_bytes == 0 && d.busy_until_ms <= now)
    }
}

/// The file a process keeps its record in.
#[derive(Debug)]
pub struct Channel {
    file: File,
}

impl Channel {
    /// A new load file, closed on exec (what the simulated libcuda opens).
    pub fn open() -> std::io::Result<Channel> {
        Channel::create(libc::MFD_CLOEXEC)
    }

    /// A load file a child process inherits: how a test gives a process it
    /// starts a record of its own (write the child's record after it
    /// started, then drop this side).
    pub fn inheritable() -> std::io::Result<Channel> {
        Channel::create(0)
    }

    fn create(flags: libc::c_uint) -> std::io::Result<Channel> {
        let name = CString::new(MEMFD_NAME).expect("no NUL in the name");
        // SAFETY: a valid C string; the result is checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new descriptor this process owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Channel { file })
    }

    /// Replaces what the file says with `record` (nothing, once it is
    /// idle). A reader that catches a write half done sees a record that
    /// does not parse, and reads again.
    pub fn publish(&self, record: &Record) -> std::io::Result<()> {
        if record.idle() {
            return self.file.set_len(0);
        }
        let mut bytes = serde_json::to_vec(record).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
        self.file.write_all_at(&bytes, 0)?;
        self.file.set_len(bytes.len() as u64)
    }

    /// The descriptor, for a test that checks what a child inherited.
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

/// Milliseconds after the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether this process was told to record and read load.
pub fn enabled_from_env() -> bool {
    std::env::var_os(LOAD_ENV).is_some_and(|v| !v.is_empty())
}

/// A record whose process is running, under the pid this process's `/proc`
/// knows it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    pub pid: u32,
    pub record: Record,
}

/// The records of the running processes this process can see, by pid.
pub fn live() -> Vec<Live> {
    live_in(Path::new("/proc"))
}

fn live_in(proc: &Path) -> Vec<Live> {
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    let numbering = numbering(proc);
    let mut live: Vec<Live> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let record = held_by(&proc.join(pid.to_string()), numbering)?;
            Some(Live { pid, record })
        })
        .collect();
    live.sort_by_key(|l| l.pid);
    live
}

/// The pid namespace whose pids name `proc`'s directories, when known:
/// that of its pid 1 (the namespace's init), or this process's own when
/// `proc` knows it by one pid only (then it is in that namespace).
fn numbering(proc: &Path) -> Option<u64> {
    if let Ok(init) = std::fs::metadata(proc.join("1/ns/pid")) {
        return Some(init.ino());
    }
    let status = std::fs::read_to_string(proc.join("self/status")).ok()?;
    let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    if nspid.split_whitespace().count() != 1 {
        return None;
    }
    std::fs::metadata(proc.join("self/ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// The record process `dir` (`/proc/<pid>`) holds about itself, if any;
/// several files naming it (a library loaded twice) add up.
fn held_by(dir: &Path, numbering: Option<u64>) -> Option<Record> {
    let fds = Descriptors::open(&dir.join("fd"))?;
    let mut identity: Option<Record> = None;
    let mut held: Option<Record> = None;
    for fd in fds.names() {
        if !fds.is_load(&fd) {
            continue;
        }
        let Some(record) = fds.open_file(&fd).and_then(read_record) else {
            continue;
        };
        let me = match &identity {
            Some(me) => me,
            None => identity.insert(Record::numbered(dir, numbering)?),
        };
        let names_holder = record.pid_namespace == me.pid_namespace
            && record.pid == me.pid
            && record.start_time == me.start_time;
        if names_holder {
            match &mut held {
                Some(h) => h.devices.extend(record.devices),
                None => held = Some(record),
            }
        }
    }
    held
}

/// A process's descriptor directory (`/proc/<pid>/fd`), held open: each
/// link is read and opened relative to it, not walked to from `/` again.
/// A walk reads every descriptor of every process, so this is what its
/// time goes to.
struct Descriptors {
    dir: std::ptr::NonNull<libc::DIR>,
}

impl Descriptors {
    fn open(path: &Path) -> Option<Descriptors> {
        let path = CString::new(path.as_os_str().as_bytes()).ok()?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
        // SAFETY: a valid C string; the result is checked.
        let fd = unsafe { libc::open(path.as_ptr(), flags) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is an open directory this function owns; on success
        // the stream owns it, on failure it is closed here.
        match std::ptr::NonNull::new(unsafe { libc::fdopendir(fd) }) {
            Some(dir) => Some(Descriptors { dir }),
            None => {
                // SAFETY: `fd` is still ours.
                unsafe { libc::close(fd) };
                None
            }
        }
    }

    fn fd(&self) -> libc::c_int {
        // SAFETY: `dir` is an open stream until drop.
        unsafe { libc::dirfd(self.dir.as_ptr()) }
    }

    /// The descriptor numbers, as names.
    fn names(&self) -> Vec<CString> {
        let mut names = Vec::new();
        loop {
            // SAFETY: `dir` is an open stream; an entry stays valid until
            // the next call, and its name is copied before that.
            let entry = unsafe { libc::readdir64(self.dir.as_ptr()) };
            if entry.is_null() {
                return names;
            }
            // SAFETY: `d_name` of a returned entry is a NUL-terminated name.
            let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) };
            if name.to_bytes().first().is_some_and(u8::is_ascii_digit) {
                names.push(name.to_owned());
            }
        }
    }

    /// Whether descriptor `name` is a load file: `/memfd:<MEMFD_NAME>...`.
    fn is_load(&self, name: &std::ffi::CStr) -> bool {
        let mut target = [0u8; 64];
        // SAFETY: a valid C string relative to our open directory, into a
        // buffer of the length given.
        let n = unsafe {
            libc::readlinkat(
                self.fd(),
                name.as_ptr(),
                target.as_mut_ptr().cast(),
                target.len(),
            )
        };
        let Ok(n) = usize::try_from(n) else {
            return false;
        };
        target[..n]
            .strip_prefix(b"/memfd:")
            .is_some_and(|t| t.starts_with(MEMFD_NAME.as_bytes()))
    }

    /// Descriptor `name` opened for reading without blocking (it may have
    /// been swapped for a FIFO since it was looked at).
    fn open_file(&self, name: &std::ffi::CStr) -> Option<File> {
        let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
        // SAFETY: a valid C string relative to our open directory; the
        // result is checked.
        let fd = unsafe { libc::openat(self.fd(), name.as_ptr(), flags) };
        // SAFETY: a new descriptor this process owns.
        (fd >= 0).then(|| File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: the stream is open and closed once, here.
        unsafe { libc::closedir(self.dir.as_ptr()) };
    }
}

/// A load file's record, taken only when the file is a small regular
/// file; a write caught half done is read again.
fn read_record(file: File) -> Option<Record> {
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() == 0 || meta.len() > MAX_RECORD_BYTES {
        return None;
    }
    for _ in 0..3 {
        let len = file.metadata().ok()?.len().min(MAX_RECORD_BYTES);
        let mut bytes = vec![0; len as usize];
        let n = file.read_at(&mut bytes, 0).ok()?;
        bytes.truncate(n);
        if let Ok(record) = serde_json::from_slice(&bytes) {
            return Some(record);
        }
    }
    None
}

/// The pid a process has in its own pid namespace: the last `NSpid` entry.
fn innermost_pid(dir: &Path) -> Option<u32> {
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
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
    /// The library's tests hold records in this process too: take turns.
    use crate::sync::Locked;
    use crate::tests::SERIAL as ONE_AT_A_TIME;

    fn load(uuid: &str, memory_bytes: u64) -> DeviceLoad {
        DeviceLoad {
            uuid: uuid.into(),
            memory_bytes,
            busy_until_ms: 0,
            sm_percent: 100,
            mps_client: false,
        }
    }

    fn found(pid: u32) -> Option<Record> {
        live().into_iter().find(|l| l.pid == pid).map(|l| l.record)
    }

    #[test]
    fn a_running_process_is_found_under_its_pid_until_it_holds_nothing() {
        let _turn = ONE_AT_A_TIME.locked();
        let channel = Channel::open().unwrap();
        let mine = Record {
            devices: vec![load("GPU-a", 1 << 30)],
            ..Record::for_this_process().expect("/proc says who this process is")
        };
        channel.publish(&mine).unwrap();
        assert_eq!(found(std::process::id()), Some(mine.clone()));
        let idle = Record {
            devices: vec![load("GPU-a", 0)],
            ..mine
        };
        channel.publish(&idle).unwrap();
        assert_eq!(found(std::process::id()), None);
    }

    #[test]
    fn a_record_speaks_only_for_the_process_holding_it() {
        let _turn = ONE_AT_A_TIME.locked();
        let channel = Channel::inheritable().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let dir = Path::new("/proc").join(child.id().to_string());
        let theirs = Record {
            devices: vec![load("GPU-a", 2 << 30)],
            ..Record::of_process(&dir).unwrap()
        };
        channel.publish(&theirs).unwrap();
        // Written here, naming the child: this process holds a copy too,
        // but a record counts for the process it names only.
        assert_eq!(found(child.id()), Some(theirs.clone()));
        assert_eq!(found(std::process::id()), None);
        drop(channel);
        assert_eq!(found(child.id()), Some(theirs.clone()));

        // A record this process writes in its own file, naming the child
        // (a forgery), counts for neither.
        let forged = Channel::open().unwrap();
        let other_claim = Record {
            devices: vec![load("GPU-b", 4 << 30)],
            ..theirs.clone()
        };
        forged.publish(&other_claim).unwrap();
        assert_eq!(found(child.id()), Some(theirs));
        assert_eq!(found(std::process::id()), None);

        // The child ends: what it held goes with it.
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found(child.id()), None);
    }

    /// A process in a pid namespace of its own (a container's) is found
    /// under the pid this `/proc` knows it by, with the record naming it
    /// by its own pid there; `/proc` here numbers by this process's
    /// namespace, which the walk takes as known.
    #[test]
    fn a_process_in_its_own_pid_namespace_is_found_by_its_own_pid() {
        let _turn = ONE_AT_A_TIME.locked();
        let mine = std::fs::metadata("/proc/self/ns/pid").unwrap().ino();
        assert_eq!(numbering(Path::new("/proc")), Some(mine));
        let channel = Channel::inheritable().unwrap();
        let spawned = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "sleep", "30"])
            .spawn();
        let Ok(unshare) = spawned else {
            println!("*** SKIPPED: no unshare(1) to make a pid namespace");
            return;
        };
        // Ended however the test ends (--kill-child takes the sleep along).
        struct Ends(std::process::Child);
        impl Drop for Ends {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut unshare = Ends(unshare);
        let children = format!("/proc/{0}/task/{0}/children", unshare.0.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let sleeper: u32 = loop {
            let comm = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/comm"));
            let child = std::fs::read_to_string(&children).unwrap_or_default();
            let child = child.split_whitespace().next().unwrap_or("").to_owned();
            if !child.is_empty() && comm(&child).is_ok_and(|c| c.trim() == "sleep") {
                break child.parse().unwrap();
            }
            if unshare.0.try_wait().unwrap().is_some() {
                println!("*** SKIPPED: unshare --pid is not permitted here");
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no sleep in a pid namespace"
            );
            std::thread::yield_now();
        };
        let dir = Path::new("/proc").join(sleeper.to_string());
        let theirs = Record {
            devices: vec![load("GPU-a", 1 << 30)],
            ..Record::of_process(&dir).unwrap()
        };
        assert_eq!(theirs.pid, 1, "the first process of its namespace");
        assert_ne!(theirs.pid_namespace, mine);
        channel.publish(&theirs).unwrap();
        assert_eq!(found(sleeper), Some(theirs));
    }

    #[test]
    fn start_time_reads_past_a_command_name_with_spaces() {
        let dir = std::env::temp_dir().join(format!(
            "tessera-fake-nvml-load-{}-stat",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut fields = vec!["1".to_owned(), "(a) b (c)".to_owned()];
        fields.extend((3..=21).map(|i| i.to_string()));
        fields.push("123456".into());
        fields.push("99".into());
        std::fs::write(dir.join("stat"), fields.join(" ")).unwrap();
        assert_eq!(start_time(&dir), Some(123456));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
