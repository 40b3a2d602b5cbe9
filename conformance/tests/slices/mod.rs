//! Shared by the ResourceSlice publisher tests (`slices_*.rs`): running the
//! real `tessera` binary on a simulated GPU machine against a real API
//! server, and asking the real kube-scheduler for devices.
//!
//! Every test gets its own node (a Node object without a kubelet: the
//! scheduler allocates and binds, nothing runs), its own driver name
//! (`gpu.<id>.test.tessera.dev`, so its DeviceClasses see only its devices)
//! and its own namespace; [`Pool::cleanup`] removes them all.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure
#![allow(dead_code)]

pub mod suite;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use serde_json::{Value, json};
use tessera_conformance::{TestCluster, delete_ignore_missing, unique_name, wait_for};

/// How long the scheduler gets to allocate (or refuse) a claim. Generous:
/// the control plane shares two cores with the tests.
pub const SCHEDULING_TIMEOUT: Duration = Duration::from_secs(90);

/// Environment variable naming the kubeconfig of the second cluster, started
/// with partitionable devices and consumable capacity off.
pub const DEGRADED_KUBECONFIG_ENV: &str = "TESSERA_DEGRADED_KUBECONFIG";

/// Environment variable naming the kubeconfig of the cluster started with
/// `DRADeviceCompatibilityGroups=true` (API server and scheduler).
pub const GROUPS_KUBECONFIG_ENV: &str = "TESSERA_GROUPS_KUBECONFIG";

const GIB: u64 = 1024 * 1024 * 1024;
const MIB: u64 = 1024 * 1024;

// ------------------------------------------------------------- binaries ----

pub use tessera_conformance::artifacts::binaries;

/// A shipped topology file of the fake NVML.
pub fn topology(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../driver/fake-nvml/topologies")
        .join(name)
}

/// A scratch file for this test run (policies, modified topologies).
pub fn scratch_file(name: &str, text: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("slices-scratch");
    std::fs::create_dir_all(&dir).expect("creating the scratch directory");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("writing a scratch file");
    path
}

/// `tessera <args>` on `topology`, with nothing NVML-related inherited.
pub fn tessera_command(topology: &Path, args: &[&str]) -> Command {
    let bins = binaries();
    // A simulated machine of its own per command: nothing here changes GPU
    // state, and parallel tests must never share a machine.
    static MACHINES: AtomicU32 = AtomicU32::new(0);
    let state = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("slices-nvml-state")
        .join(format!(
            "{}-{}.state",
            std::process::id(),
            MACHINES.fetch_add(1, Ordering::Relaxed)
        ));
    std::fs::create_dir_all(state.parent().unwrap()).expect("creating the NVML state directory");
    let _ = std::fs::remove_file(&state);
    let mut cmd = Command::new(&bins.tessera);
    cmd.args(args)
        .env_remove("TESSERA_NVML_LIBRARY")
        .env_remove("TESSERA_FAKE_NVML_EVENTS")
        .env_remove("NODE_NAME")
        .env_remove("TESSERA_POLICY")
        .env_remove("TESSERA_DRIVER_NAME")
        .env("LD_LIBRARY_PATH", &bins.fake_nvml_dir)
        .env("TESSERA_FAKE_NVML_TOPOLOGY", topology)
        .env("TESSERA_FAKE_NVML_STATE", state)
        .env("RUST_LOG", "info");
    cmd
}

fn output_text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// -------------------------------------------------------------- clusters ----

/// A cluster to test against.
#[derive(Clone)]
pub struct Cluster {
    pub client: Client,
    pub kubeconfig: PathBuf,
    /// `full`, `degraded` or `groups`, for messages.
    pub label: &'static str,
    /// Its API server and scheduler have `DRADeviceCompatibilityGroups`.
    pub groups: bool,
}

impl Cluster {
    /// The main cluster (`conformance/cluster.sh`, all DRA gates on).
    pub async fn full() -> Result<Cluster> {
        let c = TestCluster::shared().await?;
        Ok(Cluster {
            client: c.client(),
            kubeconfig: c.kubeconfig().to_path_buf(),
            label: "full",
            groups: c.env().feature_gates.get("DRADeviceCompatibilityGroups") == Some(&true),
        })
    }

    /// The second cluster with `DRAPartitionableDevices=false,
    /// DRAConsumableCapacity=false`, from [`DEGRADED_KUBECONFIG_ENV`].
    pub async fn degraded() -> Result<Cluster> {
        let hint = "the degraded-mode tests need a second cluster started with \
                    TESSERA_FEATURE_GATES=DRAPartitionableDevices=false,\
                    DRAConsumableCapacity=false";
        Cluster::from_env(DEGRADED_KUBECONFIG_ENV, "degraded", hint, false).await
    }

    /// The cluster with `DRADeviceCompatibilityGroups=true`, from
    /// [`GROUPS_KUBECONFIG_ENV`].
    pub async fn groups() -> Result<Cluster> {
        let hint = "the compatibility-group tests need a Kubernetes 1.37+ cluster started with \
                    TESSERA_FEATURE_GATES=DRADeviceCompatibilityGroups=true";
        Cluster::from_env(GROUPS_KUBECONFIG_ENV, "groups", hint, true).await
    }

    async fn from_env(var: &str, label: &'static str, hint: &str, groups: bool) -> Result<Cluster> {
        let path = std::env::var_os(var)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .with_context(|| {
                format!(
                    "{var} is not set: {hint} (conformance/test-all.sh starts one; see \
                     docs/development.md)"
                )
            })?;
        let kc =
            Kubeconfig::read_from(&path).with_context(|| format!("reading {}", path.display()))?;
        let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .with_context(|| format!("loading the {label} cluster's kubeconfig"))?;
        config.read_timeout = Some(Duration::from_secs(60));
        Ok(Cluster {
            client: Client::try_from(config)?,
            kubeconfig: path,
            label,
            groups,
        })
    }
}

// ------------------------------------------------------------------ pool ----

/// What `tessera publish --once` reported.
#[derive(Debug, Clone)]
pub struct Published {
    pub report: Value,
    pub stderr: String,
}

impl Published {
    pub fn writes(&self) -> (u64, u64, u64) {
        let w = &self.report["writes"];
        let n = |k: &str| w[k].as_u64().unwrap_or(u64::MAX);
        (n("creates"), n("updates"), n("deletes"))
    }
    pub fn total_writes(&self) -> u64 {
        let (c, u, d) = self.writes();
        c + u + d
    }
    pub fn full_model(&self) -> bool {
        self.report["result"]["fullModel"] == true
    }
    pub fn slices(&self) -> u64 {
        self.report["result"]["slices"].as_u64().unwrap_or(0)
    }
    pub fn generation(&self) -> i64 {
        self.report["result"]["generation"].as_i64().unwrap_or(-1)
    }
}

/// One test's node, driver, DeviceClasses and namespace.
pub struct Pool {
    pub cluster: Cluster,
    pub id: String,
    pub node: String,
    pub driver: String,
    pub namespace: String,
    pub topology: PathBuf,
    pub policy: Option<PathBuf>,
    classes: Vec<String>,
    names: std::sync::atomic::AtomicU32,
}

/// Where an allocated claim landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    pub device: String,
    /// UUID of the physical GPU the device belongs to.
    pub gpu: String,
}

impl Pool {
    /// Registers a node, installs this driver's DeviceClasses (rendered from
    /// `deploy/deviceclasses.yaml`) and creates a namespace.
    pub async fn new(cluster: &Cluster, prefix: &str, topology_file: &str) -> Result<Pool> {
        let id = unique_name(prefix);
        ensure!(id.len() <= 40, "id {id} too long for a driver name");
        let domain = format!("{id}.test.tessera.dev");
        let pool = Pool {
            cluster: cluster.clone(),
            node: format!("{id}-node"),
            driver: format!("gpu.{domain}"),
            namespace: id.clone(),
            topology: topology(topology_file),
            policy: None,
            classes: Vec::new(),
            names: Default::default(),
            id,
        };
        let mut pool = pool;
        pool.classes = install_classes(&cluster.client, &domain).await?;
        register_node(&cluster.client, &pool.node).await?;
        create_namespace(&cluster.client, &pool.namespace).await?;
        Ok(pool)
    }

    /// The same node, driver and namespace on another topology file (for
    /// publishing only: cleanup belongs to the original).
    pub fn with_topology(&self, topology: PathBuf) -> Pool {
        Pool {
            cluster: self.cluster.clone(),
            id: self.id.clone(),
            node: self.node.clone(),
            driver: self.driver.clone(),
            namespace: self.namespace.clone(),
            topology,
            policy: self.policy.clone(),
            classes: Vec::new(),
            names: Default::default(),
        }
    }

    fn client(&self) -> Client {
        self.cluster.client.clone()
    }

    /// DeviceClass `<kind>.<domain>` (`gpu`, `mig`, `gpu-isolated`, `gpu-shared`).
    pub fn class(&self, kind: &str) -> String {
        let domain = self.driver.strip_prefix("gpu.").unwrap_or(&self.driver);
        format!("{kind}.{domain}")
    }

    /// `device.attributes["<driver>"].<attr>` for CEL.
    pub fn attr(&self, name: &str) -> String {
        format!("device.attributes[{:?}].{name}", self.driver)
    }

    /// `device.capacity["<driver>"].<cap>` for CEL.
    pub fn cap(&self, name: &str) -> String {
        format!("device.capacity[{:?}].{name}", self.driver)
    }

    /// Common arguments naming this pool.
    fn pool_args(&self) -> Vec<String> {
        let mut args = vec![
            "--node-name".to_string(),
            self.node.clone(),
            "--driver-name".to_string(),
            self.driver.clone(),
        ];
        if let Some(p) = &self.policy {
            args.push("--policy".into());
            args.push(p.display().to_string());
        }
        args
    }

    /// Runs `tessera publish --once`, which must succeed.
    pub fn publish_once(&self) -> Result<Published> {
        self.publish_once_on(&self.topology)
    }

    pub fn publish_once_on(&self, topology: &Path) -> Result<Published> {
        self.publish_once_with(topology, &[])
    }

    /// `tessera publish --once` with extra flags (e.g. `--capabilities
    /// legacy`: what the publisher would do on a server serving less).
    pub fn publish_once_with(&self, topology: &Path, extra: &[&str]) -> Result<Published> {
        let mut args = vec!["publish".to_string(), "--once".to_string()];
        args.extend(extra.iter().map(ToString::to_string));
        args.extend(self.pool_args());
        args.push("--kubeconfig".into());
        args.push(self.cluster.kubeconfig.display().to_string());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = tessera_command(topology, &args)
            .output()
            .context("running tessera publish")?;
        ensure!(
            out.status.success(),
            "tessera publish --once failed:\n{}",
            output_text(&out)
        );
        let report: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("bad report:\n{}", output_text(&out)))?;
        Ok(Published {
            report,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// `tessera slices -o json` for this pool: what the model computes
    /// offline, without an API server.
    pub fn offline_slices(&self, capabilities: &str) -> Result<Vec<ResourceSlice>> {
        let mut args = vec![
            "slices".to_string(),
            "-o".into(),
            "json".into(),
            "--capabilities".into(),
            capabilities.into(),
        ];
        if self.cluster.groups && capabilities == "full" {
            args.push("--compatibility-groups".into());
        }
        args.extend(self.pool_args());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = tessera_command(&self.topology, &args).output()?;
        ensure!(
            out.status.success(),
            "tessera slices failed:\n{}",
            output_text(&out)
        );
        let list: Value = serde_json::from_slice(&out.stdout)?;
        Ok(serde_json::from_value(list["items"].clone())?)
    }

    /// This pool's slices on the server, by name.
    pub async fn slices(&self) -> Result<Vec<ResourceSlice>> {
        let lp = ListParams::default().fields(&format!(
            "spec.nodeName={},spec.driver={}",
            self.node, self.driver
        ));
        let mut items = Api::<ResourceSlice>::all(self.client())
            .list(&lp)
            .await?
            .items;
        items.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        Ok(items)
    }

    /// Device name -> UUID of its physical GPU, from the published slices.
    pub async fn device_gpus(&self) -> Result<BTreeMap<String, String>> {
        Ok(device_gpus(&self.slices().await?, &self.driver))
    }

    /// A unique object name in this pool's namespace.
    pub fn name(&self, what: &str) -> String {
        let n = self
            .names
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{what}-{n}")
    }

    /// Creates a ResourceClaim asking one device of `class` with the CEL
    /// `selectors` and (consumable capacity) `capacity` requests, and a pod
    /// using it that may only go to this pool's node. Returns the name of
    /// both.
    pub async fn request(
        &self,
        what: &str,
        class: &str,
        selectors: &[String],
        capacity: &[(&str, &str)],
    ) -> Result<String> {
        let name = self.name(what);
        let mut exactly = json!({
            "deviceClassName": class,
            "selectors": selectors.iter().map(|e| json!({"cel": {"expression": e}})).collect::<Vec<_>>(),
        });
        if !capacity.is_empty() {
            let requests: serde_json::Map<String, Value> = capacity
                .iter()
                .map(|(k, v)| ((*k).to_string(), json!(v)))
                .collect();
            exactly["capacity"] = json!({ "requests": requests });
        }
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": exactly }] } },
        }))?;
        let pp = PostParams::default();
        Api::<ResourceClaim>::namespaced(self.client(), &self.namespace)
            .create(&pp, &claim)
            .await
            .with_context(|| format!("creating claim {name}"))?;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": {
                "nodeSelector": { "kubernetes.io/hostname": self.node },
                // The node has no kubelet; whatever the node lifecycle
                // controller taints it with must not keep the scheduler away.
                "tolerations": [{ "operator": "Exists" }],
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": false,
                "resourceClaims": [{ "name": "gpu", "resourceClaimName": name }],
                "containers": [{
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": { "claims": [{ "name": "gpu" }] },
                }],
            },
        }))?;
        Api::<Pod>::namespaced(self.client(), &self.namespace)
            .create(&pp, &pod)
            .await
            .with_context(|| format!("creating pod {name}"))?;
        Ok(name)
    }

    /// Waits until the scheduler allocated claim `name` and bound its pod
    /// to this pool's node; returns the device and its GPU.
    pub async fn allocated(&self, name: &str) -> Result<Allocated> {
        let pods: Api<Pod> = Api::namespaced(self.client(), &self.namespace);
        let claims: Api<ResourceClaim> = Api::namespaced(self.client(), &self.namespace);
        let last = std::sync::Mutex::new(String::new());
        let device = wait_for(
            &format!("claim {name} allocated"),
            SCHEDULING_TIMEOUT,
            || async {
                let pod = pods.get(name).await?;
                *last.lock().unwrap() = scheduled_message(&pod).unwrap_or_default();
                let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                let claim = claims.get(name).await?;
                let results = claim
                    .status
                    .and_then(|s| s.allocation)
                    .and_then(|a| a.devices)
                    .and_then(|d| d.results)
                    .unwrap_or_default();
                match (bound, results.as_slice()) {
                    (Some(node), [r]) => {
                        ensure!(
                            node == self.node,
                            "pod {name} bound to {node}, not {}",
                            self.node
                        );
                        ensure!(
                            r.driver == self.driver && r.pool == self.node,
                            "claim {name} got {}/{} from the wrong driver or pool",
                            r.driver,
                            r.pool
                        );
                        Ok(Some(r.device.clone()))
                    }
                    (_, []) | (None, _) => Ok(None),
                    (_, many) => bail!("claim {name} got {} devices", many.len()),
                }
            },
        )
        .await
        .with_context(|| format!("last scheduler message: {}", last.lock().unwrap()))?;
        let gpus = self.device_gpus().await?;
        let gpu = gpus
            .get(&device)
            .with_context(|| format!("allocated device {device} is not published"))?
            .clone();
        Ok(Allocated { device, gpu })
    }

    /// Waits until the scheduler reports claim `name`'s pod unschedulable
    /// (the pod condition carries its reason); checks it is neither bound
    /// nor allocated and returns the scheduler's message.
    /// Requests a claim the scheduler must refuse; returns its name (for
    /// cleanup) once its pod is reported unschedulable.
    pub async fn request_refused(
        &self,
        what: &str,
        class: &str,
        selectors: &[String],
        capacity: &[(&str, &str)],
    ) -> Result<String> {
        let name = self.request(what, class, selectors, capacity).await?;
        self.refused(&name).await?;
        Ok(name)
    }

    pub async fn refused(&self, name: &str) -> Result<String> {
        let pods: Api<Pod> = Api::namespaced(self.client(), &self.namespace);
        let message = wait_for(
            &format!("pod {name} unschedulable"),
            SCHEDULING_TIMEOUT,
            || async {
                let pod = pods.get(name).await?;
                if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) {
                    bail!("pod {name} was scheduled to {node}, expected it to be refused");
                }
                Ok(unschedulable_message(&pod))
            },
        )
        .await?;
        ensure!(
            message.contains("cannot allocate all claims"),
            "pod {name} is unschedulable for another reason than its claim: {message}"
        );
        self.still_refused(name).await?;
        Ok(message)
    }

    /// Fails if claim `name` got allocated or its pod bound meanwhile.
    pub async fn still_refused(&self, name: &str) -> Result<()> {
        let pod = Api::<Pod>::namespaced(self.client(), &self.namespace)
            .get(name)
            .await?;
        let claim = Api::<ResourceClaim>::namespaced(self.client(), &self.namespace)
            .get(name)
            .await?;
        ensure!(
            pod.spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_none(),
            "pod {name} got bound after being refused"
        );
        ensure!(
            claim.status.and_then(|s| s.allocation).is_none(),
            "claim {name} got allocated after being refused"
        );
        Ok(())
    }

    /// Deletes the pods and claims `names` and waits until the claims are
    /// gone (deallocated), so their devices are free again.
    pub async fn release(&self, names: &[String]) -> Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client(), &self.namespace);
        let claims: Api<ResourceClaim> = Api::namespaced(self.client(), &self.namespace);
        for n in names {
            force_delete_pod(&pods, n).await?;
            delete_ignore_missing(&claims, n).await?;
        }
        for n in names {
            wait_for(
                &format!("claim {n} deleted"),
                SCHEDULING_TIMEOUT,
                || async { Ok(claims.get_opt(n).await?.is_none().then_some(())) },
            )
            .await?;
        }
        Ok(())
    }

    /// Removes everything this pool created. Best effort; returns the first
    /// error.
    pub async fn cleanup(&self) -> Result<()> {
        let client = self.client();
        let mut first: Option<anyhow::Error> = None;
        let mut note = |r: Result<()>| {
            if let Err(e) = r
                && first.is_none()
            {
                first = Some(e);
            }
        };
        // Pods on a node without kubelet never finish graceful deletion,
        // which would keep the namespace in Terminating forever.
        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        match pods.list(&ListParams::default()).await {
            Ok(list) => {
                for p in list.items {
                    let name = p.metadata.name.unwrap_or_default();
                    note(force_delete_pod(&pods, &name).await);
                }
            }
            Err(e) => note(Err(e.into())),
        }
        note(delete_ignore_missing(&Api::<Namespace>::all(client.clone()), &self.namespace).await);
        let slices: Api<ResourceSlice> = Api::all(client.clone());
        match self.slices().await {
            Ok(list) => {
                for s in list {
                    note(
                        delete_ignore_missing(&slices, &s.metadata.name.unwrap_or_default()).await,
                    );
                }
            }
            Err(e) => note(Err(e)),
        }
        note(delete_ignore_missing(&Api::<Node>::all(client.clone()), &self.node).await);
        for c in &self.classes {
            note(delete_ignore_missing(&Api::<DeviceClass>::all(client.clone()), c).await);
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

async fn force_delete_pod(pods: &Api<Pod>, name: &str) -> Result<()> {
    match pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("deleting pod {name}")),
    }
}

fn scheduled_condition(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::PodCondition> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled")
}

fn scheduled_message(pod: &Pod) -> Option<String> {
    let c = scheduled_condition(pod)?;
    Some(format!(
        "{} {}: {}",
        c.status,
        c.reason.as_deref().unwrap_or_default(),
        c.message.as_deref().unwrap_or_default()
    ))
}

fn unschedulable_message(pod: &Pod) -> Option<String> {
    let c = scheduled_condition(pod)?;
    (c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
        .then(|| c.message.clone().unwrap_or_default())
}

/// Device name -> UUID of its physical GPU (`parentUUID` on share and MIG
/// devices, `uuid` on whole GPUs).
pub fn device_gpus(slices: &[ResourceSlice], driver: &str) -> BTreeMap<String, String> {
    let _ = driver;
    let mut out = BTreeMap::new();
    for d in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
        let attr = |k: &str| {
            d.attributes
                .as_ref()
                .and_then(|a| a.get(k))
                .and_then(|v| v.string.clone())
        };
        if let Some(gpu) = attr("parentUUID").or_else(|| attr("uuid")) {
            out.insert(d.name.clone(), gpu);
        }
    }
    out
}

/// A string attribute of a published device.
pub fn device_attr(slices: &[ResourceSlice], device: &str, key: &str) -> Option<String> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)?
        .attributes
        .as_ref()?
        .get(key)?
        .string
        .clone()
}

/// A device's capacity `key` in bytes (or units).
pub fn device_capacity(slices: &[ResourceSlice], device: &str, key: &str) -> Option<u64> {
    let q = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)?
        .capacity
        .as_ref()?
        .get(key)?
        .value
        .0
        .clone();
    parse_quantity(&q)
}

/// Integer quantities as the model writes them (`81559Mi`, `20Gi`, `132`).
pub fn parse_quantity(q: &str) -> Option<u64> {
    for (suffix, mult) in [
        ("Ki", 1u64 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
    ] {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().ok()?.checked_mul(mult);
        }
    }
    q.parse().ok()
}

pub fn gib(bytes: u64) -> String {
    assert_eq!(bytes % GIB, 0, "{bytes} is not whole GiB");
    format!("{}Gi", bytes / GIB)
}

pub fn floor_gib(bytes: u64) -> u64 {
    bytes / GIB * GIB
}

pub fn round_gib(bytes: u64) -> u64 {
    (bytes + GIB / 2) / GIB * GIB
}

pub const GIB_BYTES: u64 = GIB;
pub const MIB_BYTES: u64 = MIB;

/// Installs `deploy/deviceclasses.yaml` with the domain `tessera.dev`
/// replaced, so the classes select only this test's driver. Returns the
/// class names.
async fn install_classes(client: &Client, domain: &str) -> Result<Vec<String>> {
    let api: Api<DeviceClass> = Api::all(client.clone());
    let mut names = Vec::new();
    for class in tessera_conformance::classes::deploy_classes(domain)? {
        let name = class.metadata.name.clone().unwrap_or_default();
        api.create(&PostParams::default(), &class)
            .await
            .with_context(|| format!("creating DeviceClass {name}"))?;
        names.push(name);
    }
    ensure!(
        names.len() == 5,
        "expected 5 DeviceClasses (gpu, mig, gpu-isolated, gpu-shared, gpu-monitor) in \
         deploy/deviceclasses.yaml, found {names:?}"
    );
    Ok(names)
}

/// A Ready node without a kubelet (nothing keeps its lease fresh; the pods
/// of these tests tolerate the taints that brings).
async fn register_node(client: &Client, name: &str) -> Result<()> {
    let node: Node = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
            "tessera.dev/fake-node": "true",
        }},
    }))?;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes.create(&PostParams::default(), &node).await?;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let status = json!({ "status": {
        "capacity": { "cpu": "32", "memory": "256Gi", "pods": "110" },
        "allocatable": { "cpu": "32", "memory": "256Gi", "pods": "110" },
        "conditions": [{ "type": "Ready", "status": "True", "reason": "TesseraTestNode",
                          "lastHeartbeatTime": now, "lastTransitionTime": now }],
    }});
    nodes
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(status),
        )
        .await?;
    Ok(())
}

async fn create_namespace(client: &Client, name: &str) -> Result<()> {
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "tessera.dev/test": "true" } }
    }))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), name);
    wait_for(
        &format!("ServiceAccount {name}/default"),
        SCHEDULING_TIMEOUT,
        || async { Ok(sas.get_opt("default").await?.map(|_| ())) },
    )
    .await
}

// ---------------------------------------------------------------- daemon ----

/// A `tessera publish` daemon; SIGTERM and wait on drop.
pub struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    pub fn start(pool: &Pool, extra: &[&str]) -> Result<Daemon> {
        let log = scratch_file(&format!("{}-daemon.log", pool.id), "");
        let mut args = vec![
            "publish",
            "--node-name",
            &pool.node,
            "--driver-name",
            &pool.driver,
        ];
        let kubeconfig = pool.cluster.kubeconfig.display().to_string();
        args.extend(["--kubeconfig", &kubeconfig]);
        args.extend(extra);
        let child = tessera_command(&pool.topology, &args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(log.with_extension("out"))?)
            .stderr(std::fs::OpenOptions::new().append(true).open(&log)?)
            .spawn()
            .context("starting tessera publish")?;
        Ok(Daemon { child, log })
    }

    pub fn log(&self) -> String {
        let mut s = String::new();
        let _ = std::fs::File::open(&self.log).and_then(|mut f| f.read_to_string(&mut s));
        s
    }

    pub fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("tessera publish exited ({status}):\n{}", self.log());
        }
        Ok(())
    }

    /// SIGTERM; the daemon must exit on its own.
    pub async fn stop(&mut self) -> Result<()> {
        let pid = libc::pid_t::try_from(self.child.id())?;
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let child = &mut self.child;
        let status = wait_for(
            "tessera publish to exit after SIGTERM",
            Duration::from_secs(30),
            || {
                let exited = child.try_wait();
                async move { Ok(exited?) }
            },
        )
        .await?;
        ensure!(
            status.success(),
            "tessera publish exited with {status} on SIGTERM"
        );
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
