//! Flag groups shared by the `tessera` subcommands: each is declared once
//! and flattened into every command that takes it, so a flag means the
//! same (name, environment variable, default) wherever it appears.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::ValueEnum;
use tessera_controller::model::{Capabilities, DriverName, NodePolicy, Optional};

/// How to reach the API server.
#[derive(Debug, Clone, clap::Args)]
pub struct KubeFlags {
    /// Kubeconfig file; without it the usual places (KUBECONFIG,
    /// ~/.kube/config, the in-cluster service account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
}

impl KubeFlags {
    /// A client for the API server; each request's wait is bounded by its
    /// caller, the connection attempt by `connect_timeout`.
    pub async fn client(&self, connect_timeout: Duration) -> anyhow::Result<kube::Client> {
        Ok(tessera_driver::apiserver::client(self.kubeconfig.as_deref(), connect_timeout).await?)
    }
}

/// The DRA driver this process serves.
#[derive(Debug, Clone, clap::Args)]
pub struct DriverFlags {
    /// DRA driver name: slices are published, claims prepared, configs
    /// checked and health taints keyed under it.
    #[arg(long, env = "TESSERA_DRIVER_NAME", default_value = tessera_api::names::DEFAULT_DRIVER_NAME)]
    pub driver_name: String,
}

impl DriverFlags {
    pub fn driver(&self) -> anyhow::Result<DriverName> {
        DriverName::new(&self.driver_name).map_err(|e| anyhow::anyhow!("--driver-name: {e}"))
    }
}

/// The node this process runs for.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeFlags {
    /// Name of this node (the pool is named after it).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
}

impl NodeFlags {
    pub fn node(&self) -> anyhow::Result<String> {
        match &self.node_name {
            Some(n) if !n.is_empty() => Ok(n.clone()),
            _ => bail!("the node name is required: --node-name or NODE_NAME"),
        }
    }
}

/// The node policy: which GPUs are offered in which modes.
#[derive(Debug, Clone, clap::Args)]
pub struct PolicyFlags {
    /// Node policy file (YAML, kind NodePolicy); default: every mode on
    /// every GPU. The publisher and the kubelet plugin must read the same.
    #[arg(long, env = "TESSERA_POLICY")]
    pub policy: Option<PathBuf>,
}

impl PolicyFlags {
    pub fn load(&self) -> anyhow::Result<NodePolicy> {
        match &self.policy {
            None => Ok(NodePolicy::default()),
            Some(path) => read_policy(path),
        }
    }
}

fn read_policy(path: &Path) -> anyhow::Result<NodePolicy> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the node policy {}", path.display()))?;
    NodePolicy::from_yaml(&text).with_context(|| format!("node policy {}", path.display()))
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`); colours only
/// on a terminal.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// What the model may assume the API server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CapabilityChoice {
    /// Detect from the API server (`publish`, `plugin`).
    Auto,
    /// Partitionable devices and consumable capacity: the full model.
    Full,
    /// Neither: the static per-GPU mode with share replicas.
    Legacy,
    /// Consumable capacity without partitionable devices (static mode with
    /// multi-allocatable share devices).
    ConsumableOnly,
    /// Partitionable devices without consumable capacity (static mode).
    PartitionableOnly,
}

/// Whether compatibility groups are published where the API server keeps
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GroupsChoice {
    /// Where the API server keeps them (`DRADeviceCompatibilityGroups` on
    /// it, which must then be on for the scheduler too).
    Auto,
    /// Never: the scheduler's gate is off while the API server's is on (a
    /// scheduler without the gate ignores slices with groups).
    Off,
}

impl GroupsChoice {
    pub fn allowed(self) -> bool {
        self == GroupsChoice::Auto
    }
}

/// Whether devices the node makes at prepare carry binding conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BindingChoice {
    /// Where the API server keeps them: `tessera binder` runs in the
    /// cluster and relays each waiting allocation to its node.
    Auto,
    /// Never (no binder: the scheduler would wait for conditions nobody
    /// sets).
    Off,
}

/// The optional features the operator allows.
#[derive(Debug, Clone, clap::Args)]
pub struct OptionalFlags {
    /// Compatibility groups on the devices' counter consumptions
    /// (KEP-5963): `auto` publishes them where the API server keeps them;
    /// `off` where the scheduler's DRADeviceCompatibilityGroups gate is off
    /// although the API server's is on.
    #[arg(long, value_enum, env = "TESSERA_COMPATIBILITY_GROUPS", default_value_t = GroupsChoice::Auto)]
    pub compatibility_groups: GroupsChoice,

    /// Binding conditions on devices made at prepare (dynamic MIG, KEP-5007):
    /// `auto` where the API server keeps them, for clusters that run
    /// `tessera binder`; `off` (the default) otherwise.
    #[arg(long, value_enum, env = "TESSERA_BINDING_CONDITIONS", default_value_t = BindingChoice::Off)]
    pub binding_conditions: BindingChoice,
}

impl OptionalFlags {
    pub fn optional(&self) -> Optional {
        Optional {
            compatibility_groups: self.compatibility_groups.allowed(),
            binding_conditions: self.binding_conditions == BindingChoice::Auto,
        }
    }
}

impl CapabilityChoice {
    /// The capabilities chosen; `None` for `auto` (detect them).
    pub fn capabilities(self) -> Option<Capabilities> {
        let both = Capabilities::full();
        match self {
            CapabilityChoice::Auto => None,
            CapabilityChoice::Full => Some(both),
            CapabilityChoice::Legacy => Some(Capabilities::legacy()),
            CapabilityChoice::ConsumableOnly => Some(Capabilities {
                partitionable_devices: false,
                ..both
            }),
            CapabilityChoice::PartitionableOnly => Some(Capabilities {
                consumable_capacity: false,
                ..both
            }),
        }
    }
}

/// The async runtime of the commands that serve (two workers: they wait on
/// the API server, not on CPUs).
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context as _;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}
