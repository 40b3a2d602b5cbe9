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

use std::path::{Path, PathBuf};

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
pub fn read(root: &Path, minor: u32, gi: u32, ci: u32) -> Result<MigCaps, String> {
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

fn read_minor(path: &Path) -> Result<u32, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "cannot read MIG capability file {}: {e} (the NVIDIA driver publishes it for every \
             MIG device; check --driver-root and that the MIG device still exists)",
            path.display()
        )
    })?;
    parse_minor(&text).ok_or_else(|| {
        format!(
            "MIG capability file {} has no `DeviceFileMinor: <number>` line",
            path.display()
        )
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
        assert!(err.contains("gpu3/mig/gi6/access"), "{err}");
        assert_eq!(device_path(48), "/dev/nvidia-caps/nvidia-cap48");
    }
}
