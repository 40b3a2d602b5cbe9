//! The node side of publishing: what the node process knows about its
//! node it knows from the node, never from the API server.
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

mod observer;
mod truth;

pub use observer::{Observer, Poke, Pokes, pokes};
pub use truth::{GPU_INDICES_FILE, NodeTruth};
