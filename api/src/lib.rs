//! Tessera's shared vocabulary.
//!
//! Everything that more than one Tessera crate must agree on lives here: the
//! node's GPU [`inventory`] as discovered through NVML, and (later) the opaque
//! configuration API, attribute and capacity names, device naming and the
//! kubelet gRPC protocols.

pub mod inventory;
