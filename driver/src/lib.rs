//! Tessera's node side: GPU discovery through NVML and the kubelet DRA plugin
//! (prepare/unprepare, CDI specs, checkpoint, sharing enforcement).
//!
//! The `tessera` binary is a thin command line over this library.

pub mod cdi;
pub mod checkpoint;
pub mod claim_uid;
pub mod discovery;
pub mod flags;
pub mod guard;
pub mod health;
pub mod host;
pub mod metrics;
pub mod mig;
pub mod mps;
pub mod node;
pub mod plugin;
pub mod prepare;
pub mod probe;
pub mod state;
pub mod sync;
pub mod webhook;
