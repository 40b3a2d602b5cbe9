//! Proof of the kubelet's DRA path on the local cluster: a plugin registers
//! through the kubelet's plugin registry, the scheduler allocates one of its
//! devices, the kubelet's DRA manager calls NodePrepareResources with that
//! claim, containerd starts the pod with the plugin's CDI device, and after
//! the pod is deleted the kubelet
//! calls NodeUnprepareResources. The plugin is the harness's trivial
//! `test-dra-plugin` (upstream helper library), so this checks the harness,
//! not Tessera's driver.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;
use tessera_conformance::{
    TestCluster, TestDraPlugin, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};

const TIMEOUT: Duration = Duration::from_secs(120);

#[tokio::test]
async fn kubelet_prepares_and_unprepares_claim() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    if cluster.kubelet().is_none() {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to check");
        return Ok(());
    }
    let id = unique_name("kp");
    let driver = format!("{id}.test.tessera.dev");
    let plugin = cluster.start_test_plugin(&driver, 2)?;
    let ns = cluster.create_namespace("kubelet-prep").await?;

    let result = run(&cluster, &ns, &driver, &id, &plugin).await;
    let cleanup = cleanup(&cluster, &ns, &id, &plugin).await;
    result?;
    cleanup
}

async fn run(
    cluster: &TestCluster,
    ns: &TestNamespace,
    driver: &str,
    id: &str,
    plugin: &TestDraPlugin,
) -> Result<()> {
    let client = cluster.client();
    let pp = PostParams::default();

    // The plugin publishes its devices through the API like a real driver.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let by_driver = ListParams::default().fields(&format!("spec.driver={driver}"));
    wait_for("test plugin's ResourceSlice", TIMEOUT, || async {
        plugin.check_running()?;
        let devices: usize = slices
            .list(&by_driver)
            .await?
            .items
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        Ok((devices == 2).then_some(()))
    })
    .await?;

    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": id },
        "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == {driver:?}") } }] },
    }))?;
    Api::<DeviceClass>::all(client.clone())
        .create(&pp, &class)
        .await?;
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": { "name": "dev" },
        "spec": { "spec": { "devices": { "requests": [{
            "name": "dev", "exactly": { "deviceClassName": id },
        }]}}},
    }))?;
    ns.api::<ResourceClaimTemplate>()
        .create(&pp, &template)
        .await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "consumer" },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "resourceClaims": [{ "name": "dev", "resourceClaimTemplateName": "dev" }],
            "containers": [{
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": { "claims": [{ "name": "dev" }] },
            }],
        },
    }))?;
    let pods = ns.api::<Pod>();
    pods.create(&pp, &pod).await?;

    let running = wait_for("pod Running on the kubelet node", TIMEOUT, || async {
        plugin.check_running()?;
        let p = pods.get("consumer").await?;
        let phase = p.status.as_ref().and_then(|s| s.phase.clone());
        Ok((phase.as_deref() == Some("Running")).then_some(p))
    })
    .await?;
    let node = running.spec.as_ref().and_then(|s| s.node_name.clone());
    ensure!(
        node.as_deref() == Some(cluster.node_name()),
        "pod ran on {node:?}"
    );
    let claim_name = running
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|v| v.iter().find(|c| c.name == "dev"))
        .and_then(|c| c.resource_claim_name.clone())
        .context("pod status names no claim")?;
    let claim = ns.api::<ResourceClaim>().get(&claim_name).await?;
    let uid = claim.metadata.uid.clone().context("claim has no uid")?;
    let allocated: Vec<String> = claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .map(|r| r.into_iter().map(|r| r.device).collect())
        .unwrap_or_default();
    ensure!(
        allocated.len() == 1,
        "expected one allocated device, got {allocated:?}"
    );

    // The pod could only start after a successful NodePrepareResources.
    let prepared = plugin
        .calls()?
        .into_iter()
        .find(|c| c.op == "prepare" && c.uid == uid)
        .with_context(|| {
            format!("no NodePrepareResources recorded for claim {claim_name} ({uid})")
        })?;
    ensure!(
        prepared.namespace == ns.name() && prepared.name == claim_name,
        "{prepared:?}"
    );
    ensure!(
        prepared.devices == allocated,
        "prepared {:?}, allocated {allocated:?}",
        prepared.devices
    );

    pods.delete("consumer", &DeleteParams::default()).await?;
    wait_for(
        "NodeUnprepareResources after pod deletion",
        TIMEOUT,
        || async {
            plugin.check_running()?;
            Ok(plugin
                .calls()?
                .iter()
                .any(|c| c.op == "unprepare" && c.uid == uid)
                .then_some(()))
        },
    )
    .await?;
    wait_for("pod gone", TIMEOUT, || async {
        Ok(pods.get_opt("consumer").await?.is_none().then_some(()))
    })
    .await?;
    Ok(())
}

async fn cleanup(
    cluster: &TestCluster,
    ns: &TestNamespace,
    id: &str,
    plugin: &TestDraPlugin,
) -> Result<()> {
    match ns
        .api::<Pod>()
        .delete("consumer", &DeleteParams::default().grace_period(0))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    ns.delete().await?;
    delete_ignore_missing(&Api::<DeviceClass>::all(cluster.client()), id).await?;
    plugin.stop()
}
