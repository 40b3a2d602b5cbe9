//! Proof that the local control plane allocates DRA devices with the real
//! kube-scheduler: a hand-written ResourceSlice offers two devices on one
//! node, a ResourceClaimTemplate picks one of them by a CEL selector on an
//! attribute, and a Pod using the template must end up bound to the node with
//! exactly that device allocated from our driver.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use tessera_conformance::{
    TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};

const ALLOCATION_TIMEOUT: Duration = Duration::from_secs(90);

struct Objects {
    driver: String,
    class: String,
    slice: String,
    template: String,
    pod: String,
    /// A node this test registered itself (cluster without kubelet).
    own_node: Option<String>,
}

#[tokio::test]
async fn scheduler_allocates_device_selected_by_cel() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let ns = cluster.create_namespace("sched-alloc").await?;
    let id = unique_name("sa");
    let own_node = if cluster.kubelet().is_some() {
        None
    } else {
        let n = unique_name("sched-alloc-node");
        cluster.register_fake_node(&n).await?;
        Some(n)
    };
    let objs = Objects {
        driver: format!("{id}.test.tessera.dev"),
        class: id.clone(),
        slice: id.clone(),
        template: "gpu".to_owned(),
        pod: "consumer".to_owned(),
        own_node,
    };

    let result = run(&cluster, &ns, &objs).await;
    let cleanup = cleanup(&cluster, &ns, &objs).await;
    result?;
    cleanup
}

async fn run(cluster: &TestCluster, ns: &TestNamespace, o: &Objects) -> Result<()> {
    let client = cluster.client();
    let node = o.own_node.as_deref().unwrap_or(cluster.node_name());
    let pp = PostParams::default();

    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": o.class },
        "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == {:?}", o.driver) } }] },
    }))?;
    Api::<DeviceClass>::all(client.clone())
        .create(&pp, &class)
        .await?;

    // One pool on one node with two devices that differ in one attribute.
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": { "name": o.slice },
        "spec": {
            "driver": o.driver,
            "nodeName": node,
            "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
            "devices": [
                { "name": "gpu-0", "attributes": {
                    "model": { "string": "t4" }, "memoryGiB": { "int": 16 } } },
                { "name": "gpu-1", "attributes": {
                    "model": { "string": "l4" }, "memoryGiB": { "int": 24 } } },
            ],
        },
    }))?;
    Api::<ResourceSlice>::all(client.clone())
        .create(&pp, &slice)
        .await?;

    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": { "name": o.template },
        "spec": { "spec": { "devices": { "requests": [{
            "name": "gpu",
            "exactly": {
                "deviceClassName": o.class,
                "selectors": [{ "cel": { "expression":
                    format!("device.attributes[{:?}].model == \"l4\"", o.driver) } }],
            },
        }]}}},
    }))?;
    ns.api::<ResourceClaimTemplate>()
        .create(&pp, &template)
        .await?;

    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": o.pod },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "resourceClaims": [{ "name": "gpu", "resourceClaimTemplateName": o.template }],
            "containers": [{
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
        },
    }))?;
    let pods = ns.api::<Pod>();
    pods.create(&pp, &pod).await?;

    // The resourceclaim controller creates the claim from the template and
    // records its name in the pod status; the scheduler then allocates it and
    // binds the pod.
    let claims = ns.api::<ResourceClaim>();
    let (bound_node, claim) = wait_for(
        "claim allocated and pod bound",
        ALLOCATION_TIMEOUT,
        || async {
            let Some(p) = pods.get_opt(&o.pod).await? else {
                return Ok(None);
            };
            let Some(bound) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                return Ok(None);
            };
            let claim_name = p
                .status
                .as_ref()
                .and_then(|s| s.resource_claim_statuses.as_ref())
                .and_then(|v| v.iter().find(|c| c.name == "gpu"))
                .and_then(|c| c.resource_claim_name.clone());
            let Some(claim_name) = claim_name else {
                return Ok(None);
            };
            let Some(claim) = claims.get_opt(&claim_name).await? else {
                return Ok(None);
            };
            let allocated = claim
                .status
                .as_ref()
                .is_some_and(|s| s.allocation.is_some());
            Ok(allocated.then_some((bound, claim)))
        },
    )
    .await
    .with_context(|| {
        format!(
            "pod {}/{} was not scheduled with an allocated claim",
            ns.name(),
            o.pod
        )
    })?;

    ensure!(
        bound_node == node,
        "pod bound to {bound_node}, expected {node}"
    );
    let status = claim.status.context("claim has no status")?;
    let results = status
        .allocation
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default();
    ensure!(
        results.len() == 1,
        "expected one allocated device, got {results:?}"
    );
    let r = &results[0];
    ensure!(
        r.driver == o.driver,
        "allocated from driver {}, expected {}",
        r.driver,
        o.driver
    );
    ensure!(
        r.pool == node,
        "allocated from pool {}, expected {node}",
        r.pool
    );
    ensure!(
        r.device == "gpu-1",
        "CEL selector asked for the l4 (gpu-1), got {}",
        r.device
    );
    ensure!(r.request == "gpu", "allocated for request {}", r.request);
    let reserved_for_pod = status
        .reserved_for
        .unwrap_or_default()
        .iter()
        .any(|c| c.resource == "pods" && c.name == o.pod);
    ensure!(reserved_for_pod, "claim is not reserved for pod {}", o.pod);
    Ok(())
}

async fn cleanup(cluster: &TestCluster, ns: &TestNamespace, o: &Objects) -> Result<()> {
    let client = cluster.client();
    // Pod first (immediately: the fake runtime has nothing to stop), so the
    // claim is released; the namespace takes the claim and template with it.
    match ns
        .api::<Pod>()
        .delete(&o.pod, &DeleteParams::default().grace_period(0))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    ns.delete().await?;
    delete_ignore_missing(&Api::<ResourceSlice>::all(client.clone()), &o.slice).await?;
    delete_ignore_missing(&Api::<DeviceClass>::all(client), &o.class).await?;
    if let Some(n) = &o.own_node {
        cluster.delete_node(n).await?;
    }
    Ok(())
}
