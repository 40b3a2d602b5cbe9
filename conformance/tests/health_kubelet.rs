//! Device health through the real kubelet: `tessera plugin` (the node
//! process, simulated GPUs, a driver name unique to this run) serves
//! `DRAResourceHealth` on its DRA socket; the kubelet (ResourceHealthStatus
//! on) watches it and folds it into the Pod's
//! `status.containerStatuses[].allocatedResourcesStatus`. A Pod with a whole
//! GPU runs and shows it Healthy; an injected XID 79 ("fallen off the bus")
//! on that GPU turns it Unhealthy in the Pod's status, with the XID in the
//! message.

mod plugin_support;

use std::io::Write as _;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use serde_json::Value;
use tessera_conformance::{TestCluster, unique_name, wait_for};

use plugin_support::*;

#[tokio::test]
async fn an_xid_79_makes_the_pods_gpu_unhealthy_in_its_status() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let Some(kubelet) = cluster.kubelet().cloned() else {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to check");
        return Ok(());
    };
    let id = unique_name("hk");
    let driver = format!("{id}.tessera.dev");
    let node = cluster.node_name().to_owned();
    let ns = cluster.create_namespace("health-kubelet").await?;
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
            topology: topology_path(),
            args: Vec::new(),
            log: "plugin.log".into(),
            events: Some(events.clone()),
        },
    )?;
    let result = run(&cluster, &ns, &driver, &id, &events, &mut plugin).await;
    finish_kubelet_test(&cluster, &ns, &driver, &id, plugin, result).await
}

/// `(health, message)` of every resource in the Pod's container statuses.
fn resource_health(pod: &Pod) -> Vec<(String, String)> {
    let status = serde_json::to_value(&pod.status).unwrap_or(Value::Null);
    let mut out = Vec::new();
    for c in status["containerStatuses"].as_array().into_iter().flatten() {
        for r in c["allocatedResourcesStatus"]
            .as_array()
            .into_iter()
            .flatten()
        {
            for d in r["resources"].as_array().into_iter().flatten() {
                out.push((
                    d["health"].as_str().unwrap_or_default().to_owned(),
                    d["message"].as_str().unwrap_or_default().to_owned(),
                ));
            }
        }
    }
    out
}

async fn run(
    cluster: &TestCluster,
    ns: &tessera_conformance::TestNamespace,
    driver: &str,
    id: &str,
    events: &std::path::Path,
    plugin: &mut PluginProcess,
) -> Result<()> {
    let pods = whole_gpu_pod(cluster, ns, driver, id, plugin).await?;

    // Running, and the kubelet already has the device's health from the
    // stream: Healthy.
    let running = wait_for("pod Running with its GPU Healthy", TIMEOUT * 2, || {
        let alive = plugin.check_running();
        let pods = pods.clone();
        async move {
            alive?;
            let p = pods.get("gpu-pod").await?;
            let phase = p.status.as_ref().and_then(|s| s.phase.clone());
            let health = resource_health(&p);
            Ok((phase.as_deref() == Some("Running")
                && !health.is_empty()
                && health.iter().all(|(h, _)| h == "Healthy"))
            .then_some(p))
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
    let gpu_uuid = status_gpu_uuid(&claims, &claim_name).await?;

    // The GPU falls off the bus.
    let mut f = std::fs::OpenOptions::new().append(true).open(events)?;
    writeln!(f, "{gpu_uuid} 79")?;
    drop(f);

    let unhealthy = wait_for("the Pod's GPU Unhealthy in its status", TIMEOUT, || {
        let alive = plugin.check_running();
        let pods = pods.clone();
        async move {
            alive?;
            let health = resource_health(&pods.get("gpu-pod").await?);
            Ok(health
                .iter()
                .any(|(h, _)| h == "Unhealthy")
                .then_some(health))
        }
    })
    .await?;
    let (_, message) = unhealthy
        .iter()
        .find(|(h, _)| h == "Unhealthy")
        .expect("found above");
    anyhow::ensure!(
        message.contains("XID 79") && message.contains(&gpu_uuid),
        "message {message:?} names neither the XID nor the GPU"
    );
    let text = std::fs::read_to_string(&plugin.log)?;
    anyhow::ensure!(
        text.contains("XID 79") && text.contains("marked Unhealthy"),
        "the plugin log does not report the XID"
    );
    Ok(())
}
