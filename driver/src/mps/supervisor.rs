//! One MPS control daemon per device, started, adopted, restarted and
//! stopped by the driver itself.
//!
//! Layout under the supervisor's state directory, per device UUID:
//!
//! ```text
//! <state>/<uuid>/supervisor.json   claims holding the daemon, the daemon's identity
//! <state>/<uuid>/pipe/             CUDA_MPS_PIPE_DIRECTORY (control endpoint, pid file)
//! <state>/<uuid>/log/              CUDA_MPS_LOG_DIRECTORY (+ launcher.log: output of `-d`)
//! ```
//!
//! The record is written (atomically) *before* a daemon is started and after
//! every change, so a driver that crashes at any point finds, on restart,
//! which claims hold which device and which process it started. A daemon is
//! "ours" only as the exact process recorded (PID + start time + boot id);
//! only that process is ever killed, and only when `quit` did not stop it.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::limits::{self, ClientLimits, LimitError, is_device_uuid};
use super::process::{self, ProcessId};
use crate::cdi;
use crate::claim_uid::ClaimUid;

/// File the control daemon writes its PID to, in its pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The control endpoint the daemon creates in its pipe directory when ready.
pub const CONTROL: &str = "control";
/// Where the control binary is found under the driver root by default.
pub const DEFAULT_CONTROL_BINARY: &str = "usr/bin/nvidia-cuda-mps-control";

const RECORD: &str = "supervisor.json";
const LAUNCHER_LOG: &str = "launcher.log";
const POLL: Duration = Duration::from_millis(10);
/// Longest pipe directory accepted: Unix socket paths are limited to 107
/// bytes, and MPS puts sockets with names of a dozen or so characters in it.
const MAX_PIPE_DIR: usize = 90;

/// How the supervisor runs `nvidia-cuda-mps-control`.
#[derive(Debug, Clone)]
pub struct MpsConfig {
    /// The control binary (daemon with `-d`, client without).
    pub control_binary: PathBuf,
    /// Per-device pipe, log and record directories live under here.
    pub state_dir: PathBuf,
    /// How long a new daemon may take to create its control endpoint.
    pub ready_timeout: Duration,
    /// How long `quit` may take before the recorded process is killed.
    pub quit_timeout: Duration,
    /// Extra environment for the daemon and the client (e.g. the driver
    /// root's library path).
    pub env: Vec<(OsString, OsString)>,
}

impl MpsConfig {
    /// The control binary at its usual place under `driver_root` (`/` on a
    /// host install, e.g. `/run/nvidia/driver` with a containerized driver).
    pub fn new(driver_root: &Path, state_dir: impl Into<PathBuf>) -> Self {
        MpsConfig {
            control_binary: driver_root.join(DEFAULT_CONTROL_BINARY),
            state_dir: state_dir.into(),
            ready_timeout: Duration::from_secs(30),
            quit_timeout: Duration::from_secs(10),
            env: Vec::new(),
        }
    }
}

/// A running control daemon, as a client container needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDaemon {
    pub device_uuid: String,
    /// `CUDA_MPS_PIPE_DIRECTORY` on the host.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY` on the host.
    pub log_dir: PathBuf,
    pub pid: i32,
}

impl MpsDaemon {
    /// CDI edits that make a container a client of this daemon: the pipe
    /// directory mounted at the same path and named by
    /// `CUDA_MPS_PIPE_DIRECTORY`, plus the claim's limits if any. Device
    /// nodes and `CUDA_VISIBLE_DEVICES` are the device's own edits.
    pub fn client_edits(
        &self,
        limits: Option<ClientLimits>,
    ) -> Result<cdi::ContainerEdits, LimitError> {
        let pipe = self.pipe_dir.to_string_lossy().into_owned();
        let mut env = vec![format!("{}={pipe}", limits::PIPE_DIRECTORY)];
        if let Some(l) = limits {
            env.extend(limits::client_limit_env(&self.device_uuid, l)?);
        }
        Ok(cdi::ContainerEdits {
            env,
            device_nodes: vec![],
            mounts: vec![cdi::Mount {
                host_path: pipe.clone(),
                container_path: pipe,
                options: vec!["rw".into(), "nosuid".into(), "nodev".into(), "bind".into()],
                mount_type: None,
            }],
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error(
        "{0:?} is not a GPU or MIG device UUID in the form this driver manages MPS for \
         (GPU-... or MIG-..., letters, digits and '-')"
    )]
    BadDevice(String),
    #[error(
        "MPS for {device}: the pipe directory {} is {len} bytes long; MPS creates Unix sockets \
         there and a socket path must fit in 108 bytes; fix: give the driver a shorter MPS state \
         directory (at most {max} bytes for the pipe directory)",
        pipe_dir.display()
    )]
    PathTooLong {
        device: String,
        pipe_dir: PathBuf,
        len: usize,
        max: usize,
    },
    #[error("MPS for {device}: {what} {}: {source}", path.display())]
    Io {
        device: String,
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "MPS for {device}: cannot run the control binary {}: {source}; fix: install the NVIDIA \
         driver's nvidia-cuda-mps-control under the driver root or point the driver at it",
        binary.display()
    )]
    Launch {
        device: String,
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("MPS for {device}: `{} -d` {outcome}; its output: {output}", binary.display())]
    LaunchFailed {
        device: String,
        binary: PathBuf,
        outcome: String,
        output: String,
    },
    #[error(
        "MPS for {device}: the control daemon did not create {} within {waited:?}; logs in {}: {log}",
        pipe_dir.join(CONTROL).display(), log_dir.display()
    )]
    NotReady {
        device: String,
        waited: Duration,
        pipe_dir: PathBuf,
        log_dir: PathBuf,
        log: String,
    },
    #[error(
        "MPS for {device}: the control daemon (pid {pid}) did not quit within {waited:?} and is \
         not the process this driver started, so it was left running; stop it by hand (echo quit \
         | CUDA_MPS_PIPE_DIRECTORY={} nvidia-cuda-mps-control)",
        pipe_dir.display()
    )]
    WontQuit {
        device: String,
        pid: i32,
        waited: Duration,
        pipe_dir: PathBuf,
    },
    #[error("MPS for {device}: the control daemon (pid {pid}) survived SIGKILL for {waited:?}")]
    Unkillable {
        device: String,
        pid: i32,
        waited: Duration,
    },
}

/// What one supervision pass did.
#[derive(Debug, Default)]
pub struct SupervisionReport {
    /// Daemons found running that this supervisor had no live record of.
    pub adopted: Vec<String>,
    /// Devices with claims whose daemon was not running and was started.
    pub restarted: Vec<String>,
    /// Daemons without claims that were stopped.
    pub stopped: Vec<String>,
    /// Devices that need attention, with why.
    pub failed: Vec<(String, MpsError)>,
}

/// The state of one device, as recorded on disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    claims: BTreeSet<ClaimUid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    daemon: Option<ProcessId>,
}

struct Device {
    uuid: String,
    root: PathBuf,
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    record: Record,
}

/// What the pipe directory and the record say about a device's daemon.
enum Status {
    /// A live daemon owns the pipe directory and its endpoint exists.
    Running(ProcessId),
    /// A live daemon wrote its PID but has no endpoint (yet).
    Starting(i32),
    /// The recorded process lives but the pipe directory does not name it.
    Stray(ProcessId),
    Dead,
}

/// Supervises one MPS control daemon per device, reference-counted by claim.
///
/// Every method blocks (process spawns, polling with deadlines) and is safe
/// to call from several threads: calls for one device are serialized, calls
/// for different devices run in parallel.
pub struct MpsSupervisor {
    config: MpsConfig,
    devices: Mutex<BTreeMap<String, Arc<Mutex<Device>>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MpsSupervisor {
    /// A supervisor over `config.state_dir`. Nothing is started or stopped
    /// until a method is called; call [`MpsSupervisor::supervise`] at start
    /// to adopt daemons of a previous run and restart dead ones.
    pub fn new(config: MpsConfig) -> Self {
        MpsSupervisor {
            config,
            devices: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn config(&self) -> &MpsConfig {
        &self.config
    }

    /// Make sure a control daemon serves `device_uuid` and that `claim`
    /// holds a reference to it. Idempotent per claim. A daemon already
    /// running there (after a driver restart) is adopted, a dead one is
    /// restarted, and a new one is waited for until its control endpoint
    /// exists.
    pub fn ensure(&self, device_uuid: &str, claim: &ClaimUid) -> Result<MpsDaemon, MpsError> {
        let device = self.device(device_uuid)?;
        let mut dev = lock(&device);
        let added = dev.record.claims.insert(claim.clone());
        if added {
            self.persist(&dev)?;
        }
        let result = self.ensure_running(&mut dev).map(|_| ());
        match result {
            Ok(()) => Ok(dev.daemon()),
            Err(e) => {
                if added {
                    dev.record.claims.remove(claim);
                    // The daemon error is the one to report.
                    let _ = self.persist(&dev);
                }
                Err(e)
            }
        }
    }

    /// Drop `claim`'s reference; the last reference stops the daemon
    /// (`quit`, then SIGKILL of the recorded process if `quit` timed out).
    /// Unknown claims and devices succeed.
    pub fn release(&self, device_uuid: &str, claim: &ClaimUid) -> Result<(), MpsError> {
        if !is_device_uuid(device_uuid) {
            // Nothing was ever started for it.
            return Ok(());
        }
        let device = self.device(device_uuid)?;
        let mut dev = lock(&device);
        if dev.record.claims.remove(claim) {
            self.persist(&dev)?;
        }
        if dev.record.claims.is_empty() {
            self.stop(&mut dev)?;
        }
        Ok(())
    }

    /// Drop every claim for which `keep` is false (claims the checkpoint
    /// does not know after a crash), stopping daemons left without claims.
    pub fn retain_claims(&self, keep: impl Fn(&ClaimUid) -> bool) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        for uuid in self.known_devices() {
            let Ok(device) = self.device(&uuid) else {
                continue;
            };
            let mut dev = lock(&device);
            let before = dev.record.claims.len();
            dev.record.claims.retain(|c| keep(c));
            if dev.record.claims.len() != before
                && let Err(e) = self.persist(&dev)
            {
                report.failed.push((uuid.clone(), e));
                continue;
            }
            if dev.record.claims.is_empty() {
                let was_running = !matches!(self.status(&dev), Status::Dead);
                match self.stop(&mut dev) {
                    Ok(()) if was_running => report.stopped.push(uuid.clone()),
                    Ok(()) => {}
                    Err(e) => report.failed.push((uuid.clone(), e)),
                }
            }
        }
        report
    }

    /// One supervision pass over every device this supervisor has a record
    /// of (on disk or in memory): adopt running daemons, restart dead ones
    /// that still have claims, stop ones that have none. Call it at start
    /// and periodically ([`MpsSupervisor::spawn_watchdog`]).
    pub fn supervise(&self) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        for uuid in self.known_devices() {
            let device = match self.device(&uuid) {
                Ok(d) => d,
                Err(e) => {
                    report.failed.push((uuid, e));
                    continue;
                }
            };
            let mut dev = lock(&device);
            if dev.record.claims.is_empty() {
                let was_running = !matches!(self.status(&dev), Status::Dead);
                match self.stop(&mut dev) {
                    Ok(()) if was_running => report.stopped.push(uuid),
                    Ok(()) => {}
                    Err(e) => report.failed.push((uuid, e)),
                }
                continue;
            }
            match self.ensure_running(&mut dev) {
                Ok(Outcome::AlreadyRunning) => {}
                Ok(Outcome::Adopted) => report.adopted.push(uuid),
                Ok(Outcome::Started) => report.restarted.push(uuid),
                Err(e) => report.failed.push((uuid, e)),
            }
        }
        report
    }

    /// Run [`MpsSupervisor::supervise`] every `every` on a thread until the
    /// returned handle is dropped. `on_pass` sees each pass's report (to log
    /// or count restarts).
    pub fn spawn_watchdog(
        self: &Arc<Self>,
        every: Duration,
        on_pass: impl Fn(&SupervisionReport) + Send + 'static,
    ) -> Watchdog {
        let (stop, stopped) = mpsc::channel::<()>();
        let me = Arc::clone(self);
        let thread = std::thread::Builder::new()
            .name("mps-watchdog".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    on_pass(&me.supervise());
                }
            })
            .expect("spawning the MPS watchdog thread");
        Watchdog {
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Devices and the claims holding them, for status and metrics.
    pub fn claims(&self) -> BTreeMap<String, BTreeSet<ClaimUid>> {
        self.known_devices()
            .into_iter()
            .filter_map(|uuid| {
                let device = self.device(&uuid).ok()?;
                let claims = lock(&device).record.claims.clone();
                (!claims.is_empty()).then_some((uuid, claims))
            })
            .collect()
    }

    // -- internals -----------------------------------------------------------

    fn device(&self, uuid: &str) -> Result<Arc<Mutex<Device>>, MpsError> {
        if !is_device_uuid(uuid) {
            return Err(MpsError::BadDevice(uuid.to_owned()));
        }
        let mut devices = lock(&self.devices);
        if let Some(d) = devices.get(uuid) {
            return Ok(Arc::clone(d));
        }
        let root = self.config.state_dir.join(uuid);
        let pipe_dir = root.join("pipe");
        let len = pipe_dir.as_os_str().len();
        if len > MAX_PIPE_DIR {
            return Err(MpsError::PathTooLong {
                device: uuid.to_owned(),
                pipe_dir,
                len,
                max: MAX_PIPE_DIR,
            });
        }
        let record_path = root.join(RECORD);
        let record = match fs::read(&record_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| MpsError::Io {
                device: uuid.to_owned(),
                what: "reading the record",
                path: record_path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Record::default(),
            Err(e) => {
                return Err(MpsError::Io {
                    device: uuid.to_owned(),
                    what: "reading the record",
                    path: record_path,
                    source: e,
                });
            }
        };
        let device = Arc::new(Mutex::new(Device {
            uuid: uuid.to_owned(),
            pipe_dir,
            log_dir: root.join("log"),
            root,
            record,
        }));
        devices.insert(uuid.to_owned(), Arc::clone(&device));
        Ok(device)
    }

    /// Devices with a directory under the state dir or an in-memory entry.
    fn known_devices(&self) -> Vec<String> {
        let mut uuids: BTreeSet<String> = lock(&self.devices).keys().cloned().collect();
        if let Ok(entries) = fs::read_dir(&self.config.state_dir) {
            for entry in entries.flatten() {
                if let Some(name) = entry.file_name().to_str()
                    && is_device_uuid(name)
                    && entry.path().join(RECORD).exists()
                {
                    uuids.insert(name.to_owned());
                }
            }
        }
        uuids.into_iter().collect()
    }

    fn persist(&self, dev: &Device) -> Result<(), MpsError> {
        fs::create_dir_all(&dev.root).map_err(Self::io_err(dev, "creating", &dev.root))?;
        let path = dev.root.join(RECORD);
        let bytes = serde_json::to_vec_pretty(&dev.record).expect("a record serializes");
        cdi::write_atomically(&path, &bytes).map_err(Self::io_err(dev, "writing the record", &path))
    }

    fn status(&self, dev: &Device) -> Status {
        let pid = fs::read_to_string(dev.pipe_dir.join(PID_FILE))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        if let Some(pid) = pid
            && let Some(id) = ProcessId::of(pid)
        {
            if dev.pipe_dir.join(CONTROL).symlink_metadata().is_err() {
                return Status::Starting(pid);
            }
            // The recorded daemon, or one that answers on the control
            // endpoint (started before a crash, before it was recorded).
            // A recycled PID behind stale files is neither.
            if dev.record.daemon.as_ref() == Some(&id) || self.answers(dev) {
                return Status::Running(id);
            }
        }
        match &dev.record.daemon {
            Some(id) if id.is_running() => Status::Stray(id.clone()),
            _ => Status::Dead,
        }
    }

    /// Whether a daemon answers on the device's control endpoint
    /// (`get_server_list` through the client).
    fn answers(&self, dev: &Device) -> bool {
        let Ok(mut client) = self
            .command(dev)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        else {
            return false;
        };
        if let Some(mut stdin) = client.stdin.take() {
            let _ = stdin.write_all(b"get_server_list\n");
        }
        match wait_child(&mut client, Instant::now() + self.config.quit_timeout) {
            Some(status) => status.success(),
            None => {
                let _ = client.kill();
                let _ = client.wait();
                false
            }
        }
    }

    fn ensure_running(&self, dev: &mut Device) -> Result<Outcome, MpsError> {
        match self.status(dev) {
            Status::Running(id) => {
                if dev.record.daemon.as_ref() == Some(&id) {
                    Ok(Outcome::AlreadyRunning)
                } else {
                    dev.record.daemon = Some(id);
                    self.persist(dev)?;
                    Ok(Outcome::Adopted)
                }
            }
            Status::Starting(_) => {
                // Launched before a crash, or by someone else: give it the
                // same grace a new daemon gets.
                let id = self.wait_ready(dev, Instant::now() + self.config.ready_timeout)?;
                let adopted = dev.record.daemon.as_ref() != Some(&id);
                dev.record.daemon = Some(id);
                self.persist(dev)?;
                Ok(if adopted {
                    Outcome::Adopted
                } else {
                    Outcome::AlreadyRunning
                })
            }
            Status::Stray(id) => {
                self.kill_and_wait(dev, &id)?;
                self.start(dev)?;
                Ok(Outcome::Started)
            }
            Status::Dead => {
                self.start(dev)?;
                Ok(Outcome::Started)
            }
        }
    }

    fn io_err(
        dev: &Device,
        what: &'static str,
        path: &Path,
    ) -> impl FnOnce(std::io::Error) -> MpsError {
        let device = dev.uuid.clone();
        let path = path.to_owned();
        move |source| MpsError::Io {
            device,
            what,
            path,
            source,
        }
    }

    fn command(&self, dev: &Device) -> Command {
        let mut cmd = Command::new(&self.config.control_binary);
        cmd.env("CUDA_VISIBLE_DEVICES", &dev.uuid)
            .env(limits::PIPE_DIRECTORY, &dev.pipe_dir)
            .env(limits::LOG_DIRECTORY, &dev.log_dir)
            .envs(self.config.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    fn start(&self, dev: &mut Device) -> Result<(), MpsError> {
        for dir in [&dev.pipe_dir, &dev.log_dir] {
            fs::create_dir_all(dir).map_err(Self::io_err(dev, "creating", dir))?;
        }
        // Leftovers of a daemon that died (status said so): the new one
        // must not be mistaken for ready before it is.
        for name in [CONTROL, PID_FILE] {
            let path = dev.pipe_dir.join(name);
            ignore_missing(fs::remove_file(&path)).map_err(Self::io_err(
                dev,
                "removing stale",
                &path,
            ))?;
        }
        dev.record.daemon = None;
        self.persist(dev)?;

        let launcher_log = dev.log_dir.join(LAUNCHER_LOG);
        let out =
            File::create(&launcher_log).map_err(Self::io_err(dev, "creating", &launcher_log))?;
        let err = out
            .try_clone()
            .map_err(Self::io_err(dev, "opening", &launcher_log))?;
        let deadline = Instant::now() + self.config.ready_timeout;
        let mut launcher = self
            .command(dev)
            .arg("-d")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|source| MpsError::Launch {
                device: dev.uuid.clone(),
                binary: self.config.control_binary.clone(),
                source,
            })?;
        let launched = wait_child(&mut launcher, deadline);
        let failure = match launched {
            Some(status) if status.success() => None,
            Some(status) => Some(format!("exited with {status}")),
            None => {
                // The PID we started: only it is killed.
                let _ = launcher.kill();
                let _ = launcher.wait();
                Some(format!(
                    "did not return within {:?}",
                    self.config.ready_timeout
                ))
            }
        };
        if let Some(outcome) = failure {
            return Err(MpsError::LaunchFailed {
                device: dev.uuid.clone(),
                binary: self.config.control_binary.clone(),
                outcome,
                output: tail(&launcher_log),
            });
        }
        let id = self.wait_ready(dev, deadline)?;
        dev.record.daemon = Some(id);
        self.persist(dev)
    }

    /// Poll until the pipe directory names a live daemon with its control
    /// endpoint. A daemon that misses the deadline is recorded (we started
    /// it or are adopting it) and killed, so a retry starts clean.
    fn wait_ready(&self, dev: &mut Device, deadline: Instant) -> Result<ProcessId, MpsError> {
        let started = Instant::now();
        loop {
            match self.status(dev) {
                Status::Running(id) => return Ok(id),
                Status::Starting(pid) if Instant::now() >= deadline => {
                    if let Some(id) = ProcessId::of(pid) {
                        let _ = self.kill_and_wait(dev, &id);
                    }
                    break;
                }
                Status::Starting(_) => {}
                // Launched, then died (or never wrote its PID).
                _ if Instant::now() >= deadline => break,
                _ => {}
            }
            std::thread::sleep(POLL);
        }
        Err(MpsError::NotReady {
            device: dev.uuid.clone(),
            waited: started.elapsed(),
            pipe_dir: dev.pipe_dir.clone(),
            log_dir: dev.log_dir.clone(),
            log: [LAUNCHER_LOG, "control.log"]
                .iter()
                .map(|f| format!("{f}: {}", tail(&dev.log_dir.join(f))))
                .collect::<Vec<_>>()
                .join("; "),
        })
    }

    fn stop(&self, dev: &mut Device) -> Result<(), MpsError> {
        let target = match self.status(dev) {
            Status::Dead => None,
            Status::Running(id) => {
                self.quit(dev);
                Some(id.pid)
            }
            Status::Starting(pid) => Some(pid),
            Status::Stray(id) => Some(id.pid),
        };
        if let Some(pid) = target {
            let deadline = Instant::now() + self.config.quit_timeout;
            while process::alive(pid) && Instant::now() < deadline {
                std::thread::sleep(POLL);
            }
            if process::alive(pid) {
                match dev.record.daemon.clone() {
                    Some(id) if id.pid == pid && id.is_running() => self.kill_and_wait(dev, &id)?,
                    _ => {
                        return Err(MpsError::WontQuit {
                            device: dev.uuid.clone(),
                            pid,
                            waited: self.config.quit_timeout,
                            pipe_dir: dev.pipe_dir.clone(),
                        });
                    }
                }
            }
            process::reap(pid);
        }
        // The pipe directory goes with the daemon; logs stay for debugging.
        ignore_missing(fs::remove_dir_all(&dev.pipe_dir)).map_err(Self::io_err(
            dev,
            "removing",
            &dev.pipe_dir,
        ))?;
        dev.record.daemon = None;
        if dev.record.claims.is_empty() {
            let path = dev.root.join(RECORD);
            ignore_missing(fs::remove_file(&path)).map_err(Self::io_err(dev, "removing", &path))
        } else {
            self.persist(dev)
        }
    }

    /// `echo quit | nvidia-cuda-mps-control` with the device's pipe
    /// directory. Best effort: whether the daemon stopped is checked by the
    /// caller.
    fn quit(&self, dev: &Device) {
        let Ok(mut client) = self
            .command(dev)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        else {
            return;
        };
        if let Some(mut stdin) = client.stdin.take() {
            let _ = stdin.write_all(b"quit\n");
        }
        if wait_child(&mut client, Instant::now() + self.config.quit_timeout).is_none() {
            let _ = client.kill();
            let _ = client.wait();
        }
    }

    fn kill_and_wait(&self, dev: &Device, id: &ProcessId) -> Result<(), MpsError> {
        process::kill(id).map_err(|e| Self::io_err(dev, "killing the daemon", &dev.pipe_dir)(e))?;
        let waited = Duration::from_secs(5);
        let deadline = Instant::now() + waited;
        while id.is_running() {
            if Instant::now() >= deadline {
                return Err(MpsError::Unkillable {
                    device: dev.uuid.clone(),
                    pid: id.pid,
                    waited,
                });
            }
            std::thread::sleep(POLL);
        }
        process::reap(id.pid);
        Ok(())
    }
}

enum Outcome {
    AlreadyRunning,
    Adopted,
    Started,
}

impl Device {
    fn daemon(&self) -> MpsDaemon {
        MpsDaemon {
            device_uuid: self.uuid.clone(),
            pipe_dir: self.pipe_dir.clone(),
            log_dir: self.log_dir.clone(),
            pid: self.record.daemon.as_ref().map_or(0, |d| d.pid),
        }
    }
}

/// Stops the watchdog thread when dropped.
pub struct Watchdog {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ignore_missing(result: std::io::Result<()>) -> std::io::Result<()> {
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

fn wait_child(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
            _ => return None,
        }
    }
}

/// The last few hundred bytes of a log file, for error messages.
fn tail(path: &Path) -> String {
    const MAX: u64 = 600;
    let Ok(mut f) = File::open(path) else {
        return "(none)".into();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(MAX)));
    let mut bytes = Vec::new();
    let _ = f.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim();
    if text.is_empty() {
        "(empty)".into()
    } else {
        text.replace('\n', " | ")
    }
}
