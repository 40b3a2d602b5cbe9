//! What `tessera binder` costs on a cluster of many claims (docs/benchmarks.md,
//! "Binding conditions"): the binder is the one watcher of every
//! ResourceClaim, so its start, memory and CPU grow with the cluster's
//! claims, and a burst of allocations that wait on their nodes is the most
//! it writes at once.
//!
//! The bench writes the claims' status itself, as the scheduler would: no
//! node, kubelet or driver is involved. Claims are reserved for a consumer
//! of a bench API group, which the resource claim controller leaves alone
//! (it would remove a reservation for a pod that does not exist).
//!
//! Phases, each printed as one JSON object:
//! 1. `--claims` claims allocated to another driver and reserved (what the
//!    binder decodes and drops), `--waiting` unallocated claims, and one
//!    claim already waiting; then the binder starts: the time until that
//!    claim is listed, its memory and CPU;
//! 2. the burst: every waiting claim allocated at once (`--concurrency`
//!    status writes in flight) on devices with binding conditions across
//!    `--nodes` pools; per claim, the time from its status write to its
//!    listing in its node's ConfigMap; the binder's CPU and ConfigMap writes;
//! 3. the release: every reservation removed at once; the time until every
//!    listing is empty.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde_json::{Value, json};
use tessera_api::names::binding::DRIVER_LABEL;

use super::cluster::apiserver_metrics;
use super::grpc::rss_kib;
use super::scale::cpu_time;
use super::stats::{quantile, requests_delta, requests_of, round2};
use crate::cluster::{TestCluster, TestNamespace, unique_name, wait_for};

#[derive(Debug, clap::Args)]
pub struct BinderArgs {
    /// The `tessera` binary whose `binder` subcommand is measured.
    #[arg(long)]
    pub tessera: PathBuf,
    /// Claims of another driver, allocated and reserved.
    #[arg(long, default_value_t = 5000)]
    pub claims: usize,
    /// Claims allocated at once in the burst.
    #[arg(long, default_value_t = 1000)]
    pub waiting: usize,
    /// Pools (nodes) the burst's devices are spread over.
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// Status writes in flight.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Seconds each phase may take.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
}

/// The claim's allocation: one device of `driver` in `pool`, with binding
/// conditions or without, reserved for a bench consumer.
fn allocated(driver: &str, pool: &str, conditions: bool, i: usize) -> Value {
    let mut result = json!({ "request": "gpu", "driver": driver, "pool": pool, "device": "gpu-0" });
    if conditions {
        result["bindingConditions"] = json!(["DeviceMade"]);
        result["bindingFailureConditions"] = json!(["DeviceNotMade"]);
    }
    json!({ "status": {
        "allocation": { "devices": { "results": [result] } },
        "reservedFor": [{
            "apiGroup": "bench.tessera.dev", "resource": "consumers",
            "name": format!("consumer-{i}"), "uid": format!("00000000-0000-4000-8000-{i:012x}"),
        }],
    }})
}

/// Where the burst's claim `i` waits.
fn pool_of(i: usize, nodes: usize) -> String {
    format!("node-{:04}", i % nodes.max(1))
}

struct Bench<'a> {
    args: &'a BinderArgs,
    client: Client,
    ns: TestNamespace,
    driver: String,
    claims: Api<ResourceClaim>,
}

impl Bench<'_> {
    async fn create(&self, names: Vec<String>) -> Result<Vec<(String, String)>> {
        futures::stream::iter(names)
            .map(|name| async move {
                let claim: ResourceClaim = serde_json::from_value(json!({
                    "metadata": { "name": name },
                    "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": {
                        "deviceClassName": "bench", "allocationMode": "ExactCount", "count": 1,
                    }}]}},
                }))?;
                let created = self.claims.create(&PostParams::default(), &claim).await?;
                anyhow::Ok((name, created.metadata.uid.unwrap_or_default()))
            })
            .buffer_unordered(self.args.concurrency)
            .try_collect()
            .await
    }

    /// Writes `status` of each claim, `--concurrency` at once; when each
    /// write returned.
    async fn write_all(
        &self,
        claims: &[(String, String)],
        status: impl Fn(usize) -> Value,
    ) -> Result<HashMap<String, Instant>> {
        let status = &status;
        futures::stream::iter(claims.iter().enumerate())
            .map(|(i, (name, uid))| async move {
                self.claims
                    .patch_status(name, &PatchParams::default(), &Patch::Merge(&status(i)))
                    .await
                    .with_context(|| format!("writing the status of claim {name}"))?;
                anyhow::Ok((uid.clone(), Instant::now()))
            })
            .buffer_unordered(self.args.concurrency)
            .try_collect()
            .await
    }

    fn start_binder(&self, log: &std::path::Path, kubeconfig: &std::path::Path) -> Result<Child> {
        let log = std::fs::File::create(log)?;
        Command::new(&self.args.tessera)
            .args(["binder", "--driver-name", &self.driver, "--namespace"])
            .arg(self.ns.name())
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting tessera binder")
    }

    async fn configmap_requests(&self) -> Result<std::collections::BTreeMap<String, f64>> {
        let metrics = apiserver_metrics(&self.client).await?;
        // The binder's only verb on them (the control plane lists,
        // creates and deletes other ConfigMaps of a namespace).
        let all = requests_of(&metrics, &[("configmaps", "")]);
        Ok(all
            .into_iter()
            .filter(|(k, _)| k.starts_with("APPLY "))
            .collect())
    }
}

/// The claim UIDs listed in the driver's ConfigMaps, and when each was
/// first seen listed.
#[derive(Default)]
struct Listed {
    now: HashMap<String, Vec<String>>,
    first_seen: HashMap<String, Instant>,
}

impl Listed {
    fn total(&self) -> usize {
        self.now.values().map(Vec::len).sum()
    }
}

/// Follows the driver's ConfigMaps in the namespace.
fn follow(
    client: &Client,
    ns: &str,
    driver: &str,
) -> (Arc<Mutex<Listed>>, tokio::task::JoinHandle<()>) {
    let listed = Arc::new(Mutex::new(Listed::default()));
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let config = watcher::Config::default().labels(&format!("{DRIVER_LABEL}={driver}"));
    let shared = listed.clone();
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(
            watcher::watcher(maps, config)
                .default_backoff()
                .applied_objects()
        );
        while let Some(Ok(map)) = events.next().await {
            let at = Instant::now();
            let keys: Vec<String> = map.data.unwrap_or_default().into_keys().collect();
            let mut l = shared.lock().expect("listing lock");
            for k in &keys {
                l.first_seen.entry(k.clone()).or_insert(at);
            }
            l.now.insert(map.metadata.name.unwrap_or_default(), keys);
        }
    });
    (listed, task)
}

fn ms(d: Duration) -> f64 {
    round2(d.as_secs_f64() * 1e3)
}

fn latency_summary(mut samples: Vec<f64>) -> Value {
    samples.sort_by(f64::total_cmp);
    json!({
        "p50_ms": quantile(&samples, 0.5), "p99_ms": quantile(&samples, 0.99),
        "max_ms": samples.last().copied().unwrap_or(0.0),
    })
}

/// Runs the three phases and prints each result.
pub async fn run(cluster: &TestCluster, args: BinderArgs) -> Result<()> {
    let ns = cluster.create_namespace("bench-binder").await?;
    let claims = Api::namespaced(cluster.client(), ns.name());
    let bench = Bench {
        args: &args,
        client: cluster.client(),
        driver: format!("{}.bench.tessera.dev", unique_name("binder")),
        claims,
        ns,
    };
    let work = std::env::temp_dir().join(unique_name("tessera-bench-binder"));
    std::fs::create_dir_all(&work)?;
    let result = phases(cluster, &bench, &work).await;
    bench.ns.delete().await?;
    result
}

async fn phases(cluster: &TestCluster, bench: &Bench<'_>, work: &std::path::Path) -> Result<()> {
    let args = bench.args;
    let timeout = Duration::from_secs(args.timeout);
    let idle = bench
        .create((0..args.claims).map(|i| format!("idle-{i:06}")).collect())
        .await?;
    bench
        .write_all(&idle, |i| {
            allocated("other.bench.tessera.dev", &pool_of(i, args.nodes), false, i)
        })
        .await?;
    let waiting = bench
        .create(
            (0..args.waiting)
                .map(|i| format!("waiting-{i:06}"))
                .collect(),
        )
        .await?;
    let first = bench.create(vec!["first".into()]).await?;
    bench
        .write_all(&first, |_| allocated(&bench.driver, "node-first", true, 0))
        .await?;

    let (listed, follower) = follow(&bench.client, bench.ns.name(), &bench.driver);
    let started = Instant::now();
    let mut binder = bench.start_binder(&work.join("binder.log"), cluster.kubeconfig())?;
    let measured = Measured {
        bench,
        listed: &listed,
        pid: binder.id(),
        timeout,
    };
    let result = measure(measured, &waiting, &first[0].1, started).await;
    let _ = binder.kill();
    let _ = binder.wait();
    follower.abort();
    result
}

/// The binder under measurement, and what it listed.
struct Measured<'a> {
    bench: &'a Bench<'a>,
    listed: &'a Arc<Mutex<Listed>>,
    pid: u32,
    timeout: Duration,
}

async fn measure(
    m: Measured<'_>,
    waiting: &[(String, String)],
    first_uid: &str,
    started: Instant,
) -> Result<()> {
    let cpu_start = m.start(first_uid, started).await?;
    let cpu_burst = m.burst(waiting, cpu_start).await?;
    m.release(waiting, cpu_burst).await
}

impl Measured<'_> {
    fn listed(&self) -> std::sync::MutexGuard<'_, Listed> {
        self.listed.lock().expect("listing lock")
    }

    /// Phase 1: until the claim waiting before the start is listed; the
    /// binder's CPU time then.
    async fn start(&self, first_uid: &str, started: Instant) -> Result<Duration> {
        let args = self.bench.args;
        let at = wait_for("the first claim listed", self.timeout, || async {
            Ok(self.listed().first_seen.get(first_uid).copied())
        })
        .await?;
        let cpu = cpu_time(self.pid)?;
        println!(
            "{}",
            json!({
                "phase": "start", "claims": args.claims + args.waiting + 1,
                "first_listed_ms": ms(at - started), "rss_kib": rss_kib(self.pid)?,
                "cpu_ms": ms(cpu),
            })
        );
        Ok(cpu)
    }

    /// Phase 2: every waiting claim allocated at once; the binder's CPU
    /// time at the end.
    async fn burst(&self, waiting: &[(String, String)], cpu_start: Duration) -> Result<Duration> {
        let (bench, args, pid) = (self.bench, self.bench.args, self.pid);
        let requests = bench.configmap_requests().await?;
        let burst = Instant::now();
        let written = bench
            .write_all(waiting, |i| {
                allocated(&bench.driver, &pool_of(i, args.nodes), true, i)
            })
            .await?;
        let all_written = Instant::now();
        wait_for("every waiting claim listed", self.timeout, || async {
            let l = self.listed();
            Ok(written
                .keys()
                .all(|u| l.first_seen.contains_key(u))
                .then_some(()))
        })
        .await?;
        let l = self.listed().first_seen.clone();
        let last = written
            .keys()
            .filter_map(|u| l.get(u))
            .max()
            .copied()
            .unwrap_or(burst);
        let samples = written
            .iter()
            .map(|(u, w)| ms(l[u].saturating_duration_since(*w)))
            .collect();
        let cpu = cpu_time(pid)?;
        let writes = requests_delta(&requests, &bench.configmap_requests().await?, 1.0);
        println!(
            "{}",
            json!({
                "phase": "burst", "waiting": args.waiting, "nodes": args.nodes,
                "concurrency": args.concurrency, "status_writes_ms": ms(all_written - burst),
                "all_listed_ms": ms(last - burst), "write_to_listed": latency_summary(samples),
                "cpu_ms": ms(cpu - cpu_start), "rss_kib": rss_kib(pid)?,
                "configmap_requests": writes,
            })
        );
        Ok(cpu)
    }

    /// Phase 3: every reservation removed at once.
    async fn release(&self, waiting: &[(String, String)], cpu_burst: Duration) -> Result<()> {
        let release = Instant::now();
        self.bench
            .write_all(waiting, |_| json!({ "status": { "reservedFor": null } }))
            .await?;
        wait_for("every listing empty", self.timeout, || async {
            Ok((self.listed().total() <= 1).then_some(()))
        })
        .await?;
        ensure!(
            self.listed().total() == 1,
            "the first claim (still reserved) left its listing"
        );
        println!(
            "{}",
            json!({
                "phase": "release", "all_unlisted_ms": ms(release.elapsed()),
                "cpu_ms": ms(cpu_time(self.pid)? - cpu_burst),
            })
        );
        Ok(())
    }
}
