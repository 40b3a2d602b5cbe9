//! Tessera's node side: GPU discovery through NVML and the kubelet DRA plugin
//! (prepare/unprepare, CDI specs, checkpoint, sharing enforcement).
//!
//! The `tessera` binary (`src/bin/tessera`) is a thin command line over this
//! library; [`node`] wires the node process. docs/architecture.md has the
//! modules as layers and which may use which.

pub mod apiserver;
pub mod binding;
pub mod cdi;
pub mod claim_uid;
pub mod discovery;
pub mod guard;
pub mod health;
pub mod host;
pub mod kubelet;
pub mod metrics;
pub mod node;
pub mod prepare;
pub mod probe;
pub mod publish;
pub mod state;
pub mod sync;
pub mod tls;
pub mod webhook;
