//! CDI specs: one JSON file per prepared claim, and the driver's own.
//!
//! What every container with a GPU needs from the driver (its control and
//! UVM nodes, its libraries and tools) is one spec of the driver's,
//! written at start; a claim's spec holds what is the claim's alone, and
//! prepare answers each device with the CDI ids of both. A container
//! runtime parses every spec of its directories again after each change
//! (containerd does, on every file event), so the bytes each claim adds
//! are paid for at every prepare and unprepare on the node.
//!
//! The driver only *produces* specs; the container runtime consumes them. A
//! spec is written atomically for this boot (into a spare file, [`spare`],
//! or a temp file, then renamed into place) so a runtime never reads half a
//! file and a killed process leaves either the old spec or the new one.
//! `cdiVersion` is the lowest version whose features the content uses,
//! because older runtimes (podman 4.3 in Debian 12 accepts 0.5.0 but not
//! 0.6.0) reject versions they do not know.

pub mod spare;

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::claim_uid::ClaimUid;
use spare::Spares;

/// CDI vendor (the part before `/` in a kind) used for every Tessera spec.
pub const VENDOR: &str = "gpu.tessera.dev";
/// CDI class: every Tessera spec describes the devices of one claim.
pub const CLASS: &str = "claim";
/// File name prefix; the suffix is the claim UID, so cleanup can find ours.
const FILE_PREFIX: &str = "gpu.tessera.dev-claim_";
/// CDI class of the driver's own spec.
pub const DRIVER_CLASS: &str = "driver";
/// The driver spec's file: not a claim's name, so cleanup leaves it.
const DRIVER_FILE: &str = "gpu.tessera.dev-driver.json";
const FILE_SUFFIX: &str = ".json";

/// A CDI spec as this driver writes it (the subset of the CDI schema we use).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// One CDI device: what a container gets when it references this name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

/// Edits applied to the container's OCI spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

/// A device node to create in the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Path inside the container.
    pub path: String,
    /// Path on the host when it differs (a driver root other than `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

/// A bind mount (driver libraries and tools).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub mount_type: Option<String>,
}

/// CDI spec versions this driver may emit, oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CdiVersion {
    V0_3,
    V0_4,
    V0_5,
}

impl CdiVersion {
    pub fn as_str(self) -> &'static str {
        match self {
            CdiVersion::V0_3 => "0.3.0",
            CdiVersion::V0_4 => "0.4.0",
            CdiVersion::V0_5 => "0.5.0",
        }
    }
}

impl Spec {
    /// A spec of `kind` with `devices` and no spec-wide edits (what every
    /// container needs is the driver's spec's), `cdiVersion` set to the
    /// lowest version that can express them.
    fn new(kind: String, devices: Vec<Device>) -> Spec {
        let mut spec = Spec {
            cdi_version: String::new(),
            kind,
            devices,
            container_edits: ContainerEdits::default(),
        };
        spec.cdi_version = spec.minimum_version().as_str().to_owned();
        spec
    }

    /// A spec for one claim: one device per request.
    pub fn for_claim(devices: Vec<Device>) -> Spec {
        Spec::new(kind(), devices)
    }

    /// The lowest CDI version whose schema covers everything in this spec.
    /// 0.4.0 introduced mount `type`; 0.5.0 introduced device node
    /// `hostPath` and device names that do not start with a letter.
    pub fn minimum_version(&self) -> CdiVersion {
        let edits = std::iter::once(&self.container_edits)
            .chain(self.devices.iter().map(|d| &d.container_edits));
        let mut version = CdiVersion::V0_3;
        for e in edits {
            if e.device_nodes.iter().any(|n| n.host_path.is_some()) {
                version = version.max(CdiVersion::V0_5);
            }
            if e.mounts.iter().any(|m| m.mount_type.is_some()) {
                version = version.max(CdiVersion::V0_4);
            }
        }
        let starts_without_letter = |d: &Device| {
            !d.name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic())
        };
        if self.devices.iter().any(starts_without_letter) {
            version = version.max(CdiVersion::V0_5);
        }
        version
    }
}

/// Which of the driver spec's devices a claim's containers get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverDevice {
    /// What CUDA needs: the control and UVM nodes, the driver's libraries
    /// and tools.
    Cuda,
    /// What NVML needs only: the control node, NVML and `nvidia-smi` (a
    /// claim of monitoring devices, which must not run work).
    Nvml,
}

impl DriverDevice {
    pub fn name(self) -> &'static str {
        match self {
            DriverDevice::Cuda => "cuda",
            DriverDevice::Nvml => "nvml",
        }
    }

    /// `gpu.tessera.dev/driver=<name>`, as handed to the kubelet.
    pub fn qualified_name(self) -> String {
        format!("{VENDOR}/{DRIVER_CLASS}={}", self.name())
    }
}

impl Spec {
    /// The driver's spec: one device per [`DriverDevice`], with its edits.
    /// A container listing a device twice (two claims) gets its edits
    /// once: runtimes replace a device node or mount of the same path.
    pub fn for_driver(cuda: ContainerEdits, nvml: ContainerEdits) -> Spec {
        let devices = [(DriverDevice::Cuda, cuda), (DriverDevice::Nvml, nvml)]
            .into_iter()
            .map(|(which, container_edits)| Device {
                name: which.name().to_owned(),
                container_edits,
            })
            .collect();
        Spec::new(format!("{VENDOR}/{DRIVER_CLASS}"), devices)
    }
}

/// `gpu.tessera.dev/claim`
pub fn kind() -> String {
    format!("{VENDOR}/{CLASS}")
}

/// Fully qualified CDI device id, as handed to the kubelet.
pub fn qualified_name(device: &str) -> String {
    format!("{}={device}", kind())
}

/// Where the specs of this driver live, and how they are named.
#[derive(Debug, Clone)]
pub struct SpecDir {
    dir: PathBuf,
    /// Files of removed specs, reused by the next writes.
    spares: Arc<Spares>,
}

impl SpecDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        SpecDir {
            spares: Arc::new(Spares::adopt(&dir, FILE_PREFIX)),
            dir,
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The spec file for a claim. Only a validated [`ClaimUid`] can name a
    /// file, so a crafted UID cannot escape the directory.
    pub fn spec_path(&self, claim: &ClaimUid) -> PathBuf {
        self.dir
            .join(format!("{FILE_PREFIX}{}{FILE_SUFFIX}", claim.as_str()))
    }

    /// Atomically replace the claim's spec.
    pub fn write(&self, claim: &ClaimUid, spec: &Spec) -> std::io::Result<PathBuf> {
        let path = self.spec_path(claim);
        // Compact: the runtime parses every spec of the directory again
        // after each change.
        let bytes = serde_json::to_vec(spec).map_err(std::io::Error::other)?;
        self.spares.write(&path, &bytes)?;
        Ok(path)
    }

    /// The driver's spec file.
    pub fn driver_path(&self) -> PathBuf {
        self.dir.join(DRIVER_FILE)
    }

    /// Writes the driver's spec unless the file already says `spec`;
    /// whether it wrote.
    pub fn write_driver(&self, spec: &Spec) -> std::io::Result<bool> {
        let path = self.driver_path();
        if read(&path).as_ref() == Some(spec) {
            return Ok(false);
        }
        let bytes = serde_json::to_vec(spec).map_err(std::io::Error::other)?;
        write_for_this_boot(&path, &bytes)?;
        Ok(true)
    }

    /// Remove the claim's spec (its file kept as a spare); absent is fine
    /// (unprepare is idempotent). Like the write, for this boot only (see
    /// [`write_for_this_boot`]).
    pub fn remove(&self, claim: &ClaimUid) -> std::io::Result<()> {
        self.spares.remove(&self.spec_path(claim))
    }

    /// Claims that have a spec file here (ours only; other vendors' files
    /// and stray temp files are not claims).
    pub fn claims(&self) -> std::io::Result<Vec<ClaimUid>> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut claims = Vec::new();
        for entry in entries {
            let name = entry?.file_name();
            let Some(name) = name.to_str() else { continue };
            let uid = name
                .strip_prefix(FILE_PREFIX)
                .and_then(|rest| rest.strip_suffix(FILE_SUFFIX));
            if let Some(uid) = uid.and_then(|u| ClaimUid::parse(u).ok()) {
                claims.push(uid);
            }
        }
        claims.sort();
        Ok(claims)
    }

    /// Remove temp files of interrupted spec writes (see
    /// [`remove_stale_temp_files`]).
    pub fn remove_stale_temp_files(&self) -> std::io::Result<Vec<PathBuf>> {
        let mut removed = remove_stale_temp_files(&self.dir, FILE_PREFIX)?;
        removed.extend(remove_stale_temp_files(&self.dir, DRIVER_FILE)?);
        Ok(removed)
    }

    /// Delete spec files of claims not in `keep` (crash leftovers). Returns
    /// what was removed.
    pub fn remove_orphans(
        &self,
        is_prepared: impl Fn(&ClaimUid) -> bool,
    ) -> std::io::Result<Vec<ClaimUid>> {
        let mut removed = Vec::new();
        for uid in self.claims()? {
            if !is_prepared(&uid) {
                self.remove(&uid)?;
                removed.push(uid);
            }
        }
        Ok(removed)
    }
}

/// The spec in the file at `path`, if there is one this driver can read.
pub fn read(path: &Path) -> Option<Spec> {
    let bytes = fs::read(path).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Removes temp files that [`write_atomically`] left in `dir` for targets
/// named `<prefix>...` when their writer was killed between create and
/// rename. A temp file of a live process (another instance during a rolling
/// update) is kept unless it is older than a minute. Returns what was
/// removed.
pub fn remove_stale_temp_files(dir: &Path, prefix: &str) -> std::io::Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let own = std::process::id();
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = name
            .strip_prefix('.')
            .filter(|n| n.starts_with(prefix))
            .and_then(|n| n.rsplit_once(".tmp-"))
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == own {
            continue;
        }
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(60));
        if (!alive || old) && fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    Ok(removed)
}

/// Write `bytes` to `path` so that readers see the old or the new content,
/// never a mix, even across a crash or power loss.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    replace(path, bytes, Durability::PowerLoss)
}

/// Write `bytes` to `path` for this boot only: readers, and this process
/// after a kill, see the old or the new content, never a mix.
///
/// For files that describe what a reboot ends (prepared claims, their CDI
/// specs, MIG devices, MPS daemons). A killed process leaves the page cache
/// intact and the rename alone is atomic, so fsync would only guard against
/// a kernel crash or power loss, after which the boot id differs and the
/// file is discarded (a torn one is set aside as unreadable).
pub fn write_for_this_boot(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    replace(path, bytes, Durability::ThisBoot)
}

/// Removes `path`; a file already gone is fine.
pub fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durability {
    /// Survives a kill of the writer.
    ThisBoot,
    /// Survives a power loss too (fsync of the file and the directory).
    PowerLoss,
}

fn replace(path: &Path, bytes: &[u8], durability: Durability) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| std::io::Error::other("target path has no file name"))?;
    // A leading dot keeps runtimes that scan the directory from picking up
    // the temp file; the pid avoids clashes between an old and a new daemon
    // during a rolling update.
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = create_in_dir(dir, &tmp)?;
        file.write_all(bytes)?;
        if durability == Durability::ThisBoot {
            return fs::rename(&tmp, path);
        }
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Creates `path` in `dir`, and `dir` first if it is missing (checked
/// only then: most writes go to a directory that exists).
fn create_in_dir(dir: &Path, path: &Path) -> std::io::Result<File> {
    match File::create(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::create_dir_all(dir)?;
            File::create(path)
        }
        created => created,
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests;
