//! CDI specs: one JSON file per prepared claim.
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
    /// A spec for one claim with `cdiVersion` set to the lowest version that
    /// can express `devices` and `common` edits.
    pub fn for_claim(devices: Vec<Device>, common: ContainerEdits) -> Spec {
        let mut spec = Spec {
            cdi_version: String::new(),
            kind: kind(),
            devices,
            container_edits: common,
        };
        spec.cdi_version = spec.minimum_version().as_str().to_owned();
        spec
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
        remove_stale_temp_files(&self.dir, FILE_PREFIX)
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
mod tests {
    use super::*;

    fn uid() -> ClaimUid {
        ClaimUid::parse("0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e").unwrap()
    }

    fn gpu_device(name: &str) -> Device {
        Device {
            name: name.into(),
            container_edits: ContainerEdits {
                env: vec!["NVIDIA_VISIBLE_DEVICES=GPU-1".into()],
                device_nodes: vec![DeviceNode {
                    path: "/dev/nvidia0".into(),
                    host_path: None,
                    permissions: None,
                }],
                mounts: vec![],
            },
        }
    }

    #[test]
    fn plain_spec_needs_only_0_3() {
        let spec = Spec::for_claim(vec![gpu_device("gpu-0")], ContainerEdits::default());
        assert_eq!(spec.cdi_version, "0.3.0");
        assert_eq!(spec.kind, "gpu.tessera.dev/claim");
    }

    #[test]
    fn host_path_requires_0_5_and_mount_type_0_4() {
        let mut dev = gpu_device("gpu-0");
        let common = ContainerEdits {
            mounts: vec![Mount {
                host_path: "/run/nvidia/driver/usr/bin/nvidia-smi".into(),
                container_path: "/usr/bin/nvidia-smi".into(),
                options: vec!["ro".into(), "bind".into()],
                mount_type: Some("bind".into()),
            }],
            ..Default::default()
        };
        let spec = Spec::for_claim(vec![dev.clone()], common.clone());
        assert_eq!(spec.minimum_version(), CdiVersion::V0_4);
        dev.container_edits.device_nodes[0].host_path =
            Some("/run/nvidia/driver/dev/nvidia0".into());
        let spec = Spec::for_claim(vec![dev], common);
        assert_eq!(spec.cdi_version, "0.5.0");
    }

    #[test]
    fn device_name_starting_with_digit_requires_0_5() {
        let spec = Spec::for_claim(vec![gpu_device("0-gpu")], ContainerEdits::default());
        assert_eq!(spec.minimum_version(), CdiVersion::V0_5);
    }

    #[test]
    fn write_is_atomic_and_remove_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let specs = SpecDir::new(dir.path());
        let spec = Spec::for_claim(vec![gpu_device("gpu-0")], ContainerEdits::default());
        let path = specs.write(&uid(), &spec).unwrap();
        let back: Spec = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, spec);
        // no temp file left beside it
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(
            names,
            vec![format!("gpu.tessera.dev-claim_{}.json", uid().as_str())]
        );
        assert_eq!(specs.claims().unwrap(), vec![uid()]);
        specs.remove(&uid()).unwrap();
        specs.remove(&uid()).unwrap();
        assert!(specs.claims().unwrap().is_empty());
    }

    #[test]
    fn a_removed_spec_file_is_reused_and_never_taken_for_a_spec() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let specs = SpecDir::new(dir.path());
        let spec = Spec::for_claim(vec![gpu_device("gpu-0")], ContainerEdits::default());
        let first = specs.write(&uid(), &spec).unwrap();
        let inode = fs::metadata(&first).unwrap().ino();
        specs.remove(&uid()).unwrap();
        let names = |d: &Path| -> Vec<String> {
            let mut n: Vec<String> = fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            n.sort();
            n
        };
        let left = names(dir.path());
        assert_eq!(left.len(), 1, "{left:?}");
        assert!(
            left[0].starts_with(".gpu.tessera.dev-claim_spare-"),
            "{left:?}"
        );
        assert!(
            !left[0].ends_with(".json"),
            "a runtime's CDI cache skips it"
        );
        // Not a claim, not an orphan, not a stale temp file.
        assert!(specs.claims().unwrap().is_empty());
        assert!(specs.remove_orphans(|_| false).unwrap().is_empty());
        assert!(specs.remove_stale_temp_files().unwrap().is_empty());
        // The next spec goes into it; another process adopts it too.
        let other = ClaimUid::parse("1b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e").unwrap();
        let path = SpecDir::new(dir.path()).write(&other, &spec).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().ino(), inode);
        let back: Spec = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn stale_temp_files_of_dead_writers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let specs = SpecDir::new(dir.path());
        // pid 0 is never a process; our own pid is alive.
        let dead = dir
            .path()
            .join(format!(".{FILE_PREFIX}{}.json.tmp-0", uid().as_str()));
        let mine = dir.path().join(format!(
            ".{FILE_PREFIX}{}.json.tmp-{}",
            uid().as_str(),
            std::process::id()
        ));
        let foreign = dir.path().join(".other.json.tmp-0");
        for f in [&dead, &mine, &foreign] {
            fs::write(f, b"{").unwrap();
        }
        assert_eq!(specs.remove_stale_temp_files().unwrap(), vec![dead.clone()]);
        assert!(!dead.exists() && mine.exists() && foreign.exists());
    }

    #[test]
    fn orphans_are_removed_and_foreign_files_kept() {
        let dir = tempfile::tempdir().unwrap();
        let specs = SpecDir::new(dir.path());
        let spec = Spec::for_claim(vec![gpu_device("gpu-0")], ContainerEdits::default());
        let keep = ClaimUid::parse("11111111-2222-4333-8444-555555555555").unwrap();
        specs.write(&uid(), &spec).unwrap();
        specs.write(&keep, &spec).unwrap();
        fs::write(dir.path().join("nvidia.com-gpu.json"), b"{}").unwrap();
        assert_eq!(specs.remove_orphans(|c| *c == keep).unwrap(), vec![uid()]);
        assert_eq!(specs.claims().unwrap(), vec![keep]);
        assert!(dir.path().join("nvidia.com-gpu.json").exists());
    }
}
