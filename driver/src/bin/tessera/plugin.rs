//! `tessera plugin`: the node process (see [`tessera_driver::node`]): its
//! flags, turned into a [`NodeConfig`], and its signals.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::Duration;

use tessera_controller::publisher::{MIN_FULL_MODEL, ServerVersion};
use tessera_driver::metrics::server::parse_address;
use tessera_driver::node::config::{
    CertificateFiles, DriverRoot, HostCgroupPlace, KubeletPaths, SecureMetrics,
};
use tessera_driver::node::{self, NodeConfig};
use tessera_driver::state::checkpoint::KERNEL_BOOT_ID;

use crate::flags::{
    CapabilityChoice, DriverFlags, KubeFlags, NodeFlags, OptionalFlags, PolicyFlags, init_logging,
};
use crate::signals::termination;

#[derive(Debug, Clone, clap::Args)]
pub struct PluginArgs {
    #[command(flatten)]
    pub node: NodeFlags,

    #[command(flatten)]
    pub driver: DriverFlags,

    #[command(flatten)]
    pub policy: PolicyFlags,

    #[command(flatten)]
    pub kube: KubeFlags,

    /// The kubelet's plugin registration directory.
    #[arg(
        long,
        env = "TESSERA_KUBELET_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub kubelet_registry_dir: PathBuf,

    /// The kubelet's plugin directory; the DRA socket goes into
    /// `<dir>/<driver name>/`.
    #[arg(
        long,
        env = "TESSERA_KUBELET_PLUGINS_DIR",
        default_value = "/var/lib/kubelet/plugins"
    )]
    pub kubelet_plugins_dir: PathBuf,

    /// Directory the container runtime reads CDI specs from.
    #[arg(long, env = "TESSERA_CDI_DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,

    /// Directory of the prepared-claims checkpoint.
    #[arg(long, env = "TESSERA_STATE_DIR", default_value = "/var/lib/tessera")]
    pub state_dir: PathBuf,

    /// Where the claims' MPS control daemons keep their pipes, shared
    /// memory and logs. Unix socket names are limited to 108 bytes, so this
    /// must be a short path.
    #[arg(long, env = "TESSERA_MPS_DIR", default_value = "/run/tessera/mps")]
    pub mps_dir: PathBuf,

    /// The host's cgroup filesystem as this process sees it (the host's
    /// /sys/fs/cgroup mounted into its container). With --mps-cgroup, MPS
    /// daemons move into that cgroup of the host, so that a restart, crash
    /// or rolling update of this process's container leaves the daemons of
    /// running workloads alone. Needs the host's PID namespace (hostPID).
    #[arg(long, env = "TESSERA_MPS_CGROUP_FS", requires = "mps_cgroup")]
    pub mps_cgroup_fs: Option<PathBuf>,

    /// The cgroup of the host MPS daemons move into (one path component,
    /// created in every hierarchy below --mps-cgroup-fs).
    #[arg(long, env = "TESSERA_MPS_CGROUP", requires = "mps_cgroup_fs")]
    pub mps_cgroup: Option<String>,

    /// Where HAMi-core's `libvgpu.so` and the `ld.so.preload` file listing
    /// it (as `/usr/local/vgpu/libvgpu.so`) are: mounted into containers
    /// of Isolated shares on GPUs whose policy names `isolationProvider:
    /// hami-core`. Without them such a claim is refused, never weakened.
    #[arg(long, env = "TESSERA_HAMI_CORE_DIR", default_value = tessera_driver::prepare::enforce::hami_core::DEFAULT_DIR)]
    pub hami_core_dir: PathBuf,

    /// Root of the NVIDIA driver installation (libraries, tools,
    /// /proc/driver/nvidia); `/run/nvidia/driver` for a containerized driver.
    #[arg(long, env = "TESSERA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,

    /// Root below which the NVIDIA device nodes (`dev/nvidia*`) are; default:
    /// the driver root.
    #[arg(long, env = "TESSERA_DEV_ROOT")]
    pub dev_root: Option<PathBuf>,

    /// File holding the kernel's boot id (tests simulate reboots with it).
    #[arg(long, env = "TESSERA_BOOT_ID_FILE", default_value = KERNEL_BOOT_ID)]
    pub boot_id_file: PathBuf,

    /// Seconds to wait for the API server when reading a claim.
    #[arg(long, default_value_t = 20)]
    pub api_timeout_seconds: u64,

    /// How often GPUs are discovered again (seconds); prepare and unprepare
    /// also trigger a discovery.
    #[arg(long, default_value_t = 10)]
    pub rediscover_seconds: u64,

    /// Oldest API server version that gets the full model (its scheduler
    /// must have the 2026 counter fixes; see docs/device-model.md).
    #[arg(long, default_value_t = MIN_FULL_MODEL)]
    pub full_model_min_version: ServerVersion,

    /// Write each prepared claim's `status.devices` (device data for users
    /// and tools: UUIDs, MIG UUID, limits). Each prepare and unprepare then
    /// costs one more API write; `false` leaves the field to others.
    #[arg(
        long,
        env = "TESSERA_DEVICE_STATUS",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub device_status: bool,

    /// What the API server serves; `auto` detects it (discovery, dry-run
    /// probes, version). Forcing a lower level publishes the static model.
    #[arg(long, value_enum, default_value_t = CapabilityChoice::Auto)]
    pub capabilities: CapabilityChoice,

    #[command(flatten)]
    pub optional: OptionalFlags,

    /// The driver's namespace, where `tessera binder` lists the claims this
    /// node makes ahead of binding (needed with --binding-conditions auto).
    #[arg(long, env = "POD_NAMESPACE")]
    pub binding_namespace: Option<String>,

    /// XIDs that are only logged (application errors), comma-separated;
    /// replaces the default list. The fatal XIDs (48, 63, 64, 74, 79, 92,
    /// 94, 95, 119, 120) make a GPU Unhealthy whatever this says.
    #[arg(
        long,
        env = "TESSERA_BENIGN_XIDS",
        value_delimiter = ',',
        default_values_t = tessera_driver::health::DEFAULT_BENIGN_XIDS.to_vec()
    )]
    pub benign_xids: Vec<u64>,

    /// Seconds after its last fatal XID a GPU is reported Healthy again; 0:
    /// never while the process runs (a restart starts Healthy).
    #[arg(long, env = "TESSERA_XID_RECOVERY_SECONDS", default_value_t = 0)]
    pub xid_recovery_seconds: u64,

    /// Where to serve Prometheus metrics (`/metrics`, and `/healthz`:
    /// probes use --health-socket): host:port (port 0 picks a free one,
    /// logged), or `off`. Unauthenticated: keep it on loopback unless a
    /// firewall or NetworkPolicy guards the address.
    #[arg(
        long,
        env = "TESSERA_METRICS_ADDRESS",
        default_value = "127.0.0.1:9400"
    )]
    pub metrics_address: String,

    /// Where to serve the same metrics over TLS to callers the API server
    /// allows (a bearer token it accepts, whose user may `get` the path as
    /// a non-resource URL): host:port, or `off`. For a Service in front of
    /// the node pods.
    #[arg(long, env = "TESSERA_METRICS_SECURE_ADDRESS", default_value = "off")]
    pub metrics_secure_address: String,

    /// The secure endpoint's certificate chain (PEM); without it, a
    /// self-signed certificate made at start. Re-read when it changes.
    #[arg(
        long,
        env = "TESSERA_METRICS_TLS_CERT_FILE",
        requires = "metrics_tls_private_key_file"
    )]
    pub metrics_tls_cert_file: Option<PathBuf>,

    /// The private key (PEM) of --metrics-tls-cert-file.
    #[arg(
        long,
        env = "TESSERA_METRICS_TLS_PRIVATE_KEY_FILE",
        requires = "metrics_tls_cert_file"
    )]
    pub metrics_tls_private_key_file: Option<PathBuf>,

    /// Unix socket this process answers its probes on (`tessera health
    /// --socket`), bound before waiting for the state lock: in a directory
    /// of this pod alone (an emptyDir), never one another instance shares.
    #[arg(long, env = "TESSERA_HEALTH_SOCKET")]
    pub health_socket: Option<PathBuf>,
}

impl PluginArgs {
    /// The node process's configuration: every flag checked and read
    /// (the policy file included) before anything starts.
    fn config(&self) -> anyhow::Result<NodeConfig> {
        Ok(NodeConfig {
            node_name: self.node.node()?,
            driver: self.driver.driver()?,
            policy: self.policy.load()?,
            kubeconfig: self.kube.kubeconfig.clone(),
            api_timeout: Duration::from_secs(self.api_timeout_seconds.max(1)),
            kubelet: KubeletPaths {
                registry_dir: self.kubelet_registry_dir.clone(),
                plugins_dir: self.kubelet_plugins_dir.clone(),
            },
            cdi_dir: self.cdi_dir.clone(),
            state_dir: self.state_dir.clone(),
            boot_id_file: self.boot_id_file.clone(),
            driver_root: DriverRoot {
                root: self.driver_root.clone(),
                dev_root: self
                    .dev_root
                    .clone()
                    .unwrap_or_else(|| self.driver_root.clone()),
            },
            mps_dir: self.mps_dir.clone(),
            // clap requires both or neither.
            mps_cgroup: self
                .mps_cgroup_fs
                .clone()
                .zip(self.mps_cgroup.clone())
                .map(|(fs, name)| HostCgroupPlace { fs, name }),
            hami_core_dir: self.hami_core_dir.clone(),
            rediscover: Duration::from_secs(self.rediscover_seconds.max(1)),
            full_model_min_version: self.full_model_min_version,
            capabilities: self.capabilities.capabilities(),
            optional: self.optional.optional(),
            binding_namespace: self.binding_namespace()?,
            device_status: self.device_status,
            benign_xids: self.benign_xids.clone(),
            xid_recovery: (self.xid_recovery_seconds > 0)
                .then(|| Duration::from_secs(self.xid_recovery_seconds)),
            metrics_address: parse_address("--metrics-address", &self.metrics_address)?,
            secure_metrics: self.secure_metrics()?,
            health_socket: self.health_socket.clone(),
        })
    }
}

impl PluginArgs {
    fn binding_namespace(&self) -> anyhow::Result<Option<String>> {
        if !self.optional.optional().binding_conditions {
            return Ok(None);
        }
        match self.binding_namespace.as_deref().map(str::trim) {
            Some(ns) if !ns.is_empty() => Ok(Some(ns.to_owned())),
            _ => anyhow::bail!(
                "--binding-conditions auto needs --binding-namespace (or POD_NAMESPACE): the \
                 namespace where tessera binder lists the claims to make ahead"
            ),
        }
    }

    fn secure_metrics(&self) -> anyhow::Result<Option<SecureMetrics>> {
        let address = parse_address("--metrics-secure-address", &self.metrics_secure_address)?;
        let files = self
            .metrics_tls_cert_file
            .clone()
            .zip(self.metrics_tls_private_key_file.clone());
        if address.is_none() && files.is_some() {
            anyhow::bail!(
                "--metrics-tls-cert-file is for the secure endpoint: set --metrics-secure-address \
                 too, or leave both out"
            );
        }
        Ok(address.map(|address| SecureMetrics {
            address,
            certificate: files.map(|(cert, key)| CertificateFiles { cert, key }),
        }))
    }
}

/// `tessera plugin`.
pub fn main(nvml_library: &OsStr, args: &PluginArgs) -> anyhow::Result<()> {
    init_logging();
    let config = args.config()?;
    Ok(node::process::run(nvml_library, &config, termination)?)
}
