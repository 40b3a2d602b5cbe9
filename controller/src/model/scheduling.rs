//! What the scheduler is told beyond counters.
//!
//! Compatibility groups (KEP-5963, `DRADeviceCompatibilityGroups`, alpha in
//! 1.37): where the API server keeps them, each counter consumption names
//! the mode its device puts the GPU in, so the scheduler refuses to
//! co-allocate devices of different modes on one counter set by rule. The
//! counters already refuse every such mix (whole GPU and share devices take
//! every counter in full, a MIG placement takes memory slices the others
//! need); the groups say the same as a rule and refuse nothing more:
//! devices of one mode share their group, so what the counters allow
//! within a mode stays allowed.
//!
//! A scheduler without the gate ignores a slice whose devices declare
//! groups, and with it the pool: groups are published only where detected
//! (and not turned off, see `Capabilities::compatibility_groups`).
//!
//! Binding conditions ([`bind_when_made`]) are the other scheduling-time
//! rule the model adds to devices, where the cluster serves them.

use tessera_api::config::IsolationLevel;
use tessera_api::names::binding;

use super::devices::DeviceKind;
use super::plan::GpuOutput;

/// The group of a device of `kind`; `None` for kinds without counters.
pub fn group_of(kind: &DeviceKind) -> Option<&'static str> {
    Some(match kind {
        DeviceKind::Whole => "whole",
        DeviceKind::Mig { .. } => "mig",
        DeviceKind::Share { level, .. } | DeviceKind::Replica { level, .. } => match level {
            IsolationLevel::Isolated => "isolated",
            IsolationLevel::Shared => "shared",
        },
        DeviceKind::Monitor => return None,
    })
}

/// Names the group of every counter consumption of the GPU's devices.
pub fn label(output: &mut GpuOutput) {
    for planned in &mut output.devices {
        let Some(group) = group_of(&planned.reference.kind) else {
            continue;
        };
        for consumption in planned.device.consumes_counters.iter_mut().flatten() {
            consumption.compatibility_groups = Some(vec![group.to_owned()]);
        }
    }
}

/// Where the node makes devices before their pod binds: every dynamic MIG
/// placement not yet made carries the binding conditions (KEP-5007), so the
/// scheduler waits for the node to create it, and places the pod again when
/// the node cannot. Instances that exist need nothing made; whole GPUs and
/// shares are ready at once (a MIG mode switch or an MPS daemon start at
/// prepare depends on nothing another GPU would do better).
pub fn bind_when_made(output: &mut GpuOutput) {
    for planned in &mut output.devices {
        if let DeviceKind::Mig {
            dynamic: true,
            existing: None,
            ..
        } = planned.reference.kind
        {
            planned.device.binding_conditions = Some(vec![binding::MADE.to_owned()]);
            planned.device.binding_failure_conditions = Some(vec![binding::NOT_MADE.to_owned()]);
        }
    }
}
