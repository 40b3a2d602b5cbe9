//! Names in a daemon's directories, shared by the daemon, its launch and
//! view, and the supervisor.

/// File the control daemon writes its PID to, in its pipe directory. A
/// container can write it: the driver never reads it.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The control endpoint the daemon creates in its pipe directory when ready.
pub const CONTROL: &str = "control";
/// Environment variable carrying a daemon's secret launch id (see the
/// module documentation).
pub const LAUNCH_ID_ENV: &str = "TESSERA_MPS_LAUNCH_ID";
/// The daemon's standard output and error, in its (host-only) log directory;
/// the previous run's is kept as `launcher.log.1`.
pub const LAUNCHER_LOG: &str = "launcher.log";
/// The host-only record of a daemon, in its directory.
pub const RECORD: &str = "daemon.json";

/// Longest pipe directory accepted: Unix socket paths are limited to 107
/// bytes, and MPS puts sockets with names of a dozen or so characters in it.
pub const MAX_PIPE_DIR: usize = 90;

pub fn ignore_missing(result: std::io::Result<()>) -> std::io::Result<()> {
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
