//! The whole node path with real components: `tessera plugin`, the node
//! process, publishes the simulated GPUs of the kubelet's node, the real
//! scheduler allocates a
//! whole GPU to a Pod's claim (from a ResourceClaimTemplate), the real
//! kubelet finds `tessera plugin` through its plugin registry, calls
//! NodePrepareResources, containerd runs the Pod with the CDI spec, and calls
//! NodeUnprepareResources when the Pod is deleted: CDI spec and checkpoint
//! entry appear and go, and the claim's status says which GPU it got.
//!
//! The driver name is unique per run, so this test never shares a pool or
//! slices with other tests on the same node.

mod plugin_support;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::DeleteParams;
use tessera_conformance::{TestCluster, unique_name, wait_for};

use plugin_support::*;

#[tokio::test]
async fn kubelet_prepares_and_unprepares_through_tessera() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let Some(kubelet) = cluster.kubelet().cloned() else {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to check");
        return Ok(());
    };
    let id = unique_name("pk");
    let driver = format!("{id}.tessera.dev");
    let node = cluster.node_name().to_owned();
    let ns = cluster.create_namespace("plugin-kubelet").await?;
    let dirs = PluginDirs::for_kubelet(&kubelet)?;

    // The node process, in the kubelet's own directories: it registers with
    // the kubelet and publishes the node's slices.
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
            events: None,
        },
    )?;
    let result = run(&cluster, &ns, &driver, &id, &dirs, &mut plugin).await;
    finish_kubelet_test(&cluster, &ns, &driver, &id, plugin, result).await
}

async fn run(
    cluster: &TestCluster,
    ns: &tessera_conformance::TestNamespace,
    driver: &str,
    id: &str,
    dirs: &PluginDirs,
    plugin: &mut PluginProcess,
) -> Result<()> {
    let pods = whole_gpu_pod(cluster, ns, driver, id, plugin).await?;

    let running = wait_for(
        "pod Running after the kubelet prepared its claim",
        TIMEOUT * 2,
        || {
            let alive = plugin.check_running();
            let pods = pods.clone();
            async move {
                alive?;
                let p = pods.get("gpu-pod").await?;
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                Ok((phase.as_deref() == Some("Running")).then_some(p))
            }
        },
    )
    .await?;
    let claim_name = running
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|v| v.iter().find(|c| c.name == "gpu"))
        .and_then(|c| c.resource_claim_name.clone())
        .context("pod status names no claim")?;
    let claims: Api<ResourceClaim> = ns.api();
    let claim = claims.get(&claim_name).await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let allocated = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default();
    ensure!(
        allocated.len() == 1 && allocated[0].driver == driver,
        "{allocated:?}"
    );

    // Prepared by Tessera: spec and checkpoint entry, status with the GPU.
    let spec = dirs.spec(&uid).context("no CDI spec for the Pod's claim")?;
    ensure!(spec["devices"][0]["name"] == format!("gpu_{uid}"), "{spec}");
    ensure!(dirs.checkpoint()[&uid]["state"] == "Completed");
    let gpu_uuid = status_gpu_uuid(&claims, &claim_name).await?;
    ensure!(
        inventory().gpus.iter().any(|g| g.uuid == gpu_uuid),
        "status names {gpu_uuid}, not a GPU of the node"
    );
    let env = spec["devices"][0]["containerEdits"]["env"].to_string();
    ensure!(
        env.contains(&format!("NVIDIA_VISIBLE_DEVICES={gpu_uuid}")),
        "{env}"
    );

    // Deleting the Pod makes the kubelet unprepare.
    pods.delete("gpu-pod", &DeleteParams::default()).await?;
    wait_for(
        "CDI spec and checkpoint entry removed by unprepare",
        TIMEOUT * 2,
        || async {
            Ok((dirs.spec(&uid).is_none() && !dirs.checkpoint().contains_key(&uid)).then_some(()))
        },
    )
    .await?;
    Ok(())
}
