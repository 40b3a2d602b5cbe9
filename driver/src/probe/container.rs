//! `tessera probe --cdi-device`: the probe in the container a claim's CDI
//! device makes, with no container runtime (the GPU self-test prepares
//! claims on a node without a kubelet and probes each this way).
//!
//! What decides what a CUDA process gets is applied as a runtime would:
//! the edits' environment, and a fresh `/dev` in a mount namespace of the
//! probe's own holding only the edits' device nodes (beside null, zero,
//! full, random, urandom and tty) and the edits' mounts under `/dev` (an MPS
//! daemon's `/dev/shm`). Mounts elsewhere are the driver's files or a pipe
//! directory at its host path: the host's own file at that path serves (the
//! probe has no root filesystem of its own), except `libcuda.so.1`, which
//! is loaded from the path the spec names, and only if it is the library
//! the driver root holds (`--driver-root`, as `tessera plugin` finds it).
//! Needs root (`CAP_SYS_ADMIN`).
//!
//! The probe runs as root on what a spec file says, so nothing outside its
//! own mount namespace changes, whatever the spec:
//!
//! * the CDI directory and every `*.json` in it must be owned by root (or
//!   the probe's user) and not writable by group or others; spec files are
//!   regular files (symlinks are not followed) of at most
//!   [`MAX_SPEC_BYTES`];
//! * device-node and `/dev` mount paths are absolute and plain (no `.`,
//!   `..` or empty component): `/dev/../x` is refused, not resolved;
//! * host paths are opened without following a final symlink and without
//!   opening the file itself (`O_PATH`), so a FIFO cannot block; a node
//!   must be a character device, a mount source a directory, regular file
//!   or character device;
//! * every node and mount target is made in the probe's own `/dev` tmpfs,
//!   component by component relative to it: a path that would lead into an
//!   earlier mount (a host directory) is refused.
//!
//! Two departures from the spec, each asked for ([`Shape`]): the GPUs' own
//! nodes can be withheld (does an MPS client need them?), and a Pod's hosts
//! file bound on `/etc/hosts`, as the kubelet binds it, so that the node
//! process maps the probe to that Pod as it maps a container's processes.

use std::ffi::{CString, OsStr};
use std::fs::{File, Metadata};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tessera_api::probe::ProbeContainer;

use crate::cdi::ContainerEdits;

mod error;
mod spec;

pub use error::ContainerError;
pub use spec::{find, find_all};

type Result<T, E = ContainerError> = std::result::Result<T, E>;

/// Where container runtimes read CDI specs by default (and where
/// `tessera plugin` writes them unless told otherwise).
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";

/// Largest spec file read. A claim's spec is a few KiB; one naming every
/// GPU of a node with all of the driver's libraries stays far below this.
pub const MAX_SPEC_BYTES: u64 = 1 << 20;

/// Device nodes every container gets.
const STANDARD_NODES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// How the probe's container differs from the one the CDI device makes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shape {
    /// Leave the GPUs' own device nodes (`/dev/nvidia<N>`) out, keeping
    /// `/dev/nvidiactl`, `/dev/nvidia-uvm` and the rest of the edits.
    pub withhold_gpu_nodes: bool,
    /// A file bound on `/etc/hosts`. The kubelet binds each container's
    /// from `<kubelet dir>/pods/<pod UID>/etc-hosts`, and that is how the
    /// node's attribution (metrics, claim guard) finds the Pod of a process
    /// whose cgroup does not name it.
    pub pod_hosts: Option<PathBuf>,
    /// Root of the driver installation `tessera plugin` uses: the spec's
    /// `libcuda.so.1` is loaded only if it is this driver's.
    pub driver_root: PathBuf,
}

/// Whether `path` is a GPU's own device node (`/dev/nvidia<N>`), not the
/// driver's control, UVM or capability nodes.
pub fn is_gpu_node(path: &str) -> bool {
    path.strip_prefix("/dev/nvidia")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A device's edits, ready to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edits {
    pub device: String,
    pub edits: ContainerEdits,
}

fn kind_of(meta: &Metadata) -> &'static str {
    let kind = meta.file_type();
    match () {
        () if kind.is_dir() => "a directory",
        () if kind.is_file() => "a regular file",
        () if kind.is_symlink() => "a symlink",
        () if kind.is_char_device() => "a character device",
        () if kind.is_block_device() => "a block device",
        () if kind.is_fifo() => "a FIFO",
        () if kind.is_socket() => "a socket",
        () => "an unknown kind of file",
    }
}

/// `path` written plainly: absolute, with no empty, `.` or `..` component
/// (nothing to resolve, so what is checked is what is used).
fn plain_absolute(path: &str) -> bool {
    path.strip_prefix('/').is_some_and(|rest| {
        !rest.is_empty()
            && rest
                .split('/')
                .all(|c| !c.is_empty() && c != "." && c != "..")
    }) && !path.contains('\0')
}

/// The part of `path` below `/dev` (`shm` of `/dev/shm`), if it is a plain
/// absolute path under `/dev`.
fn below_dev(path: &str) -> Option<&str> {
    path.strip_prefix("/dev/").filter(|_| plain_absolute(path))
}

/// A container path the probe makes in its own `/dev`: checked before
/// anything is made.
fn dev_target<'a>(device: &str, what: &'static str, path: &'a str) -> Result<&'a str> {
    below_dev(path).ok_or_else(|| ContainerError::NotUnderDev {
        device: device.to_owned(),
        what,
        path: path.to_owned(),
    })
}

fn host_source<'a>(device: &str, what: &'static str, path: &'a str) -> Result<&'a str> {
    if !plain_absolute(path) {
        return Err(ContainerError::NotPlainHost {
            device: device.to_owned(),
            what,
            path: path.to_owned(),
        });
    }
    Ok(path)
}

/// A device node as the host has it, to be made at `path` below `/dev`.
struct Node {
    path: String,
    mode: u32,
    rdev: u64,
}

impl Node {
    fn of(below_dev: &str, host_path: &str) -> Result<Node> {
        let fd = open_path(host_path)?;
        let meta = File::from(fd).metadata()?;
        if !meta.file_type().is_char_device() {
            return Err(ContainerError::NotCharDevice {
                path: host_path.to_owned(),
                kind: kind_of(&meta),
            });
        }
        Ok(Node {
            path: below_dev.to_owned(),
            mode: meta.mode(),
            rdev: meta.rdev(),
        })
    }
}

/// A bind mount under `/dev`.
struct DevMount<'a> {
    source: &'a str,
    /// Below `/dev`.
    target: &'a str,
    read_only: bool,
}

/// A bind mount's source held open across the new `/dev` (opened in the
/// probe's namespace: mount(2) binds only mounts of the caller's).
struct OpenSource<'a> {
    mount: &'a DevMount<'a>,
    fd: OwnedFd,
    is_dir: bool,
}

impl<'a> OpenSource<'a> {
    fn open(mount: &'a DevMount<'a>) -> Result<Self> {
        let fd = open_path(mount.source)?;
        let meta = File::from(fd.try_clone()?).metadata()?;
        let kind = meta.file_type();
        if !(kind.is_dir() || kind.is_file() || kind.is_char_device()) {
            return Err(ContainerError::MountSourceKind {
                path: mount.source.to_owned(),
                kind: kind_of(&meta),
            });
        }
        Ok(OpenSource {
            mount,
            fd,
            is_dir: kind.is_dir(),
        })
    }
}

/// Enters the container of `edits`, as `shape` changes it (this process
/// only), and sets its environment. Returns what was applied, and the
/// `libcuda.so.1` the spec mounts (the library to load unless one was
/// named), which must be one the driver below `shape.driver_root` has.
pub fn enter(edits: &Edits, shape: &Shape) -> Result<(ProbeContainer, Option<PathBuf>)> {
    let mut view = ProbeContainer {
        cdi_device: edits.device.clone(),
        ..ProbeContainer::default()
    };
    // Everything on the host is looked at before the new /dev hides it.
    let nodes = host_nodes(edits, shape, &mut view)?;
    let (dev_mounts, libcuda) = sort_mounts(edits, &shape.driver_root, &mut view)?;
    private_mount_namespace()?;
    if let Some(hosts) = &shape.pod_hosts {
        bind_hosts(hosts)?;
    }
    make_dev(&nodes, &dev_mounts)?;
    set_env(edits, &mut view)?;
    Ok((view, libcuda))
}

/// The standard nodes and the edits' (less the GPUs' own if withheld), as
/// the host has them; the edits' recorded in `view`.
fn host_nodes(edits: &Edits, shape: &Shape, view: &mut ProbeContainer) -> Result<Vec<Node>> {
    let device = edits.device.as_str();
    let mut nodes = Vec::new();
    for name in STANDARD_NODES {
        let path = format!("/dev/{name}");
        if Path::new(&path).exists() {
            nodes.push(Node::of(name, &path)?);
        }
    }
    for n in &edits.edits.device_nodes {
        if shape.withhold_gpu_nodes && is_gpu_node(&n.path) {
            continue;
        }
        let target = dev_target(device, "device node path", &n.path)?;
        let host = host_source(
            device,
            "device node hostPath",
            n.host_path.as_deref().unwrap_or(&n.path),
        )?;
        nodes.push(Node::of(target, host)?);
        view.device_nodes.push(n.path.clone());
    }
    Ok(nodes)
}

/// The edits' mounts: those under `/dev` to bind there, the others served
/// by the host's file at that path; and the driver's `libcuda.so.1` if the
/// spec mounts it. Each recorded in `view`.
fn sort_mounts<'e>(
    edits: &'e Edits,
    driver_root: &Path,
    view: &mut ProbeContainer,
) -> Result<(Vec<DevMount<'e>>, Option<PathBuf>)> {
    let device = edits.device.as_str();
    let mut dev_mounts = Vec::new();
    let mut libcuda = None;
    for m in &edits.edits.mounts {
        let path = &m.container_path;
        if !plain_absolute(path) {
            return Err(ContainerError::NotPlainContainer {
                device: device.to_owned(),
                path: path.clone(),
            });
        }
        if let Some(target) = below_dev(path) {
            dev_mounts.push(DevMount {
                source: host_source(device, "mount hostPath", &m.host_path)?,
                target,
                read_only: m.options.iter().any(|o| o == "ro"),
            });
            view.mounts.push(path.clone());
        } else {
            if path.rsplit('/').next() == Some("libcuda.so.1") {
                libcuda = Some(driver_library(device, driver_root, m)?);
            }
            view.from_host.push(path.clone());
        }
    }
    Ok((dev_mounts, libcuda))
}

/// A fresh `/dev` tmpfs (in the probe's own mount namespace) holding
/// `nodes` and the `mounts`, whose sources are opened before it hides them.
fn make_dev(nodes: &[Node], mounts: &[DevMount]) -> Result<()> {
    let sources = mounts
        .iter()
        .map(OpenSource::open)
        .collect::<Result<Vec<_>>>()?;
    mount(
        Some("tmpfs"),
        "/dev",
        Some("tmpfs"),
        libc::MS_NOSUID,
        Some("mode=755"),
    )?;
    let dev = OwnDev::open()?;
    for node in nodes {
        dev.make_node(node)?;
    }
    for source in &sources {
        dev.bind(source)?;
    }
    Ok(())
}

/// The edits' environment, set in this process; the names recorded in
/// `view`.
fn set_env(edits: &Edits, view: &mut ProbeContainer) -> Result<()> {
    for var in &edits.edits.env {
        let Some((name, value)) = var.split_once('=') else {
            return Err(ContainerError::EnvEntry {
                var: var.clone(),
                device: edits.device.clone(),
            });
        };
        // SAFETY: `tessera probe` runs on the main thread only and has not
        // started any other; nothing reads the environment concurrently.
        unsafe { std::env::set_var(name, value) };
        view.env.push(name.to_owned());
    }
    Ok(())
}

/// The spec's `libcuda.so.1` mount `m`, if the driver below `driver_root`
/// has that very file at that path (what `tessera plugin` would mount):
/// the probe loads a library as root, never one a spec alone names.
fn driver_library(device: &str, driver_root: &Path, m: &crate::cdi::Mount) -> Result<PathBuf> {
    let ours = crate::host::driver_root::discover_driver_files(driver_root);
    if !ours
        .iter()
        .any(|d| d.host_path == m.host_path && d.container_path == m.container_path)
    {
        return Err(ContainerError::NotDriverLibrary {
            device: device.to_owned(),
            host_path: m.host_path.clone(),
            container_path: m.container_path.clone(),
            driver_root: driver_root.to_owned(),
        });
    }
    Ok(PathBuf::from(&m.host_path))
}

/// Binds `file` on `/etc/hosts` (in the probe's own mount namespace).
fn bind_hosts(file: &Path) -> Result<()> {
    let source = file.to_str().ok_or_else(|| ContainerError::HostsNotUtf8 {
        file: file.to_owned(),
    })?;
    if !file.is_file() {
        return Err(ContainerError::NoHostsFile {
            file: source.to_owned(),
        });
    }
    mount(Some(source), "/etc/hosts", None, libc::MS_BIND, None)
}

/// This process's own mount namespace, with nothing propagating back.
fn private_mount_namespace() -> Result<()> {
    // SAFETY: a plain syscall; the probe has one thread.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(ContainerError::Unshare {
            source: std::io::Error::last_os_error(),
        });
    }
    mount(None, "/", None, libc::MS_REC | libc::MS_PRIVATE, None)
}

fn mount(
    source: Option<&str>,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<()> {
    let c = |s: &str| CString::new(s).map_err(|source| ContainerError::Nul { source });
    let (source_c, target_c) = (source.map(c).transpose()?, c(target)?);
    let (fstype_c, data_c) = (fstype.map(c).transpose()?, data.map(c).transpose()?);
    let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: NUL-terminated strings or null, as mount(2) takes them.
    let rc = unsafe {
        libc::mount(
            ptr(&source_c),
            target_c.as_ptr(),
            ptr(&fstype_c),
            flags,
            ptr(&data_c).cast(),
        )
    };
    if rc != 0 {
        return Err(ContainerError::Mount {
            from: source.unwrap_or("(none)").to_owned(),
            target: target.to_owned(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn cstring(name: &OsStr) -> std::io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput.into())
}

/// openat(2) of `name` in directory `dir`.
fn open_at(dir: &OwnedFd, name: &OsStr, flags: libc::c_int) -> std::io::Result<OwnedFd> {
    let name = cstring(name)?;
    // SAFETY: a valid directory descriptor and a NUL-terminated name; the
    // descriptor returned is owned here alone.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, 0o644) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A host path, without following a final symlink and without opening
/// the file itself (`O_PATH`: a FIFO does not block, a device is not
/// opened).
fn open_path(path: &str) -> Result<OwnedFd> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| ContainerError::OpenHost {
            path: path.to_owned(),
            source,
        })?;
    Ok(file.into())
}

fn fd_path(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// The probe's own `/dev` tmpfs, where every node and mount target is made.
struct OwnDev {
    root: OwnedFd,
    /// The tmpfs's device number: a directory with another is some other
    /// file system (an earlier bind mount of a host directory).
    st_dev: u64,
}

impl OwnDev {
    fn open() -> Result<Self> {
        let root = open_path("/dev")?;
        let st_dev = File::from(root.try_clone()?).metadata()?.dev();
        Ok(OwnDev { root, st_dev })
    }

    /// The directory `target`'s last component goes in, made as needed
    /// one component at a time, each in this tmpfs and none a symlink;
    /// and that last component.
    fn parent_of<'t>(&self, target: &'t str) -> Result<(OwnedFd, &'t OsStr)> {
        let (dirs, name) = match target.rsplit_once('/') {
            Some((dirs, name)) => (Some(dirs), name),
            None => (None, target),
        };
        let mut dir = self.root.try_clone()?;
        for part in dirs.into_iter().flat_map(|d| d.split('/')) {
            let c = cstring(OsStr::new(part))?;
            // SAFETY: a valid directory descriptor and a NUL-terminated name.
            if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::AlreadyExists {
                    return Err(ContainerError::MakeDir {
                        target: target.to_owned(),
                        source: e,
                    });
                }
            }
            let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
            let next = open_at(&dir, OsStr::new(part), flags).map_err(|source| {
                ContainerError::NotADir {
                    target: target.to_owned(),
                    part: part.to_owned(),
                    source,
                }
            })?;
            if File::from(next.try_clone()?).metadata()?.dev() != self.st_dev {
                return Err(ContainerError::IntoMount {
                    target: target.to_owned(),
                    part: part.to_owned(),
                });
            }
            dir = next;
        }
        Ok((dir, OsStr::new(name)))
    }

    fn make_node(&self, node: &Node) -> Result<()> {
        let (dir, name) = self.parent_of(&node.path)?;
        let c = cstring(name)?;
        // SAFETY: a valid directory descriptor and a NUL-terminated name;
        // mode and device as the host's node has them.
        if unsafe { libc::mknodat(dir.as_raw_fd(), c.as_ptr(), node.mode, node.rdev) } != 0 {
            return Err(ContainerError::Mknod {
                path: node.path.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        // mknod(2) applies the umask; the node keeps the host's permissions.
        // SAFETY: as above; the name was just made a device node.
        if unsafe { libc::fchmodat(dir.as_raw_fd(), c.as_ptr(), node.mode & 0o7777, 0) } != 0 {
            return Err(ContainerError::Chmod {
                path: node.path.clone(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    fn bind(&self, source: &OpenSource) -> Result<()> {
        let target = source.mount.target;
        let (dir, name) = self.parent_of(target)?;
        let c = cstring(name)?;
        let made = if source.is_dir {
            // SAFETY: a valid directory descriptor and a NUL-terminated name.
            if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) } == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        } else {
            let flags = libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_WRONLY;
            open_at(&dir, name, flags | libc::O_CLOEXEC).map(drop)
        };
        made.map_err(|source| ContainerError::MakeTarget {
            target: target.to_owned(),
            source,
        })?;
        let at = open_at(
            &dir,
            name,
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
        .map_err(|source| ContainerError::OpenTarget {
            target: target.to_owned(),
            source,
        })?;
        // Both ends by descriptor: the bind lands on what was just made.
        mount(
            Some(&fd_path(&source.fd)),
            &fd_path(&at),
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )
        .map_err(|e| ContainerError::Bind {
            from: source.mount.source.to_owned(),
            target: target.to_owned(),
            source: Box::new(e),
        })?;
        if source.mount.read_only {
            mount(
                None,
                &format!("/dev/{target}"),
                None,
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                None,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
