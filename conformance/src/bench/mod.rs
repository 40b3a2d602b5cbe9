//! `tessera-bench`: the node-plugin benchmark (docs/benchmarks.md). It
//! measures any DRA kubelet plugin the same way, so Tessera and the
//! Kubernetes project's DRA test driver are compared call for call:
//!
//! * [`grpc`]: `NodePrepareResources` / `NodeUnprepareResources` called
//!   directly on the plugin's socket for claims stored in the API server,
//!   at a chosen concurrency, latencies timed per call;
//! * [`cluster`]: what the cluster's components report (their metrics, the
//!   kubelet's own `dra_grpc_operations_duration_seconds`), the API
//!   server's ResourceSlice write counters, and the time from a process's
//!   start to its first slice;
//! * [`pods`]: pods of one claim each through the kubelet, creation to
//!   Running;
//! * [`pod_start`]: where those pods' start went, stage by stage and
//!   process by process;
//! * [`scale`]: many simulated nodes on one control plane: publishing
//!   every node's slices, and kube-scheduler's pace with Tessera's device
//!   model vs plain replica devices;
//! * [`binder`]: `tessera binder` on a cluster of many claims: its start,
//!   memory and CPU, and a burst of allocations waiting on their nodes.

pub mod binder;
pub mod cluster;
pub mod grpc;
pub mod pod_start;
pub mod pods;
pub mod scale;
pub mod stats;
