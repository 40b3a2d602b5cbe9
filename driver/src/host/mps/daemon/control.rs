//! Talking to a daemon through its control endpoint: waiting for it to
//! appear, sending commands, setting the limits as the daemon's defaults.
//! The endpoint is looked at with `lstat` only (see the module
//! documentation of `daemon` for why).

use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use super::{Daemon, Liveness, POLL};
use crate::host::mps::config::{MpsConfig, MpsError};
use crate::host::mps::launch;
use crate::host::mps::paths::CONTROL;
use crate::host::mps::view::{Role, View};
use crate::host::mps_client as limits;

/// How waiting for a daemon's control endpoint ended.
pub(super) enum Readiness {
    Ready,
    Exited(String),
    TimedOut,
}

impl Daemon {
    /// The limits as the daemon's defaults, through its control endpoint,
    /// while no container has the pipe directory yet. A daemon that does not
    /// take them by `deadline` is stopped: it must not serve without them.
    /// The endpoint appears when the daemon binds it, a moment before it
    /// listens: a refused connection then is retried (the commands set
    /// values, so sending them again is harmless).
    pub(super) fn set_defaults(
        &mut self,
        config: &MpsConfig,
        deadline: Instant,
    ) -> Result<(), MpsError> {
        let commands = limits::daemon_default_commands(self.record.limits);
        loop {
            if self.send(config, &commands) {
                return Ok(());
            }
            let alive = !matches!(self.liveness(), Ok(Liveness::Dead) | Err(_));
            if Instant::now() >= deadline || !alive {
                break;
            }
            std::thread::sleep(POLL);
        }
        self.kill()?;
        Err(MpsError::LimitsRefused {
            device: self.record.key.device.clone(),
            log_dir: self.log_dir.clone(),
        })
    }

    /// Poll until the held daemon's control endpoint exists, the daemon
    /// exits (then it is forgotten) or `deadline` passes.
    pub(super) fn wait_ready(&mut self, deadline: Instant) -> Readiness {
        loop {
            let Some(handle) = self.handle.as_mut() else {
                return Readiness::Exited("is not running".into());
            };
            if let Some(outcome) = handle.exit() {
                self.handle = None;
                self.record.daemon = None;
                // Best effort: the record is checked against the kernel
                // before it is acted on anyway.
                let _ = self.persist();
                return Readiness::Exited(outcome);
            }
            if endpoint_ready(&self.pipe_dir) {
                return Readiness::Ready;
            }
            if Instant::now() >= deadline {
                return Readiness::TimedOut;
            }
            std::thread::sleep(POLL);
        }
    }

    /// `echo <commands> | nvidia-cuda-mps-control` with the daemon's pipe
    /// directory; whether the client ran and succeeded. Its output is not
    /// read. The client sees only the endpoint checked here (a socket or
    /// fifo, opened without following a link), in a view of its own.
    pub(super) fn send(&self, config: &MpsConfig, commands: &str) -> bool {
        let Some(endpoint) = endpoint_inode(&self.pipe_dir) else {
            return false;
        };
        let Ok(view) = self
            .view_spec(config)
            .and_then(|spec| View::prepare(&spec, Role::Client { endpoint }))
        else {
            return false;
        };
        let mut command = self.command(config);
        launch::confine(&mut command, view, None);
        let Ok(mut client) = command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        else {
            return false;
        };
        if let Some(mut stdin) = client.stdin.take() {
            let _ = stdin.write_all(commands.as_bytes());
        }
        let deadline = Instant::now() + config.quit_timeout;
        loop {
            match client.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                _ => {
                    let _ = client.kill();
                    let _ = client.wait();
                    return false;
                }
            }
        }
    }
}

/// The control endpoint's (device, inode), if it is a socket or fifo
/// itself (not followed): the one inode the control client may reach.
fn endpoint_inode(pipe_dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = pipe_dir.join(CONTROL).symlink_metadata().ok()?;
    let t = meta.file_type();
    (t.is_socket() || t.is_fifo()).then(|| (meta.dev(), meta.ino()))
}

/// Whether the control endpoint is there: a socket (or fifo) itself, not a
/// symlink or anything else a container may have put in its place.
pub(in crate::host::mps) fn endpoint_ready(pipe_dir: &Path) -> bool {
    pipe_dir.join(CONTROL).symlink_metadata().is_ok_and(|m| {
        let t = m.file_type();
        t.is_socket() || t.is_fifo()
    })
}
