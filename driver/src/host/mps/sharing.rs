//! The prepare engine's [`MpsControl`] on top of the supervisor: a claim's
//! target is its own daemon, keyed by claim, request and device.

use tessera_api::config::Limits;

use super::MpsError;
use super::daemon::DaemonKey;
use super::supervisor::MpsSupervisor;
use crate::claim_uid::ClaimUid;
use crate::host::mps_client::ClientLimits;
use crate::host::port::{HostError, MpsClient, MpsControl, MpsTarget};

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
        gpu_minor: u32,
    ) -> Result<MpsClient, HostError> {
        let shm_bytes = (self.config().shm)
            .size_for(limits.shared_memory_bytes)
            .map_err(HostError::backend)?;
        let client_limits = ClientLimits {
            memory_bytes: limits.memory_bytes,
            thread_percent: limits.compute_percent,
            shm_bytes: Some(shm_bytes),
        };
        let daemon = self
            .ensure(&key(claim, target), client_limits, Some(gpu_minor))
            .map_err(HostError::backend)?;
        // The pipe and shared memory directories only: the daemon's logs
        // and the supervisor's record stay on the host.
        Ok(MpsClient {
            pipe_dir: daemon.pipe_dir,
            shm_dir: daemon.shm_dir,
            limits: *limits,
        })
    }

    fn release(&self, claim: &ClaimUid, target: &MpsTarget) -> Result<(), HostError> {
        MpsSupervisor::release(self, &key(claim, target)).map_err(HostError::backend)
    }

    fn release_claim(&self, claim: &ClaimUid) -> Result<(), HostError> {
        let report = self.retain_claims(|c| c != claim);
        match report.failed.into_iter().next() {
            Some((daemon, source)) => Err(HostError::backend(StopError { daemon, source })),
            None => Ok(()),
        }
    }
}

/// A daemon of a claim being released would not stop.
#[derive(Debug, thiserror::Error)]
#[error("stopping {daemon}: {source}")]
pub struct StopError {
    pub daemon: String,
    pub source: MpsError,
}
