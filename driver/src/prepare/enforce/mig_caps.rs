//! MIG capability device nodes.
//!
//! A process may only use a MIG device if it can open the capability device
//! nodes of its GPU instance and compute instance. The NVIDIA kernel driver
//! publishes, per MIG device,
//! `/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access` and
//! `.../gi<G>/ci<C>/access`, text files with a line `DeviceFileMinor: <N>`;
//! the matching device node is `/dev/nvidia-caps/nvidia-cap<N>`. `<minor>`
//! is the parent GPU's device minor (`/dev/nvidia<minor>`), not its index.
//!
//! The files are read below the driver root (the host's `/` normally), and
//! a missing file is an error that says where it looked: without the
//! capability nodes a container could not use its MIG device.

use std::io;
use std::path::{Path, PathBuf};

/// Why a MIG device's capability minors or nodes are not there. The
/// Display, system error included, is what the claim's error says.
#[derive(Debug, thiserror::Error)]
pub enum MigCapsError {
    #[error(
        "cannot read MIG capability file {}: {source} (the NVIDIA driver publishes it for every \
         MIG device; check --driver-root and that the MIG device still exists)",
        .path.display()
    )]
    Read { path: PathBuf, source: io::Error },
    #[error(
        "MIG capability file {} has no `DeviceFileMinor: <number>` line",
        .path.display()
    )]
    NoMinor { path: PathBuf },
    #[error(
        "{} exists but is not the character device of MIG capability {minor}",
        .path.display()
    )]
    NotTheNode { path: PathBuf, minor: u32 },
    #[error("cannot inspect {}: {source}", .path.display())]
    Inspect { path: PathBuf, source: io::Error },
    #[error("creating {}: {source}", .dir.display())]
    CreateDir { dir: PathBuf, source: io::Error },
    #[error("{} contains a NUL byte", .path.display())]
    Nul { path: PathBuf },
    #[error(
        "cannot create MIG capability device {} (c {major}:{minor}): {source}",
        .path.display()
    )]
    Mknod {
        path: PathBuf,
        major: u32,
        minor: u32,
        source: io::Error,
    },
    #[error(
        "no nvidia-caps character device in /proc/devices: the NVIDIA kernel driver is not \
         loaded, or too old for MIG"
    )]
    NoCapsMajor,
}

/// Capability minors of one MIG device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigCaps {
    pub gpu_instance: u32,
    pub compute_instance: u32,
}

/// Directory of the capability files of GPU `minor`, below `root`.
pub fn caps_dir(root: &Path, minor: u32) -> PathBuf {
    root.join(format!("proc/driver/nvidia/capabilities/gpu{minor}/mig"))
}

/// Reads the capability minors of GPU instance `gi` / compute instance
/// `ci` on GPU `minor`.
pub fn read(root: &Path, minor: u32, gi: u32, ci: u32) -> Result<MigCaps, MigCapsError> {
    let dir = caps_dir(root, minor).join(format!("gi{gi}"));
    let gpu_instance = read_minor(&dir.join("access"))?;
    let compute_instance = read_minor(&dir.join(format!("ci{ci}")).join("access"))?;
    Ok(MigCaps {
        gpu_instance,
        compute_instance,
    })
}

/// Path of a capability device node inside a container.
pub fn device_path(cap_minor: u32) -> String {
    format!("/dev/nvidia-caps/nvidia-cap{cap_minor}")
}

/// Makes sure the capability device node `device` (a [`device_path`]) exists
/// below `dev_root` (the root whose `dev/` holds the NVIDIA nodes). The kernel driver registers the `nvidia-caps` major but
/// creates no nodes (`nvidia-modprobe -f` does, on demand), so a MIG device
/// the driver just created usually has none: it is made here, read-only as
/// the driver's `DeviceFileMode` asks, with the major from `/proc/devices`
/// (the driver root's, else the host's).
pub fn ensure_node(
    dev_root: &Path,
    driver_root: &Path,
    device: &str,
    cap_minor: u32,
) -> Result<(), MigCapsError> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let path = dev_root.join(device.trim_start_matches('/'));
    match std::fs::metadata(&path) {
        Ok(m) if m.file_type().is_char_device() && libc::minor(m.rdev()) == cap_minor => {
            return Ok(());
        }
        Ok(_) => {
            return Err(MigCapsError::NotTheNode {
                path,
                minor: cap_minor,
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(MigCapsError::Inspect { path, source }),
    }
    let major = caps_major(driver_root)?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| MigCapsError::CreateDir {
            dir: dir.to_owned(),
            source,
        })?;
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| MigCapsError::Nul { path: path.clone() })?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o444,
            libc::makedev(major, cap_minor),
        )
    };
    let err = io::Error::last_os_error();
    // A concurrent prepare may have made it first.
    if rc != 0 && err.kind() != io::ErrorKind::AlreadyExists {
        return Err(MigCapsError::Mknod {
            path,
            major,
            minor: cap_minor,
            source: err,
        });
    }
    Ok(())
}

/// The `nvidia-caps` character major.
fn caps_major(driver_root: &Path) -> Result<u32, MigCapsError> {
    let candidates = [
        driver_root.join("proc/devices"),
        Path::new("/proc/devices").to_path_buf(),
    ];
    candidates
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|text| char_major(&text, "nvidia-caps"))
        .ok_or(MigCapsError::NoCapsMajor)
}

/// The major of character device `name` in `/proc/devices` text.
pub fn char_major(text: &str, name: &str) -> Option<u32> {
    text.lines()
        .skip_while(|l| !l.starts_with("Character devices:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.trim().split_once(' '))
        .find(|(_, n)| n.trim() == name)
        .and_then(|(m, _)| m.parse().ok())
}

fn read_minor(path: &Path) -> Result<u32, MigCapsError> {
    let text = std::fs::read_to_string(path).map_err(|source| MigCapsError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_minor(&text).ok_or_else(|| MigCapsError::NoMinor {
        path: path.to_owned(),
    })
}

/// The number after `DeviceFileMinor:`.
pub fn parse_minor(text: &str) -> Option<u32> {
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim() == "DeviceFileMinor")
        .and_then(|(_, v)| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_caps_major_among_character_devices_only() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n509 nvidia-caps\n\nBlock devices:\n  9 nvidia-caps\n";
        assert_eq!(char_major(text, "nvidia-caps"), Some(509));
        assert_eq!(char_major(text, "nvidia-uvm"), None);
        assert_eq!(
            char_major("Block devices:\n  9 nvidia-caps\n", "nvidia-caps"),
            None
        );
    }

    #[test]
    fn creates_a_missing_capability_node_and_refuses_an_impostor() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc")).unwrap();
        std::fs::write(
            root.path().join("proc/devices"),
            "Character devices:\n195 nvidia-frontend\n509 nvidia-caps\n",
        )
        .unwrap();
        let dev = root.path();
        let device = device_path(21);
        match ensure_node(dev, root.path(), &device, 21) {
            Err(MigCapsError::Mknod { source, .. })
                if source.kind() == io::ErrorKind::PermissionDenied =>
            {
                eprintln!("SKIP: mknod needs CAP_MKNOD here: {source}");
                return;
            }
            r => r.unwrap(),
        }
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let m = std::fs::metadata(dev.join("dev/nvidia-caps/nvidia-cap21")).unwrap();
        assert!(m.file_type().is_char_device());
        assert_eq!((libc::major(m.rdev()), libc::minor(m.rdev())), (509, 21));
        // Present: nothing to do.
        ensure_node(dev, root.path(), &device, 21).unwrap();
        // A plain file where the node belongs is an error that names it.
        std::fs::write(dev.join("dev/nvidia-caps/nvidia-cap22"), "").unwrap();
        let e = ensure_node(dev, root.path(), &device_path(22), 22).unwrap_err();
        assert!(
            matches!(e, MigCapsError::NotTheNode { minor: 22, .. }),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(
            e.contains("nvidia-cap22") && e.contains("not the character device"),
            "{e}"
        );
    }

    #[test]
    fn parses_driver_format() {
        assert_eq!(
            parse_minor("DeviceFileMinor: 21\nDeviceFileMode: 292\nDeviceFileModify: 1\n"),
            Some(21)
        );
        assert_eq!(parse_minor("DeviceFileMode: 292\n"), None);
        assert_eq!(parse_minor("DeviceFileMinor: x\n"), None);
    }

    #[test]
    fn reads_gi_and_ci_below_root() {
        let root = tempfile::tempdir().unwrap();
        let gi = caps_dir(root.path(), 3).join("gi5");
        std::fs::create_dir_all(gi.join("ci0")).unwrap();
        std::fs::write(gi.join("access"), "DeviceFileMinor: 48\n").unwrap();
        std::fs::write(gi.join("ci0/access"), "DeviceFileMinor: 49\n").unwrap();
        assert_eq!(
            read(root.path(), 3, 5, 0).unwrap(),
            MigCaps {
                gpu_instance: 48,
                compute_instance: 49
            }
        );
        let err = read(root.path(), 3, 6, 0).unwrap_err();
        assert!(matches!(err, MigCapsError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains("gpu3/mig/gi6/access"), "{err}");
        assert_eq!(device_path(48), "/dev/nvidia-caps/nvidia-cap48");
    }
}
