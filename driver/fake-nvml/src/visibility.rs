//! Which GPUs and MIG devices a process may see: real NVML in a container
//! only answers for the device nodes the runtime gave it.
//!
//! With `TESSERA_FAKE_NVML_DEV_ROOT` set to a directory `D` (`/dev` in a
//! container), a GPU is visible when `D/nvidia<minor>` is a character device
//! 195:`<minor>`, and a MIG device of a visible GPU when both its capability
//! nodes `D/nvidia-caps/nvidia-cap<N>` (GPU instance and compute instance,
//! numbered as in [`crate::caps`]) are character devices of minor `N`. The
//! nodes are only `stat`ed, never opened: there is no NVIDIA kernel module
//! behind them. The nodes a container has are fixed when it starts, so they
//! are looked at once per `nvmlInit*`.

use std::collections::BTreeSet;
use std::path::Path;

use crate::caps::{NVIDIA_MAJOR, is_char_device};

/// The device nodes found below a device root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Visible {
    /// Minors of the GPUs whose `nvidia<minor>` node is there.
    pub gpu_minors: BTreeSet<u32>,
    /// Numbers `N` of the `nvidia-caps/nvidia-cap<N>` nodes that are there.
    pub cap_minors: BTreeSet<u32>,
}

impl Visible {
    /// Looks for the nodes of the GPUs with `gpu_minors` and for every
    /// capability node below `dev_root`.
    pub fn scan(dev_root: &Path, gpu_minors: impl IntoIterator<Item = u32>) -> Visible {
        let gpu_minors = gpu_minors
            .into_iter()
            .filter(|m| {
                is_char_device(&dev_root.join(format!("nvidia{m}")), Some(NVIDIA_MAJOR), *m)
            })
            .collect();
        Visible {
            gpu_minors,
            cap_minors: cap_nodes(&dev_root.join("nvidia-caps")),
        }
    }
}

/// `nvidia-cap<N>` character devices of minor `N` in `dir`. Their major is
/// the `nvidia-caps` one, assigned at module load, so it is not checked.
fn cap_nodes(dir: &Path) -> BTreeSet<u32> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeSet::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let n: u32 = e
                .file_name()
                .to_str()?
                .strip_prefix("nvidia-cap")?
                .parse()
                .ok()?;
            is_char_device(&e.path(), None, n).then_some(n)
        })
        .collect()
}
