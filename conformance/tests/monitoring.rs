//! A monitoring agent on a busy GPU, through the real kube-scheduler,
//! kubelet and containers: a workload Pod holds a whole GPU (its counters
//! charged); a claim with `adminAccess: true` on the monitoring class,
//! pinned to that GPU, is still allocated (the GPU's monitoring device) and
//! its Pod sees the GPU with `nvidia-smi -L`. The same claim on the
//! whole-GPU class, as other drivers document monitoring, stays Pending
//! with the scheduler's "cannot allocate all claims" where the whole GPU
//! consumes counters (the full model). The monitoring class without admin
//! access is refused at prepare with an error naming the claim, the request
//! and the fix.
//!
//! Pods must really run (nvidia-smi in the container), so the test needs
//! the cluster's real container runtime and uses the node process on the
//! kubelet's node (`cluster.sh node-start`): one already running is used
//! with its driver name; otherwise it is started over
//! `a100-40gb-x2-mig.yaml` and stopped and removed after.

mod plugin_support;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tessera_conformance::{
    ClusterEnv, TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};

use plugin_support::cluster::{PodNode, delete_pods, log_with, probe_image};

const TOPOLOGY: &str = "a100-40gb-x2-mig.yaml";
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread")]
async fn an_admin_access_claim_monitors_a_gpu_a_workload_holds() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    let Some(node) = PodNode::start(&env, "what nvidia-smi printed in a pod", TOPOLOGY, &[])?
    else {
        return Ok(());
    };
    let cluster = TestCluster::shared().await?;
    let id = unique_name("mon");
    let ns = cluster.create_namespace("monitoring").await?;
    let classes: Api<DeviceClass> = Api::all(cluster.client());

    let result = run(&cluster, &ns, &node.driver, &id).await;

    // Unprepared before the node process may stop.
    delete_pods(&ns).await;
    let _ = ns.delete().await;
    for class in [format!("{id}-gpu"), format!("{id}-monitor")] {
        let _ = delete_ignore_missing(&classes, &class).await;
    }
    node.stop(&env);
    result
}

fn pod(name: &str, claim: &str, command: &str) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "restartPolicy": "Never",
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": claim }],
            "containers": [{
                "name": "main",
                "image": probe_image(),
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", command],
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
        },
    }))?)
}

async fn claim(ns: &TestNamespace, name: &str, exactly: serde_json::Value) -> Result<()> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": exactly }] } },
    }))?;
    ns.api::<ResourceClaim>()
        .create(&PostParams::default(), &claim)
        .await?;
    Ok(())
}

/// `gpuUUID` of the claim's first device in `status.devices`, once there.
async fn status_gpu(claims: &Api<ResourceClaim>, name: &str) -> Result<String> {
    wait_for("status.devices with the GPU UUID", TIMEOUT, || async {
        let c = claims.get(name).await?;
        Ok(c.status
            .and_then(|s| s.devices)
            .and_then(|d| d.into_iter().next())
            .and_then(|d| d.data)
            .and_then(|d| {
                d.0.get("gpuUUID")
                    .and_then(|v| v.as_str())
                    .map(str::to_owned)
            }))
    })
    .await
}

async fn run(cluster: &TestCluster, ns: &TestNamespace, driver: &str, id: &str) -> Result<()> {
    let pp = PostParams::default();
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    for (suffix, ty) in [("gpu", "gpu"), ("monitor", "monitor")] {
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": { "name": format!("{id}-{suffix}") },
            "spec": { "selectors": [{ "cel": { "expression": format!(
                "device.driver == {driver:?} && device.attributes[{driver:?}].type == {ty:?}"
            ) } }] },
        }))?;
        classes.create(&pp, &class).await?;
    }
    // Admin access needs the namespace label.
    Api::<Namespace>::all(cluster.client())
        .patch(
            ns.name(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": {
                "resource.kubernetes.io/admin-access": "true"
            } } })),
        )
        .await?;
    let pods: Api<Pod> = ns.api();
    let claims: Api<ResourceClaim> = ns.api();

    // A workload holds a whole GPU.
    claim(
        ns,
        "workload",
        json!({ "deviceClassName": format!("{id}-gpu") }),
    )
    .await?;
    pods.create(
        &pp,
        &pod("workload", "workload", "nvidia-smi -L && exec sleep 3600")?,
    )
    .await?;
    let gpu = status_gpu(&claims, "workload").await?;
    log_with(&pods, "workload", &gpu).await?;

    // A monitoring claim for exactly that GPU, with admin access.
    claim(
        ns,
        "monitor",
        json!({
            "deviceClassName": format!("{id}-monitor"),
            "adminAccess": true,
            "selectors": [{ "cel": { "expression": format!(
                "device.attributes[{driver:?}].uuid == {gpu:?}"
            ) } }],
        }),
    )
    .await?;
    pods.create(
        &pp,
        &pod(
            "monitor",
            "monitor",
            "nvidia-smi -L; nvidia-smi --query-gpu=uuid,name --format=csv,noheader; \
             ls /dev/nvidia-uvm 2>&1; echo monitor-done; exec sleep 3600",
        )?,
    )
    .await?;
    // The last line, so every check below sees the whole output.
    let log = log_with(&pods, "monitor", "monitor-done").await?;
    eprintln!("the monitoring pod, beside a workload on {gpu}, printed:\n{log}");
    ensure!(
        log.contains(&format!("(UUID: {gpu})")),
        "the monitor's nvidia-smi -L does not list {gpu}:\n{log}"
    );
    ensure!(
        log.contains("No such file"),
        "the monitoring container has /dev/nvidia-uvm (CUDA's device):\n{log}"
    );
    let allocated = claims.get("monitor").await?;
    let results = allocated
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default();
    ensure!(
        results.len() == 1
            && results[0].device.ends_with("-monitor")
            && results[0].admin_access == Some(true),
        "the monitoring claim's allocation: {results:?}"
    );
    // The workload still holds its GPU and runs.
    let workload = pods.get("workload").await?;
    ensure!(
        workload.status.and_then(|s| s.phase).as_deref() == Some("Running"),
        "the workload stopped"
    );

    // Admin access on the whole-GPU class instead: the scheduler checks the
    // GPU's counters, which the workload holds.
    if whole_gpu_consumes_counters(cluster, driver, &gpu).await? {
        claim(
            ns,
            "admin-whole",
            json!({
                "deviceClassName": format!("{id}-gpu"),
                "adminAccess": true,
                "selectors": [{ "cel": { "expression": format!(
                    "device.attributes[{driver:?}].uuid == {gpu:?}"
                ) } }],
            }),
        )
        .await?;
        pods.create(&pp, &pod("admin-whole", "admin-whole", "exec sleep 3600")?)
            .await?;
        let why = wait_for("pod admin-whole unschedulable", TIMEOUT, || async {
            let pod = pods.get("admin-whole").await?;
            if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) {
                bail!("pod admin-whole was scheduled to {node}: admin access on the whole GPU was allocated beside the workload");
            }
            Ok(pod
                .status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .find(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                })
                .map(|c| c.message.unwrap_or_default()))
        })
        .await?;
        ensure!(
            why.contains("cannot allocate all claims"),
            "pod admin-whole is unschedulable for another reason: {why}"
        );
    } else {
        eprintln!(
            "the whole GPU consumes no counters (static model): admin access on it is not refused by the scheduler"
        );
    }

    // Without admin access the same device is refused at prepare, with the
    // claim, the request and the fix named.
    claim(
        ns,
        "not-admin",
        json!({
            "deviceClassName": format!("{id}-monitor"),
            "selectors": [{ "cel": { "expression": format!(
                "device.attributes[{driver:?}].uuid == {gpu:?}"
            ) } }],
        }),
    )
    .await?;
    pods.create(&pp, &pod("not-admin", "not-admin", "exec sleep 3600")?)
        .await?;
    let events: Api<Event> = ns.api();
    let refused = wait_for(
        "the kubelet's event for the refused prepare",
        TIMEOUT,
        || {
            let events = events.clone();
            async move {
                let list = events
                    .list(&ListParams::default().fields("involvedObject.name=not-admin"))
                    .await?;
                Ok(list
                    .items
                    .into_iter()
                    .filter_map(|e| e.message)
                    .find(|m| m.contains("adminAccess")))
            }
        },
    )
    .await?;
    ensure!(
        refused.contains("not-admin")
            && refused.contains("request `gpu`")
            && refused.contains("adminAccess: true"),
        "the error names neither the claim, the request nor the fix: {refused}"
    );
    Ok(())
}

/// Whether the whole-GPU device of `gpu` consumes counters in the node's
/// slices (the full model; the static model publishes none).
async fn whole_gpu_consumes_counters(
    cluster: &TestCluster,
    driver: &str,
    gpu: &str,
) -> Result<bool> {
    let slices = Api::<ResourceSlice>::all(cluster.client())
        .list(&ListParams::default())
        .await?;
    let whole = slices
        .items
        .iter()
        .filter(|s| s.spec.driver == driver)
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| {
            let attr = |k: &str| {
                d.attributes
                    .as_ref()
                    .and_then(|a| a.get(k))
                    .and_then(|v| v.string.as_deref())
            };
            attr("type") == Some("gpu") && attr("uuid") == Some(gpu)
        })
        .with_context(|| format!("no whole-GPU device of {gpu} in the slices of {driver}"))?;
    Ok(whole
        .consumes_counters
        .as_ref()
        .is_some_and(|c| !c.is_empty()))
}
