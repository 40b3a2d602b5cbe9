//! One MPS control daemon per device, started, adopted, restarted and
//! stopped by the driver itself.
//!
//! Layout under the supervisor's state directory, per device UUID:
//!
//! ```text
//! <state>/<uuid>/supervisor.json   host-only: claims holding the daemon, the daemon's identity
//! <state>/<uuid>/log/              host-only: CUDA_MPS_LOG_DIRECTORY, launcher.log (the daemon's output)
//! <state>/<uuid>/pipe/             CUDA_MPS_PIPE_DIRECTORY: the one directory mounted into containers
//! ```
//!
//! # What is trusted, and why
//!
//! The pipe directory is bind-mounted read-write into every Isolated
//! container on the device, in any namespace, and such a container may run
//! as root. So nothing found there is trusted:
//!
//! - The control daemon's pid file there ([`PID_FILE`]) is never read. The
//!   daemon runs in the foreground (`nvidia-cuda-mps-control -f`) as the
//!   driver's direct child, so the driver holds its [`Child`] handle; a
//!   daemon that outlived a driver restart is the process recorded as PID +
//!   start time + boot id in the host-only record, and is signalled and
//!   waited for through a pidfd opened and then checked against that record,
//!   so a recycled PID is never hit.
//! - The driver opens nothing there. It looks at the control endpoint with
//!   `lstat` (ready means a socket or fifo, never a symlink), unlinks stale
//!   names before a start (unlink does not follow symlinks), and removes the
//!   directory with the last claim (the standard library's `remove_dir_all`
//!   does not follow symlinks).
//! - No content from there (or from any log) reaches an error: errors, which
//!   end up in Pod events, name paths and conditions only.
//!
//! Trusted: the record and the log directory (never mounted into a
//! container), the `Child` and pidfd handles, and the kernel.
//!
//! The record is written atomically *before* a daemon is spawned, naming a
//! fresh random launch id that the daemon gets in its environment, and again
//! with the daemon's identity right after the spawn. A driver killed in
//! between finds its daemon on restart by that id: a secret kept host-only,
//! so no container can make another process carry it.
//!
//! # What this does not prevent
//!
//! - The daemon is stopped with `quit` through the control endpoint, sent
//!   only after `lstat` shows a socket; a container that swaps in a symlink
//!   in the instant between that check and the client's connect can send
//!   that one `quit` elsewhere. A daemon that does not exit is killed
//!   through its handle.
//! - What NVIDIA's control daemon itself does in its pipe directory (it
//!   writes its pid file there) is its own business.
//! - All claims on a device share its pipe directory and daemon: a container
//!   can disturb the other claims on that device (remove the endpoint, make
//!   the daemon quit). The watchdog restarts a daemon that died; isolation
//!   between clients of one daemon holds only by agreement (their limits
//!   are environment variables a process can drop).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::limits::{self, ClientLimits, LimitError, is_device_uuid};
use super::process::{self, Pidfd, ProcessId};
use crate::cdi;
use crate::claim_uid::ClaimUid;

/// File the control daemon writes its PID to, in its pipe directory. A
/// container can write it: the driver never reads it.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The control endpoint the daemon creates in its pipe directory when ready.
pub const CONTROL: &str = "control";
/// Where the control binary is found under the driver root by default.
pub const DEFAULT_CONTROL_BINARY: &str = "usr/bin/nvidia-cuda-mps-control";
/// Environment variable carrying a daemon's secret launch id (see the
/// module documentation).
pub const LAUNCH_ID_ENV: &str = "TESSERA_MPS_LAUNCH_ID";
/// The daemon's standard output and error, in its (host-only) log directory;
/// the previous run's is kept as `launcher.log.1`.
pub const LAUNCHER_LOG: &str = "launcher.log";

const RECORD: &str = "supervisor.json";
const POLL: Duration = Duration::from_millis(10);
/// How long a daemon may take to die after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Longest pipe directory accepted: Unix socket paths are limited to 107
/// bytes, and MPS puts sockets with names of a dozen or so characters in it.
const MAX_PIPE_DIR: usize = 90;

/// How the supervisor runs `nvidia-cuda-mps-control`.
#[derive(Debug, Clone)]
pub struct MpsConfig {
    /// The control binary (daemon with `-f`, client without).
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
    /// `CUDA_MPS_PIPE_DIRECTORY` on the host: what clients mount.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY` on the host: for the operator, never mounted
    /// into a container.
    pub log_dir: PathBuf,
    pub pid: i32,
}

/// Mount options for a pipe directory in a client container: clients
/// connect to sockets (and open pipes) there, they never need to execute or
/// open a device node from it.
pub const PIPE_MOUNT_OPTIONS: [&str; 5] = ["rw", "nosuid", "nodev", "noexec", "bind"];

impl MpsDaemon {
    /// CDI edits that make a container a client of this daemon: the pipe
    /// directory (only it) mounted at the same path and named by
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
                options: PIPE_MOUNT_OPTIONS.iter().map(|o| o.to_string()).collect(),
                mount_type: None,
            }],
        })
    }
}

/// What went wrong. Messages name devices, paths and conditions, never the
/// content of a file: they reach Pod events.
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
    #[error(
        "MPS for {device}: the control daemon (`{} -f`) {outcome} before creating {}; its output \
         is in {} on the node",
        binary.display(), pipe_dir.join(CONTROL).display(), log.display()
    )]
    LaunchFailed {
        device: String,
        binary: PathBuf,
        outcome: String,
        pipe_dir: PathBuf,
        log: PathBuf,
    },
    #[error(
        "MPS for {device}: the control daemon (pid {pid}) did not create {} (a socket) within \
         {waited:?} and was stopped; its logs are in {} on the node",
        pipe_dir.join(CONTROL).display(), log_dir.display()
    )]
    NotReady {
        device: String,
        pid: i32,
        waited: Duration,
        pipe_dir: PathBuf,
        log_dir: PathBuf,
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
    /// Recorded daemons found running that this supervisor had not seen yet
    /// (after a driver restart).
    pub adopted: Vec<String>,
    /// Devices with claims whose daemon was not running and was started.
    pub restarted: Vec<String>,
    /// Daemons without claims that were stopped.
    pub stopped: Vec<String>,
    /// Devices that need attention, with why.
    pub failed: Vec<(String, MpsError)>,
}

/// The state of one device, as recorded on disk (host-only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    claims: BTreeSet<ClaimUid>,
    /// The daemon this driver spawned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    daemon: Option<ProcessId>,
    /// The secret launch id of a daemon being spawned, until its identity
    /// is recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    launch: Option<String>,
}

struct Device {
    uuid: String,
    root: PathBuf,
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    record: Record,
    /// A handle on the recorded daemon, once this supervisor has one.
    handle: Option<Handle>,
}

/// The driver's own hold on its daemon.
enum Handle {
    /// Spawned by this supervisor: its PID stays ours until we reap it.
    Spawned(Child),
    /// Recorded by an earlier run, held through a checked pidfd.
    Adopted(Pidfd),
}

impl Handle {
    fn pid(&self) -> i32 {
        match self {
            Handle::Spawned(c) => c.id() as i32,
            Handle::Adopted(p) => p.id().pid,
        }
    }

    /// `None` while the daemon runs, how it ended once it has exited
    /// (reaping it).
    fn exit(&mut self) -> Option<String> {
        match self {
            Handle::Spawned(c) => match c.try_wait() {
                Ok(None) => None,
                Ok(Some(status)) => Some(format!("exited ({status})")),
                Err(e) => Some(format!("could not be waited for ({e})")),
            },
            Handle::Adopted(p) => p.wait(Duration::ZERO).then(|| "exited".to_owned()),
        }
    }

    /// Whether the daemon exited within `timeout`.
    fn wait(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        match self {
            Handle::Spawned(_) => loop {
                if self.exit().is_some() {
                    return true;
                }
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(POLL);
            },
            Handle::Adopted(p) => p.wait(timeout),
        }
    }

    fn kill(&mut self) -> std::io::Result<()> {
        match self {
            Handle::Spawned(c) => match c.kill() {
                // Already exited and reaped.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
                other => other,
            },
            Handle::Adopted(p) => p.kill(),
        }
    }
}

/// Whether the recorded daemon runs, as this supervisor knows it.
enum Liveness {
    /// Held by this supervisor already.
    Running,
    /// The recorded process runs and is now held (after a driver restart).
    Adopted,
    Dead,
}

/// How waiting for a daemon's control endpoint ended.
enum Readiness {
    Ready,
    Exited(String),
    TimedOut,
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
    /// holds a reference to it. Idempotent per claim. The daemon recorded
    /// there (after a driver restart) is adopted, a dead one is restarted,
    /// and a new one is waited for until its control endpoint exists.
    pub fn ensure(&self, device_uuid: &str, claim: &ClaimUid) -> Result<MpsDaemon, MpsError> {
        let device = self.device(device_uuid)?;
        let mut dev = lock(&device);
        let added = dev.record.claims.insert(claim.clone());
        if added {
            self.persist(&dev)?;
        }
        match self.ensure_running(&mut dev) {
            Ok(_) => Ok(dev.daemon()),
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
    /// (`quit`, then SIGKILL through the driver's handle if `quit` timed
    /// out). Unknown claims and devices succeed.
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
                self.stop_into(&mut dev, uuid, &mut report);
            }
        }
        report
    }

    /// One supervision pass over every device this supervisor has a record
    /// of (on disk or in memory): adopt recorded daemons, restart dead ones
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
                self.stop_into(&mut dev, uuid, &mut report);
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
            handle: None,
        }));
        devices.insert(uuid.to_owned(), Arc::clone(&device));
        Ok(device)
    }

    /// Devices with a record under the state dir or an in-memory entry.
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

    /// Whether the recorded daemon runs; takes hold of it if this supervisor
    /// has no handle yet, and forgets it once it has exited. Only the record
    /// and the kernel are consulted, never the pipe directory.
    fn liveness(&self, dev: &mut Device) -> Result<Liveness, MpsError> {
        if let Some(handle) = dev.handle.as_mut() {
            if handle.exit().is_none() {
                return Ok(Liveness::Running);
            }
            dev.handle = None;
            dev.record.daemon = None;
            self.persist(dev)?;
            return Ok(Liveness::Dead);
        }
        if let Some(launch) = dev.record.launch.take() {
            // An earlier run was killed between spawning a daemon and
            // recording it: the daemon carries the secret launch id.
            dev.record.daemon = dev
                .record
                .daemon
                .take()
                .or_else(|| process::find_by_env(&format!("{LAUNCH_ID_ENV}={launch}")));
            self.persist(dev)?;
        }
        let Some(id) = dev.record.daemon.clone() else {
            return Ok(Liveness::Dead);
        };
        let pidfd = Pidfd::open(&id).map_err(Self::io_err(
            dev,
            "taking hold of the recorded daemon (pidfd_open, Linux 5.3 or later)",
            Path::new(&format!("/proc/{}", id.pid)),
        ))?;
        match pidfd {
            Some(pidfd) => {
                dev.handle = Some(Handle::Adopted(pidfd));
                Ok(Liveness::Adopted)
            }
            None => {
                dev.record.daemon = None;
                self.persist(dev)?;
                Ok(Liveness::Dead)
            }
        }
    }

    fn ensure_running(&self, dev: &mut Device) -> Result<Outcome, MpsError> {
        let outcome = match self.liveness(dev)? {
            Liveness::Running => Outcome::AlreadyRunning,
            Liveness::Adopted => Outcome::Adopted,
            Liveness::Dead => {
                self.start(dev)?;
                return Ok(Outcome::Started);
            }
        };
        if endpoint_ready(&dev.pipe_dir) {
            return Ok(outcome);
        }
        // Alive without an endpoint: adopted half-started, or the endpoint
        // was removed under it. Give it a new daemon's grace, then replace it.
        let deadline = Instant::now() + self.config.ready_timeout;
        match self.wait_ready(dev, deadline) {
            Readiness::Ready => return Ok(outcome),
            Readiness::Exited(_) => {}
            Readiness::TimedOut => self.kill(dev)?,
        }
        self.start(dev)?;
        Ok(Outcome::Started)
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

    /// Spawn `nvidia-cuda-mps-control -f` as our child and wait for its
    /// control endpoint. Called only when no recorded daemon runs.
    fn start(&self, dev: &mut Device) -> Result<(), MpsError> {
        for dir in [&dev.root, &dev.pipe_dir, &dev.log_dir] {
            fs::create_dir_all(dir).map_err(Self::io_err(dev, "creating", dir))?;
        }
        // Leftovers of a daemon that died, or names a container planted: the
        // new daemon must not be mistaken for ready before it is, nor refuse
        // to start because of a pid file. Unlinking never follows a symlink.
        for name in [CONTROL, PID_FILE] {
            let path = dev.pipe_dir.join(name);
            ignore_missing(fs::remove_file(&path)).map_err(Self::io_err(
                dev,
                "removing stale",
                &path,
            ))?;
        }
        let launch = process::random_id().map_err(Self::io_err(
            dev,
            "drawing a launch id for",
            &dev.pipe_dir,
        ))?;
        dev.record.daemon = None;
        dev.record.launch = Some(launch.clone());
        self.persist(dev)?;

        let log = dev.log_dir.join(LAUNCHER_LOG);
        let out = open_launcher_log(&log).map_err(Self::io_err(dev, "creating", &log))?;
        let err = out
            .try_clone()
            .map_err(Self::io_err(dev, "opening", &log))?;
        let deadline = Instant::now() + self.config.ready_timeout;
        let spawned = self
            .command(dev)
            .arg("-f")
            .env(LAUNCH_ID_ENV, &launch)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Its own process group: signals meant for the driver's group (a
            // terminal's Ctrl-C) do not reach it; it outlives a driver restart
            // and is adopted by the next run.
            .process_group(0)
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(source) => {
                dev.record.launch = None;
                // The launch error is the one to report.
                let _ = self.persist(dev);
                return Err(MpsError::Launch {
                    device: dev.uuid.clone(),
                    binary: self.config.control_binary.clone(),
                    source,
                });
            }
        };
        // Our child: its PID cannot be reused before we reap it. `None` if it
        // already exited (waiting below says how).
        dev.record.daemon = ProcessId::of(child.id() as i32);
        dev.record.launch = None;
        dev.handle = Some(Handle::Spawned(child));
        if let Err(e) = self.persist(dev) {
            // Unrecorded, it could not be found again: do not leave it.
            let _ = self.kill(dev);
            return Err(e);
        }
        match self.wait_ready(dev, deadline) {
            Readiness::Ready => Ok(()),
            Readiness::Exited(outcome) => Err(MpsError::LaunchFailed {
                device: dev.uuid.clone(),
                binary: self.config.control_binary.clone(),
                outcome,
                pipe_dir: dev.pipe_dir.clone(),
                log,
            }),
            Readiness::TimedOut => {
                let pid = dev.handle.as_ref().map_or(0, Handle::pid);
                self.kill(dev)?;
                Err(MpsError::NotReady {
                    device: dev.uuid.clone(),
                    pid,
                    waited: self.config.ready_timeout,
                    pipe_dir: dev.pipe_dir.clone(),
                    log_dir: dev.log_dir.clone(),
                })
            }
        }
    }

    /// Poll until the held daemon's control endpoint exists, the daemon
    /// exits (then it is forgotten) or `deadline` passes.
    fn wait_ready(&self, dev: &mut Device, deadline: Instant) -> Readiness {
        loop {
            let Some(handle) = dev.handle.as_mut() else {
                return Readiness::Exited("is not running".into());
            };
            if let Some(outcome) = handle.exit() {
                dev.handle = None;
                dev.record.daemon = None;
                // Best effort: the record is checked against the kernel
                // before it is acted on anyway.
                let _ = self.persist(dev);
                return Readiness::Exited(outcome);
            }
            if endpoint_ready(&dev.pipe_dir) {
                return Readiness::Ready;
            }
            if Instant::now() >= deadline {
                return Readiness::TimedOut;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Stop the recorded daemon (if it runs), remove the pipe directory and,
    /// without claims, the record.
    fn stop(&self, dev: &mut Device) -> Result<(), MpsError> {
        if !matches!(self.liveness(dev)?, Liveness::Dead) {
            let asked = endpoint_ready(&dev.pipe_dir) && self.quit(dev);
            let quit = asked
                && dev
                    .handle
                    .as_mut()
                    .is_none_or(|h| h.wait(self.config.quit_timeout));
            if quit {
                dev.handle = None;
            } else {
                self.kill(dev)?;
            }
            dev.record.daemon = None;
        }
        // The pipe directory goes with the daemon (containers may have left
        // anything there; removal does not follow symlinks); the host-only
        // logs stay for debugging.
        ignore_missing(fs::remove_dir_all(&dev.pipe_dir)).map_err(Self::io_err(
            dev,
            "removing",
            &dev.pipe_dir,
        ))?;
        if dev.record.claims.is_empty() {
            let path = dev.root.join(RECORD);
            ignore_missing(fs::remove_file(&path)).map_err(Self::io_err(dev, "removing", &path))
        } else {
            self.persist(dev)
        }
    }

    /// [`MpsSupervisor::stop`] for a supervision pass, reporting into
    /// `report`.
    fn stop_into(&self, dev: &mut Device, uuid: String, report: &mut SupervisionReport) {
        let was_running = !matches!(self.liveness(dev), Ok(Liveness::Dead));
        match self.stop(dev) {
            Ok(()) if was_running => report.stopped.push(uuid),
            Ok(()) => {}
            Err(e) => report.failed.push((uuid, e)),
        }
    }

    /// `echo quit | nvidia-cuda-mps-control` with the device's pipe
    /// directory; whether the client ran. Its output is not read. Whether
    /// the daemon stopped is checked by the caller, on its handle.
    fn quit(&self, dev: &Device) -> bool {
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
            let _ = stdin.write_all(b"quit\n");
        }
        let deadline = Instant::now() + self.config.quit_timeout;
        loop {
            match client.try_wait() {
                Ok(Some(_)) => return true,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                _ => {
                    let _ = client.kill();
                    let _ = client.wait();
                    return false;
                }
            }
        }
    }

    /// SIGKILL the held daemon through its handle and wait until it is gone.
    fn kill(&self, dev: &mut Device) -> Result<(), MpsError> {
        let Some(handle) = dev.handle.as_mut() else {
            return Ok(());
        };
        let pid = handle.pid();
        handle.kill().map_err(|source| MpsError::Io {
            device: dev.uuid.clone(),
            what: "killing the daemon",
            path: PathBuf::from(format!("/proc/{pid}")),
            source,
        })?;
        if !handle.wait(KILL_WAIT) {
            return Err(MpsError::Unkillable {
                device: dev.uuid.clone(),
                pid,
                waited: KILL_WAIT,
            });
        }
        dev.handle = None;
        dev.record.daemon = None;
        self.persist(dev)
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

/// Whether the control endpoint is there: a socket (or fifo) itself, not a
/// symlink or anything else a container may have put in its place.
fn endpoint_ready(pipe_dir: &Path) -> bool {
    pipe_dir.join(CONTROL).symlink_metadata().is_ok_and(|m| {
        let t = m.file_type();
        t.is_socket() || t.is_fifo()
    })
}

/// A fresh launcher log in the host-only log directory; the previous one is
/// kept as `<name>.1`. Neither step follows a symlink.
fn open_launcher_log(path: &Path) -> std::io::Result<File> {
    let mut previous = path.as_os_str().to_owned();
    previous.push(".1");
    ignore_missing(fs::rename(path, &previous))?;
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o640)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

fn ignore_missing(result: std::io::Result<()>) -> std::io::Result<()> {
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
