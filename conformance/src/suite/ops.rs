//! The Kubernetes operations the checks share: create objects in the run's
//! namespace, wait on pod conditions with deadlines (polling, never fixed
//! sleeps), read logs and the scheduler's reasons, follow a pod's claims to
//! the devices they were allocated, and clean up between checks.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

const POLL: Duration = Duration::from_millis(500);

/// A device a pod's claim was allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    pub claim: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
}

impl Allocated {
    pub fn id(&self) -> String {
        format!("{}/{}", self.pool, self.device)
    }
}

/// Every allocation seen of each ResourceClaim of the namespace (by claim
/// name). A pod's claim is deallocated (and a generated one deleted) as soon
/// as the pod finished, so the checks read allocations from this log, kept
/// by a watch from the start of the run.
pub type ClaimLog = Arc<Mutex<BTreeMap<String, Vec<Allocated>>>>;

fn allocation_of(claim: &ResourceClaim) -> Vec<Allocated> {
    let name = claim.metadata.name.clone().unwrap_or_default();
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .map(|r| Allocated {
            claim: name.clone(),
            driver: r.driver.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
        })
        .collect()
}

/// Starts the watch that fills a [`ClaimLog`] and returns once its initial
/// list is done: a claim a check creates afterwards is seen, even one
/// allocated and deleted within a moment (a finished pod's generated
/// claim). Abort the task to stop the watch.
pub async fn watch_claims(
    client: Client,
    ns: &str,
) -> Result<(ClaimLog, tokio::task::JoinHandle<()>)> {
    let log: ClaimLog = Arc::default();
    let api: Api<ResourceClaim> = Api::namespaced(client, ns);
    let (listed, ready) = tokio::sync::oneshot::channel();
    let task = tokio::spawn({
        let log = log.clone();
        async move {
            let mut listed = Some(listed);
            let mut stream = watcher(api, watcher::Config::default())
                .default_backoff()
                .boxed();
            while let Some(event) = stream.next().await {
                let claim = match event {
                    Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c)) => c,
                    Ok(watcher::Event::InitDone) => {
                        if let Some(listed) = listed.take() {
                            let _ = listed.send(());
                        }
                        continue;
                    }
                    _ => continue,
                };
                let allocated = allocation_of(&claim);
                if !allocated.is_empty() {
                    let name = claim.metadata.name.clone().unwrap_or_default();
                    log.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(name, allocated);
                }
            }
        }
    });
    match tokio::time::timeout(Duration::from_secs(60), ready).await {
        Ok(Ok(())) => Ok((log, task)),
        _ => {
            task.abort();
            bail!(
                "the watch of namespace {ns}'s ResourceClaims did not finish its initial list within 60 s"
            )
        }
    }
}

/// The run's namespace on one cluster.
#[derive(Clone)]
pub struct Kube {
    pub client: Client,
    pub ns: String,
    pub timeout: Duration,
    pub claim_log: ClaimLog,
}

impl Kube {
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn claims(&self) -> Api<ResourceClaim> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn templates(&self) -> Api<ResourceClaimTemplate> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// Creates a namespaced object from its JSON form.
    pub async fn create<K>(&self, obj: Value) -> Result<K>
    where
        K: Resource<Scope = NamespaceResourceScope> + Clone + DeserializeOwned + Serialize + Debug,
        K::DynamicType: Default,
    {
        let kind = obj["kind"].as_str().unwrap_or("object").to_owned();
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_owned();
        let typed: K =
            serde_json::from_value(obj).with_context(|| format!("building {kind} {name}"))?;
        Api::<K>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &typed)
            .await
            .with_context(|| format!("creating {kind} {}/{name}", self.ns))
    }

    async fn get_pods(&self, names: &[String]) -> Result<Vec<Pod>> {
        let mut pods = Vec::with_capacity(names.len());
        for n in names {
            pods.push(
                self.pods()
                    .get(n)
                    .await
                    .with_context(|| format!("reading pod {}/{n}", self.ns))?,
            );
        }
        Ok(pods)
    }

    /// Waits until every pod has terminated (Succeeded or Failed).
    pub async fn wait_finished(&self, names: &[String]) -> Result<Vec<Pod>> {
        self.wait_pods(names, "finished", |p| {
            matches!(phase(p), "Succeeded" | "Failed")
        })
        .await
    }

    /// Waits until every pod is scheduled (bound to a node).
    pub async fn wait_scheduled(&self, names: &[String]) -> Result<Vec<Pod>> {
        self.wait_pods(names, "scheduled", |p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
        })
        .await
    }

    async fn wait_pods(
        &self,
        names: &[String],
        what: &str,
        done: impl Fn(&Pod) -> bool,
    ) -> Result<Vec<Pod>> {
        let deadline = self.deadline();
        loop {
            let pods = self.get_pods(names).await?;
            self.record_allocations(&pods).await;
            if pods.iter().all(&done) {
                return Ok(pods);
            }
            if Instant::now() >= deadline {
                let mut why = Vec::new();
                for p in pods.iter().filter(|p| !done(p)) {
                    why.push(self.describe(p).await);
                }
                bail!("not {what} within {:?}: {}", self.timeout, why.join("; "));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Records the allocation of each of `pods`' claims not in the claim log
    /// yet, read now: a second source beside the watch, which misses a
    /// claim allocated and deleted while it relists.
    async fn record_allocations(&self, pods: &[Pod]) {
        let claims = pods
            .iter()
            .filter_map(|p| p.status.as_ref()?.resource_claim_statuses.as_ref())
            .flatten()
            .filter_map(|s| s.resource_claim_name.clone());
        for claim in claims {
            if self
                .claim_log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&claim)
            {
                continue;
            }
            if let Ok(Some(found)) = self.claims().get_opt(&claim).await {
                let allocated = allocation_of(&found);
                if !allocated.is_empty() {
                    self.claim_log
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(claim, allocated);
                }
            }
        }
    }

    /// Waits until the scheduler reports the pod unschedulable and returns
    /// its reason (the PodScheduled condition, or the FailedScheduling event).
    pub async fn wait_unschedulable(&self, name: &str) -> Result<String> {
        let deadline = self.deadline();
        loop {
            let pod = self.pods().get(name).await?;
            if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) {
                bail!("pod {}/{name} was scheduled to node {node}", self.ns);
            }
            if let Some(msg) = unschedulable_message(&pod) {
                let event = self.last_event(name, Some("FailedScheduling")).await;
                return Ok(event.unwrap_or(msg));
            }
            if Instant::now() >= deadline {
                bail!(
                    "the scheduler reported nothing about pod {}/{name} within {:?}: {}",
                    self.ns,
                    self.timeout,
                    self.describe(&pod).await
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until each container of each pod has printed its probe's
    /// output (`PROBE: DONE`), for pods that keep running afterwards.
    pub async fn wait_printed(&self, names: &[String], containers: &[&str]) -> Result<()> {
        let deadline = self.deadline();
        loop {
            let mut missing = Vec::new();
            for n in names {
                for c in containers {
                    let log = self.logs(n, c).await.unwrap_or_default();
                    if !log.lines().any(|l| l.trim_end() == "PROBE: DONE") {
                        missing.push((n.clone(), *c));
                    }
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let mut why = Vec::new();
                for (n, c) in missing {
                    let state = match self.pods().get(&n).await {
                        Ok(p) => self.describe(&p).await,
                        Err(e) => format!("pod {n}: {e}"),
                    };
                    why.push(format!("container {c}: {state}"));
                }
                bail!(
                    "probe output missing after {:?}: {}",
                    self.timeout,
                    why.join("; ")
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    pub async fn logs(&self, pod: &str, container: &str) -> Result<String> {
        let lp = LogParams {
            container: Some(container.to_owned()),
            ..LogParams::default()
        };
        self.pods()
            .logs(pod, &lp)
            .await
            .with_context(|| format!("reading logs of {}/{pod} container {container}", self.ns))
    }

    async fn last_event(&self, pod: &str, reason: Option<&str>) -> Option<String> {
        last_event(&self.client, &self.ns, pod, reason).await
    }

    /// Why a pod is where it is: see [`describe_pod`].
    pub async fn describe(&self, pod: &Pod) -> String {
        describe_pod(&self.client, &self.ns, pod).await
    }

    /// The devices allocated to the claims of a pod, read from claim status.
    pub async fn allocated(&self, pod: &Pod) -> Result<Vec<Allocated>> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let statuses = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.clone())
            .unwrap_or_default();
        let mut claim_names: Vec<String> = statuses
            .into_iter()
            .filter_map(|s| s.resource_claim_name)
            .collect();
        // The claim the scheduler made for the pod's `resources.limits`.
        claim_names.extend(
            pod.status
                .as_ref()
                .and_then(|s| s.extended_resource_claim_status.as_ref())
                .map(|s| s.resource_claim_name.clone()),
        );
        for c in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
        {
            if let Some(n) = &c.resource_claim_name {
                claim_names.push(n.clone());
            }
        }
        claim_names.sort();
        claim_names.dedup();
        if claim_names.is_empty() {
            bail!("pod {}/{name} has no ResourceClaim in its status", self.ns);
        }
        let mut out = Vec::new();
        for c in claim_names {
            let live = match self.claims().get_opt(&c).await {
                Ok(Some(claim)) => allocation_of(&claim),
                Ok(None) => Vec::new(),
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("reading ResourceClaim {}/{c}", self.ns));
                }
            };
            let results = if live.is_empty() {
                self.seen_allocation(&c).await
            } else {
                live
            };
            // A claim the controller generated for the pod again after the
            // pod had run (its status then names the new, never allocated
            // one): the allocation of the pod's own earlier claim, named
            // `<pod>-<pod claim>-<suffix>` as the controller names them.
            let results = if results.is_empty() {
                self.pods_earlier_claim(&name, &c)
            } else {
                results
            };
            if results.is_empty() {
                bail!(
                    "ResourceClaim {}/{c} of pod {name} was never seen allocated",
                    self.ns
                );
            }
            out.extend(results);
        }
        Ok(out)
    }

    /// The allocation the claim watch saw for `claim` (briefly waits for
    /// the watch to catch up).
    fn pods_earlier_claim(&self, pod: &str, claim: &str) -> Vec<Allocated> {
        let Some((prefix, _)) = claim
            .strip_prefix(&format!("{pod}-"))
            .and_then(|rest| rest.rsplit_once('-'))
        else {
            return Vec::new();
        };
        let prefix = format!("{pod}-{prefix}-");
        let log = self.claim_log.lock().unwrap_or_else(|e| e.into_inner());
        let mut earlier = log
            .iter()
            .filter(|(name, a)| name.starts_with(&prefix) && *name != claim && !a.is_empty());
        match (earlier.next(), earlier.next()) {
            (Some((_, allocated)), None) => allocated.clone(),
            _ => Vec::new(),
        }
    }

    async fn seen_allocation(&self, claim: &str) -> Vec<Allocated> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let seen = self
                .claim_log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(claim)
                .cloned();
            match seen {
                Some(a) => return a,
                None if Instant::now() >= deadline => return Vec::new(),
                None => tokio::time::sleep(POLL).await,
            }
        }
    }

    /// Deletes the run's pods, claims and templates and waits until the pods
    /// and claims are gone (so the next check finds the GPUs free).
    pub async fn cleanup(&self) -> Result<()> {
        let dp = DeleteParams::default();
        let lp = ListParams::default();
        self.pods()
            .delete_collection(&dp, &lp)
            .await
            .context("deleting pods")?;
        self.templates()
            .delete_collection(&dp, &lp)
            .await
            .context("deleting ResourceClaimTemplates")?;
        self.claims()
            .delete_collection(&dp, &lp)
            .await
            .context("deleting ResourceClaims")?;
        let deadline = self.deadline();
        loop {
            let pods = self.pods().list(&lp).await?.items.len();
            let claims = self.claims().list(&lp).await?.items.len();
            if pods == 0 && claims == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "{pods} pods and {claims} ResourceClaims still in namespace {} after {:?}",
                    self.ns,
                    self.timeout
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// The message of `pod`'s newest event of `reason` (any warning when `None`).
async fn last_event(client: &Client, ns: &str, pod: &str, reason: Option<&str>) -> Option<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let mut fields = format!("involvedObject.name={pod}");
    if let Some(r) = reason {
        fields.push_str(&format!(",reason={r}"));
    } else {
        fields.push_str(",type=Warning");
    }
    let list = events
        .list(&ListParams::default().fields(&fields))
        .await
        .ok()?;
    list.items
        .into_iter()
        .max_by_key(|e| {
            e.last_timestamp
                .clone()
                .map(|t| t.0)
                .or(e.event_time.clone().map(|t| t.0))
        })
        .and_then(|e| {
            let msg = e.message?;
            Some(match reason {
                Some(_) => msg,
                None => format!("{}: {msg}", e.reason.unwrap_or_default()),
            })
        })
}

/// Why a pod is where it is: phase, node, scheduler message, container
/// states, the last warning event.
pub async fn describe_pod(client: &Client, ns: &str, pod: &Pod) -> String {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let mut s = format!("pod {ns}/{name} is {}", phase(pod));
    match pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) {
        Some(n) => s.push_str(&format!(" on node {n}")),
        None => s.push_str(" (not scheduled)"),
    }
    if let Some(msg) = unschedulable_message(pod) {
        s.push_str(&format!(", scheduler: {msg}"));
    } else if !has_condition(pod, "PodScheduled") {
        // A pod a scheduler plugin's PreEnqueue holds back gets no condition.
        s.push_str(", no PodScheduled condition (the scheduler never tried it)");
    }
    let statuses = pod
        .status
        .as_ref()
        .and_then(|st| st.container_statuses.as_ref());
    for c in statuses.into_iter().flatten() {
        let state = c.state.as_ref();
        if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
            s.push_str(&format!(
                ", container {} waiting: {} {}",
                c.name,
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default()
            ));
        } else if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
            s.push_str(&format!(
                ", container {} exited {} {}",
                c.name,
                t.exit_code,
                t.reason.clone().unwrap_or_default()
            ));
        }
    }
    if let Some(e) = last_event(client, ns, &name, None).await {
        s.push_str(&format!(", last warning: {e}"));
    }
    s.trim_end().to_owned()
}

pub fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

/// Whether the pod's status has a condition of `kind`, whatever its value.
fn has_condition(p: &Pod, kind: &str) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == kind))
}

/// The PodScheduled=False condition's message, if the pod has one.
pub fn unschedulable_message(p: &Pod) -> Option<String> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| {
            format!(
                "{}: {}",
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default()
            )
        })
}
