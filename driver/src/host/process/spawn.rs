//! Starting a confined child without copying the node process.
//!
//! `fork` copies the caller's page tables under its memory map's lock and
//! then makes every page the parent writes fault until the child executes:
//! with a few dozen MiB resident and a burst of daemon starts, each start
//! paid for the whole process, one at a time (measured: 1.5 ms per start
//! alone, 10 ms at 16 at once, against 0.1 and 4 ms without the copy). Here
//! the child shares the parent's memory until it executes
//! (`CLONE_VM | CLONE_VFORK`, as `posix_spawn` does) and runs on a stack of
//! its own, and its pidfd comes from the same call (`CLONE_PIDFD`).
//!
//! What runs in the child before `execve` must be async-signal-safe and
//! must not allocate: it shares the parent's heap and locks. Signals are
//! blocked in the calling thread around the clone, so no handler of the
//! parent runs on the child's stack; the child sets every disposition back
//! to the default and unblocks all signals before it executes, as
//! `std::process::Command` does.

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack: its steps are a few plain system calls deep.
const STACK: usize = 256 << 10;
/// An inaccessible page under the stack: an overflow faults instead of
/// writing into the parent's memory.
const GUARD: usize = 64 << 10;

/// What to execute and how: the program, its arguments and environment,
/// its standard streams, and the steps it takes before it executes.
pub struct Launch {
    program: CString,
    args: Vec<CString>,
    env: Vec<CString>,
    stdio: [OwnedFd; 3],
    process_group: bool,
}

/// A child just started: its PID stays ours until it is reaped.
#[derive(Debug)]
pub struct Started {
    pub pid: i32,
    pub pidfd: OwnedFd,
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exit status: {code}"),
            Exit::Signal(signal) => write!(f, "signal: {signal}"),
        }
    }
}

impl Started {
    /// How the child ended (reaping it), or `None` while it runs.
    pub fn try_wait(&self) -> io::Result<Option<Exit>> {
        wait_pidfd(&self.pidfd, libc::WNOHANG)
    }

    /// SIGKILL; a child that has already exited is fine.
    pub fn kill(&self) -> io::Result<()> {
        super::send_kill(&self.pidfd)
    }

    /// How the child ended, waiting for it until `deadline` (through its
    /// pidfd); `None` while it still runs.
    pub fn wait_until(&self, deadline: std::time::Instant) -> Option<Exit> {
        super::poll_readable(&[self.pidfd.as_fd()], deadline);
        self.try_wait().ok().flatten()
    }
}

impl Launch {
    /// `program` with the node process's environment, `stdio` as its
    /// standard input, output and error.
    pub fn new(program: &Path, stdio: [OwnedFd; 3]) -> io::Result<Launch> {
        let program = c_string(program.as_os_str())?;
        let env = std::env::vars_os()
            .map(|(k, v)| env_entry(&k, &v))
            .collect::<io::Result<_>>()?;
        Ok(Launch {
            args: vec![program.clone()],
            program,
            env,
            stdio,
            process_group: false,
        })
    }

    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> io::Result<&mut Self> {
        self.args.push(c_string(arg.as_ref())?);
        Ok(self)
    }

    /// Sets `name` (replacing an inherited value).
    pub fn env(&mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> io::Result<()> {
        let entry = env_entry(name.as_ref(), value.as_ref())?;
        let prefix = name.as_ref().len() + 1;
        self.env
            .retain(|e| e.as_bytes().get(..prefix) != entry.as_bytes().get(..prefix));
        self.env.push(entry);
        Ok(())
    }

    /// In a process group of its own: signals for the node's group (a
    /// terminal's Ctrl-C) do not reach it.
    pub fn process_group(&mut self) -> &mut Self {
        self.process_group = true;
        self
    }

    /// Starts the child; `confine` runs in it before it executes (see the
    /// module documentation for what it may do). An error of `confine` or
    /// of `execve` is returned here, the child then reaped.
    pub fn start(&self, confine: &(dyn Fn() -> io::Result<()> + Sync)) -> io::Result<Started> {
        let argv = null_terminated(&self.args);
        let envp = null_terminated(&self.env);
        let child = Child {
            launch: self,
            argv: &argv,
            envp: &envp,
            confine,
            last_signal: libc::SIGRTMAX(),
            error: AtomicI32::new(0),
        };
        let stack = Stack::new()?;
        let mut pidfd: libc::c_int = -1;
        let pid = {
            let _blocked = BlockedSignals::new();
            // SAFETY: the child runs `child_main` on its own stack with a
            // pointer to `child`, which outlives it: CLONE_VFORK suspends
            // this thread until the child executes or exits.
            unsafe {
                libc::clone(
                    child_main,
                    stack.top(),
                    libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD,
                    (&child as *const Child<'_>).cast_mut().cast(),
                    &mut pidfd as *mut libc::c_int,
                )
            }
        };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: CLONE_PIDFD stored a new descriptor there, ours alone.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
        match child.error.load(Ordering::SeqCst) {
            0 => Ok(Started { pid, pidfd }),
            errno => {
                // It exited before it executed: collected here.
                let _ = wait_pidfd(&pidfd, 0);
                Err(io::Error::from_raw_os_error(errno))
            }
        }
    }
}

/// What the child reads, prepared by the parent.
struct Child<'a> {
    launch: &'a Launch,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
    confine: &'a (dyn Fn() -> io::Result<()> + Sync),
    /// The highest signal number, read before the clone.
    last_signal: libc::c_int,
    /// The errno that stopped the child before it executed; 0 if none.
    error: AtomicI32,
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: the parent passed a pointer to a `Child` it keeps alive
    // until this process executes or exits.
    let child = unsafe { &*arg.cast::<Child<'_>>() };
    let failed = |e: io::Error| -> libc::c_int {
        child
            .error
            .store(e.raw_os_error().unwrap_or(libc::EINVAL), Ordering::SeqCst);
        // SAFETY: _exit(2) ends this process without running anything of
        // the parent's.
        unsafe { libc::_exit(127) }
    };
    if let Err(e) = child.prepare() {
        return failed(e);
    }
    if let Err(e) = (child.confine)() {
        return failed(e);
    }
    // SAFETY: NUL-terminated program path, argv and envp arrays ending in
    // null pointers, all owned by the parent's suspended frame.
    unsafe {
        libc::execve(
            child.launch.program.as_ptr(),
            child.argv.as_ptr(),
            child.envp.as_ptr(),
        )
    };
    failed(io::Error::last_os_error())
}

impl Child<'_> {
    /// Default signal dispositions, no signal blocked, the standard
    /// streams, the process group. Plain system calls only.
    fn prepare(&self) -> io::Result<()> {
        // SAFETY: sigaction/sigprocmask/dup2/setpgid on plain values; the
        // signal table changed is this process's own copy (no CLONE_SIGHAND).
        unsafe {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            for signal in 1..=self.last_signal {
                if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                    // EINVAL: a signal glibc keeps for itself.
                    libc::sigaction(signal, &default, std::ptr::null_mut());
                }
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            check(libc::sigprocmask(
                libc::SIG_SETMASK,
                &none,
                std::ptr::null_mut(),
            ))?;
            for (target, fd) in self.launch.stdio.iter().enumerate() {
                let (fd, target) = (fd.as_raw_fd(), target as libc::c_int);
                if fd == target {
                    // dup2 onto itself would keep close-on-exec.
                    check(libc::fcntl(fd, libc::F_SETFD, 0))?;
                } else {
                    check(libc::dup2(fd, target))?;
                }
            }
            if self.launch.process_group {
                check(libc::setpgid(0, 0))?;
            }
        }
        only_streams_on_exec()
    }
}

/// Marks every descriptor above the standard streams close-on-exec, so
/// that the program gets the three streams alone: a descriptor the node
/// process inherited without the flag (a pipe of whoever started it) would
/// otherwise stay open in a daemon that outlives the node. The steps before
/// `execve` still use theirs. Plain system calls only.
fn only_streams_on_exec() -> io::Result<()> {
    let all = libc::c_uint::MAX;
    let flags = libc::CLOSE_RANGE_CLOEXEC as libc::c_long;
    // SAFETY: close_range(2) with the close-on-exec flag closes nothing.
    if unsafe { libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, all, flags) } == 0 {
        return Ok(());
    }
    // Kernels before 5.11: every descriptor the limit allows, one by one.
    // SAFETY: getrlimit/fcntl on plain values.
    unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        check(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit))?;
        let last = limit.rlim_cur.min(1 << 20) as libc::c_int;
        for fd in 3..last {
            if libc::fcntl(fd, libc::F_GETFD) >= 0 {
                check(libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC))?;
            }
        }
    }
    Ok(())
}

/// All signals blocked in this thread while it lives.
struct BlockedSignals(libc::sigset_t);

impl BlockedSignals {
    fn new() -> Self {
        // SAFETY: pthread_sigmask on sets we own.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            BlockedSignals(old)
        }
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// The child's stack, mapped with a guard below it.
struct Stack(*mut libc::c_void);

impl Stack {
    fn new() -> io::Result<Stack> {
        // SAFETY: an anonymous private mapping, then its lowest part made
        // inaccessible; both on memory only this value owns.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                GUARD + STACK,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let stack = Stack(base);
            check(libc::mprotect(base, GUARD, libc::PROT_NONE))?;
            Ok(stack)
        }
    }

    /// Where the stack starts (it grows down), 16-byte aligned.
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of our mapping, a multiple of the page.
        unsafe { self.0.cast::<u8>().add(GUARD + STACK).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.0, GUARD + STACK) };
    }
}

/// Waits for (and reaps) the exited child behind `pidfd`: how it ended, or
/// `None` while it runs under `WNOHANG`. Only ever that process: a pidfd
/// names one.
pub(super) fn wait_pidfd(pidfd: &OwnedFd, flags: libc::c_int) -> io::Result<Option<Exit>> {
    // SAFETY: waitid(2) on a pidfd into a zeroed siginfo; under WNOHANG it
    // leaves `si_pid` 0 while the process runs.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let rc = libc::waitid(
            libc::P_PIDFD,
            pidfd.as_raw_fd() as libc::id_t,
            &mut info,
            libc::WEXITED | flags,
        );
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        if info.si_pid() == 0 {
            return Ok(None);
        }
        Ok(Some(match info.si_code {
            libc::CLD_EXITED => Exit::Code(info.si_status()),
            _ => Exit::Signal(info.si_status()),
        }))
    }
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    (strings.iter().map(|s| s.as_ptr()))
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

fn c_string(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

fn env_entry(name: &OsStr, value: &OsStr) -> io::Result<CString> {
    let mut entry = OsString::from(name);
    entry.push("=");
    entry.push(value);
    c_string(&entry)
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn null_stdio() -> [OwnedFd; 3] {
        let null = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        [null(), null(), null()]
    }

    /// `/bin/sh -c script`, its output and errors into the pipe returned.
    fn shell(script: &str) -> (Launch, std::io::PipeReader) {
        let (read, write) = std::io::pipe().unwrap();
        let null = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let out = OwnedFd::from(write);
        let err = out.try_clone().unwrap();
        let mut launch = Launch::new(Path::new("/bin/sh"), [null, out, err]).unwrap();
        launch.arg("-c").unwrap().arg(script).unwrap();
        (launch, read)
    }

    /// Starts `launch` and reads what it says until it ends.
    fn said(launch: Launch, mut read: std::io::PipeReader) -> (String, Started) {
        let started = launch.start(&|| Ok(())).unwrap();
        // Our copies of the pipe's write end go with `launch`.
        drop(launch);
        let mut said = String::new();
        read.read_to_string(&mut said).unwrap();
        (said, started)
    }

    fn exit_code(started: &Started) -> i32 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        match started.wait_until(deadline) {
            Some(Exit::Code(code)) => code,
            other => panic!("the child ended with {other:?}"),
        }
    }

    #[test]
    fn the_child_gets_its_arguments_environment_and_streams() {
        let (mut launch, read) = shell("echo \"$1 $TESSERA_SPAWN_TEST\"; exit 3");
        launch.arg("sh").unwrap().arg("first").unwrap();
        launch.env("TESSERA_SPAWN_TEST", "old").unwrap();
        launch.env("TESSERA_SPAWN_TEST", "set").unwrap();
        let (said, started) = said(launch, read);
        assert_eq!(said, "first set\n");
        assert_eq!(exit_code(&started), 3);
    }

    #[test]
    fn a_failed_step_or_exec_is_the_callers_error() {
        let launch = Launch::new(Path::new("/bin/true"), null_stdio()).unwrap();
        let denied = launch.start(&|| Err(io::Error::from_raw_os_error(libc::EPERM)));
        assert_eq!(denied.unwrap_err().raw_os_error(), Some(libc::EPERM));
        let missing = Launch::new(Path::new("/nonexistent/program"), null_stdio()).unwrap();
        let err = missing.start(&|| Ok(())).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn the_child_gets_no_descriptor_but_its_streams() {
        // A descriptor this process holds without close-on-exec, as one
        // inherited from whoever started the node would be.
        let (held, _other) = std::io::pipe().unwrap();
        let fd = held.as_raw_fd();
        // SAFETY: clears the flag on a descriptor this test owns.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0);
        let (launch, read) = shell(&format!(
            "if [ -e /proc/$$/fd/{fd} ]; then echo open; else echo closed; fi"
        ));
        let (said, started) = said(launch, read);
        assert_eq!(exit_code(&started), 0);
        assert_eq!(said, "closed\n", "descriptor {fd} reached the program");
    }

    #[test]
    fn the_child_has_default_signals_and_a_group_of_its_own() {
        // The signals the child blocks and ignores; its group beside its PID.
        let (mut launch, read) = shell(
            "grep -E '^Sig(Blk|Ign)' /proc/$$/status; echo $$ $(cut -d' ' -f5 /proc/$$/stat)",
        );
        launch.process_group();
        let (said, started) = said(launch, read);
        assert_eq!(exit_code(&started), 0);
        let lines: Vec<&str> = said.lines().collect();
        assert_eq!(lines[0], "SigBlk:\t0000000000000000", "{said}");
        // This test process ignores SIGPIPE (Rust does); the child does not.
        let ignored = u64::from_str_radix(lines[1].trim_start_matches("SigIgn:\t"), 16).unwrap();
        assert_eq!(ignored & (1 << (libc::SIGPIPE - 1)), 0, "{said}");
        let pid_and_group: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(pid_and_group[0], pid_and_group[1], "{said}");
    }
}
