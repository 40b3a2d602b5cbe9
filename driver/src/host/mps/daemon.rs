//! One MPS control daemon: the daemon of one request of one claim on one
//! device, its host-only record and its pipe directory.
//!
//! Layout under the supervisor's state directory:
//!
//! ```text
//! <state>/<claim uid>/<tag>/daemon.json   host-only: which claim, request and device, the limits, the daemon's identity
//! <state>/<claim uid>/<tag>/log/          host-only: CUDA_MPS_LOG_DIRECTORY, launcher.log (the daemon's output)
//! <state>/<claim uid>/<tag>/pipe/         CUDA_MPS_PIPE_DIRECTORY: mounted into that claim's containers only
//! <state>/<claim uid>/<tag>/shm/          the daemon's /dev/shm, and that claim's containers' (see launch.rs)
//! ```
//!
//! `<tag>` is a short hash of the request and device (Unix socket paths are
//! short); the record says what it stands for.
//!
//! # What is trusted, and why
//!
//! The pipe directory is bind-mounted read-write into the containers of the
//! claim's request, and such a container may run as root. So nothing found
//! there is trusted:
//!
//! - The control daemon's pid file there
//!   ([`PID_FILE`](super::paths::PID_FILE)) is never read. The daemon
//!   runs in the foreground (`nvidia-cuda-mps-control -f`) as the
//!   driver's direct child, so the driver holds its pidfd from the start; a
//!   daemon that outlived a driver restart is the process recorded as PID +
//!   start time + boot id in the host-only record, and is signalled and
//!   waited for through a pidfd opened and then checked against that record,
//!   so a recycled PID is never hit.
//! - The driver opens nothing there. It looks at the control endpoint with
//!   `lstat` (ready means a socket or fifo, never a symlink); it connects
//!   to it once, empty, only in a directory the new daemon alone has had,
//!   to see that it listens before any container gets the directory.
//! - Every start gets a fresh, empty pipe directory (and shared memory
//!   directory, which containers can write too): the old one is removed
//!   whole (the standard library's `remove_dir_all` does not follow
//!   symlinks) and made anew, so a daemon, which runs as root, never works
//!   in a directory a tenant has prepared. Containers that mounted the old
//!   directory keep it (a bind mount holds the directory, not its path):
//!   only containers started after the restart reach the new daemon.
//! - No content from there (or from any log) reaches an error: errors, which
//!   end up in Pod events, name paths and conditions only.
//!
//! The limits are the daemon's own defaults, given in its environment at
//! spawn (NVIDIA: every server the daemon starts observes them; with
//! `confirm_defaults` also set through its control endpoint) before the
//! pipe directory is handed to any container, so a client holds them
//! whatever its own environment says (its environment can only lower them).
//!
//! The record is written atomically *before* a daemon is spawned, naming a
//! fresh random launch id that the daemon gets in its environment, and again
//! with the daemon's identity right after the spawn. A driver killed in
//! between finds its daemon on restart by that id: a secret kept host-only,
//! so no container can make another process carry it.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::debug;

mod control;
mod record;

use control::{Readiness, endpoint_ready};
pub(super) use record::{Record, written_before_this_boot};

use super::config::{MpsConfig, MpsError};
use super::launch;
use super::paths::{LAUNCH_ID_ENV, LAUNCHER_LOG, MAX_PIPE_DIR, ignore_missing};
use super::tmpfs::{self, ClientDir};
use super::view::{Role, View, ViewSpec};
use crate::claim_uid::ClaimUid;
use crate::host::mps_client::{self as limits, ClientLimits};
use crate::host::process::{self, Handle, Launch, Pidfd, ProcessId, Started};

/// How long a daemon may take to die after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Which daemon: the one of a request of a claim on a device (a GPU, or a
/// MIG device). A CUDA process talks to one daemon, and a container gets
/// the devices of the requests it references, so a request is the unit.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonKey {
    pub claim: ClaimUid,
    pub request: String,
    pub device: String,
}

impl DaemonKey {
    /// The daemon's directory name below its claim's: 8 hex digits of a
    /// hash of request and device (FNV-1a; a clash is caught by the record).
    pub fn tag(&self) -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.request.bytes().chain([0]).chain(self.device.bytes()) {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        format!("{:08x}", hash as u32)
    }
}

impl std::fmt::Display for DaemonKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "claim {} request {} on {}",
            self.claim, self.request, self.device
        )
    }
}

/// A running control daemon, as a client container needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDaemon {
    pub key: DaemonKey,
    /// `CUDA_MPS_PIPE_DIRECTORY` on the host: what clients mount.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY` on the host: for the operator, never mounted
    /// into a container.
    pub log_dir: PathBuf,
    /// The daemon's `/dev/shm` on the host: clients mount it at `/dev/shm`.
    pub shm_dir: PathBuf,
    /// The daemon's defaults for every client.
    pub limits: ClientLimits,
    pub pid: i32,
}

/// Whether the recorded daemon runs, as this supervisor knows it.
pub(super) enum Liveness {
    /// Held by this supervisor already.
    Running,
    /// The recorded process runs and is now held (after a driver restart).
    Adopted,
    Dead,
}

/// What making sure a daemon runs did.
pub(super) enum Outcome {
    AlreadyRunning,
    Adopted,
    Started,
}

/// One daemon: its directories, its record and the driver's hold on it.
pub(super) struct Daemon {
    pub record: Record,
    root: PathBuf,
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    shm_dir: PathBuf,
    handle: Option<Handle>,
}

impl Daemon {
    /// The daemon of `key` below `state_dir`, from its record if there is
    /// one, else a new one with `limits` (`None` without either).
    pub fn load(
        state_dir: &Path,
        key: &DaemonKey,
        limits: Option<ClientLimits>,
    ) -> Result<Option<Self>, MpsError> {
        let root = state_dir.join(key.claim.as_str()).join(key.tag());
        let pipe_dir = root.join("pipe");
        let len = pipe_dir.as_os_str().len();
        if len > MAX_PIPE_DIR {
            return Err(MpsError::PathTooLong {
                device: key.device.clone(),
                pipe_dir,
                len,
                max: MAX_PIPE_DIR,
            });
        }
        let Some(record) = Record::read(&root, key, limits)? else {
            return Ok(None);
        };
        Ok(Some(Daemon {
            record,
            log_dir: root.join("log"),
            shm_dir: root.join("shm"),
            pipe_dir,
            root,
            handle: None,
        }))
    }

    pub fn info(&self) -> MpsDaemon {
        MpsDaemon {
            key: self.record.key.clone(),
            pipe_dir: self.pipe_dir.clone(),
            log_dir: self.log_dir.clone(),
            shm_dir: self.shm_dir.clone(),
            limits: self.record.limits,
            pid: self.record.daemon.as_ref().map_or(0, |d| d.pid),
        }
    }

    fn io_err(&self, what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> MpsError {
        let device = self.record.key.device.clone();
        let path = path.to_owned();
        move |source| MpsError::Io {
            device,
            what,
            path,
            source,
        }
    }

    pub fn persist(&self) -> Result<(), MpsError> {
        self.record.write(&self.root)
    }

    /// Whether the recorded daemon runs; takes hold of it if this supervisor
    /// has no handle yet, and forgets it once it has exited. Only the record
    /// and the kernel are consulted, never the pipe directory.
    pub fn liveness(&mut self) -> Result<Liveness, MpsError> {
        if let Some(handle) = self.handle.as_mut() {
            if handle.exit().is_none() {
                return Ok(Liveness::Running);
            }
            self.handle = None;
            self.record.daemon = None;
            self.persist()?;
            return Ok(Liveness::Dead);
        }
        if let Some(launch) = self.record.launch.take() {
            // An earlier run was killed between spawning a daemon and
            // recording it: the daemon carries the secret launch id.
            self.record.daemon = self
                .record
                .daemon
                .take()
                .or_else(|| process::find_by_env(&format!("{LAUNCH_ID_ENV}={launch}")));
            self.persist()?;
        }
        let Some(id) = self.record.daemon.clone() else {
            return Ok(Liveness::Dead);
        };
        let pidfd = Pidfd::open(&id).map_err(self.io_err(
            "taking hold of the recorded daemon (pidfd_open, Linux 5.3 or later)",
            Path::new(&format!("/proc/{}", id.pid)),
        ))?;
        match pidfd {
            Some(pidfd) => {
                self.handle = Some(Handle::Adopted(pidfd));
                Ok(Liveness::Adopted)
            }
            None => {
                self.record.daemon = None;
                self.persist()?;
                Ok(Liveness::Dead)
            }
        }
    }

    /// Adopt the recorded daemon or start one; a daemon alive without its
    /// control endpoint gets a new daemon's grace, then is replaced.
    pub fn ensure_running(&mut self, config: &MpsConfig) -> Result<Outcome, MpsError> {
        let outcome = match self.liveness()? {
            Liveness::Running => Outcome::AlreadyRunning,
            Liveness::Adopted => Outcome::Adopted,
            Liveness::Dead => {
                self.start(config)?;
                return Ok(Outcome::Started);
            }
        };
        if endpoint_ready(&self.pipe_dir) {
            return Ok(outcome);
        }
        let deadline = Instant::now() + config.ready_timeout;
        match self.wait_ready(deadline) {
            Readiness::Ready => return Ok(outcome),
            Readiness::Exited(_) => {}
            Readiness::TimedOut => self.kill()?,
        }
        self.start(config)?;
        Ok(Outcome::Started)
    }

    /// What the daemon and its control client find in their environment
    /// beside the node process's.
    fn env<'a>(&'a self, config: &'a MpsConfig) -> impl Iterator<Item = (&'a OsStr, &'a OsStr)> {
        [
            (
                "CUDA_VISIBLE_DEVICES".as_ref(),
                self.record.key.device.as_ref(),
            ),
            (limits::PIPE_DIRECTORY.as_ref(), self.pipe_dir.as_os_str()),
            (limits::LOG_DIRECTORY.as_ref(), self.log_dir.as_os_str()),
        ]
        .into_iter()
        .chain(config.env.iter().map(|(k, v)| (k.as_ref(), v.as_ref())))
    }

    /// Fresh, empty pipe and shared memory directories (see the module
    /// documentation), each a bounded tmpfs of its own.
    fn fresh_client_dirs(&self, config: &MpsConfig) -> Result<(), MpsError> {
        self.detach_client_dirs()?;
        let bounds = config.shm.bounds(self.record.limits.shm_bytes);
        for (dir, which) in [
            (&self.pipe_dir, ClientDir::Pipe),
            (&self.shm_dir, ClientDir::Shm),
        ] {
            ignore_missing(fs::remove_dir_all(dir))
                .map_err(self.io_err("removing the previous", dir))?;
            fs::create_dir(dir).map_err(self.io_err("creating", dir))?;
            tmpfs::mount(dir, which, bounds)
                .map_err(self.io_err("mounting a tmpfs (needs CAP_SYS_ADMIN) on", dir))?;
        }
        Ok(())
    }

    /// Unmounts the client directories' tmpfs (containers keep theirs).
    fn detach_client_dirs(&self) -> Result<(), MpsError> {
        for dir in [&self.pipe_dir, &self.shm_dir] {
            tmpfs::detach(dir).map_err(self.io_err("unmounting", dir))?;
        }
        Ok(())
    }

    /// Spawn `nvidia-cuda-mps-control -f` as our child with the limits as
    /// its defaults and wait until its control endpoint listens. Called only
    /// when no recorded daemon runs.
    fn start(&mut self, config: &MpsConfig) -> Result<(), MpsError> {
        let limit_env = limits::client_limit_env(&self.record.key.device, self.record.limits)
            .map_err(|e| MpsError::Limits {
                device: self.record.key.device.clone(),
                source: e,
            })?;
        // Recorded before its directories are mounted: a crash from here on
        // leaves a record that leads to them.
        let mut steps = Steps::start();
        let launch = self.record_launch()?;
        steps.lap("record");
        self.make_dirs(config)?;
        steps.lap("dirs");
        let log = self.log_dir.join(LAUNCHER_LOG);
        let out = launch::open_log(&log).map_err(self.io_err("creating", &log))?;
        let err = out.try_clone().map_err(self.io_err("opening", &log))?;
        let deadline = Instant::now() + config.ready_timeout;
        let child = self.spawn(config, &launch, &limit_env, [out, err])?;
        steps.lap("spawn");
        self.record_spawned(child)?;
        steps.lap("identity");
        self.await_ready(config, deadline, log)?;
        steps.lap("ready");
        debug!(device = %self.record.key.device, steps = %steps, "MPS daemon started");
        Ok(())
    }

    /// The daemon's directories: its own and its log's, and fresh client
    /// directories. A missing binary is said as such first, before the
    /// view needs it.
    fn make_dirs(&self, config: &MpsConfig) -> Result<(), MpsError> {
        fs::metadata(&config.control_binary).map_err(|source| MpsError::Launch {
            device: self.record.key.device.clone(),
            binary: config.control_binary.clone(),
            source,
        })?;
        for dir in [&self.root, &self.log_dir] {
            fs::create_dir_all(dir).map_err(self.io_err("creating", dir))?;
        }
        self.fresh_client_dirs(config)
    }

    /// A fresh secret launch id, recorded before the daemon that carries it
    /// is spawned (see the module documentation).
    fn record_launch(&mut self) -> Result<String, MpsError> {
        let launch =
            process::random_id().map_err(self.io_err("drawing a launch id for", &self.pipe_dir))?;
        self.record.daemon = None;
        self.record.launch = Some(launch.clone());
        self.persist()?;
        Ok(launch)
    }

    /// The daemon spawned in its view (and the host's cgroup) with the
    /// limits and the launch id in its environment, its output to `log`.
    /// A failed spawn forgets the launch.
    fn spawn(
        &mut self,
        config: &MpsConfig,
        launch_id: &str,
        limit_env: &[String],
        [out, err]: [fs::File; 2],
    ) -> Result<Started, MpsError> {
        let view = self
            .view_spec(config)
            .and_then(|spec| View::prepare(&spec, Role::Daemon))
            .map_err(self.io_err("preparing the mount view of the daemon in", &self.root))?;
        let confine = launch::confinement(view, config.host_cgroup.clone());
        let started = self
            .launch(config, launch_id, limit_env, [out, err])
            .and_then(|l| l.start(&confine));
        started.map_err(|source| {
            self.record.launch = None;
            // The launch error is the one to report.
            let _ = self.persist();
            MpsError::Launch {
                device: self.record.key.device.clone(),
                binary: config.control_binary.clone(),
                source,
            }
        })
    }

    /// `nvidia-cuda-mps-control -f` with its environment, in a process
    /// group of its own: signals meant for the driver's group (a terminal's
    /// Ctrl-C) do not reach it; it outlives a driver restart and is adopted
    /// by the next run.
    fn launch(
        &self,
        config: &MpsConfig,
        launch_id: &str,
        limit_env: &[String],
        [out, err]: [fs::File; 2],
    ) -> std::io::Result<Launch> {
        let stdin = fs::File::open("/dev/null")?;
        let mut launch = Launch::new(
            &config.control_binary,
            [stdin.into(), out.into(), err.into()],
        )?;
        launch.arg("-f")?.process_group();
        for (name, value) in self.env(config) {
            launch.env(name, value)?;
        }
        for entry in limit_env {
            let (name, value) = entry.split_once('=').expect("NAME=value");
            launch.env(name, value)?;
        }
        launch.env(LAUNCH_ID_ENV, launch_id)?;
        Ok(launch)
    }

    /// The spawned daemon's identity recorded in place of its launch id, and
    /// the driver's hold on it.
    fn record_spawned(&mut self, started: Started) -> Result<(), MpsError> {
        let handle = Handle::Spawned(started);
        // Our child: its PID cannot be reused before we reap it. `None` if it
        // already exited (waiting for it says how).
        self.record.daemon = ProcessId::of(handle.pid());
        self.record.launch = None;
        self.handle = Some(handle);
        if let Err(e) = self.persist() {
            // Unrecorded, it could not be found again: do not leave it.
            let _ = self.kill();
            return Err(e);
        }
        Ok(())
    }

    /// Wait for the new daemon's control endpoint to listen (its limits are
    /// its defaults from its environment; with `confirm_defaults` they are
    /// set again through the endpoint); a daemon not ready by `deadline` is
    /// stopped.
    fn await_ready(
        &mut self,
        config: &MpsConfig,
        deadline: Instant,
        log: PathBuf,
    ) -> Result<(), MpsError> {
        let readiness = match self.wait_ready(deadline) {
            Readiness::Ready if config.confirm_defaults => {
                return self.set_defaults(config, deadline);
            }
            Readiness::Ready => self.wait_listening(deadline),
            other => other,
        };
        match readiness {
            Readiness::Ready => Ok(()),
            Readiness::Exited(outcome) => Err(MpsError::LaunchFailed {
                device: self.record.key.device.clone(),
                binary: config.control_binary.clone(),
                outcome,
                pipe_dir: self.pipe_dir.clone(),
                log,
            }),
            Readiness::TimedOut => {
                let pid = self.handle.as_ref().map_or(0, Handle::pid);
                self.kill()?;
                Err(MpsError::NotReady {
                    device: self.record.key.device.clone(),
                    pid,
                    waited: config.ready_timeout,
                    pipe_dir: self.pipe_dir.clone(),
                    log_dir: self.log_dir.clone(),
                })
            }
        }
    }

    /// Stop the recorded daemon (if it runs) and remove its directory,
    /// record included; the logs go with it.
    pub fn stop(&mut self, config: &MpsConfig) -> Result<bool, MpsError> {
        let was_running = !matches!(self.liveness()?, Liveness::Dead);
        if was_running {
            let asked = endpoint_ready(&self.pipe_dir) && self.send(config, "quit\n");
            let quit = asked
                && self
                    .handle
                    .as_mut()
                    .is_none_or(|h| h.wait(config.quit_timeout));
            if quit {
                self.handle = None;
            } else {
                self.kill()?;
            }
            self.record.daemon = None;
        }
        // Containers may have left anything in the pipe directory; removal
        // does not follow symlinks.
        self.detach_client_dirs()?;
        ignore_missing(fs::remove_dir_all(&self.root))
            .map_err(self.io_err("removing", &self.root))?;
        Ok(was_running)
    }

    /// What the daemon and its control client see (see `view.rs`); a view
    /// that copies the node's namespace is built on the host-only `view/`
    /// directory.
    fn view_spec(&self, config: &MpsConfig) -> std::io::Result<ViewSpec> {
        Ok(ViewSpec {
            root: self.root.join("view"),
            driver_root: config.driver_root.clone(),
            dev_root: config.dev_root.clone(),
            gpu_minor: self.record.gpu_minor,
            binary: fs::canonicalize(&config.control_binary)?,
            pipe_dir: self.pipe_dir.clone(),
            log_dir: self.log_dir.clone(),
            shm_dir: self.shm_dir.clone(),
        })
    }

    /// SIGKILL the held daemon through its handle and wait until it is gone.
    pub fn kill(&mut self) -> Result<(), MpsError> {
        let Some(handle) = self.handle.as_mut() else {
            return Ok(());
        };
        let pid = handle.pid();
        handle.kill().map_err(|source| MpsError::Io {
            device: self.record.key.device.clone(),
            what: "killing the daemon",
            path: PathBuf::from(format!("/proc/{pid}")),
            source,
        })?;
        if !handle.wait(KILL_WAIT) {
            return Err(MpsError::Unkillable {
                device: self.record.key.device.clone(),
                pid,
                waited: KILL_WAIT,
            });
        }
        self.handle = None;
        self.record.daemon = None;
        self.persist()
    }
}

/// How long each step of a daemon's start took, for the debug log.
struct Steps {
    since: Instant,
    laps: Vec<(&'static str, Duration)>,
}

impl Steps {
    fn start() -> Self {
        Steps {
            since: Instant::now(),
            laps: Vec::new(),
        }
    }

    fn lap(&mut self, step: &'static str) {
        let now = Instant::now();
        self.laps.push((step, now - self.since));
        self.since = now;
    }
}

impl std::fmt::Display for Steps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (step, took)) in self.laps.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{step}={:.3}ms", took.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
