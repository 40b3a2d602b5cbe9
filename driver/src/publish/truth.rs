use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tessera_api::inventory::Inventory;
use tessera_controller::model::Model;
use tessera_controller::model::naming::GpuIndices;
use tessera_controller::publisher::NodeState;
use tracing::{info, warn};

use crate::state::catalog::{Catalog, DeviceCatalog};
use crate::sync::Locked;

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
    /// Told the pool's generation after each reconcile that published.
    on_published: Option<Box<dyn Fn(i64) + Send + Sync>>,
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
            on_published: None,
        }
    }

    /// Tells `on_published` the pool's generation after each reconcile
    /// that left the server with the model.
    pub fn on_published(mut self, on_published: impl Fn(i64) + Send + Sync + 'static) -> Self {
        self.on_published = Some(Box::new(on_published));
        self
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

    fn published(&self, generation: i64) {
        if let Some(tell) = &self.on_published {
            tell(generation);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
