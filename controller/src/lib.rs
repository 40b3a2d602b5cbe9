//! ResourceSlice model (inventory + node policy + API capabilities -> slices) and publisher.
//!
//! [`model`] is pure: it computes the ResourceSlices a node should publish.
//! The publisher (server-side apply, capability detection) is a thin
//! reconcile loop over [`model::SliceModel`].

pub mod binder;
pub mod model;
pub mod publisher;

pub use model::{
    Capabilities, DriverName, Model, ModelError, NodePolicy, SliceModel, desired_slices,
};
pub use publisher::{Publisher, PublisherConfig};
