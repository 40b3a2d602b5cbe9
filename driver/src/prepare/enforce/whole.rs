//! The GPU itself: every device a claim gets, whole or a part of it, is
//! reached through its GPU's device node; nothing changes on the host.

use super::{EnforceError, Enforcer, Request};
use crate::cdi::ContainerEdits;

/// `/dev/nvidia<minor>` for each device's GPU.
pub struct WholeGpu;

impl Enforcer for WholeGpu {
    fn edits(&self, request: &Request<'_>, edits: &mut ContainerEdits) -> Result<(), EnforceError> {
        let layout = request.layout;
        for device in &request.devices {
            let gpu = &device.resolved.gpu;
            let node = format!("/dev/nvidia{}", gpu.minor);
            if !layout.exists(&node) {
                return Err(EnforceError::Node {
                    problem: format!(
                        "device node {node} of GPU {} does not exist under {}",
                        gpu.uuid,
                        layout.dev_root.display()
                    ),
                    fix: "load the NVIDIA driver (nvidia-modprobe), or point \
                          --dev-root/--driver-root at where its /dev is"
                        .into(),
                });
            }
            push_node(request, edits, node);
        }
        Ok(())
    }
}

/// Adds a device node once.
pub fn push_node(request: &Request<'_>, edits: &mut ContainerEdits, path: String) {
    if !edits.device_nodes.iter().any(|n| n.path == path) {
        edits.device_nodes.push(request.layout.node(&path));
    }
}
