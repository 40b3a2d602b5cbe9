//! The node process: one Tessera process per node serves the kubelet and
//! publishes the node's ResourceSlices, and what it knows about the node it
//! knows from the node, never from the API server.
//!
//! ```text
//! NVML ──observe──> NodeView {inventory, created MIG, prepared devices} ──> publisher
//!   ^                  (read under the hardware lock)                         │ model
//!   │                + unhealthy GPUs (health tracker)                        v
//! prepare/unprepare <── catalog (the model being published) <── NodeTruth::model_built
//!   └── pokes the observer after every change (so does a health change)
//! ```
//!
//! * [`Observer`] reads the GPUs and the checkpoint together (the prepare
//!   engine's hardware lock, for reading), so a MIG device the driver
//!   created is always known as the driver's when the model sees it.
//! * [`NodeTruth`] is what the publisher consults and feeds back: the GPU
//!   numbering recorded in the state directory, and every model it builds,
//!   which becomes the catalog prepare resolves names through.
//! * [`state_lock::StateLock`] keeps a second process (a rolling update)
//!   from touching the node's state until the first is gone; meanwhile it
//!   answers its own probes ([`readiness`]): standby, ready to take over
//!   when its pre-flight checks pass.

pub mod readiness;
pub mod state_lock;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tessera_api::inventory::Inventory;
use tessera_controller::model::Model;
use tessera_controller::model::naming::GpuIndices;
use tessera_controller::publisher::{NodeState, NodeView};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::discovery;
use crate::health::HealthTracker;
use crate::prepare::NodeChange;
use crate::prepare::Preparer;
use crate::state::catalog::{Catalog, DeviceCatalog};
use crate::sync::{Locked, ReadWrite};

/// The GPU numbering's file in the state directory.
pub const GPU_INDICES_FILE: &str = "gpu-indices.json";

/// What the publisher learns from the node process, and gives back.
pub struct NodeTruth {
    catalog: Arc<DeviceCatalog>,
    indices_file: PathBuf,
    indices: Mutex<GpuIndices>,
    first_model: AtomicBool,
    /// Called once with the GPUs whose MIG mode the driver manages, when
    /// the first model is known.
    on_first_model: Box<dyn Fn(BTreeSet<String>) + Send + Sync>,
    /// Counts the devices of every model built.
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl NodeTruth {
    /// Reads the recorded GPU numbering from `state_dir` (none yet is an
    /// empty numbering; an unreadable file is reported and ignored: the
    /// published slices still carry the numbers).
    pub fn new(
        catalog: Arc<DeviceCatalog>,
        state_dir: &Path,
        on_first_model: impl Fn(BTreeSet<String>) + Send + Sync + 'static,
    ) -> Self {
        let indices_file = state_dir.join(GPU_INDICES_FILE);
        let indices = match std::fs::read(&indices_file) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                warn!("ignoring {}: {e}", indices_file.display());
                GpuIndices::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => GpuIndices::new(),
            Err(e) => {
                warn!("ignoring {}: {e}", indices_file.display());
                GpuIndices::new()
            }
        };
        NodeTruth {
            catalog,
            indices_file,
            indices: Mutex::new(indices),
            first_model: AtomicBool::new(true),
            on_first_model: Box::new(on_first_model),
            metrics: None,
        }
    }

    /// Reports every model built to `metrics` (devices by kind, readiness).
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn record_indices(&self, model: &GpuIndices) {
        let mut recorded = self.indices.locked();
        let merged = merge_indices(&recorded, model);
        if merged == *recorded {
            return;
        }
        let written = serde_json::to_vec_pretty(&merged)
            .map_err(std::io::Error::other)
            .and_then(|bytes| crate::cdi::write_atomically(&self.indices_file, &bytes));
        match written {
            Ok(()) => *recorded = merged,
            Err(e) => warn!(
                "cannot record the GPU numbering in {}: {e}",
                self.indices_file.display()
            ),
        }
    }
}

/// The model's numbering, plus the numbers of GPUs that are gone for now
/// (so they come back under their number) unless the model gave the number
/// to another GPU.
fn merge_indices(recorded: &GpuIndices, model: &GpuIndices) -> GpuIndices {
    let taken: BTreeSet<u32> = model.values().copied().collect();
    let mut merged = model.clone();
    for (uuid, n) in recorded {
        if !model.contains_key(uuid) && !taken.contains(n) {
            merged.insert(uuid.clone(), *n);
        }
    }
    merged
}

impl NodeState for NodeTruth {
    fn gpu_indices(&self) -> GpuIndices {
        self.indices.locked().clone()
    }

    fn model_built(&self, inventory: &Inventory, model: &Model) {
        self.catalog.set(Catalog::from_model(inventory, model));
        self.record_indices(&model.gpu_indices);
        if let Some(metrics) = &self.metrics {
            metrics.model_built(model);
        }
        if self.first_model.swap(false, Ordering::SeqCst) {
            info!(
                devices = model.devices.len(),
                full_model = model.full,
                "this node's devices are known; prepare resolves names through them"
            );
            (self.on_first_model)(model.mig_managed.clone());
        }
    }
}

/// Reads the GPUs and what the driver did to them, together.
pub struct Observer {
    nvml: Arc<Nvml>,
    preparer: Arc<Preparer>,
    health: Option<Arc<HealthTracker>>,
}

impl Observer {
    pub fn new(nvml: Arc<Nvml>, preparer: Arc<Preparer>) -> Self {
        Observer {
            nvml,
            preparer,
            health: None,
        }
    }

    /// Every view carries the GPUs `health` holds Unhealthy (the slices
    /// taint their devices); poke the observer when it changes.
    pub fn with_health(mut self, health: Arc<HealthTracker>) -> Self {
        self.health = Some(health);
        self
    }

    /// One look at the node. A GPU that cannot be read is left out, unless
    /// `last` saw it and it is not lost: then its last look stands in (an
    /// operator's `nvidia-smi` switching its MIG layout between two NVML
    /// calls must not make its devices vanish from the slices).
    pub fn observe(&self, last: Option<&Inventory>) -> anyhow::Result<NodeView> {
        let lock = self.preparer.hardware_lock();
        let _reading = lock.reading();
        let found = discovery::discover(&self.nvml)?;
        let mut inventory = found.inventory;
        for e in &found.failed {
            let kept = e
                .uuid
                .as_deref()
                .filter(|_| !matches!(e.error, NvmlError::GpuLost))
                .and_then(|uuid| keep_last_look(&mut inventory, last, uuid));
            match kept {
                Some(()) => warn!("GPU discovery: {e} (its last look stays published)"),
                None => warn!("GPU discovery: {e} (not published)"),
            }
        }
        Ok(self.with_records(inventory))
    }

    /// `last`'s GPUs with the records as they are now: after a change that
    /// left the GPUs alone (a whole GPU or a share prepared, a health
    /// change), reading every GPU through NVML again would only cost time.
    pub fn refresh(&self, last: &NodeView) -> NodeView {
        let lock = self.preparer.hardware_lock();
        let _reading = lock.reading();
        self.with_records(last.inventory.clone())
    }

    fn with_records(&self, inventory: Inventory) -> NodeView {
        NodeView {
            inventory,
            owned_mig: self.preparer.created_mig(),
            prepared: self.preparer.prepared_devices(),
            unhealthy: self
                .health
                .as_ref()
                .map(|h| crate::health::unhealthy_gpus(&h.current()))
                .unwrap_or_default(),
        }
    }

    /// Observes every `period`, and at once when poked (prepare and
    /// unprepare poke after each change, saying whether the GPUs changed or
    /// only the records); sends views that differ. Ends when every poke
    /// sender is gone.
    pub fn spawn(
        self: Arc<Self>,
        views: watch::Sender<NodeView>,
        pokes: mpsc::Receiver<NodeChange>,
        period: Duration,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            loop {
                let mut change = match pokes.recv_timeout(period) {
                    Ok(change) => change,
                    Err(mpsc::RecvTimeoutError::Timeout) => NodeChange::Gpus,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                };
                while let Ok(more) = pokes.try_recv() {
                    if more == NodeChange::Gpus {
                        change = more;
                    }
                }
                let last = views.borrow().clone();
                let looked = match change {
                    NodeChange::Records => Ok(self.refresh(&last)),
                    NodeChange::Gpus => self.observe(Some(&last.inventory)),
                };
                match looked {
                    Ok(view) => {
                        views.send_if_modified(|current| {
                            let changed = *current != view;
                            if changed {
                                info!(
                                    gpus = view.inventory.gpus.len(),
                                    created_mig = view.owned_mig.len(),
                                    prepared = view.prepared.len(),
                                    unhealthy = view.unhealthy.len(),
                                    "node changed"
                                );
                                *current = view;
                            }
                            changed
                        });
                    }
                    Err(e) => warn!("GPU discovery failed: {e:#}; keeping the last view"),
                }
            }
        })
    }
}

/// Puts `last`'s entry for GPU `uuid` into `inventory` (in NVML order, by
/// PCI bus id); `None` when `last` never saw it.
fn keep_last_look(inventory: &mut Inventory, last: Option<&Inventory>, uuid: &str) -> Option<()> {
    if inventory.gpus.iter().any(|g| g.uuid == uuid) {
        return Some(());
    }
    let gpu = last?.gpus.iter().find(|g| g.uuid == uuid)?.clone();
    let at = inventory
        .gpus
        .iter()
        .position(|g| g.pci_bus_id > gpu.pci_bus_id)
        .unwrap_or(inventory.gpus.len());
    inventory.gpus.insert(at, gpu);
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::inventory::{Gpu, Mig};

    fn gpu(uuid: &str, bus: &str) -> Gpu {
        Gpu {
            uuid: uuid.into(),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            brand: "nvidia".into(),
            architecture: "hopper".into(),
            cuda_compute_capability: "9.0".into(),
            pci_bus_id: bus.into(),
            memory_bytes: 80 << 30,
            multiprocessors: 132,
            minor: 0,
            mig: Mig::NotSupported,
        }
    }

    #[test]
    fn an_unreadable_gpu_keeps_its_last_look_in_place() {
        let last = Inventory {
            gpus: vec![
                gpu("GPU-a", "0000:1b:00.0"),
                gpu("GPU-b", "0000:43:00.0"),
                gpu("GPU-c", "0000:52:00.0"),
            ],
            ..Inventory::default()
        };
        let mut now = Inventory {
            gpus: vec![gpu("GPU-a", "0000:1b:00.0"), gpu("GPU-c", "0000:52:00.0")],
            ..Inventory::default()
        };
        assert_eq!(keep_last_look(&mut now, Some(&last), "GPU-b"), Some(()));
        assert_eq!(now, last);
        // Never seen before: nothing to keep.
        assert_eq!(keep_last_look(&mut now, Some(&last), "GPU-x"), None);
        assert_eq!(keep_last_look(&mut now, None, "GPU-x"), None);
        assert_eq!(now, last);
    }

    #[test]
    fn a_vanished_gpu_keeps_its_number_unless_it_was_given_away() {
        let recorded: GpuIndices = [
            ("GPU-a".into(), 0),
            ("GPU-b".into(), 1),
            ("GPU-c".into(), 2),
        ]
        .into_iter()
        .collect();
        // b vanished; a new GPU d got number 2 (c vanished too).
        let model: GpuIndices = [("GPU-a".into(), 0), ("GPU-d".into(), 2)]
            .into_iter()
            .collect();
        let merged = merge_indices(&recorded, &model);
        assert_eq!(merged.get("GPU-b"), Some(&1));
        assert_eq!(merged.get("GPU-c"), None, "number 2 now belongs to GPU-d");
        assert_eq!(merged.get("GPU-d"), Some(&2));
    }
}
