//! The chart's claim status policy (`admission-policy.yaml`,
//! `<release>-tessera-own-node-claim-status`) against the real API server,
//! without a kubelet.
//!
//! The chart's ServiceAccount, RBAC and admission policies are rendered with
//! `helm template` and created as they are. Kubernetes 1.36+ checks status
//! writes per driver and node itself (`resourceclaims/driver`
//! `associated-node:patch`); 1.34 and 1.35 do not, and let
//! `resourceclaims/status` change the allocation too. The test takes the
//! newer server's checks out of the way as the older ones have none (an
//! extra role grants `arbitrary-node:patch` and `resourceclaims/binding`),
//! so what it sees is the policy's doing. As the node process's service
//! account with a token bound to a pod on node A:
//!
//! * writing and removing status.devices of a claim allocated on A is
//!   admitted;
//! * writing status.devices of a claim allocated on node B, an entry of
//!   another driver on A's claim, or A's claim's reservedFor is denied, with
//!   a message naming the policy, the node and the claim;
//! * a token not bound to a pod (no node in it) writes nothing.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::{Value, json};
use tessera_conformance::procs::run;
use tessera_conformance::{TestCluster, TestNamespace, unique_name, wait_for};
use tessera_test_kit::repo_root;

/// The policy is picked up by the API server's informers within seconds.
const POLICY_ACTIVE: Duration = Duration::from_secs(60);
/// A device of another driver, allocated on node A beside ours.
const OTHER_DRIVER: &str = "gpu.other.example.com";

/// The chart's ServiceAccount, RBAC and admission policies for `release`.
fn render_chart(
    state_dir: &Path,
    release: &str,
    namespace: &str,
    driver: &str,
) -> Result<Vec<Value>> {
    let helm = run(
        Command::new(repo_root().join("conformance/cluster/image.sh"))
            .arg("helm")
            .env("TESSERA_CLUSTER_DIR", state_dir),
    )?;
    let yaml = run(Command::new(helm.trim())
        .args(["template", release])
        .arg(repo_root().join("deploy/helm/tessera"))
        .args([
            "--namespace",
            namespace,
            "--set",
            &format!("driverName={driver}"),
        ])
        .args(["--show-only", "templates/serviceaccount.yaml"])
        .args(["--show-only", "templates/rbac.yaml"])
        .args(["--show-only", "templates/admission-policy.yaml"]))?;
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&yaml) {
        let object = Value::deserialize(doc)?;
        if !object.is_null() {
            objects.push(object);
        }
    }
    Ok(objects)
}

/// The API of a rendered object: namespaced where it names a namespace.
fn api_of(client: &Client, object: &DynamicObject) -> Result<Api<DynamicObject>> {
    let types = object
        .types
        .as_ref()
        .context("a rendered object without a kind")?;
    let gvk = GroupVersionKind::try_from(types)?;
    let resource = ApiResource::from_gvk(&gvk);
    Ok(match &object.metadata.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    })
}

/// Objects created by the test, deleted at its end.
struct Created {
    client: Client,
    objects: Vec<DynamicObject>,
}

impl Created {
    async fn create(&mut self, object: Value) -> Result<()> {
        let object: DynamicObject = serde_json::from_value(object)?;
        let api = api_of(&self.client, &object)?;
        api.create(&PostParams::default(), &object)
            .await
            .with_context(|| format!("creating {:?} {:?}", object.types, object.metadata.name))?;
        self.objects.push(object);
        Ok(())
    }

    async fn delete_all(&self) {
        for object in self.objects.iter().rev() {
            let (Ok(api), Some(name)) = (api_of(&self.client, object), &object.metadata.name)
            else {
                continue;
            };
            if let Err(e) = api.delete(name, &DeleteParams::default()).await {
                eprintln!("cleanup: deleting {name}: {e}");
            }
        }
    }
}

/// A claim allocated on `node`: one device per `(request, driver)`, each in
/// the pool named after the node (as Tessera's slices are).
async fn allocated_claim(
    ns: &TestNamespace,
    node: &str,
    devices: &[(&str, &str)],
) -> Result<String> {
    let name = unique_name(&format!("on-{node}"));
    let requests: Vec<Value> = devices
        .iter()
        .map(|(request, _)| json!({ "name": request, "exactly": { "deviceClassName": "gpu.example.com" } }))
        .collect();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "devices": { "requests": requests } },
    }))?;
    let claims: Api<ResourceClaim> = ns.api();
    claims.create(&PostParams::default(), &claim).await?;
    let results: Vec<Value> = devices
        .iter()
        .map(|(request, driver)| json!({ "request": request, "driver": driver, "pool": node, "device": "dev-0" }))
        .collect();
    let allocation = json!({ "status": { "allocation": {
        "devices": { "results": results },
        "nodeSelector": { "nodeSelectorTerms": [{ "matchFields": [
            { "key": "metadata.name", "operator": "In", "values": [node] }
        ]}]},
    }}});
    claims
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(allocation))
        .await
        .context("allocating the claim (as admin)")?;
    Ok(name)
}

/// What the node process applies: its status.devices entries of a claim.
fn device_status(name: &str, ns: &str, entries: &[(&str, &str)]) -> Value {
    let devices: Vec<Value> = entries
        .iter()
        .map(|(driver, pool)| json!({ "driver": driver, "pool": pool, "device": "dev-0", "data": { "uuid": "GPU-1" } }))
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": name, "namespace": ns },
        "status": { "devices": devices },
    })
}

fn apply(driver: &str, dry_run: bool) -> PatchParams {
    let mut params = PatchParams::apply(driver).force();
    params.dry_run = dry_run;
    params
}

/// Expects a 403 from `policy` whose message holds every one of `says`.
fn denied(
    result: kube::Result<ResourceClaim>,
    policy: &str,
    says: &[&str],
    what: &str,
) -> Result<()> {
    match result {
        Err(kube::Error::Api(s))
            if s.code == 403
                && s.message.contains(policy)
                && says.iter().all(|w| s.message.contains(w)) =>
        {
            eprintln!("denied as expected ({what}): {}", s.message);
            Ok(())
        }
        Err(e) => bail!("{what}: expected a denial by {policy} saying {says:?}, got {e}"),
        Ok(_) => bail!("{what}: admitted, the policy {policy} should deny it"),
    }
}

#[tokio::test]
async fn the_node_process_writes_status_only_of_its_own_nodes_claims() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let id = unique_name("cs");
    let driver = format!("gpu.{id}.tessera.dev");
    let ns = cluster.create_namespace("claim-status").await?;
    let (node_a, node_b) = (format!("{id}-a"), format!("{id}-b"));
    cluster.register_fake_node(&node_a).await?;
    cluster.register_fake_node(&node_b).await?;
    let mut created = Created {
        client: cluster.client(),
        objects: Vec::new(),
    };
    let outcome = policy_case(&cluster, &ns, &mut created, &id, &driver, &node_a, &node_b).await;
    created.delete_all().await;
    for node in [&node_a, &node_b] {
        cluster.delete_node(node).await?;
    }
    ns.delete().await?;
    outcome
}

async fn policy_case(
    cluster: &TestCluster,
    ns: &TestNamespace,
    created: &mut Created,
    release: &str,
    driver: &str,
    node_a: &str,
    node_b: &str,
) -> Result<()> {
    let rendered = {
        let (dir, release, namespace, driver) = (
            cluster.state_dir().to_path_buf(),
            release.to_owned(),
            ns.name().to_owned(),
            driver.to_owned(),
        );
        tokio::task::spawn_blocking(move || render_chart(&dir, &release, &namespace, &driver))
            .await??
    };
    let kinds: Vec<&str> = rendered.iter().filter_map(|o| o["kind"].as_str()).collect();
    ensure!(
        kinds
            .iter()
            .filter(|k| **k == "ValidatingAdmissionPolicy")
            .count()
            == 2,
        "the chart renders the slice and the claim status policies, got {kinds:?}"
    );
    for object in rendered {
        created.create(object).await?;
    }
    let fullname = format!("{release}-tessera");
    let policy = format!("{fullname}-own-node-claim-status");
    let sa = format!("system:serviceaccount:{}:{fullname}", ns.name());

    // What Kubernetes before 1.36 allows anyone with resourceclaims/status
    // patch: any claim's device status of any driver, and its reservedFor.
    created
        .create(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": format!("{release}-as-before-1-36") },
            "rules": [
                { "apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
                  "verbs": ["arbitrary-node:patch"] },
                { "apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/binding"],
                  "verbs": ["patch"] },
            ],
        }))
        .await?;
    created
        .create(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": format!("{release}-as-before-1-36") },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": format!("{release}-as-before-1-36") },
            "subjects": [{ "kind": "ServiceAccount", "name": fullname, "namespace": ns.name() }],
        }))
        .await?;

    // The policy type-checks against the server's schema.
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(cluster.client());
    let checked = wait_for("the policy's type check", POLICY_ACTIVE, || async {
        let p = policies.get(&policy).await?;
        let observed = p.status.as_ref().and_then(|s| s.observed_generation);
        Ok((observed == p.metadata.generation).then_some(p))
    })
    .await?;
    let warnings = checked
        .status
        .and_then(|s| s.type_checking)
        .and_then(|t| t.expression_warnings)
        .unwrap_or_default();
    ensure!(
        warnings.is_empty(),
        "the policy {policy} does not type-check: {warnings:?}"
    );

    // A pod of the service account on node A: its token names node A.
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "node-process" },
        "spec": {
            "nodeName": node_a, "serviceAccountName": fullname,
            "containers": [{ "name": "c", "image": "tessera.local/none" }],
        },
    }))?;
    let pod = ns.api::<Pod>().create(&PostParams::default(), &pod).await?;
    let as_node_a: Api<ResourceClaim> = Api::namespaced(
        cluster
            .client_with_token(&ns.token(&fullname, Some(&pod)).await?)
            .await?,
        ns.name(),
    );

    let claim_a = allocated_claim(ns, node_a, &[("gpu", driver), ("other", OTHER_DRIVER)]).await?;
    let claim_b = allocated_claim(ns, node_b, &[("gpu", driver)]).await?;

    // Until the API server enforces the policy, node B's claim is writable
    // (dry run: nothing is stored).
    let theirs = device_status(&claim_b, ns.name(), &[(driver, node_b)]);
    wait_for(
        "the policy to deny node B's claim to node A",
        POLICY_ACTIVE,
        || async {
            match as_node_a
                .patch_status(&claim_b, &apply(driver, true), &Patch::Apply(&theirs))
                .await
            {
                Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains(&policy) => {
                    Ok(Some(()))
                }
                _ => Ok(None),
            }
        },
    )
    .await?;
    denied(
        as_node_a
            .patch_status(&claim_b, &apply(driver, false), &Patch::Apply(&theirs))
            .await,
        &policy,
        &[
            &sa,
            &format!("on node {node_a}"),
            &format!("driver {driver} in pool {node_a}"),
            &claim_b,
        ],
        "node A writing a claim allocated on node B",
    )?;

    // Its own node's claim: written, then removed (prepare, unprepare).
    let ours = device_status(&claim_a, ns.name(), &[(driver, node_a)]);
    let written = as_node_a
        .patch_status(&claim_a, &apply(driver, false), &Patch::Apply(&ours))
        .await
        .context("node A writing status.devices of its own claim")?;
    let entries = written.status.and_then(|s| s.devices).unwrap_or_default();
    ensure!(
        entries.len() == 1 && entries[0].driver == driver && entries[0].pool == node_a,
        "node A's claim status after its write: {entries:?}"
    );

    denied(
        as_node_a
            .patch_status(
                &claim_a,
                &apply(driver, false),
                &Patch::Apply(&device_status(
                    &claim_a,
                    ns.name(),
                    &[(driver, node_a), (OTHER_DRIVER, node_a)],
                )),
            )
            .await,
        &policy,
        &[&format!("{OTHER_DRIVER}/{node_a}/dev-0")],
        "node A writing another driver's entry of its own claim",
    )?;
    let reserve = json!({ "status": { "reservedFor": [
        { "resource": "pods", "name": "someone", "uid": "00000000-0000-0000-0000-000000000001" }
    ]}});
    denied(
        as_node_a
            .patch_status(&claim_a, &PatchParams::default(), &Patch::Merge(&reserve))
            .await,
        &policy,
        &["not its allocation or reservedFor"],
        "node A reserving its own claim",
    )?;
    let unbound: Api<ResourceClaim> = Api::namespaced(
        cluster
            .client_with_token(&ns.token(&fullname, None).await?)
            .await?,
        ns.name(),
    );
    denied(
        unbound
            .patch_status(&claim_a, &apply(driver, true), &Patch::Apply(&ours))
            .await,
        &policy,
        &["the token names no node"],
        "a token without the node's name",
    )?;

    let removed = as_node_a
        .patch_status(
            &claim_a,
            &apply(driver, false),
            &Patch::Apply(&device_status(&claim_a, ns.name(), &[])),
        )
        .await
        .context("node A removing its entries of its own claim")?;
    let left = removed.status.and_then(|s| s.devices).unwrap_or_default();
    ensure!(
        left.is_empty(),
        "node A's entries stay after it removed them: {left:?}"
    );
    Ok(())
}
