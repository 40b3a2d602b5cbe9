//! Which physical resource an allocated device name stands for.
//!
//! The scheduler hands the driver device *names* from this node's pool.
//! The slice model (`tessera_controller::model`) is the only place that
//! knows what a name means: [`tessera_controller::Model::devices`] maps every
//! published name to a [`DeviceRef`]. The driver never parses names; it asks
//! a [`Catalog`] built from that map plus the GPU inventory (minors, MIG
//! instance ids, memory sizes).
//!
//! In a process that also runs the publisher, the publisher's model feeds
//! the catalog ([`DeviceCatalog::set`]). A standalone plugin computes the
//! model itself from the same inputs ([`Catalog::compute`]): the same
//! inventory, node policy and GPU numbering (read back from the published
//! slices) give the same names. Because the plugin does not know which API
//! capabilities the publisher detected, it merges the models of every
//! capability level; names never collide across levels with different
//! meanings (see `docs/device-model.md`).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use tessera_api::inventory::{Gpu, Inventory};
use tessera_controller::model::naming::GpuIndices;
use tessera_controller::model::{
    Capabilities, DeviceRef, DriverName, ModelError, NodePolicy, SliceModel,
};

/// Device names of one pool -> what they are, plus the inventory.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    inventory: Option<Inventory>,
    devices: BTreeMap<String, DeviceRef>,
}

impl Catalog {
    /// A catalog over an already computed model's device map.
    pub fn new(inventory: Inventory, devices: BTreeMap<String, DeviceRef>) -> Self {
        Catalog {
            inventory: Some(inventory),
            devices,
        }
    }

    /// Computes the device map the publisher would publish for this
    /// inventory and policy, for every capability level the API server might
    /// have (full model, consumable capacity only, neither), merged.
    pub fn compute(
        inventory: &Inventory,
        policy: &NodePolicy,
        node: &str,
        driver: &DriverName,
        indices: &GpuIndices,
    ) -> Result<Catalog, ModelError> {
        let full = Capabilities::full();
        let levels = [
            full,
            Capabilities {
                partitionable_devices: false,
                ..full
            },
            Capabilities::legacy(),
        ];
        let mut devices = BTreeMap::new();
        for capabilities in levels {
            let model = SliceModel::new(inventory, policy, capabilities, node)
                .driver(driver.clone())
                .previous_indices(indices.clone())
                .build()?;
            for (name, reference) in model.devices {
                devices.entry(name).or_insert(reference);
            }
        }
        Ok(Catalog::new(inventory.clone(), devices))
    }

    pub fn resolve(&self, device: &str) -> Option<&DeviceRef> {
        self.devices.get(device)
    }

    pub fn gpu(&self, uuid: &str) -> Option<&Gpu> {
        self.inventory
            .as_ref()?
            .gpus
            .iter()
            .find(|g| g.uuid == uuid)
    }

    pub fn inventory(&self) -> Option<&Inventory> {
        self.inventory.as_ref()
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// Future of a catalog refresh.
pub type RefreshFuture = Pin<Box<dyn Future<Output = anyhow::Result<Catalog>> + Send>>;
/// How to compute a fresh catalog (rediscover GPUs, reread the numbering).
pub type Refresh = Box<dyn Fn() -> RefreshFuture + Send + Sync>;

/// The current catalog, replaceable while the plugin runs.
pub struct DeviceCatalog {
    current: RwLock<Arc<Catalog>>,
    refresh: Option<Refresh>,
    refreshing: tokio::sync::Mutex<()>,
}

impl DeviceCatalog {
    /// A fixed catalog (tests, or a publisher that calls [`Self::set`]).
    pub fn fixed(catalog: Catalog) -> Self {
        DeviceCatalog {
            current: RwLock::new(Arc::new(catalog)),
            refresh: None,
            refreshing: tokio::sync::Mutex::new(()),
        }
    }

    /// A catalog that recomputes itself with `refresh` when asked for a
    /// device it does not know (a GPU numbering or MIG layout that changed
    /// since it was computed).
    pub fn refreshing(initial: Catalog, refresh: Refresh) -> Self {
        DeviceCatalog {
            current: RwLock::new(Arc::new(initial)),
            refresh: Some(refresh),
            refreshing: tokio::sync::Mutex::new(()),
        }
    }

    pub fn current(&self) -> Arc<Catalog> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace the catalog (the publisher, after each model build).
    pub fn set(&self, catalog: Catalog) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(catalog);
    }

    /// The catalog, refreshed once if any of `devices` is unknown to it.
    pub async fn for_devices<'a>(
        &self,
        mut devices: impl Iterator<Item = &'a str>,
    ) -> anyhow::Result<Arc<Catalog>> {
        let current = self.current();
        let Some(refresh) = &self.refresh else {
            return Ok(current);
        };
        if devices.all(|d| current.resolve(d).is_some()) {
            return Ok(current);
        }
        let _one_at_a_time = self.refreshing.lock().await;
        let latest = self.current();
        if !Arc::ptr_eq(&latest, &current) {
            return Ok(latest); // someone else refreshed meanwhile
        }
        let fresh = refresh().await?;
        self.set(fresh);
        Ok(self.current())
    }
}
