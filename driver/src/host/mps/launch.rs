//! Where a control daemon's process runs: its own `/dev/shm`, and, when the
//! node process runs in a container, a cgroup of the host outside it.
//!
//! - **Shared memory.** The MPS server and its clients share memory through
//!   `/dev/shm`, so a client in a container needs the server's. Each daemon
//!   runs in a mount view of its own (`view.rs`) whose `/dev/shm` is its
//!   claim's `shm/` directory; the same directory is mounted at `/dev/shm`
//!   in that claim's containers only. No claim sees another claim's
//!   segments, and a daemon never sees the node's `/dev/shm`.
//! - **Outliving the container.** A container runtime ends every process of
//!   a container's cgroup when the container stops (and the kubelet those of
//!   a Pod's cgroup when it removes the Pod), and a PID namespace ends with
//!   its first process. So a daemon spawned by a containerized node process
//!   would die with every restart, crash or rolling update of that process.
//!   With a [`HostCgroup`], the node process runs in the host's PID
//!   namespace (`hostPID`) and each daemon moves, before it executes, into
//!   that cgroup of the host: nothing that ends the container reaches it,
//!   and the next node process adopts it (see `daemon.rs`).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use super::view::View;

/// `statfs` magic of a cgroup v2 filesystem.
const CGROUP2_MAGIC: i64 = 0x6367_7270;
/// `statfs` magic of a cgroup v1 hierarchy.
const CGROUP_MAGIC: i64 = 0x0027_e0eb;

/// Why daemons cannot be placed outside the node process's container.
#[derive(Debug, thiserror::Error)]
pub enum HostCgroupError {
    #[error(
        "{fs} is not a cgroup filesystem (nor a directory of cgroup v1 hierarchies): mount the \
         host's /sys/fs/cgroup there (the chart does, with mps.hostCgroup set)"
    )]
    NotCgroupFs { fs: PathBuf },
    #[error(
        "this process runs in a PID namespace of its own: its MPS daemons would end with it; run \
         it in the host's PID namespace (hostPID: true) or leave --mps-cgroup unset"
    )]
    OwnPidNamespace,
    #[error("invalid cgroup name {name:?}: one path component, no \"/\", \".\" or \"..\"")]
    BadName { name: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A cgroup of the host that MPS daemons move into, in every hierarchy of
/// the host's cgroup filesystem.
#[derive(Debug)]
pub struct HostCgroup {
    /// The cgroup's directory in each hierarchy (one on cgroup v2).
    dirs: Vec<PathBuf>,
    /// `cgroup.procs` of each, as the child writes them.
    procs: Vec<CString>,
    /// The host's cgroup namespace, when this process runs in another one
    /// (a cgroup outside a namespace cannot be joined from inside it).
    namespace: Option<OwnedFd>,
}

impl HostCgroup {
    /// The cgroup `name` below the host's cgroup filesystem mounted at `fs`
    /// (cgroup v2, or the v1 hierarchies below a tmpfs), created where
    /// missing. Checks that this process can place daemons there.
    pub fn open(fs: &Path, name: &str) -> Result<HostCgroup, HostCgroupError> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(HostCgroupError::BadName { name: name.into() });
        }
        if in_own_pid_namespace() {
            return Err(HostCgroupError::OwnPidNamespace);
        }
        let io = |what, path: &Path| {
            let path = path.to_owned();
            move |source| HostCgroupError::Io { what, path, source }
        };
        let hierarchies = hierarchies(fs).map_err(io("reading", fs))?;
        if hierarchies.is_empty() {
            return Err(HostCgroupError::NotCgroupFs { fs: fs.into() });
        }
        let mut dirs = Vec::new();
        for hierarchy in hierarchies {
            let dir = hierarchy.join(name);
            match fs::create_dir(&dir) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                    return Err(io("creating the cgroup", &dir)(e));
                }
                _ => {}
            }
            inherit_cpuset(&hierarchy, &dir).map_err(io("setting the cpuset of", &dir))?;
            dirs.push(dir);
        }
        let procs = dirs
            .iter()
            .map(|d| CString::new(d.join("cgroup.procs").as_os_str().as_bytes()))
            .collect::<Result<_, _>>()
            .map_err(|e| io("naming", fs)(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let namespace =
            host_cgroup_namespace().map_err(io("opening", Path::new(HOST_CGROUP_NS)))?;
        Ok(HostCgroup {
            dirs,
            procs,
            namespace,
        })
    }

    /// The cgroup's directories, one per hierarchy.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Moves the calling (forked, single-threaded) process into the cgroup.
    /// Async-signal-safe: plain system calls on prepared strings.
    fn join(&self) -> io::Result<()> {
        if let Some(ns) = &self.namespace {
            // SAFETY: setns(2) on a namespace descriptor this process holds.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWCGROUP) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        for procs in &self.procs {
            // SAFETY: open/write/close on a NUL-terminated path; "0" moves
            // the writing process.
            unsafe {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if written != 1 {
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// Proves at start that a child can be placed: a forked child joins the
    /// cgroup the way a daemon does and exits there, without executing
    /// anything.
    pub fn check(self: &Arc<Self>) -> Result<(), HostCgroupError> {
        let mut cmd = Command::new("/");
        let cgroup = self.clone();
        // SAFETY: `join` and `_exit` are async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(move || {
                cgroup.join()?;
                libc::_exit(0)
            })
        };
        let io = |what, source| HostCgroupError::Io {
            what,
            path: self.dirs[0].clone(),
            source,
        };
        let status = cmd
            .status()
            .map_err(|e| io("moving a child process into", e))?;
        if !status.success() {
            return Err(io(
                "moving a child process into",
                io::Error::other(format!("the child ended with {status}")),
            ));
        }
        Ok(())
    }
}

/// The host's cgroup namespace, seen through the host's first process.
const HOST_CGROUP_NS: &str = "/proc/1/ns/cgroup";

/// The host's cgroup namespace if this process runs in another one; `None`
/// when it is the same, or when it cannot be read (then joining the cgroup
/// shows whether it is reachable).
fn host_cgroup_namespace() -> io::Result<Option<OwnedFd>> {
    let ours = fs::read_link("/proc/self/ns/cgroup")?;
    match fs::read_link(HOST_CGROUP_NS) {
        Ok(host) if host != ours => Ok(Some(fs::File::open(HOST_CGROUP_NS)?.into())),
        _ => Ok(None),
    }
}

/// Whether this process is in a nested PID namespace (`NSpid` lists a PID
/// per level).
fn in_own_pid_namespace() -> bool {
    fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .is_some_and(|pids| pids.split_whitespace().count() > 1)
    })
}

fn fs_magic(path: &Path) -> io::Result<i64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statfs(2) fills the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// The hierarchies below `fs`: `fs` itself on cgroup v2, else every cgroup
/// mount directly below it (v1 and hybrid; symlinked aliases such as
/// `cpu,cpuacct` once).
fn hierarchies(fs: &Path) -> io::Result<Vec<PathBuf>> {
    if fs_magic(fs)? == CGROUP2_MAGIC {
        return Ok(vec![fs.to_owned()]);
    }
    let mut found = Vec::new();
    for entry in fs::read_dir(fs)? {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        let path = entry.path();
        if matches!(fs_magic(&path), Ok(CGROUP_MAGIC | CGROUP2_MAGIC)) {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// A new cgroup v1 cpuset starts with no CPUs or memory nodes, and no
/// process can join it: give it its parent's.
fn inherit_cpuset(hierarchy: &Path, dir: &Path) -> io::Result<()> {
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let own = dir.join(file);
        if !own.exists() || !fs::read_to_string(&own)?.trim().is_empty() {
            continue;
        }
        fs::write(&own, fs::read_to_string(hierarchy.join(file))?.trim())?;
    }
    Ok(())
}

/// How a daemon (or its control client) is placed: in its own view (see
/// the `view` module), and in the host cgroup if there is one. Run in the
/// child before it executes: async-signal-safe system calls on values
/// prepared before, no allocation.
pub(super) fn confinement(
    view: View<'static>,
    cgroup: Option<Arc<HostCgroup>>,
) -> impl Fn() -> io::Result<()> + Send + Sync + 'static {
    move || {
        if let Some(cgroup) = &cgroup {
            cgroup.join()?;
        }
        view.enter()
    }
}

/// A fresh launcher log in the host-only log directory; the previous one is
/// kept as `<name>.1`. Neither step follows a symlink.
pub(super) fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut previous: std::ffi::OsString = path.as_os_str().to_owned();
    previous.push(".1");
    super::paths::ignore_missing(std::fs::rename(path, &previous))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o640)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_one_component() {
        for bad in ["", "a/b", ".", "..", "/x"] {
            assert!(matches!(
                HostCgroup::open(Path::new("/sys/fs/cgroup"), bad),
                Err(HostCgroupError::BadName { .. })
            ));
        }
    }

    #[test]
    fn a_directory_that_is_no_cgroup_filesystem_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        if in_own_pid_namespace() {
            return;
        }
        assert!(matches!(
            HostCgroup::open(dir.path(), "tessera-mps"),
            Err(HostCgroupError::NotCgroupFs { .. })
        ));
    }
}
