//! The prepare engine's [`MpsControl`] on top of the supervisor: a claim's
//! target is its own daemon, keyed by claim, request and device.

use tessera_api::config::Limits;

use super::daemon::DaemonKey;
use super::supervisor::MpsSupervisor;
use crate::claim_uid::ClaimUid;
use crate::host::mps_client::ClientLimits;
use crate::host::port::{MpsClient, MpsControl, MpsTarget, SharingError};

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

impl MpsControl for MpsSupervisor {
    /// The daemon is the claim's own, so the limits are its defaults: they
    /// hold whatever a client's environment says.
    fn acquire(
        &self,
        claim: &ClaimUid,
        target: &MpsTarget,
        limits: &Limits,
    ) -> Result<MpsClient, SharingError> {
        let shm_bytes = (self.config().shm)
            .size_for(limits.shared_memory_bytes)
            .map_err(SharingError)?;
        let client_limits = ClientLimits {
            memory_bytes: limits.memory_bytes,
            thread_percent: limits.compute_percent,
            shm_bytes: Some(shm_bytes),
        };
        let daemon = self
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

    fn release(&self, claim: &ClaimUid, target: &MpsTarget) -> Result<(), SharingError> {
        MpsSupervisor::release(self, &key(claim, target)).map_err(|e| SharingError(e.to_string()))
    }

    fn release_claim(&self, claim: &ClaimUid) -> Result<(), SharingError> {
        let report = self.retain_claims(|c| c != claim);
        match report.failed.into_iter().next() {
            Some((daemon, e)) => Err(SharingError(format!("stopping {daemon}: {e}"))),
            None => Ok(()),
        }
    }
}
