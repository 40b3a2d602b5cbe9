//! The GPU's compute time slice, set with the driver root's `nvidia-smi`
//! (`compute-policy -i <GPU UUID> --set-timeslice=<0..3>`), as on a real
//! node: NVML has no call for it.
//!
//! Reference counting across claims is prepare's (the checkpoint's
//! `TimeSlice` actions): [`SharingControl::reset_time_slice`] is called only
//! when no other claim holds a changed slice on the GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_api::config::{Limits, TimeSliceInterval};

use super::sharing::{MpsClient, MpsTarget, SharingControl, SharingError, Unsupported};
use crate::claim_uid::ClaimUid;

/// Runs `<driver root>/usr/bin/nvidia-smi compute-policy`. Its MPS calls
/// are [`Unsupported`]'s: it is the time-slice half of
/// [`crate::mps::MpsSharing`].
#[derive(Debug, Clone)]
pub struct NvidiaSmiTimeSlice {
    tool: PathBuf,
}

impl NvidiaSmiTimeSlice {
    pub fn new(driver_root: &Path) -> Self {
        NvidiaSmiTimeSlice {
            tool: driver_root.join("usr/bin/nvidia-smi"),
        }
    }

    fn set(&self, gpu_uuid: &str, level: u32) -> Result<(), SharingError> {
        let tool = self.tool.display();
        if !self.tool.is_file() {
            return Err(SharingError(format!(
                "{tool} does not exist; fix: install the NVIDIA driver's tools at the driver \
                 root (--driver-root), or use a config without a time slice (node policy \
                 timeSlice: Default, sharing strategy None)"
            )));
        }
        let out = Command::new(&self.tool)
            .args(["compute-policy", "-i", gpu_uuid])
            .arg(format!("--set-timeslice={level}"))
            .output()
            .map_err(|e| {
                SharingError(format!(
                    "cannot run {tool}: {e}; fix: check that it is executable"
                ))
            })?;
        if out.status.success() {
            return Ok(());
        }
        let said = String::from_utf8_lossy(&out.stdout).trim().to_owned()
            + " "
            + String::from_utf8_lossy(&out.stderr).trim();
        Err(SharingError(format!(
            "`{tool} compute-policy -i {gpu_uuid} --set-timeslice={level}` failed ({}): {}; \
             fix: run it by hand on the node to see why (the driver must run privileged)",
            out.status,
            said.trim()
        )))
    }
}

impl SharingControl for NvidiaSmiTimeSlice {
    fn mps_acquire(
        &self,
        claim: &ClaimUid,
        target: &MpsTarget,
        limits: &Limits,
    ) -> Result<MpsClient, SharingError> {
        Unsupported.mps_acquire(claim, target, limits)
    }

    fn mps_release(&self, claim: &ClaimUid, target: &MpsTarget) -> Result<(), SharingError> {
        Unsupported.mps_release(claim, target)
    }

    fn set_time_slice(
        &self,
        _claim: &ClaimUid,
        gpu_uuid: &str,
        interval: TimeSliceInterval,
    ) -> Result<(), SharingError> {
        self.set(gpu_uuid, interval.level())
    }

    /// Back to the driver's default slice. Nothing to undo where the tool
    /// is gone (it never set anything then).
    fn reset_time_slice(&self, _claim: &ClaimUid, gpu_uuid: &str) -> Result<(), SharingError> {
        if !self.tool.is_file() {
            return Ok(());
        }
        self.set(gpu_uuid, TimeSliceInterval::Default.level())
    }
}
