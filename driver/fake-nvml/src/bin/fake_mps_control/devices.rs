//! What the MPS server opens when it starts: the driver's control and UVM
//! nodes and the device node of every GPU it serves. A daemon whose view
//! lacks one cannot start a server for its first client, as NVIDIA's
//! cannot, and the client's connection fails.
//!
//! The GPUs are named by UUID; their minors come from the simulated
//! module's `information` files below the machine's driver root
//! (`TESSERA_FAKE_NVML_DRIVER_ROOT`, [`tessera_fake_nvml::gpu_info`]). A
//! daemon that knows no such files runs outside a simulated machine and
//! checks nothing. A MIG device (`MIG-...`) is not looked up: its GPU and
//! capability nodes are not named in those files.

use std::path::Path;

use tessera_fake_nvml::caps::{NVIDIA_MAJOR, NVIDIA_UVM_MAJOR, NVIDIACTL_MINOR, is_char_device};
use tessera_fake_nvml::gpu_info;

/// Why a server for `devices` could not start with the nodes in `dev` (the
/// process's `/dev`), the GPUs' minors read below `driver_root`.
pub fn unusable(devices: &[String], driver_root: Option<&Path>, dev: &Path) -> Option<String> {
    let minors = gpu_info::minors(driver_root?)?;
    let mut nodes = vec![
        ("nvidiactl".to_owned(), NVIDIA_MAJOR, NVIDIACTL_MINOR),
        ("nvidia-uvm".to_owned(), NVIDIA_UVM_MAJOR, 0),
    ];
    for uuid in devices.iter().filter(|d| d.starts_with("GPU-")) {
        let Some(minor) = minors.get(uuid) else {
            return Some(format!("no GPU {uuid} on this machine"));
        };
        nodes.push((format!("nvidia{minor}"), NVIDIA_MAJOR, *minor));
    }
    nodes.into_iter().find_map(|(name, major, minor)| {
        let path = dev.join(&name);
        (!is_char_device(&path, Some(major), minor))
            .then(|| format!("cannot open {} ({major}:{minor})", path.display()))
    })
}
