//! The compute time slice, set with the driver's own tool.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_api::config::TimeSliceInterval;

use super::port::{HostError, TimeSliceControl};

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

    fn run(&self, gpu_uuid: &str, level: u32) -> Result<(), TimeSliceError> {
        let tool = self.tool.clone();
        if !self.tool.is_file() {
            return Err(TimeSliceError::NoTool { tool });
        }
        let out = Command::new(&self.tool)
            .args(["compute-policy", "-i", gpu_uuid])
            .arg(format!("--set-timeslice={level}"))
            .output()
            .map_err(|source| TimeSliceError::Spawn {
                tool: tool.clone(),
                source,
            })?;
        if out.status.success() {
            return Ok(());
        }
        let said = String::from_utf8_lossy(&out.stdout).trim().to_owned()
            + " "
            + String::from_utf8_lossy(&out.stderr).trim();
        Err(TimeSliceError::Refused {
            tool,
            gpu: gpu_uuid.to_owned(),
            level,
            status: out.status,
            said: said.trim().to_owned(),
        })
    }
}

/// Why the time slice could not be set.
#[derive(Debug, thiserror::Error)]
pub enum TimeSliceError {
    #[error(
        "{} does not exist; fix: install the NVIDIA driver's tools at the driver root \
         (--driver-root), or use a config without a time slice (node policy timeSlice: Default, \
         sharing strategy None)",
        tool.display()
    )]
    NoTool { tool: PathBuf },
    #[error("cannot run {}: {source}; fix: check that it is executable", tool.display())]
    Spawn {
        tool: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "`{} compute-policy -i {gpu} --set-timeslice={level}` failed ({status}): {said}; fix: run \
         it by hand on the node to see why (the driver must run privileged)",
        tool.display()
    )]
    Refused {
        tool: PathBuf,
        gpu: String,
        level: u32,
        status: std::process::ExitStatus,
        said: String,
    },
}

impl TimeSliceControl for NvidiaSmiTimeSlice {
    fn set(&self, gpu_uuid: &str, interval: TimeSliceInterval) -> Result<(), HostError> {
        self.run(gpu_uuid, interval.level())
            .map_err(HostError::backend)
    }

    /// Back to the driver's default slice. Nothing to undo where the tool
    /// is gone (it never set anything then).
    fn reset(&self, gpu_uuid: &str) -> Result<(), HostError> {
        if !self.tool.is_file() {
            return Ok(());
        }
        self.run(gpu_uuid, TimeSliceInterval::Default.level())
            .map_err(HostError::backend)
    }
}
