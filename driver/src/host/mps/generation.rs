//! What the node offers for the next generation of Isolated enforcement,
//! detected and reported, not used: MPS v3 (one server whose namespaces are
//! routed by cgroup, documented from driver branch r615 / CUDA 13.4) and
//! the cgroup v2 `dmem` controller (device memory limited per cgroup by the
//! kernel). Today every Isolated claim is enforced by its own MPS control
//! daemon (docs/isolation.md, "Per driver generation").

use std::fs;
use std::path::Path;

use serde::Serialize;

/// The first driver branch whose MPS has cgroup-routed namespaces (v3).
pub const MPS_V3_BRANCH: u32 = 615;

/// How Isolated shares are enforced on this node, and what the next
/// generation's pieces look like here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IsolationSupport {
    /// What Tessera enforces Isolated shares with on this node.
    pub enforced_by: &'static str,
    /// `v2` (unified), `hybrid` (v1 controllers beside a v2 mount) or `v1`.
    pub cgroup: &'static str,
    /// The cgroup v2 `dmem` controller is available at the root.
    pub dmem_controller: bool,
    /// Device memory regions the kernel limits (`dmem.capacity`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dmem_regions: Vec<String>,
    /// The driver's branch has MPS v3 (r615 or newer).
    pub mps_v3_driver: bool,
}

/// Detects from the cgroup filesystem at `cgroup_root` (the host's
/// `/sys/fs/cgroup`) and the driver version NVML reports (`580.159.04`).
pub fn detect(cgroup_root: &Path, driver_version: &str) -> IsolationSupport {
    let controllers = |dir: &Path| fs::read_to_string(dir.join("cgroup.controllers")).ok();
    let (cgroup, unified) = match controllers(cgroup_root) {
        Some(list) => ("v2", Some(list)),
        None => match controllers(&cgroup_root.join("unified")) {
            Some(list) => ("hybrid", Some(list)),
            None => ("v1", None),
        },
    };
    let dmem_controller = unified
        .as_deref()
        .is_some_and(|list| list.split_whitespace().any(|c| c == "dmem"));
    let dmem_regions = if dmem_controller {
        fs::read_to_string(cgroup_root.join("dmem.capacity"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect()
    } else {
        Vec::new()
    };
    IsolationSupport {
        enforced_by: "mps-daemon-per-claim",
        cgroup,
        dmem_controller,
        dmem_regions,
        mps_v3_driver: driver_branch(driver_version).is_some_and(|b| b >= MPS_V3_BRANCH),
    }
}

/// The branch (major version) of a driver version string.
fn driver_branch(version: &str) -> Option<u32> {
    version.split('.').next()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_v1_and_an_r580_driver_have_neither() {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir(root.path().join("memory")).unwrap();
        let s = detect(root.path(), "580.159.04");
        assert_eq!(s.cgroup, "v1");
        assert!(!s.dmem_controller && s.dmem_regions.is_empty() && !s.mps_v3_driver);
        assert_eq!(s.enforced_by, "mps-daemon-per-claim");
    }

    #[test]
    fn hybrid_mounts_read_the_unified_hierarchy() {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir(root.path().join("unified")).unwrap();
        fs::write(root.path().join("unified/cgroup.controllers"), "\n").unwrap();
        let s = detect(root.path(), "550.90.07");
        assert_eq!(s.cgroup, "hybrid");
        assert!(!s.dmem_controller);
    }

    #[test]
    fn dmem_regions_and_an_r615_driver_are_reported() {
        let root = tempfile::tempdir().unwrap();
        fs::write(
            root.path().join("cgroup.controllers"),
            "cpuset cpu io memory dmem pids\n",
        )
        .unwrap();
        fs::write(
            root.path().join("dmem.capacity"),
            "drm/0000:07:00.0/vram0 85899345920\ndrm/0000:0f:00.0/vram0 85899345920\n",
        )
        .unwrap();
        let s = detect(root.path(), "615.10");
        assert_eq!(s.cgroup, "v2");
        assert!(s.dmem_controller && s.mps_v3_driver);
        assert_eq!(
            s.dmem_regions,
            ["drm/0000:07:00.0/vram0", "drm/0000:0f:00.0/vram0"]
        );
        // v2 without the controller: no regions read.
        fs::write(root.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
        assert!(!detect(root.path(), "bad").dmem_controller);
        assert!(!detect(root.path(), "bad").mps_v3_driver);
    }
}
