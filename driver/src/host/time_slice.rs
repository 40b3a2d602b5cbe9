//! The compute time slice, set with the driver's own tool.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_api::config::TimeSliceInterval;

use super::port::{SharingError, TimeSliceControl};

/// Runs `<driver root>/usr/bin/nvidia-smi compute-policy`.
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

    fn run(&self, gpu_uuid: &str, level: u32) -> Result<(), SharingError> {
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

impl TimeSliceControl for NvidiaSmiTimeSlice {
    fn set(&self, gpu_uuid: &str, interval: TimeSliceInterval) -> Result<(), SharingError> {
        self.run(gpu_uuid, interval.level())
    }

    /// Back to the driver's default slice. Nothing to undo where the tool
    /// is gone (it never set anything then).
    fn reset(&self, gpu_uuid: &str) -> Result<(), SharingError> {
        if !self.tool.is_file() {
            return Ok(());
        }
        self.run(gpu_uuid, TimeSliceInterval::Default.level())
    }
}
