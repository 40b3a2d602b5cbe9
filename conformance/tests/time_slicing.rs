//! The GPU's compute time slice, through the real kube-scheduler, kubelet
//! and containers, read back the way an operator reads it: the driver
//! root's `nvidia-smi compute-policy -i <GPU UUID> -l` (the simulated
//! machine's state file, see docs/simulated-gpus.md).
//!
//! * Node policy `timeSlice: long`: two Pods, each with its own claim on a
//!   Shared share of the same GPU, run and list that GPU with `nvidia-smi
//!   -L`; while they run the GPU's slice is `3 (Long)`. When the first
//!   claim is unprepared the slice stays; when the second is, it is back to
//!   `0 (Default)`.
//! * A Pod with two containers sharing one claim for a whole GPU with
//!   `GpuConfig` `sharing: {strategy: TimeSlicing, timeSlicing: {interval:
//!   Medium}}`: both containers see the GPU, the slice is `2 (Medium)`, the
//!   claim's status says `TimeSlicing`/`Medium`, and deleting the Pod
//!   resets the slice.
//! * Crash safety (only when the test started the node process itself): the
//!   node process is killed with SIGKILL while a Shared Pod holds the slice
//!   and started again; the slice is still set (the claim is still
//!   prepared), and deleting the Pod resets it, from what the checkpoint
//!   recorded.
//!
//! It needs the cluster's real container runtime and a node process with a
//! long time slice: one already running is used only if its policy says
//! `timeSlice: long` (otherwise the test is skipped: `cluster.sh node-stop`
//! first); else it is started over `h100x8.yaml` with that policy, and
//! stopped and removed after. Everything it creates in the API server is
//! its own (a namespace, DeviceClasses with a unique prefix).

mod plugin_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::{DeleteParams, LogParams, PostParams};
use serde_json::{Value, json};
use tessera_conformance::artifacts::binaries;
use tessera_conformance::{
    ClusterEnv, TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};

use plugin_support::cluster::{cluster_sh, container_runtime, delete_pods, node_pid, probe_image};
use plugin_support::repo_root;
use tessera_test_kit::cluster::{ClusterState, parse_exports};

const TOPOLOGY: &str = "h100x8.yaml";
const POLICY: &str = "gpus:\n- select: {all: true}\n  timeSlice: long\n";
const TIMEOUT: Duration = Duration::from_secs(120);
const LONG: &str = "3 (Long)";
const MEDIUM: &str = "2 (Medium)";
const DEFAULT: &str = "0 (Default)";

/// The simulated node's variables, as `cluster.sh env` prints them after
/// node-start.
struct Node {
    vars: BTreeMap<String, String>,
}

impl Node {
    fn load(env: &ClusterEnv) -> Result<Node> {
        let vars = parse_exports(&cluster_sh(env, &["env"])?);
        Ok(Node { vars })
    }

    fn var(&self, k: &str) -> Result<&str> {
        self.vars
            .get(k)
            .map(String::as_str)
            .with_context(|| format!("cluster.sh env has no {k}"))
    }

    fn with_machine(&self, cmd: &mut Command) -> Result<()> {
        for k in [
            "TESSERA_FAKE_NVML_TOPOLOGY",
            "TESSERA_FAKE_NVML_STATE",
            "TESSERA_FAKE_NVML_DRIVER_ROOT",
        ] {
            cmd.env(k, self.var(k)?);
        }
        Ok(())
    }

    /// `<driver root>/usr/bin/nvidia-smi compute-policy -i <uuid> -l`: the
    /// GPU's slice as the tool prints it, e.g. `3 (Long)`.
    fn time_slice(&self, gpu: &str) -> Result<String> {
        let root = Path::new(self.var("TESSERA_NODE_DRIVER_ROOT")?);
        let mut cmd = Command::new(root.join("usr/bin/nvidia-smi"));
        cmd.args(["compute-policy", "-i", gpu, "-l"])
            .env("LD_LIBRARY_PATH", root.join("usr/lib/x86_64-linux-gnu"));
        self.with_machine(&mut cmd)?;
        let out = cmd.output().context("running the node's nvidia-smi")?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "nvidia-smi compute-policy -i {gpu} -l failed ({}): {text} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        text.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "Timeslice").then(|| v.trim().to_owned())
            })
            .with_context(|| format!("no Timeslice line in nvidia-smi's answer: {text}"))
    }

    /// The claim UIDs the node process's checkpoint holds (`tessera status
    /// --no-api`), per GPU UUID.
    fn prepared(&self, driver: &str) -> Result<BTreeMap<String, Vec<String>>> {
        let nvml = Path::new(self.var("TESSERA_NODE_DRIVER_ROOT")?)
            .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
        let mut cmd = Command::new(&binaries().tessera);
        cmd.arg("--nvml-library")
            .arg(nvml)
            .args(["status", "-o", "json", "--no-api", "--driver-name", driver])
            .arg("--state-dir")
            .arg(self.var("TESSERA_NODE_STATE_DIR")?);
        self.with_machine(&mut cmd)?;
        let out = cmd.output().context("running tessera status")?;
        ensure!(
            out.status.success(),
            "tessera status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_slice(&out.stdout)?;
        Ok(report["gpus"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|g| {
                let uids = g["claims"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["uid"].as_str().map(str::to_owned))
                    .collect();
                (g["uuid"].as_str().unwrap_or_default().to_owned(), uids)
            })
            .collect())
    }

    fn holds(&self, driver: &str, uid: &str) -> Result<bool> {
        Ok(self
            .prepared(driver)?
            .values()
            .any(|uids| uids.iter().any(|u| u == uid)))
    }

    /// For assertion messages: the CDI specs the node wrote for a claim and
    /// the end of the node process's log (the host actions it took).
    fn evidence(&self, uid: &str) -> String {
        let mut out = String::new();
        if let Ok(dir) = self.var("TESSERA_NODE_CDI_DIR")
            && let Ok(entries) = std::fs::read_dir(dir)
        {
            for e in entries.flatten() {
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                if text.contains(uid) {
                    out += &format!("CDI spec {}:\n{text}\n", e.path().display());
                }
            }
        }
        if out.is_empty() {
            out += &format!("no CDI spec names claim {uid}\n");
        }
        if let Ok(log) = self.var("TESSERA_NODE_LOG") {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            out += "node process log (last 30 lines):\n";
            out += &lines[lines.len().saturating_sub(30)..].join("\n");
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_shares_and_time_slicing_configs_set_and_reset_the_gpus_time_slice() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    if env.kubelet.is_none() {
        eprintln!("SKIP: the cluster runs without a kubelet (TESSERA_KUBELET=0)");
        return Ok(());
    }
    let runtime = container_runtime(&env);
    if runtime != "containerd" {
        eprintln!(
            "SKIP: the cluster's kubelet runs the {runtime} CRI, where pods never execute; \
             this test reads what nvidia-smi printed in a pod"
        );
        return Ok(());
    }
    let node_dir = env.state_dir.join("node");
    let started_node = node_pid(&env).is_none();
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
        .to_ascii_lowercase()
        .contains("timeslice: long")
    {
        eprintln!(
            "SKIP: the running node process's policy sets no long time slice \
             (cluster.sh node-stop, and the test starts one that does)"
        );
        return Ok(());
    }
    let driver = ClusterState::new(&env.state_dir).node_driver();
    let cluster = TestCluster::shared().await?;
    let id = unique_name("ts");
    let ns = cluster.create_namespace("time-slicing").await?;
    let classes: Api<DeviceClass> = Api::all(cluster.client());

    let result = async {
        let node = Node::load(&env)?;
        let t = Test {
            env: &env,
            node,
            ns: &ns,
            driver: &driver,
            id: &id,
        };
        t.classes(&classes).await?;
        t.shared_shares().await?;
        t.time_slicing_config().await?;
        if started_node {
            t.node_crash().await?;
        } else {
            eprintln!("not killing a node process this test did not start: crash case skipped");
        }
        Ok(())
    }
    .await;

    // Unprepared before the node process may stop.
    delete_pods(&ns).await;
    let _ = ns.delete().await;
    for class in [format!("{id}-shared"), format!("{id}-gpu")] {
        let _ = delete_ignore_missing(&classes, &class).await;
    }
    if started_node {
        let _ = cluster_sh(&env, &["node-stop"]);
        let _ = std::fs::remove_dir_all(&node_dir);
    }
    result
}

struct Test<'a> {
    env: &'a ClusterEnv,
    node: Node,
    ns: &'a TestNamespace,
    driver: &'a str,
    id: &'a str,
}

impl Test<'_> {
    async fn classes(&self, classes: &Api<DeviceClass>) -> Result<()> {
        let d = self.driver;
        // Shared shares of GPUs whose policy sets a long slice.
        let shared = format!(
            "device.driver == {d:?} && device.attributes[{d:?}].type == 'share' && \
             device.attributes[{d:?}].isolationLevel == 'Shared' && \
             device.attributes[{d:?}].timeSlice == 'Long'"
        );
        let gpu = format!("device.driver == {d:?} && device.attributes[{d:?}].type == 'gpu'");
        for (suffix, cel) in [("shared", shared), ("gpu", gpu)] {
            let class: DeviceClass = serde_json::from_value(json!({
                "metadata": { "name": format!("{}-{suffix}", self.id) },
                "spec": { "selectors": [{ "cel": { "expression": cel } }] },
            }))?;
            classes.create(&PostParams::default(), &class).await?;
        }
        Ok(())
    }

    async fn claim(&self, name: &str, exactly: Value, config: Option<Value>) -> Result<String> {
        let mut spec = json!({ "requests": [{ "name": "gpu", "exactly": exactly }] });
        if let Some(config) = config {
            spec["config"] = json!([{ "requests": ["gpu"], "opaque": {
                "driver": self.driver,
                "parameters": config,
            } }]);
        }
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "devices": spec },
        }))?;
        let created = self
            .ns
            .api::<ResourceClaim>()
            .create(&PostParams::default(), &claim)
            .await?;
        created.metadata.uid.context("claim uid")
    }

    /// A Pod whose containers (name, command) all use claim `claim`.
    async fn pod(&self, name: &str, claim: &str, containers: &[(&str, &str)]) -> Result<()> {
        let containers: Vec<Value> = containers
            .iter()
            .map(|(c, command)| {
                json!({
                    "name": c,
                    "image": probe_image(),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sh", "-c", command],
                    "resources": { "claims": [{ "name": "gpu" }] },
                })
            })
            .collect();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": {
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": false,
                "restartPolicy": "Never",
                "resourceClaims": [{ "name": "gpu", "resourceClaimName": claim }],
                "containers": containers,
            },
        }))?;
        self.ns
            .api::<Pod>()
            .create(&PostParams::default(), &pod)
            .await?;
        Ok(())
    }

    async fn delete_pod(&self, name: &str) -> Result<()> {
        self.ns
            .api::<Pod>()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await?;
        Ok(())
    }

    /// The claim's `status.devices[0].data` once the driver wrote it.
    async fn device_data(&self, claim: &str) -> Result<Value> {
        let claims = self.ns.api::<ResourceClaim>();
        wait_for(
            &format!("{claim}'s status.devices data"),
            TIMEOUT,
            || async {
                let c = claims.get(claim).await?;
                Ok(c.status
                    .and_then(|s| s.devices)
                    .and_then(|d| d.into_iter().next())
                    .and_then(|d| d.data)
                    .map(|d| d.0))
            },
        )
        .await
    }

    async fn gpu_of(&self, claim: &str) -> Result<String> {
        let data = self.device_data(claim).await?;
        data["gpuUUID"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("{claim}'s device data has no gpuUUID: {data}"))
    }

    /// The container's log once it contains `what`.
    async fn log_with(&self, pod: &str, container: &str, what: &str) -> Result<String> {
        let pods = self.ns.api::<Pod>();
        let params = LogParams {
            container: Some(container.to_owned()),
            ..LogParams::default()
        };
        wait_for(
            &format!("{pod}/{container}'s log to show {what}"),
            TIMEOUT,
            || async {
                let log = pods.logs(pod, &params).await.unwrap_or_default();
                Ok(log.contains(what).then_some(log))
            },
        )
        .await
    }

    async fn until_unprepared(&self, claim: &str, uid: &str) -> Result<()> {
        wait_for(
            &format!("claim {claim} unprepared (gone from the checkpoint)"),
            TIMEOUT,
            || async { Ok((!self.node.holds(self.driver, uid)?).then_some(())) },
        )
        .await
        .with_context(|| self.node.evidence(uid))
    }

    async fn until_slice(&self, gpu: &str, want: &str, uid: &str) -> Result<()> {
        wait_for(
            &format!("GPU {gpu}'s time slice to be {want}"),
            TIMEOUT,
            || async { Ok((self.node.time_slice(gpu)? == want).then_some(())) },
        )
        .await
        .with_context(|| {
            format!(
                "the slice is {:?}\n{}",
                self.node.time_slice(gpu),
                self.node.evidence(uid)
            )
        })
    }

    fn expect_slice(&self, gpu: &str, want: &str, when: &str, uid: &str) -> Result<()> {
        let have = self.node.time_slice(gpu)?;
        ensure!(
            have == want,
            "{when}: GPU {gpu}'s time slice is {have}, not {want}\n{}",
            self.node.evidence(uid)
        );
        Ok(())
    }

    /// Two Pods, two claims, Shared shares of one GPU: the first sets the
    /// policy's slice, the last to go resets it.
    async fn shared_shares(&self) -> Result<()> {
        let class = format!("{}-shared", self.id);
        let share = |pin: Option<&str>| {
            let mut exactly = json!({
                "deviceClassName": class,
                "capacity": { "requests": { "memory": "1Gi", "cores": "10" } },
            });
            if let Some(gpu) = pin {
                let d = self.driver;
                exactly["selectors"] = json!([{ "cel": { "expression": format!(
                    "device.attributes[{d:?}].uuid == {gpu:?}"
                ) } }]);
            }
            exactly
        };
        let list = "nvidia-smi -L; echo listed; exec sleep 3600";
        let uid_a = self.claim("share-a", share(None), None).await?;
        self.pod("share-a", "share-a", &[("main", list)]).await?;
        let gpu = self.gpu_of("share-a").await?;
        let uid_b = self.claim("share-b", share(Some(&gpu)), None).await?;
        self.pod("share-b", "share-b", &[("main", list)]).await?;
        for (pod, uid) in [("share-a", &uid_a), ("share-b", &uid_b)] {
            let log = self.log_with(pod, "main", "listed").await?;
            ensure!(
                log.contains(&format!("(UUID: {gpu})")),
                "{pod}'s nvidia-smi -L does not list {gpu}:\n{log}\n{}",
                self.node.evidence(uid)
            );
        }
        let b_gpu = self.gpu_of("share-b").await?;
        ensure!(b_gpu == gpu, "share-b got GPU {b_gpu}, not {gpu}");
        self.expect_slice(&gpu, LONG, "two Shared claims run", &uid_a)?;

        self.delete_pod("share-a").await?;
        self.until_unprepared("share-a", &uid_a).await?;
        ensure!(
            self.node.holds(self.driver, &uid_b)?,
            "share-b is no longer prepared after share-a's pod was deleted"
        );
        self.expect_slice(
            &gpu,
            LONG,
            "share-a unprepared, share-b still holds the GPU",
            &uid_b,
        )?;

        self.delete_pod("share-b").await?;
        self.until_unprepared("share-b", &uid_b).await?;
        self.expect_slice(&gpu, DEFAULT, "the last Shared claim unprepared", &uid_b)?;
        Ok(())
    }

    /// One Pod, two containers, one claim for a whole GPU with a
    /// TimeSlicing GpuConfig.
    async fn time_slicing_config(&self) -> Result<()> {
        let config = json!({
            "apiVersion": "gpu.tessera.dev/v1alpha1",
            "kind": "GpuConfig",
            "sharing": { "strategy": "TimeSlicing", "timeSlicing": { "interval": "Medium" } },
        });
        let uid = self
            .claim(
                "whole",
                json!({ "deviceClassName": format!("{}-gpu", self.id) }),
                Some(config),
            )
            .await?;
        let list = "nvidia-smi -L; echo \"visible=$NVIDIA_VISIBLE_DEVICES\"; echo listed; \
                    exec sleep 3600";
        self.pod("whole", "whole", &[("first", list), ("second", list)])
            .await?;
        let gpu = self.gpu_of("whole").await?;
        for c in ["first", "second"] {
            let log = self.log_with("whole", c, "listed").await?;
            ensure!(
                log.contains(&format!("(UUID: {gpu})")) && log.contains(&format!("visible={gpu}")),
                "container {c} of the pod does not see {gpu}:\n{log}\n{}",
                self.node.evidence(&uid)
            );
        }
        let data = self.device_data("whole").await?;
        ensure!(
            data["sharing"] == "TimeSlicing" && data["timeSlice"] == "Medium",
            "the claim's device data does not say TimeSlicing/Medium: {data}"
        );
        self.expect_slice(&gpu, MEDIUM, "a TimeSlicing claim holds the GPU", &uid)?;
        self.delete_pod("whole").await?;
        self.until_unprepared("whole", &uid).await?;
        self.expect_slice(&gpu, DEFAULT, "the TimeSlicing claim unprepared", &uid)?;
        Ok(())
    }

    /// SIGKILL the node process while a Shared claim holds the slice; the
    /// restarted process keeps it and resets it at unprepare.
    async fn node_crash(&self) -> Result<()> {
        let exactly = json!({
            "deviceClassName": format!("{}-shared", self.id),
            "capacity": { "requests": { "memory": "1Gi", "cores": "10" } },
        });
        let uid = self.claim("crash", exactly, None).await?;
        self.pod(
            "crash",
            "crash",
            &[("main", "nvidia-smi -L; echo listed; exec sleep 3600")],
        )
        .await?;
        self.log_with("crash", "main", "listed").await?;
        let gpu = self.gpu_of("crash").await?;
        self.expect_slice(&gpu, LONG, "a Shared claim runs", &uid)?;

        let pid = node_pid(self.env).context("the node process is not running")?;
        // SAFETY: a process this test started (cluster.sh node-start).
        ensure!(
            unsafe { libc::kill(pid, libc::SIGKILL) } == 0,
            "cannot kill the node process {pid}"
        );
        wait_for("the killed node process gone", TIMEOUT, || async {
            Ok(node_pid(self.env).is_none().then_some(()))
        })
        .await?;
        self.expect_slice(&gpu, LONG, "the node process was killed", &uid)?;
        cluster_sh(self.env, &["node-start"])?;
        ensure!(
            self.node.holds(self.driver, &uid)?,
            "the restarted node process dropped the prepared claim\n{}",
            self.node.evidence(&uid)
        );
        self.expect_slice(&gpu, LONG, "the node process restarted", &uid)?;

        self.delete_pod("crash").await?;
        self.until_unprepared("crash", &uid).await?;
        self.until_slice(&gpu, DEFAULT, &uid).await
    }
}
