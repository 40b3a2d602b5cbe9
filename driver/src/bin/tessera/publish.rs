//! `tessera publish` and `tessera slices`: GPU discovery -> ResourceSlice
//! model -> API server (or stdout); the logic lives in `tessera_controller`.

use std::ffi::OsStr;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::ValueEnum;
use serde::Serialize;
use tessera_api::inventory::Inventory;
use tessera_controller::model::SliceModel;
use tessera_controller::publisher::{
    Detected, MIN_FULL_MODEL, NodeView, Publisher, PublisherConfig, Reconciled, ServerVersion,
    WriteCounts,
};
use tessera_driver::discovery;

use crate::flags::{
    CapabilityChoice, DriverFlags, KubeFlags, NodeFlags, OptionalFlags, PolicyFlags, init_logging,
};
use crate::inventory::{quote_base60_lookalikes, write_stdout};
use crate::signals::termination;

/// Which node and driver the pool belongs to, and the node policy.
#[derive(Debug, clap::Args)]
pub struct PoolArgs {
    #[command(flatten)]
    node: NodeFlags,

    #[command(flatten)]
    driver: DriverFlags,

    #[command(flatten)]
    policy: PolicyFlags,
}

#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    #[command(flatten)]
    pool: PoolArgs,

    #[command(flatten)]
    kube: KubeFlags,

    /// Reconcile once, print what was written (JSON) and exit.
    #[arg(long)]
    once: bool,

    /// What the API server serves; `auto` detects it (discovery, dry-run
    /// probes, version).
    #[arg(long, value_enum, default_value_t = CapabilityChoice::Auto)]
    capabilities: CapabilityChoice,

    #[command(flatten)]
    optional: OptionalFlags,

    /// Oldest server version that gets the full model (its scheduler must
    /// have the 2026 counter fixes; see docs/device-model.md).
    #[arg(long, default_value_t = MIN_FULL_MODEL)]
    full_model_min_version: ServerVersion,

    /// How often GPUs are discovered again (seconds); a change is published
    /// at once.
    #[arg(long, default_value_t = 10)]
    rediscover_seconds: u64,
}

#[derive(Debug, clap::Args)]
pub struct SlicesArgs {
    #[command(flatten)]
    pool: PoolArgs,

    /// What the API server is assumed to serve.
    #[arg(long, value_enum, default_value_t = CapabilityChoice::Full)]
    capabilities: CapabilityChoice,

    /// Shorthand for `--capabilities legacy` (an API server without
    /// partitionable devices and consumable capacity).
    #[arg(long, conflicts_with = "capabilities")]
    legacy: bool,

    /// Name each counter consumption's compatibility group, as `publish`
    /// does where the API server keeps them.
    #[arg(long)]
    compatibility_groups: bool,

    /// Give devices made at prepare their binding conditions, as `publish
    /// --binding-conditions auto` does where the API server keeps them.
    #[arg(long)]
    binding_conditions: bool,

    /// Output format: YAML documents, or a JSON `v1 List`.
    #[arg(long, short, value_enum, default_value_t = SliceFormat::Yaml)]
    output: SliceFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum SliceFormat {
    Yaml,
    Json,
}

/// Discovers the GPUs; GPUs that fail are reported and left out.
fn discover_once(nvml: &nvml_wrapper::Nvml) -> anyhow::Result<Inventory> {
    let found = discovery::discover(nvml)?;
    for e in &found.failed {
        eprintln!("tessera: error: {e} (not published)");
    }
    Ok(found.inventory)
}

/// `tessera slices`.
pub fn slices(library: &OsStr, args: &SlicesArgs) -> anyhow::Result<ExitCode> {
    let node = match args.pool.node.node() {
        Ok(n) => n,
        Err(_) => hostname().context("no --node-name/NODE_NAME and no hostname")?,
    };
    let choice = if args.legacy {
        CapabilityChoice::Legacy
    } else {
        args.capabilities
    };
    let Some(mut capabilities) = choice.capabilities() else {
        bail!("--capabilities auto needs an API server; use `tessera publish`, or pick one");
    };
    capabilities.compatibility_groups = args.compatibility_groups;
    capabilities.binding_conditions = args.binding_conditions;
    let policy = args.pool.policy.load()?;
    let driver = args.pool.driver.driver()?;
    let nvml = discovery::init(Some(library))?;
    let inventory = discover_once(&nvml)?;
    let model = SliceModel::new(&inventory, &policy, capabilities, &node)
        .driver(driver)
        .build()?;
    for note in &model.notes {
        eprintln!("tessera: note: {note}");
    }
    let text = match args.output {
        SliceFormat::Yaml => {
            let mut out = String::new();
            for slice in &model.slices {
                out.push_str("---\n");
                out.push_str(&serde_yaml::to_string(slice).context("encoding YAML")?);
            }
            quote_base60_lookalikes(&out)
        }
        SliceFormat::Json => {
            let list = serde_json::json!({
                "apiVersion": "v1",
                "kind": "List",
                "items": model.slices,
            });
            serde_json::to_string_pretty(&list).context("encoding JSON")? + "\n"
        }
    };
    write_stdout(&text)?;
    Ok(ExitCode::SUCCESS)
}

fn hostname() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    Ok(name.trim().to_ascii_lowercase())
}

/// What `publish --once` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct OnceReport {
    /// API writes of this run (creates/updates/deletes of slices).
    writes: WriteCounts,
    /// Writes the server refused.
    rejected: u64,
    result: Reconciled,
    server: ServerReport,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ServerReport {
    git_version: String,
    partitionable_devices: bool,
    consumable_capacity: bool,
    device_taints: bool,
    compatibility_groups: bool,
    binding_conditions: bool,
    version_ok: bool,
    reasons: Vec<String>,
}

impl From<&Detected> for ServerReport {
    fn from(d: &Detected) -> Self {
        ServerReport {
            git_version: d.git_version.clone(),
            partitionable_devices: d.capabilities.partitionable_devices,
            consumable_capacity: d.capabilities.consumable_capacity,
            device_taints: d.capabilities.device_taints,
            compatibility_groups: d.capabilities.compatibility_groups,
            binding_conditions: d.capabilities.binding_conditions,
            version_ok: d.version_ok,
            reasons: d.reasons.clone(),
        }
    }
}

/// A client for the publisher, which watches its slices and the claims.
async fn client(kube: &KubeFlags) -> anyhow::Result<kube::Client> {
    kube.client(Duration::from_secs(10)).await
}

/// `tessera publish`.
pub fn publish(library: &OsStr, args: &PublishArgs) -> anyhow::Result<ExitCode> {
    init_logging();
    let node = args.pool.node.node()?;
    let mut config =
        PublisherConfig::new(&node, args.pool.driver.driver()?, args.pool.policy.load()?);
    config.capabilities = args.capabilities.capabilities();
    config.optional = args.optional.optional();
    config.min_full_model = args.full_model_min_version;

    let nvml = discovery::init(Some(library))?;
    let inventory = discover_once(&nvml)?;

    let runtime = crate::flags::runtime()?;
    if args.once {
        return runtime.block_on(async {
            let mut publisher = Publisher::new(client(&args.kube).await?, config);
            let counters = publisher.counters();
            let result = publisher.reconcile(&inventory.into()).await;
            let server = publisher.detected().map(ServerReport::from);
            let result = result?;
            let report = OnceReport {
                writes: counters.snapshot(),
                rejected: counters.rejected(),
                result,
                server: server.context("capabilities were not detected")?,
            };
            write_stdout(&(serde_json::to_string(&report)? + "\n"))?;
            Ok(ExitCode::SUCCESS)
        });
    }

    let (tx, rx) = tokio::sync::watch::channel(NodeView::from(inventory));
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let interval = Duration::from_secs(args.rediscover_seconds.max(1));
    // NVML calls block: rediscover on a thread of its own and hand changed
    // inventories to the publisher.
    let rediscovery = std::thread::spawn(move || {
        while let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(interval) {
            match discovery::discover(&nvml) {
                Ok(found) => {
                    for e in &found.failed {
                        tracing::warn!("{e} (not published)");
                    }
                    tx.send_if_modified(|current| {
                        let changed = current.inventory != found.inventory;
                        if changed {
                            tracing::info!("GPU inventory changed");
                            current.inventory = found.inventory;
                        }
                        changed
                    });
                }
                Err(e) => tracing::warn!("GPU discovery failed: {e}; keeping the last inventory"),
            }
        }
    });
    runtime.block_on(async {
        let client = client(&args.kube).await?;
        let publisher = Publisher::new(client, config);
        tracing::info!("publishing ResourceSlices for node {node}");
        publisher.run(rx, termination()).await;
        anyhow::Ok(())
    })?;
    let _ = stop_tx.send(());
    let _ = rediscovery.join();
    Ok(ExitCode::SUCCESS)
}
