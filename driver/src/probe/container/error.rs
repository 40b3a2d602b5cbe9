//! Why the probe did not enter a CDI device's container: one variant per
//! step that can refuse or fail, each naming what it looked at and, where
//! the system said why, keeping that as its source.

use std::ffi::NulError;
use std::io;
use std::path::PathBuf;

use super::MAX_SPEC_BYTES;

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("--cdi-device {qualified:?}: want VENDOR/CLASS=NAME, as a CDI device is named")]
    DeviceName { qualified: String },
    #[error("--cdi-dir {}: opening it", .dir.display())]
    OpenDir { dir: PathBuf, source: io::Error },
    #[error(
        "--cdi-dir {}: {why}, so anyone could add a spec the probe would apply as root; \
         fix: chown root and chmod go-w the directory",
        .dir.display()
    )]
    UntrustedDir { dir: PathBuf, why: String },
    #[error("--cdi-dir {}: reading the CDI specs", .dir.display())]
    ReadDir { dir: PathBuf, source: io::Error },
    #[error(
        "CDI spec {}: opening it (symlinks are not followed: put the spec itself there)",
        .path.display()
    )]
    OpenSpec { path: PathBuf, source: io::Error },
    #[error(
        "CDI spec {}: not a regular file ({kind}); remove it from the CDI directory",
        .path.display()
    )]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("CDI spec {}: {why}; fix: chown root and chmod go-w it", .path.display())]
    UntrustedSpec { path: PathBuf, why: String },
    #[error(
        "CDI spec {}: larger than {} bytes, more than any driver's spec; \
         remove it from the CDI directory",
        .path.display(),
        MAX_SPEC_BYTES
    )]
    SpecTooBig { path: PathBuf },
    #[error("CDI spec {}: reading it", .path.display())]
    ReadSpec { path: PathBuf, source: io::Error },
    #[error("--cdi-device {qualified}: no spec in {} has it (is the claim prepared?)", .dir.display())]
    NoSpec { qualified: String, dir: PathBuf },
    #[error(
        "--cdi-device {qualified}: {} specs in {} have it ({}); a runtime refuses that too",
        .specs.len(),
        .dir.display(),
        list(.specs)
    )]
    Ambiguous {
        qualified: String,
        dir: PathBuf,
        specs: Vec<PathBuf>,
    },

    #[error(
        "CDI device {device}: {what} {path:?} is not a plain path under /dev (absolute, \
         without `.`, `..` or `//`); the probe makes nothing outside its own /dev"
    )]
    NotUnderDev {
        device: String,
        what: &'static str,
        path: String,
    },
    #[error(
        "CDI device {device}: {what} {path:?} is not a plain absolute host path (without \
         `.`, `..` or `//`)"
    )]
    NotPlainHost {
        device: String,
        what: &'static str,
        path: String,
    },
    #[error(
        "CDI device {device}: mount containerPath {path:?} is not a plain absolute path \
         (without `.`, `..` or `//`)"
    )]
    NotPlainContainer { device: String, path: String },
    #[error(
        "CDI device {device}: the spec mounts {host_path} as {container_path}, which is not \
         the driver's library below --driver-root {}; the probe loads libcuda.so.1 only from \
         the driver root (point --driver-root at the driver the node process uses)",
        .driver_root.display()
    )]
    NotDriverLibrary {
        device: String,
        host_path: String,
        container_path: String,
        driver_root: PathBuf,
    },
    #[error("{path}: opening it (a final symlink is not followed)")]
    OpenHost { path: String, source: io::Error },
    #[error("device node {path} is {kind}, not a character device")]
    NotCharDevice { path: String, kind: &'static str },
    #[error(
        "mount source {path} is {kind}; a mount under /dev binds a directory, regular file or \
         character device"
    )]
    MountSourceKind { path: String, kind: &'static str },

    #[error("--pod-hosts-file {}: not a UTF-8 path", .file.display())]
    HostsNotUtf8 { file: PathBuf },
    #[error(
        "--pod-hosts-file {file}: no such file (the Pod's hosts file, as the kubelet keeps \
         it in <kubelet dir>/pods/<pod UID>/etc-hosts)"
    )]
    NoHostsFile { file: String },
    #[error("unshare(CLONE_NEWNS): --cdi-device needs root (CAP_SYS_ADMIN)")]
    Unshare { source: io::Error },
    #[error("a path with a NUL byte")]
    Nul { source: NulError },
    #[error("mount {from} on {target}")]
    Mount {
        from: String,
        target: String,
        source: io::Error,
    },
    #[error("making /dev/{target}")]
    MakeDir { target: String, source: io::Error },
    #[error("making /dev/{target}: {part} is not a directory")]
    NotADir {
        target: String,
        part: String,
        source: io::Error,
    },
    #[error(
        "/dev/{target}: {part} is an earlier edit's mount, not the probe's own /dev; \
         a node or mount target inside a mount would be made in a host directory"
    )]
    IntoMount { target: String, part: String },
    #[error("mknod /dev/{path}")]
    Mknod { path: String, source: io::Error },
    #[error("chmod /dev/{path}")]
    Chmod { path: String, source: io::Error },
    #[error("making the mount target /dev/{target}")]
    MakeTarget { target: String, source: io::Error },
    #[error("opening the mount target /dev/{target}")]
    OpenTarget { target: String, source: io::Error },
    #[error("binding {from} on /dev/{target}")]
    Bind {
        from: String,
        target: String,
        source: Box<ContainerError>,
    },
    #[error("CDI env entry {var:?} of {device} is not NAME=VALUE")]
    EnvEntry { var: String, device: String },

    /// A call on a file already open (its metadata, a second descriptor):
    /// the system's reason alone.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// `a, b, c`.
fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
