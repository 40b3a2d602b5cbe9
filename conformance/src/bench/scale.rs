//! The cluster-scale benchmark (docs/benchmarks.md, "Cluster scale"): many
//! simulated GPU nodes on one real control plane with nodes that have no
//! kubelet (`cluster.sh add-nodes`).
//!
//! * [`publish`]: one `tessera publish` process per node, all started at
//!   once, each over its own simulated machine (the fake NVML with its own
//!   state file); a watch on the driver's ResourceSlices times when each
//!   node's pool is complete; the API server's request counters say what
//!   the publishers asked for, per node; `/proc` says how much memory each
//!   holds.
//! * [`apply_replicas`]: the same GPUs published the way a driver without
//!   partitionable devices and consumable capacity does it: N plain devices
//!   per GPU (replicas), no counters, under a driver name of its own.
//! * [`schedule`]: pods with one claim each, created at once, bound by the
//!   real kube-scheduler (nothing runs them: the nodes have no kubelet); a
//!   watch times each pod's binding, the scheduler's own metrics say where
//!   its time went.
//!
//! Numbers are reported, never asserted.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::cluster::{apiserver_metrics, claim_watch_events, claim_watchers, slice_writes};
use super::grpc::rss_kib;
use super::stats::{Histogram, parse_histogram, quantile, sum_counter};
use super::stats::{requests_delta, requests_of, round2};
use crate::cluster::{TestCluster, TestNamespace, wait_for};

/// Field manager of the replica slices this benchmark writes.
const FIELD_MANAGER: &str = "tessera-bench";

/// The fake nodes of the cluster (`cluster.sh add-nodes`), by name, at most
/// `count` of them; fails when there are fewer.
pub async fn fake_nodes(client: &Client, count: usize) -> Result<Vec<String>> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut names: Vec<String> = nodes
        .list_metadata(&ListParams::default().labels("tessera.dev/fake-node=true"))
        .await?
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    // tessera-fake-2 before tessera-fake-10.
    names.sort_by_key(|n| {
        let digits = n.trim_start_matches(|c: char| !c.is_ascii_digit());
        (digits.parse::<u64>().unwrap_or(u64::MAX), n.clone())
    });
    ensure!(
        names.len() >= count,
        "{count} fake nodes wanted, the cluster has {} (cluster.sh add-nodes N)",
        names.len()
    );
    names.truncate(count);
    Ok(names)
}

// ------------------------------------------------------------ requests ----

/// What a publisher asks the API server about, as `apiserver_request_total`
/// names it: (resource, subresource). Discovery is `("", "api")` and
/// `("", "apis")`.
const PUBLISHER_RESOURCES: [(&str, &str); 5] = [
    ("resourceslices", ""),
    ("resourceclaims", ""),
    ("nodes", ""),
    ("", "api"),
    ("", "apis"),
];

/// Requests the API server counted, by `"<VERB> <resource>"` (dry runs
/// apart), for [`PUBLISHER_RESOURCES`].
pub fn publisher_requests(metrics: &str) -> BTreeMap<String, f64> {
    requests_of(metrics, &PUBLISHER_RESOURCES)
}

// ------------------------------------------------------------- watches ----

/// Starts a watch in the background and returns once its first list is
/// complete. `step` sees every event with the time it arrived and says
/// when to stop; the task then ends.
async fn watch_in_background<K, F>(
    api: Api<K>,
    config: watcher::Config,
    mut step: F,
) -> Result<tokio::task::JoinHandle<Result<()>>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    F: FnMut(watcher::Event<K>, Instant) -> bool + Send + 'static,
{
    let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        let mut listed = Some(listed_tx);
        while let Some(item) = stream.next().await {
            // An API server under the load measured drops watch streams;
            // the watcher relists (with backoff) and goes on.
            let event = match item {
                Ok(event) => event,
                Err(e) => {
                    eprintln!("[bench] watch interrupted, resumed: {e}");
                    continue;
                }
            };
            let now = Instant::now();
            let init_done = matches!(event, watcher::Event::InitDone);
            let done = step(event, now);
            if init_done && let Some(tx) = listed.take() {
                let _ = tx.send(());
            }
            if done {
                return Ok(());
            }
        }
        bail!("the watch ended")
    });
    match listed_rx.await {
        Ok(()) => Ok(task),
        Err(_) => match task.await? {
            Err(e) => Err(e.context("starting a watch")),
            Ok(()) => bail!("the watch ended before its first list"),
        },
    }
}

/// Waits for a task from [`watch_in_background`], at most `timeout`.
async fn join_watch(
    what: &str,
    task: tokio::task::JoinHandle<Result<()>>,
    timeout: Duration,
) -> Result<()> {
    match tokio::time::timeout(timeout, task).await {
        Ok(joined) => joined?,
        Err(_) => bail!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Per pool: its slices (name -> pool generation, slice count) and when
/// it was first complete (every slice of its newest generation present).
#[derive(Default)]
struct Pools {
    slices: HashMap<String, HashMap<String, (i64, i64)>>,
    complete: HashMap<String, Instant>,
}

impl Pools {
    fn apply(&mut self, slice: &ResourceSlice, now: Instant) {
        let pool = &slice.spec.pool;
        let name = slice.metadata.name.clone().unwrap_or_default();
        let slices = self.slices.entry(pool.name.clone()).or_default();
        slices.insert(name, (pool.generation, pool.resource_slice_count));
        let newest = slices.values().map(|(g, _)| *g).max().unwrap_or(0);
        let of_newest: Vec<i64> = slices
            .values()
            .filter(|(g, _)| *g == newest)
            .map(|(_, c)| *c)
            .collect();
        if of_newest.iter().all(|c| *c == of_newest.len() as i64) {
            self.complete.entry(pool.name.clone()).or_insert(now);
        }
    }

    fn delete(&mut self, slice: &ResourceSlice) {
        if let Some(s) = self.slices.get_mut(&slice.spec.pool.name) {
            s.remove(slice.metadata.name.as_deref().unwrap_or_default());
        }
    }
}

// ----------------------------------------------------------- publishers ----

/// How to run one `tessera publish` per node.
#[derive(Debug, Clone)]
pub struct PublisherSetup {
    pub tessera: PathBuf,
    pub nvml_library: PathBuf,
    pub topology: PathBuf,
    pub kubeconfig: PathBuf,
    pub driver: String,
    /// Node policy of every publisher; default: every mode on every GPU.
    pub policy: Option<PathBuf>,
    /// One directory per node below it (simulated machine state, log).
    pub work_dir: PathBuf,
}

/// The publisher processes this benchmark started; stopped (SIGTERM, then
/// SIGKILL) when dropped.
pub struct Publishers {
    children: Vec<(String, Child)>,
}

impl Publishers {
    /// Starts one publisher per node, each over its own simulated machine.
    pub fn start(setup: &PublisherSetup, nodes: &[String]) -> Result<Publishers> {
        let mut started = Publishers {
            children: Vec::with_capacity(nodes.len()),
        };
        for node in nodes {
            let dir = setup.work_dir.join(node);
            if dir.exists() {
                std::fs::remove_dir_all(&dir)
                    .with_context(|| format!("removing {}", dir.display()))?;
            }
            std::fs::create_dir_all(dir.join("driver"))?;
            let log = std::fs::File::create(dir.join("publish.log"))?;
            let mut command = Command::new(&setup.tessera);
            if let Some(policy) = &setup.policy {
                command.env("TESSERA_POLICY", policy);
            } else {
                command.env_remove("TESSERA_POLICY");
            }
            let child = command
                .arg("--nvml-library")
                .arg(&setup.nvml_library)
                .arg("publish")
                .args(["--node-name", node, "--driver-name", &setup.driver])
                .arg("--kubeconfig")
                .arg(&setup.kubeconfig)
                .env("TESSERA_FAKE_NVML_TOPOLOGY", &setup.topology)
                .env("TESSERA_FAKE_NVML_STATE", dir.join("nvml.state"))
                .env("TESSERA_FAKE_NVML_DRIVER_ROOT", dir.join("driver"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {}", setup.tessera.display()))?;
            started.children.push((node.clone(), child));
        }
        Ok(started)
    }

    /// Fails naming the first publisher that exited.
    pub fn check_running(&mut self, work_dir: &Path) -> Result<()> {
        for (node, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "the publisher of {node} exited ({status}); log: {}",
                    work_dir.join(node.as_str()).join("publish.log").display()
                );
            }
        }
        Ok(())
    }

    /// Resident memory of every publisher (KiB), in node order.
    pub fn rss_kib(&self) -> Result<Vec<u64>> {
        self.children.iter().map(|(_, c)| rss_kib(c.id())).collect()
    }

    /// SIGTERM to every publisher, then waits (SIGKILL after 10 s).
    pub fn stop(mut self) -> Result<()> {
        self.stop_all()
    }

    fn stop_all(&mut self) -> Result<()> {
        for (_, child) in &self.children {
            // SAFETY: kill(2) on the pid of a child we have not reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for (_, child) in &mut self.children {
            while child.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    child.kill()?;
                    child.wait()?;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.children.clear();
        Ok(())
    }
}

impl Drop for Publishers {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts a publisher per node at once and times until every node's pool
/// is complete on the API server.
pub async fn publish(
    client: &Client,
    setup: &PublisherSetup,
    nodes: &[String],
    settle: Duration,
    timeout: Duration,
) -> Result<(Publishers, Value)> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let existing = slices
        .list_metadata(&ListParams::default().fields(&format!("spec.driver={}", setup.driver)))
        .await?;
    ensure!(
        existing.items.is_empty(),
        "{} already has {} slices: start from a fresh cluster",
        setup.driver,
        existing.items.len()
    );
    let pools = Arc::new(Mutex::new(Pools::default()));
    let want = nodes.len();
    let watched = pools.clone();
    let watch = watch_in_background(
        slices,
        watcher::Config::default().fields(&format!("spec.driver={}", setup.driver)),
        move |event, now| {
            let mut p = watched.lock().expect("pools lock");
            match event {
                watcher::Event::Apply(s) | watcher::Event::InitApply(s) => p.apply(&s, now),
                watcher::Event::Delete(s) => p.delete(&s),
                watcher::Event::Init | watcher::Event::InitDone => {}
            }
            p.complete.len() >= want
        },
    )
    .await?;

    let before = publisher_requests(&apiserver_metrics(client).await?);
    let began = Instant::now();
    let mut publishers = Publishers::start(setup, nodes)?;
    let spawned_s = began.elapsed().as_secs_f64();
    let waited = tokio::select! {
        r = join_watch("every pool published", watch, timeout) => r,
        e = watch_exits(&mut publishers, &setup.work_dir) => Err(e),
    };
    waited?;
    let at_complete = publisher_requests(&apiserver_metrics(client).await?);
    // A measurement window: what the publishers ask for once published.
    tokio::time::sleep(settle).await;
    publishers.check_running(&setup.work_dir)?;
    let after_settle = publisher_requests(&apiserver_metrics(client).await?);

    let p = pools.lock().expect("pools lock");
    let mut per_node: Vec<f64> = p
        .complete
        .values()
        .map(|t| t.duration_since(began).as_secs_f64())
        .collect();
    per_node.sort_by(f64::total_cmp);
    let slices_per_node = p.slices.values().map(HashMap::len).max().unwrap_or(0);
    let rss = publishers.rss_kib()?;
    let n = nodes.len() as f64;
    let result = json!({
        "phase": "publish",
        "nodes": nodes.len(),
        "slices_per_node": slices_per_node,
        "spawn_all_s": round3(spawned_s),
        "all_published_s": round3(per_node.last().copied().unwrap_or(0.0)),
        "node_published_s": { "p50": round3(quantile(&per_node, 0.5)),
            "p99": round3(quantile(&per_node, 0.99)), "min": round3(per_node[0]) },
        "requests_per_node": requests_delta(&before, &at_complete, n),
        "requests_per_node_settle": requests_delta(&at_complete, &after_settle, n),
        "settle_s": settle.as_secs_f64(),
        "publisher_rss_kib": rss_summary(&rss),
    });
    drop(p);
    Ok((publishers, result))
}

/// Resolves with an error once a publisher exits (never otherwise).
async fn watch_exits(publishers: &mut Publishers, work_dir: &Path) -> anyhow::Error {
    loop {
        if let Err(e) = publishers.check_running(work_dir) {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn rss_summary(rss: &[u64]) -> Value {
    let mut v: Vec<f64> = rss.iter().map(|k| *k as f64).collect();
    v.sort_by(f64::total_cmp);
    json!({
        "one_p50": quantile(&v, 0.5), "one_max": v.last().copied().unwrap_or(0.0),
        "all_mib": round3(v.iter().sum::<f64>() / 1024.0),
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

// ------------------------------------------------------------- replicas ----

/// What one node's GPUs are, read from the pool Tessera published for it:
/// the whole-GPU devices' `uuid`, `productName` and `memory`.
#[derive(Debug, Clone)]
pub struct Gpu {
    pub uuid: String,
    pub product: String,
    /// MiB.
    pub memory_mib: u64,
}

/// The GPUs of `pool` as `driver` published them (devices of type `gpu`).
pub async fn published_gpus(client: &Client, driver: &str, pool: &str) -> Result<Vec<Gpu>> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.driver={driver},spec.nodeName={pool}"));
    let mut gpus = Vec::new();
    for slice in slices.list(&lp).await?.items {
        for d in slice.spec.devices.unwrap_or_default() {
            let attrs = d.attributes.unwrap_or_default();
            let string = |k: &str| attrs.get(k).and_then(|a| a.string.clone());
            if string("type").as_deref() != Some("gpu") {
                continue;
            }
            let memory = d
                .capacity
                .unwrap_or_default()
                .get("memory")
                .map(|c| c.value.0.clone())
                .context("a GPU without memory capacity")?;
            gpus.push(Gpu {
                uuid: string("uuid").unwrap_or_default(),
                product: string("productName").unwrap_or_default(),
                memory_mib: parse_mib(&memory)?,
            });
        }
    }
    ensure!(!gpus.is_empty(), "{driver} published no GPU for {pool}");
    Ok(gpus)
}

/// A memory quantity in MiB (binary suffixes, or plain bytes).
pub fn parse_mib(q: &str) -> Result<u64> {
    let (digits, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: u64 = digits
        .parse()
        .with_context(|| format!("memory quantity {q:?}"))?;
    Ok(match unit {
        "" => n / (1 << 20),
        "Ki" => n / 1024,
        "Mi" => n,
        "Gi" => n * 1024,
        "Ti" => n * 1024 * 1024,
        _ => bail!("memory quantity {q:?}: unit {unit:?}"),
    })
}

/// The replica slice of one node: `replicas` plain devices per GPU, each
/// with the attributes a share device has and an equal part of the memory.
pub fn replica_slice(driver: &str, node: &str, gpus: &[Gpu], replicas: usize) -> Value {
    let mut devices = Vec::new();
    for (g, gpu) in gpus.iter().enumerate() {
        for r in 0..replicas {
            devices.push(json!({
                "name": format!("gpu-{g}-replica-{r}"),
                "attributes": {
                    "type": { "string": "share" },
                    "isolationLevel": { "string": "Isolated" },
                    "parentUUID": { "string": gpu.uuid },
                    "productName": { "string": gpu.product },
                },
                "capacity": {
                    "memory": { "value": format!("{}Mi", gpu.memory_mib / replicas as u64) },
                },
            }));
        }
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": { "name": format!("{node}-{driver}") },
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
            "devices": devices,
        },
    })
}

/// Publishes the replica model for every node (server-side apply, 8 in
/// flight) and its DeviceClass `class`; how long it took.
pub async fn apply_replicas(
    client: &Client,
    driver: &str,
    class: &str,
    nodes: &[String],
    gpus: &[Gpu],
    replicas: usize,
) -> Result<Value> {
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let dc = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": { "name": class },
        "spec": { "selectors": [{ "cel": { "expression": format!(
            "device.driver == \"{driver}\" && device.attributes[\"{driver}\"].type == \"share\" \
             && device.attributes[\"{driver}\"].isolationLevel == \"Isolated\""
        ) } }] },
    });
    classes.patch(class, &pp, &Patch::Apply(dc)).await?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let began = Instant::now();
    futures::stream::iter(nodes)
        .map(|node| {
            let (slices, pp) = (slices.clone(), pp.clone());
            let slice = replica_slice(driver, node, gpus, replicas);
            async move {
                let name = format!("{node}-{driver}");
                slices
                    .patch(&name, &pp, &Patch::Apply(slice))
                    .await
                    .with_context(|| format!("applying {name}"))
            }
        })
        .buffer_unordered(8)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(json!({
        "phase": "replicas",
        "driver": driver,
        "nodes": nodes.len(),
        "devices_per_node": gpus.len() * replicas,
        "apply_all_s": round3(began.elapsed().as_secs_f64()),
    }))
}

// ----------------------------------------------------------- scheduling ----

/// How each pod gets its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClaimSource {
    /// A ResourceClaim per pod, created before the clock starts: the time
    /// is the scheduler's alone.
    Direct,
    /// One ResourceClaimTemplate: kube-controller-manager creates each
    /// pod's claim, so its pace counts too.
    Template,
}

/// One scheduling run.
#[derive(Debug, Clone)]
pub struct ScheduleRun {
    /// Label for the report (the device model).
    pub model: String,
    pub class: String,
    /// Capacity the claim's one request asks for (`capacity.requests`).
    pub capacity: Option<BTreeMap<String, String>>,
    pub pods: usize,
    pub source: ClaimSource,
    /// Pods (and claims) created this many at a time.
    pub create_concurrency: usize,
    pub timeout: Duration,
}

/// A client for kube-scheduler's own HTTPS port (its metrics), with the
/// admin credentials.
pub async fn scheduler_client(cluster: &TestCluster) -> Result<Client> {
    super::cluster::component_client(cluster, "SCHEDULER_PORT").await
}

async fn metrics_of(client: &Client) -> Result<String> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .context("building the request")?;
    client
        .request_text(req)
        .await
        .context("reading the metrics")
}

fn histogram_view(h: &Histogram) -> Value {
    json!({
        "count": h.count,
        "mean_ms": round3(h.mean() * 1e3),
        "p50_ms": round3(h.quantile(0.5) * 1e3),
        "p99_ms": round3(h.quantile(0.99) * 1e3),
    })
}

/// What kube-scheduler says about the pods it handled between two scrapes.
pub fn scheduler_view(before: &str, after: &str) -> Value {
    let delta = |name: &str, want: &[(&str, &str)]| {
        parse_histogram(after, name, want).since(&parse_histogram(before, name, want))
    };
    let count = |result: &str| {
        let want = [("result", result)];
        sum_counter(after, "scheduler_schedule_attempts_total", &want)
            - sum_counter(before, "scheduler_schedule_attempts_total", &want)
    };
    let mut points = serde_json::Map::new();
    for point in ["PreFilter", "Filter", "Score", "Reserve", "PreBind", "Bind"] {
        let h = delta(
            "scheduler_framework_extension_point_duration_seconds",
            &[("extension_point", point)],
        );
        points.insert(point.to_owned(), histogram_view(&h));
    }
    json!({
        "attempts": { "scheduled": count("scheduled"), "unschedulable": count("unschedulable"),
            "error": count("error") },
        "attempt_scheduled": histogram_view(&delta(
            "scheduler_scheduling_attempt_duration_seconds", &[("result", "scheduled")])),
        "algorithm": histogram_view(&delta("scheduler_scheduling_algorithm_duration_seconds", &[])),
        "pod_e2e_sli": histogram_view(&delta(
            "scheduler_pod_scheduling_sli_duration_seconds", &[])),
        "extension_points": points,
    })
}

/// Creates the run's claims (direct) or template and pods in a fresh
/// namespace and times each pod until it is bound. The namespace is left
/// for the caller to measure the loaded cluster and then [`clean_up`].
pub async fn schedule(
    cluster: &TestCluster,
    scheduler: &Client,
    run: &ScheduleRun,
) -> Result<(Value, TestNamespace)> {
    let ns = cluster.create_namespace("bench-scale").await?;
    let pp = PostParams::default();
    let mut request = json!({ "deviceClassName": run.class });
    if let Some(cap) = &run.capacity {
        request["capacity"] = json!({ "requests": cap });
    }
    let claim_spec = json!({ "devices": { "requests": [{ "name": "gpu", "exactly": request }] } });
    let claims_began = Instant::now();
    match run.source {
        ClaimSource::Template => {
            let t: ResourceClaimTemplate = serde_json::from_value(json!({
                "metadata": { "name": "gpu" }, "spec": { "spec": claim_spec },
            }))?;
            ns.api::<ResourceClaimTemplate>().create(&pp, &t).await?;
        }
        ClaimSource::Direct => {
            let api = ns.api::<ResourceClaim>();
            futures::stream::iter(0..run.pods)
                .map(|i| {
                    let (api, pp) = (api.clone(), pp.clone());
                    let claim: Result<ResourceClaim, _> = serde_json::from_value(json!({
                        "metadata": { "name": format!("claim-{i:04}") }, "spec": claim_spec,
                    }));
                    async move { api.create(&pp, &claim?).await.map_err(anyhow::Error::from) }
                })
                .buffer_unordered(run.create_concurrency)
                .try_collect::<Vec<_>>()
                .await?;
        }
    }
    let claims_s = claims_began.elapsed().as_secs_f64();

    let bound: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let seen = bound.clone();
    let want = run.pods;
    let watch = watch_in_background(
        ns.api::<Pod>(),
        watcher::Config::default(),
        move |event, now| {
            let mut b = seen.lock().expect("bound lock");
            if let watcher::Event::Apply(p) | watcher::Event::InitApply(p) = event
                && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
            {
                b.entry(p.metadata.name.unwrap_or_default()).or_insert(now);
            }
            b.len() >= want
        },
    )
    .await?;
    let sched_before = metrics_of(scheduler).await?;
    let api = ns.api::<Pod>();
    let began = Instant::now();
    let created: Vec<(String, Instant)> = futures::stream::iter(0..run.pods)
        .map(|i| {
            let (api, pp) = (api.clone(), pp.clone());
            let name = format!("pod-{i:04}");
            let claim = match run.source {
                ClaimSource::Template => {
                    json!({ "name": "gpu", "resourceClaimTemplateName": "gpu" })
                }
                ClaimSource::Direct => {
                    json!({ "name": "gpu", "resourceClaimName": format!("claim-{i:04}") })
                }
            };
            let pod: Result<Pod, _> = serde_json::from_value(json!({
                "metadata": { "name": name },
                "spec": {
                    "nodeSelector": { "tessera.dev/fake-node": "true" },
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": false,
                    "resourceClaims": [claim],
                    "containers": [{
                        "name": "main", "image": "tessera.local/probe:1",
                        "resources": { "claims": [{ "name": "gpu" }] },
                    }],
                },
            }));
            async move {
                api.create(&pp, &pod?).await?;
                anyhow::Ok((name, Instant::now()))
            }
        })
        .buffer_unordered(run.create_concurrency)
        .try_collect()
        .await?;
    let created_s = began.elapsed().as_secs_f64();
    join_watch("every pod bound", watch, run.timeout)
        .await
        .with_context(|| {
            let n = bound.lock().map(|b| b.len()).unwrap_or(0);
            format!("{n} of {} pods bound", run.pods)
        })?;
    let sched_after = metrics_of(scheduler).await?;

    let (at, latency) = {
        let b = bound.lock().expect("bound lock");
        let mut at: Vec<f64> = b
            .values()
            .map(|t| t.duration_since(began).as_secs_f64())
            .collect();
        at.sort_by(f64::total_cmp);
        let mut latency: Vec<f64> = created
            .iter()
            .filter_map(|(name, c)| b.get(name).map(|t| t.saturating_duration_since(*c)))
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        latency.sort_by(f64::total_cmp);
        (at, latency)
    };
    let (first, last) = (at[0], at[at.len() - 1]);
    let allocated = ns
        .api::<ResourceClaim>()
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|c| {
            c.status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .is_some()
        })
        .count();
    let result = json!({
        "phase": "schedule",
        "model": run.model,
        "claims": match run.source { ClaimSource::Direct => "direct", ClaimSource::Template => "template" },
        "pods": run.pods,
        "claims_created_before_s": (run.source == ClaimSource::Direct).then(|| round3(claims_s)),
        "pods_created_s": round3(created_s),
        "first_bound_s": round3(first),
        "all_bound_s": round3(last),
        "pods_per_s": round2(run.pods as f64 / last),
        "pods_per_s_after_first": round2((run.pods - 1) as f64 / (last - first).max(1e-9)),
        "create_to_bound_ms": { "p50": round3(quantile(&latency, 0.5)),
            "p99": round3(quantile(&latency, 0.99)), "max": round3(latency.last().copied().unwrap_or(0.0)) },
        "claims_allocated": allocated,
        "scheduler": scheduler_view(&sched_before, &sched_after),
    });
    Ok((result, ns))
}

/// Deletes a run's pods (at once: no kubelet will ever confirm them) and
/// its namespace, and waits until the namespace is gone.
pub async fn clean_up(client: &Client, ns: TestNamespace, timeout: Duration) -> Result<()> {
    ns.api::<Pod>()
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await?;
    let name = ns.name().to_owned();
    ns.delete().await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    wait_for(&format!("namespace {name} gone"), timeout, || async {
        Ok(namespaces.get_opt(&name).await?.is_none().then_some(()))
    })
    .await
}

// ------------------------------------------------------------ the whole ----

/// `tessera-bench scale`: every phase, one JSON object per result.
#[derive(Debug, clap::Args)]
pub struct ScaleArgs {
    /// Fake nodes to publish for (`cluster.sh add-nodes`).
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// The `tessera` binary.
    #[arg(long)]
    pub tessera: PathBuf,
    /// The simulated `libnvidia-ml.so.1`.
    #[arg(long)]
    pub nvml_library: PathBuf,
    /// The machine every node simulates.
    #[arg(long)]
    pub topology: PathBuf,
    /// Per-node directories of the publishers (emptied first).
    #[arg(long)]
    pub work_dir: PathBuf,
    #[arg(long, default_value = tessera_api::names::DEFAULT_DRIVER_NAME)]
    pub driver: String,
    /// Node policy (YAML) of every publisher; default: every mode on every
    /// GPU (the full model).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// DeviceClass of the Isolated shares (deploy/deviceclasses.yaml,
    /// applied beforehand).
    #[arg(long, default_value = "gpu-isolated.tessera.dev")]
    pub class: String,
    /// Pods (one claim each) per scheduling run.
    #[arg(long, default_value_t = 1000)]
    pub pods: usize,
    /// Replica devices per GPU in the comparison model; each Tessera claim
    /// asks for the same part of a GPU (memory and cores).
    #[arg(long, default_value_t = 10)]
    pub replicas: usize,
    #[arg(long, default_value = "replicas.bench.dev")]
    pub replica_driver: String,
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [ClaimSource::Direct, ClaimSource::Template])]
    pub claims: Vec<ClaimSource>,
    /// Requests in flight while creating claims and pods.
    #[arg(long, default_value_t = 32)]
    pub create_concurrency: usize,
    /// Seconds to count the publishers' requests after the last pool is
    /// complete.
    #[arg(long, default_value_t = 10)]
    pub settle: u64,
    /// Only Tessera's model (no replica runs).
    #[arg(long)]
    pub no_replicas: bool,
    /// Seconds one scheduling run may take.
    #[arg(long, default_value_t = 3600)]
    pub timeout: u64,
}

/// CPU time (user + system) a process has used so far.
pub fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces: field 3 first.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let field = |n: usize| -> Result<u64> {
        after
            .split_whitespace()
            .nth(n - 3)
            .and_then(|t| t.parse().ok())
            .with_context(|| format!("no field {n} in /proc/{pid}/stat"))
    };
    let ticks = field(14)? + field(15)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// The pid `cluster.sh` recorded for one of its components.
pub fn component_pid(cluster: &TestCluster, name: &str) -> Result<u32> {
    let file = cluster.state_dir().join("pids").join(format!("{name}.pid"));
    std::fs::read_to_string(&file)
        .with_context(|| format!("reading {}", file.display()))?
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no pid in {}", file.display()))
}

/// CPU seconds the control plane's components and the publishers used.
struct CpuMeter {
    pids: Vec<(&'static str, u32)>,
    publishers: Vec<u32>,
    at: Vec<Duration>,
    publishers_at: Duration,
}

impl CpuMeter {
    fn start(cluster: &TestCluster, publishers: Option<&Publishers>) -> Result<CpuMeter> {
        let mut pids = Vec::new();
        for name in [
            "kube-apiserver",
            "kube-scheduler",
            "kube-controller-manager",
            "etcd",
        ] {
            pids.push((name, component_pid(cluster, name)?));
        }
        let publishers: Vec<u32> = publishers
            .map(|p| p.children.iter().map(|(_, c)| c.id()).collect())
            .unwrap_or_default();
        let at = pids
            .iter()
            .map(|(_, p)| cpu_time(*p))
            .collect::<Result<_>>()?;
        let publishers_at = Self::sum(&publishers)?;
        Ok(CpuMeter {
            pids,
            publishers,
            at,
            publishers_at,
        })
    }

    fn sum(pids: &[u32]) -> Result<Duration> {
        pids.iter().map(|p| cpu_time(*p)).sum()
    }

    /// CPU seconds used since `start`, per component.
    fn since(&self) -> Result<Value> {
        let mut out = serde_json::Map::new();
        for ((name, pid), at) in self.pids.iter().zip(&self.at) {
            let used = cpu_time(*pid)?.saturating_sub(*at);
            out.insert((*name).to_owned(), json!(round3(used.as_secs_f64())));
        }
        if !self.publishers.is_empty() {
            let used = Self::sum(&self.publishers)?.saturating_sub(self.publishers_at);
            out.insert("publishers".to_owned(), json!(round3(used.as_secs_f64())));
        }
        Ok(Value::Object(out))
    }
}

/// Runs every phase in order, printing each result as it comes: the
/// publishers, Tessera's model under load; then, with Tessera's slices
/// gone, the replica model alone, so each model is scheduled on a cluster
/// that holds only its own devices.
pub async fn run(cluster: &TestCluster, args: ScaleArgs) -> Result<()> {
    let client = cluster.client();
    let nodes = fake_nodes(&client, args.nodes).await?;
    let setup = PublisherSetup {
        tessera: args.tessera.clone(),
        nvml_library: args.nvml_library.clone(),
        topology: args.topology.clone(),
        kubeconfig: cluster.kubeconfig().to_owned(),
        driver: args.driver.clone(),
        policy: args.policy.clone(),
        work_dir: args.work_dir.clone(),
    };
    let cpu = CpuMeter::start(cluster, None)?;
    let (mut publishers, mut result) = publish(
        &client,
        &setup,
        &nodes,
        Duration::from_secs(args.settle),
        Duration::from_secs(600),
    )
    .await?;
    result["cpu_s"] = cpu.since()?;
    println!("{result}");

    let gpus = published_gpus(&client, &args.driver, &nodes[0]).await?;
    // Each Tessera claim asks for what one replica stands for.
    let memory_mib = gpus.iter().map(|g| g.memory_mib).min().unwrap_or(0) / args.replicas as u64;
    let capacity = BTreeMap::from([
        ("memory".to_owned(), format!("{}Mi", memory_mib / 256 * 256)),
        ("cores".to_owned(), (100 / args.replicas).to_string()),
    ]);
    let scheduler = scheduler_client(cluster).await?;
    let schedule_all = async |model: &str,
                              class: &str,
                              capacity: Option<BTreeMap<String, String>>,
                              publishers: Option<&mut Publishers>|
           -> Result<()> {
        let mut publishers = publishers;
        for &source in &args.claims {
            let run = ScheduleRun {
                model: model.to_owned(),
                class: class.to_owned(),
                capacity: capacity.clone(),
                pods: args.pods,
                source,
                create_concurrency: args.create_concurrency,
                timeout: Duration::from_secs(args.timeout),
            };
            let before = apiserver_metrics(&client).await?;
            let cpu = CpuMeter::start(cluster, publishers.as_deref())?;
            let (mut result, ns) = schedule(cluster, &scheduler, &run).await?;
            result["cpu_s"] = cpu.since()?;
            let after = apiserver_metrics(&client).await?;
            result["slice_writes_during"] = json!(slice_writes(&after) - slice_writes(&before));
            // The fan-out: every claim event goes to every claim watcher.
            result["claim_watch_events_during"] =
                json!(claim_watch_events(&after) - claim_watch_events(&before));
            result["claim_watchers"] = json!(claim_watchers(&after));
            // Everyone's, this benchmark's claims and its one list included.
            result["requests_during"] = json!(requests_delta(
                &publisher_requests(&before),
                &publisher_requests(&after),
                1.0
            ));
            if let Some(p) = publishers.as_deref_mut() {
                p.check_running(&setup.work_dir)?;
                result["publisher_rss_kib"] = rss_summary(&p.rss_kib()?);
            }
            println!("{result}");
            clean_up(&client, ns, Duration::from_secs(600)).await?;
        }
        Ok(())
    };
    schedule_all(
        "tessera",
        &args.class,
        Some(capacity),
        Some(&mut publishers),
    )
    .await?;
    publishers.stop()?;
    delete_slices(&client, &args.driver).await?;
    if args.no_replicas {
        return Ok(());
    }

    let replica_class = args.replica_driver.clone();
    let result = apply_replicas(
        &client,
        &args.replica_driver,
        &replica_class,
        &nodes,
        &gpus,
        args.replicas,
    )
    .await?;
    println!("{result}");
    schedule_all("replicas", &replica_class, None, None).await?;
    delete_slices(&client, &args.replica_driver).await?;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    classes
        .delete(&replica_class, &DeleteParams::default())
        .await?;
    Ok(())
}

/// Deletes every slice of `driver` and waits until they are gone.
pub async fn delete_slices(client: &Client, driver: &str) -> Result<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.driver={driver}"));
    slices
        .delete_collection(&DeleteParams::default(), &lp)
        .await?;
    wait_for(
        &format!("every slice of {driver} gone"),
        Duration::from_secs(120),
        || async {
            Ok(slices
                .list_metadata(&lp)
                .await?
                .items
                .is_empty()
                .then_some(()))
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_quantities_are_read_in_mib() {
        assert_eq!(parse_mib("81559Mi").unwrap(), 81559);
        assert_eq!(parse_mib("80Gi").unwrap(), 81920);
        assert_eq!(parse_mib("1048576").unwrap(), 1);
        assert!(parse_mib("1.5Gi").is_err());
    }

    #[test]
    fn request_deltas_are_per_node_and_skip_zeros() {
        let metrics = |slices: u32, claims: u32| {
            format!(
                "apiserver_request_total{{code=\"201\",dry_run=\"\",resource=\"resourceslices\",subresource=\"\",verb=\"APPLY\"}} {slices}\n\
                 apiserver_request_total{{code=\"201\",dry_run=\"All\",resource=\"resourceslices\",subresource=\"\",verb=\"POST\"}} 2\n\
                 apiserver_request_total{{code=\"200\",dry_run=\"\",resource=\"resourceclaims\",subresource=\"\",verb=\"LIST\"}} {claims}\n"
            )
        };
        let before = publisher_requests(&metrics(10, 3));
        let after = publisher_requests(&metrics(30, 3));
        assert_eq!(before["POST resourceslices (dry run)"], 2.0);
        let d = requests_delta(&before, &after, 10.0);
        assert_eq!(d.len(), 1);
        assert_eq!(d["APPLY resourceslices"], 2.0);
    }

    #[test]
    fn a_pool_is_complete_with_every_slice_of_its_newest_generation() {
        let slice = |name: &str, generation: i64, count: i64| -> ResourceSlice {
            serde_json::from_value(json!({
                "metadata": { "name": name },
                "spec": { "driver": "d", "nodeName": "n",
                    "pool": { "name": "n", "generation": generation, "resourceSliceCount": count } },
            }))
            .unwrap()
        };
        let now = Instant::now();
        let mut p = Pools::default();
        p.apply(&slice("a", 1, 2), now);
        assert!(p.complete.is_empty());
        p.apply(&slice("b", 2, 1), now);
        assert!(p.complete.contains_key("n"));
    }

    #[test]
    fn replica_slices_split_each_gpu_into_equal_devices() {
        let gpu = Gpu {
            uuid: "GPU-1".into(),
            product: "H".into(),
            memory_mib: 81559,
        };
        let s = replica_slice("r.dev", "node-1", &[gpu.clone(), gpu], 10);
        let devices = s["spec"]["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 20);
        assert_eq!(devices[19]["name"], "gpu-1-replica-9");
        assert_eq!(devices[0]["capacity"]["memory"]["value"], "8155Mi");
        assert_eq!(s["spec"]["pool"]["name"], "node-1");
    }
}
