//! The simulated node's driver root, built one way for the tests, the
//! self-test and `conformance/cluster.sh` (through `tessera-kit
//! driver-root`): what a host with the NVIDIA driver has under its root.
//!
//! * character device nodes as nvidia-modprobe creates them: one per GPU
//!   (for the minors the simulated GPUs have), `nvidiactl`, `nvidia-uvm`
//!   and `nvidia-uvm-tools`. Nothing on this host serves their majors: a
//!   container runtime can hand them to a container, nobody can open them;
//! * the simulated libraries and tools where a driver install has them
//!   (Debian's library directory, which the probe image's loader searches).
//!
//! `proc/devices` and the MIG capability files are the simulated driver's:
//! the fake NVML keeps them in step with its instances
//! (`TESSERA_FAKE_NVML_DRIVER_ROOT`); the capability device nodes are
//! Tessera's to create, as on a real node.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use tessera_fake_nvml::caps::{NVIDIA_MAJOR, NVIDIA_UVM_MAJOR, NVIDIACTL_MINOR};

/// Where a driver install has its libraries (Debian's layout).
pub const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";
/// The NVML library, under the name the loader looks for.
pub const NVML: &str = "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1";
/// The CUDA driver library.
pub const LIBCUDA: &str = "usr/lib/x86_64-linux-gnu/libcuda.so.1";
/// The MPS control binary.
pub const MPS_CONTROL: &str = "usr/bin/nvidia-cuda-mps-control";
/// `nvidia-smi`.
pub const NVIDIA_SMI: &str = "usr/bin/nvidia-smi";

/// The simulated driver's files, as cargo built them.
#[derive(Clone, Debug)]
pub struct Fakes {
    pub nvml: PathBuf,
    pub cuda: PathBuf,
    pub mps_control: PathBuf,
    pub nvidia_smi: PathBuf,
}

impl Fakes {
    /// The fakes in cargo's profile directory (`<target dir>/<profile>`),
    /// under the names cargo gives them; each must be there.
    pub fn in_profile_dir(dir: &Path) -> Result<Fakes> {
        let file = |name: &str| -> Result<PathBuf> {
            let path = dir.join(name);
            ensure!(
                path.exists(),
                "{} is missing: build it (cargo build -p tessera-fake-nvml -p tessera-fake-cuda)",
                path.display()
            );
            Ok(path)
        };
        Ok(Fakes {
            nvml: file("libtessera_fake_nvml.so")?,
            cuda: file("libtessera_fake_cuda.so")?,
            mps_control: file("fake-mps-control")?,
            nvidia_smi: file("nvidia-smi")?,
        })
    }

    /// The fakes as this test process built them.
    pub fn built() -> Fakes {
        use crate::artifacts;
        Fakes {
            nvml: artifacts::fake_nvml_lib().to_owned(),
            cuda: artifacts::fake_cuda_lib().to_owned(),
            mps_control: artifacts::fake_mps_control().to_owned(),
            nvidia_smi: artifacts::fake_nvidia_smi().to_owned(),
        }
    }
}

/// How files come into the root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Install {
    /// Symbolic links to the built files (a host process follows them).
    Link,
    /// Copies, so that every path resolves inside the root (as a pod that
    /// mounts only the root sees it).
    Copy,
}

/// Asks the machine in the root (given its path) for its GPUs' minors.
type AskMinors<'a> = Box<dyn FnOnce(&Path) -> Result<Vec<u32>> + 'a>;

/// Where the GPUs' minors come from.
enum Gpus<'a> {
    Minors(Vec<u32>),
    /// Asked once the files are in place (the simulated NVML is in the root).
    Asked(AskMinors<'a>),
}

/// A driver root to build: devices, files, GPUs.
pub struct DriverRootBuilder<'a> {
    nodes: Vec<(&'static str, u32, u32)>,
    files: Vec<(PathBuf, &'static str)>,
    install: Install,
    gpus: Gpus<'a>,
}

/// A built driver root.
#[derive(Clone, Debug)]
pub struct DriverRoot {
    pub root: PathBuf,
    /// The GPUs' minors, each with its `dev/nvidia<minor>`.
    pub gpus: Vec<u32>,
}

impl DriverRoot {
    /// The NVML library in the root.
    pub fn nvml(&self) -> PathBuf {
        self.root.join(NVML)
    }
}

impl Default for DriverRootBuilder<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> DriverRootBuilder<'a> {
    /// An empty root: no devices, no files, no GPUs.
    pub fn new() -> Self {
        DriverRootBuilder {
            nodes: Vec::new(),
            files: Vec::new(),
            install: Install::Link,
            gpus: Gpus::Minors(Vec::new()),
        }
    }

    /// What a simulated node has besides its GPUs: every control device
    /// and the fakes.
    pub fn simulated(fakes: &Fakes) -> Self {
        Self::new().control_devices().fakes(fakes)
    }

    /// `dev/nvidiactl`, `dev/nvidia-uvm` and `dev/nvidia-uvm-tools`.
    pub fn control_devices(self) -> Self {
        self.nvidiactl().uvm().uvm_tools()
    }

    pub fn nvidiactl(mut self) -> Self {
        self.nodes
            .push(("nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR));
        self
    }

    pub fn uvm(mut self) -> Self {
        self.nodes.push(("nvidia-uvm", NVIDIA_UVM_MAJOR, 0));
        self
    }

    pub fn uvm_tools(mut self) -> Self {
        self.nodes.push(("nvidia-uvm-tools", NVIDIA_UVM_MAJOR, 1));
        self
    }

    /// The NVML and CUDA libraries, the MPS control binary and nvidia-smi.
    pub fn fakes(self, fakes: &Fakes) -> Self {
        self.file(&fakes.nvml, NVML)
            .file(&fakes.cuda, LIBCUDA)
            .file(&fakes.mps_control, MPS_CONTROL)
            .file(&fakes.nvidia_smi, NVIDIA_SMI)
    }

    /// `source` installed at `at` (relative to the root).
    pub fn file(mut self, source: &Path, at: &'static str) -> Self {
        self.files.push((source.to_owned(), at));
        self
    }

    /// Files copied in rather than linked.
    pub fn copied(mut self) -> Self {
        self.install = Install::Copy;
        self
    }

    /// GPUs of these minors.
    pub fn gpus(mut self, minors: impl IntoIterator<Item = u32>) -> Self {
        self.gpus = Gpus::Minors(minors.into_iter().collect());
        self
    }

    /// GPUs whose minors `ask` reports, once the files are in the root
    /// (given its path): the simulated machine says which it has.
    pub fn gpus_asked(mut self, ask: impl FnOnce(&Path) -> Result<Vec<u32>> + 'a) -> Self {
        self.gpus = Gpus::Asked(Box::new(ask));
        self
    }

    /// Builds the root at `root` (created if needed; what is there at the
    /// same paths is replaced).
    pub fn build(self, root: &Path) -> Result<DriverRoot> {
        std::fs::create_dir_all(root.join("dev"))
            .with_context(|| format!("creating {}", root.display()))?;
        for (source, at) in &self.files {
            install(source, &root.join(at), self.install)?;
        }
        for (name, major, minor) in &self.nodes {
            mknod_char(&root.join("dev").join(name), *major, *minor)?;
        }
        let gpus = match self.gpus {
            Gpus::Minors(minors) => minors,
            Gpus::Asked(ask) => ask(root)?,
        };
        for minor in &gpus {
            mknod_char(
                &root.join(format!("dev/nvidia{minor}")),
                NVIDIA_MAJOR,
                *minor,
            )?;
        }
        Ok(DriverRoot {
            root: root.to_owned(),
            gpus,
        })
    }
}

/// `source` at `at`, replacing what is there.
fn install(source: &Path, at: &Path, how: Install) -> Result<()> {
    if let Some(dir) = at.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(at);
    match how {
        Install::Link => std::os::unix::fs::symlink(source, at),
        Install::Copy => std::fs::copy(source, at).map(drop),
    }
    .with_context(|| format!("installing {} as {}", source.display(), at.display()))
}

/// A character device node of mode 0666 (whatever the umask), replacing
/// what is there.
pub fn mknod_char(path: &Path, major: u32, minor: u32) -> Result<()> {
    let _ = std::fs::remove_file(path);
    tessera_fake_nvml::caps::mknod_char(path, major, minor)
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)))
        .with_context(|| format!("mknod {} c {major} {minor}", path.display()))
}

/// The GPUs' minors `tessera --nvml-library <nvml> inventory` reports, run
/// with `env` besides this process's environment.
pub fn inventory_minors(tessera: &Path, nvml: &Path, env: &[(&str, &OsStr)]) -> Result<Vec<u32>> {
    let out = Command::new(tessera)
        .arg("--nvml-library")
        .arg(nvml)
        .args(["inventory", "--output", "json"])
        .envs(env.iter().copied())
        .output()
        .with_context(|| format!("running {}", tessera.display()))?;
    ensure!(
        out.status.success(),
        "tessera inventory on the simulated node failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    minors_of(&out.stdout)
}

/// The `minor` of every GPU in `tessera inventory --output json`.
pub fn minors_of(inventory: &[u8]) -> Result<Vec<u32>> {
    let doc: Value = serde_json::from_slice(inventory).context("tessera inventory's JSON")?;
    doc["gpus"]
        .as_array()
        .context("no gpus in tessera inventory's JSON")?
        .iter()
        .map(|gpu| {
            gpu["minor"]
                .as_u64()
                .and_then(|m| u32::try_from(m).ok())
                .context("a GPU without a minor in tessera inventory's JSON")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minors_are_read_from_the_inventory() {
        let json = br#"{"gpus": [{"index": 0, "minor": 3}, {"index": 1, "minor": 7}]}"#;
        assert_eq!(minors_of(json).unwrap(), vec![3, 7]);
        assert!(minors_of(br#"{"gpus": [{"index": 0}]}"#).is_err());
        assert!(minors_of(b"not json").is_err());
    }

    #[test]
    fn a_root_has_the_devices_and_files_asked_for() {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let dir = std::env::temp_dir().join(format!("kit-root-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let tool = dir.join("tool");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        let root = dir.join("root");
        let built = DriverRootBuilder::new()
            .nvidiactl()
            .file(&tool, NVIDIA_SMI)
            .gpus_asked(|root| {
                assert!(
                    root.join(NVIDIA_SMI).exists(),
                    "asked before the files are in"
                );
                Ok(vec![0, 2])
            })
            .build(&root)
            .unwrap();
        assert_eq!(built.gpus, [0, 2]);
        let mut devices: Vec<_> = std::fs::read_dir(root.join("dev"))
            .unwrap()
            .map(|e| {
                let meta = e.unwrap().metadata().unwrap();
                assert!(meta.file_type().is_char_device());
                assert_eq!(meta.mode() & 0o777, 0o666);
                major_minor(meta.rdev())
            })
            .collect();
        devices.sort();
        assert_eq!(devices, [(195, 0), (195, 2), (195, 255)]);
        assert_eq!(std::fs::read_link(root.join(NVIDIA_SMI)).unwrap(), tool);
        // A second build replaces what the first made.
        DriverRootBuilder::new()
            .nvidiactl()
            .copied()
            .file(&tool, NVIDIA_SMI)
            .build(&root)
            .unwrap();
        assert!(
            !std::fs::symlink_metadata(root.join(NVIDIA_SMI))
                .unwrap()
                .is_symlink()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Linux's encoding of a device number.
    fn major_minor(dev: u64) -> (u64, u64) {
        ((dev >> 8) & 0xfff, (dev & 0xff) | ((dev >> 12) & 0xfff00))
    }
}
