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

use crate::host::port::{CreateError, HostError, MigManager};
use crate::state::records::MigRecord;
use crate::sync::ReadWrite;

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
        *self.profiles.writing() = table;
    }

    fn profile(&self, gpu_uuid: &str, profile_id: u32) -> Option<MigProfile> {
        self.profiles
            .reading()
            .get(gpu_uuid)?
            .iter()
            .find(|p| p.id == profile_id)
            .cloned()
    }
}

impl NvmlMig {
    /// The GPU instances on a GPU; none on a GPU that is gone.
    fn instances(&self, gpu_uuid: &str) -> Result<Vec<super::GpuInstanceState>, HostError> {
        match super::list(&self.nvml, gpu_uuid) {
            Ok(list) => Ok(list),
            Err(super::MigError::GpuNotFound { .. }) => Ok(Vec::new()),
            Err(e) => Err(shown(e)),
        }
    }
}

impl MigManager for NvmlMig {
    fn mig_enabled(&self, gpu_uuid: &str) -> Result<bool, HostError> {
        super::mig_enabled(&self.nvml, gpu_uuid).map_err(shown)
    }

    fn set_mig_mode(&self, gpu_uuid: &str, enabled: bool) -> Result<(), HostError> {
        super::set_mig_mode(&self.nvml, gpu_uuid, enabled).map_err(shown)
    }

    fn has_instances(&self, gpu_uuid: &str) -> Result<bool, HostError> {
        Ok(!self.instances(gpu_uuid)?.is_empty())
    }

    fn check_free(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<(), HostError> {
        super::check_free(&self.nvml, gpu_uuid, profile_id, placement).map_err(shown)
    }

    fn create(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<MigInstance, CreateError> {
        let Some(profile) = self.profile(gpu_uuid, profile_id) else {
            return Err(CreateError::NothingMade(HostError::backend(
                UnknownProfile {
                    gpu: gpu_uuid.to_owned(),
                    profile_id,
                },
            )));
        };
        let made = super::create(&self.nvml, gpu_uuid, profile_id, placement).map_err(|e| {
            if e.made_nothing() {
                CreateError::NothingMade(shown(e))
            } else {
                CreateError::LeftBehind(shown(e))
            }
        })?;
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

    fn exists(&self, gpu_uuid: &str, recorded: &MigRecord) -> Result<bool, HostError> {
        Ok(self.instances(gpu_uuid)?.iter().any(|g| {
            g.gpu_instance_id == recorded.gpu_instance_id
                && g.compute_instances
                    .iter()
                    .any(|c| c.mig_uuid.as_deref() == Some(recorded.mig_uuid.as_str()))
        }))
    }

    fn destroy(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
        recorded: &MigRecord,
    ) -> Result<(), HostError> {
        let recorded = super::Recorded {
            gpu_instance_id: recorded.gpu_instance_id,
            mig_uuid: &recorded.mig_uuid,
        };
        super::destroy(&self.nvml, gpu_uuid, profile_id, placement, recorded)
            .map(|_| ())
            .map_err(shown)
    }
}

fn shown(e: super::MigError) -> HostError {
    HostError::backend(e)
}

/// A create asked for a profile the GPU was not found to have.
#[derive(Debug, thiserror::Error)]
#[error("MIG on {gpu}: discovery found no profile with id {profile_id} on this GPU")]
pub struct UnknownProfile {
    pub gpu: String,
    pub profile_id: u32,
}
