//! MIG capability files, kept like the NVIDIA kernel driver keeps them.
//!
//! For every GPU instance and compute instance that exists, the driver
//! publishes `/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access`
//! and `.../gi<G>/ci<C>/access`, each naming the minor of a
//! `/dev/nvidia-caps/nvidia-cap<N>` device node:
//!
//! ```text
//! DeviceFileMinor: <N>
//! DeviceFileMode: 292
//! DeviceFileModify: 1
//! ```
//!
//! When the machine has a driver root (`TESSERA_FAKE_NVML_DRIVER_ROOT`,
//! recorded in the state file so every process keeps the same tree), the
//! files below it follow the state after every change: created for the
//! topology's instances when the state is seeded, created and removed with
//! each create/destroy, all of a GPU's removed when its MIG mode goes off.
//! `.../capabilities/mig/config` (minor 1) and `.../mig/monitor` (minor 2)
//! are written too, `<root>/proc/devices` listing the module's character
//! majors (`nvidia-caps` among them), where the node process looks up the
//! major of the capability device nodes it creates, and each GPU's
//! `information` file ([`crate::gpu_info`]).
//!
//! Minors follow the kernel driver's table (`/proc/driver/nvidia-caps/mig-minors`):
//! 1 and 2 for config and monitor, then per GPU minor 15 GPU instances of
//! 1 + 8 entries each (the GPU instance, then its compute instances 0-7):
//! `gi = 3 + 135 * gpu_minor + 9 * G`, `ci = gi + 1 + C`. That is unique for
//! every id hardware uses (G < 15, C < 8); the rare id beyond that gets no
//! files (and a warning), as no real driver would have one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::gpu_info;
use crate::machine::Machine;

/// GPU instance ids per GPU and compute instance ids per GPU instance in
/// the kernel driver's minor table.
const GPU_INSTANCES: u32 = 15;
const COMPUTE_INSTANCES: u32 = 8;

/// Capability minor of GPU instance `gi` on the GPU with device minor `gpu_minor`.
pub fn gi_minor(gpu_minor: u32, gi: u32) -> Option<u32> {
    (gi < GPU_INSTANCES).then(|| {
        3 + gpu_minor * GPU_INSTANCES * (1 + COMPUTE_INSTANCES) + gi * (1 + COMPUTE_INSTANCES)
    })
}

/// Capability minor of compute instance `ci` of GPU instance `gi`.
pub fn ci_minor(gpu_minor: u32, gi: u32, ci: u32) -> Option<u32> {
    (ci < COMPUTE_INSTANCES).then_some(gi_minor(gpu_minor, gi)? + 1 + ci)
}

/// The `access` file's text for a capability minor and file mode.
pub fn access_text(minor: u32, mode: u32) -> String {
    format!("DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n")
}

/// `<root>/proc/driver/nvidia/capabilities`.
pub fn caps_root(root: &Path) -> PathBuf {
    root.join("proc/driver/nvidia/capabilities")
}

/// Makes the capability files below the machine's driver root match its
/// MIG state. Problems are reported on stderr: a real driver cannot fail a
/// MIG call over them, and a reader of a missing file says which it is.
pub fn reconcile(machine: &Machine) {
    let Some(root) = &machine.driver_root else {
        return;
    };
    if let Err(e) = try_reconcile(machine, &caps_root(root)) {
        eprintln!(
            "tessera-fake-nvml: keeping the MIG capability files below {}: {e}",
            root.display()
        );
    }
}

/// Character majors the simulated kernel module registers, as the kernel
/// lists them in `/proc/devices` (195 is NVIDIA's fixed major; the others
/// are dynamic on real hosts). Nothing on the host serves them.
pub const NVIDIA_MAJOR: u32 = 195;
pub const NVIDIA_UVM_MAJOR: u32 = 508;
pub const NVIDIA_CAPS_MAJOR: u32 = 509;
/// `nvidiactl`'s minor (major [`NVIDIA_MAJOR`]).
pub const NVIDIACTL_MINOR: u32 = 255;

/// Whether `path` is a character device `major:minor` (any major if `None`).
/// Only `stat`ed: nothing serves these nodes on a simulated machine.
pub fn is_char_device(path: &Path, major: Option<u32>, minor: u32) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(meta) = std::fs::metadata(path) else {
        return false;
    };
    let rdev = meta.rdev();
    meta.file_type().is_char_device()
        && major.is_none_or(|m| libc::major(rdev) == m)
        && libc::minor(rdev) == minor
}

/// Makes the character device node `path` (c `major`:`minor`, mode 0666,
/// parents created), as nvidia-modprobe makes a GPU's nodes: for test
/// machines' driver roots. Needs CAP_MKNOD.
pub fn mknod_char(path: &Path, major: u32, minor: u32) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major, minor),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `/proc/devices` of a host with the simulated module loaded.
fn proc_devices() -> String {
    format!(
        "Character devices:\n  1 mem\n{NVIDIA_MAJOR:3} nvidia-frontend\n{NVIDIA_UVM_MAJOR:3} nvidia-uvm\n{NVIDIA_CAPS_MAJOR:3} nvidia-caps\n\nBlock devices:\n  7 loop\n"
    )
}

fn try_reconcile(machine: &Machine, base: &Path) -> std::io::Result<()> {
    if let Some(root) = &machine.driver_root {
        put(&root.join("proc/devices"), &proc_devices())?;
        for g in &machine.gpus {
            let card = &g.card;
            let dir = gpu_info::gpus_dir(root).join(gpu_info::bus_dir(&card.pci_bus_id));
            let text = gpu_info::text(&card.model.name, &card.uuid, &card.pci_bus_id, g.minor);
            put(&dir.join("information"), &text)?;
        }
    }
    put(&base.join("mig/config"), &access_text(1, 256))?;
    put(&base.join("mig/monitor"), &access_text(2, 292))?;
    for g in &machine.gpus {
        let Some(mig) = &g.mig else { continue };
        // GPU instance id -> its compute instance ids; nothing with MIG off.
        let mut want: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        if mig.enabled {
            for (gi, inst) in &mig.gpu_instances {
                want.insert(*gi, inst.compute_instances.keys().copied().collect());
            }
        }
        let dir = base.join(format!("gpu{}/mig", g.minor));
        std::fs::create_dir_all(&dir)?;
        for (name, id) in numbered(&dir, "gi")? {
            if !want.contains_key(&id) {
                std::fs::remove_dir_all(dir.join(name))?;
            }
        }
        for (gi, cis) in &want {
            let Some(minor) = gi_minor(g.minor, *gi) else {
                eprintln!(
                    "tessera-fake-nvml: GPU instance {gi} on GPU {} has no capability minor \
                     (the NVIDIA driver numbers GPU instances 0-{})",
                    g.card.uuid,
                    GPU_INSTANCES - 1
                );
                continue;
            };
            let gi_dir = dir.join(format!("gi{gi}"));
            put(&gi_dir.join("access"), &access_text(minor, 292))?;
            for (name, id) in numbered(&gi_dir, "ci")? {
                if !cis.contains(&id) {
                    std::fs::remove_dir_all(gi_dir.join(name))?;
                }
            }
            for ci in cis {
                let Some(minor) = ci_minor(g.minor, *gi, *ci) else {
                    eprintln!(
                        "tessera-fake-nvml: compute instance {ci} of GPU instance {gi} on GPU \
                         {} has no capability minor (the NVIDIA driver numbers compute \
                         instances 0-{})",
                        g.card.uuid,
                        COMPUTE_INSTANCES - 1
                    );
                    continue;
                };
                put(
                    &gi_dir.join(format!("ci{ci}/access")),
                    &access_text(minor, 292),
                )?;
            }
        }
    }
    Ok(())
}

/// Entries of `dir` named `<prefix><number>`, with the number.
fn numbered(dir: &Path, prefix: &str) -> std::io::Result<Vec<(String, u32)>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(id) = name.strip_prefix(prefix).and_then(|n| n.parse().ok()) {
            out.push((name.to_owned(), id));
        }
    }
    Ok(out)
}

/// Writes `text` to `path` unless it holds it already; atomically, so a
/// reader never sees half a file.
fn put(path: &Path, text: &str) -> std::io::Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minors_follow_the_kernel_driver_table_and_are_unique() {
        assert_eq!(gi_minor(0, 0), Some(3));
        assert_eq!(ci_minor(0, 0, 0), Some(4));
        assert_eq!(ci_minor(0, 0, 7), Some(11));
        assert_eq!(gi_minor(0, 1), Some(12));
        assert_eq!(gi_minor(1, 0), Some(138));
        assert_eq!(gi_minor(0, 15), None);
        assert_eq!(ci_minor(0, 1, 8), None);
        let mut seen = std::collections::BTreeSet::from([1, 2]);
        for gpu in 0..8 {
            for gi in 0..GPU_INSTANCES {
                assert!(seen.insert(gi_minor(gpu, gi).unwrap()));
                for ci in 0..COMPUTE_INSTANCES {
                    assert!(seen.insert(ci_minor(gpu, gi, ci).unwrap()));
                }
            }
        }
    }
}
