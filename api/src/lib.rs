//! Tessera's shared vocabulary.
//!
//! Everything that more than one Tessera crate must agree on lives here: the
//! node's GPU [`inventory`] as discovered through NVML, the opaque
//! configuration API users put into DeviceClasses and ResourceClaims
//! ([`config`]), attribute and capacity [`names`], the DeviceClass names
//! ([`classes`]), and the kubelet gRPC protocols ([`kubelet`]).

pub mod classes;
pub mod config;
pub mod inventory;
pub mod kubelet;
pub mod names;
pub mod probe;
