//! The local cluster as `conformance/cluster.sh` runs it, for tests whose
//! pods really execute on the kubelet's node: the script itself, its state
//! files, the node process it starts and the probe image pods run.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams};
use serde_json::{Value, json};
use tessera_conformance::suite::ops::describe_pod;
use tessera_conformance::{ClusterEnv, TestCluster, TestNamespace, wait_for};
use tessera_driver::probe::ProbeReport;
use tessera_test_kit::cluster::{ClusterState, parse_exports};

use super::{binaries, repo_root};

/// How long [`log_with`] waits for a real container's output: the pod
/// tests' timeout, twice the plugin tests' `TIMEOUT`.
pub const POD_TIMEOUT: Duration = Duration::from_secs(120);

/// The container runtime the cluster's kubelet uses: only under
/// `containerd` do pods execute (the fake CRI never runs them).
pub fn container_runtime(env: &ClusterEnv) -> String {
    std::env::var("TESSERA_CONTAINER_RUNTIME")
        .ok()
        .filter(|v| !v.is_empty())
        .or_else(|| {
            ClusterState::new(&env.state_dir)
                .cluster_env()
                .remove("CONTAINER_RUNTIME")
        })
        .unwrap_or_else(|| "fake".to_owned())
}

/// `cluster.sh <args>` on this test's cluster; its stdout (what `env`
/// prints), an error with its stderr when it fails.
pub fn cluster_sh(env: &ClusterEnv, args: &[&str]) -> Result<String> {
    let out = Command::new(repo_root().join("conformance/cluster.sh"))
        .args(args)
        .env("TESSERA_CLUSTER_DIR", &env.state_dir)
        .output()
        .context("running cluster.sh")?;
    if !out.status.success() {
        bail!(
            "cluster.sh {args:?} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The variables `cluster.sh env` exports (the cluster's, and after
/// `node-start` the simulated node's: `TESSERA_NODE_MPS_DIR`, ...).
pub fn cluster_env_vars(env: &ClusterEnv) -> Result<BTreeMap<String, String>> {
    Ok(parse_exports(&cluster_sh(env, &["env"])?))
}

/// The node process `cluster.sh node-start` started, while it runs (its
/// pid file outlives it).
pub fn node_pid(env: &ClusterEnv) -> Option<i32> {
    let pid = ClusterState::new(&env.state_dir).recorded_pid("tessera-node")?;
    // SAFETY: signal 0 only checks that the process exists.
    (unsafe { libc::kill(pid, 0) == 0 }).then_some(pid)
}

/// Whether a node process runs: a test that finds none starts its own and
/// stops it after.
pub fn node_running(env: &ClusterEnv) -> bool {
    node_pid(env).is_some()
}

/// The image test pods run (busybox + glibc, imported by the cluster):
/// `TESSERA_PROBE_IMAGE` when set.
pub fn probe_image() -> String {
    std::env::var("TESSERA_PROBE_IMAGE")
        .ok()
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| "tessera.local/probe:1".into())
}

/// The Pod's log once it contains `what`; on timeout, the error says where
/// the pod is (phase, scheduler, containers, last warning) and its log.
pub async fn log_with(pods: &Api<Pod>, pod: &str, what: &str) -> Result<String> {
    let read = || async {
        pods.logs(pod, &LogParams::default())
            .await
            .unwrap_or_default()
    };
    let waited = wait_for(
        &format!("{pod}'s log to show {what}"),
        POD_TIMEOUT,
        || async {
            let log = read().await;
            Ok(log.contains(what).then_some(log))
        },
    )
    .await;
    let Err(e) = waited else {
        return waited;
    };
    let state = match pods.get(pod).await {
        Ok(p) => {
            let ns = pods.namespace().unwrap_or_default();
            describe_pod(&pods.clone().into_client(), ns, &p).await
        }
        Err(err) => format!("pod {pod} unreadable: {err}"),
    };
    Err(e.context(format!("{state}\nits log:\n{}", read().await)))
}

/// Deletes every Pod of the test's namespace and waits until none is left,
/// so their claims are unprepared before the node process may stop. The
/// grace period is one second, not zero: zero removes the object at once
/// (a forced delete), and the kubelet would unprepare after the node
/// process had gone, leaving its claims' MPS daemons behind. With a grace
/// period the kubelet removes the object only once nothing of the pod is
/// left to unprepare. A cleanup step: failures are left to the test's own
/// assertions.
pub async fn delete_pods(ns: &TestNamespace) {
    let pods = ns.api::<Pod>();
    if let Ok(list) = pods.list(&ListParams::default()).await {
        for p in list.items {
            let name = p.metadata.name.unwrap_or_default();
            let _ = pods
                .delete(&name, &DeleteParams::default().grace_period(1))
                .await;
        }
    }
    let _ = wait_for("the test's pods gone", POD_TIMEOUT, || {
        let pods = pods.clone();
        async move {
            Ok(pods
                .list(&ListParams::default())
                .await?
                .items
                .is_empty()
                .then_some(()))
        }
    })
    .await;
}

/// `tessera status -o json` on the node of `cluster.sh node-start`.
pub fn node_status(env: &ClusterEnv, driver: &str, extra: &[&str]) -> Result<Value> {
    let vars = cluster_env_vars(env)?;
    let var = |k: &str| {
        vars.get(k)
            .with_context(|| format!("cluster.sh env has no {k}"))
    };
    let nvml = Path::new(var("TESSERA_NODE_DRIVER_ROOT")?)
        .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    let out = Command::new(&binaries().tessera)
        .arg("--nvml-library")
        .arg(nvml)
        .args(["status", "-o", "json", "--driver-name", driver])
        .arg("--state-dir")
        .arg(var("TESSERA_NODE_STATE_DIR")?)
        .arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .args(extra)
        .env(
            "TESSERA_FAKE_NVML_TOPOLOGY",
            var("TESSERA_FAKE_NVML_TOPOLOGY")?,
        )
        .env("TESSERA_FAKE_NVML_STATE", var("TESSERA_FAKE_NVML_STATE")?)
        .env(
            "TESSERA_FAKE_NVML_DRIVER_ROOT",
            var("TESSERA_FAKE_NVML_DRIVER_ROOT")?,
        )
        .output()
        .context("running tessera status")?;
    ensure!(
        out.status.success(),
        "tessera status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The node process on the kubelet's node (`cluster.sh node-start`), for a
/// test whose pods really run: the one running, used with its driver name;
/// otherwise one started over a topology of the test's, which
/// [`PodNode::stop`] stops and removes.
pub struct PodNode {
    pub driver: String,
    started: bool,
}

impl PodNode {
    /// `None` (the test skips, saying why) where pods never execute: no
    /// kubelet, or a CRI other than containerd. `reads` says what the test
    /// reads from its pods; `extra` goes to `node-start` after `--topology`.
    pub fn start(
        env: &ClusterEnv,
        reads: &str,
        topology: &str,
        extra: &[&str],
    ) -> Result<Option<PodNode>> {
        if env.kubelet.is_none() {
            eprintln!("SKIP: the cluster runs without a kubelet (TESSERA_KUBELET=0)");
            return Ok(None);
        }
        let runtime = container_runtime(env);
        if runtime != "containerd" {
            eprintln!(
                "SKIP: the cluster's kubelet runs the {runtime} CRI, where pods never execute; \
                 this test reads {reads}"
            );
            return Ok(None);
        }
        let started = !node_running(env);
        if started {
            let topology = repo_root()
                .join("driver/fake-nvml/topologies")
                .join(topology);
            let topology = topology.to_str().context("topology path")?;
            let mut args = vec!["node-start"];
            // A node that ran before keeps its machine (node.env).
            if !env.state_dir.join("node/node.env").exists() {
                args.extend(["--topology", topology]);
            }
            args.extend(extra);
            cluster_sh(env, &args)?;
        }
        let driver = ClusterState::new(&env.state_dir).node_driver();
        Ok(Some(PodNode { driver, started }))
    }

    /// Stops and removes the node process if [`PodNode::start`] started it
    /// (the test's pods must be gone first, so their claims are unprepared).
    pub fn stop(self, env: &ClusterEnv) {
        if self.started {
            let _ = cluster_sh(env, &["node-stop"]);
            let _ = std::fs::remove_dir_all(env.state_dir.join("node"));
        }
    }
}

/// DeviceClass `<id>-isolated`: the Isolated share of GPU `gpu` alone, so
/// that every claim of a test lands on that one GPU.
pub fn isolated_class_on(id: &str, driver: &str, gpu: &str) -> Result<DeviceClass> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": format!("{id}-isolated") },
        "spec": { "selectors": [{ "cel": { "expression": format!(
            "device.driver == {driver:?} && device.attributes[{driver:?}].type == 'share' && \
             device.attributes[{driver:?}].isolationLevel == 'Isolated' && \
             device.attributes[{driver:?}].uuid == {gpu:?}"
        ) } }] },
    }))?)
}

/// The UUID of a GPU whose Isolated share device is published with MPS.
pub async fn mps_gpu(cluster: &TestCluster, node: &str, driver: &str) -> Result<String> {
    let slices: Api<ResourceSlice> = Api::all(cluster.client());
    let slices = slices.list(&ListParams::default()).await?;
    for slice in slices.items {
        let slice = serde_json::to_value(&slice)?;
        if slice["spec"]["nodeName"] != node || slice["spec"]["driver"] != driver {
            continue;
        }
        for device in slice["spec"]["devices"].as_array().into_iter().flatten() {
            let attr = |name: &str| device["attributes"][name]["string"].as_str();
            if attr("isolationLevel") == Some("Isolated")
                && attr("isolationProvider") == Some("mps")
                && let Some(uuid) = attr("uuid")
            {
                return Ok(uuid.to_owned());
            }
        }
    }
    bail!("node {node} publishes no Isolated share device with provider mps")
}

/// Where probe pods find the probe (the `tessera` binary, mounted
/// read-only).
pub const PROBE: &str = "/probe/tessera";

/// A Pod named `name` holding the claim of the same name, running `script`
/// in the probe image with the probe at [`PROBE`] and `trigger` (a host
/// directory the test writes files into) read-only at `/trigger`.
pub fn probe_pod(name: &str, script: &str, trigger: &Path) -> Result<Pod> {
    let tessera = binaries().tessera.clone();
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "restartPolicy": "Never",
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": name }],
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
                { "name": "probe", "hostPath": { "path": tessera, "type": "File" } },
                { "name": "trigger", "hostPath": { "path": trigger, "type": "Directory" } },
            ],
        },
    }))?)
}

/// The probe report a Pod printed after `tag` (a line `<tag> <json>`).
pub fn probe_report(log: &str, tag: &str) -> Result<ProbeReport> {
    let line = log
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{tag} ")))
        .with_context(|| format!("no {tag} line in:\n{log}"))?;
    serde_json::from_str(line).with_context(|| format!("{tag} is not a probe report: {line}"))
}
