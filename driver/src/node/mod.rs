//! The node process, wired: one Tessera process per node serves the
//! kubelet and publishes the node's ResourceSlices. This module is the
//! composition root: the only place that builds the host adapters, the
//! prepare engine, the publisher, the metrics and the kubelet servers and
//! hands each the others it needs ([`process::start`], in named steps).
//!
//! * [`config::NodeConfig`] is everything the process is told (the
//!   `tessera plugin` command turns its flags into one).
//! * [`state_lock::StateLock`] keeps a second process (a rolling update)
//!   from touching the node's state until the first is gone; meanwhile it
//!   answers its own probes ([`readiness`]) on standby ([`standby`]):
//!   ready to take over when its pre-flight checks pass.
//! * [`mps_watch`] keeps the claims' MPS daemons in line with the records.
//! * [`heap`] tunes the allocator and gives freed memory back.

pub mod config;
pub mod heap;
pub mod mps_watch;
pub mod process;
pub mod readiness;
pub mod standby;
pub mod state_lock;

pub use config::NodeConfig;
pub use process::{NodeProcess, start};
