//! [`NvmlMig`]: the prepare engine's [`MigManager`] trait on top of
//! [`super::create`] / [`super::destroy`], for wiring into the plugin:
//!
//! ```text
//! mig: Arc::new(NvmlMig::new(nvml.clone(), &inventory)),
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use nvml_wrapper::Nvml;
use tessera_api::inventory::{Inventory, MigInstance, MigPlacement, MigProfile};

use crate::claim_uid::ClaimUid;
use crate::prepare::sharing::{MigManager, SharingError};

/// Dynamic MIG through NVML; profile names, memory and engines come from
/// the inventory (what NVML reported at discovery).
pub struct NvmlMig {
    nvml: Arc<Nvml>,
    profiles: RwLock<BTreeMap<String, Vec<MigProfile>>>,
}

impl NvmlMig {
    pub fn new(nvml: Arc<Nvml>, inventory: &Inventory) -> Self {
        let me = NvmlMig {
            nvml,
            profiles: RwLock::new(BTreeMap::new()),
        };
        me.set_inventory(inventory);
        me
    }

    /// Refresh the profile table after a new discovery.
    pub fn set_inventory(&self, inventory: &Inventory) {
        let table = inventory
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), g.mig.profiles().to_vec()))
            .collect();
        *self
            .profiles
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = table;
    }

    fn profile(&self, gpu_uuid: &str, profile_id: u32) -> Option<MigProfile> {
        self.profiles
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(gpu_uuid)?
            .iter()
            .find(|p| p.id == profile_id)
            .cloned()
    }
}

impl MigManager for NvmlMig {
    fn create(
        &self,
        _claim: &ClaimUid,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<MigInstance, SharingError> {
        let Some(profile) = self.profile(gpu_uuid, profile_id) else {
            return Err(SharingError(format!(
                "MIG on {gpu_uuid}: discovery found no profile with id {profile_id} on this GPU"
            )));
        };
        let (made, _) = super::create(&self.nvml, gpu_uuid, profile_id, placement)
            .map_err(|e| SharingError(e.to_string()))?;
        Ok(MigInstance {
            uuid: made.mig_uuid,
            profile: profile.name,
            profile_id,
            gpu_instance_id: made.gpu_instance_id,
            compute_instance_id: made.compute_instance_id,
            placement: made.placement,
            memory_bytes: profile.memory_bytes,
            multiprocessors: made.multiprocessors,
            engines: profile.engines,
        })
    }

    /// The trait names no profile: whatever GPU instance sits at exactly
    /// `placement` is destroyed (prepare only destroys placements its
    /// checkpoint says this claim created).
    fn destroy(
        &self,
        _claim: &ClaimUid,
        gpu_uuid: &str,
        placement: MigPlacement,
    ) -> Result<(), SharingError> {
        let err = |e: super::MigError| SharingError(e.to_string());
        let found = match super::list(&self.nvml, gpu_uuid) {
            Ok(list) => list.into_iter().find(|g| g.placement == placement),
            // The GPU is gone, and so is anything that was on it.
            Err(super::MigError::GpuNotFound { .. }) => None,
            Err(e) => return Err(err(e)),
        };
        match found {
            None => Ok(()),
            Some(g) => super::destroy(&self.nvml, gpu_uuid, g.profile_id, placement)
                .map(|_| ())
                .map_err(err),
        }
    }
}
