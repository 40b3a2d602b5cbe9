//! Talking to a daemon through its control endpoint: waiting for it to
//! appear, sending commands, setting the limits as the daemon's defaults.
//! The endpoint is looked at with `lstat` only (see the module
//! documentation of `daemon` for why).

use std::ffi::CString;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use super::{Daemon, Liveness};
use crate::host::mps::config::{MpsConfig, MpsError};
use crate::host::mps::launch;
use crate::host::mps::paths::CONTROL;
use crate::host::mps::view::{Role, View};
use crate::host::mps_client as limits;
use crate::host::process::{self, Launch};

/// How often an endpoint is looked for where no directory watch could be
/// had (the user's inotify instances used up).
const UNWATCHED: Duration = Duration::from_millis(2);
/// The first and the longest pause between connection attempts while a
/// bound endpoint does not listen yet.
const FIRST_RETRY: Duration = Duration::from_micros(250);
const LAST_RETRY: Duration = Duration::from_millis(8);

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
        let mut pause = FIRST_RETRY;
        loop {
            if self.send(config, &commands) {
                return Ok(());
            }
            let alive = !matches!(self.liveness(), Ok(Liveness::Dead) | Err(_));
            if Instant::now() >= deadline || !alive {
                break;
            }
            self.sleep_until(deadline.min(Instant::now() + pause), None);
            pause = (pause * 2).min(LAST_RETRY);
        }
        self.kill()?;
        Err(MpsError::LimitsRefused {
            device: self.record.key.device.clone(),
            log_dir: self.log_dir.clone(),
        })
    }

    /// Wait until the held daemon's control endpoint exists, the daemon
    /// exits (then it is forgotten) or `deadline` passes: woken by the
    /// endpoint's creation (inotify on the pipe directory) or the daemon's
    /// exit (its pidfd), not by a clock.
    pub(super) fn wait_ready(&mut self, deadline: Instant) -> Readiness {
        // Watched before the first look: a creation in between is seen.
        let watch = DirWatch::new(&self.pipe_dir).ok();
        loop {
            if let Some(exited) = self.exited() {
                return exited;
            }
            if endpoint_ready(&self.pipe_dir) {
                return Readiness::Ready;
            }
            if Instant::now() >= deadline {
                return Readiness::TimedOut;
            }
            // Without a watch (no inotify instance left), look again soon.
            let wake = match &watch {
                Some(_) => deadline,
                None => deadline.min(Instant::now() + UNWATCHED),
            };
            self.sleep_until(wake, watch.as_ref());
        }
    }

    /// Wait until the new daemon accepts connections on its endpoint: it
    /// binds it (the file appears) a moment before it listens, and a client
    /// refused in between would run without MPS. One empty connection,
    /// retried at growing intervals; made only on a fresh pipe directory
    /// the daemon alone has had (no container has it yet).
    pub(super) fn wait_listening(&mut self, deadline: Instant) -> Readiness {
        let mut pause = FIRST_RETRY;
        loop {
            match UnixStream::connect(self.pipe_dir.join(CONTROL)) {
                Ok(_) => return Readiness::Ready,
                // A full backlog: it listens.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Readiness::Ready,
                Err(_) => {}
            }
            if let Some(exited) = self.exited() {
                return exited;
            }
            if Instant::now() >= deadline {
                return Readiness::TimedOut;
            }
            self.sleep_until(deadline.min(Instant::now() + pause), None);
            pause = (pause * 2).min(LAST_RETRY);
        }
    }

    /// How the held daemon ended, if it has (then it is forgotten).
    fn exited(&mut self) -> Option<Readiness> {
        let Some(handle) = self.handle.as_mut() else {
            return Some(Readiness::Exited("is not running".into()));
        };
        let outcome = handle.exit()?;
        self.handle = None;
        self.record.daemon = None;
        // Best effort: the record is checked against the kernel before it is
        // acted on anyway.
        let _ = self.persist();
        Some(Readiness::Exited(outcome))
    }

    /// Sleeps until `wake`, the daemon's exit or an event of `watch`.
    fn sleep_until(&self, wake: Instant, watch: Option<&DirWatch>) {
        let Some(handle) = self.handle.as_ref() else {
            return;
        };
        let mut events = vec![handle.exit_event()];
        events.extend(watch.and_then(DirWatch::event));
        process::poll_readable(&events, wake);
        if let Some(watch) = watch {
            watch.drain();
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
        let confine = launch::confinement(view, None);
        let Ok((client, mut stdin)) = self
            .client(config)
            .and_then(|(launch, stdin)| Ok((launch.start(&confine)?, stdin)))
        else {
            return false;
        };
        let _ = stdin.write_all(commands.as_bytes());
        drop(stdin);
        let deadline = Instant::now() + config.quit_timeout;
        match client.wait_until(deadline) {
            Some(exit) => exit.success(),
            None => {
                let _ = client.kill();
                let _ = client.wait_until(Instant::now() + config.quit_timeout);
                false
            }
        }
    }

    /// The control client with the daemon's environment, reading its
    /// commands from the pipe returned.
    fn client(&self, config: &MpsConfig) -> io::Result<(Launch, std::io::PipeWriter)> {
        let (commands, writer) = std::io::pipe()?;
        let null = || std::fs::OpenOptions::new().write(true).open("/dev/null");
        let mut launch = Launch::new(
            &config.control_binary,
            [commands.into(), null()?.into(), null()?.into()],
        )?;
        for (name, value) in self.env(config) {
            launch.env(name, value)?;
        }
        Ok((launch, writer))
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

/// Creations in one directory, as an fd that is readable once there were
/// some (inotify; non-blocking and close-on-exec, so no child gets it).
struct DirWatch(Option<OwnedFd>);

impl Drop for DirWatch {
    fn drop(&mut self) {
        if let Some(fd) = self.0.take() {
            close_later(fd);
        }
    }
}

/// Closing an inotify instance waits for the kernel's grace period (ten
/// milliseconds and more, measured): a thread of its own does it, off the
/// prepare's path. Without that thread, here.
fn close_later(fd: OwnedFd) {
    static CLOSER: OnceLock<Option<mpsc::Sender<OwnedFd>>> = OnceLock::new();
    let closer = CLOSER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<OwnedFd>();
        std::thread::Builder::new()
            .name("inotify-close".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .ok()
            .map(|_| tx)
    });
    if let Some(Err(mpsc::SendError(fd))) = closer.as_ref().map(|tx| tx.send(fd)) {
        drop(fd);
    }
}

impl DirWatch {
    fn new(dir: &Path) -> io::Result<DirWatch> {
        let path = CString::new(dir.as_os_str().as_bytes())?;
        // SAFETY: inotify_init1(2) takes flags and returns a new fd or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned, owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mask = libc::IN_CREATE | libc::IN_MOVED_TO | libc::IN_ONLYDIR | libc::IN_DONT_FOLLOW;
        // SAFETY: our inotify fd and a NUL-terminated path that outlives the
        // call.
        if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), mask) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(DirWatch(Some(fd)))
    }

    fn event(&self) -> Option<BorrowedFd<'_>> {
        self.0.as_ref().map(AsFd::as_fd)
    }

    /// Reads the pending events away (what they say is looked at anew).
    fn drain(&self) {
        let mut buf = [0u8; 4096];
        let Some(fd) = &self.0 else { return };
        // SAFETY: reads at most `buf.len()` bytes into `buf` from our fd.
        while unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
    }
}
