//! How the supervisor runs `nvidia-cuda-mps-control`, and what can go
//! wrong doing it.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::launch::HostCgroup;
use super::paths::CONTROL;
use super::tmpfs::ShmPolicy;
use crate::host::mps_client::LimitError;

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
    /// Also set the limits through the control endpoint once a daemon
    /// started (a second process per daemon), for drivers shown not to take
    /// them from the daemon's environment alone.
    pub confirm_defaults: bool,
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
            confirm_defaults: false,
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
