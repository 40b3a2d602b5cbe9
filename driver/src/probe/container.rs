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
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail, ensure};
use tessera_api::probe::ProbeContainer;

use crate::cdi::{ContainerEdits, Spec};

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

/// The edits of CDI device `qualified` (`vendor/class=name`) from the specs
/// in `dir`: the spec's common edits, then the device's own.
pub fn find(dir: &Path, qualified: &str) -> Result<Edits> {
    let Some((kind, name)) = qualified.split_once('=') else {
        bail!("--cdi-device {qualified:?}: want VENDOR/CLASS=NAME, as a CDI device is named");
    };
    let dir_fd = open_spec_dir(dir)?;
    // Listed through the checked descriptor, not the path again.
    let entries = std::fs::read_dir(fd_path(&dir_fd))
        .with_context(|| format!("--cdi-dir {}: reading the CDI specs", dir.display()))?;
    let mut names = entries
        .map(|e| Ok(e?.file_name()))
        .collect::<std::io::Result<Vec<_>>>()
        .with_context(|| format!("--cdi-dir {}: reading the CDI specs", dir.display()))?;
    names.sort();
    let mut found = Vec::new();
    for file in names {
        if Path::new(&file).extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let path = dir.join(&file);
        let bytes = read_spec(&dir_fd, &file, &path)?;
        // Other drivers' specs may use fields this driver never writes.
        let Ok(spec) = serde_json::from_slice::<Spec>(&bytes) else {
            continue;
        };
        if spec.kind != kind {
            continue;
        }
        for device in spec.devices.iter().filter(|d| d.name == name) {
            let mut edits = spec.container_edits.clone();
            edits.env.extend(device.container_edits.env.iter().cloned());
            edits
                .device_nodes
                .extend(device.container_edits.device_nodes.iter().cloned());
            edits
                .mounts
                .extend(device.container_edits.mounts.iter().cloned());
            found.push((path.clone(), edits));
        }
    }
    match found.len() {
        1 => Ok(Edits {
            device: qualified.to_owned(),
            edits: found.remove(0).1,
        }),
        0 => bail!(
            "--cdi-device {qualified}: no spec in {} has it (is the claim prepared?)",
            dir.display()
        ),
        _ => bail!(
            "--cdi-device {qualified}: {} specs in {} have it ({}); a runtime refuses that too",
            found.len(),
            dir.display(),
            found
                .iter()
                .map(|(p, _)| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The CDI directory, once it is known that only root (or this user) can
/// have put files there.
fn open_spec_dir(dir: &Path) -> Result<OwnedFd> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .with_context(|| format!("--cdi-dir {}: opening it", dir.display()))?;
    let meta = file.metadata()?;
    if let Some(why) = untrusted(&meta) {
        bail!(
            "--cdi-dir {}: {why}, so anyone could add a spec the probe would apply as root; \
             fix: chown root and chmod go-w the directory",
            dir.display()
        );
    }
    Ok(file.into())
}

/// Reads spec `file` of the directory `dir` (at `path`): a regular file
/// only root (or this user) can write, of at most [`MAX_SPEC_BYTES`].
fn read_spec(dir: &OwnedFd, file: &OsStr, path: &Path) -> Result<Vec<u8>> {
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let fd = open_at(dir, file, flags).with_context(|| {
        format!(
            "CDI spec {}: opening it (symlinks are not followed: put the spec itself there)",
            path.display()
        )
    })?;
    let file = File::from(fd);
    let meta = file.metadata()?;
    ensure!(
        meta.is_file(),
        "CDI spec {}: not a regular file ({}); remove it from the CDI directory",
        path.display(),
        kind_of(&meta)
    );
    if let Some(why) = untrusted(&meta) {
        bail!(
            "CDI spec {}: {why}; fix: chown root and chmod go-w it",
            path.display()
        );
    }
    let too_big = || {
        anyhow!(
            "CDI spec {}: larger than {MAX_SPEC_BYTES} bytes, more than any driver's spec; \
             remove it from the CDI directory",
            path.display()
        )
    };
    if meta.len() > MAX_SPEC_BYTES {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    file.take(MAX_SPEC_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("CDI spec {}: reading it", path.display()))?;
    if bytes.len() as u64 > MAX_SPEC_BYTES {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Why a file (or directory) the probe acts on as root might hold what
/// someone else wrote: not owned by root or this process's user, or
/// writable by its group or others. `None` when neither.
fn untrusted(meta: &Metadata) -> Option<String> {
    // SAFETY: a plain syscall.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != me {
        return Some(format!("owned by uid {}, not root", meta.uid()));
    }
    let mode = meta.mode() & 0o7777;
    (mode & 0o022 != 0).then(|| format!("writable by its group or others (mode {mode:o})"))
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
fn dev_target<'a>(device: &str, what: &str, path: &'a str) -> Result<&'a str> {
    below_dev(path).ok_or_else(|| {
        anyhow!(
            "CDI device {device}: {what} {path:?} is not a plain path under /dev (absolute, \
             without `.`, `..` or `//`); the probe makes nothing outside its own /dev"
        )
    })
}

fn host_source<'a>(device: &str, what: &str, path: &'a str) -> Result<&'a str> {
    ensure!(
        plain_absolute(path),
        "CDI device {device}: {what} {path:?} is not a plain absolute host path (without \
         `.`, `..` or `//`)"
    );
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
        ensure!(
            meta.file_type().is_char_device(),
            "device node {host_path} is {}, not a character device",
            kind_of(&meta)
        );
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
        ensure!(
            kind.is_dir() || kind.is_file() || kind.is_char_device(),
            "mount source {} is {}; a mount under /dev binds a directory, regular file or \
             character device",
            mount.source,
            kind_of(&meta)
        );
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
    let driver_root = shape.driver_root.as_path();
    let e = &edits.edits;
    let device = edits.device.as_str();
    let mut view = ProbeContainer {
        cdi_device: edits.device.clone(),
        ..ProbeContainer::default()
    };
    // Everything on the host is looked at before the new /dev hides it.
    let mut nodes = Vec::new();
    for name in STANDARD_NODES {
        let path = format!("/dev/{name}");
        if Path::new(&path).exists() {
            nodes.push(Node::of(name, &path)?);
        }
    }
    for n in &e.device_nodes {
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
    let mut dev_mounts = Vec::new();
    let mut libcuda = None;
    for m in &e.mounts {
        let path = &m.container_path;
        ensure!(
            plain_absolute(path),
            "CDI device {device}: mount containerPath {path:?} is not a plain absolute path \
             (without `.`, `..` or `//`)"
        );
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

    private_mount_namespace()?;
    if let Some(hosts) = &shape.pod_hosts {
        bind_hosts(hosts)?;
    }
    let sources = dev_mounts
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
    for node in &nodes {
        dev.make_node(node)?;
    }
    for source in &sources {
        dev.bind(source)?;
    }
    for var in &e.env {
        let Some((name, value)) = var.split_once('=') else {
            bail!("CDI env entry {var:?} of {device} is not NAME=VALUE");
        };
        // SAFETY: `tessera probe` runs on the main thread only and has not
        // started any other; nothing reads the environment concurrently.
        unsafe { std::env::set_var(name, value) };
        view.env.push(name.to_owned());
    }
    Ok((view, libcuda))
}

/// The spec's `libcuda.so.1` mount `m`, if the driver below `driver_root`
/// has that very file at that path (what `tessera plugin` would mount):
/// the probe loads a library as root, never one a spec alone names.
fn driver_library(device: &str, driver_root: &Path, m: &crate::cdi::Mount) -> Result<PathBuf> {
    let ours = crate::host::driver_root::discover_driver_files(driver_root);
    ensure!(
        ours.iter()
            .any(|d| d.host_path == m.host_path && d.container_path == m.container_path),
        "CDI device {device}: the spec mounts {} as {}, which is not the driver's library \
         below --driver-root {}; the probe loads libcuda.so.1 only from the driver root \
         (point --driver-root at the driver the node process uses)",
        m.host_path,
        m.container_path,
        driver_root.display()
    );
    Ok(PathBuf::from(&m.host_path))
}

/// Binds `file` on `/etc/hosts` (in the probe's own mount namespace).
fn bind_hosts(file: &Path) -> Result<()> {
    let source = file
        .to_str()
        .with_context(|| format!("--pod-hosts-file {}: not a UTF-8 path", file.display()))?;
    ensure!(
        file.is_file(),
        "--pod-hosts-file {source}: no such file (the Pod's hosts file, as the kubelet keeps \
         it in <kubelet dir>/pods/<pod UID>/etc-hosts)"
    );
    mount(Some(source), "/etc/hosts", None, libc::MS_BIND, None)
}

/// This process's own mount namespace, with nothing propagating back.
fn private_mount_namespace() -> Result<()> {
    // SAFETY: a plain syscall; the probe has one thread.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(std::io::Error::last_os_error())
            .context("unshare(CLONE_NEWNS): --cdi-device needs root (CAP_SYS_ADMIN)");
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
    let c = |s: &str| CString::new(s).context("a path with a NUL byte");
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
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mount {} on {target}", source.unwrap_or("(none)")));
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
        .with_context(|| format!("{path}: opening it (a final symlink is not followed)"))?;
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
                    return Err(e).with_context(|| format!("making /dev/{target}"));
                }
            }
            let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
            let next = open_at(&dir, OsStr::new(part), flags)
                .with_context(|| format!("making /dev/{target}: {part} is not a directory"))?;
            ensure!(
                File::from(next.try_clone()?).metadata()?.dev() == self.st_dev,
                "/dev/{target}: {part} is an earlier edit's mount, not the probe's own /dev; \
                 a node or mount target inside a mount would be made in a host directory"
            );
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
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("mknod /dev/{}", node.path));
        }
        // mknod(2) applies the umask; the node keeps the host's permissions.
        // SAFETY: as above; the name was just made a device node.
        if unsafe { libc::fchmodat(dir.as_raw_fd(), c.as_ptr(), node.mode & 0o7777, 0) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("chmod /dev/{}", node.path));
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
        made.with_context(|| format!("making the mount target /dev/{target}"))?;
        let at = open_at(
            &dir,
            name,
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
        .with_context(|| format!("opening the mount target /dev/{target}"))?;
        // Both ends by descriptor: the bind lands on what was just made.
        mount(
            Some(&fd_path(&source.fd)),
            &fd_path(&at),
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )
        .with_context(|| format!("binding {} on /dev/{target}", source.mount.source))?;
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
mod tests {
    use super::*;
    use crate::cdi::{Device, DeviceNode, Mount};
    use std::os::unix::fs::PermissionsExt;

    fn spec(kind: &str, devices: &[(&str, &str)]) -> Spec {
        Spec {
            cdi_version: "0.5.0".into(),
            kind: kind.into(),
            devices: devices
                .iter()
                .map(|(name, var)| Device {
                    name: (*name).into(),
                    container_edits: ContainerEdits {
                        env: vec![format!("{var}=1")],
                        device_nodes: vec![DeviceNode {
                            path: "/dev/nvidia0".into(),
                            host_path: None,
                            permissions: None,
                        }],
                        mounts: Vec::new(),
                    },
                })
                .collect(),
            container_edits: ContainerEdits {
                env: vec!["COMMON=1".into()],
                mounts: vec![Mount {
                    host_path: "/opt/x/libcuda.so.1".into(),
                    container_path: "/usr/lib/libcuda.so.1".into(),
                    options: Vec::new(),
                    mount_type: None,
                }],
                ..ContainerEdits::default()
            },
        }
    }

    fn write(dir: &Path, file: &str, spec: &Spec) {
        std::fs::write(dir.join(file), serde_json::to_vec(spec).unwrap()).unwrap();
    }

    #[test]
    fn a_device_gets_its_specs_common_edits_then_its_own() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "a.json",
            &spec("gpu.tessera.dev/claim", &[("u-0", "A"), ("u-1", "B")]),
        );
        std::fs::write(
            dir.path().join("other.json"),
            r#"{"cdiVersion":"0.7.0","kind":"x/y","devices":[],"annotations":{}}"#,
        )
        .unwrap();
        let got = find(dir.path(), "gpu.tessera.dev/claim=u-1").unwrap();
        assert_eq!(got.edits.env, ["COMMON=1", "B=1"]);
        assert_eq!(got.edits.device_nodes.len(), 1);
        assert_eq!(got.edits.mounts[0].container_path, "/usr/lib/libcuda.so.1");
    }

    #[test]
    fn a_missing_or_ambiguous_device_is_named_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "a.json",
            &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
        );
        let e = find(dir.path(), "gpu.tessera.dev/claim=u-9").unwrap_err();
        assert!(e.to_string().contains("is the claim prepared?"), "{e}");
        let e = find(dir.path(), "u-0").unwrap_err();
        assert!(e.to_string().contains("VENDOR/CLASS=NAME"), "{e}");
        write(
            dir.path(),
            "b.json",
            &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
        );
        let e = find(dir.path(), "gpu.tessera.dev/claim=u-0").unwrap_err();
        assert!(e.to_string().contains("2 specs"), "{e}");
    }

    #[test]
    fn only_plain_paths_under_dev_are_made_there() {
        assert_eq!(below_dev("/dev/shm"), Some("shm"));
        assert_eq!(below_dev("/dev/dri/card0"), Some("dri/card0"));
        for path in [
            "/dev",
            "/dev/",
            "/dev/../etc/passwd",
            "/dev/shm/../../x",
            "/dev/./shm",
            "/dev//shm",
            "/dev/shm/",
            "dev/shm",
            "/tmp/tessera-mps/x/pipe",
        ] {
            assert_eq!(below_dev(path), None, "{path}");
        }
        assert!(plain_absolute("/usr/lib/libcuda.so.1"));
        assert!(!plain_absolute("/usr/lib/../../etc"));
        assert!(!plain_absolute("relative"));
        assert!(!plain_absolute("/"));
    }

    #[test]
    fn a_device_node_or_dev_mount_outside_dev_is_refused_before_anything_is_made() {
        let mut edits = Edits {
            device: "gpu.tessera.dev/claim=c-0".into(),
            edits: ContainerEdits::default(),
        };
        edits.edits.device_nodes.push(DeviceNode {
            path: "/tmp/nvidia0".into(),
            host_path: Some("/dev/null".into()),
            permissions: None,
        });
        // Refused before unshare(2): nothing of this test process changes.
        let e = enter(
            &edits,
            &Shape {
                driver_root: "/".into(),
                ..Shape::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("\"/tmp/nvidia0\" is not a plain path under /dev"),
            "{e}"
        );
        edits.edits.device_nodes.clear();
        edits.edits.mounts.push(Mount {
            host_path: "/dev/shm".into(),
            container_path: "/dev/../tmp/x".into(),
            options: Vec::new(),
            mount_type: None,
        });
        let e = enter(
            &edits,
            &Shape {
                driver_root: "/".into(),
                ..Shape::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("\"/dev/../tmp/x\" is not a plain absolute path"),
            "{e}"
        );
    }

    #[test]
    fn libcuda_is_loaded_only_from_the_driver_root() {
        let root = tempfile::tempdir().unwrap();
        let lib = root.path().join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libcuda.so.1"), "").unwrap();
        let real = std::fs::canonicalize(lib.join("libcuda.so.1")).unwrap();
        let mount = |host: &Path| Mount {
            host_path: host.to_str().unwrap().into(),
            container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
            options: Vec::new(),
            mount_type: None,
        };
        let got = driver_library("d", root.path(), &mount(&real)).unwrap();
        assert_eq!(got, real);
        let elsewhere = tempfile::tempdir().unwrap();
        let evil = elsewhere.path().join("libcuda.so.1");
        std::fs::write(&evil, "").unwrap();
        let e = driver_library("d", root.path(), &mount(&evil)).unwrap_err();
        assert!(e.to_string().contains("not the driver's library"), "{e}");
    }

    #[test]
    fn a_cdi_dir_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "a.json",
            &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
        );
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = find(dir.path(), "gpu.tessera.dev/claim=u-0").unwrap_err();
        assert!(
            e.to_string()
                .contains("writable by its group or others (mode 777)"),
            "{e}"
        );
        assert!(e.to_string().contains("chmod go-w"), "{e}");
    }

    /// A spec dir holding `a.json` (device u-0) beside `b.json`, which the
    /// test spoils.
    fn beside_a_good_spec() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        write(
            dir.path(),
            "a.json",
            &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
        );
        dir
    }

    fn refused(dir: &Path) -> String {
        find(dir, "gpu.tessera.dev/claim=u-0")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn spec_files_are_regular_not_writable_by_others_and_small() {
        let dir = beside_a_good_spec();
        let b = dir.path().join("b.json");
        std::fs::write(&b, "{}").unwrap();
        std::fs::set_permissions(&b, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = refused(dir.path());
        assert!(e.contains("b.json: writable by its group or others"), "{e}");

        std::fs::remove_file(&b).unwrap();
        std::os::unix::fs::symlink(dir.path().join("a.json"), &b).unwrap();
        let e = refused(dir.path());
        assert!(
            e.contains("b.json: opening it (symlinks are not followed"),
            "{e}"
        );

        // A FIFO is refused at once, not read (which would block).
        std::fs::remove_file(&b).unwrap();
        let c = CString::new(b.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = refused(dir.path());
        assert!(e.contains("b.json: not a regular file (a FIFO)"), "{e}");

        std::fs::remove_file(&b).unwrap();
        let big = File::create(&b).unwrap();
        big.set_len(MAX_SPEC_BYTES + 1).unwrap();
        let e = refused(dir.path());
        assert!(e.contains("b.json: larger than 1048576 bytes"), "{e}");

        std::fs::remove_file(&b).unwrap();
        assert!(find(dir.path(), "gpu.tessera.dev/claim=u-0").is_ok());
    }

    #[test]
    fn a_spec_owned_by_another_user_is_refused() {
        // SAFETY: plain syscalls.
        if unsafe { libc::geteuid() } != 0 {
            println!("*** SKIPPED: giving a file to another user needs root");
            return;
        }
        let dir = beside_a_good_spec();
        let b = dir.path().join("b.json");
        std::fs::write(&b, "{}").unwrap();
        std::os::unix::fs::chown(&b, Some(65534), None).unwrap();
        let e = refused(dir.path());
        assert!(e.contains("b.json: owned by uid 65534, not root"), "{e}");
    }

    #[test]
    fn only_a_gpus_own_node_is_withheld() {
        for gpu in ["/dev/nvidia0", "/dev/nvidia7", "/dev/nvidia15"] {
            assert!(is_gpu_node(gpu), "{gpu}");
        }
        for other in [
            "/dev/nvidia",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-modeset",
            "/dev/nvidia-caps/nvidia-cap21",
            "/dev/nvidia0x",
            "/dev/dri/card0",
        ] {
            assert!(!is_gpu_node(other), "{other}");
        }
    }
}
