//! Access to the local control plane started by `conformance/cluster.sh`.
//!
//! The test command (`conformance/test-all.sh`) starts a cluster and exports
//! the output of `cluster.sh env` before running `cargo test`. Tests call
//! [`TestCluster::shared`] to get a client for it; the cluster itself is shared
//! by every test, so tests create uniquely named objects ([`unique_name`]) and
//! delete them when done.
//!
//! Tests never sleep to synchronise: they poll a condition with a deadline
//! through [`wait_for`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use kube::api::{DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tessera_test_kit::cluster::ClusterState;

/// Deadline used by the helpers when a test has no better one.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the kubelet of the test node keeps its plugin sockets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletDirs {
    /// `--root-dir` of the kubelet.
    pub root: PathBuf,
    /// Plugin registration directory (`<root>/plugins_registry`): a DRA driver
    /// puts its registration socket here.
    pub registry: PathBuf,
    /// Plugin directory (`<root>/plugins`): a DRA driver puts its service
    /// socket in `<plugins>/<driver name>/`.
    pub plugins: PathBuf,
    /// A CDI spec directory the node's container runtime reads: a driver
    /// whose containers must start writes its specs here.
    pub cdi: PathBuf,
}

/// What the environment says about the cluster, before any connection is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterEnv {
    /// `TESSERA_CLUSTER_DIR`: the cluster's state directory.
    pub state_dir: PathBuf,
    /// `KUBECONFIG`, or `<state dir>/kubeconfig`.
    pub kubeconfig: PathBuf,
    /// `TESSERA_NODE_NAME`: the node run by the real kubelet.
    pub node_name: String,
    /// `None` when the cluster runs without a kubelet (`TESSERA_KUBELET=0`).
    pub kubelet: Option<KubeletDirs>,
    /// Feature gates the components were started with (`TESSERA_FEATURE_GATES`).
    pub feature_gates: BTreeMap<String, bool>,
    /// `TESSERA_KUBE_BIN`: the multi-call binary (kubectl, fake-nodes, ...).
    pub kube_bin: Option<PathBuf>,
}

impl ClusterEnv {
    /// Reads the environment exported by `cluster.sh env`, falling back to
    /// the state directory's `cluster.env` for anything not exported.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let state_dir = lookup("TESSERA_CLUSTER_DIR")
            .map(PathBuf::from)
            .ok_or_else(|| {
                anyhow!(
                    "TESSERA_CLUSTER_DIR is not set: these tests need the local control plane. \
                 Run them through conformance/test-all.sh, or start a cluster with \
                 `conformance/cluster.sh start` and `eval \"$(conformance/cluster.sh env)\"` first"
                )
            })?;
        // Values recorded by `cluster.sh start`, used where the env is silent.
        let recorded = ClusterState::new(&state_dir).cluster_env();
        let get = |env_key: &str, file_key: &str| {
            lookup(env_key).or_else(|| recorded.get(file_key).cloned())
        };

        let kubeconfig = lookup("KUBECONFIG")
            .map(PathBuf::from)
            .unwrap_or_else(|| state_dir.join("kubeconfig"));
        let node_name =
            get("TESSERA_NODE_NAME", "NODE_NAME").unwrap_or_else(|| "tessera-node".to_owned());
        let kubelet_enabled = get("TESSERA_KUBELET", "KUBELET_ENABLED").is_none_or(|v| v != "0");
        let kubelet = kubelet_enabled.then(|| {
            let root = lookup("TESSERA_KUBELET_ROOT_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| state_dir.join("kubelet"));
            KubeletDirs {
                registry: lookup("TESSERA_KUBELET_REGISTRY_DIR")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| root.join("plugins_registry")),
                plugins: lookup("TESSERA_KUBELET_PLUGINS_DIR")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| root.join("plugins")),
                cdi: lookup("TESSERA_CDI_DIR")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| state_dir.join("cdi")),
                root,
            }
        });
        let feature_gates = parse_feature_gates(
            &get("TESSERA_FEATURE_GATES", "FEATURE_GATES").unwrap_or_default(),
        )?;
        let kube_bin = get("TESSERA_KUBE_BIN", "KUBE_BIN").map(PathBuf::from);
        Ok(Self {
            state_dir,
            kubeconfig,
            node_name,
            kubelet,
            feature_gates,
            kube_bin,
        })
    }
}

/// Parses `A=true,B=false`; later entries win, as on the components' command line.
pub fn parse_feature_gates(s: &str) -> Result<BTreeMap<String, bool>> {
    let mut gates = BTreeMap::new();
    for kv in s.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("feature gate {kv:?} is not Name=bool"))?;
        let v: bool = v
            .trim()
            .parse()
            .with_context(|| format!("feature gate {kv:?}"))?;
        gates.insert(k.trim().to_owned(), v);
    }
    Ok(gates)
}

/// A connection to the shared local cluster.
///
/// Each call to [`TestCluster::shared`] builds a new client (cheap): a
/// `kube::Client` belongs to the tokio runtime it was created on, and every
/// `#[tokio::test]` has its own runtime.
#[derive(Clone)]
pub struct TestCluster {
    env: ClusterEnv,
    client: Client,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("env", &self.env)
            .finish_non_exhaustive()
    }
}

impl TestCluster {
    /// Connects to the cluster described by the environment (see [`ClusterEnv::from_env`]).
    pub async fn shared() -> Result<Self> {
        let env = ClusterEnv::from_env()?;
        let kubeconfig = Kubeconfig::read_from(&env.kubeconfig)
            .with_context(|| format!("reading kubeconfig {}", env.kubeconfig.display()))?;
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .context("loading kubeconfig")?;
        // The apiserver shares two cores with everything else: be patient.
        config.read_timeout = Some(Duration::from_secs(60));
        let client = Client::try_from(config).context("building client")?;
        Ok(Self { env, client })
    }

    /// A client with cluster-admin rights.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The environment this cluster was described by.
    pub fn env(&self) -> &ClusterEnv {
        &self.env
    }

    /// Name of the node run by the real kubelet.
    pub fn node_name(&self) -> &str {
        &self.env.node_name
    }

    /// The kubelet's directories, `None` if the cluster runs without one.
    pub fn kubelet(&self) -> Option<&KubeletDirs> {
        self.env.kubelet.as_ref()
    }

    /// The cluster's state directory.
    pub fn state_dir(&self) -> &Path {
        &self.env.state_dir
    }

    /// Path of the admin kubeconfig.
    pub fn kubeconfig(&self) -> &Path {
        &self.env.kubeconfig
    }

    /// Ends one of the cluster's components (`kube-scheduler`, `kubelet`,
    /// ...) with SIGKILL and waits until it is gone (`cluster.sh kill`).
    pub async fn kill_component(&self, name: &str) -> Result<()> {
        self.cluster_sh("kill", name).await
    }

    /// Starts a killed component again as it was started and waits until
    /// it serves (`cluster.sh revive`).
    pub async fn revive_component(&self, name: &str) -> Result<()> {
        self.cluster_sh("revive", name).await
    }

    async fn cluster_sh(&self, command: &str, component: &str) -> Result<()> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster.sh");
        let mut cmd = std::process::Command::new("bash");
        cmd.arg(&script)
            .args([command, component])
            .env("TESSERA_CLUSTER_DIR", self.state_dir());
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await?
            .with_context(|| format!("running {}", script.display()))?;
        if !out.status.success() {
            bail!(
                "cluster.sh {command} {component} failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Whether a feature gate was set explicitly, and to what.
    pub fn feature_gate(&self, name: &str) -> Option<bool> {
        self.env.feature_gates.get(name).copied()
    }

    /// Creates a namespace with a unique name and waits until pods can be
    /// created in it (its `default` ServiceAccount exists).
    pub async fn create_namespace(&self, prefix: &str) -> Result<TestNamespace> {
        let name = unique_name(prefix);
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "labels": { "tessera.dev/test": "true" } }
        }))?;
        Api::<Namespace>::all(self.client())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        let sas: Api<ServiceAccount> = Api::namespaced(self.client(), &name);
        wait_for(
            &format!("ServiceAccount {name}/default"),
            DEFAULT_TIMEOUT,
            || async { Ok(sas.get_opt("default").await?.map(|_| ())) },
        )
        .await?;
        Ok(TestNamespace {
            name,
            client: self.client(),
        })
    }

    /// Registers a Node without a kubelet, Ready and with a fresh Lease, for
    /// tests that need a schedulable node on a cluster started with
    /// `TESSERA_KUBELET=0`. Nothing renews it: the node lifecycle controller
    /// marks it NotReady after its grace period (about a minute), so use it
    /// for short tests only and delete it with [`TestCluster::delete_node`].
    /// Long-lived fake nodes come from `cluster.sh add-nodes N`.
    pub async fn register_fake_node(&self, name: &str) -> Result<()> {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "tessera.dev/fake-node": "true"
            }},
        }))?;
        let nodes: Api<Node> = Api::all(self.client());
        nodes.create(&PostParams::default(), &node).await?;
        let status = serde_json::json!({ "status": {
            "capacity": { "cpu": "32", "memory": "256Gi", "pods": "110" },
            "allocatable": { "cpu": "32", "memory": "256Gi", "pods": "110" },
            "conditions": [{ "type": "Ready", "status": "True", "reason": "TesseraFakeNode",
                              "lastHeartbeatTime": now, "lastTransitionTime": now }],
        }});
        nodes
            .patch_status(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(status),
            )
            .await?;
        let lease: Lease = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name },
            "spec": { "holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now_micro() },
        }))?;
        Api::<Lease>::namespaced(self.client(), "kube-node-lease")
            .create(&PostParams::default(), &lease)
            .await?;
        Ok(())
    }

    /// Deletes a node registered by [`TestCluster::register_fake_node`] and its lease.
    pub async fn delete_node(&self, name: &str) -> Result<()> {
        delete_ignore_missing(&Api::<Node>::all(self.client()), name).await?;
        delete_ignore_missing(
            &Api::<Lease>::namespaced(self.client(), "kube-node-lease"),
            name,
        )
        .await
    }
}

impl TestCluster {
    /// A client of this cluster that authenticates with `token` alone (as
    /// a service account's process would).
    pub async fn client_with_token(&self, token: &str) -> Result<Client> {
        let kubeconfig = Kubeconfig::read_from(self.kubeconfig())?;
        let mut config =
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.to_owned().into()),
            ..Default::default()
        };
        Ok(Client::try_from(config)?)
    }
}

impl TestCluster {
    /// Starts `tessera-kube test-dra-plugin`: a trivial upstream-helper based
    /// DRA plugin that registers with the kubelet under `driver`, publishes
    /// `devices` devices (`dev-0`...) for the test node, and records every
    /// NodePrepareResources / NodeUnprepareResources it serves.
    /// Needs a cluster with a kubelet.
    pub fn start_test_plugin(&self, driver: &str, devices: u32) -> Result<TestDraPlugin> {
        let kubelet = self
            .kubelet()
            .context("the cluster runs without a kubelet (TESSERA_KUBELET=0)")?;
        let bin = self
            .env
            .kube_bin
            .as_ref()
            .context("TESSERA_KUBE_BIN is not set (eval \"$(conformance/cluster.sh env)\")")?;
        let dir = self.state_dir().join("test-plugins");
        std::fs::create_dir_all(&dir)?;
        let record = dir.join(format!("{driver}.jsonl"));
        let log = std::fs::File::create(dir.join(format!("{driver}.log")))?;
        let child = std::process::Command::new(bin)
            .arg("test-dra-plugin")
            .args(["--driver-name", driver, "--node-name", self.node_name()])
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .arg("--registry-dir")
            .arg(&kubelet.registry)
            .arg("--plugins-dir")
            .arg(&kubelet.plugins)
            .args(["--devices", &devices.to_string()])
            .arg("--record")
            .arg(&record)
            .arg("--cdi-dir")
            .arg(&kubelet.cdi)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} test-dra-plugin", bin.display()))?;
        Ok(TestDraPlugin {
            child: std::sync::Mutex::new(child),
            record,
        })
    }
}

/// One call the test plugin served, as it recorded it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct PluginCall {
    /// `prepare` or `unprepare`.
    pub op: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    #[serde(default)]
    pub devices: Vec<String>,
}

/// A running `test-dra-plugin`; killed when dropped.
#[derive(Debug)]
pub struct TestDraPlugin {
    child: std::sync::Mutex<std::process::Child>,
    record: PathBuf,
}

impl TestDraPlugin {
    /// Every call recorded so far, oldest first.
    pub fn calls(&self) -> Result<Vec<PluginCall>> {
        let data = match std::fs::read_to_string(&self.record) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        data.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).with_context(|| format!("bad record line {l:?}")))
            .collect()
    }

    /// Fails if the plugin process has exited.
    pub fn check_running(&self) -> Result<()> {
        let mut child = self.child.lock().map_err(|_| anyhow!("poisoned"))?;
        match child.try_wait()? {
            None => Ok(()),
            Some(status) => bail!("test-dra-plugin exited: {status}"),
        }
    }

    /// Stops the process this handle started: SIGTERM (the plugin then
    /// deletes its ResourceSlices), SIGKILL if it is still there after 10s.
    pub fn stop(&self) -> Result<()> {
        let mut child = self.child.lock().map_err(|_| anyhow!("poisoned"))?;
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        let pid = libc::pid_t::try_from(child.id())?;
        // SAFETY: plain kill(2) on the pid of our own, not yet reaped, child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.kill()?;
        child.wait()?;
        Ok(())
    }
}

impl Drop for TestDraPlugin {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn now_micro() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string()
}

/// A namespace owned by one test. Call [`TestNamespace::delete`] at the end.
#[derive(Clone)]
pub struct TestNamespace {
    name: String,
    client: Client,
}

impl TestNamespace {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The API server client the namespace was made with.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// An `Api` for a namespaced kind in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// A token of the service account `sa` of this namespace, bound to
    /// `pod` when given (then it names the pod's node).
    pub async fn token(
        &self,
        sa: &str,
        pod: Option<&k8s_openapi::api::core::v1::Pod>,
    ) -> Result<String> {
        use k8s_openapi::api::authentication::v1::TokenRequest;
        let mut spec = serde_json::json!({ "audiences": [], "expirationSeconds": 600 });
        if let Some(pod) = pod {
            spec["boundObjectRef"] = serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "name": pod.metadata.name, "uid": pod.metadata.uid,
            });
        }
        let request: TokenRequest = serde_json::from_value(serde_json::json!({ "spec": spec }))?;
        let answer: TokenRequest = self
            .api::<ServiceAccount>()
            .create_subresource("token", sa, &PostParams::default(), &request)
            .await
            .context("TokenRequest")?;
        answer
            .status
            .and_then(|s| s.token)
            .context("no token in the answer")
    }

    /// Starts deletion of the namespace and everything in it.
    pub async fn delete(&self) -> Result<()> {
        delete_ignore_missing(&Api::<Namespace>::all(self.client.clone()), &self.name).await
    }
}

/// Deletes an object, treating "already gone" as success.
pub async fn delete_ignore_missing<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: kube::Resource + Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("deleting {name}")),
    }
}

/// A name no other test run will use: `<prefix>-<suffix>`, a valid DNS label
/// (at most 63 characters, lower case).
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let suffix = format!(
        "{:x}{:05x}{:x}",
        std::process::id() & 0xffff,
        nanos & 0xf_ffff,
        n
    );
    let mut prefix: String = prefix
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    prefix.truncate(62 - suffix.len());
    let prefix = prefix.trim_matches('-');
    if prefix.is_empty() {
        format!("t-{suffix}")
    } else {
        format!("{prefix}-{suffix}")
    }
}

/// Polls a check until it yields `Some`, an error, or the deadline passes
/// (the test kit's).
pub use tessera_test_kit::wait::until_some as wait_for;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_are_dns_labels_and_distinct() {
        let a = unique_name("Scheduler_Allocates");
        let b = unique_name("Scheduler_Allocates");
        assert_ne!(a, b);
        for n in [&a, &b, &unique_name(&"x".repeat(100)), &unique_name("--")] {
            assert!(n.len() <= 63, "{n}");
            assert!(
                n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{n}"
            );
            assert!(!n.starts_with('-') && !n.ends_with('-'), "{n}");
        }
    }

    #[test]
    fn feature_gates_later_wins() {
        let g = parse_feature_gates("A=true, B=false,A=false").unwrap();
        assert_eq!(g.get("A"), Some(&false));
        assert_eq!(g.get("B"), Some(&false));
        assert!(parse_feature_gates("A").is_err());
        assert!(parse_feature_gates("A=maybe").is_err());
    }

    #[test]
    fn env_falls_back_to_state_dir_defaults() {
        let env = ClusterEnv::from_lookup(|k| match k {
            "TESSERA_CLUSTER_DIR" => Some("/nonexistent/state".into()),
            "TESSERA_FEATURE_GATES" => Some("DRAConsumableCapacity=false".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(env.kubeconfig, Path::new("/nonexistent/state/kubeconfig"));
        assert_eq!(env.node_name, "tessera-node");
        let k = env.kubelet.unwrap();
        assert_eq!(
            k.registry,
            Path::new("/nonexistent/state/kubelet/plugins_registry")
        );
        assert_eq!(k.plugins, Path::new("/nonexistent/state/kubelet/plugins"));
        assert_eq!(k.cdi, Path::new("/nonexistent/state/cdi"));
        assert_eq!(env.feature_gates.get("DRAConsumableCapacity"), Some(&false));

        let no_kubelet = ClusterEnv::from_lookup(|k| match k {
            "TESSERA_CLUSTER_DIR" => Some("/x".into()),
            "TESSERA_KUBELET" => Some("0".into()),
            _ => None,
        })
        .unwrap();
        assert!(no_kubelet.kubelet.is_none());
        assert!(ClusterEnv::from_lookup(|_| None).is_err());
    }
}
