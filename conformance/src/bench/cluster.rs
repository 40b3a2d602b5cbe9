//! What the cluster itself measures: the kubelet's DRA call histogram for
//! pods, the API server's write counters, and when a driver's first slice
//! appears.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde::Serialize;
use serde_json::json;

use super::pod_start::{PodStart, Stages};
use super::stats::{Histogram, Summary, parse_histogram, requests_delta, requests_of, sum_counter};
use crate::cluster::{TestCluster, TestNamespace, wait_for};

const KUBELET_HISTOGRAM: &str = "dra_grpc_operations_duration_seconds";

/// A client for the local kubelet's own HTTPS port, with the admin
/// credentials (the API server will not proxy to a loopback node address).
pub async fn kubelet_client(cluster: &TestCluster) -> Result<Client> {
    component_client(cluster, "KUBELET_PORT").await
}

/// A client for a component's own HTTPS port on loopback (`port_key` in
/// the cluster's `ports.env`), with the admin credentials.
pub async fn component_client(cluster: &TestCluster, port_key: &str) -> Result<Client> {
    let ports = cluster.state_dir().join("ports.env");
    let text =
        std::fs::read_to_string(&ports).with_context(|| format!("reading {}", ports.display()))?;
    let port = text
        .lines()
        .find_map(|l| l.strip_prefix(port_key)?.strip_prefix('='))
        .with_context(|| format!("no {port_key} in {}", ports.display()))?;
    let kubeconfig = Kubeconfig::read_from(cluster.kubeconfig())?;
    let mut config =
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.cluster_url = format!("https://127.0.0.1:{}", port.trim()).parse()?;
    Ok(Client::try_from(config)?)
}

/// A component's metrics (a client from [`component_client`]).
pub async fn component_metrics(component: &Client) -> Result<String> {
    metrics_of(component, "a component").await
}

/// The API server's own metrics.
pub async fn apiserver_metrics(client: &Client) -> Result<String> {
    metrics_of(client, "the API server").await
}

/// `GET /metrics` on whatever `client` points at (`whose` names it in
/// errors).
async fn metrics_of(client: &Client, whose: &str) -> Result<String> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .context("building the request")?;
    client
        .request_text(req)
        .await
        .with_context(|| format!("reading {whose}'s metrics"))
}

/// ResourceClaim events the API server has sent to watchers since it
/// started: one per event and watcher (the fan-out).
pub fn claim_watch_events(apiserver_metrics: &str) -> f64 {
    sum_counter(
        apiserver_metrics,
        "apiserver_watch_events_total",
        &[("resource", "resourceclaims")],
    )
}

/// ResourceClaim watches open now.
pub fn claim_watchers(apiserver_metrics: &str) -> f64 {
    sum_counter(
        apiserver_metrics,
        "apiserver_longrunning_requests",
        &[("resource", "resourceclaims"), ("verb", "WATCH")],
    )
}

/// Writes (create, update, patch, delete) the API server has served on
/// ResourceSlices since it started. Dry runs (a publisher's capability
/// probes) change nothing and are not counted.
pub fn slice_writes(apiserver_metrics: &str) -> f64 {
    [
        "POST",
        "PUT",
        "PATCH",
        "DELETE",
        "DELETECOLLECTION",
        "APPLY",
    ]
    .iter()
    .map(|verb| {
        sum_counter(
            apiserver_metrics,
            "apiserver_request_total",
            &[
                ("resource", "resourceslices"),
                ("verb", verb),
                ("dry_run", ""),
            ],
        )
    })
    .sum()
}

/// The kubelet's view of one DRA method of one driver.
pub fn kubelet_histogram(metrics: &str, driver: &str, method: &str) -> Histogram {
    // The label holds the full gRPC method (`/k8s.io...DRAPlugin/<method>`).
    let mut merged = Histogram::default();
    for line in metrics.lines().filter(|l| {
        l.starts_with(KUBELET_HISTOGRAM) && l.contains(&format!("DRAPlugin/{method}\""))
    }) {
        let Some(label) = line
            .split("method_name=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        let h = parse_histogram(
            line,
            KUBELET_HISTOGRAM,
            &[("driver_name", driver), ("method_name", label)],
        );
        for (le, n) in h.buckets {
            match merged.buckets.iter_mut().find(|(b, _)| *b == le) {
                Some(b) => b.1 += n,
                None => merged.buckets.push((le, n)),
            }
        }
        merged.sum += h.sum;
        merged.count += h.count;
    }
    merged.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    merged
}

/// The kubelet's prepare and unprepare histograms over a pods run.
#[derive(Debug, Clone, Serialize)]
pub struct PodsResult {
    pub pods: usize,
    /// One pod created every this long (0: all at once).
    pub every_ms: f64,
    pub prepare: KubeletView,
    pub unprepare: KubeletView,
    /// From the first pod created to all running.
    pub all_running_s: f64,
    /// Per pod, from its create call's return to the first watch event that
    /// says it runs (the bench's clock, a watch opened before the creates).
    pub creation_to_running: Summary,
    /// Pods whose claims the kubelet could not read at first: the node
    /// authorizer did not know the pod's binding yet. Kubernetes' kubelet
    /// tries again only at its next pod resync (`syncFrequency`, a minute),
    /// whichever the driver; the driver was not called for them.
    pub refused_by_node_authorizer: Vec<String>,
    /// [`Self::creation_to_running`] of the other pods.
    pub creation_to_running_unrefused: Summary,
    /// Where the pods' start went, from the first create to all running.
    pub stages: Stages,
    /// Requests on claims (`resourceclaims`, `resourceclaims/status`) per
    /// pod, every client together, from the claims' creation to every
    /// unprepare counted: the driver's are `GET resourceclaims` and the
    /// writes of `status`; the scheduler and the controller manager add the
    /// same for both drivers.
    pub api_requests_per_pod: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct KubeletView {
    pub calls: f64,
    pub mean_ms: f64,
    /// Estimated from the histogram's buckets (as `histogram_quantile`).
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl KubeletView {
    fn of(h: &Histogram) -> Self {
        KubeletView {
            calls: h.count,
            mean_ms: h.mean() * 1e3,
            p50_ms: h.quantile(0.5) * 1e3,
            p99_ms: h.quantile(0.99) * 1e3,
        }
    }
}

/// A pods run: `pods` pods of one claim each (a claim of `class` per pod)
/// on `node`, running `image`.
#[derive(Debug, Clone)]
pub struct PodsRun {
    pub node: String,
    pub driver: String,
    pub class: String,
    pub image: String,
    pub pods: usize,
    pub timeout: Duration,
    /// Capacity each claim requests (`NAME` -> quantity): a share.
    pub capacity: BTreeMap<String, String>,
    /// Pods created one every this long (an arrival schedule, open loop);
    /// zero: all at once.
    pub every: Duration,
}

/// Creates the run's pods (at once, or on a schedule), waits until they
/// run, deletes them;
/// the kubelet's histogram deltas and where the pods' start went.
pub async fn pods_run(start: &PodStart, ns: &TestNamespace, run: &PodsRun) -> Result<PodsResult> {
    let kubelet = start.kubelet();
    let PodsRun {
        node,
        driver,
        class,
        image,
        pods,
        timeout,
        capacity,
        every,
    } = run;
    let (node, driver, pods, timeout) = (node.as_str(), driver.as_str(), *pods, *timeout);
    let pp = PostParams::default();
    let requests = || async {
        let metrics = apiserver_metrics(ns.client()).await?;
        anyhow::Ok(requests_of(&metrics, &super::grpc::CLAIM_RESOURCES))
    };
    let requests_before = requests().await?;
    // One named claim per pod, created first: the API server's node
    // authorizer then knows the pod -> claim edge from the pod's spec when
    // the kubelet reads the claim. (Claims from a template are named in the
    // pod's status; a kubelet that reads one before that edge arrives is
    // refused and backs off for about a minute, whichever the driver.)
    let claims = ns.api::<ResourceClaim>();
    for i in 0..pods {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": format!("bench-{i:03}") },
            "spec": { "devices": { "requests": [{
                "name": "gpu", "exactly": exactly(class, capacity),
            }]}},
        }))?;
        claims.create(&pp, &claim).await?;
    }
    let before = component_metrics(kubelet).await?;
    let stages_before = start.read(&before).await?;
    let cpu = start.sample_cpu();
    let api = ns.api::<Pod>();
    let running = RunningWatch::start(api.clone()).await?;
    let mut created = BTreeMap::new();
    let began = Instant::now();
    for i in 0..pods {
        // The schedule, not a wait for anything: the i-th pod arrives at
        // i * every whatever the earlier ones do.
        tokio::time::sleep_until((began + *every * i as u32).into()).await;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": format!("bench-{i:03}"), "labels": { "app": "bench" } },
            "spec": {
                "nodeName": null,
                "nodeSelector": { "kubernetes.io/hostname": node },
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": false,
                "resourceClaims": [{ "name": "gpu", "resourceClaimName": format!("bench-{i:03}") }],
                "containers": [{
                    "name": "main", "image": image, "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sleep", "3600"],
                    "resources": { "claims": [{ "name": "gpu" }] },
                }],
            },
        }))?;
        api.create(&pp, &pod).await?;
        created.insert(format!("bench-{i:03}"), Instant::now());
    }
    let lp = ListParams::default().labels("app=bench");
    let seen = running.wait_all(pods, timeout).await?;
    let stages_after = start.read(&component_metrics(kubelet).await?).await?;
    let cpu = cpu.stop().await?;
    let all_running_s = (seen.values().max().copied().unwrap_or(began) - began).as_secs_f64();
    let latency = |name: &String| {
        seen.get(name).map_or(Duration::ZERO, |r| {
            r.saturating_duration_since(created[name])
        })
    };
    let latencies: Vec<Duration> = created.keys().map(latency).collect();
    let refused = refused_claim_reads(ns).await?;
    let unrefused: Vec<Duration> = (created.keys())
        .filter(|name| !refused.contains(*name))
        .map(latency)
        .collect();
    let last_unrefused = (seen.iter())
        .filter(|(name, _)| !refused.contains(*name))
        .map(|(_, at)| *at)
        .max()
        .unwrap_or(began);
    let stages = Stages::between(
        &stages_before,
        &stages_after,
        &cpu,
        last_unrefused,
        unrefused.len(),
    );
    api.delete_collection(&DeleteParams::default().grace_period(0), &lp)
        .await?;
    wait_for("every bench pod gone", timeout, || async {
        Ok(api.list(&lp).await?.items.is_empty().then_some(()))
    })
    .await?;
    // The kubelet unprepares after the pod object is gone too (its pod
    // workers finish on their own): wait until it counted every call.
    let after = wait_for("the kubelet to count every unprepare", timeout, || async {
        let text = component_metrics(kubelet).await?;
        let done = kubelet_histogram(&text, driver, "NodeUnprepareResources")
            .since(&kubelet_histogram(
                &before,
                driver,
                "NodeUnprepareResources",
            ))
            .count;
        Ok((done >= pods as f64).then_some(text))
    })
    .await?;
    let delta = |method| {
        kubelet_histogram(&after, driver, method).since(&kubelet_histogram(&before, driver, method))
    };
    let requests_after = requests().await?;
    Ok(PodsResult {
        pods,
        every_ms: every.as_secs_f64() * 1e3,
        prepare: KubeletView::of(&delta("NodePrepareResources")),
        unprepare: KubeletView::of(&delta("NodeUnprepareResources")),
        all_running_s,
        creation_to_running: Summary::of(&latencies, pods, Duration::from_secs_f64(all_running_s)),
        creation_to_running_unrefused: Summary::of(
            &unrefused,
            unrefused.len(),
            Duration::from_secs_f64(all_running_s),
        ),
        refused_by_node_authorizer: refused,
        stages,
        api_requests_per_pod: requests_delta(&requests_before, &requests_after, pods as f64),
    })
}

/// The pods whose `FailedPrepareDynamicResources` Event says the kubelet
/// was refused reading a claim by the node authorizer.
async fn refused_claim_reads(ns: &TestNamespace) -> Result<Vec<String>> {
    let events = ns.api::<Event>().list(&ListParams::default()).await?;
    let mut pods: Vec<String> = events
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("FailedPrepareDynamicResources"))
        .filter(|e| {
            e.message
                .as_deref()
                .is_some_and(|m| m.contains("no relationship found"))
        })
        .filter_map(|e| e.involved_object.name)
        .collect();
    pods.sort();
    pods.dedup();
    Ok(pods)
}

/// A request's `exactly`: the class, and the capacity a share asks for.
fn exactly(class: &str, capacity: &BTreeMap<String, String>) -> serde_json::Value {
    if capacity.is_empty() {
        json!({ "deviceClassName": class })
    } else {
        json!({ "deviceClassName": class, "capacity": { "requests": capacity } })
    }
}

/// When each pod of a namespace was first seen running, from a watch
/// opened before the pods are created.
struct RunningWatch {
    seen: std::sync::Arc<std::sync::Mutex<BTreeMap<String, Instant>>>,
    failed: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningWatch {
    async fn start(api: Api<Pod>) -> Result<Self> {
        use futures::StreamExt;
        use kube::runtime::{WatchStreamExt, watcher};
        let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::new()));
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (s, f) = (seen.clone(), failed.clone());
        let task = tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default().labels("app=bench"))
                .default_backoff()
                .boxed();
            let mut ready = Some(ready_tx);
            while let Some(Ok(event)) = events.next().await {
                if let watcher::Event::InitDone = event
                    && let Some(tx) = ready.take()
                {
                    let _ = tx.send(());
                }
                let (watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) = event else {
                    continue;
                };
                let name = pod.metadata.name.clone().unwrap_or_default();
                match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
                    Some("Running") => {
                        s.lock()
                            .expect("not poisoned")
                            .entry(name)
                            .or_insert_with(Instant::now);
                    }
                    Some("Failed") => *f.lock().expect("not poisoned") = Some(name),
                    _ => {}
                }
            }
        });
        ready_rx
            .await
            .context("the pod watch ended before its first list")?;
        Ok(RunningWatch { seen, failed, task })
    }

    /// Waits until `pods` pods were seen running; when each was.
    async fn wait_all(self, pods: usize, timeout: Duration) -> Result<BTreeMap<String, Instant>> {
        let result = wait_for("every bench pod running", timeout, || async {
            if let Some(name) = self.failed.lock().expect("not poisoned").clone() {
                bail!("pod {name} failed");
            }
            let seen = self.seen.lock().expect("not poisoned");
            Ok((seen.len() >= pods).then(|| seen.clone()))
        })
        .await;
        self.task.abort();
        result
    }
}

/// Whether `driver` has published a slice for `pool`.
pub async fn has_slice(client: &Client, driver: &str, pool: &str) -> Result<bool> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.driver={driver}"));
    Ok(slices
        .list(&lp)
        .await?
        .items
        .iter()
        .any(|s| s.spec.pool.name == pool))
}

/// Waits for the first slice of `driver` for `pool`, then returns how long
/// after the start of the process in `pid_file` (first word: the pid) it
/// was seen. Times are kernel boot-time clock ticks, so the start of a
/// process launched by someone else is measured too.
pub async fn first_slice(
    client: &Client,
    driver: &str,
    pool: &str,
    pid_file: &Path,
    timeout: Duration,
) -> Result<Duration> {
    let deadline = Instant::now() + timeout;
    // Poll tightly: the answer is a latency, and a list is cheap here.
    let seen = loop {
        if has_slice(client, driver, pool).await? {
            break boot_time()?;
        }
        if Instant::now() > deadline {
            bail!("no slice of {driver} for {pool} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let pid: u32 = std::fs::read_to_string(pid_file)
        .with_context(|| format!("reading {}", pid_file.display()))?
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no pid in {}", pid_file.display()))?;
    let started = process_start(pid)?;
    Ok(seen.saturating_sub(started))
}

fn boot_time() -> Result<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        bail!("clock_gettime: {}", std::io::Error::last_os_error());
    }
    Ok(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// When a process started, on the boot-time clock (`/proc/<pid>/stat`
/// field 22, in clock ticks).
fn process_start(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces: field 3 first.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let ticks: u64 = after
        .split_whitespace()
        .nth(19)
        .and_then(|t| t.parse().ok())
        .context("no start time in /proc/<pid>/stat")?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dry_runs_are_not_slice_writes() {
        let metrics = "\
apiserver_request_total{code=\"201\",dry_run=\"\",resource=\"resourceslices\",verb=\"APPLY\"} 9
apiserver_request_total{code=\"201\",dry_run=\"All\",resource=\"resourceslices\",verb=\"POST\"} 4
apiserver_request_total{code=\"200\",dry_run=\"\",resource=\"resourceslices\",verb=\"LIST\"} 3
";
        assert_eq!(slice_writes(metrics), 9.0);
    }

    #[test]
    fn claim_fan_out_counts_only_claim_series() {
        let metrics = "\
# TYPE apiserver_watch_events_total counter
apiserver_watch_events_total{group=\"resource.k8s.io\",resource=\"resourceclaims\",version=\"v1\"} 1200
apiserver_watch_events_total{group=\"resource.k8s.io\",resource=\"resourceslices\",version=\"v1\"} 50
apiserver_watch_events_total_other{resource=\"resourceclaims\"} 7
apiserver_longrunning_requests{component=\"apiserver\",group=\"resource.k8s.io\",resource=\"resourceclaims\",scope=\"cluster\",subresource=\"\",verb=\"WATCH\",version=\"v1\"} 2
apiserver_longrunning_requests{component=\"apiserver\",group=\"resource.k8s.io\",resource=\"resourceclaims\",scope=\"namespace\",subresource=\"\",verb=\"WATCH\",version=\"v1\"} 1
apiserver_longrunning_requests{component=\"apiserver\",group=\"\",resource=\"pods\",scope=\"cluster\",subresource=\"\",verb=\"WATCH\",version=\"v1\"} 9
";
        assert_eq!(claim_watch_events(metrics), 1200.0);
        assert_eq!(claim_watchers(metrics), 3.0);
    }
}
