//! Just enough of `/proc` to tell whether a process is alive and whether it
//! is still the one that was recorded (a PID alone can be reused).

use std::fs;

use serde::{Deserialize, Serialize};

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

/// Whether some live process has this PID (zombies have exited).
pub fn alive(pid: i32) -> bool {
    Stat::read(pid).is_some_and(|s| s.alive())
}

/// Collect the exit status of `pid` if it is our child and has exited, so a
/// daemon re-parented to this process (PID 1 in a container) does not stay a
/// zombie. Any other PID is left alone.
pub fn reap(pid: i32) {
    if pid > 0 {
        // SAFETY: waitpid with WNOHANG on a single PID only reaps that PID if
        // it is an exited child of ours; otherwise it fails with ECHILD or
        // returns 0.
        unsafe {
            libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG);
        }
    }
}

/// SIGKILL `process`, only if it is still the recorded process.
pub fn kill(process: &ProcessId) -> std::io::Result<()> {
    if !process.is_running() {
        return Ok(());
    }
    // SAFETY: kill(2) with a positive PID checked to be the recorded process
    // an instant ago.
    if unsafe { libc::kill(process.pid, libc::SIGKILL) } == 0 {
        Ok(())
    } else {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ESRCH) {
            Ok(())
        } else {
            Err(e)
        }
    }
}

fn boot_id() -> String {
    fs::read_to_string(crate::checkpoint::KERNEL_BOOT_ID)
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
    fn exited_child_is_not_alive_and_is_reaped() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        // Until reaped it is a zombie; either way it is not alive once it
        // has exited. Poll: its exit is asynchronous.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while alive(pid) {
            assert!(std::time::Instant::now() < deadline, "`true` did not exit");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        reap(pid);
        // Reaped by us: the standard library's wait now finds no child.
        assert!(child.wait().is_err());
        assert!(ProcessId::of(pid).is_none());
    }
}
