//! The MPS control daemons of a node: one per request of an Isolated claim
//! (or an MPS config) on each device it holds, started at prepare with the
//! claim's limits as the daemon's defaults, adopted after a driver restart,
//! restarted (in a fresh pipe directory) if it died, and stopped at
//! unprepare. See [`super::daemon`] for one daemon's layout and what is
//! trusted.
//!
//! No daemon is shared between claims: a tenant that quits or tampers with
//! its daemon reaches only its own claim, and a daemon's limits are its
//! defaults for every client, not a request a client's environment makes.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::daemon::{CONTROL, Daemon, DaemonKey, MpsDaemon, Outcome, RECORD, ignore_missing};
use super::launch::HostCgroup;
use super::limits::{ClientLimits, LimitError, is_device_uuid};
use super::process::{Pidfd, ProcessId};
use super::tmpfs::ShmPolicy;
use crate::claim_uid::ClaimUid;

/// Where the control binary is found under the driver root by default.
pub const DEFAULT_CONTROL_BINARY: &str = "usr/bin/nvidia-cuda-mps-control";

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
    /// The host cgroup daemons move into, so that they outlive the node
    /// process's container; `None`: they stay in the node process's.
    pub host_cgroup: Option<Arc<HostCgroup>>,
    /// The bounds of each daemon's `/dev/shm` and pipe directory.
    pub shm: ShmPolicy,
    /// The driver's files a daemon sees (read-only) besides the system's.
    pub driver_root: PathBuf,
    /// Where the GPU device nodes a daemon sees are (`<dev_root>/dev`).
    pub dev_root: PathBuf,
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
            host_cgroup: None,
            shm: ShmPolicy::default(),
            driver_root: driver_root.to_owned(),
            dev_root: driver_root.to_owned(),
        }
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
    #[error("MPS for {device}: {source}")]
    Limits { device: String, source: LimitError },
    #[error(
        "MPS for {device}: the control daemon did not accept its default limits \
         (set_default_active_thread_percentage, set_default_device_pinned_mem_limit) and was \
         stopped rather than serve without them; its logs are in {} on the node",
        log_dir.display()
    )]
    LimitsRefused { device: String, log_dir: PathBuf },
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
    pub adopted: Vec<DaemonKey>,
    /// Daemons that were not running and were started again.
    pub restarted: Vec<DaemonKey>,
    /// Daemons of claims no longer prepared, stopped.
    pub stopped: Vec<DaemonKey>,
    /// Daemons that need attention, with why.
    pub failed: Vec<(String, MpsError)>,
}

/// Supervises the node's MPS control daemons, one per [`DaemonKey`].
///
/// Every method blocks (process spawns, polling with deadlines) and is safe
/// to call from several threads: calls for one daemon are serialized, calls
/// for different daemons run in parallel.
pub struct MpsSupervisor {
    config: MpsConfig,
    daemons: Mutex<BTreeMap<DaemonKey, Arc<Mutex<Daemon>>>>,
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
            daemons: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn config(&self) -> &MpsConfig {
        &self.config
    }

    /// Make sure the daemon of `key` runs with `limits` as its defaults.
    /// Idempotent: a recorded daemon (after a driver restart) is adopted, a
    /// dead one is started again in a fresh pipe directory, and a new one is
    /// waited for until its control endpoint exists and it took the limits.
    pub fn ensure(&self, key: &DaemonKey, limits: ClientLimits) -> Result<MpsDaemon, MpsError> {
        let daemon = self.daemon(key, Some(limits))?.expect("made when missing");
        let mut d = lock(&daemon);
        if d.record.limits != limits {
            // Prepared again with other limits (an earlier prepare was
            // rolled back): the running daemon has the old defaults.
            d.kill()?;
            d.record.limits = limits;
        }
        d.persist()?;
        match d.ensure_running(&self.config) {
            Ok(_) => Ok(d.info()),
            Err(e) => {
                // Nothing half-made stays: the daemon error is the one to
                // report.
                let _ = d.stop(&self.config);
                drop(d);
                lock(&self.daemons).remove(key);
                Err(e)
            }
        }
    }

    /// Stop the daemon of `key` (`quit`, then SIGKILL through the driver's
    /// handle if `quit` timed out) and remove its directory. Unknown keys
    /// succeed.
    pub fn release(&self, key: &DaemonKey) -> Result<(), MpsError> {
        if !is_device_uuid(&key.device) {
            // Nothing was ever started for it.
            return Ok(());
        }
        self.stop(key).map(|_| ())
    }

    /// Stop the daemons of every claim for which `keep` is false (claims the
    /// checkpoint does not know after a crash).
    pub fn retain_claims(&self, keep: impl Fn(&ClaimUid) -> bool) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        for key in self.known_daemons(&mut report) {
            if keep(&key.claim) {
                continue;
            }
            match self.stop(&key) {
                Ok(true) => report.stopped.push(key),
                Ok(false) => {}
                Err(e) => report.failed.push((key.to_string(), e)),
            }
        }
        report
    }

    /// Stop a daemon and forget it; whether it was running.
    fn stop(&self, key: &DaemonKey) -> Result<bool, MpsError> {
        let Some(daemon) = self.daemon(key, None)? else {
            return Ok(false);
        };
        let was_running = lock(&daemon).stop(&self.config)?;
        lock(&self.daemons).remove(key);
        remove_if_empty(&self.config.state_dir.join(key.claim.as_str()));
        Ok(was_running)
    }

    /// One supervision pass over every daemon this supervisor has a record
    /// of (on disk or in memory): adopt recorded daemons and restart dead
    /// ones. Call it at start and periodically
    /// ([`MpsSupervisor::spawn_watchdog`]).
    pub fn supervise(&self) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        for key in self.known_daemons(&mut report) {
            let daemon = match self.daemon(&key, None) {
                Ok(Some(d)) => d,
                Ok(None) => continue,
                Err(e) => {
                    report.failed.push((key.to_string(), e));
                    continue;
                }
            };
            let mut d = lock(&daemon);
            match d.ensure_running(&self.config) {
                Ok(Outcome::AlreadyRunning) => {}
                Ok(Outcome::Adopted) => report.adopted.push(key),
                Ok(Outcome::Started) => report.restarted.push(key),
                Err(e) => report.failed.push((key.to_string(), e)),
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

    /// The daemons recorded, for status and metrics.
    pub fn daemons(&self) -> Vec<MpsDaemon> {
        let mut report = SupervisionReport::default();
        self.known_daemons(&mut report)
            .into_iter()
            .filter_map(|key| {
                let daemon = self.daemon(&key, None).ok()??;
                Some(lock(&daemon).info())
            })
            .collect()
    }

    /// How many daemons are supervised, without waiting on any of them
    /// (a daemon's own lock is held while it starts or stops; the map's
    /// only for lookups). For the metrics.
    pub fn supervised(&self) -> usize {
        lock(&self.daemons).len()
    }

    // -- internals -----------------------------------------------------------

    /// The daemon of `key`: held, recorded, or (given `limits`) new.
    fn daemon(
        &self,
        key: &DaemonKey,
        limits: Option<ClientLimits>,
    ) -> Result<Option<Arc<Mutex<Daemon>>>, MpsError> {
        if !is_device_uuid(&key.device) {
            return Err(MpsError::BadDevice(key.device.clone()));
        }
        let mut daemons = lock(&self.daemons);
        if let Some(d) = daemons.get(key) {
            return Ok(Some(Arc::clone(d)));
        }
        let Some(daemon) = Daemon::load(&self.config.state_dir, key, limits)? else {
            return Ok(None);
        };
        let daemon = Arc::new(Mutex::new(daemon));
        daemons.insert(key.clone(), Arc::clone(&daemon));
        Ok(Some(daemon))
    }

    /// Daemons with a record under the state dir or an in-memory entry.
    /// Directories of the per-device daemons of earlier versions are retired
    /// on the way (see [`retire_shared_daemon`]).
    fn known_daemons(&self, report: &mut SupervisionReport) -> Vec<DaemonKey> {
        let mut keys: std::collections::BTreeSet<DaemonKey> =
            lock(&self.daemons).keys().cloned().collect();
        let Ok(claims) = fs::read_dir(&self.config.state_dir) else {
            return keys.into_iter().collect();
        };
        for claim_dir in claims.flatten() {
            let Some(name) = claim_dir.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if is_device_uuid(&name) {
                if let Err(e) = retire_shared_daemon(&claim_dir.path()) {
                    report.failed.push((name, e));
                }
                continue;
            }
            if ClaimUid::parse(&name).is_err() {
                continue;
            }
            let Ok(tags) = fs::read_dir(claim_dir.path()) else {
                continue;
            };
            for tag in tags.flatten() {
                let path = tag.path().join(RECORD);
                let record = fs::read(&path)
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|v| serde_json::from_value::<DaemonKey>(v["key"].clone()).ok());
                if let Some(key) = record {
                    keys.insert(key);
                }
            }
        }
        keys.into_iter().collect()
    }
}

/// An earlier version ran one daemon per device, shared by every claim on
/// it (`<state>/<device uuid>/supervisor.json`). Such a daemon died with
/// the driver's container on upgrade in the documented deployment; one that
/// still runs (a host install) is stopped, since it serves claims of any
/// namespace through one pipe directory, and its directory is removed.
/// Claims prepared by that version keep their CDI specs; their containers
/// run outside MPS until their Pods are recreated.
fn retire_shared_daemon(dir: &Path) -> Result<(), MpsError> {
    let device = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let record = dir.join("supervisor.json");
    let daemon = fs::read(&record)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| serde_json::from_value::<ProcessId>(v["daemon"].clone()).ok());
    if let Some(id) = daemon {
        let io = |what| {
            let device = device.clone();
            move |source| MpsError::Io {
                device,
                what,
                path: PathBuf::from(format!("/proc/{}", id.pid)),
                source,
            }
        };
        if let Some(pidfd) = Pidfd::open(&id).map_err(io("taking hold of a shared daemon"))? {
            pidfd.kill().map_err(io("stopping a shared daemon"))?;
            pidfd.wait(Duration::from_secs(5));
        }
    }
    ignore_missing(fs::remove_dir_all(dir)).map_err(|source| MpsError::Io {
        device,
        what: "removing the directory of a shared daemon",
        path: dir.to_owned(),
        source,
    })
}

fn remove_if_empty(dir: &Path) {
    // Fails (and is meant to) while another daemon of the claim is there.
    let _ = fs::remove_dir(dir);
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
