//! The host: everything prepare changes on the node goes through the
//! [`port`] traits, and the adapters here implement them against the real
//! thing: the claims' MPS daemons ([`mps`]), MIG through NVML ([`mig`]) and
//! the compute time slice ([`time_slice`]). Beside them, what both sides
//! share: the driver's files ([`driver_root`]), what a container needs to
//! reach its MPS daemon ([`mps_client`]) and process identity
//! ([`process`]).
//!
//! The prepare engine imports only the port and the shared parts, never an
//! adapter; the adapters never import the engine. The node process
//! ([`crate::node`]) builds the adapters and hands them to prepare.

pub mod driver_root;
pub mod mig;
pub mod mps;
pub mod mps_client;
pub mod port;
pub mod process;
pub mod time_slice;
