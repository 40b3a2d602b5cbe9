//! The Helm chart (`deploy/helm/tessera`) installed for real on the local
//! cluster's kubelet node, from the image `conformance/cluster/image.sh`
//! builds (`FROM scratch`: the release `tessera` and the libraries it links)
//! and imports into the cluster's containerd:
//!
//! * `helm lint` passes (defaults and this test's values), the PodMonitor is
//!   rendered only when enabled;
//! * `helm install`: the DaemonSet's pod runs, registers with the kubelet
//!   and publishes the node's slices; the DeviceClasses it installed are
//!   those of `deploy/deviceclasses.yaml` for the chart's driver name;
//! * the example claim's pod (`deploy/examples/whole-gpu.yaml`) runs and
//!   sees exactly the GPU its claim got;
//! * the admission policy, as the daemon's service account with a token bound
//!   to the daemon's pod (it carries the node's name), denies slice writes
//!   for another node or driver and a token without the node, and admits its
//!   own node's;
//! * `helm upgrade` to a new image tag rolls the pod (maxSurge 1: the new
//!   pod waits for the state lock while the old one serves); a pod created
//!   during the roll runs without a failed prepare, the slices are not
//!   rewritten, and the new pod unprepares and prepares claims afterwards;
//! * the webhook as deployed (in the same install): its Deployment runs with
//!   a certificate for its Service's name from a Secret, the API server
//!   calls it through the Service (`failurePolicy: Fail`), a claim with a bad
//!   config for the driver is refused with the webhook's words, a good one
//!   admitted;
//! * rendered only (no cluster): the node pod mounts `<kubeletDir>/plugins/
//!   <driverName>` and no directory above it, and `admissionPolicy.enabled:
//!   false` fails to render for an API server before 1.36, renders on 1.36;
//! * with `nvidiaCompatibleNames: true` (a second case, on eight simulated
//!   H100s): the driver is `gpu.nvidia.com`, its DeviceClasses are
//!   `gpu.nvidia.com`, `mig.nvidia.com`, ... (those of
//!   `deploy/deviceclasses.yaml` for `nvidia.com`); `tessera-conformance
//!   --driver gpu.nvidia.com` (KAR-0003, secure access) passes; a claim written as for
//!   NVIDIA's driver (class `gpu.nvidia.com`, a CEL selector on
//!   `productName` and `pcieBusID`) gets that GPU and its pod sees exactly
//!   it; `deploy/examples/nvidia-gpu.yaml` runs as it is; a Pod asking
//!   `resources.limits: {nvidia.com/gpu: 1}` (`extended-resource.yaml`)
//!   gets a GPU of its own and sees exactly it; and every other
//!   manifest of `deploy/examples` runs with its classes renamed to
//!   `nvidia.com`.
//!
//! The simulated machine is the node's (`<state>/sim-kernel`, what every
//! container sees at /run/tessera-sim), so the test needs the node slot of
//! `cluster.sh node-start` free, as `node_start.rs` does; its driver name,
//! namespace, release and host directories are its own.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod plugin_support;
#[path = "helm_install/survival.rs"]
mod survival;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod, Secret};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::{Value, json};
use tessera_api::config::{API_VERSION, decode_value};
use tessera_conformance::procs::run;
use tessera_conformance::tls::serving_certificate;
use tessera_conformance::{
    TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};
use tessera_test_kit::driver_root::{DriverRootBuilder, Fakes, NVML, minors_of};

use plugin_support::{binaries, repo_root, status_gpu_uuid};

/// Two whole GPUs: the example pod's and the pods of the roll.
const TOPOLOGY: &str = "l4x2.yaml";
/// Eight GPUs that offer every mode: one per example of deploy/examples
/// and the NVIDIA-style claims.
const NVIDIA_TOPOLOGY: &str = "h100x8.yaml";
/// The namespace deploy/examples/monitoring.yaml creates.
const MONITORING_NS: &str = "gpu-monitoring";
/// Both cases use the node's simulated machine and CDI directory: one at a time.
static NODE_SLOT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// Pods start from an image containerd has, but the first start of the
/// node process also builds its model: be patient on two cores.
const TIMEOUT: Duration = Duration::from_secs(180);
/// Every container of the node sees the simulated machine here.
const SIM_MOUNT: &str = "/run/tessera-sim";
/// How long after its container starts a new pod may first turn Ready (and
/// the DaemonSet delete the old one): the window in which the test's pod is
/// created, scheduled and prepared by the old pod. (`minReadySeconds` would
/// say the same, but with maxSurge the 1.36 DaemonSet controller was seen
/// not to come back after it: the roll stopped with both pods Ready.)
const STARTUP_DELAY_SECONDS: u64 = 15;

fn chart() -> PathBuf {
    repo_root().join("deploy/helm/tessera")
}

/// The authenticated metrics Service only when asked for: its endpoint,
/// the Service over the node pods alone, the reader's ClusterRole and the
/// node's right to review tokens; a given certificate is mounted.
async fn check_metrics_service(helm: &Helm, chart: &str, plain: &str) -> Result<()> {
    ensure!(
        !plain.contains("--metrics-secure-address") && !plain.contains("https-metrics"),
        "the metrics Service must be off by default:\n{plain}"
    );
    let served = helm
        .run(&[
            "template",
            "t",
            chart,
            "--set",
            "metrics.service.enabled=true",
            "--set",
            "metrics.service.tls.secretName=metrics-cert",
        ])
        .await?;
    for want in [
        "--metrics-secure-address=0.0.0.0:9401",
        "--metrics-tls-cert-file=/etc/tessera/metrics-tls/tls.crt",
        "secretName: metrics-cert",
        "name: https-metrics",
        "name: t-tessera-metrics-reader",
        "nonResourceURLs: [\"/metrics\"]",
        "resources: [\"tokenreviews\"]",
        "resources: [\"subjectaccessreviews\"]",
    ] {
        ensure!(served.contains(want), "{want} missing:\n{served}");
    }
    // The loopback endpoint stays as it was.
    ensure!(served.contains("--metrics-address=127.0.0.1:9400"));
    Ok(())
}

/// The binder and the nodes' binding conditions only when asked for.
async fn check_binder(helm: &Helm, chart: &str, plain: &str) -> Result<()> {
    ensure!(
        !plain.contains("--binding-conditions=auto") && !plain.contains("- binder"),
        "binding conditions must be off by default:\n{plain}"
    );
    let bound = helm
        .run(&[
            "template",
            "t",
            chart,
            "--set",
            "bindingConditions.enabled=true",
        ])
        .await?;
    for want in [
        "--binding-conditions=auto",
        "name: t-tessera-binder",
        "- binder",
        "resources: [\"resourceclaims\"]",
        "name: t-tessera-binding-requests",
        "fieldPath: metadata.namespace",
    ] {
        ensure!(bound.contains(want), "{want} missing:\n{bound}");
    }
    Ok(())
}

/// The default chart serves metrics on the node's loopback only, and its
/// probes ask the pod's own process over a socket in an emptyDir (never the
/// node's port, which the old pod of a rolling update holds).
fn check_endpoints(rendered: &str) -> Result<()> {
    ensure!(
        rendered.contains("--metrics-address=127.0.0.1:9400"),
        "metrics must default to loopback:\n{rendered}"
    );
    let socket = "--socket=/run/tessera-health/health.sock";
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let (_, after) = rendered
            .split_once(&format!("{probe}:"))
            .with_context(|| format!("no {probe}"))?;
        let command = after.lines().take(3).collect::<Vec<_>>().join("\n");
        ensure!(
            command.contains("exec:") && command.contains("health") && command.contains(socket),
            "{probe} must be an exec probe on the pod's socket:\n{command}"
        );
    }
    ensure!(
        rendered.contains("--health-socket=/run/tessera-health/health.sock")
            && rendered.contains("mountPath: /run/tessera-health")
            && rendered.contains("emptyDir:"),
        "the probe socket must be in an emptyDir:\n{rendered}"
    );
    Ok(())
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await?
}

/// `conformance/cluster/image.sh` for this cluster.
fn image_script(state_dir: &Path, args: &[&str]) -> Result<String> {
    run(
        Command::new(repo_root().join("conformance/cluster/image.sh"))
            .args(args)
            .env("TESSERA_CLUSTER_DIR", state_dir),
    )
}

/// The helm client, with its caches and config in the test's directory.
struct Helm {
    bin: PathBuf,
    home: PathBuf,
    kubeconfig: PathBuf,
}

impl Helm {
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(args)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .env("HELM_CACHE_HOME", self.home.join("cache"))
            .env("HELM_CONFIG_HOME", self.home.join("config"))
            .env("HELM_DATA_HOME", self.home.join("data"));
        c
    }

    async fn run(&self, args: &[&str]) -> Result<String> {
        let mut c = self.command(args);
        blocking(move || run(&mut c)).await
    }
}

/// The host side of the simulated node the chart's pod runs on.
struct Machine {
    dir: tempfile::TempDir,
    sim_kernel: PathBuf,
}

impl Machine {
    fn driver_root(&self) -> PathBuf {
        self.dir.path().join("driver")
    }

    /// A driver root as a host with the NVIDIA driver has it (the fake
    /// library and tools copied in, so every path resolves inside it, as
    /// the pod sees it), and the machine's topology in the node's
    /// sim-kernel directory, emptied first (a new machine).
    fn new(state_dir: &Path, topology: &str) -> Result<Machine> {
        // Short: the MPS pipes below it are Unix sockets.
        let dir = tempfile::Builder::new().prefix("th").tempdir()?;
        let sim_kernel = state_dir.join("sim-kernel");
        std::fs::create_dir_all(&sim_kernel)?;
        for entry in std::fs::read_dir(&sim_kernel)? {
            let path = entry?.path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path)?;
            } else {
                std::fs::remove_file(&path)?;
            }
        }
        std::fs::copy(
            repo_root()
                .join("driver/fake-nvml/topologies")
                .join(topology),
            sim_kernel.join("topology.yaml"),
        )?;
        let m = Machine { dir, sim_kernel };
        std::fs::create_dir_all(m.dir.path().join("state"))?;
        m.share_mps_dir()?;
        DriverRootBuilder::simulated(&Fakes::built())
            .copied()
            .gpus_asked(|_| m.minors())
            .build(&m.driver_root())?;
        Ok(m)
    }

    fn mps_dir(&self) -> PathBuf {
        self.dir.path().join("mps")
    }

    /// The chart mounts mpsDir with Bidirectional propagation (the node
    /// process mounts each daemon's tmpfs there for the runtime to see),
    /// which the runtime refuses below a private mount: "/" is private on
    /// this machine (no systemd), so mpsDir becomes a shared mount of its
    /// own, as it is below a systemd host's shared "/".
    fn share_mps_dir(&self) -> Result<()> {
        let dir = self.mps_dir();
        std::fs::create_dir_all(&dir)?;
        run(Command::new("mount").arg("--bind").arg(&dir).arg(&dir))?;
        run(Command::new("mount").arg("--make-shared").arg(&dir))?;
        Ok(())
    }

    /// The GPUs' minors, as `tessera inventory` on this machine reports them.
    fn minors(&self) -> Result<Vec<u32>> {
        let b = binaries();
        let out = run(Command::new(&b.tessera)
            .arg("--nvml-library")
            .arg(self.driver_root().join(NVML))
            .args(["inventory", "-o", "json"])
            .env(
                "TESSERA_FAKE_NVML_TOPOLOGY",
                self.sim_kernel.join("topology.yaml"),
            )
            .env(
                "TESSERA_FAKE_NVML_STATE",
                self.sim_kernel.join("nvml.state"),
            )
            .env("TESSERA_FAKE_NVML_DRIVER_ROOT", self.driver_root())
            .env_remove("TESSERA_FAKE_NVML_DEV_ROOT"))?;
        let minors = minors_of(out.as_bytes())?;
        ensure!(!minors.is_empty(), "the simulated machine has no GPUs");
        Ok(minors)
    }

    /// Empties the node's machine state again (what `node-start` of a new
    /// machine would do too).
    fn clear(&self) {
        if let Ok(entries) = std::fs::read_dir(&self.sim_kernel) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

impl Drop for Machine {
    /// Lazily, with whatever a daemon left mounted below it: the directory
    /// goes with the TempDir after.
    fn drop(&mut self) {
        let _ = run(Command::new("umount").arg("--lazy").arg(self.mps_dir()));
    }
}

/// The chart's values for this cluster: the test's image, driver name and
/// host paths, the node's simulated machine, the API server on loopback
/// (no Service network here; the pod runs on the host network).
fn values(
    cluster: &TestCluster,
    kubelet: &tessera_conformance::KubeletDirs,
    machine: &Machine,
    driver: &str,
    tag: &str,
    mps_cgroup: &str,
) -> Result<Value> {
    let recorded = std::fs::read_to_string(cluster.state_dir().join("cluster.env"))?;
    let apiserver_port = recorded
        .lines()
        .find_map(|l| l.strip_prefix("APISERVER_PORT="))
        .map(|p| p.trim_matches('\'').to_owned())
        .context("no APISERVER_PORT in cluster.env")?;
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    Ok(json!({
        "driverName": driver,
        "image": { "repository": "tessera.local/tessera", "tag": tag },
        "kubeletDir": path(kubelet.root.clone()),
        // The node slot's CDI directory: containerd reads it, no other
        // plugin writes it while this test runs (checked at the start).
        "cdiDir": path(cluster.state_dir().join("node/cdi")),
        "stateDir": path(machine.dir.path().join("state")),
        "mpsDir": path(machine.mps_dir()),
        "mpsHostCgroup": mps_cgroup,
        "driverRoot": path(machine.driver_root()),
        "nvmlLibrary": NVML,
        // "/" is a private mount on this machine (no systemd).
        "driverRootMountPropagation": "None",
        "metrics": { "port": metrics_port },
        "probes": { "startup": { "initialDelaySeconds": STARTUP_DELAY_SECONDS } },
        "nodeSelector": { "kubernetes.io/hostname": cluster.node_name() },
        "extraEnv": [
            { "name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1" },
            { "name": "KUBERNETES_SERVICE_PORT", "value": apiserver_port },
            { "name": "TESSERA_FAKE_NVML_TOPOLOGY", "value": format!("{SIM_MOUNT}/topology.yaml") },
            { "name": "TESSERA_FAKE_NVML_STATE", "value": format!("{SIM_MOUNT}/nvml.state") },
            { "name": "TESSERA_FAKE_NVML_DRIVER_ROOT", "value": path(machine.driver_root()) },
            // The node process sees every GPU and changes the machine.
            { "name": "TESSERA_FAKE_NVML_DEV_ROOT", "value": "" },
        ],
        "extraVolumes": [
            { "name": "sim-kernel", "hostPath": { "path": path(machine.sim_kernel.clone()), "type": "Directory" } },
        ],
        "extraVolumeMounts": [
            { "name": "sim-kernel", "mountPath": SIM_MOUNT },
        ],
    }))
}

/// The DaemonSet's pods of the release (not its webhook's), with the image
/// tag each runs.
async fn daemon_pods(pods: &Api<Pod>, release: &str) -> Result<Vec<(Pod, String)>> {
    let list = pods
        .list(&ListParams::default().labels(&format!(
            "app.kubernetes.io/instance={release},app.kubernetes.io/component!=webhook"
        )))
        .await?;
    Ok(list
        .items
        .into_iter()
        .map(|p| {
            let image = p
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            let tag = image.rsplit(':').next().unwrap_or_default().to_owned();
            (p, tag)
        })
        .collect())
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn running(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// Fails when the pod's container cannot start (its image, its spec) or
/// keeps crashing: waiting longer would not help.
fn stuck(pod: &Pod) -> Result<()> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    for c in statuses.into_iter().flatten() {
        if let Some(w) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) {
            let reason = w.reason.as_deref().unwrap_or_default();
            if matches!(
                reason,
                "CreateContainerError"
                    | "CreateContainerConfigError"
                    | "ErrImageNeverPull"
                    | "ErrImagePull"
                    | "ImagePullBackOff"
                    | "CrashLoopBackOff"
            ) {
                bail!(
                    "daemon pod {}: {reason}: {}",
                    name(pod),
                    w.message.as_deref().unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

fn name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

async fn logs(pods: &Api<Pod>, pod: &str) -> String {
    pods.logs(pod, &LogParams::default())
        .await
        .unwrap_or_default()
}

/// The one daemon pod running `tag`, once it is Ready and its node process
/// serves: registered with the kubelet, its slices published.
async fn registered_daemon(pods: &Api<Pod>, release: &str, tag: &str) -> Result<Pod> {
    let kubelet = tessera_conformance::ClusterEnv::from_env()?
        .kubelet
        .context("the chart's pod needs the cluster's kubelet")?;
    wait_for(
        &format!("the daemon pod of tag {tag} serving (registered, slices published)"),
        TIMEOUT,
        || async {
            for (pod, t) in daemon_pods(pods, release).await? {
                stuck(&pod)?;
                if t == tag && ready(&pod) && serving(&kubelet.root, &pod) {
                    return Ok(Some(pod));
                }
            }
            Ok(None)
        },
    )
    .await
}

/// Whether the pod's node process says it serves (`tessera health --probe
/// status`), asked on its probe socket: the pod's `health` emptyDir, which
/// the kubelet of this host keeps under its root. The path is longer than a
/// socket address may be, so the probe runs in that directory.
fn serving(kubelet_root: &Path, pod: &Pod) -> bool {
    let Some(uid) = pod.metadata.uid.as_deref() else {
        return false;
    };
    let dir = kubelet_root
        .join("pods")
        .join(uid)
        .join("volumes/kubernetes.io~empty-dir/health");
    Command::new(tessera_conformance::artifacts::tessera())
        .args(["health", "--probe", "status", "--socket", "health.sock"])
        .current_dir(&dir)
        .output()
        .is_ok_and(|out| out.status.success())
}

/// The node's slices of `driver` once the pool is complete: name -> resourceVersion.
async fn published(client: &Client, node: &str, driver: &str) -> Result<BTreeMap<String, String>> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let fields = format!("spec.nodeName={node},spec.driver={driver}");
    wait_for("the node's slices", TIMEOUT, || async {
        let list = api.list(&ListParams::default().fields(&fields)).await?;
        let complete = list.items.first().is_some_and(|first| {
            let pool = &first.spec.pool;
            list.items
                .iter()
                .all(|s| s.spec.pool.generation == pool.generation)
                && list.items.len() as i64 == pool.resource_slice_count
        });
        let devices = list
            .items
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum::<usize>();
        Ok((complete && devices > 0).then(|| {
            list.items
                .iter()
                .map(|s| {
                    (
                        s.metadata.name.clone().unwrap_or_default(),
                        s.metadata.resource_version.clone().unwrap_or_default(),
                    )
                })
                .collect()
        }))
    })
    .await
}

/// `kubectl` of the cluster, with `stdin` fed to it.
fn kubectl(cluster: &TestCluster, args: &[&str], stdin: Option<String>) -> Result<String> {
    let bin = cluster
        .env()
        .kube_bin
        .clone()
        .context("TESSERA_KUBE_BIN is not set")?;
    let mut child = Command::new(bin)
        .arg("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(text) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .context("kubectl stdin")?
            .write_all(text.as_bytes())?;
    }
    drop(child.stdin.take());
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The DeviceClasses of deploy/deviceclasses.yaml for `domain` (name ->
/// spec), read through kubectl, and the ones the chart installed.
async fn check_device_classes(cluster: &TestCluster, domain: &str) -> Result<()> {
    let text = std::fs::read_to_string(repo_root().join("deploy/deviceclasses.yaml"))?
        .replace("tessera.dev", domain);
    let c = cluster.clone();
    let rendered = blocking(move || {
        kubectl(
            &c,
            &["create", "--dry-run=client", "-o", "json", "-f", "-"],
            Some(text),
        )
    })
    .await?;
    // One JSON document per class.
    let rendered: Vec<Value> = serde_json::Deserializer::from_str(&rendered)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()?;
    let want: BTreeMap<String, Value> = rendered
        .iter()
        .map(|c| {
            (
                c["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                c["spec"].clone(),
            )
        })
        .collect();
    ensure!(
        !want.is_empty(),
        "no DeviceClass in deploy/deviceclasses.yaml"
    );
    let api: Api<DeviceClass> = Api::all(cluster.client());
    let installed: Vec<String> = api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|n| n.ends_with(&format!(".{domain}")))
        .collect();
    ensure!(
        installed.len() == want.len(),
        "the chart installed {installed:?}, deploy/deviceclasses.yaml has {:?}",
        want.keys()
    );
    for (name, spec) in &want {
        let got = api
            .get(name)
            .await
            .with_context(|| format!("the chart installed no DeviceClass {name}"))?;
        ensure!(
            &serde_json::to_value(&got.spec)? == spec,
            "DeviceClass {name}: the chart has {:?}, deploy/deviceclasses.yaml {spec}",
            got.spec
        );
    }
    Ok(())
}

/// The pod of deploy/examples/whole-gpu.yaml, for this test's classes.
async fn example_pod(cluster: &TestCluster, ns: &str, domain: &str) -> Result<()> {
    let text = std::fs::read_to_string(repo_root().join("deploy/examples/whole-gpu.yaml"))?
        .replace("tessera.dev", domain);
    let c = cluster.clone();
    let ns = ns.to_owned();
    blocking(move || kubectl(&c, &["apply", "-n", &ns, "-f", "-"], Some(text))).await?;
    Ok(())
}

/// A pod like the example's (its claim from the example's template).
async fn gpu_pod(pods: &Api<Pod>, name: &str) -> Result<()> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "cuda",
                "image": "tessera.local/probe:1",
                "command": ["sh", "-c", "nvidia-smi -L && exec sleep infinity"],
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
            "resourceClaims": [{ "name": "gpu", "resourceClaimTemplateName": "whole-gpu" }],
        },
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    Ok(())
}

/// Waits until `pod` runs and prints exactly the GPU its claim got; returns
/// the claim's name and the GPU's UUID.
async fn sees_its_gpu(ns: &TestNamespace, pod: &str) -> Result<(String, String)> {
    let pods: Api<Pod> = ns.api();
    let running_pod = wait_for(&format!("pod {pod} running"), TIMEOUT, || async {
        let p = pods.get(pod).await?;
        if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed") {
            bail!("pod {pod} failed: {:?}", p.status);
        }
        Ok(running(&p).then_some(p))
    })
    .await?;
    let claim = running_pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.resource_claim_name.clone())
        .or_else(|| {
            // The claim the scheduler made for the pod's resources.limits.
            let s = running_pod.status.as_ref()?;
            Some(
                s.extended_resource_claim_status
                    .as_ref()?
                    .resource_claim_name
                    .clone(),
            )
        })
        .or_else(|| {
            // A claim the pod names itself (no template): not in the status.
            running_pod
                .spec
                .as_ref()?
                .resource_claims
                .as_ref()?
                .first()?
                .resource_claim_name
                .clone()
        })
        .context("the pod's claim has no name")?;
    let uuid = status_gpu_uuid(&ns.api::<ResourceClaim>(), &claim).await?;
    let listing = wait_for(&format!("nvidia-smi -L of {pod}"), TIMEOUT, || async {
        let text = logs(&pods, pod).await;
        Ok(text.contains("GPU 0:").then_some(text))
    })
    .await?;
    let gpus: Vec<&str> = listing.lines().filter(|l| l.starts_with("GPU ")).collect();
    ensure!(
        gpus.len() == 1 && gpus[0].contains(&uuid),
        "{pod}: its claim got {uuid}, nvidia-smi -L lists {gpus:?}"
    );
    Ok((claim, uuid))
}

fn slice(name: &str, driver: &str, node: &str) -> Result<ResourceSlice> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
            "devices": [],
        },
    }))?)
}

fn denied(result: kube::Result<ResourceSlice>, policy: &str, what: &str) -> Result<()> {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains(policy) => {
            eprintln!("denied as expected ({what}): {}", s.message);
            Ok(())
        }
        Err(e) => bail!("{what}: expected a denial by {policy}, got {e}"),
        Ok(_) => bail!("{what}: admitted, the policy {policy} should deny it"),
    }
}

/// The admission policy, as the daemon's service account.
async fn check_admission(
    cluster: &TestCluster,
    ns: &TestNamespace,
    release: &str,
    daemon: &Pod,
    driver: &str,
) -> Result<()> {
    let node = cluster.node_name();
    let sa = daemon
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .context("the daemon pod has no service account")?;
    let policy = format!("{release}-tessera-own-node-slices");
    let bound = cluster
        .client_with_token(&ns.token(&sa, Some(daemon)).await?)
        .await?;

    // The API server puts the node of the pod the token is bound to into
    // the user's extra (ServiceAccountTokenPodNodeInfo, GA in 1.32).
    let review: SelfSubjectReview = Api::all(bound.clone())
        .create(&PostParams::default(), &serde_json::from_value(json!({}))?)
        .await
        .context("SelfSubjectReview as the daemon")?;
    let user = review
        .status
        .and_then(|s| s.user_info)
        .context("no user in the review")?;
    let extra = user.extra.unwrap_or_default();
    ensure!(
        extra.get("authentication.kubernetes.io/node-name") == Some(&vec![node.to_owned()]),
        "the bound token's user {:?} has no node name {node} in its extra {extra:?}",
        user.username
    );

    let as_daemon: Api<ResourceSlice> = Api::all(bound);
    let admin: Api<ResourceSlice> = Api::all(cluster.client());
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let other = unique_name("other-node");
    denied(
        as_daemon
            .create(
                &PostParams::default(),
                &slice(&unique_name("adm"), driver, &other)?,
            )
            .await,
        &policy,
        "a slice of another node",
    )?;
    denied(
        as_daemon
            .create(
                &dry,
                &slice(&unique_name("adm"), "gpu.other.example.com", node)?,
            )
            .await,
        &policy,
        "a slice of another driver on its own node",
    )?;
    // Deleting (or changing) another node's slice.
    let theirs = unique_name("adm-theirs");
    admin
        .create(&PostParams::default(), &slice(&theirs, driver, &other)?)
        .await?;
    let deleted = as_daemon.delete(&theirs, &DeleteParams::default()).await;
    delete_ignore_missing(&admin, &theirs).await?;
    match deleted {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains(&policy) => {}
        other => bail!("deleting another node's slice as the daemon: {other:?}"),
    }
    // Its own node's slice is admitted (a dry run: the pool stays the daemon's).
    as_daemon
        .create(&dry, &slice(&unique_name("adm-own"), driver, node)?)
        .await
        .context("the daemon's service account may write its own node's slice")?;
    // A token not bound to a pod names no node: nothing is admitted.
    let unbound = cluster
        .client_with_token(&ns.token(&sa, None).await?)
        .await?;
    denied(
        Api::<ResourceSlice>::all(unbound)
            .create(&dry, &slice(&unique_name("adm"), driver, node)?)
            .await,
        &policy,
        "a token without the node's name",
    )?;
    Ok(())
}

/// The chart's `<fullname>-webhook` (its Deployment, Service and the name
/// its certificate is for); the fullname is `<release>-tessera` for a
/// release whose name does not contain the chart's.
fn webhook_name(release: &str) -> Result<String> {
    let name = format!("{release}-tessera-webhook");
    ensure!(
        !release.contains("tessera") && name.len() <= 63,
        "release {release}: the chart names its webhook otherwise"
    );
    Ok(name)
}

/// Turns the webhook on in the values file: a certificate for its Service's
/// DNS name in a `kubernetes.io/tls` Secret of the release namespace, its
/// CA as the caBundle, one replica, and `failurePolicy: Fail`, so that
/// every claim with a config for the driver is admitted only by its answer.
async fn enable_webhook(ns: &TestNamespace, release: &str, values_file: &Path) -> Result<()> {
    let name = webhook_name(release)?;
    let dir = values_file
        .parent()
        .context("values dir")?
        .join("webhook-tls");
    std::fs::create_dir_all(&dir)?;
    let certs = serving_certificate(&dir, &format!("DNS:{name}.{}.svc", ns.name()))?;
    let secret_name = format!("{name}-tls");
    let secret: Secret = serde_json::from_value(json!({
        "metadata": { "name": secret_name },
        "type": "kubernetes.io/tls",
        "data": {
            "tls.crt": ByteString(std::fs::read(&certs.cert)?),
            "tls.key": ByteString(std::fs::read(&certs.key)?),
        },
    }))?;
    ns.api::<Secret>()
        .create(&PostParams::default(), &secret)
        .await
        .context("creating the webhook's TLS Secret")?;
    // The API's base64, as the chart wants the caBundle.
    let ca_bundle = serde_json::to_value(ByteString(std::fs::read(&certs.ca)?))?;
    let mut values: Value = serde_json::from_slice(&std::fs::read(values_file)?)?;
    values["webhook"] = json!({
        "enabled": true,
        "replicas": 1,
        "failurePolicy": "Fail",
        "tls": { "secretName": secret_name, "caBundle": ca_bundle },
    });
    std::fs::write(values_file, serde_json::to_vec_pretty(&values)?)?;
    Ok(())
}

/// A claim of `class` whose one config is `parameters` for `driver`.
fn configured_claim(
    name: &str,
    class: &str,
    driver: &str,
    parameters: Value,
) -> Result<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "devices": {
            "requests": [{ "name": "share", "exactly": { "deviceClassName": class } }],
            "config": [{ "opaque": { "driver": driver, "parameters": parameters } }],
        } },
    }))?)
}

/// The webhook as the chart deploys it: its Deployment available, the API
/// server calling it through its Service, a claim with an unknown field in
/// its ShareConfig refused with the webhook's words, a good one admitted.
async fn check_webhook(
    ns: &TestNamespace,
    release: &str,
    driver: &str,
    domain: &str,
) -> Result<()> {
    let webhook = webhook_name(release)?;
    let pods: Api<Pod> = ns.api();
    let selector = ListParams::default().labels(&format!(
        "app.kubernetes.io/instance={release},app.kubernetes.io/component=webhook"
    ));
    let deployments: Api<Deployment> = ns.api();
    let t0 = Instant::now();
    wait_for("the webhook's Deployment available", TIMEOUT, || async {
        for pod in pods.list(&selector).await?.items {
            stuck(&pod)?;
        }
        let available = deployments
            .get(&webhook)
            .await?
            .status
            .and_then(|s| s.available_replicas)
            .unwrap_or(0);
        Ok((available > 0).then_some(()))
    })
    .await?;
    eprintln!("the webhook's Deployment available in {:?}", t0.elapsed());

    let class = format!("gpu-isolated.{domain}");
    let bad_share = json!({ "apiVersion": API_VERSION, "kind": "ShareConfig",
                            "processLimit": { "memory": "4Gi" } });
    let problem = decode_value(&bad_share)
        .err()
        .context("the ShareConfig with an unknown field decodes")?;
    let field = match problem.field.as_str() {
        "parameters" => String::new(),
        f => format!(".{f}"),
    };
    let want = format!(
        "admission webhook \"claims.{driver}\" denied the request: claim {}/bad-share: \
         spec.devices.config[0].opaque.parameters{field}: {}; fix: {}",
        ns.name(),
        problem.message,
        problem.fix
    );
    let claims: Api<ResourceClaim> = ns.api();
    let bad = configured_claim("bad-share", &class, driver, bad_share)?;
    // The Service's endpoint reaches the API server a moment after the
    // pod is Ready: until then the call fails (failurePolicy: Fail).
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let last = std::sync::Mutex::new(String::new());
    wait_for("the API server calling the webhook", TIMEOUT, || async {
        match claims.create(&dry, &bad).await {
            Err(kube::Error::Api(s)) if s.message.contains("denied the request") => Ok(Some(())),
            Ok(_) => bail!("the claim with a bad config was admitted (dry run)"),
            Err(e) => {
                *last.lock().unwrap() = e.to_string();
                Ok(None)
            }
        }
    })
    .await
    .with_context(|| format!("last answer: {}", last.lock().unwrap()))?;
    let message = match claims.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(s)) => s.message,
        Err(e) => return Err(e).context("creating the claim with a bad config"),
        Ok(_) => bail!("the claim with a bad config was admitted"),
    };
    ensure!(
        message.contains(&want),
        "refusal {message:?} does not contain {want:?}"
    );
    ensure!(
        claims.get_opt("bad-share").await?.is_none(),
        "the refused claim exists"
    );
    let good = json!({ "apiVersion": API_VERSION, "kind": "ShareConfig",
                       "processLimits": { "memory": "4Gi", "computePercent": 50 } });
    claims
        .create(
            &PostParams::default(),
            &configured_claim("good-share", &class, driver, good)?,
        )
        .await
        .context("a claim with a good ShareConfig, through the webhook")?;
    // The deployed pod answered (not some other webhook of the name).
    let mut logged = String::new();
    for pod in pods.list(&selector).await?.items {
        logged.push_str(&logs(&pods, &name(&pod)).await);
    }
    ensure!(
        logged.contains(&format!("denied: claim {}/bad-share", ns.name())),
        "the webhook's pod logged no denial of the claim:\n{logged}"
    );
    eprintln!("the deployed webhook refused: {message}");
    Ok(())
}

/// Records the longest time no registration socket of `driver` was in the
/// kubelet's registry (a measurement, printed; nothing waits on it).
struct GapMeter {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Duration>,
}

impl GapMeter {
    fn start(registry: PathBuf, driver: String) -> GapMeter {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut longest = Duration::ZERO;
            let mut since: Option<Instant> = None;
            while !flag.load(Ordering::Relaxed) {
                let present = std::fs::read_dir(&registry).is_ok_and(|rd| {
                    rd.flatten().any(|e| {
                        e.file_name().to_str().is_some_and(|n| {
                            n.starts_with(&format!("{driver}-")) && n.ends_with("-reg.sock")
                        })
                    })
                });
                match (present, since) {
                    (false, None) => since = Some(Instant::now()),
                    (true, Some(t)) => {
                        longest = longest.max(t.elapsed());
                        since = None;
                    }
                    _ => {}
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            longest
        });
        GapMeter { stop, handle }
    }

    fn finish(self) -> Duration {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

/// Warning events the kubelet recorded for `pod` about preparing its claims.
async fn failed_prepares(ns: &TestNamespace, pod: &str) -> Result<Vec<String>> {
    let events = ns
        .api::<Event>()
        .list(&ListParams::default().fields(&format!("involvedObject.name={pod}")))
        .await?;
    Ok(events
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("FailedPrepareDynamicResources"))
        .map(|e| e.message.unwrap_or_default())
        .collect())
}

#[tokio::test]
async fn the_chart_installs_runs_gpu_pods_admits_only_its_node_and_rolls() -> Result<()> {
    let _slot = NODE_SLOT.lock().await;
    chart_case(Case::Roll).await
}

#[tokio::test]
async fn the_chart_installs_under_nvidia_compatible_names_and_runs_every_example() -> Result<()> {
    let _slot = NODE_SLOT.lock().await;
    chart_case(Case::Nvidia).await
}

#[tokio::test]
async fn an_isolated_workload_keeps_its_daemon_and_limits_through_sigkill_and_upgrade() -> Result<()>
{
    let _slot = NODE_SLOT.lock().await;
    chart_case(Case::Survival).await
}

/// What one install of the chart checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    /// Lint, install, admission, the roll (a driver name of its own).
    Roll,
    /// NVIDIA-compatible names and every example.
    Nvidia,
    /// An Isolated workload through SIGKILL of the node container and an
    /// upgrade (`chart_survival.rs`).
    Survival,
}

/// Installs the chart on the node and runs one case; cleans up either way.
async fn chart_case(case: Case) -> Result<()> {
    let nvidia = case == Case::Nvidia;
    let cluster = TestCluster::shared().await?;
    let Some(kubelet) = cluster.kubelet().cloned() else {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to install on");
        return Ok(());
    };
    let node_dir = cluster.state_dir().join("node");
    ensure!(
        !node_dir.join("node.env").exists(),
        "{} exists: a simulated node was started on this cluster (cluster.sh node-start); the \
         chart's pod needs the node's simulated machine: `conformance/cluster.sh node-stop && rm \
         -rf {}`, or run this test on a cluster of its own",
        node_dir.display(),
        node_dir.display()
    );

    // Tools: helm from its Go module, the image in two tags (the upgrade's).
    let id = unique_name("h");
    let (tag1, tag2) = (format!("{id}-a"), format!("{id}-b"));
    let state_dir = cluster.state_dir().to_path_buf();
    let t0 = Instant::now();
    let helm_bin = {
        let s = state_dir.clone();
        blocking(move || image_script(&s, &["helm"])).await?
    };
    {
        let (s, a, b) = (state_dir.clone(), tag1.clone(), tag2.clone());
        blocking(move || image_script(&s, &["import", "--tag", &a, "--tag", &b])).await?;
    }
    eprintln!("helm and the image ready in {:?}", t0.elapsed());
    let topology = if case == Case::Roll {
        TOPOLOGY
    } else {
        NVIDIA_TOPOLOGY
    };
    let machine = Machine::new(&state_dir, topology)?;
    let helm = Helm {
        bin: PathBuf::from(helm_bin.trim()),
        home: machine.dir.path().join("helm"),
        kubeconfig: cluster.kubeconfig().to_path_buf(),
    };

    let (driver, domain) = if nvidia {
        ("gpu.nvidia.com".to_owned(), "nvidia.com".to_owned())
    } else {
        (format!("gpu.{id}.tessera.dev"), format!("{id}.tessera.dev"))
    };
    let ns = cluster.create_namespace("helm").await?;
    let release = id.clone();
    let values_file = machine.dir.path().join("values.json");
    // A host cgroup of this test's own for the MPS daemons.
    let mps_cgroup = format!("{id}-mps");
    let mut values = values(&cluster, &kubelet, &machine, &driver, &tag1, &mps_cgroup)?;
    if nvidia {
        // The one value a user sets; driverName stays at its default.
        let v = values.as_object_mut().context("values")?;
        v.remove("driverName");
        v.insert("nvidiaCompatibleNames".into(), json!(true));
    }
    std::fs::write(&values_file, serde_json::to_vec_pretty(&values)?)?;

    let result = match case {
        Case::Nvidia => install_nvidia(&cluster, &helm, &ns, &release, &values_file, &tag1).await,
        Case::Roll => {
            install_and_roll(
                &cluster,
                &helm,
                &ns,
                &release,
                &driver,
                &domain,
                &values_file,
                &tag2,
                &kubelet,
            )
            .await
        }
        Case::Survival => {
            let chart = chart();
            let install = survival::Install {
                helm: &helm,
                ns: &ns,
                release: &release,
                driver: &driver,
                domain: &domain,
                chart: &chart,
                values: &values_file,
                tags: (&tag1, &tag2),
                mps_dir: &machine.mps_dir(),
                cgroup: &mps_cgroup,
            };
            survival::run(&install).await
        }
    };

    // Cleanup whatever happened: workloads first (their claims are
    // unprepared while the node process still runs), then the release.
    let pods: Api<Pod> = ns.api();
    if result.is_err() {
        for (pod, tag) in daemon_pods(&pods, &release).await.unwrap_or_default() {
            eprintln!(
                "--- daemon pod {} ({tag}) log:\n{}",
                name(&pod),
                logs(&pods, &name(&pod)).await
            );
        }
    }
    let workloads = |list: Vec<Pod>| -> Vec<String> {
        list.iter()
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .is_none_or(|l| l.get("app.kubernetes.io/instance") != Some(&release))
            })
            .map(name)
            .collect()
    };
    if let Ok(list) = pods.list(&ListParams::default()).await {
        for p in workloads(list.items) {
            let _ = pods
                .delete(&p, &DeleteParams::default().grace_period(0))
                .await;
        }
    }
    let monitoring: Api<Pod> = Api::namespaced(cluster.client(), MONITORING_NS);
    if nvidia {
        let _ = monitoring
            .delete_collection(
                &DeleteParams::default().grace_period(0),
                &ListParams::default(),
            )
            .await;
    }
    let _ = wait_for("the test's GPU pods gone", TIMEOUT, || async {
        let left = workloads(pods.list(&ListParams::default()).await?.items);
        let monitors = if nvidia {
            monitoring.list(&ListParams::default()).await?.items.len()
        } else {
            0
        };
        Ok((left.is_empty() && monitors == 0).then_some(()))
    })
    .await;
    // Pods gone from the API are not yet unprepared: wait until the node
    // process has stopped their MPS daemons, which outlive it by design.
    let mps_dir = machine.mps_dir();
    let _ = wait_for("the workloads' MPS daemons stopped", TIMEOUT, || async {
        Ok(survival::daemons_left(&mps_dir).is_empty().then_some(()))
    })
    .await;
    if nvidia {
        let namespaces: Api<Namespace> = Api::all(cluster.client());
        let _ = namespaces
            .delete(MONITORING_NS, &DeleteParams::default())
            .await;
    }
    let uninstalled = helm
        .run(&[
            "uninstall",
            &release,
            "-n",
            ns.name(),
            "--wait",
            "--timeout",
            "3m",
        ])
        .await;
    let _ = wait_for("the daemon pods gone", TIMEOUT, || async {
        Ok(daemon_pods(&pods, &release).await?.is_empty().then_some(()))
    })
    .await;
    let slices: Api<ResourceSlice> = Api::all(cluster.client());
    if let Ok(list) = slices
        .list(&ListParams::default().fields(&format!("spec.driver={driver}")))
        .await
    {
        for s in list.items {
            let _ = delete_ignore_missing(&slices, s.metadata.name.as_deref().unwrap_or_default())
                .await;
        }
    }
    let _ = ns.delete().await;
    let killed = survival::kill_daemons_left(&mps_dir);
    if !killed.is_empty() {
        eprintln!("killed MPS daemons no unprepare stopped: {killed:?}");
    }
    survival::remove_cgroup(&mps_cgroup);
    machine.clear();
    for f in std::fs::read_dir(node_dir.join("cdi"))
        .into_iter()
        .flatten()
        .flatten()
    {
        // Specs of this test's claims only: the node slot was free.
        let _ = std::fs::remove_file(f.path());
    }
    result?;
    uninstalled.map(|_| ())
}

#[allow(clippy::too_many_arguments)]
async fn install_and_roll(
    cluster: &TestCluster,
    helm: &Helm,
    ns: &TestNamespace,
    release: &str,
    driver: &str,
    domain: &str,
    values_file: &Path,
    tag2: &str,
    kubelet: &tessera_conformance::KubeletDirs,
) -> Result<()> {
    let chart = chart();
    let chart = chart.to_str().context("chart path")?;
    let values = values_file.to_str().context("values path")?;
    let tag1: String =
        serde_json::from_slice::<Value>(&std::fs::read(values_file)?)?["image"]["tag"]
            .as_str()
            .context("tag")?
            .to_owned();

    // The webhook as deployed, in the same release (an install costs minutes).
    enable_webhook(ns, release, values_file).await?;

    // Lint, and the optional PodMonitor.
    helm.run(&["lint", "--strict", chart]).await?;
    helm.run(&["lint", "--strict", chart, "-f", values]).await?;
    let plain = helm.run(&["template", "t", chart]).await?;
    let monitored = helm
        .run(&[
            "template",
            "t",
            chart,
            "--set",
            "podMonitor.enabled=true",
            "--set",
            "metrics.bindAddress=0.0.0.0",
        ])
        .await?;
    ensure!(
        !plain.contains("kind: PodMonitor") && monitored.contains("kind: PodMonitor"),
        "the PodMonitor must be rendered exactly when podMonitor.enabled"
    );
    check_endpoints(&plain)?;
    check_metrics_service(helm, chart, &plain).await?;
    check_binder(helm, chart, &plain).await?;
    // Prometheus cannot scrape the default loopback address.
    let refused = helm
        .run(&["template", "t", chart, "--set", "podMonitor.enabled=true"])
        .await;
    ensure!(
        refused
            .as_ref()
            .is_err_and(|e| format!("{e:#}").contains("metrics.bindAddress")),
        "a PodMonitor over a loopback endpoint must be refused: {refused:?}"
    );

    // Install: the pod runs, registers, publishes.
    let t0 = Instant::now();
    helm.run(&["install", release, chart, "-n", ns.name(), "-f", values])
        .await?;
    let pods: Api<Pod> = ns.api();
    let first = registered_daemon(&pods, release, &tag1).await?;
    let before = published(&cluster.client(), cluster.node_name(), driver).await?;
    eprintln!(
        "helm install -> pod registered and {} slices published in {:?}",
        before.len(),
        t0.elapsed()
    );
    check_device_classes(cluster, domain).await?;

    // The example claim's pod runs with its GPU.
    let t0 = Instant::now();
    example_pod(cluster, ns.name(), domain).await?;
    let (_, example_gpu) = sees_its_gpu(ns, "whole-gpu").await?;
    eprintln!("example pod ran with {example_gpu} in {:?}", t0.elapsed());

    check_admission(cluster, ns, release, &first, driver).await?;
    check_webhook(ns, release, driver, domain).await?;

    // Upgrade to the second tag: a surge pod beside the old one.
    let gap = GapMeter::start(kubelet.registry.clone(), driver.to_owned());
    let t0 = Instant::now();
    let tag_arg = format!("image.tag={tag2}");
    helm.run(&[
        "upgrade",
        release,
        chart,
        "-n",
        ns.name(),
        "-f",
        values,
        "--set",
        &tag_arg,
    ])
    .await?;
    let old_name = name(&first);
    wait_for("the new daemon pod beside the old one", TIMEOUT, || async {
        let now = daemon_pods(&pods, release).await?;
        let new = now.iter().any(|(_, t)| t == tag2);
        let old = now.iter().any(|(p, _)| name(p) == old_name);
        if !old && !new {
            bail!("the old pod went before a new one appeared");
        }
        Ok((new && old).then_some(()))
    })
    .await?;
    // A pod created during the roll.
    gpu_pod(&pods, "during-roll").await?;
    let (roll_claim, roll_gpu) = sees_its_gpu(ns, "during-roll").await?;
    let new = registered_daemon(&pods, release, tag2).await?;
    wait_for("the old daemon pod gone", TIMEOUT, || async {
        let now = daemon_pods(&pods, release).await?;
        Ok((!now.iter().any(|(p, _)| name(p) == old_name)).then_some(()))
    })
    .await?;
    let rolled = t0.elapsed();
    let gap = gap.finish();
    let failures = failed_prepares(ns, "during-roll").await?;
    ensure!(
        failures.is_empty(),
        "the pod created during the roll had failed prepares: {failures:?}"
    );
    let new_log = logs(&pods, &name(&new)).await;
    ensure!(
        new_log.contains("waiting for it to exit (rolling update)"),
        "the new pod did not start beside the old one (no wait for the state lock):\n{new_log}"
    );
    let after = published(&cluster.client(), cluster.node_name(), driver).await?;
    ensure!(
        after == before,
        "the roll rewrote the slices: {before:?} -> {after:?}"
    );
    eprintln!(
        "helm upgrade rolled the pod in {rolled:?} (the pod created during the roll ran with \
         {roll_gpu}); longest time without a registered plugin: {gap:?}"
    );

    // The new pod serves: it unprepares the roll's claim and prepares another.
    let claims: Api<ResourceClaim> = ns.api();
    pods.delete("during-roll", &DeleteParams::default().grace_period(0))
        .await?;
    let cdi = cluster.state_dir().join("node/cdi");
    let roll_uid = claims
        .get(&roll_claim)
        .await
        .ok()
        .and_then(|c| c.metadata.uid)
        .unwrap_or_default();
    wait_for("the roll's claim unprepared", TIMEOUT, || async {
        let gone = pods.get_opt("during-roll").await?.is_none();
        let spec = cdi.join(format!("gpu.tessera.dev-claim_{roll_uid}.json"));
        Ok((gone && !spec.exists()).then_some(()))
    })
    .await?;
    gpu_pod(&pods, "after-roll").await?;
    let (_, after_gpu) = sees_its_gpu(ns, "after-roll").await?;
    ensure!(after_gpu != example_gpu, "two pods on one whole GPU");
    Ok(())
}

/// Applies a manifest of deploy/examples with its classes renamed to
/// `domain` (a file with its own namespace is applied as it is).
async fn apply_example(cluster: &TestCluster, ns: &str, file: &str, domain: &str) -> Result<()> {
    let text = std::fs::read_to_string(repo_root().join("deploy/examples").join(file))?
        .replace("tessera.dev", domain);
    let own_namespace = text
        .lines()
        .any(|l| l.trim_start().starts_with("namespace:"));
    let mut args = vec!["apply".to_owned()];
    if !own_namespace {
        args.extend(["-n".to_owned(), ns.to_owned()]);
    }
    args.extend(["-f".to_owned(), "-".to_owned()]);
    let c = cluster.clone();
    blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        kubectl(&c, &args, Some(text))
    })
    .await
    .with_context(|| format!("applying deploy/examples/{file}"))?;
    Ok(())
}

/// Waits until every pod of `pods` except the release's runs.
async fn all_running(pods: &Api<Pod>, release: &str, what: &str) -> Result<usize> {
    wait_for(what, TIMEOUT, || async {
        let list = pods.list(&ListParams::default()).await?.items;
        let mut n = 0;
        for p in &list {
            let ours = p.metadata.labels.as_ref().is_some_and(|l| {
                l.get("app.kubernetes.io/instance").map(String::as_str) == Some(release)
            });
            if ours {
                continue;
            }
            if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed") {
                bail!("pod {} failed: {:?}", name(p), p.status);
            }
            if !running(p) {
                return Ok(None);
            }
            n += 1;
        }
        Ok((n > 0).then_some(n))
    })
    .await
}

/// `nvidiaCompatibleNames: true`: the names, a claim written for NVIDIA's
/// driver, and every example of deploy/examples.
async fn install_nvidia(
    cluster: &TestCluster,
    helm: &Helm,
    ns: &TestNamespace,
    release: &str,
    values_file: &Path,
    tag: &str,
) -> Result<()> {
    const DRIVER: &str = "gpu.nvidia.com";
    let chart = chart();
    let chart = chart.to_str().context("chart path")?;
    let values = values_file.to_str().context("values path")?;
    helm.run(&["lint", "--strict", chart, "-f", values]).await?;
    // A driver name beside the switch is a contradiction, refused.
    let clash = helm
        .run(&[
            "template",
            "t",
            chart,
            "--set",
            "nvidiaCompatibleNames=true",
            "--set",
            "driverName=gpu.example.com",
        ])
        .await;
    ensure!(
        clash
            .as_ref()
            .is_err_and(|e| e.to_string().contains("nvidiaCompatibleNames")),
        "nvidiaCompatibleNames with another driverName must fail: {clash:?}"
    );
    // The whole-GPU class names nvidia.com/gpu only where the API server
    // serves the field (1.36+); a name in a reserved domain is refused.
    for (kube, want) in [("1.37.0", true), ("1.35.0", false)] {
        let rendered = helm
            .run(&[
                "template",
                "t",
                chart,
                "-f",
                values,
                "--kube-version",
                kube,
                "--show-only",
                "templates/deviceclasses.yaml",
            ])
            .await?;
        ensure!(
            rendered.contains("extendedResourceName: nvidia.com/gpu") == want,
            "on Kubernetes {kube} the chart should {}name nvidia.com/gpu:\n{rendered}",
            if want { "" } else { "not " }
        );
    }
    let reserved = helm
        .run(&[
            "template",
            "t",
            chart,
            "--set",
            "deviceClasses.extendedResources.gpu=kubernetes.io/gpu",
        ])
        .await;
    ensure!(
        reserved.as_ref().is_err_and(|e| e
            .to_string()
            .contains("deviceClasses.extendedResources.gpu")),
        "an extended resource in a reserved domain must fail: {reserved:?}"
    );

    // The metrics through the chart's authenticated Service, as the CNCF
    // check scrapes them (a free port of the host network).
    let secure_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let t0 = Instant::now();
    helm.run(&[
        "install",
        release,
        chart,
        "-n",
        ns.name(),
        "-f",
        values,
        "--set",
        "metrics.service.enabled=true",
        "--set",
        &format!("metrics.service.port={secure_port}"),
    ])
    .await?;
    let pods: Api<Pod> = ns.api();
    registered_daemon(&pods, release, tag).await?;
    published(&cluster.client(), cluster.node_name(), DRIVER).await?;
    eprintln!(
        "nvidiaCompatibleNames: registered and published as {DRIVER} in {:?}",
        t0.elapsed()
    );
    check_device_classes(cluster, "nvidia.com").await?;

    // The KAR-0003 suite under NVIDIA's names, on free GPUs.
    let t0 = Instant::now();
    let out_dir = values_file.parent().context("values dir")?.to_owned();
    let env = cluster.env().clone();
    // The CUDA probe runs from Tessera's own image (`isolated-limits`,
    // and the load of `accelerator-metrics`, read through the Service).
    let image = format!("tessera.local/tessera:{tag}");
    let service = format!("{}/{release}-tessera-metrics", ns.name());
    let junit = blocking(move || run_suite(&env, DRIVER, &out_dir, &image, &service)).await?;
    ensure!(
        junit.contains("testcase") && !junit.contains("<failure"),
        "tessera-conformance --driver {DRIVER}: failures in its JUnit report:\n{junit}"
    );
    // The CUDA probe ran: what an Isolated share really gets was checked,
    // the metrics followed its load, and a resources.limits pod ran.
    for check in [
        "isolated-limits",
        "accelerator-metrics",
        "extended-resource",
    ] {
        let case = junit
            .split("<testcase ")
            .find(|c| c.contains(&format!("name=\"{check}\"")))
            .with_context(|| format!("no {check} in the JUnit report"))?;
        ensure!(!case.contains("<skipped"), "{check} was skipped:\n{case}");
    }
    eprintln!(
        "tessera-conformance --driver {DRIVER} passed in {:?}",
        t0.elapsed()
    );

    // A whole GPU as NVIDIA's driver names it: NVIDIA's attribute names,
    // single-quoted CEL, pinned to one card by its bus id.
    let slices: Api<ResourceSlice> = Api::all(cluster.client());
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.driver={DRIVER}")))
        .await?;
    let attr = |d: &k8s_openapi::api::resource::v1::Device, k: &str| {
        d.attributes
            .as_ref()
            .and_then(|a| a.get(k))
            .and_then(|v| v.string.clone())
    };
    let gpus: Vec<_> = list
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| attr(d, "type").as_deref() == Some("gpu"))
        .collect();
    let last = gpus.last().context("no whole GPU published")?;
    let product = attr(last, "productName").context("no productName")?;
    let bus = attr(last, "pcieBusID").context("no pcieBusID")?;
    let want_uuid = attr(last, "uuid").context("no uuid")?;
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": "nv-pinned" },
        "spec": { "devices": { "requests": [{
            "name": "gpu",
            "exactly": {
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [{ "cel": { "expression": format!(
                    "device.attributes['gpu.nvidia.com'].productName == '{product}' && \
                     device.attributes['gpu.nvidia.com'].pcieBusID == '{bus}'"
                ) } }],
            },
        }] } },
    }))?;
    ns.api::<ResourceClaim>()
        .create(&PostParams::default(), &claim)
        .await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "nv-pinned" },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "cuda",
                "image": "tessera.local/probe:1",
                "command": ["sh", "-c", "nvidia-smi -L && exec sleep infinity"],
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": "nv-pinned" }],
        },
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let (_, got) = sees_its_gpu(ns, "nv-pinned").await?;
    ensure!(
        got == want_uuid,
        "the claim pinned to {bus} ({want_uuid}) got {got}"
    );

    // deploy/examples/nvidia-gpu.yaml as it is.
    apply_example(cluster, ns.name(), "nvidia-gpu.yaml", "nvidia.com").await?;
    let (_, example) = sees_its_gpu(ns, "nvidia-gpu").await?;
    ensure!(example != got, "two claims on one whole GPU");

    // A Pod written for the device plugin, `resources.limits:
    // {nvidia.com/gpu: 1}` and no claim: the chart's whole-GPU class
    // stands for that extended resource, the scheduler makes the claim.
    apply_example(cluster, ns.name(), "extended-resource.yaml", "nvidia.com").await?;
    let (limits_claim, limits_gpu) = sees_its_gpu(ns, "limits-gpu").await?;
    ensure!(
        limits_gpu != got && limits_gpu != example,
        "the resources.limits Pod's claim {limits_claim} got {limits_gpu}, a GPU another claim holds"
    );
    eprintln!("resources.limits nvidia.com/gpu: claim {limits_claim} got {limits_gpu}");

    // Every other example, under the nvidia.com classes.
    let mut files: Vec<String> = std::fs::read_dir(repo_root().join("deploy/examples"))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|f| f.ends_with(".yaml") && f != "nvidia-gpu.yaml" && f != "extended-resource.yaml")
        .collect();
    files.sort();
    for f in &files {
        apply_example(cluster, ns.name(), f, "nvidia.com").await?;
    }
    let n = all_running(&pods, release, "the examples' pods running").await?;
    let monitoring: Api<Pod> = Api::namespaced(cluster.client(), MONITORING_NS);
    let m = all_running(&monitoring, release, "the monitoring example's pod running").await?;
    eprintln!("deploy/examples {files:?} ran under nvidia.com classes: {n} + {m} pods");
    Ok(())
}

/// `tessera-conformance --driver <driver>` on the node; returns its JUnit
/// report.
fn run_suite(
    env: &tessera_conformance::ClusterEnv,
    driver: &str,
    out: &Path,
    cuda_probe_image: &str,
    metrics_service: &str,
) -> Result<String> {
    let junit = out.join("junit.xml");
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera-conformance"));
    c.arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .args([
            "--driver",
            driver,
            "--node",
            &env.node_name,
            "--timeout",
            "180s",
        ])
        .arg("--junit")
        .arg(&junit)
        .arg("--report")
        .arg(out.join("report.md"))
        .args(["--cuda-probe-image", cuda_probe_image])
        .args(["--metrics-service", metrics_service]);
    if let Some(image) = std::env::var("TESSERA_PROBE_IMAGE")
        .ok()
        .filter(|i| !i.is_empty())
    {
        c.args(["--image", &image]);
    }
    let stdout = run(&mut c)?;
    eprintln!("{stdout}");
    std::fs::read_to_string(&junit).context("reading the JUnit report")
}

/// `helm template` of the chart with `args`, by the helm client
/// `conformance/cluster/image.sh helm` builds (cached); no cluster needed.
fn render(args: &[&str]) -> Result<String> {
    let helm = run(Command::new(repo_root().join("conformance/cluster/image.sh")).arg("helm"))?;
    let home = tempfile::tempdir()?;
    run(Command::new(helm.trim())
        .args(["template", "t"])
        .arg(chart())
        .args(args)
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data")))
}

/// The rendered DaemonSet's pod spec.
fn daemon_pod_spec(args: &[&str]) -> Result<Value> {
    let yaml = render(&[args, &["--show-only", "templates/daemonset.yaml"]].concat())?;
    let daemonset = Value::deserialize(serde_yaml::Deserializer::from_str(&yaml))?;
    Ok(daemonset["spec"]["template"]["spec"].clone())
}

/// The node pod holds the kubelet's plugins directory of its own driver,
/// `<kubeletDir>/plugins/<driverName>`, where the node process serves its
/// socket, and no directory above it: other drivers' sockets beside it stay
/// out of its reach.
#[test]
fn the_node_pod_mounts_only_its_own_kubelet_plugin_directory() -> Result<()> {
    for (args, kubelet, driver) in [
        (vec![], "/var/lib/kubelet", "gpu.tessera.dev"),
        (
            vec![
                "--set",
                "kubeletDir=/srv/kubelet/",
                "--set",
                "driverName=gpu.example.com",
            ],
            "/srv/kubelet",
            "gpu.example.com",
        ),
        (
            vec!["--set", "nvidiaCompatibleNames=true"],
            "/var/lib/kubelet",
            "gpu.nvidia.com",
        ),
    ] {
        let spec = daemon_pod_spec(&args)?;
        let plugins = Path::new(kubelet).join("plugins");
        let own = plugins.join(driver);
        let host_paths: BTreeMap<&str, &str> = spec["volumes"]
            .as_array()
            .context("no volumes")?
            .iter()
            .filter_map(|v| Some((v["name"].as_str()?, v["hostPath"]["path"].as_str()?)))
            .collect();
        let above: Vec<_> = host_paths
            .iter()
            .filter(|(_, path)| plugins.starts_with(path))
            .collect();
        ensure!(
            above.is_empty(),
            "{args:?}: the node pod mounts {above:?}, which holds every driver's plugin \
             directory, not only {}",
            own.display()
        );
        let container = &spec["containers"][0];
        let mounted = container["volumeMounts"]
            .as_array()
            .context("no volumeMounts")?
            .iter()
            .any(|m| {
                m["mountPath"].as_str() == own.to_str()
                    && m["name"]
                        .as_str()
                        .and_then(|n| host_paths.get(n))
                        .is_some_and(|p| Path::new(p) == own)
            });
        ensure!(
            mounted,
            "{args:?}: the node pod does not mount {} at its own path; host paths: {host_paths:?}",
            own.display()
        );
        // The node process serves its socket in exactly that directory.
        let container_args: Vec<&str> = container["args"]
            .as_array()
            .context("no args")?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for want in [
            format!("--kubelet-plugins-dir={}", plugins.display()),
            format!("--driver-name={driver}"),
        ] {
            ensure!(
                container_args.contains(&want.as_str()),
                "{args:?}: no {want} in {container_args:?}"
            );
        }
    }
    Ok(())
}

/// Before 1.36 the API server checks nothing of which node writes a claim's
/// status: the chart's admission policies are all that does, so turning them
/// off fails the render there, and only there.
#[test]
fn the_admission_policies_cannot_be_turned_off_before_kubernetes_1_36() -> Result<()> {
    const POLICY: &str = "kind: ValidatingAdmissionPolicy\n";
    let off = ["--set", "admissionPolicy.enabled=false"];
    for kube in ["1.34.0", "1.35.0"] {
        let refused = render(&[&off[..], &["--kube-version", kube]].concat());
        let error = match refused {
            Ok(_) => bail!("admissionPolicy.enabled=false rendered on Kubernetes {kube}"),
            Err(e) => format!("{e:#}"),
        };
        ensure!(
            error.contains("admissionPolicy.enabled: false on Kubernetes")
                && error.contains("keep admissionPolicy.enabled: true"),
            "on Kubernetes {kube} the render must fail naming admissionPolicy.enabled: {error}"
        );
        let on = render(&["--kube-version", kube])?;
        ensure!(
            on.contains(POLICY),
            "the policies are not rendered on {kube}"
        );
    }
    for kube in ["1.36.0", "1.37.0"] {
        let rendered = render(&[&off[..], &["--kube-version", kube]].concat())
            .with_context(|| format!("admissionPolicy.enabled=false on Kubernetes {kube}"))?;
        ensure!(
            !rendered.contains(POLICY) && rendered.contains("kind: DaemonSet"),
            "admissionPolicy.enabled=false on {kube}: no policy, the rest rendered"
        );
    }
    Ok(())
}
