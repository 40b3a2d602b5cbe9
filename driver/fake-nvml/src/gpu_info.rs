//! Each GPU's `information` file, as the NVIDIA kernel module publishes it
//! at `/proc/driver/nvidia/gpus/<bus id>/information`: among other lines
//! its model, UUID, bus location and device minor (the `N` of
//! `/dev/nvidiaN`).
//!
//! The simulated machine writes them below its driver root
//! (`TESSERA_FAKE_NVML_DRIVER_ROOT`) with the MIG capability files
//! ([`crate::caps::reconcile`]). A process that names its GPUs by UUID and
//! must open their device nodes without asking NVML (the simulated MPS
//! server) finds each one's minor here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `<root>/proc/driver/nvidia/gpus`.
pub fn gpus_dir(root: &Path) -> PathBuf {
    root.join("proc/driver/nvidia/gpus")
}

/// The directory the kernel names a GPU's entries by: its bus id with a
/// four-digit domain, in lower case (NVML's form has eight).
pub fn bus_dir(pci_bus_id: &str) -> String {
    let id = pci_bus_id.to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

/// The `information` file of one GPU.
pub fn text(model: &str, uuid: &str, pci_bus_id: &str, minor: u32) -> String {
    format!(
        "Model: \t\t {model}\nGPU UUID: \t {uuid}\nBus Type: \t PCIe\nBus Location: \t {}\n\
         Device Minor: \t {minor}\nGPU Excluded:\t No\n",
        bus_dir(pci_bus_id)
    )
}

/// The device minor of each GPU the files below `root` describe, by UUID;
/// `None` when `root` has no such directory (no simulated module there).
pub fn minors(root: &Path) -> Option<BTreeMap<String, u32>> {
    let entries = std::fs::read_dir(gpus_dir(root)).ok()?;
    let mut minors = BTreeMap::new();
    for entry in entries.flatten() {
        let Ok(info) = std::fs::read_to_string(entry.path().join("information")) else {
            continue;
        };
        if let (Some(uuid), Some(minor)) = (field(&info, "GPU UUID"), field(&info, "Device Minor"))
            && let Ok(minor) = minor.parse()
        {
            minors.insert(uuid.to_owned(), minor);
        }
    }
    Some(minors)
}

/// The value of the `name:` line.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bus_directory_has_a_four_digit_domain() {
        assert_eq!(bus_dir("00000000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(bus_dir("0000:1b:00.0"), "0000:1b:00.0");
    }
}
