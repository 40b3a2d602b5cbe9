//! Side effects on the GPU that prepare may need besides a CDI spec: an MPS
//! control daemon per GPU (Isolated shares, `sharing.strategy: MPS`), the
//! compute time slice (`TimeSlicing`), and MIG instances created for a
//! claim (dynamic MIG).
//!
//! They sit behind two small traits so prepare's bookkeeping (checkpoint,
//! rollback, CDI) does not depend on how they are done. Contract for
//! implementers:
//!
//! * Every method is **idempotent**: prepare records what it is about to do
//!   in the checkpoint *before* calling, so after a crash the same call (or
//!   its undo) is repeated for work that may or may not have happened.
//!   `release`/`destroy` of something that does not exist succeeds.
//! * Calls are keyed by claim: a daemon shared by several claims of one GPU
//!   is reference-counted per claim UID, so releasing claim A twice never
//!   drops claim B's reference.
//! * Methods block (process spawns, NVML); prepare calls them from a
//!   blocking thread.
//!
//! [`Unsupported`] is what the node has until the real implementations
//! land: every call fails with a message that says so, which prepare passes
//! to the claim's error, and undo calls succeed (nothing was ever done).

use std::path::PathBuf;

use tessera_api::config::{Limits, TimeSliceInterval};
use tessera_api::inventory::{MigInstance, MigPlacement};

use crate::claim_uid::ClaimUid;

/// An error of a sharing or MIG operation, shown to the user as is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SharingError(pub String);

/// Which device an MPS daemon serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsTarget {
    /// The physical GPU.
    pub gpu_uuid: String,
    /// The MIG device, when the daemon serves one (MigConfig MPS).
    pub mig_uuid: Option<String>,
}

/// What a client container needs to reach its MPS daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsClient {
    /// `CUDA_MPS_PIPE_DIRECTORY` (host path, mounted at the same path).
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY` (host path, mounted at the same path).
    pub log_dir: PathBuf,
}

/// MPS daemons and time slices.
pub trait Sharing: Send + Sync {
    /// Make sure an MPS control daemon serves `target` and holds a reference
    /// for `claim`; `limits` are the claim's defaults (the daemon may use
    /// them as its default per-client limits).
    fn mps_acquire(
        &self,
        claim: &ClaimUid,
        target: &MpsTarget,
        limits: &Limits,
    ) -> Result<MpsClient, SharingError>;

    /// Drop `claim`'s reference; the daemon stops with its last reference.
    fn mps_release(&self, claim: &ClaimUid, target: &MpsTarget) -> Result<(), SharingError>;

    /// Set the compute time slice of a GPU held exclusively by `claim`.
    fn set_time_slice(
        &self,
        claim: &ClaimUid,
        gpu_uuid: &str,
        interval: TimeSliceInterval,
    ) -> Result<(), SharingError>;

    /// Restore the node's time slice after `claim` let go of the GPU.
    fn reset_time_slice(&self, claim: &ClaimUid, gpu_uuid: &str) -> Result<(), SharingError>;
}

/// Dynamic MIG: instances created at prepare, destroyed at unprepare.
pub trait MigManager: Send + Sync {
    /// Create (or find, if this claim already created it) a GPU instance of
    /// `profile_id` at `placement` on `gpu_uuid` with one compute instance
    /// spanning it, and return it as the inventory describes MIG devices.
    fn create(
        &self,
        claim: &ClaimUid,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<MigInstance, SharingError>;

    /// Destroy the instance at `placement` that `claim` created; absent is
    /// success.
    fn destroy(
        &self,
        claim: &ClaimUid,
        gpu_uuid: &str,
        placement: MigPlacement,
    ) -> Result<(), SharingError>;
}

/// No MPS supervision, time-slice control or MIG creation on this node yet.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unsupported;

impl Unsupported {
    fn refuse(what: &str) -> SharingError {
        SharingError(format!(
            "{what} is not implemented yet in this Tessera build; fix: use a device or \
             config that does not need it (a whole GPU or an existing MIG device with \
             sharing strategy None, or a Shared share)"
        ))
    }
}

impl Sharing for Unsupported {
    fn mps_acquire(
        &self,
        _claim: &ClaimUid,
        _target: &MpsTarget,
        _limits: &Limits,
    ) -> Result<MpsClient, SharingError> {
        Err(Self::refuse("MPS control daemon supervision"))
    }

    fn mps_release(&self, _claim: &ClaimUid, _target: &MpsTarget) -> Result<(), SharingError> {
        Ok(())
    }

    fn set_time_slice(
        &self,
        _claim: &ClaimUid,
        _gpu_uuid: &str,
        _interval: TimeSliceInterval,
    ) -> Result<(), SharingError> {
        Err(Self::refuse("setting the compute time slice"))
    }

    fn reset_time_slice(&self, _claim: &ClaimUid, _gpu_uuid: &str) -> Result<(), SharingError> {
        Ok(())
    }
}

impl MigManager for Unsupported {
    fn create(
        &self,
        _claim: &ClaimUid,
        _gpu_uuid: &str,
        _profile_id: u32,
        _placement: MigPlacement,
    ) -> Result<MigInstance, SharingError> {
        Err(Self::refuse(
            "creating MIG devices at prepare (dynamic MIG)",
        ))
    }

    fn destroy(
        &self,
        _claim: &ClaimUid,
        _gpu_uuid: &str,
        _placement: MigPlacement,
    ) -> Result<(), SharingError> {
        Ok(())
    }
}
