//! The GPU's compute time slice: a whole GPU's `TimeSlicing` config, or the
//! node policy's slice for Shared shares. Set under the node's hardware lock,
//! recorded (a `TimeSlice` action) before it is set, and reset with the
//! GPU's last holder: another claim's recorded action keeps the slice.
//!
//! The slice is set with the driver root's `nvidia-smi`
//! (`compute-policy -i <GPU UUID> --set-timeslice=<0..3>`), as on a real
//! node: NVML has no call for it.

use std::sync::Arc;

use tessera_api::config::{EffectiveConfig, Sharing as ConfigSharing, TimeSliceInterval};

use super::{Device, Effects, EnforceError, Enforcer, Undo};
use crate::host::port::TimeSliceControl;
use crate::prepare::resolve::{Kind, Resolved};
use crate::state::records::{Action, DeviceData};

/// The time slice a device sets on its GPU: its config's `TimeSlicing`
/// interval (whole GPUs), or the node policy's for a Shared share.
pub fn interval(device: &Resolved, config: &EffectiveConfig) -> Option<TimeSliceInterval> {
    match (config, &device.kind) {
        (
            EffectiveConfig::Gpu {
                sharing: ConfigSharing::TimeSlicing { interval },
            },
            _,
        ) => Some(*interval),
        (EffectiveConfig::Share { .. }, Kind::Share { time_slice, .. }) => *time_slice,
        _ => None,
    }
}

pub struct TimeSlice {
    host: Arc<dyn TimeSliceControl>,
}

impl TimeSlice {
    pub fn new(host: Arc<dyn TimeSliceControl>) -> Self {
        TimeSlice { host }
    }
}

impl Enforcer for TimeSlice {
    fn plan(&self, devices: &[Device]) -> Vec<Action> {
        devices
            .iter()
            .filter(|d| interval(&d.resolved, &d.config).is_some())
            .map(|d| Action::TimeSlice {
                gpu_uuid: d.resolved.gpu.uuid.clone(),
            })
            .collect()
    }

    fn apply(&self, cx: &mut Effects<'_>, devices: &mut [Device]) -> Result<bool, EnforceError> {
        for device in devices.iter() {
            let Some(interval) = interval(&device.resolved, &device.config) else {
                continue;
            };
            if !cx.may_block() {
                return Err(EnforceError::WouldBlock);
            }
            // Under the hardware lock, so it cannot cross another claim's
            // reset.
            let gpu = &device.resolved.gpu.uuid;
            let _hardware = cx.hardware();
            self.host
                .set(gpu, interval)
                .map_err(EnforceError::host(format!(
                    "set the time slice of GPU {gpu}"
                )))?;
        }
        Ok(false)
    }

    fn undo(&self, cx: &Undo<'_>, action: &Action) -> Option<Result<(), EnforceError>> {
        let Action::TimeSlice { gpu_uuid } = action else {
            return None;
        };
        let _hardware = cx.hardware();
        let held =
            cx.held_by_other(|a| matches!(a, Action::TimeSlice { gpu_uuid: g } if g == gpu_uuid));
        Some(if held {
            Ok(())
        } else {
            self.host
                .reset(gpu_uuid)
                .map_err(EnforceError::host(format!(
                    "reset the time slice of GPU {gpu_uuid}"
                )))
        })
    }

    fn describe(&self, device: &Device, data: &mut DeviceData) {
        data.time_slice = interval(&device.resolved, &device.config).map(|i| format!("{i:?}"));
    }
}
