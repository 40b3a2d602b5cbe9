//! HAMi-core as the isolation provider, through the real kube-scheduler,
//! kubelet and containers: on a node whose policy says `isolationProvider:
//! hami-core`, a Pod with an Isolated share of 4Gi and 25 % runs, and its
//! own shell sees `CUDA_DEVICE_MEMORY_LIMIT_0=4096m`,
//! `CUDA_DEVICE_SM_LIMIT_0=25`, the preload file listing the library and the
//! library itself (the harness's stand-in, see docs/simulated-gpus.md), and
//! no MPS pipe. `tessera status` lists the claim on its GPU with the Pod,
//! the mode `isolated/hami-core` and the GPU healthy; with `--no-api` it
//! says Pods are unknown.
//!
//! It needs the cluster's real container runtime and a node process with
//! that policy: one already running is used only if its policy names
//! hami-core (otherwise the test is skipped: `cluster.sh node-stop` first);
//! else it is started over `h100x8.yaml` with the policy, and stopped and
//! removed after.

mod plugin_support;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use tessera_conformance::{
    ClusterEnv, TestCluster, TestNamespace, delete_ignore_missing, unique_name,
};

use plugin_support::cluster::{
    cluster_sh, container_runtime, delete_pods, log_with, node_running, node_status, probe_image,
};
use plugin_support::repo_root;
use tessera_test_kit::cluster::ClusterState;

const TOPOLOGY: &str = "h100x8.yaml";
const POLICY: &str = "gpus:\n- select: {all: true}\n  isolationProvider: hami-core\n";

#[tokio::test(flavor = "multi_thread")]
async fn a_hami_core_share_runs_with_its_limits_and_status_lists_its_pod() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    if env.kubelet.is_none() {
        eprintln!("SKIP: the cluster runs without a kubelet (TESSERA_KUBELET=0)");
        return Ok(());
    }
    let runtime = container_runtime(&env);
    if runtime != "containerd" {
        eprintln!(
            "SKIP: the cluster's kubelet runs the {runtime} CRI, where pods never execute; \
             this test reads what a pod's shell printed"
        );
        return Ok(());
    }
    let node_dir = env.state_dir.join("node");
    let started_node = !node_running(&env);
    if started_node {
        let policy = tempfile::NamedTempFile::new()?;
        std::fs::write(policy.path(), POLICY)?;
        let policy = policy.path().to_str().context("policy path")?;
        if node_dir.join("node.env").exists() {
            cluster_sh(&env, &["node-start", "--policy", policy])?;
        } else {
            let topology = repo_root()
                .join("driver/fake-nvml/topologies")
                .join(TOPOLOGY);
            let topology = topology.to_str().context("topology path")?;
            cluster_sh(
                &env,
                &["node-start", "--topology", topology, "--policy", policy],
            )?;
        }
    } else if !std::fs::read_to_string(node_dir.join("policy.yaml"))
        .unwrap_or_default()
        .contains("hami-core")
    {
        eprintln!(
            "SKIP: the running node process's policy does not name hami-core \
             (cluster.sh node-stop, and the test starts one that does)"
        );
        return Ok(());
    }
    let driver = ClusterState::new(&env.state_dir).node_driver();
    let cluster = TestCluster::shared().await?;
    let id = unique_name("hami");
    let ns = cluster.create_namespace("hami-core").await?;
    let classes: Api<DeviceClass> = Api::all(cluster.client());

    let result = run(&env, &cluster, &ns, &driver, &id).await;

    // Unprepared before the node process may stop.
    delete_pods(&ns).await;
    let _ = ns.delete().await;
    let _ = delete_ignore_missing(&classes, &format!("{id}-isolated")).await;
    if started_node {
        let _ = cluster_sh(&env, &["node-stop"]);
        let _ = std::fs::remove_dir_all(&node_dir);
    }
    result
}

async fn run(
    env: &ClusterEnv,
    cluster: &TestCluster,
    ns: &TestNamespace,
    driver: &str,
    id: &str,
) -> Result<()> {
    let pp = PostParams::default();
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": format!("{id}-isolated") },
        "spec": { "selectors": [{ "cel": { "expression": format!(
            "device.driver == {driver:?} && device.attributes[{driver:?}].type == 'share' && \
             device.attributes[{driver:?}].isolationLevel == 'Isolated' && \
             device.attributes[{driver:?}].isolationProvider == 'hami-core'"
        ) } }] },
    }))?;
    classes.create(&pp, &class).await?;
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": "limited" },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": {
            "deviceClassName": format!("{id}-isolated"),
            "capacity": { "requests": { "memory": "4Gi", "cores": "25" } },
        } }] } },
    }))?;
    let claims: Api<ResourceClaim> = ns.api();
    claims.create(&pp, &claim).await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "limited" },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "restartPolicy": "Never",
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": "limited" }],
            "containers": [{
                "name": "main",
                "image": probe_image(),
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c",
                    "echo \"memory=$CUDA_DEVICE_MEMORY_LIMIT_0 sm=$CUDA_DEVICE_SM_LIMIT_0 \
                     mps=${CUDA_MPS_PIPE_DIRECTORY:-none} visible=$CUDA_VISIBLE_DEVICES\"; \
                     echo \"preload=$(cat /etc/ld.so.preload)\"; \
                     test -f /usr/local/vgpu/libvgpu.so && echo library-mounted; \
                     echo checked; exec sleep 3600"],
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
        },
    }))?;
    let pods: Api<Pod> = ns.api();
    pods.create(&pp, &pod).await?;
    let log = log_with(&pods, "limited", "checked").await?;
    eprintln!("the hami-core pod printed:\n{log}");
    ensure!(
        log.contains("memory=4096m sm=25 mps=none visible=GPU-"),
        "the container's limits are not the claim's 4Gi / 25 % (or it runs under MPS):\n{log}"
    );
    ensure!(
        log.contains("preload=/usr/local/vgpu/libvgpu.so") && log.contains("library-mounted"),
        "the preload file or the library is not mounted:\n{log}"
    );

    // tessera status lists the claim, its Pod and the GPU's mode.
    let uid = claims.get("limited").await?.metadata.uid.context("uid")?;
    let report = node_status(env, driver, &[])?;
    let gpus = report["gpus"].as_array().context("gpus")?;
    let (gpu, claim) = gpus
        .iter()
        .find_map(|g| {
            let c = g["claims"].as_array()?.iter().find(|c| c["uid"] == uid)?;
            Some((g, c))
        })
        .with_context(|| format!("tessera status does not list claim {uid}: {report:#}"))?;
    ensure!(
        claim["pods"] == json!([format!("{}/limited", ns.name())]),
        "tessera status does not name the claim's pod: {claim:#}"
    );
    ensure!(
        claim["isolationProvider"] == "hami-core"
            && gpu["mode"] == "isolated/hami-core"
            && gpu["health"] == "healthy",
        "tessera status: {gpu:#}"
    );
    ensure!(
        claim["limits"]["memoryBytes"] == 4u64 << 30 && claim["limits"]["computePercent"] == 25,
        "tessera status shows other limits: {claim:#}"
    );
    let offline = node_status(env, driver, &["--no-api"])?;
    ensure!(
        offline["apiUnavailable"].is_string()
            && offline["gpus"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["claims"].as_array().into_iter().flatten())
                .all(|c| c.get("pods").is_none()),
        "without the API server the pods must be reported unknown: {offline:#}"
    );
    Ok(())
}
