//! Tessera's conformance suite and the helpers its tests use to reach the
//! local Kubernetes control plane started by `conformance/cluster.sh`.

pub mod bench;
pub mod classes;
pub mod cluster;
pub mod procs;
pub mod selftest;
pub mod suite;
pub mod tls;

/// The built `tessera` and simulated libraries (the test kit's).
pub use tessera_test_kit::artifacts;

pub use cluster::{
    ClusterEnv, DEFAULT_TIMEOUT, KubeletDirs, PluginCall, TestCluster, TestDraPlugin,
    TestNamespace, delete_ignore_missing, unique_name, wait_for,
};
