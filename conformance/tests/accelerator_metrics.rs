//! Accelerator metrics that follow a real Pod's load, through the real
//! kube-scheduler, kubelet and containers (the CNCF AI conformance's
//! accelerator_metrics): a Pod holding a whole simulated GPU runs
//! `tessera probe --alloc 3Gi --busy`, which allocates 3 GiB and launches
//! spin kernels through the simulated libcuda until told to stop. The node
//! process's `/metrics` must show the GPU utilized and warmer, and the
//! claim's memory equal to what the Pod allocated (its process found
//! through the node's cgroups); when the load stops, utilization and the
//! claim's memory fall back to 0; when the Pod is gone, the claim's series
//! go.
//!
//! Needs the cluster's containerd (with the load directory every container
//! writes, see conformance/cluster/containerd.sh) and the node process on
//! the kubelet's node: one already running is used (its metrics address
//! read from its log); otherwise it is started over `h100x8.yaml` with a
//! metrics port of its own, and stopped and removed after.

mod plugin_support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use tessera_conformance::artifacts::binaries;
use tessera_conformance::suite::metrics;
use tessera_conformance::{
    ClusterEnv, TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};

use plugin_support::cluster::{
    PodNode, cluster_env_vars, delete_pods, log_with, node_pid, probe_image,
};
use plugin_support::status_gpu_uuid;

const TOPOLOGY: &str = "h100x8.yaml";
const TIMEOUT: Duration = Duration::from_secs(120);
/// Where the Pod finds the probe (the `tessera` binary, mounted read-only).
const PROBE: &str = "/probe/tessera";
/// What the Pod allocates: a multiple of the allocation granularity (2 MiB),
/// so NVML reports exactly this much.
const ALLOC: u64 = 3 << 30;

#[tokio::test(flavor = "multi_thread")]
async fn metrics_follow_a_pods_gpu_load_and_attribute_its_memory_to_its_claim() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    let metrics = ["--", "--metrics-address", "127.0.0.1:0"];
    let Some(node) = PodNode::start(
        &env,
        "the node's metrics under a pod's load",
        TOPOLOGY,
        &metrics,
    )?
    else {
        return Ok(());
    };
    let base_spec = env.state_dir.join("containerd/base-spec.json");
    if !std::fs::read_to_string(&base_spec)
        .unwrap_or_default()
        .contains("TESSERA_FAKE_NVML_LOAD")
    {
        eprintln!(
            "SKIP: containers of this cluster do not record load ({} predates it; restart \
             the cluster with conformance/cluster.sh)",
            base_spec.display()
        );
        node.stop(&env);
        return Ok(());
    }
    let cluster = TestCluster::shared().await?;
    let id = unique_name("metrics");
    let ns = cluster.create_namespace("accelerator-metrics").await?;
    let trigger = tempfile::tempdir()?;

    let result = run(&env, &cluster, &ns, &node.driver, &id, trigger.path()).await;

    delete_pods(&ns).await;
    let _ = ns.delete().await;
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    let _ = delete_ignore_missing(&classes, &format!("{id}-gpu")).await;
    node.stop(&env);
    result
}

/// The address the running node process serves metrics on: the last one
/// its log announced, after checking it records the simulated GPUs' load.
fn metrics_address(env: &ClusterEnv) -> Result<SocketAddr> {
    let vars = cluster_env_vars(env)?;
    let pid = node_pid(env).context("no node process runs")?;
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    ensure!(
        String::from_utf8_lossy(&environ).contains("TESSERA_FAKE_NVML_LOAD="),
        "the node process (pid {pid}) was started without load recording; restart it: \
         conformance/cluster.sh node-stop && conformance/cluster.sh node-start"
    );
    let log = vars
        .get("TESSERA_NODE_LOG")
        .context("cluster.sh env has no TESSERA_NODE_LOG")?;
    let text = std::fs::read_to_string(log).with_context(|| format!("reading {log}"))?;
    let last = text
        .lines()
        .rev()
        .find_map(|l| {
            let rest =
                &l[l.find("serving metrics on http://")? + "serving metrics on http://".len()..];
            rest.split('/').next()
        })
        .with_context(|| format!("{log} announces no metrics address"))?;
    last.parse()
        .with_context(|| format!("{last:?} in {log} is not an address"))
}

/// One scrape of `/metrics`, as `tessera-conformance` scrapes it.
async fn scrape(address: SocketAddr) -> Result<String> {
    let url = format!("http://{address}/metrics");
    tokio::task::spawn_blocking(move || metrics::scrape(&url)).await?
}

/// The value of the series `name{labels}` (exactly as written).
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

/// The Pod: probes with a load until `/trigger/stop` appears, then kills
/// the probe (its memory goes with the process, as on a real GPU).
fn pod(name: &str, claim: &str, trigger: &Path) -> Result<Pod> {
    let script = format!(
        "{PROBE} probe --alloc {ALLOC} --busy 600 >/tmp/report & probe=$!; echo loading; \
         while [ ! -e /trigger/stop ]; do sleep 0.2; done; kill $probe; wait $probe; \
         echo stopped; exec sleep 3600"
    );
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
                "command": ["/bin/sh", "-c", script],
                "resources": { "claims": [{ "name": "gpu" }] },
                "volumeMounts": [
                    { "name": "probe", "mountPath": PROBE, "readOnly": true },
                    { "name": "trigger", "mountPath": "/trigger", "readOnly": true },
                ],
            }],
            "volumes": [
                { "name": "probe", "hostPath": { "path": binaries().tessera.clone(), "type": "File" } },
                { "name": "trigger", "hostPath": { "path": trigger, "type": "Directory" } },
            ],
        },
    }))?)
}

async fn run(
    env: &ClusterEnv,
    cluster: &TestCluster,
    ns: &TestNamespace,
    driver: &str,
    id: &str,
    trigger: &Path,
) -> Result<()> {
    let address = metrics_address(env)?;
    let pp = PostParams::default();
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": format!("{id}-gpu") },
        "spec": { "selectors": [{ "cel": { "expression": format!(
            "device.driver == {driver:?} && device.attributes[{driver:?}].type == 'gpu'"
        ) } }] },
    }))?;
    classes.create(&pp, &class).await?;
    let claims: Api<ResourceClaim> = ns.api();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": "load" },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": {
            "deviceClassName": format!("{id}-gpu"),
        } }] } },
    }))?;
    claims.create(&pp, &claim).await?;
    let pods: Api<Pod> = ns.api();
    pods.create(&pp, &pod("worker", "load", trigger)?).await?;
    log_with(&pods, "worker", "loading").await?;
    let gpu = status_gpu_uuid(&claims, "load").await?;

    let utilization = format!("tessera_gpu_utilization_ratio{{gpu=\"{gpu}\"}}");
    let temperature = format!("tessera_gpu_temperature_celsius{{gpu=\"{gpu}\"}}");
    let power = format!("tessera_gpu_power_watts{{gpu=\"{gpu}\"}}");
    let claim_labels = format!(
        "{{namespace=\"{}\",claim=\"load\",gpu=\"{gpu}\"}}",
        ns.name()
    );
    let claim_memory = format!("tessera_claim_memory_used_bytes{claim_labels}");
    let claim_sm = format!("tessera_claim_sm_utilization_ratio{claim_labels}");
    let used = format!("tessera_gpu_memory_used_bytes{{gpu=\"{gpu}\"}}");

    // Under load: the GPU busy, warmer and drawing more; the claim holds
    // what its Pod allocated and occupies the GPU's SMs.
    let loaded = wait_for("the load in the metrics", TIMEOUT, || async {
        let text = scrape(address).await?;
        let busy = sample(&text, &utilization).is_some_and(|u| u > 0.0)
            && sample(&text, &claim_memory) == Some(ALLOC as f64)
            && sample(&text, &claim_sm).is_some_and(|s| s > 0.0);
        Ok(busy.then_some(text))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}; last scrape:\n{}", last_lines(address)))?;
    for (series, above) in [(&temperature, 32.0), (&power, 70.0)] {
        let v = sample(&loaded, series).with_context(|| format!("{series} missing"))?;
        ensure!(
            v > above,
            "{series} is {v} under load, not above idle ({above})"
        );
    }
    let used_now = sample(&loaded, &used).context("GPU memory used missing")?;
    ensure!(
        used_now >= ALLOC as f64,
        "{used} is {used_now}, less than the Pod allocated ({ALLOC})"
    );

    // The load ends: the probe is killed, its memory goes with it.
    std::fs::write(trigger.join("stop"), "")?;
    log_with(&pods, "worker", "stopped").await?;
    wait_for("the metrics to fall back", TIMEOUT, || async {
        let text = scrape(address).await?;
        let idle =
            sample(&text, &utilization) == Some(0.0) && sample(&text, &claim_memory) == Some(0.0);
        Ok(idle.then_some(()))
    })
    .await?;

    // The Pod gone, the claim is unprepared: its series go.
    pods.delete("worker", &DeleteParams::default().grace_period(0))
        .await?;
    wait_for("the claim's series to go", TIMEOUT, || async {
        let text = scrape(address).await?;
        Ok(sample(&text, &claim_memory).is_none().then_some(()))
    })
    .await?;
    Ok(())
}

/// The `tessera_gpu_*` and `tessera_claim_*` lines of a scrape now, for a
/// failure's message.
fn last_lines(address: SocketAddr) -> String {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return String::new();
    };
    let text = tokio::task::block_in_place(|| runtime.block_on(scrape(address)));
    match text {
        Ok(text) => text
            .lines()
            .filter(|l| l.starts_with("tessera_gpu_") || l.starts_with("tessera_claim_m"))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("(no scrape: {e:#})"),
    }
}

#[test]
fn samples_are_read_by_exact_series() {
    let text = "tessera_gpu_utilization_ratio{gpu=\"GPU-a\"} 1.0\n\
                tessera_gpu_utilization_ratio{gpu=\"GPU-ab\"} 0.0\n";
    assert_eq!(
        sample(text, "tessera_gpu_utilization_ratio{gpu=\"GPU-a\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(text, "tessera_gpu_utilization_ratio{gpu=\"GPU-b\"}"),
        None
    );
}
