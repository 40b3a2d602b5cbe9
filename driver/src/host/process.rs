//! The processes the MPS supervisor started, identified so that no other
//! process can be mistaken for one of them.
//!
//! Trusted: the kernel's view of a PID (`/proc/<pid>/stat`, pidfds) and the
//! identities the driver recorded itself, outside every directory a
//! container can write. Not trusted: a PID read from a file a container can
//! write (the control daemon's pid file in its pipe directory is never read),
//! and a process's environment on its own (a process writes its own): a
//! launch id found there counts only because it is a random secret the
//! driver generated and kept in its host-only record.

use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

mod spawn;
pub use spawn::{Exit, Launch, Started};

/// A process, identified beyond its PID: the kernel's start time (clock
/// ticks since boot) and the boot it ran in. A recycled PID has a different
/// start time; a record from before a reboot has a different boot id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessId {
    pub pid: i32,
    pub start_time: u64,
    pub boot_id: String,
}

impl ProcessId {
    /// The live process `pid`, or `None` if there is none.
    pub fn of(pid: i32) -> Option<ProcessId> {
        let stat = Stat::read(pid)?;
        stat.alive().then(|| ProcessId {
            pid,
            start_time: stat.start_time,
            boot_id: boot_id(),
        })
    }

    /// Whether this very process is still running.
    pub fn is_running(&self) -> bool {
        self.boot_id == boot_id()
            && Stat::read(self.pid).is_some_and(|s| s.alive() && s.start_time == self.start_time)
    }
}

/// A pidfd on a recorded process: signals and waits reach that very process,
/// never another one that got its PID after it exited.
#[derive(Debug)]
pub struct Pidfd {
    fd: OwnedFd,
    id: ProcessId,
}

impl Pidfd {
    /// A pidfd on `id`'s process, or `None` if that process is not running
    /// (any more). The identity is checked again *after* the pidfd is open:
    /// if the PID had been recycled in between, the check fails, so a pidfd
    /// returned here refers to the recorded process.
    pub fn open(id: &ProcessId) -> io::Result<Option<Pidfd>> {
        if !id.is_running() {
            return Ok(None);
        }
        let fd = match pidfd_open(id.pid) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(id.is_running().then(|| Pidfd { fd, id: id.clone() }))
    }

    pub fn id(&self) -> &ProcessId {
        &self.id
    }

    /// Whether the process has exited, waiting at most `timeout`. An exited
    /// child of this process is reaped.
    pub fn wait(&self, timeout: Duration) -> bool {
        let exited = poll_readable(&[self.fd.as_fd()], Instant::now() + timeout).is_some();
        if exited {
            self.reap();
        }
        exited
    }

    /// SIGKILL the process; one that has already exited is fine.
    pub fn kill(&self) -> io::Result<()> {
        send_kill(&self.fd)
    }

    /// Collect the exit status if the process is our child (a daemon a
    /// previous supervisor in this same process spawned), so it does not
    /// stay a zombie. Any other process is left alone: waitid on a pidfd
    /// only ever concerns that process.
    fn reap(&self) {
        let _ = spawn::wait_pidfd(&self.fd, libc::WNOHANG);
    }
}

/// A pidfd on `pid` (CLOEXEC, as every pidfd): readable once it exits.
fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a PID and flags and returns a new file
    // descriptor or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor pidfd_open just returned, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Waits until one of `fds` is readable (its index) or `deadline` passes
/// (`None`): one poll(2), restarted after a signal.
pub fn poll_readable(fds: &[BorrowedFd<'_>], deadline: Instant) -> Option<usize> {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Rounded up: a wait of 0.4 ms must not become a busy loop.
        let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: `polled` lives across the call and holds `len` entries.
        let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, ms) };
        if n > 0 {
            return polled.iter().position(|p| p.revents != 0);
        }
        let interrupted = n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted;
        if !interrupted || left.is_zero() {
            return None;
        }
    }
}

/// The oldest live process whose environment holds exactly `entry`
/// (`NAME=value`). Meant for a secret launch id: a process found this way
/// was started with it (its children inherit it too, hence the oldest).
pub fn find_by_env(entry: &str) -> Option<ProcessId> {
    let holds = |pid: i32| {
        fs::read(format!("/proc/{pid}/environ"))
            .is_ok_and(|env| env.split(|b| *b == 0).any(|e| e == entry.as_bytes()))
    };
    fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| holds(*pid))
        // Read the identity, then check the environment again: a PID
        // recycled in between would not hold the secret.
        .filter_map(|pid| ProcessId::of(pid).filter(|_| holds(pid)))
        .min_by_key(|id| id.start_time)
}

/// 128 random bits from the kernel, as hex.
pub fn random_id() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        // SAFETY: getrandom(2) writes at most the given length into the
        // rest of our buffer.
        let n = unsafe {
            libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else {
            filled += n as usize;
        }
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn boot_id() -> String {
    fs::read_to_string(crate::state::checkpoint::KERNEL_BOOT_ID)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

struct Stat {
    state: char,
    start_time: u64,
}

impl Stat {
    fn read(pid: i32) -> Option<Stat> {
        if pid <= 0 {
            return None;
        }
        let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // `pid (comm) state ...`: comm may contain spaces and parentheses,
        // so fields are counted after the last ')'. The state is field 3 and
        // the start time field 22 of proc(5).
        let (_, rest) = text.rsplit_once(')')?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        Some(Stat {
            state: fields.first()?.chars().next()?,
            start_time: fields.get(22 - 3)?.parse().ok()?,
        })
    }

    fn alive(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// The driver's own hold on its daemon.
pub(super) enum Handle {
    /// Started by this supervisor: its PID stays ours until we reap it, so
    /// its pidfd, from the very clone that made it, is that process's.
    Spawned(Started),
    /// Recorded by an earlier run, held through a checked pidfd.
    Adopted(Pidfd),
}

impl Handle {
    pub(super) fn pid(&self) -> i32 {
        match self {
            Handle::Spawned(s) => s.pid,
            Handle::Adopted(p) => p.id().pid,
        }
    }

    /// Readable once the daemon has exited: to wait on together with other
    /// events.
    pub(super) fn exit_event(&self) -> BorrowedFd<'_> {
        match self {
            Handle::Spawned(s) => s.pidfd.as_fd(),
            Handle::Adopted(p) => p.fd.as_fd(),
        }
    }

    /// `None` while the daemon runs, how it ended once it has exited
    /// (reaping it).
    pub(super) fn exit(&mut self) -> Option<String> {
        match self {
            Handle::Spawned(s) => match s.try_wait() {
                Ok(None) => None,
                Ok(Some(how)) => Some(format!("exited ({how})")),
                Err(e) => Some(format!("could not be waited for ({e})")),
            },
            Handle::Adopted(p) => p.wait(Duration::ZERO).then(|| "exited".to_owned()),
        }
    }

    /// Whether the daemon exited within `timeout`.
    pub(super) fn wait(&mut self, timeout: Duration) -> bool {
        match self {
            Handle::Spawned(s) => {
                poll_readable(&[s.pidfd.as_fd()], Instant::now() + timeout).is_some()
                    && self.exit().is_some()
            }
            Handle::Adopted(p) => p.wait(timeout),
        }
    }

    pub(super) fn kill(&mut self) -> std::io::Result<()> {
        match self {
            Handle::Spawned(s) => s.kill(),
            Handle::Adopted(p) => p.kill(),
        }
    }
}

/// SIGKILL through a pidfd; a process that has already exited (or been
/// reaped) is fine.
fn send_kill(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: pidfd_send_signal(2) on our pidfd, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ESRCH) {
        Ok(())
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn own_process_is_running_and_identified() {
        let me = ProcessId::of(std::process::id() as i32).unwrap();
        assert!(me.is_running());
        let recycled = ProcessId {
            start_time: me.start_time + 1,
            ..me.clone()
        };
        assert!(!recycled.is_running());
        let other_boot = ProcessId {
            boot_id: "another boot".into(),
            ..me
        };
        assert!(!other_boot.is_running());
    }

    #[test]
    fn a_pidfd_kills_waits_for_and_reaps_exactly_the_recorded_process() {
        let mut child = Command::new("sleep").arg("1000").spawn().unwrap();
        let id = ProcessId::of(child.id() as i32).unwrap();
        // Another identity on the same PID (as after reuse) opens nothing.
        let recycled = ProcessId {
            start_time: id.start_time + 1,
            ..id.clone()
        };
        assert!(Pidfd::open(&recycled).unwrap().is_none());

        let fd = Pidfd::open(&id).unwrap().unwrap();
        assert_eq!(fd.id(), &id);
        assert!(!fd.wait(Duration::ZERO));
        fd.kill().unwrap();
        assert!(fd.wait(Duration::from_secs(10)));
        // Reaped through the pidfd: the standard library finds no child.
        assert!(child.wait().is_err());
        assert!(!id.is_running());
        assert!(Pidfd::open(&id).unwrap().is_none());
        // Killing an exited process is not an error.
        fd.kill().unwrap();
    }

    #[test]
    fn a_process_is_found_by_a_secret_in_its_environment() {
        let secret = random_id().unwrap();
        assert_eq!(secret.len(), 32);
        assert_ne!(secret, random_id().unwrap());
        let entry = format!("TESSERA_TEST_LAUNCH_ID={secret}");
        assert!(find_by_env(&entry).is_none());
        let mut child = Command::new("sleep")
            .arg("1000")
            .env("TESSERA_TEST_LAUNCH_ID", &secret)
            .spawn()
            .unwrap();
        // The kernel shows the new environment only once exec has set it
        // up, a little after spawn returns.
        let deadline = Instant::now() + Duration::from_secs(10);
        let found = loop {
            if let Some(found) = find_by_env(&entry) {
                break found;
            }
            assert!(Instant::now() < deadline, "the child holds the secret");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(found.pid, child.id() as i32);
        // A prefix of the entry is not the entry.
        assert!(find_by_env(&entry[..entry.len() - 1]).is_none());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(find_by_env(&entry).is_none());
    }
}
