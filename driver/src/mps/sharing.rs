//! [`MpsSharing`]: the prepare engine's [`SharingControl`] trait on top of the
//! supervisor, for wiring into the plugin:
//!
//! ```text
//! sharing: Arc::new(MpsSharing::new(Arc::new(MpsSupervisor::new(config)), NvidiaSmiTimeSlice::new(root))),
//! ```
//!
//! MPS calls go to the supervisor; time-slice calls to `time_slicing`.

use std::sync::Arc;

use tessera_api::config::{Limits, TimeSliceInterval};

use super::daemon::DaemonKey;
use super::limits::ClientLimits;
use super::supervisor::MpsSupervisor;
use crate::claim_uid::ClaimUid;
use crate::prepare::sharing::{MpsClient, MpsTarget, SharingControl, SharingError};

/// MPS through an [`MpsSupervisor`], time slices through `T`.
pub struct MpsSharing<T> {
    supervisor: Arc<MpsSupervisor>,
    time_slicing: T,
}

impl<T> MpsSharing<T> {
    pub fn new(supervisor: Arc<MpsSupervisor>, time_slicing: T) -> Self {
        MpsSharing {
            supervisor,
            time_slicing,
        }
    }

    pub fn supervisor(&self) -> &Arc<MpsSupervisor> {
        &self.supervisor
    }
}

/// The daemon of a claim's target: it serves the MIG device when there is
/// one.
fn key(claim: &ClaimUid, target: &MpsTarget) -> DaemonKey {
    DaemonKey {
        claim: claim.clone(),
        request: target.request.clone(),
        device: (target.mig_uuid.as_deref())
            .unwrap_or(&target.gpu_uuid)
            .to_owned(),
    }
}

impl<T: SharingControl> SharingControl for MpsSharing<T> {
    /// The daemon is the claim's own, so the limits are its defaults: they
    /// hold whatever a client's environment says.
    fn mps_acquire(
        &self,
        claim: &ClaimUid,
        target: &MpsTarget,
        limits: &Limits,
    ) -> Result<MpsClient, SharingError> {
        let client_limits = ClientLimits {
            memory_bytes: limits.memory_bytes,
            thread_percent: limits.compute_percent,
        };
        let daemon = self
            .supervisor
            .ensure(&key(claim, target), client_limits)
            .map_err(|e| SharingError(e.to_string()))?;
        // The pipe and shared memory directories only: the daemon's logs
        // and the supervisor's record stay on the host.
        Ok(MpsClient {
            pipe_dir: daemon.pipe_dir,
            shm_dir: daemon.shm_dir,
            limits: *limits,
        })
    }

    fn mps_release(&self, claim: &ClaimUid, target: &MpsTarget) -> Result<(), SharingError> {
        self.supervisor
            .release(&key(claim, target))
            .map_err(|e| SharingError(e.to_string()))
    }

    fn set_time_slice(
        &self,
        claim: &ClaimUid,
        gpu_uuid: &str,
        interval: TimeSliceInterval,
    ) -> Result<(), SharingError> {
        self.time_slicing.set_time_slice(claim, gpu_uuid, interval)
    }

    fn reset_time_slice(&self, claim: &ClaimUid, gpu_uuid: &str) -> Result<(), SharingError> {
        self.time_slicing.reset_time_slice(claim, gpu_uuid)
    }
}
