//! Where the NVIDIA driver's files and device nodes are on this host, and
//! which of its files every container with a claim gets.

use std::path::{Path, PathBuf};

use crate::cdi::{DeviceNode, Mount};

/// Where the NVIDIA driver's files are on this host.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Root of the driver installation (`/`, or `/run/nvidia/driver` for a
    /// containerized driver): libraries, tools, `/proc/driver/nvidia`.
    pub driver_root: PathBuf,
    /// Where the device nodes are (`/dev` below this root).
    pub dev_root: PathBuf,
    /// Driver libraries and tools mounted into every container with a
    /// claim (see [`discover_driver_files`]).
    pub driver_files: Vec<Mount>,
    /// Where HAMi-core's `libvgpu.so` and `ld.so.preload` are on this host
    /// (Isolated shares whose provider is `hami-core`).
    pub hami_core_dir: PathBuf,
}

impl Layout {
    pub fn node(&self, container_path: &str) -> DeviceNode {
        let host = host_path(&self.dev_root, container_path);
        DeviceNode {
            path: container_path.to_owned(),
            host_path: (host.to_str() != Some(container_path))
                .then(|| host.to_string_lossy().into_owned()),
            permissions: None,
        }
    }

    pub fn exists(&self, container_path: &str) -> bool {
        host_path(&self.dev_root, container_path).exists()
    }
}

fn host_path(root: &Path, container_path: &str) -> PathBuf {
    root.join(container_path.trim_start_matches('/'))
}

/// Whether a driver file is one a monitoring agent needs: NVML and
/// `nvidia-smi`.
pub(crate) fn is_nvml_file(container_path: &str) -> bool {
    let name = container_path.rsplit('/').next().unwrap_or_default();
    name.starts_with("libnvidia-ml.so") || name == "nvidia-smi"
}

/// The driver's user-space files to mount into containers: the libraries
/// CUDA programs load and the tools operators expect (`nvidia-smi`), found
/// below `root` in the usual library and binary directories. Each file is
/// mounted read-only at the same path inside the container; a versioned
/// library reached through its soname link (`libcuda.so.1 ->
/// libcuda.so.550.90.07`) is mounted under both names.
pub fn discover_driver_files(root: &Path) -> Vec<Mount> {
    const LIB_DIRS: &[&str] = &[
        "usr/lib/x86_64-linux-gnu",
        "usr/lib/aarch64-linux-gnu",
        "usr/lib64",
        "usr/lib",
        "lib64",
        "lib/x86_64-linux-gnu",
    ];
    const LIB_PREFIXES: &[&str] = &[
        "libcuda.so",
        "libcudadebugger.so",
        "libnvidia-ml.so",
        "libnvidia-ptxjitcompiler.so",
        "libnvidia-nvvm.so",
        "libnvidia-opencl.so",
        "libnvidia-cfg.so",
        "libnvidia-allocator.so",
        "libnvidia-gpucomp.so",
    ];
    const BIN_DIRS: &[&str] = &["usr/bin", "bin"];
    const TOOLS: &[&str] = &["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"];
    let mut mounts: Vec<Mount> = Vec::new();
    let mut add = |host: &Path, container: String| {
        if mounts.iter().any(|m| m.container_path == container) {
            return;
        }
        mounts.push(Mount {
            host_path: host.to_string_lossy().into_owned(),
            container_path: container,
            options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
            mount_type: None,
        });
    };
    for dir in LIB_DIRS {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| LIB_PREFIXES.iter().any(|p| n.starts_with(p)))
            .collect();
        names.sort();
        for name in names {
            let host = root.join(dir).join(&name);
            // Resolve links so the mount source is a file; skip dangling ones.
            let Ok(real) = std::fs::canonicalize(&host) else {
                continue;
            };
            // `libcuda.so` (no version) is for linking only.
            if name.ends_with(".so") {
                continue;
            }
            add(&real, format!("/{dir}/{name}"));
        }
    }
    for dir in BIN_DIRS {
        for tool in TOOLS {
            let host = root.join(dir).join(tool);
            if let Ok(real) = std::fs::canonicalize(&host) {
                add(&real, format!("/usr/bin/{tool}"));
            }
        }
    }
    mounts
}
