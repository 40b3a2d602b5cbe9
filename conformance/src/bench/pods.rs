//! Pods through the kubelet: a run of pods of one claim each, created at
//! once or on a schedule, from each create call to the pod running; the
//! kubelet's DRA calls, the requests on claims and where the start went.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde::Serialize;
use serde_json::json;

use super::cluster::{apiserver_metrics, component_metrics, kubelet_histogram};
use super::pod_start::{PodStart, Stages};
use super::stats::{Histogram, Summary, requests_delta, requests_of, sum_counter};
use crate::cluster::{TestNamespace, wait_for};

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
    /// How long the run waited, before its first claim, for the runtime
    /// to stop the pods of the runs before it.
    pub settle_ms: f64,
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
/// run, deletes them; the kubelet's histogram deltas and where the pods'
/// start went.
pub async fn pods_run(start: &PodStart, ns: &TestNamespace, run: &PodsRun) -> Result<PodsResult> {
    let kubelet = start.kubelet();
    let settle = runtime_settled(ns.client(), kubelet, &run.node, run.timeout).await?;
    let requests_before = claim_requests(ns.client()).await?;
    create_claims(ns, run).await?;
    let before = component_metrics(kubelet).await?;
    let stages_before = start.read(&before).await?;
    let cpu = start.sample_cpu();
    let started = start_pods(ns, run).await?;
    let stages_after = start.read(&component_metrics(kubelet).await?).await?;
    let cpu = cpu.stop().await?;
    let refused = refused_claim_reads(ns).await?;
    let held_back = |name: &str| refused.iter().any(|r| r == name);
    let unrefused = started.latencies(|name| !held_back(name));
    let stages = Stages::between(
        &stages_before,
        &stages_after,
        &cpu,
        started.last_running(|name| !held_back(name)),
        unrefused.len(),
    );
    let after = tear_down(ns, kubelet, run, &before).await?;
    let delta = |method| {
        kubelet_histogram(&after, &run.driver, method).since(&kubelet_histogram(
            &before,
            &run.driver,
            method,
        ))
    };
    let requests_after = claim_requests(ns.client()).await?;
    let all_running = started.last_running(|_| true) - started.began;
    Ok(PodsResult {
        pods: run.pods,
        every_ms: run.every.as_secs_f64() * 1e3,
        prepare: KubeletView::of(&delta("NodePrepareResources")),
        unprepare: KubeletView::of(&delta("NodeUnprepareResources")),
        all_running_s: all_running.as_secs_f64(),
        creation_to_running: Summary::of(&started.latencies(|_| true), run.pods, all_running),
        creation_to_running_unrefused: Summary::of(&unrefused, unrefused.len(), all_running),
        settle_ms: settle.as_secs_f64() * 1e3,
        refused_by_node_authorizer: refused,
        stages,
        api_requests_per_pod: requests_delta(&requests_before, &requests_after, run.pods as f64),
    })
}

/// Waits until the kubelet runs no pod sandbox beyond the pods the API
/// server has on `node`: the runs before this one stopped theirs. Their
/// teardown (the network, the pause process, the driver's unprepare) would
/// otherwise fall into this run, on whichever driver comes next. How long
/// it waited.
async fn runtime_settled(
    client: &Client,
    kubelet: &Client,
    node: &str,
    timeout: Duration,
) -> Result<Duration> {
    let began = Instant::now();
    let pods: Api<Pod> = Api::all(client.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    wait_for(
        "the kubelet to stop earlier runs' pods",
        timeout,
        || async {
            let running = sum_counter(
                &component_metrics(kubelet).await?,
                "kubelet_running_pods",
                &[],
            );
            let listed = pods.list(&on_node).await?.items.len() as f64;
            Ok((running <= listed).then_some(()))
        },
    )
    .await?;
    Ok(began.elapsed())
}

/// Requests on claims so far, every client together.
async fn claim_requests(client: &Client) -> Result<BTreeMap<String, f64>> {
    let metrics = apiserver_metrics(client).await?;
    Ok(requests_of(&metrics, &super::grpc::CLAIM_RESOURCES))
}

/// One named claim per pod, created first: the API server's node
/// authorizer then knows the pod -> claim edge from the pod's spec when the
/// kubelet reads the claim. (Claims from a template are named in the pod's
/// status; a kubelet that reads one before that edge arrives is refused
/// and backs off for about a minute, whichever the driver.)
async fn create_claims(ns: &TestNamespace, run: &PodsRun) -> Result<()> {
    let claims = ns.api::<ResourceClaim>();
    for i in 0..run.pods {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": format!("bench-{i:03}") },
            "spec": { "devices": { "requests": [{
                "name": "gpu", "exactly": exactly(&run.class, &run.capacity),
            }]}},
        }))?;
        claims.create(&PostParams::default(), &claim).await?;
    }
    Ok(())
}

/// When each pod was created and first seen running.
struct Started {
    began: Instant,
    created: BTreeMap<String, Instant>,
    running: BTreeMap<String, Instant>,
}

impl Started {
    /// Creation to running of the pods `pick` keeps.
    fn latencies(&self, pick: impl Fn(&str) -> bool) -> Vec<Duration> {
        (self.created.iter())
            .filter(|(name, _)| pick(name))
            .map(|(name, created)| {
                self.running
                    .get(name)
                    .map_or(Duration::ZERO, |r| r.saturating_duration_since(*created))
            })
            .collect()
    }

    /// When the last of the pods `pick` keeps was seen running.
    fn last_running(&self, pick: impl Fn(&str) -> bool) -> Instant {
        (self.running.iter())
            .filter(|(name, _)| pick(name))
            .map(|(_, at)| *at)
            .max()
            .unwrap_or(self.began)
    }
}

/// Creates the pods on the run's schedule and waits until each runs.
async fn start_pods(ns: &TestNamespace, run: &PodsRun) -> Result<Started> {
    let api = ns.api::<Pod>();
    let watch = RunningWatch::start(api.clone()).await?;
    let mut created = BTreeMap::new();
    let began = Instant::now();
    for i in 0..run.pods {
        // The schedule, not a wait for anything: the i-th pod arrives at
        // i * every whatever the earlier ones do.
        tokio::time::sleep_until((began + run.every * i as u32).into()).await;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": format!("bench-{i:03}"), "labels": { "app": "bench" } },
            "spec": {
                "nodeName": null,
                "nodeSelector": { "kubernetes.io/hostname": run.node },
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": false,
                "resourceClaims": [{ "name": "gpu", "resourceClaimName": format!("bench-{i:03}") }],
                "containers": [{
                    "name": "main", "image": run.image, "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sleep", "3600"],
                    "resources": { "claims": [{ "name": "gpu" }] },
                }],
            },
        }))?;
        api.create(&PostParams::default(), &pod).await?;
        created.insert(format!("bench-{i:03}"), Instant::now());
    }
    let running = watch.wait_all(run.pods, run.timeout).await?;
    Ok(Started {
        began,
        created,
        running,
    })
}

/// Deletes the pods and waits until the kubelet counted every unprepare
/// (its pod workers finish after the pod objects are gone); its metrics
/// then.
async fn tear_down(
    ns: &TestNamespace,
    kubelet: &Client,
    run: &PodsRun,
    before: &str,
) -> Result<String> {
    let api = ns.api::<Pod>();
    let lp = ListParams::default().labels("app=bench");
    api.delete_collection(&DeleteParams::default().grace_period(0), &lp)
        .await?;
    wait_for("every bench pod gone", run.timeout, || async {
        Ok(api.list(&lp).await?.items.is_empty().then_some(()))
    })
    .await?;
    let unprepares = |text: &str| kubelet_histogram(text, &run.driver, "NodeUnprepareResources");
    wait_for(
        "the kubelet to count every unprepare",
        run.timeout,
        || async {
            let text = component_metrics(kubelet).await?;
            let done = unprepares(&text).since(&unprepares(before)).count;
            Ok((done >= run.pods as f64).then_some(text))
        },
    )
    .await
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
