//! What the enforcers change on the node, behind one small trait each so
//! that prepare's bookkeeping (checkpoint, rollback, CDI) does not depend on
//! how it is done: a claim's own MPS control daemons ([`MpsControl`],
//! Isolated shares and `sharing.strategy: MPS`), the compute time slice
//! ([`TimeSliceControl`]), and the MIG layout ([`MigManager`]: MIG mode and
//! devices created for a claim). Contract for implementers:
//!
//! * Every method is **idempotent**: prepare records what it is about to do
//!   in the checkpoint *before* calling, so after a crash the same call (or
//!   its undo) is repeated for work that may or may not have happened.
//!   `release`/`destroy` of something that does not exist succeeds.
//! * MPS calls are keyed by claim: each claim has daemons of its own, so
//!   releasing claim A twice never touches claim B's.
//! * Methods block (process spawns, NVML); prepare calls them from a
//!   blocking thread.
//!
//! [`Unsupported`] stands in where a node has no such backend (tests that
//! are about something else): every call fails with a message that says so,
//! which prepare passes to the claim's error, and undo calls succeed
//! (nothing was ever done).

use std::path::PathBuf;
use std::sync::Arc;

use tessera_api::config::{Limits, TimeSliceInterval};
use tessera_api::inventory::{MigInstance, MigPlacement};

use crate::claim_uid::ClaimUid;
use crate::state::records::MigRecord;

/// Why the host did not do what prepare asked. Its text is what the
/// claim's error shows; the adapter's own error stays reachable as its
/// source.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HostError {
    /// This node has no such backend.
    #[error(
        "{what} is not implemented yet in this Tessera build; fix: use a device or config that \
         does not need it (a whole GPU or an existing MIG device with sharing strategy None, \
         or a Shared share)"
    )]
    Unsupported { what: &'static str },
    /// The adapter failed; its error says why.
    #[error(transparent)]
    Backend(Arc<dyn std::error::Error + Send + Sync>),
}

impl HostError {
    /// An adapter's error, kept whole.
    pub fn backend(error: impl std::error::Error + Send + Sync + 'static) -> HostError {
        HostError::Backend(Arc::new(error))
    }
}

/// Which daemon: the one of a request of a claim on a device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MpsTarget {
    /// The request whose containers are the daemon's clients.
    pub request: String,
    /// The physical GPU.
    pub gpu_uuid: String,
    /// The MIG device, when the daemon serves one (MigConfig MPS).
    pub mig_uuid: Option<String>,
}

/// What a client container needs to reach its MPS daemon: its pipe and
/// shared memory directories, and nothing else of the daemon's (its logs
/// stay on the host),
/// and the limits the daemon holds its clients to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsClient {
    /// `CUDA_MPS_PIPE_DIRECTORY` (host path, mounted at the same path).
    pub pipe_dir: PathBuf,
    /// The daemon's `/dev/shm` (host path, mounted at `/dev/shm`).
    pub shm_dir: PathBuf,
    pub limits: Limits,
}

/// The claims' own MPS control daemons.
pub trait MpsControl: Send + Sync {
    /// Make sure `claim`'s own MPS control daemon serves `target`, with
    /// `limits` as its defaults for every client.
    /// `gpu_minor` names the GPU's device node (`/dev/nvidia<minor>`),
    /// the only GPU node the daemon sees.
    fn acquire(
        &self,
        claim: &ClaimUid,
        target: &MpsTarget,
        limits: &Limits,
        gpu_minor: u32,
    ) -> Result<MpsClient, HostError>;

    /// Stop `claim`'s daemon of `target`; one that is not there is fine.
    fn release(&self, claim: &ClaimUid, target: &MpsTarget) -> Result<(), HostError>;

    /// Stop every daemon of `claim`, whatever it serves (a claim whose
    /// record was lost); none is fine.
    fn release_claim(&self, claim: &ClaimUid) -> Result<(), HostError>;
}

/// The GPU's compute time slice.
pub trait TimeSliceControl: Send + Sync {
    /// Set the compute time slice of a GPU.
    fn set(&self, gpu_uuid: &str, interval: TimeSliceInterval) -> Result<(), HostError>;

    /// Restore the driver's default slice after the last claim let go of
    /// the GPU.
    fn reset(&self, gpu_uuid: &str) -> Result<(), HostError>;
}

/// MIG mode and dynamic MIG: what prepare changes on a GPU's MIG layout.
/// Callers serialize these calls (the node's hardware lock) and record
/// each change in the checkpoint before making it.
pub trait MigManager: Send + Sync {
    /// Whether MIG mode is on now.
    fn mig_enabled(&self, gpu_uuid: &str) -> Result<bool, HostError>;

    /// Switch MIG mode, taking effect now; an error (with the mode put
    /// back) where the GPU would need a reset.
    fn set_mig_mode(&self, gpu_uuid: &str, enabled: bool) -> Result<(), HostError>;

    /// Whether any GPU instance exists on the GPU.
    fn has_instances(&self, gpu_uuid: &str) -> Result<bool, HostError>;

    /// An error naming what occupies the memory slices of `placement`, if
    /// anything does.
    fn check_free(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<(), HostError>;

    /// Create a GPU instance of `profile_id` at `placement` with one compute
    /// instance spanning it, and return it as the inventory describes MIG
    /// devices (with its instance ids). Adopts nothing: anything at the
    /// placement is an error; a failure says whether it left anything.
    fn create(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<MigInstance, CreateError>;

    /// Whether the MIG device `recorded` names still exists (matched by GPU
    /// instance id and MIG UUID).
    fn exists(&self, gpu_uuid: &str, recorded: &MigRecord) -> Result<bool, HostError>;

    /// Destroy what a claim created: the GPU instance of `profile_id` at
    /// `placement` that `recorded` names (matched by id and MIG UUID).
    /// Anything else there is left alone; nothing there is success.
    fn destroy(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
        recorded: &MigRecord,
    ) -> Result<(), HostError>;
}

/// Why [`MigManager::create`] failed, and whether the GPU is as it was.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CreateError {
    /// Nothing was made (the placement was taken, NVML refused, or what
    /// was made was destroyed again).
    #[error(transparent)]
    NothingMade(HostError),
    /// Part of an instance is still there: the error names it.
    #[error(transparent)]
    LeftBehind(HostError),
}

/// No MPS supervision, time-slice control or MIG creation on this node.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unsupported;

impl Unsupported {
    fn refuse(what: &'static str) -> HostError {
        HostError::Unsupported { what }
    }
}

impl MpsControl for Unsupported {
    fn acquire(
        &self,
        _claim: &ClaimUid,
        _target: &MpsTarget,
        _limits: &Limits,
        _gpu_minor: u32,
    ) -> Result<MpsClient, HostError> {
        Err(Self::refuse("MPS control daemon supervision"))
    }

    fn release(&self, _claim: &ClaimUid, _target: &MpsTarget) -> Result<(), HostError> {
        Ok(())
    }

    fn release_claim(&self, _claim: &ClaimUid) -> Result<(), HostError> {
        Ok(())
    }
}

impl TimeSliceControl for Unsupported {
    fn set(&self, _gpu_uuid: &str, _interval: TimeSliceInterval) -> Result<(), HostError> {
        Err(Self::refuse("setting the compute time slice"))
    }

    fn reset(&self, _gpu_uuid: &str) -> Result<(), HostError> {
        Ok(())
    }
}

impl MigManager for Unsupported {
    fn mig_enabled(&self, _gpu_uuid: &str) -> Result<bool, HostError> {
        Err(Self::refuse("reading the MIG mode"))
    }

    fn set_mig_mode(&self, _gpu_uuid: &str, _enabled: bool) -> Result<(), HostError> {
        Err(Self::refuse("switching the MIG mode"))
    }

    fn has_instances(&self, _gpu_uuid: &str) -> Result<bool, HostError> {
        Ok(false)
    }

    fn check_free(
        &self,
        _gpu_uuid: &str,
        _profile_id: u32,
        _placement: MigPlacement,
    ) -> Result<(), HostError> {
        Err(Self::refuse(
            "creating MIG devices at prepare (dynamic MIG)",
        ))
    }

    fn create(
        &self,
        _gpu_uuid: &str,
        _profile_id: u32,
        _placement: MigPlacement,
    ) -> Result<MigInstance, CreateError> {
        Err(CreateError::NothingMade(Self::refuse(
            "creating MIG devices at prepare (dynamic MIG)",
        )))
    }

    fn exists(&self, _gpu_uuid: &str, _recorded: &MigRecord) -> Result<bool, HostError> {
        Ok(false)
    }

    fn destroy(
        &self,
        _gpu_uuid: &str,
        _profile_id: u32,
        _placement: MigPlacement,
        _recorded: &MigRecord,
    ) -> Result<(), HostError> {
        Ok(())
    }
}
