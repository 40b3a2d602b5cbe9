//! What the node process is told: where the kubelet, the container
//! runtime, the driver and its own state are, and how it behaves.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tessera_controller::model::{Capabilities, DriverName, NodePolicy};
use tessera_controller::publisher::ServerVersion;

/// The node process's whole configuration, checked: built by the `tessera
/// plugin` command from its flags, or by a test.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node; the pool is named after it.
    pub node_name: String,
    pub driver: DriverName,
    pub policy: NodePolicy,
    /// Kubeconfig file; `None`: the usual places.
    pub kubeconfig: Option<PathBuf>,
    /// How long a read of a claim may wait for the API server.
    pub api_timeout: Duration,
    pub kubelet: KubeletPaths,
    /// Directory the container runtime reads CDI specs from.
    pub cdi_dir: PathBuf,
    /// The prepared-claims checkpoint and the node's other records.
    pub state_dir: PathBuf,
    /// File holding the kernel's boot id.
    pub boot_id_file: PathBuf,
    pub driver_root: DriverRoot,
    /// Where the claims' MPS daemons keep their pipes, memory and logs.
    pub mps_dir: PathBuf,
    /// The host cgroup MPS daemons move into, so they outlive this
    /// process's container.
    pub mps_cgroup: Option<HostCgroupPlace>,
    /// HAMi-core's `libvgpu.so` and its `ld.so.preload`.
    pub hami_core_dir: PathBuf,
    /// How often GPUs are discovered again besides after each change.
    pub rediscover: Duration,
    /// Oldest API server version that gets the full model.
    pub full_model_min_version: ServerVersion,
    /// What the API server serves; `None`: detect it.
    pub capabilities: Option<Capabilities>,
    /// Compatibility groups and binding conditions, where the API server
    /// keeps them.
    pub optional: tessera_controller::model::Optional,
    /// Where `tessera binder` lists the claims to make ahead (with binding
    /// conditions on).
    pub binding_namespace: Option<String>,
    /// Whether prepared claims get their `status.devices` written.
    pub device_status: bool,
    /// XIDs that are only logged.
    pub benign_xids: Vec<u64>,
    /// How long after its last fatal XID a GPU is Healthy again; `None`:
    /// not while the process runs.
    pub xid_recovery: Option<Duration>,
    /// Where Prometheus metrics are served to anyone; `None`: not at all.
    pub metrics_address: Option<SocketAddr>,
    /// Where they are served over TLS to whom the API server allows.
    pub secure_metrics: Option<SecureMetrics>,
    /// The unix socket the process's probes are answered on.
    pub health_socket: Option<PathBuf>,
}

/// The authenticated metrics endpoint.
#[derive(Debug, Clone)]
pub struct SecureMetrics {
    pub address: SocketAddr,
    /// The serving certificate's files; `None`: a self-signed one.
    pub certificate: Option<CertificateFiles>,
}

/// A PEM certificate chain and its private key.
#[derive(Debug, Clone)]
pub struct CertificateFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Where the kubelet looks for plugins.
#[derive(Debug, Clone)]
pub struct KubeletPaths {
    /// The plugin registration directory.
    pub registry_dir: PathBuf,
    /// The plugin directory; the DRA socket goes into `<dir>/<driver>/`.
    pub plugins_dir: PathBuf,
}

/// The NVIDIA driver installation and its device nodes.
#[derive(Debug, Clone)]
pub struct DriverRoot {
    /// Libraries, tools and `/proc/driver/nvidia` are below this.
    pub root: PathBuf,
    /// `dev/nvidia*` are below this (the driver root unless told).
    pub dev_root: PathBuf,
}

/// A cgroup of the host, as this process sees the host's cgroup tree.
#[derive(Debug, Clone)]
pub struct HostCgroupPlace {
    /// The host's cgroup filesystem, mounted into this container.
    pub fs: PathBuf,
    /// The cgroup's name (one path component).
    pub name: String,
}
