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
//! is loaded from the path the spec names. Needs root (`CAP_SYS_ADMIN`);
//! nothing outside the probe's own mount namespace changes.
//!
//! Two departures from the spec, each asked for ([`Shape`]): the GPUs' own
//! nodes can be withheld (does an MPS client need them?), and a Pod's hosts
//! file bound on `/etc/hosts`, as the kubelet binds it, so that the node
//! process maps the probe to that Pod as it maps a container's processes.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use tessera_api::probe::ProbeContainer;

use crate::cdi::{ContainerEdits, Spec};

/// Where container runtimes read CDI specs by default (and where
/// `tessera plugin` writes them unless told otherwise).
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";

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
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("--cdi-dir {}: reading the CDI specs", dir.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        // Other drivers' specs may use fields this driver never writes.
        let Ok(spec) = serde_json::from_slice::<Spec>(&std::fs::read(&path)?) else {
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

/// A device node as the host has it.
struct Node {
    path: String,
    mode: u32,
    rdev: u64,
}

impl Node {
    fn of(container_path: &str, host_path: &Path) -> Result<Node> {
        let meta = std::fs::metadata(host_path)
            .with_context(|| format!("device node {}", host_path.display()))?;
        let kind = meta.file_type();
        ensure!(
            kind.is_char_device() || kind.is_block_device(),
            "{} is not a device node",
            host_path.display()
        );
        Ok(Node {
            path: container_path.to_owned(),
            mode: meta.mode(),
            rdev: meta.rdev(),
        })
    }
}

/// A bind mount under `/dev`.
struct DevMount<'a> {
    source: &'a str,
    target: &'a str,
    read_only: bool,
}

/// A bind mount's source held open across the new `/dev` (opened in the
/// probe's namespace: mount(2) binds only mounts of the caller's).
struct OpenSource<'a> {
    mount: &'a DevMount<'a>,
    file: File,
    is_dir: bool,
}

/// Enters the container of `edits`, as `shape` changes it (this process
/// only), and sets its environment. Returns what was applied, and the
/// `libcuda.so.1` the spec mounts (the library to load unless one was
/// named).
pub fn enter(edits: &Edits, shape: &Shape) -> Result<(ProbeContainer, Option<PathBuf>)> {
    let e = &edits.edits;
    let mut view = ProbeContainer {
        cdi_device: edits.device.clone(),
        ..ProbeContainer::default()
    };
    // Everything on the host is looked at before the new /dev hides it.
    let mut nodes = Vec::new();
    for name in STANDARD_NODES {
        let path = format!("/dev/{name}");
        if Path::new(&path).exists() {
            nodes.push(Node::of(&path, Path::new(&path))?);
        }
    }
    for n in &e.device_nodes {
        if shape.withhold_gpu_nodes && is_gpu_node(&n.path) {
            continue;
        }
        let host = n.host_path.as_deref().unwrap_or(&n.path);
        nodes.push(Node::of(&n.path, Path::new(host))?);
        view.device_nodes.push(n.path.clone());
    }
    let mut dev_mounts = Vec::new();
    let mut libcuda = None;
    for m in &e.mounts {
        if under_dev(&m.container_path) {
            dev_mounts.push(DevMount {
                source: &m.host_path,
                target: &m.container_path,
                read_only: m.options.iter().any(|o| o == "ro"),
            });
            view.mounts.push(m.container_path.clone());
        } else {
            if m.container_path.rsplit('/').next() == Some("libcuda.so.1") {
                libcuda = Some(PathBuf::from(&m.host_path));
            }
            view.from_host.push(m.container_path.clone());
        }
    }

    private_mount_namespace()?;
    if let Some(hosts) = &shape.pod_hosts {
        bind_hosts(hosts)?;
    }
    let sources = dev_mounts
        .iter()
        .map(|mount| {
            let file = File::open(mount.source)
                .with_context(|| format!("mount source {}", mount.source))?;
            let is_dir = file.metadata()?.is_dir();
            Ok(OpenSource {
                mount,
                file,
                is_dir,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    mount(
        Some("tmpfs"),
        "/dev",
        Some("tmpfs"),
        libc::MS_NOSUID,
        Some("mode=755"),
    )?;
    for node in &nodes {
        make_node(node)?;
    }
    for source in &sources {
        bind(source)?;
    }
    for var in &e.env {
        let Some((name, value)) = var.split_once('=') else {
            bail!(
                "CDI env entry {var:?} of {} is not NAME=VALUE",
                edits.device
            );
        };
        // SAFETY: `tessera probe` runs on the main thread only and has not
        // started any other; nothing reads the environment concurrently.
        unsafe { std::env::set_var(name, value) };
        view.env.push(name.to_owned());
    }
    Ok((view, libcuda))
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

fn under_dev(path: &str) -> bool {
    path.starts_with("/dev/")
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

fn make_parent(path: &str) -> Result<()> {
    if let Some(parent) = Path::new(path).parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    Ok(())
}

fn make_node(node: &Node) -> Result<()> {
    make_parent(&node.path)?;
    let path = CString::new(node.path.as_str()).context("a path with a NUL byte")?;
    // SAFETY: a NUL-terminated path; mode and device as the host's node has them.
    if unsafe { libc::mknod(path.as_ptr(), node.mode, node.rdev) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mknod {}", node.path));
    }
    // mknod(2) applies the umask; the node keeps the host's permissions.
    std::fs::set_permissions(
        &node.path,
        std::fs::Permissions::from_mode(node.mode & 0o7777),
    )
    .with_context(|| format!("chmod {}", node.path))
}

fn bind(source: &OpenSource) -> Result<()> {
    let target = source.mount.target;
    make_parent(target)?;
    if source.is_dir {
        std::fs::create_dir_all(target)
    } else {
        File::create(target).map(drop)
    }
    .with_context(|| format!("creating {target}"))?;
    let fd = format!("/proc/self/fd/{}", source.file.as_raw_fd());
    mount(Some(&fd), target, None, libc::MS_BIND | libc::MS_REC, None)?;
    if source.mount.read_only {
        mount(
            None,
            target,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
            None,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi::{Device, DeviceNode, Mount};

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

    #[test]
    fn only_mounts_under_dev_are_made() {
        assert!(under_dev("/dev/shm"));
        assert!(!under_dev("/dev"));
        assert!(!under_dev("/tmp/tessera-mps/x/pipe"));
    }
}
