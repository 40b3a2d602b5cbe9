//! `tessera plugin`: the node process (flags, wiring, signals): the kubelet
//! plugin and the publisher of this node's slices in one process (see
//! [`crate::node`]). The `tessera` binary declares the subcommand.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use tessera_api::inventory::Inventory;
use tessera_controller::model::{DriverName, NodePolicy};
use tessera_controller::publisher::{MIN_FULL_MODEL, Publisher, PublisherConfig, ServerVersion};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{Plugin, PluginConfig, sockets};
use crate::checkpoint::KERNEL_BOOT_ID;
use crate::discovery;
use crate::flags::CapabilityChoice;
use crate::health::{self, HealthService, HealthTracker, XidPolicy};
use crate::mig::NvmlMig;
use crate::mps::{HostCgroup, MpsConfig, MpsSupervisor, ShmPolicy, SupervisionReport};
use crate::node::readiness::{self, Phase, Readiness};
use crate::node::state_lock::StateLock;
use crate::node::{NodeTruth, Observer};
use crate::prepare::claims::ApiClaims;
use crate::prepare::layout::{Layout, discover_driver_files};
use crate::prepare::provider::time_slice::NvidiaSmiTimeSlice;
use crate::prepare::status::StatusWriter;
use crate::prepare::{Dependencies, NodeChange, PrepareConfig, Preparer};
use crate::state::catalog::DeviceCatalog;
use crate::state::events::NodeEvents;

#[derive(Debug, Clone, clap::Args)]
pub struct PluginArgs {
    /// Name of this node (the pool is named after it).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// DRA driver name.
    #[arg(long, env = "TESSERA_DRIVER_NAME", default_value = tessera_api::names::DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

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
    #[arg(long, env = "TESSERA_HAMI_CORE_DIR", default_value = crate::prepare::provider::hami_core::DEFAULT_DIR)]
    pub hami_core_dir: PathBuf,

    /// Root of the NVIDIA driver installation (libraries, tools,
    /// /proc/driver/nvidia); `/run/nvidia/driver` for a containerized driver.
    #[arg(long, env = "TESSERA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,

    /// Root below which the NVIDIA device nodes (`dev/nvidia*`) are; default:
    /// the driver root.
    #[arg(long, env = "TESSERA_DEV_ROOT")]
    pub dev_root: Option<PathBuf>,

    /// Node policy file (YAML, kind NodePolicy); must be the publisher's.
    #[arg(long, env = "TESSERA_POLICY")]
    pub policy: Option<PathBuf>,

    /// Kubeconfig file; without it the usual places (KUBECONFIG,
    /// ~/.kube/config, the in-cluster service account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,

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

    /// XIDs that are only logged (application errors), comma-separated;
    /// replaces the default list. The fatal XIDs (48, 63, 64, 74, 79, 92,
    /// 94, 95, 119, 120) make a GPU Unhealthy whatever this says.
    #[arg(
        long,
        env = "TESSERA_BENIGN_XIDS",
        value_delimiter = ',',
        default_values_t = health::DEFAULT_BENIGN_XIDS.to_vec()
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

    /// Unix socket this process answers its probes on (`tessera health
    /// --socket`), bound before waiting for the state lock: in a directory
    /// of this pod alone (an emptyDir), never one another instance shares.
    #[arg(long, env = "TESSERA_HEALTH_SOCKET")]
    pub health_socket: Option<PathBuf>,
}

/// Builds a client from `--kubeconfig` or the usual places (see
/// [`http2_client`]). Callers bound each request's wait themselves.
pub async fn client(
    kubeconfig: Option<&Path>,
    connect_timeout: Duration,
) -> anyhow::Result<Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context(
            "no kubeconfig given and none found (KUBECONFIG, ~/.kube/config, in-cluster)",
        )?,
    };
    config.connect_timeout = Some(connect_timeout);
    http2_client(config).context("building the Kubernetes client")
}

/// How often an idle HTTP/2 connection is pinged, and how long the answer
/// may take before the connection (and every request on it) fails.
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);

/// A client that multiplexes every request and watch over one HTTP/2
/// connection, as Go clients do. Over HTTP/1.1 (kube's own client) each
/// request in flight needs a connection of its own, and idle ones are
/// closed by the API server after 90 s: a burst of prepares after a quiet
/// spell paid a TLS handshake each. Here the watches keep the connection
/// in use, and pings find a dead one (instead of per-read timeouts, which
/// would cut long watches).
fn http2_client(config: kube::Config) -> anyhow::Result<Client> {
    use kube::client::ConfigExt;

    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    // HTTP/2 writes a request as several small frames: without NODELAY the
    // kernel holds the last one until the server's delayed ACK (40 ms).
    http.set_nodelay(true);
    http.set_connect_timeout(config.connect_timeout);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    let https = match &config.tls_server_name {
        Some(name) => https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
            name.clone()
                .try_into()
                .with_context(|| format!("tls-server-name {name:?}"))?,
        )),
        None => https,
    };
    let https = https.enable_http1().enable_http2().wrap_connector(http);
    let connections =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .http2_keep_alive_interval(PING_INTERVAL)
            .http2_keep_alive_timeout(PING_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .build(https);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(connections);
    Ok(Client::new(service, config.default_namespace))
}

/// The node process, started: the kubelet plugin and the publisher.
pub struct NodeProcess {
    pub plugin: Plugin,
    publisher: tokio::task::JoinHandle<()>,
    stop_publisher: tokio::sync::oneshot::Sender<()>,
    /// Held until the process ends.
    _state_lock: StateLock,
}

impl NodeProcess {
    /// Serves until `shutdown`, then stops publishing (the slices stay: the
    /// next instance finds them up to date and writes nothing).
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        let served = self.plugin.run(shutdown).await;
        let _ = self.stop_publisher.send(());
        let _ = self.publisher.await;
        served
    }
}

/// Sets up everything and returns the node process, ready to run.
pub async fn start(nvml_library: &OsStr, args: &PluginArgs) -> anyhow::Result<NodeProcess> {
    let timeout = Duration::from_secs(args.api_timeout_seconds.max(1));
    // One client: its connection stays in use by the watches, so prepares
    // never wait for a new one.
    let client = client(args.kubeconfig.as_deref(), timeout).await?;
    let watching = client.clone();
    let driver =
        DriverName::new(&args.driver_name).map_err(|e| anyhow::anyhow!("--driver-name: {e}"))?;
    let policy = match &args.policy {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading node policy {}", path.display()))?;
            NodePolicy::from_yaml(&text)
                .map_err(|e| anyhow::anyhow!("node policy {}: {e}", path.display()))?
        }
        None => NodePolicy::default(),
    };

    // Probes ask this process alone, from now on (standby included).
    let readiness = Arc::new(Readiness::default());
    if let Some(socket) = &args.health_socket {
        readiness::serve(socket, readiness.clone()).await?;
    }

    // Nothing of the node's state is read or touched before this.
    let (state_lock, checked_nvml) =
        take_state_lock(nvml_library, args, &client, timeout, &readiness).await?;
    let catalog = Arc::new(DeviceCatalog::awaiting_model());
    readiness.set(Phase::Active(catalog.clone()));

    // After the lock: during a rolling update the old instance holds the
    // port until it exits. A port that cannot be bound costs the metrics,
    // never the kubelet plugin.
    let metrics = match crate::metrics::server::parse_address(&args.metrics_address)? {
        Some(address) => {
            let metrics = Arc::new(crate::metrics::Metrics::new());
            match crate::metrics::server::serve(address, metrics.clone()).await {
                Ok(_) => Some(metrics),
                Err(e) => {
                    tracing::error!("{e:#}; serving no metrics");
                    None
                }
            }
        }
        None => None,
    };

    let nvml = match checked_nvml {
        Some(nvml) => nvml,
        None => Arc::new(discovery::init(Some(nvml_library))?),
    };

    // Device health: XID events of every GPU, from now on.
    let health = Arc::new(HealthTracker::new(
        XidPolicy::new(args.benign_xids.iter().copied()),
        (args.xid_recovery_seconds > 0).then(|| Duration::from_secs(args.xid_recovery_seconds)),
    ));
    health::spawn_monitor(nvml.clone(), health.clone()).context("starting the XID monitor")?;

    let dev_root = args
        .dev_root
        .clone()
        .unwrap_or_else(|| args.driver_root.clone());
    let driver_files = discover_driver_files(&args.driver_root);
    if driver_files.is_empty() {
        warn!(
            "no NVIDIA driver libraries or tools found below {}; containers get device nodes only \
             (set --driver-root to the driver installation)",
            args.driver_root.display()
        );
    }
    let config = PrepareConfig {
        driver: args.driver_name.clone(),
        node: args.node_name.clone(),
        cdi_dir: args.cdi_dir.clone(),
        state_dir: args.state_dir.clone(),
        boot_id_file: args.boot_id_file.clone(),
        layout: Layout {
            driver_root: args.driver_root.clone(),
            dev_root,
            driver_files,
            hami_core_dir: args.hami_core_dir.clone(),
        },
    };
    let mut mps_config = MpsConfig::new(&args.driver_root, args.mps_dir.clone());
    mps_config.shm = ShmPolicy::from(&policy.mps);
    mps_config.dev_root = config.layout.dev_root.clone();
    if let (Some(fs), Some(name)) = (&args.mps_cgroup_fs, &args.mps_cgroup) {
        let cgroup = Arc::new(HostCgroup::open(fs, name).context("--mps-cgroup")?);
        cgroup.check().context("--mps-cgroup")?;
        info!(
            "MPS daemons run in the host cgroup {} (they outlive this process)",
            cgroup.dirs()[0].display()
        );
        mps_config.host_cgroup = Some(cgroup);
    }
    let mps = Arc::new(MpsSupervisor::new(mps_config));
    let (poke, pokes) = std::sync::mpsc::channel::<NodeChange>();
    // Health changes reach the slices (taints) through the observer, and
    // the Node's events.
    // One recorder: repeats count together whoever reports them.
    let node_events = NodeEvents::new(
        client.clone(),
        args.node_name.clone(),
        format!("{}-plugin", args.driver_name),
    );
    let health_poke = poke.clone();
    health::spawn_follower(
        health.clone(),
        Some(node_events.clone()),
        catalog.clone(),
        tessera_controller::model::taints::unhealthy_key(&driver),
        move || {
            let _ = health_poke.send(NodeChange::Records);
        },
    );
    // Profiles come from the first look at the GPUs, taken after recovery
    // (which destroys MIG devices but never creates one).
    let mig = Arc::new(NvmlMig::new(nvml.clone(), &Inventory::default()));
    let deps = Dependencies {
        claims: Arc::new(ApiClaims::new(client.clone(), timeout)),
        catalog: catalog.clone(),
        mps: mps.clone(),
        time_slice: Arc::new(NvidiaSmiTimeSlice::new(&args.driver_root)),
        mig: mig.clone(),
        status: args.device_status.then(|| {
            StatusWriter::new(
                client.clone(),
                args.driver_name.clone(),
                &args.state_dir,
                Some(node_events.clone()),
            )
        }),
        events: Some(node_events.clone()),
        on_change: Some(Arc::new(move |change| {
            let _ = poke.send(change);
        })),
    };
    let (preparer, recovery) = Preparer::open(config, deps).await?;
    info!(
        rolled_back = recovery.rolled_back.len(),
        unprepared = recovery.unprepared.len(),
        specs_restored = recovery.specs_restored.len(),
        orphans_removed = recovery.orphans_removed.len(),
        "start-up recovery done"
    );
    if let Some(metrics) = &metrics {
        preparer.observe(metrics.clone());
    }
    supervise_mps(&mps, &preparer, metrics.clone());
    crate::guard::ClaimGuard {
        policy: policy.claim_guard,
        nvml: nvml.clone(),
        preparer: preparer.clone(),
        consumers: crate::metrics::claims::Consumers::spawn(Arc::new(ApiClaims::new(
            client.clone(),
            timeout,
        ))),
        events: Some(node_events),
        metrics: metrics.clone(),
    }
    .spawn();

    // Publish: the observer reads the node, the publisher turns each view
    // into slices, and every model it builds is the catalog.
    let observer_nvml = nvml.clone();
    // Looked at after recovery, which may have destroyed MIG devices.
    let observer = Arc::new(Observer::new(nvml, preparer.clone()).with_health(health.clone()));
    let first_view = {
        let observer = observer.clone();
        tokio::task::spawn_blocking(move || observer.observe(None)).await??
    };
    mig.set_inventory(&first_view.inventory);
    let (views, view) = watch::channel(first_view);
    let sampled_view = view.clone();
    Observer::spawn(
        observer,
        views,
        pokes,
        Duration::from_secs(args.rediscover_seconds.max(1)),
    );
    let truth = {
        let preparer = preparer.clone();
        NodeTruth::new(catalog.clone(), &args.state_dir, move |managed| {
            // A crash may have left a GPU in MIG mode that no claim holds.
            let preparer = preparer.clone();
            tokio::task::spawn_blocking(move || {
                preparer.settle_mig_modes(managed.iter().map(String::as_str))
            });
        })
    };
    let mut publisher_config = PublisherConfig::new(&args.node_name, driver, policy);
    publisher_config.min_full_model = args.full_model_min_version;
    publisher_config.capabilities = args.capabilities.capabilities();
    let truth = match &metrics {
        Some(metrics) => truth.with_metrics(metrics.clone()),
        None => truth,
    };
    let publisher = Publisher::new(watching, publisher_config).with_node_state(Arc::new(truth));
    if let Some(metrics) = &metrics {
        metrics.set_sampler(crate::metrics::Sampler {
            preparer: preparer.clone(),
            view: sampled_view,
            nvml: observer_nvml,
            mps: mps.clone(),
            publisher: publisher.counters(),
            health: health.clone(),
            catalog: catalog.clone(),
            consumers: crate::metrics::claims::Consumers::spawn(Arc::new(ApiClaims::new(
                client.clone(),
                timeout,
            ))),
            sampled_at: Default::default(),
        });
    }
    let (stop_publisher, stopped) = tokio::sync::oneshot::channel::<()>();
    info!("publishing ResourceSlices for node {}", args.node_name);
    let publisher = tokio::spawn(publisher.run(view, async move {
        let _ = stopped.await;
    }));

    Ok(NodeProcess {
        plugin: Plugin::new(
            PluginConfig {
                driver_name: args.driver_name.clone(),
                registry_dir: args.kubelet_registry_dir.clone(),
                plugins_dir: args.kubelet_plugins_dir.clone(),
                instance: sockets::instance_id(),
            },
            preparer,
        )
        .with_health(HealthService::new(args.node_name.clone(), catalog, health)),
        publisher,
        stop_publisher,
        _state_lock: state_lock,
    })
}

/// How often a standby runs its pre-flight checks again, and how often it
/// tries the state lock.
const PREFLIGHT_PERIOD: Duration = Duration::from_secs(10);
const LOCK_POLL: Duration = Duration::from_millis(200);

/// Takes the state lock. While another process holds it (a rolling
/// update), this one is on standby: pre-flight checks say whether it could
/// take over (its probes answer so) while it tries the lock until the other
/// exits. Returns the NVML handle the checks loaded, if they did.
async fn take_state_lock(
    nvml_library: &OsStr,
    args: &PluginArgs,
    client: &Client,
    timeout: Duration,
    readiness: &Arc<Readiness>,
) -> anyhow::Result<(StateLock, Option<Arc<nvml_wrapper::Nvml>>)> {
    let dir = &args.state_dir;
    let locking = || format!("locking the state directory {}", dir.display());
    if let Some(lock) = StateLock::try_acquire(dir).with_context(locking)? {
        return Ok((lock, None));
    }
    info!(
        "another Tessera process holds {}; waiting for it to exit (rolling update); standby until then",
        dir.join(crate::node::state_lock::LOCK_FILE).display()
    );
    let nvml = Arc::new(std::sync::OnceLock::new());
    // Checks run beside the lock polls: a slow check never delays taking over.
    let checking = tokio::spawn(readiness::standby(
        nvml_library.to_owned(),
        nvml.clone(),
        client.clone(),
        timeout,
        readiness.clone(),
        PREFLIGHT_PERIOD,
        readiness::Takeover {
            state_dir: args.state_dir.clone(),
            boot_id_file: args.boot_id_file.clone(),
            mps_cgroup: args.mps_cgroup_fs.clone().zip(args.mps_cgroup.clone()),
        },
    ));
    let lock = loop {
        match StateLock::try_acquire(dir).with_context(locking) {
            Ok(Some(lock)) => break Ok(lock),
            Ok(None) => tokio::time::sleep(LOCK_POLL).await,
            Err(e) => break Err(e),
        }
    };
    checking.abort();
    // Gone for good: it never changes the readiness after this.
    let _ = checking.await;
    let lock = lock?;
    info!("took over the state lock");
    Ok((lock, nvml.get().cloned()))
}

/// Bring the MPS daemons in line with the checkpoint (claims that were
/// unprepared while the plugin was down release theirs; daemons of prepared
/// claims that died are restarted), then keep them alive. Only the marking
/// happens here: the stops, adoptions and restarts run in the watchdog's
/// first pass, in parallel and in the background, so hung daemons never
/// delay serving.
fn supervise_mps(
    mps: &Arc<MpsSupervisor>,
    preparer: &Preparer,
    metrics: Option<Arc<crate::metrics::Metrics>>,
) {
    let prepared: std::collections::BTreeSet<_> =
        preparer.entries().into_iter().map(|(uid, _)| uid).collect();
    // A claim whose record was lost keeps its daemons: its Pod may run.
    let lost = preparer.lost_claims();
    log_supervision(&mps.release_claims_unless(|uid| prepared.contains(uid) || lost.may_hold(uid)));
    let watchdog = mps.spawn_watchdog(MPS_WATCHDOG_PERIOD, move |report| {
        if let Some(metrics) = &metrics {
            metrics.mps_restarted(report.restarted.len());
        }
        log_supervision(report)
    });
    // The watchdog stops when its handle drops: keep it for the life of the
    // runtime.
    tokio::spawn(async move {
        let _watchdog = watchdog;
        std::future::pending::<()>().await
    });
}

const MPS_WATCHDOG_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);

fn log_supervision(report: &SupervisionReport) {
    for key in &report.adopted {
        info!(daemon = %key, "adopted a running MPS control daemon");
    }
    for key in &report.restarted {
        warn!(daemon = %key, "MPS control daemon was not running; restarted it in a fresh pipe directory (containers started from now on reach it)");
    }
    for key in &report.stopped {
        info!(daemon = %key, "stopped the MPS control daemon of a claim no longer prepared");
    }
    for (daemon, error) in &report.failed {
        warn!(daemon = %daemon, "MPS control daemon needs attention: {error}");
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn termination() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        warn!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM"),
        _ = int.recv() => info!("SIGINT"),
    }
}

/// Async workers of the node process. Its async work is waiting on the API
/// server and the kubelet; a thread per core (hundreds on a GPU node) would
/// only add stacks and allocator arenas.
const RUNTIME_WORKERS: usize = 2;
/// Threads for blocking work (files, NVML, MIG, MPS): prepares beyond this
/// many at once queue for a thread, as they would queue for the hardware
/// lock anyway, instead of each growing the process by a thread.
const BLOCKING_THREADS: usize = 16;

/// `tessera plugin`.
pub fn main(nvml_library: &OsStr, args: &PluginArgs) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    super::heap::limit_arenas();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_WORKERS)
        .max_blocking_threads(BLOCKING_THREADS)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        tokio::spawn(super::heap::scavenge(super::heap::SCAVENGE_PERIOD));
        let node = start(nvml_library, args).await?;
        node.run(termination()).await
    })
}
