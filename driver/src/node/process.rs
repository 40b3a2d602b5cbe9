//! The node process started in named steps: each takes what the earlier
//! ones made and nothing else, so the order below is the order of
//! dependencies (and of the log).
//!
//! connect -> serve probes -> take the state lock (standby until then) ->
//! serve metrics -> open NVML -> watch device health -> host adapters ->
//! open the prepare engine (recovery) -> supervise MPS -> claim guard ->
//! publish slices -> the kubelet plugin.

use std::ffi::OsStr;
use std::sync::Arc;

use kube::Client;
use nvml_wrapper::Nvml;
use tessera_api::inventory::Inventory;
use tessera_controller::publisher::{NodeView, Publisher, PublisherConfig};
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::config::{NodeConfig, SecureMetrics};
use super::readiness::{self, Phase, ProbeSocketError, Readiness};
use super::standby::{self, LockError};
use super::state_lock::StateLock;
use super::{heap, mps_watch};
use crate::apiserver::{self, ClientError};
use crate::discovery;
use crate::guard::ClaimGuard;
use crate::health::{self, HealthTracker, XidPolicy};
use crate::host::driver_root::{Layout, discover_driver_files};
use crate::host::mig::NvmlMig;
use crate::host::mps::{HostCgroup, HostCgroupError, MpsConfig, MpsSupervisor, ShmPolicy};
use crate::host::time_slice::NvidiaSmiTimeSlice;
use crate::kubelet::health::HealthService;
use crate::kubelet::{Plugin, PluginConfig, ServeError, sockets};
use crate::metrics::Metrics;
use crate::metrics::claims::Consumers;
use crate::metrics::server::BindError;
use crate::prepare::claims::ApiClaims;
use crate::prepare::status::StatusWriter;
use crate::prepare::{Dependencies, NodeChange, PrepareConfig, Preparer, SetupError};
use crate::publish::{NodeTruth, Observer, Poke, Pokes};
use crate::state::catalog::DeviceCatalog;
use crate::state::events::NodeEvents;
use crate::tls::{TlsError, with_causes};

/// Why the node process could not start; each names the step.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    ApiServer(#[from] ClientError),
    #[error(transparent)]
    Probes(#[from] ProbeSocketError),
    #[error(transparent)]
    StateLock(#[from] LockError),
    #[error("loading NVML: {0}")]
    Nvml(#[source] discovery::Error),
    #[error("starting the XID monitor: {0}")]
    XidMonitor(#[source] std::io::Error),
    #[error("--mps-cgroup: {0}")]
    MpsCgroup(#[from] HostCgroupError),
    #[error(transparent)]
    Recovery(#[from] SetupError),
    #[error("starting the claim status ledger's thread: {0}")]
    StatusLedger(#[source] std::io::Error),
    #[error("the first look at the GPUs: {0}")]
    FirstLook(#[source] discovery::Error),
    #[error("the first look at the GPUs did not finish: {0}")]
    FirstLookPanicked(#[from] tokio::task::JoinError),
}

/// Why the authenticated metrics endpoint is not served.
#[derive(Debug, thiserror::Error)]
enum SecureMetricsError {
    #[error("--metrics-tls-cert-file, --metrics-tls-private-key-file")]
    Certificate(#[source] TlsError),
    #[error(transparent)]
    SelfSigned(TlsError),
    #[error(transparent)]
    Bind(#[from] BindError),
}

/// The node process, started: the kubelet plugin and the publisher.
pub struct NodeProcess {
    pub plugin: Plugin,
    publisher: tokio::task::JoinHandle<()>,
    stop_publisher: tokio::sync::oneshot::Sender<()>,
    /// What the unprepares left to do after their answers is done before
    /// the process ends.
    preparer: Arc<Preparer>,
    /// Held until the process ends.
    _state_lock: StateLock,
}

impl NodeProcess {
    /// Serves until `shutdown`, then stops publishing (the slices stay: the
    /// next instance finds them up to date and writes nothing).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServeError> {
        let served = self.plugin.run(shutdown).await;
        self.preparer.remove_unprepared_files().await;
        let _ = self.stop_publisher.send(());
        let _ = self.publisher.await;
        served
    }
}

/// What every step after the state lock shares.
struct Node<'a> {
    config: &'a NodeConfig,
    readiness: Arc<Readiness>,
    client: Client,
    catalog: Arc<DeviceCatalog>,
    metrics: Option<Arc<Metrics>>,
    nvml: Arc<Nvml>,
    health: Arc<HealthTracker>,
    events: NodeEvents,
}

/// The host adapters the prepare engine drives the node through.
struct HostAdapters {
    layout: Layout,
    mps: Arc<MpsSupervisor>,
    mig: Arc<NvmlMig>,
}

/// Sets up everything and returns the node process, ready to run.
pub async fn start(nvml_library: &OsStr, config: &NodeConfig) -> Result<NodeProcess, StartError> {
    // One client: its connection stays in use by the watches, so prepares
    // never wait for a new one.
    let client = apiserver::client(config.kubeconfig.as_deref(), config.api_timeout).await?;
    let readiness = serve_probes(config).await?;
    // Nothing of the node's state is read or touched before this.
    let (state_lock, checked_nvml) =
        standby::take_state_lock(nvml_library, config, &client, &readiness).await?;
    let catalog = Arc::new(DeviceCatalog::awaiting_model());
    readiness.set(Phase::Active(catalog.clone()));
    let metrics = serve_metrics(config, &client, &readiness).await;
    let nvml = match checked_nvml {
        Some(nvml) => nvml,
        None => Arc::new(discovery::init(Some(nvml_library)).map_err(StartError::Nvml)?),
    };
    let health = watch_health(config, &nvml)?;
    let events = NodeEvents::new(
        client.clone(),
        config.node_name.clone(),
        format!("{}-plugin", config.driver.as_str()),
    );
    let node = Node {
        config,
        readiness,
        client,
        catalog,
        metrics,
        nvml,
        health,
        events,
    };
    let host = host_adapters(&node)?;
    let (poke, pokes) = crate::publish::pokes();
    follow_health(&node, poke.clone());
    let preparer = open_preparer(&node, &host, poke).await?;
    make_ahead_on_request(&node, &preparer);
    mps_watch::supervise(&host.mps, &preparer, node.metrics.clone());
    spawn_guard(&node, &preparer);
    let (publisher, stop_publisher) = start_publishing(&node, &host, &preparer, pokes).await?;
    Ok(NodeProcess {
        plugin: kubelet_plugin(&node, preparer.clone()),
        publisher,
        stop_publisher,
        preparer,
        _state_lock: state_lock,
    })
}

/// Probes ask this process alone, from now on (standby included).
async fn serve_probes(config: &NodeConfig) -> Result<Arc<Readiness>, ProbeSocketError> {
    let readiness = Arc::new(Readiness::default());
    if let Some(socket) = &config.health_socket {
        readiness::serve(socket, readiness.clone()).await?;
    }
    Ok(readiness)
}

/// After the lock: during a rolling update the old instance holds the ports
/// until it exits. A port that cannot be bound costs the metrics there,
/// never the kubelet plugin.
async fn serve_metrics(
    config: &NodeConfig,
    client: &Client,
    readiness: &Readiness,
) -> Option<Arc<Metrics>> {
    if config.metrics_address.is_none() && config.secure_metrics.is_none() {
        return None;
    }
    let metrics = Arc::new(Metrics::new());
    let mut served = false;
    if let Some(address) = config.metrics_address {
        match crate::metrics::server::serve(address, metrics.clone()).await {
            Ok(bound) => {
                readiness.set_metrics_address(bound);
                served = true;
            }
            Err(e) => error!("{e}; serving no plain metrics"),
        }
    }
    if let Some(secure) = &config.secure_metrics {
        match serve_secure_metrics(secure, config, client, metrics.clone()).await {
            Ok(bound) => {
                readiness.set_secure_metrics_address(bound);
                served = true;
            }
            Err(e) => error!("{}; serving no authenticated metrics", with_causes(&e)),
        }
    }
    served.then_some(metrics)
}

/// The authenticated endpoint: its certificate (given, or self-signed for
/// the node's name and the address bound), each request reviewed.
async fn serve_secure_metrics(
    secure: &SecureMetrics,
    config: &NodeConfig,
    client: &Client,
    metrics: Arc<Metrics>,
) -> Result<std::net::SocketAddr, SecureMetricsError> {
    let tls = match &secure.certificate {
        Some(files) => crate::tls::load_tls(&files.cert, &files.key)
            .map_err(SecureMetricsError::Certificate)?,
        None => {
            let mut names = vec![config.node_name.clone(), "localhost".to_owned()];
            if !secure.address.ip().is_unspecified() {
                names.push(secure.address.ip().to_string());
            }
            crate::tls::self_signed_tls(names).map_err(SecureMetricsError::SelfSigned)?
        }
    };
    let guard = crate::metrics::server::Guard {
        tls,
        access: Arc::new(crate::metrics::access::Access::new(client.clone())),
    };
    Ok(crate::metrics::server::serve_guarded(secure.address, metrics, guard).await?)
}

/// Where binding conditions are on: the claims the binder lists for this
/// node are made before their pods bind.
fn make_ahead_on_request(node: &Node, preparer: &Arc<Preparer>) {
    let Some(namespace) = node.config.binding_namespace.clone() else {
        return;
    };
    if !node.config.optional.binding_conditions {
        return;
    }
    let config = crate::binding::BindingConfig {
        namespace,
        driver: node.config.driver.as_str().to_owned(),
        node: node.config.node_name.clone(),
    };
    crate::binding::spawn(node.client.clone(), config, preparer.clone());
}

/// Device health: XID events of every GPU, from now on.
fn watch_health(config: &NodeConfig, nvml: &Arc<Nvml>) -> Result<Arc<HealthTracker>, StartError> {
    let health = Arc::new(HealthTracker::new(
        XidPolicy::new(config.benign_xids.iter().copied()),
        config.xid_recovery,
    ));
    health::spawn_monitor(nvml.clone(), health.clone()).map_err(StartError::XidMonitor)?;
    Ok(health)
}

/// Health changes reach the slices (taints) through the observer, and the
/// Node's events. One recorder: repeats count together whoever reports them.
fn follow_health(node: &Node, poke: Poke) {
    health::spawn_follower(
        node.health.clone(),
        Some(node.events.clone()),
        node.catalog.clone(),
        tessera_controller::model::taints::unhealthy_key(&node.config.driver),
        move || {
            let _ = poke.send(NodeChange::Records);
        },
    );
}

/// The driver's files, the MPS supervisor and the MIG manager.
fn host_adapters(node: &Node) -> Result<HostAdapters, StartError> {
    let config = node.config;
    let root = &config.driver_root.root;
    let driver_files = discover_driver_files(root);
    if driver_files.is_empty() {
        warn!(
            "no NVIDIA driver libraries or tools found below {}; containers get device nodes only \
             (set --driver-root to the driver installation)",
            root.display()
        );
    }
    let layout = Layout {
        driver_root: root.clone(),
        dev_root: config.driver_root.dev_root.clone(),
        driver_files,
        hami_core_dir: config.hami_core_dir.clone(),
    };
    let mut mps_config = MpsConfig::new(root, config.mps_dir.clone());
    mps_config.shm = ShmPolicy::from(&config.policy.mps);
    mps_config.confirm_defaults = config.policy.mps.confirm_defaults;
    mps_config.dev_root = layout.dev_root.clone();
    if let Some(place) = &config.mps_cgroup {
        let cgroup = Arc::new(HostCgroup::open(&place.fs, &place.name)?);
        cgroup.check()?;
        info!(
            "MPS daemons run in the host cgroup {} (they outlive this process)",
            cgroup.dirs()[0].display()
        );
        mps_config.host_cgroup = Some(cgroup);
    }
    // Profiles come from the first look at the GPUs, taken after recovery
    // (which destroys MIG devices but never creates one).
    let mig = Arc::new(NvmlMig::new(node.nvml.clone(), &Inventory::default()));
    Ok(HostAdapters {
        layout,
        mps: Arc::new(MpsSupervisor::new(mps_config)),
        mig,
    })
}

/// The prepare engine, after start-up recovery.
async fn open_preparer(
    node: &Node<'_>,
    host: &HostAdapters,
    poke: Poke,
) -> Result<Arc<Preparer>, StartError> {
    let config = node.config;
    let prepare = PrepareConfig {
        driver: config.driver.as_str().to_owned(),
        node: config.node_name.clone(),
        cdi_dir: config.cdi_dir.clone(),
        state_dir: config.state_dir.clone(),
        boot_id_file: config.boot_id_file.clone(),
        layout: host.layout.clone(),
    };
    let deps = Dependencies {
        claims: Arc::new(ApiClaims::new(node.client.clone(), config.api_timeout)),
        catalog: node.catalog.clone(),
        mps: host.mps.clone(),
        time_slice: Arc::new(NvidiaSmiTimeSlice::new(&config.driver_root.root)),
        mig: host.mig.clone(),
        status: match config.device_status {
            true => Some(
                StatusWriter::new(
                    node.client.clone(),
                    config.driver.as_str().to_owned(),
                    &config.state_dir,
                    Some(node.events.clone()),
                )
                .map_err(StartError::StatusLedger)?,
            ),
            false => None,
        },
        events: Some(node.events.clone()),
        on_change: Some(Arc::new(move |change| {
            let _ = poke.send(change);
        })),
    };
    let (preparer, recovery) = Preparer::open(prepare, deps).await?;
    info!(
        rolled_back = recovery.rolled_back.len(),
        unprepared = recovery.unprepared.len(),
        specs_restored = recovery.specs_restored.len(),
        orphans_removed = recovery.orphans_removed.len(),
        "start-up recovery done"
    );
    if let Some(metrics) = &node.metrics {
        preparer.observe(metrics.clone());
    }
    Ok(preparer)
}

/// Who uses each prepared claim, from the API server.
fn consumers(node: &Node) -> Arc<Consumers> {
    Consumers::spawn(Arc::new(ApiClaims::new(
        node.client.clone(),
        node.config.api_timeout,
    )))
}

fn spawn_guard(node: &Node, preparer: &Arc<Preparer>) {
    ClaimGuard {
        policy: node.config.policy.claim_guard,
        nvml: node.nvml.clone(),
        preparer: preparer.clone(),
        consumers: consumers(node),
        events: Some(node.events.clone()),
        metrics: node.metrics.clone(),
    }
    .spawn();
}

/// Publish: the observer reads the node, the publisher turns each view into
/// slices, and every model it builds is the catalog.
async fn start_publishing(
    node: &Node<'_>,
    host: &HostAdapters,
    preparer: &Arc<Preparer>,
    pokes: Pokes,
) -> Result<
    (
        tokio::task::JoinHandle<()>,
        tokio::sync::oneshot::Sender<()>,
    ),
    StartError,
> {
    let config = node.config;
    // Looked at after recovery, which may have destroyed MIG devices.
    let observer = Arc::new(
        Observer::new(node.nvml.clone(), preparer.clone()).with_health(node.health.clone()),
    );
    let first_view = {
        let observer = observer.clone();
        tokio::task::spawn_blocking(move || observer.observe(None))
            .await?
            .map_err(StartError::FirstLook)?
    };
    host.mig.set_inventory(&first_view.inventory);
    let (views, view) = watch::channel(first_view);
    Observer::spawn(observer, views, pokes, config.rediscover);
    let mut publisher_config = PublisherConfig::new(
        &config.node_name,
        config.driver.clone(),
        config.policy.clone(),
    );
    publisher_config.min_full_model = config.full_model_min_version;
    publisher_config.capabilities = config.capabilities;
    publisher_config.optional = config.optional;
    let publisher = Publisher::new(node.client.clone(), publisher_config)
        .with_node_state(Arc::new(node_truth(node, preparer)));
    sample_metrics(node, host, preparer, &publisher, view.clone());
    let (stop_publisher, stopped) = tokio::sync::oneshot::channel::<()>();
    info!("publishing ResourceSlices for node {}", config.node_name);
    let publisher = tokio::spawn(publisher.run(view, async move {
        let _ = stopped.await;
    }));
    Ok((publisher, stop_publisher))
}

/// What the publisher learns from the node and gives back (the catalog).
fn node_truth(node: &Node, preparer: &Arc<Preparer>) -> NodeTruth {
    let settling = preparer.clone();
    let truth = NodeTruth::new(
        node.catalog.clone(),
        &node.config.state_dir,
        move |managed| {
            // A crash may have left a GPU in MIG mode that no claim holds.
            let preparer = settling.clone();
            tokio::task::spawn_blocking(move || {
                preparer.settle_mig_modes(managed.iter().map(String::as_str))
            });
        },
    );
    let readiness = node.readiness.clone();
    let truth = truth.on_published(move |generation| readiness.set_published(generation));
    match &node.metrics {
        Some(metrics) => truth.with_metrics(metrics.clone()),
        None => truth,
    }
}

/// What each scrape samples, when metrics are served.
fn sample_metrics(
    node: &Node,
    host: &HostAdapters,
    preparer: &Arc<Preparer>,
    publisher: &Publisher,
    view: watch::Receiver<NodeView>,
) {
    let Some(metrics) = &node.metrics else {
        return;
    };
    metrics.set_sampler(crate::metrics::Sampler {
        preparer: preparer.clone(),
        view,
        nvml: node.nvml.clone(),
        mps_daemons: {
            let mps = host.mps.clone();
            Box::new(move || mps.supervised())
        },
        publisher: publisher.counters(),
        health: node.health.clone(),
        catalog: node.catalog.clone(),
        consumers: consumers(node),
        sampled_at: Default::default(),
    });
}

/// The kubelet's servers over the prepare engine, with device health.
fn kubelet_plugin(node: &Node, preparer: Arc<Preparer>) -> Plugin {
    let config = node.config;
    Plugin::new(
        PluginConfig {
            driver_name: config.driver.as_str().to_owned(),
            registry_dir: config.kubelet.registry_dir.clone(),
            plugins_dir: config.kubelet.plugins_dir.clone(),
            instance: sockets::instance_id(),
        },
        preparer,
    )
    .with_health(HealthService::new(
        config.node_name.clone(),
        node.catalog.clone(),
        node.health.clone(),
    ))
    .on_registration({
        let readiness = node.readiness.clone();
        Arc::new(move |registered| readiness.set_registered(registered))
    })
}

/// Async workers of the node process. Its async work is waiting on the API
/// server and the kubelet; a thread per core (hundreds on a GPU node) would
/// only add stacks and allocator arenas.
const RUNTIME_WORKERS: usize = 2;
/// Threads for blocking work (files, NVML, MIG, MPS): prepares beyond this
/// many at once queue for a thread, as they would queue for the hardware
/// lock anyway, instead of each growing the process by a thread.
const BLOCKING_THREADS: usize = 16;

/// Why the node process stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("starting the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Serve(#[from] ServeError),
}

/// Runs the node process on a runtime of its own until `shutdown`.
pub fn run<F: Future<Output = ()> + Send>(
    nvml_library: &OsStr,
    config: &NodeConfig,
    shutdown: impl FnOnce() -> F,
) -> Result<(), RunError> {
    heap::limit_arenas();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_WORKERS)
        .max_blocking_threads(BLOCKING_THREADS)
        .enable_all()
        .build()
        .map_err(RunError::Runtime)?;
    runtime.block_on(async {
        tokio::spawn(heap::scavenge(heap::SCAVENGE_PERIOD));
        let node = start(nvml_library, config).await?;
        Ok(node.run(shutdown()).await?)
    })
}
