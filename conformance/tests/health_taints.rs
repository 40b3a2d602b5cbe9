//! GPU health in the slices, through the real kubelet and kube-scheduler:
//! `tessera plugin` (simulated 2 x L4, a driver name unique to this run,
//! `--xid-recovery-seconds`) runs a Pod on a whole GPU; an injected XID 79
//! on that GPU makes it Unhealthy in the Pod's status and taints every
//! device of the GPU in its slice (`<driver>/unhealthy=xid-79`, NoSchedule;
//! effect None on the monitoring device) within seconds, with a Warning
//! Event on the Node. Once the Pod is gone the scheduler does not allocate
//! the tainted GPU: a claim pinned to it stays unallocated (its Pod
//! Unschedulable) while a claim for any whole GPU gets the other one. When
//! the GPU recovers the taint goes (a Normal Event says so) and the pinned
//! claim is allocated and its Pod runs.

mod plugin_support;

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use tessera_conformance::{TestCluster, TestNamespace, unique_name, wait_for};

use plugin_support::*;

/// Seconds after its last fatal XID a GPU counts as Healthy again.
const RECOVERY_SECONDS: u64 = 30;
/// "Within seconds": from the XID to the taint in the slice.
const TAINT_DEADLINE: Duration = Duration::from_secs(15);

#[tokio::test]
async fn an_xid_79_taints_the_gpu_the_scheduler_avoids_it_and_recovery_untaints_it() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let Some(kubelet) = cluster.kubelet().cloned() else {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to check");
        return Ok(());
    };
    if cluster.feature_gate("DRADeviceTaints") == Some(false) {
        eprintln!("the cluster runs with DRADeviceTaints off: no taints to check");
        return Ok(());
    }
    let id = unique_name("ht");
    let driver = format!("{id}.tessera.dev");
    let node = cluster.node_name().to_owned();
    let ns = cluster.create_namespace("health-taints").await?;
    let dirs = PluginDirs::for_kubelet(&kubelet)?;
    let events = dirs.path("xid-events");
    std::fs::write(&events, "")?;

    let mut plugin = PluginProcess::start(
        &dirs,
        &PluginOptions {
            node: node.clone(),
            driver: driver.clone(),
            kubeconfig: cluster.kubeconfig().to_path_buf(),
            kubelet: Some(kubelet.clone()),
            topology: repo_root().join("driver/fake-nvml/topologies/l4x2.yaml"),
            args: vec![
                "--xid-recovery-seconds".into(),
                RECOVERY_SECONDS.to_string(),
            ],
            log: "plugin.log".into(),
            events: Some(events.clone()),
        },
    )?;
    let result = run(&cluster, &ns, &driver, &id, &events, &mut plugin).await;
    for pod in ["pinned-pod", "any-pod"] {
        let _ = ns
            .api::<Pod>()
            .delete(pod, &DeleteParams::default().grace_period(0))
            .await;
    }
    finish_kubelet_test(&cluster, &ns, &driver, &id, plugin, result).await
}

/// Our devices in the published slices, as JSON.
async fn published(cluster: &TestCluster, driver: &str) -> Result<Vec<Value>> {
    let slices: Api<ResourceSlice> = Api::all(cluster.client());
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.driver={driver}")))
        .await?;
    list.items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| Ok(serde_json::to_value(d)?))
        .collect()
}

fn attr<'a>(device: &'a Value, name: &str) -> &'a str {
    device["attributes"][name]["string"]
        .as_str()
        .unwrap_or_default()
}

/// The GPU a device is on.
fn gpu_of(device: &Value) -> &str {
    match attr(device, "parentUUID") {
        "" => attr(device, "uuid"),
        parent => parent,
    }
}

/// `(key, value, effect)` of each taint of a device.
fn taints(device: &Value) -> Vec<(String, String, String)> {
    device["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let s = |k: &str| t[k].as_str().unwrap_or_default().to_owned();
            (s("key"), s("value"), s("effect"))
        })
        .collect()
}

/// Whether every device of `gpu` carries exactly our health taint (None on
/// the monitoring device, NoSchedule on the others) and no other device
/// carries any; `Err` when a device of another GPU is tainted.
fn tainted_as_expected(devices: &[Value], driver: &str, gpu: &str) -> Result<bool> {
    let key = format!("{driver}/unhealthy");
    let mut all = !devices.is_empty();
    for d in devices {
        let t = taints(d);
        if gpu_of(d) != gpu {
            ensure!(
                t.is_empty(),
                "{} of a healthy GPU is tainted: {t:?}",
                d["name"]
            );
            continue;
        }
        let effect = if attr(d, "type") == "monitor" {
            "None"
        } else {
            "NoSchedule"
        };
        all &= t == [(key.clone(), "xid-79".to_owned(), effect.to_owned())];
    }
    Ok(all)
}

/// Events the plugin recorded on the Node with `reason`, naming `gpu`.
async fn node_events(
    cluster: &TestCluster,
    driver: &str,
    reason: &str,
    gpu: &str,
) -> Result<Vec<Event>> {
    let api: Api<Event> = Api::namespaced(cluster.client(), "default");
    let list = api
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind=Node,involvedObject.name={},reason={reason}",
            cluster.node_name()
        )))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|e| {
            e.reporting_component.as_deref() == Some(&format!("{driver}-plugin"))
                && e.message.as_deref().is_some_and(|m| m.contains(gpu))
        })
        .collect())
}

/// A claim for one whole GPU of class `class`, narrowed by `selector`, and
/// a Pod using it.
async fn claim_and_pod(
    ns: &TestNamespace,
    class: &str,
    name: &str,
    selector: Option<String>,
) -> Result<()> {
    let pp = PostParams::default();
    let mut exactly = json!({ "deviceClassName": class });
    if let Some(cel) = selector {
        exactly["selectors"] = json!([{ "cel": { "expression": cel } }]);
    }
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": exactly }] } },
    }))?;
    ns.api::<ResourceClaim>().create(&pp, &claim).await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": format!("{name}-pod") },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": name }],
            "containers": [{
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
        },
    }))?;
    ns.api::<Pod>().create(&pp, &pod).await?;
    Ok(())
}

/// The device allocated to a claim, once it is allocated.
async fn allocated_device(claims: &Api<ResourceClaim>, name: &str) -> Result<Option<String>> {
    let c = claims.get(name).await?;
    Ok(c.status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .and_then(|r| r.into_iter().next())
        .map(|r| r.device))
}

/// The Pod's PodScheduled condition says Unschedulable.
fn unschedulable(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
}

fn inject(events: &std::path::Path, gpu: &str) -> Result<()> {
    let mut f = std::fs::OpenOptions::new().append(true).open(events)?;
    writeln!(f, "{gpu} 79")?;
    Ok(())
}

async fn run(
    cluster: &TestCluster,
    ns: &TestNamespace,
    driver: &str,
    id: &str,
    events: &std::path::Path,
    plugin: &mut PluginProcess,
) -> Result<()> {
    let pods = whole_gpu_pod(cluster, ns, driver, id, plugin).await?;
    let running = wait_for("gpu-pod Running", TIMEOUT * 2, || {
        let alive = plugin.check_running();
        let pods = pods.clone();
        async move {
            alive?;
            let p = pods.get("gpu-pod").await?;
            let phase = p.status.as_ref().and_then(|s| s.phase.clone());
            Ok((phase.as_deref() == Some("Running")).then_some(p))
        }
    })
    .await?;
    let claim_name = running
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|v| v.iter().find(|c| c.name == "gpu"))
        .and_then(|c| c.resource_claim_name.clone())
        .context("pod status names no claim")?;
    let claims: Api<ResourceClaim> = ns.api();
    let sick = status_gpu_uuid(&claims, &claim_name).await?;
    let devices = published(cluster, driver).await?;
    let whole_of = |gpu: &str| {
        devices
            .iter()
            .find(|d| attr(d, "type") == "gpu" && gpu_of(d) == gpu)
            .and_then(|d| d["name"].as_str())
            .map(str::to_owned)
    };
    let sick_whole = whole_of(&sick).context("no whole-GPU device of the Pod's GPU")?;
    let other = devices
        .iter()
        .map(gpu_of)
        .find(|g| !g.is_empty() && *g != sick)
        .context("a second GPU")?
        .to_owned();
    let other_whole = whole_of(&other).context("no whole-GPU device of the other GPU")?;
    ensure!(
        devices.iter().all(|d| taints(d).is_empty()),
        "devices are tainted before any XID"
    );

    // The GPU falls off the bus.
    let injected = Instant::now();
    inject(events, &sick)?;
    wait_for(
        "the sick GPU's devices tainted in the slice",
        TAINT_DEADLINE,
        || async {
            let devices = published(cluster, driver).await?;
            Ok(tainted_as_expected(&devices, driver, &sick)?.then_some(()))
        },
    )
    .await?;
    eprintln!(
        "XID 79 -> taint in the slice after {:?}",
        injected.elapsed()
    );
    wait_for("the Pod's GPU Unhealthy in its status", TIMEOUT, || {
        let pods = pods.clone();
        async move {
            let p = serde_json::to_value(pods.get("gpu-pod").await?.status)?;
            let unhealthy = p["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|c| {
                    c["allocatedResourcesStatus"]
                        .as_array()
                        .into_iter()
                        .flatten()
                })
                .flat_map(|r| r["resources"].as_array().into_iter().flatten())
                .any(|r| r["health"] == "Unhealthy");
            Ok(unhealthy.then_some(()))
        }
    })
    .await?;
    let warned = wait_for("a GpuUnhealthy Event on the Node", TIMEOUT, || async {
        let found = node_events(cluster, driver, "GpuUnhealthy", &sick).await?;
        Ok(found.into_iter().next())
    })
    .await?;
    ensure!(warned.type_.as_deref() == Some("Warning"), "{warned:?}");
    let message = warned.message.unwrap_or_default();
    ensure!(
        message.contains("XID 79") && message.contains(&format!("{driver}/unhealthy")),
        "event message {message:?} names neither the XID nor the taint"
    );

    // The workload goes; its GPU stays tainted.
    pods.delete("gpu-pod", &DeleteParams::default().grace_period(0))
        .await?;
    wait_for("the Pod's claim gone", TIMEOUT, || {
        let (claims, pods, name) = (claims.clone(), pods.clone(), claim_name.clone());
        async move {
            let claim_gone = claims.get_opt(&name).await?.is_none();
            let pod_gone = pods.get_opt("gpu-pod").await?.is_none();
            Ok((claim_gone && pod_gone).then_some(()))
        }
    })
    .await?;

    // A claim for exactly the sick GPU, and one for any whole GPU. Another
    // fatal XID first restarts the recovery clock, so that recovery cannot
    // come before the scheduler has decided.
    inject(events, &sick)?;
    let attribute = format!("device.attributes[{driver:?}].uuid");
    claim_and_pod(ns, id, "pinned", Some(format!("{attribute} == {sick:?}"))).await?;
    claim_and_pod(ns, id, "any", None).await?;
    let got = wait_for("the claim for any whole GPU allocated", TIMEOUT, || {
        allocated_device(&claims, "any")
    })
    .await?;
    ensure!(
        got == other_whole,
        "the claim for any whole GPU got {got}, not the healthy GPU's {other_whole}"
    );
    wait_for("the pinned Pod Unschedulable", TIMEOUT, || {
        let pods = pods.clone();
        async move { Ok(unschedulable(&pods.get("pinned-pod").await?).then_some(())) }
    })
    .await?;
    ensure!(
        allocated_device(&claims, "pinned").await?.is_none(),
        "the claim pinned to the tainted GPU was allocated"
    );
    let devices = published(cluster, driver).await?;
    if !tainted_as_expected(&devices, driver, &sick)? {
        bail!(
            "the GPU recovered before the scheduler's decision could be checked \
             (recovery after {RECOVERY_SECONDS}s)"
        );
    }

    // Recovery: the taint goes, and the pinned claim gets the GPU.
    wait_for(
        "the taint removed after recovery",
        Duration::from_secs(RECOVERY_SECONDS) + TIMEOUT,
        || async {
            let devices = published(cluster, driver).await?;
            Ok((!devices.is_empty() && devices.iter().all(|d| taints(d).is_empty())).then_some(()))
        },
    )
    .await?;
    wait_for("a GpuHealthy Event on the Node", TIMEOUT, || async {
        let found = node_events(cluster, driver, "GpuHealthy", &sick).await?;
        Ok(found.into_iter().next())
    })
    .await?;
    let got = wait_for(
        "the pinned claim allocated after recovery",
        TIMEOUT * 2,
        || allocated_device(&claims, "pinned"),
    )
    .await?;
    ensure!(
        got == sick_whole,
        "the pinned claim got {got}, not {sick_whole}"
    );
    wait_for("the pinned Pod Running", TIMEOUT * 2, || {
        let pods = pods.clone();
        async move {
            let p = pods.get("pinned-pod").await?;
            let phase = p.status.and_then(|s| s.phase);
            Ok((phase.as_deref() == Some("Running")).then_some(()))
        }
    })
    .await?;
    Ok(())
}
