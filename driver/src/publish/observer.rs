use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tessera_api::inventory::Inventory;
use tessera_controller::publisher::NodeView;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::discovery;
use crate::health::HealthTracker;
use crate::prepare::NodeChange;
use crate::prepare::Preparer;
use crate::sync::ReadWrite;

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
    pub fn observe(&self, last: Option<&Inventory>) -> Result<NodeView, discovery::Error> {
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
            not_made: self.preparer.not_made_devices(),
        }
    }

    /// Observes every `period`, at once when poked with a GPU change, and
    /// when a burst of record changes has settled (prepare and unprepare
    /// poke after each change, saying whether the GPUs changed or only the
    /// records); sends views that differ. Ends when every poke sender is
    /// gone.
    pub fn spawn(
        self: Arc<Self>,
        views: watch::Sender<NodeView>,
        pokes: Pokes,
        period: Duration,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            loop {
                let change = match pokes.rx.recv_timeout(period) {
                    Ok(NodeChange::Records) => pokes.records_settled(),
                    Ok(NodeChange::Gpus) => NodeChange::Gpus,
                    Err(mpsc::RecvTimeoutError::Timeout) => NodeChange::Gpus,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                };
                let change = pokes.drain(change);
                // From here a records change pokes again: what changed
                // before is in the look below, which comes after it.
                pokes.counted.pending.store(false, Ordering::SeqCst);
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

/// How long the records must stay unchanged before they are read again,
/// and the longest they wait: a burst of prepares and unprepares (the
/// kubelet's, or a bench's) is read once, after it, not once per claim on
/// the CPUs the next claims need. A GPU change is read at once.
const RECORDS_QUIET: Duration = Duration::from_millis(20);
const RECORDS_MAX_LAG: Duration = Duration::from_secs(1);

/// Records changes since the observer last looked: only the first of a
/// burst is sent (and wakes the observer); the others are counted, and the
/// observer sees them by the count when it looks again.
#[derive(Debug, Default)]
struct Counted {
    /// A records poke was sent and the observer has not looked since.
    pending: AtomicBool,
    changes: AtomicU64,
}

/// What prepare, unprepare and health tell the observer.
#[derive(Debug, Clone)]
pub struct Poke {
    tx: mpsc::Sender<NodeChange>,
    counted: Arc<Counted>,
}

impl Poke {
    /// A GPU change is sent at once; a records change only when none is
    /// pending. `false` once the observer is gone.
    pub fn send(&self, change: NodeChange) -> bool {
        if change == NodeChange::Records {
            self.counted.changes.fetch_add(1, Ordering::SeqCst);
            if self.counted.pending.swap(true, Ordering::SeqCst) {
                return true;
            }
        }
        self.tx.send(change).is_ok()
    }
}

/// The observer's end of [`Poke`].
#[derive(Debug)]
pub struct Pokes {
    rx: mpsc::Receiver<NodeChange>,
    counted: Arc<Counted>,
}

/// A connected [`Poke`] and [`Pokes`].
pub fn pokes() -> (Poke, Pokes) {
    let (tx, rx) = mpsc::channel();
    let counted = Arc::new(Counted::default());
    (
        Poke {
            tx,
            counted: counted.clone(),
        },
        Pokes { rx, counted },
    )
}

impl Pokes {
    /// After a records change: waits until the count of records changes
    /// stayed the same for [`RECORDS_QUIET`] (at most [`RECORDS_MAX_LAG`]);
    /// a GPU change ends the wait.
    fn records_settled(&self) -> NodeChange {
        let until = std::time::Instant::now() + RECORDS_MAX_LAG;
        let mut seen = self.counted.changes.load(Ordering::SeqCst);
        loop {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return NodeChange::Records;
            }
            match self.rx.recv_timeout(RECORDS_QUIET.min(left)) {
                Ok(NodeChange::Records) => {}
                Ok(NodeChange::Gpus) => return NodeChange::Gpus,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let now = self.counted.changes.load(Ordering::SeqCst);
                    if now == seen {
                        return NodeChange::Records;
                    }
                    seen = now;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return NodeChange::Records,
            }
        }
    }

    /// `change`, or a GPU change if one is waiting among the pokes (taken).
    fn drain(&self, mut change: NodeChange) -> NodeChange {
        while let Ok(more) = self.rx.try_recv() {
            if more == NodeChange::Gpus {
                change = more;
            }
        }
        change
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
    fn record_changes_are_read_once_settled_and_a_gpu_change_at_once() {
        let (tx, rx) = pokes();
        // Quiet: a single records change waits out the quiet period.
        let began = std::time::Instant::now();
        assert!(tx.send(NodeChange::Records));
        assert_eq!(rx.rx.recv().unwrap(), NodeChange::Records);
        assert_eq!(rx.records_settled(), NodeChange::Records);
        assert!(began.elapsed() >= RECORDS_QUIET);
        // Only the first of a burst is sent until the observer looks.
        assert!(tx.send(NodeChange::Records));
        assert!(rx.rx.try_recv().is_err(), "the observer has not looked yet");
        rx.counted.pending.store(false, Ordering::SeqCst);
        assert!(tx.send(NodeChange::Records));
        assert_eq!(rx.rx.try_recv().unwrap(), NodeChange::Records);
        // A GPU change among them ends the wait.
        assert!(tx.send(NodeChange::Gpus));
        assert_eq!(rx.records_settled(), NodeChange::Gpus);
        // Changes without end are still read within the longest lag.
        let feeder = std::thread::spawn(move || {
            let end = std::time::Instant::now() + 3 * RECORDS_MAX_LAG;
            while std::time::Instant::now() < end {
                if !tx.send(NodeChange::Records) {
                    return;
                }
                // Changes closer together than the quiet period.
                std::thread::sleep(RECORDS_QUIET / 4);
            }
        });
        let began = std::time::Instant::now();
        assert_eq!(rx.records_settled(), NodeChange::Records);
        assert!(began.elapsed() >= RECORDS_MAX_LAG, "the changes went on");
        assert!(!feeder.is_finished(), "read while the changes went on");
        drop(rx);
        feeder.join().unwrap();
    }
}
