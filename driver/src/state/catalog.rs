//! Which physical resource an allocated device name stands for.
//!
//! The scheduler hands the driver device *names* from this node's pool.
//! The slice model (`tessera_controller::model`) is the only place that
//! knows what a name means: [`tessera_controller::Model::devices`] maps every
//! published name to a [`DeviceRef`]. The driver never parses names.
//!
//! The node process publishes its own slices: the publisher hands every
//! model it builds to the [`DeviceCatalog`] *before* writing it, so a name
//! the scheduler can have allocated is always one the catalog knows, with
//! the meaning it was published with. Until the first model is built
//! (capabilities not detected yet, API server unreachable) prepare waits a
//! little and then asks the kubelet to retry; nothing is computed on the
//! side.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tessera_api::inventory::{Gpu, Inventory};
use tessera_controller::model::{DeviceRef, Model};
use tokio::sync::watch;

/// Device names of one pool -> what they are, plus the inventory the model
/// was built from.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    inventory: Inventory,
    devices: BTreeMap<String, DeviceRef>,
    mig_managed: BTreeSet<String>,
}

impl Catalog {
    /// The catalog of a model built from `inventory`.
    pub fn from_model(inventory: &Inventory, model: &Model) -> Self {
        Catalog {
            inventory: inventory.clone(),
            devices: model.devices.clone(),
            mig_managed: model.mig_managed.clone(),
        }
    }

    /// A catalog over a device map, with no GPU whose MIG mode the driver
    /// switches (tests).
    pub fn new(inventory: Inventory, devices: BTreeMap<String, DeviceRef>) -> Self {
        Catalog {
            inventory,
            devices,
            mig_managed: BTreeSet::new(),
        }
    }

    /// The same catalog with these GPUs' MIG mode managed by the driver
    /// (tests of prepare's switching).
    #[cfg(test)]
    pub(crate) fn with_mig_managed(mut self, gpus: &[&str]) -> Self {
        self.mig_managed = gpus.iter().map(|g| g.to_string()).collect();
        self
    }

    /// Every published device name with what it stands for (health).
    pub fn devices(&self) -> impl Iterator<Item = (&String, &DeviceRef)> {
        self.devices.iter()
    }

    pub fn resolve(&self, device: &str) -> Option<&DeviceRef> {
        self.devices.get(device)
    }

    pub fn gpu(&self, uuid: &str) -> Option<&Gpu> {
        self.inventory.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// Whether the driver switches this GPU's MIG mode to what a prepared
    /// device needs (see `tessera_controller::model::plan`).
    pub fn mig_managed(&self, gpu_uuid: &str) -> bool {
        self.mig_managed.contains(gpu_uuid)
    }
}

/// This node's devices are not known yet.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "this node's devices are not published yet (no slice model within {0:?}: is the API server \
     reachable? see the driver's log)"
)]
pub struct NotReady(pub Duration);

/// The current catalog: replaced with every model the publisher builds.
pub struct DeviceCatalog {
    current: watch::Sender<Option<Arc<Catalog>>>,
}

impl DeviceCatalog {
    /// A fixed catalog (tests).
    pub fn fixed(catalog: Catalog) -> Self {
        DeviceCatalog {
            current: watch::Sender::new(Some(Arc::new(catalog))),
        }
    }

    /// No catalog until the first [`Self::set`].
    pub fn awaiting_model() -> Self {
        DeviceCatalog {
            current: watch::Sender::new(None),
        }
    }

    /// Replace the catalog (the publisher, after each model build).
    pub fn set(&self, catalog: Catalog) {
        self.current.send_replace(Some(Arc::new(catalog)));
    }

    /// Follows the catalog (`None` until the first model).
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Catalog>>> {
        self.current.subscribe()
    }

    /// The catalog, waiting up to `timeout` for the first model.
    pub async fn ready(&self, timeout: Duration) -> Result<Arc<Catalog>, NotReady> {
        let mut rx = self.current.subscribe();
        let wait = rx.wait_for(Option::is_some);
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(catalog)) => catalog.as_ref().cloned().ok_or(NotReady(timeout)),
            _ => Err(NotReady(timeout)),
        }
    }
}
