//! Extended resources backed by DRA: a Pod written for the device plugin,
//! with only `resources.limits: {<domain>/gpu: 1}` and no claim, gets a
//! whole GPU through the whole-GPU class of `deploy/deviceclasses.yaml`
//! (its `extendedResourceName`), and one with `<domain>/mig-<profile>: 1`
//! a MIG device through a per-profile class like the chart's
//! (`deviceClasses.extendedResources.migProfiles`). The real scheduler
//! makes each Pod's claim, the real kubelet asks Tessera's node process to
//! prepare it, the container's `nvidia-smi -L` lists exactly the device
//! the claim got, and `tessera status` names the Pod. Deleting the Pods
//! unprepares the claims.
//!
//! Runs on the node process of the kubelet's node (`cluster.sh
//! node-start`, as `monitoring.rs` does). The classes get names and
//! resource names of the test's own (the node's driver and selectors
//! unchanged), so runs never share an extended resource.

mod plugin_support;

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::{Value, json};
use tessera_conformance::classes::deploy_classes;
use tessera_conformance::{
    ClusterEnv, TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};

use plugin_support::cluster::{
    PodNode, cluster_env_vars, delete_pods, log_with, node_status, probe_image,
};

/// Whole GPUs and MIG-capable A100s with instances.
const TOPOLOGY: &str = "a100-40gb-x2-mig.yaml";
const TIMEOUT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_asking_resources_limits_gets_a_gpu_and_a_mig_device_through_dra() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    let Some(node) = PodNode::start(&env, "what nvidia-smi printed in a pod", TOPOLOGY, &[])?
    else {
        return Ok(());
    };
    let cluster = TestCluster::shared().await?;
    let id = unique_name("ext");
    let ns = cluster.create_namespace("extended").await?;
    let classes: Api<DeviceClass> = Api::all(cluster.client());

    let result = run(&env, &cluster, &ns, &node.driver, &id).await;

    // Unprepared before the node process may stop.
    delete_pods(&ns).await;
    let _ = ns.delete().await;
    for class in [format!("{id}-gpu"), format!("{id}-mig")] {
        let _ = delete_ignore_missing(&classes, &class).await;
    }
    node.stop(&env);
    result
}

async fn run(
    env: &ClusterEnv,
    cluster: &TestCluster,
    ns: &TestNamespace,
    driver: &str,
    id: &str,
) -> Result<()> {
    let domain = driver.strip_prefix("gpu.").unwrap_or(driver);
    let gpu_resource = format!("{id}.{domain}/gpu");
    let mig_profile = published_mig_profile(cluster, driver).await?;
    let mig_resource = format!("{id}.{domain}/mig-{mig_profile}");

    // The whole-GPU class as deployed, under this test's names.
    let mut gpu_class = deploy_classes(domain)?
        .into_iter()
        .find(|c| c.metadata.name.as_deref() == Some(&format!("gpu.{domain}")))
        .context("deploy/deviceclasses.yaml has no whole-GPU class")?;
    let spec = gpu_class.spec.get_or_insert_default();
    ensure!(
        spec.extended_resource_name.as_deref() == Some(&format!("{domain}/gpu")),
        "deploy/deviceclasses.yaml's whole-GPU class names {:?}, not {domain}/gpu",
        spec.extended_resource_name
    );
    spec.extended_resource_name = Some(gpu_resource.clone());
    gpu_class.metadata.name = Some(format!("{id}-gpu"));
    // A MIG profile's class, as the chart renders it.
    let mig_class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": format!("{id}-mig") },
        "spec": {
            "extendedResourceName": mig_resource,
            "selectors": [{ "cel": { "expression": format!(
                "device.driver == {driver:?} && device.attributes[{driver:?}].type == \"mig\" && \
                 device.attributes[{driver:?}].profile == {mig_profile:?}"
            ) } }],
        },
    }))?;
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    let pp = PostParams::default();
    classes.create(&pp, &gpu_class).await?;
    classes.create(&pp, &mig_class).await?;

    let pods: Api<Pod> = ns.api();
    pods.create(&pp, &limits_pod("gpu-pod", &gpu_resource)?)
        .await?;
    pods.create(&pp, &limits_pod("mig-pod", &mig_resource)?)
        .await?;

    let (gpu_claim, gpu) = prepared_device(ns, "gpu-pod", driver).await?;
    let listing = log_with(&pods, "gpu-pod", "listed").await?;
    let lines: Vec<&str> = listing.lines().filter(|l| l.starts_with("GPU ")).collect();
    ensure!(
        lines.len() == 1 && lines[0].contains(&format!("(UUID: {})", gpu.gpu)),
        "gpu-pod's claim got {}, its nvidia-smi -L lists:\n{listing}",
        gpu.gpu
    );

    let (mig_claim, mig) = prepared_device(ns, "mig-pod", driver).await?;
    let mig_uuid = mig
        .mig
        .context("the MIG claim's status names no MIG UUID")?;
    let listing = log_with(&pods, "mig-pod", "listed").await?;
    let gpus = listing.lines().filter(|l| l.starts_with("GPU ")).count();
    let migs: Vec<&str> = listing
        .lines()
        .filter(|l| l.trim_start().starts_with("MIG "))
        .collect();
    ensure!(
        gpus == 1
            && migs.len() == 1
            && migs[0].contains(&mig_profile)
            && migs[0].contains(&mig_uuid),
        "mig-pod's claim got {mig_uuid} ({mig_profile}) on {}, its nvidia-smi -L lists:\n{listing}",
        mig.gpu
    );

    // `tessera status` on the node names each Pod beside its claim.
    let report = node_status(env, driver, &[])?;
    for (claim, pod) in [(&gpu_claim, "gpu-pod"), (&mig_claim, "mig-pod")] {
        let want = format!("{}/{pod}", ns.name());
        let listed = report["gpus"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["claims"].as_array().into_iter().flatten())
            .find(|c| c["name"] == claim.as_str())
            .with_context(|| format!("tessera status lists no claim {claim}:\n{report:#}"))?;
        ensure!(
            listed["pods"]
                .as_array()
                .is_some_and(|p| p.iter().any(|p| p == want.as_str())),
            "tessera status names no Pod {want} for claim {claim}: {listed}"
        );
    }

    // Deleting the Pods unprepares their claims: the scheduler's claims go
    // with the Pods, and the node's records of them too.
    delete_pods(ns).await;
    let state_dir = cluster_env_vars(env)?
        .remove("TESSERA_NODE_STATE_DIR")
        .context("cluster.sh env has no TESSERA_NODE_STATE_DIR")?;
    wait_for("both claims unprepared on the node", TIMEOUT, || async {
        let report = node_status(env, driver, &[])?;
        let left: Vec<String> = report["gpus"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["claims"].as_array().into_iter().flatten())
            .filter_map(|c| c["name"].as_str().map(str::to_owned))
            .filter(|n| *n == gpu_claim || *n == mig_claim)
            .collect();
        Ok(left.is_empty().then_some(()))
    })
    .await
    .with_context(|| format!("records under {state_dir}"))?;
    Ok(())
}

/// A Pod as written for the device plugin: one container, `resources.limits`
/// only; it prints what it sees, then waits.
fn limits_pod(name: &str, resource: &str) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": probe_image(),
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", "nvidia-smi -L; echo listed; exec sleep 3600"],
                "resources": { "limits": { resource: "1" } },
            }],
        },
    }))?)
}

/// A MIG profile the node publishes devices of (an instance or a
/// placement).
async fn published_mig_profile(cluster: &TestCluster, driver: &str) -> Result<String> {
    let slices: Api<ResourceSlice> = Api::all(cluster.client());
    let by_driver = ListParams::default().fields(&format!("spec.driver={driver}"));
    wait_for("a MIG device in the node's slices", TIMEOUT, || async {
        let profile = slices
            .list(&by_driver)
            .await?
            .items
            .into_iter()
            .filter(|s| s.spec.node_name.as_deref() == Some(cluster.node_name()))
            .flat_map(|s| s.spec.devices.unwrap_or_default())
            .filter_map(|d| d.attributes)
            .filter(|a| a.get("type").and_then(|v| v.string.as_deref()) == Some("mig"))
            .find_map(|a| a.get("profile").and_then(|v| v.string.clone()));
        Ok(profile)
    })
    .await
}

struct Prepared {
    gpu: String,
    mig: Option<String>,
}

/// Waits until `pod` runs; returns the claim the scheduler made for its
/// limits (allocated from `driver`) and what the node wrote into its
/// `status.devices`.
async fn prepared_device(
    ns: &TestNamespace,
    pod: &str,
    driver: &str,
) -> Result<(String, Prepared)> {
    let pods: Api<Pod> = ns.api();
    let running = wait_for(&format!("{pod} running"), TIMEOUT, || async {
        let p = pods.get(pod).await?;
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        if phase == Some("Failed") {
            bail!("{pod} failed: {:?}", p.status);
        }
        Ok((phase == Some("Running")).then_some(p))
    })
    .await?;
    let claim = running
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .map(|s| s.resource_claim_name.clone())
        .with_context(|| format!("{pod} runs without an extended resource claim in its status"))?;
    let claims: Api<ResourceClaim> = ns.api();
    let data = wait_for(&format!("status.devices of {claim}"), TIMEOUT, || async {
        let c = claims.get(&claim).await?;
        let results = c
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.clone())
            .unwrap_or_default();
        ensure!(
            results.len() == 1 && results[0].driver == driver,
            "claim {claim} of {pod} is allocated {results:?}, not one device of {driver}"
        );
        Ok(c.status
            .and_then(|s| s.devices)
            .and_then(|d| d.into_iter().next())
            .and_then(|d| d.data)
            .map(|d| d.0))
    })
    .await?;
    let text = |k: &str| data.get(k).and_then(Value::as_str).map(str::to_owned);
    let gpu = text("gpuUUID").with_context(|| format!("status.devices of {claim}: {data}"))?;
    Ok((
        claim,
        Prepared {
            gpu,
            mig: text("migUUID"),
        },
    ))
}
