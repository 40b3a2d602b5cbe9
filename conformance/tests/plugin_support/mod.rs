//! Running `tessera plugin` against the local API server and talking to it
//! over its unix sockets exactly as the kubelet's DRA manager does:
//! `GetInfo` on the registration socket, then the DRA service on the
//! endpoint it names.
//!
//! Claims are allocated by writing `status.allocation` directly (the
//! scheduler is not involved): these tests are about the plugin, and this
//! lets them craft allocations a scheduler would never produce (other
//! nodes, other drivers, bad configs). The real scheduler + kubelet path is
//! covered by `plugin_kubelet.rs`.
//!
//! GPUs come from the simulated NVML (`a100-40gb-x2-mig.yaml`: GPU 0 with
//! three MIG devices, GPU 1 MIG-capable with MIG off); the driver root is a
//! temporary directory with the device nodes and MIG capability files the
//! NVIDIA driver would provide.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure
#![allow(dead_code)]

pub mod cluster;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tessera_api::inventory::Inventory;
use tessera_api::kubelet::{dra_v1, registration};
use tessera_conformance::{TestCluster, delete_ignore_missing, procs, unique_name, wait_for};
use tessera_controller::model::{DeviceKind, DeviceRef, DriverName, NodePolicy};
use tessera_test_kit::driver_root::{DriverRootBuilder, MPS_CONTROL};
use tonic::transport::Channel;

pub const TOPOLOGY: &str = "a100-40gb-x2-mig.yaml";
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Workspace root (conformance/..).
pub use tessera_test_kit::repo_root;

/// The `tessera` binary and the fake NVML library, built if missing.
pub use tessera_conformance::artifacts::binaries;

pub fn topology_path() -> PathBuf {
    repo_root()
        .join("driver/fake-nvml/topologies")
        .join(TOPOLOGY)
}

/// The simulated node's inventory, as `tessera inventory` reports it.
pub fn inventory() -> &'static Inventory {
    static I: OnceLock<Inventory> = OnceLock::new();
    I.get_or_init(|| {
        let b = binaries();
        // The node as its topology describes it: a simulated machine of its own.
        let machine = tempfile::tempdir().expect("a directory for the NVML state");
        let out = Command::new(&b.tessera)
            .arg("--nvml-library")
            .arg(&b.fake_nvml)
            .args(["inventory", "-o", "json"])
            // Only this machine's state: nothing a node started by hand
            // (`cluster.sh node-start`, then `env`) left in this shell.
            .env_remove("TESSERA_FAKE_NVML_DRIVER_ROOT")
            .env("TESSERA_FAKE_NVML_TOPOLOGY", topology_path())
            .env("TESSERA_FAKE_NVML_STATE", machine.path().join("nvml.state"))
            .output()
            .expect("running tessera inventory");
        assert!(
            out.status.success(),
            "tessera inventory: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("inventory JSON")
    })
}

/// Device names the node publishes (the full model, which the local API
/// server serves), with what they stand for.
pub fn devices(node: &str, driver: &str) -> BTreeMap<String, DeviceRef> {
    tessera_controller::model::SliceModel::new(
        inventory(),
        &NodePolicy::default(),
        tessera_controller::model::Capabilities::full(),
        node,
    )
    .driver(DriverName::new(driver).unwrap())
    .build()
    .unwrap()
    .devices
}

/// A device name of the wanted kind.
pub fn device_where(node: &str, driver: &str, want: impl Fn(&DeviceRef) -> bool) -> String {
    devices(node, driver)
        .into_iter()
        .find(|(_, r)| want(r))
        .map(|(n, _)| n)
        .expect("no device of the wanted kind")
}

pub fn whole_gpu(node: &str, driver: &str) -> String {
    device_where(node, driver, |r| matches!(r.kind, DeviceKind::Whole))
}

pub fn existing_mig(node: &str, driver: &str) -> (String, String) {
    let name = device_where(node, driver, |r| {
        matches!(
            &r.kind,
            DeviceKind::Mig {
                existing: Some(_),
                ..
            }
        )
    });
    let uuid = match &devices(node, driver)[&name].kind {
        DeviceKind::Mig {
            existing: Some(u), ..
        } => u.clone(),
        _ => unreachable!(),
    };
    (name, uuid)
}

pub fn share(node: &str, driver: &str, shared: bool) -> String {
    use tessera_controller::model::IsolationLevel;
    device_where(node, driver, |r| match &r.kind {
        DeviceKind::Share { level, .. } => (*level == IsolationLevel::Shared) == shared,
        _ => false,
    })
}

/// Directories of one plugin instance; survive restarts of the process.
pub struct PluginDirs {
    pub root: tempfile::TempDir,
    /// Where the plugin writes CDI specs: its own directory, or the one the
    /// node's container runtime reads ([`PluginDirs::for_kubelet`]).
    cdi: PathBuf,
}

impl PluginDirs {
    pub fn new() -> Result<Self> {
        let root = tempfile::Builder::new().prefix("tp").tempdir()?;
        let cdi = root.path().join("cdi");
        Self::with_cdi(root, cdi)
    }

    /// For a plugin whose claims' containers the cluster's runtime starts:
    /// its specs go where containerd reads them (claim UIDs keep tests apart).
    pub fn for_kubelet(kubelet: &tessera_conformance::KubeletDirs) -> Result<Self> {
        let root = tempfile::Builder::new().prefix("tp").tempdir()?;
        Self::with_cdi(root, kubelet.cdi.clone())
    }

    fn with_cdi(root: tempfile::TempDir, cdi: PathBuf) -> Result<Self> {
        let dirs = PluginDirs { root, cdi };
        std::fs::create_dir_all(&dirs.cdi)?;
        for d in ["registry", "plugins", "cdi", "state", "driver"] {
            std::fs::create_dir_all(dirs.path(d))?;
        }
        std::fs::write(dirs.boot_id(), "boot-1\n")?;
        dirs.fake_driver_root()?;
        Ok(dirs)
    }

    pub fn path(&self, what: &str) -> PathBuf {
        self.root.path().join(what)
    }

    pub fn registry(&self) -> PathBuf {
        self.path("registry")
    }
    pub fn plugins(&self) -> PathBuf {
        self.path("plugins")
    }
    pub fn cdi(&self) -> PathBuf {
        self.cdi.clone()
    }
    pub fn state(&self) -> PathBuf {
        self.path("state")
    }
    pub fn driver_root(&self) -> PathBuf {
        self.path("driver")
    }
    pub fn boot_id(&self) -> PathBuf {
        self.path("boot_id")
    }
    /// The GPUs of this node's simulated machine as another process sees
    /// them now. Like NVML on a real machine, a GPU whose MIG mode the node
    /// switches between two of the tool's calls fails that one look: it is
    /// asked again (a few times at most).
    pub fn inventory_now(&self, topology: &Path) -> Result<Inventory> {
        let b = binaries();
        let mut last = String::new();
        for _ in 0..3 {
            let out = Command::new(&b.tessera)
                .arg("--nvml-library")
                .arg(&b.fake_nvml)
                .args(["inventory", "-o", "json"])
                .env("TESSERA_FAKE_NVML_TOPOLOGY", topology)
                .env("TESSERA_FAKE_NVML_STATE", self.nvml_state())
                .env_remove("TESSERA_FAKE_NVML_DRIVER_ROOT")
                .output()?;
            if out.status.success() {
                return Ok(serde_json::from_slice(&out.stdout)?);
            }
            last = String::from_utf8_lossy(&out.stderr).into_owned();
        }
        bail!("tessera inventory: {last}")
    }

    /// The MPS control binary under the driver root.
    pub fn mps_control(&self) -> PathBuf {
        self.driver_root().join(MPS_CONTROL)
    }

    /// Running MPS control daemons started from this driver root.
    pub fn mps_daemons(&self) -> Vec<i32> {
        let control = self.mps_control();
        let control = control.as_os_str().as_encoded_bytes();
        procs::pids()
            .into_iter()
            .filter(|pid| {
                procs::args(*pid).is_some_and(|args| {
                    args.first().is_some_and(|a| a == control) && args.iter().any(|a| a == b"-f")
                }) && procs::running(*pid)
            })
            .collect()
    }

    /// MPS pipe directories (short: Unix socket paths are limited).
    pub fn mps(&self) -> PathBuf {
        self.path("mps")
    }
    /// The simulated GPUs' machine-wide state (MIG instances, modes): every
    /// process of this node uses it.
    pub fn nvml_state(&self) -> PathBuf {
        self.path("nvml.state")
    }

    /// Character device nodes as nvidia-modprobe creates them (nothing on
    /// this host serves their majors: a container runtime can hand them to a
    /// container, nobody can open them). The MIG capability files and
    /// `proc/devices` are the simulated driver's: the fake library keeps them
    /// in step with the instances (`TESSERA_FAKE_NVML_DRIVER_ROOT`); the
    /// capability device nodes are the plugin's to create, as on a node.
    fn fake_driver_root(&self) -> Result<()> {
        // The MPS stand-in where a driver install has the control binary.
        DriverRootBuilder::new()
            .nvidiactl()
            .uvm()
            .gpus(0..8)
            .file(tessera_test_kit::artifacts::fake_mps_control(), MPS_CONTROL)
            .build(&self.driver_root())?;
        Ok(())
    }

    /// The claims' spec files of the CDI directory (not hidden ones, not
    /// the driver's own spec).
    pub fn cdi_files(&self) -> Vec<String> {
        let mut names = self.cdi_all();
        names.retain(|n| !n.starts_with('.') && n != "gpu.tessera.dev-driver.json");
        names
    }

    /// Waits until claim `uid`'s spec and record are removed (see
    /// [`Self::unprepared_files_removed`]).
    pub async fn claim_files_removed(&self, uid: &str) -> Result<()> {
        wait_for(
            &format!("the CDI spec and the record of claim {uid} removed"),
            Duration::from_secs(30),
            || async {
                let gone = self.spec(uid).is_none() && !self.checkpoint().contains_key(uid);
                Ok(gone.then_some(()))
            },
        )
        .await
    }

    /// Waits until the CDI directory holds no spec and no record is left
    /// retired: an unprepare of a claim with nothing to undo on the host
    /// answers once its record says `Unpreparing`; its spec and record go
    /// when the unprepares pause.
    pub async fn unprepared_files_removed(&self) -> Result<()> {
        let retired = |dirs: &Self| {
            (dirs.checkpoint().into_iter())
                .filter(|(_, e)| e["state"] == "Unpreparing")
                .map(|(uid, _)| uid)
                .collect::<Vec<_>>()
        };
        tessera_conformance::wait_for(
            "the unprepared claims' CDI specs and records removed",
            Duration::from_secs(30),
            || async {
                Ok((self.cdi_files().is_empty() && retired(self).is_empty()).then_some(()))
            },
        )
        .await
        .with_context(|| {
            format!(
                "{:?} and records {:?} left",
                self.cdi_files(),
                retired(self)
            )
        })
    }

    /// The hidden files of the CDI directory: the spares the plugin keeps
    /// of removed specs, and temp files of writes in flight.
    pub fn cdi_hidden(&self) -> Vec<String> {
        let mut names = self.cdi_all();
        names.retain(|n| n.starts_with('.'));
        names
    }

    fn cdi_all(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.cdi())
            .map(|rd| {
                rd.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// The driver's own CDI spec (what every claim's containers need).
    pub fn driver_spec(&self) -> Option<Value> {
        let path = self.cdi().join("gpu.tessera.dev-driver.json");
        std::fs::read(path)
            .ok()
            .map(|b| serde_json::from_slice(&b).expect("spec is JSON"))
    }

    pub fn spec(&self, uid: &str) -> Option<Value> {
        let path = self.cdi().join(format!("gpu.tessera.dev-claim_{uid}.json"));
        std::fs::read(path)
            .ok()
            .map(|b| serde_json::from_slice(&b).expect("spec is JSON"))
    }

    /// The directory of the plugin's per-claim checkpoint records.
    pub fn records(&self) -> PathBuf {
        self.state().join("prepared-claims")
    }

    /// Rewrites the checkpoint records to hold exactly these entries (valid
    /// records of the current boot, as the plugin would have written
    /// them), to stage what a kill leaves.
    pub fn write_checkpoint(&self, entries: &BTreeMap<String, Value>) -> Result<()> {
        let boot = std::fs::read_to_string(self.boot_id())?.trim().to_owned();
        let dir = self.records();
        std::fs::create_dir_all(&dir)?;
        for file in std::fs::read_dir(&dir)? {
            let path = file?.path();
            let uid = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            if !entries.contains_key(uid) {
                std::fs::remove_file(&path)?;
            }
        }
        for (uid, entry) in entries {
            let entry = serde_json::to_string(entry)?;
            let record = json!({
                "version": 2,
                "bootId": boot,
                "crc32": crc32fast::hash(entry.as_bytes()),
                "entry": entry,
            });
            std::fs::write(
                dir.join(format!("{uid}.json")),
                serde_json::to_vec(&record)?,
            )?;
        }
        Ok(())
    }

    /// The checkpoint's entries by claim UID (decoded from the records).
    pub fn checkpoint(&self) -> BTreeMap<String, Value> {
        let Ok(files) = std::fs::read_dir(self.records()) else {
            return BTreeMap::new();
        };
        let mut entries: BTreeMap<String, Value> = BTreeMap::new();
        for file in files {
            let path = file.expect("records listed").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let Some(uid) = name
                .strip_suffix(".json")
                .filter(|_| !name.starts_with('.'))
            else {
                continue;
            };
            // Removed by the plugin between listing and reading.
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let record: Value = serde_json::from_slice(&bytes).expect("checkpoint record JSON");
            let entry = record["entry"].as_str().expect("entry text");
            entries.insert(uid.to_owned(), serde_json::from_str(entry).unwrap());
        }
        // Records an unprepare retired are named in the journal beside
        // them (a claim's last line says), and read as `Unpreparing`.
        let journal = std::fs::read_to_string(self.records().join("retired.log"));
        let mut retired = BTreeMap::new();
        for line in journal.unwrap_or_default().lines() {
            if let Some((verb, uid)) = line.split_once(' ') {
                retired.insert(uid.to_owned(), verb == "retired");
            }
        }
        for (uid, entry) in &mut entries {
            if retired.get(uid) == Some(&true) {
                entry["state"] = json!("Unpreparing");
            }
        }
        entries
    }
}

/// Capability minors of GPU instance `gi` (compute instance 0) on GPU
/// `gpu_minor`, as the NVIDIA driver's MIG minor table numbers them (and
/// the simulated driver writes them).
pub fn mig_cap_minors(gpu_minor: u32, gi: u32) -> (u32, u32) {
    let gi_minor = 3 + 135 * gpu_minor + 9 * gi;
    (gi_minor, gi_minor + 1)
}

/// A running `tessera plugin`.
pub struct PluginProcess {
    child: Child,
    pub log: PathBuf,
    /// The probe socket (`--health-socket`) of this process.
    health: PathBuf,
    /// The registration sockets in the instance's registry directory before
    /// this process started: none of them is this process's (every process
    /// names its sockets anew). A killed process's socket can still accept
    /// connections for a moment after its death (see [`register`]).
    registry_before: std::collections::BTreeSet<PathBuf>,
}

pub struct PluginOptions {
    pub node: String,
    pub driver: String,
    pub kubeconfig: PathBuf,
    /// Register with the cluster's real kubelet (its registry and plugin
    /// directories) instead of the instance's own directories.
    pub kubelet: Option<tessera_conformance::KubeletDirs>,
    /// The simulated machine's topology file.
    pub topology: PathBuf,
    /// Extra `tessera plugin` arguments.
    pub args: Vec<String>,
    /// Log file name in the plugin directory (appended to).
    pub log: String,
    /// XID injection: the file the simulated NVML reads `<uuid> <xid>`
    /// lines from (`TESSERA_FAKE_NVML_EVENTS`); none by default.
    pub events: Option<PathBuf>,
}

impl PluginProcess {
    pub fn start(dirs: &PluginDirs, opts: &PluginOptions) -> Result<Self> {
        let b = binaries();
        let log = dirs.path(&opts.log);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let (registry, plugins) = match &opts.kubelet {
            Some(k) => (k.registry.clone(), k.plugins.clone()),
            None => (dirs.registry(), dirs.plugins()),
        };
        let registry_before = std::fs::read_dir(dirs.registry())
            .map(|rd| rd.filter_map(|e| Some(e.ok()?.path())).collect())
            .unwrap_or_default();
        // Its probe socket: the one the test gives, else one of its own.
        let health = opts
            .args
            .iter()
            .position(|a| a == "--health-socket")
            .and_then(|at| opts.args.get(at + 1))
            .map_or_else(
                || dirs.path(&opts.log.replace(".log", ".sock")),
                PathBuf::from,
            );
        let mut command = Command::new(&b.tessera);
        if let Some(events) = &opts.events {
            command.env("TESSERA_FAKE_NVML_EVENTS", events);
        } else {
            command.env_remove("TESSERA_FAKE_NVML_EVENTS");
        }
        let child = command
            .arg("--nvml-library")
            .arg(&b.fake_nvml)
            .arg("plugin")
            .args(["--node-name", &opts.node, "--driver-name", &opts.driver])
            .arg("--kubeconfig")
            .arg(&opts.kubeconfig)
            .arg("--kubelet-registry-dir")
            .arg(registry)
            .arg("--kubelet-plugins-dir")
            .arg(plugins)
            .arg("--cdi-dir")
            .arg(dirs.cdi())
            .arg("--state-dir")
            .arg(dirs.state())
            .arg("--driver-root")
            .arg(dirs.driver_root())
            .arg("--boot-id-file")
            .arg(dirs.boot_id())
            .args(["--api-timeout-seconds", "10", "--rediscover-seconds", "1"])
            .arg("--mps-dir")
            .arg(dirs.mps())
            .args(&opts.args)
            // Its probes, where tests wait for it to serve.
            .args(
                (!opts.args.iter().any(|a| a.starts_with("--health-socket")))
                    .then(|| ["--health-socket".to_owned(), health.display().to_string()])
                    .into_iter()
                    .flatten(),
            )
            // Tests run side by side: a free port each, unless a test picks.
            .args(
                (!opts.args.iter().any(|a| a.starts_with("--metrics-address")))
                    .then_some(["--metrics-address", "127.0.0.1:0"])
                    .into_iter()
                    .flatten(),
            )
            .env("TESSERA_FAKE_NVML_TOPOLOGY", &opts.topology)
            // The node's GPU state, kept across restarts of the plugin.
            .env("TESSERA_FAKE_NVML_STATE", dirs.nvml_state())
            .env("TESSERA_FAKE_NVML_DRIVER_ROOT", dirs.driver_root())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting tessera plugin")?;
        Ok(PluginProcess {
            child,
            log,
            health,
            registry_before,
        })
    }

    /// Waits until the process says it serves (`tessera health --probe
    /// status`): registered with the kubelet, its slices published.
    pub async fn serving(&self) -> Result<()> {
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            let asked = self.ask_status()?;
            if asked.status.success() {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!(
                    "the plugin did not serve within {TIMEOUT:?}: {}{}",
                    String::from_utf8_lossy(&asked.stdout),
                    String::from_utf8_lossy(&asked.stderr)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// What the process says of itself on its probe socket (`tessera
    /// health --probe status`: phase, readiness, registration, published
    /// generation, metrics address); `None` while nothing answers.
    pub fn status(&self) -> Result<Option<serde_json::Value>> {
        Ok(serde_json::from_slice(&self.ask_status()?.stdout).ok())
    }

    /// `tessera health --probe status` on this process's probe socket: its
    /// JSON on stdout, and success once the process serves.
    fn ask_status(&self) -> Result<std::process::Output> {
        Command::new(&binaries().tessera)
            .args(["health", "--probe", "status", "--socket"])
            .arg(&self.health)
            .output()
            .context("running tessera health")
    }

    /// The metrics endpoint's address, as the process says on its probe
    /// socket (`tessera health --probe status`), once it is bound.
    pub async fn metrics_address(&mut self) -> Result<std::net::SocketAddr> {
        self.said_address("metricsAddress").await
    }

    /// The authenticated metrics endpoint's address, once it is bound.
    pub async fn secure_metrics_address(&mut self) -> Result<std::net::SocketAddr> {
        self.said_address("secureMetricsAddress").await
    }

    async fn said_address(&mut self, field: &str) -> Result<std::net::SocketAddr> {
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            self.check_running()?;
            let status = self.status()?.unwrap_or_default();
            if let Some(address) = status[field].as_str() {
                return Ok(address.parse()?);
            }
            if std::time::Instant::now() > deadline {
                bail!("the plugin said no {field} within {TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "tessera plugin exited ({status}); log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        Ok(())
    }

    /// SIGKILL, no cleanup.
    pub fn kill(mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM and wait for a clean exit.
    pub async fn terminate(mut self) -> Result<std::process::ExitStatus> {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        let child = &mut self.child;
        wait_for("plugin exit after SIGTERM", TIMEOUT, || {
            let r = child.try_wait();
            async move { Ok(r?) }
        })
        .await
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A gRPC channel over a unix socket.
pub use tessera_conformance::bench::grpc::connect;

/// What the kubelet learns at registration, and a DRA client for it.
pub struct Kubelet {
    pub info: registration::PluginInfo,
    pub dra: dra_v1::dra_plugin_client::DraPluginClient<Channel>,
}

/// Waits for the plugin's registration socket, calls GetInfo on it and
/// connects to the endpoint it names, like the kubelet's plugin manager.
///
/// Only a socket that appeared since `process` started is its own. A
/// socket of a SIGKILLed instance stays in the directory, and it can still
/// accept connections after `kill` + `wait` returned: a child the instance
/// was starting (the MPS daemon, `echo quit | nvidia-cuda-mps-control`)
/// holds a copy of every descriptor, listeners included, from fork until
/// exec closes them. A connection made then is queued, never accepted, and
/// reset when exec closes the listener (GetInfo fails with
/// `ConnectionReset`).
pub async fn register(
    dirs: &PluginDirs,
    process: &mut PluginProcess,
    driver: &str,
) -> Result<Kubelet> {
    let socket = wait_for_registration_socket(dirs, process, driver).await?;
    let mut reg =
        registration::registration_client::RegistrationClient::new(connect(&socket).await?);
    let info = reg
        .get_info(registration::InfoRequest {})
        .await?
        .into_inner();
    reg.notify_registration_status(registration::RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await?;
    let dra =
        dra_v1::dra_plugin_client::DraPluginClient::new(connect(Path::new(&info.endpoint)).await?);
    Ok(Kubelet { info, dra })
}

/// Polls (every few milliseconds, until [`TIMEOUT`]) for a registration
/// socket of `driver` that `process` created and that accepts connections.
async fn wait_for_registration_socket(
    dirs: &PluginDirs,
    process: &mut PluginProcess,
    driver: &str,
) -> Result<PathBuf> {
    let registry = dirs.registry();
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        process.check_running()?;
        let found = std::fs::read_dir(&registry).ok().and_then(|rd| {
            rd.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| {
                !process.registry_before.contains(p)
                    && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        n.starts_with(&format!("{driver}-")) && n.ends_with("-reg.sock")
                    })
                    && std::os::unix::net::UnixStream::connect(p).is_ok()
            })
        });
        if let Some(found) = found {
            return Ok(found);
        }
        if std::time::Instant::now() > deadline {
            bail!(
                "no registration socket of {driver} in {} after {TIMEOUT:?}",
                registry.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Creates a claim with the given requests and writes its allocation.
pub struct ClaimSpec {
    pub name: String,
    /// `(request name, device class)`.
    pub requests: Vec<(String, String)>,
    /// `status.allocation.devices.results`.
    pub results: Vec<Value>,
    /// `status.allocation.devices.config`.
    pub config: Vec<Value>,
    /// `spec.devices.config` (claim configs are copied there too).
    pub spec_config: Vec<Value>,
}

pub fn result(request: &str, driver: &str, pool: &str, device: &str) -> Value {
    json!({ "request": request, "driver": driver, "pool": pool, "device": device })
}

pub async fn create_allocated(
    client: &Client,
    namespace: &str,
    spec: &ClaimSpec,
) -> Result<ResourceClaim> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let requests: Vec<Value> = spec
        .requests
        .iter()
        .map(|(name, class)| json!({ "name": name, "exactly": { "deviceClassName": class, "allocationMode": "ExactCount", "count": 1 } }))
        .collect();
    let mut devices = json!({ "requests": requests });
    if !spec.spec_config.is_empty() {
        devices["config"] = json!(spec.spec_config);
    }
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": spec.name },
        "spec": { "devices": devices },
    }))?;
    let created = api.create(&PostParams::default(), &claim).await?;
    let mut alloc = json!({ "results": spec.results });
    if !spec.config.is_empty() {
        alloc["config"] = json!(spec.config);
    }
    let status = json!({ "status": { "allocation": { "devices": alloc } } });
    api.patch_status(&spec.name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .with_context(|| format!("writing the allocation of claim {}", spec.name))?;
    Ok(created)
}

pub fn claim_ref(namespace: &str, claim: &ResourceClaim) -> dra_v1::Claim {
    dra_v1::Claim {
        namespace: namespace.to_owned(),
        uid: claim.metadata.uid.clone().unwrap_or_default(),
        name: claim.metadata.name.clone().unwrap_or_default(),
    }
}

pub async fn prepare(
    k: &mut Kubelet,
    claims: Vec<dra_v1::Claim>,
) -> Result<dra_v1::NodePrepareResourcesResponse> {
    Ok(k.dra
        .node_prepare_resources(dra_v1::NodePrepareResourcesRequest { claims })
        .await?
        .into_inner())
}

pub async fn unprepare(
    k: &mut Kubelet,
    claims: Vec<dra_v1::Claim>,
) -> Result<dra_v1::NodeUnprepareResourcesResponse> {
    Ok(k.dra
        .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest { claims })
        .await?
        .into_inner())
}

/// A DeviceClass-free device class name: the tests never ask the scheduler.
pub const CLASS: &str = "gpu.tessera.dev";

/// One test's world: namespace, node and driver names, plugin dirs.
pub struct World {
    pub cluster: TestCluster,
    pub namespace: tessera_conformance::TestNamespace,
    pub node: String,
    pub driver: String,
    pub dirs: PluginDirs,
}

impl World {
    pub async fn new(prefix: &str) -> Result<Self> {
        let cluster = TestCluster::shared().await?;
        let namespace = cluster.create_namespace(prefix).await?;
        let node = unique_name(&format!("{prefix}-node"));
        Ok(World {
            cluster,
            namespace,
            node,
            driver: "gpu.tessera.dev".into(),
            dirs: PluginDirs::new()?,
        })
    }

    pub fn options(&self) -> PluginOptions {
        PluginOptions {
            node: self.node.clone(),
            driver: self.driver.clone(),
            kubeconfig: self.cluster.kubeconfig().to_path_buf(),
            kubelet: None,
            topology: topology_path(),
            args: Vec::new(),
            log: "plugin.log".into(),
            events: None,
        }
    }

    pub fn ns(&self) -> &str {
        self.namespace.name()
    }
}

/// What the kubelet tests share: a DeviceClass `id` for whole GPUs of
/// `driver`, a ResourceClaimTemplate `gpu` in `ns`, and, once the kubelet
/// has registered the plugin (like a DaemonSet's readiness), a Pod
/// `gpu-pod` with a claim from that template. Returns the namespace's Pods.
pub async fn whole_gpu_pod(
    cluster: &TestCluster,
    ns: &tessera_conformance::TestNamespace,
    driver: &str,
    id: &str,
    plugin: &PluginProcess,
) -> Result<Api<Pod>> {
    let pp = PostParams::default();
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": id },
        "spec": { "selectors": [{ "cel": { "expression":
            format!("device.driver == {driver:?} && device.attributes[{driver:?}].type == \"gpu\"") } }] },
    }))?;
    Api::<DeviceClass>::all(cluster.client())
        .create(&pp, &class)
        .await?;
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": { "name": "gpu" },
        "spec": { "spec": { "devices": { "requests": [{
            "name": "gpu", "exactly": { "deviceClassName": id },
        }]}}},
    }))?;
    ns.api::<ResourceClaimTemplate>()
        .create(&pp, &template)
        .await?;
    plugin.serving().await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "gpu-pod" },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "resourceClaims": [{ "name": "gpu", "resourceClaimTemplateName": "gpu" }],
            "containers": [{
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
        },
    }))?;
    let pods = ns.api::<Pod>();
    pods.create(&pp, &pod).await?;
    Ok(pods)
}

/// The GPU UUID the plugin wrote into the claim's `status.devices`, once there.
pub async fn status_gpu_uuid(claims: &Api<ResourceClaim>, claim_name: &str) -> Result<String> {
    wait_for("status.devices with the GPU UUID", TIMEOUT, || async {
        let c = claims.get(claim_name).await?;
        Ok(c.status
            .and_then(|s| s.devices)
            .and_then(|d| d.into_iter().next())
            .and_then(|d| d.data)
            .and_then(|d| {
                d.0.get("gpuUUID")
                    .and_then(|v| v.as_str())
                    .map(str::to_owned)
            }))
    })
    .await
}

/// Ends a test of [`whole_gpu_pod`] whatever happened: deletes its Pod,
/// namespace, DeviceClass `id` and the slices of `driver`, stops the plugin
/// with SIGTERM (so it removes its sockets from the kubelet's directories),
/// and prints the plugin's log when `result` is a failure.
pub async fn finish_kubelet_test(
    cluster: &TestCluster,
    ns: &tessera_conformance::TestNamespace,
    driver: &str,
    id: &str,
    plugin: PluginProcess,
    result: Result<()>,
) -> Result<()> {
    let client = cluster.client();
    let _ = ns
        .api::<Pod>()
        .delete("gpu-pod", &DeleteParams::default().grace_period(0))
        .await;
    let _ = ns.delete().await;
    let _ = delete_ignore_missing(&Api::<DeviceClass>::all(client.clone()), id).await;
    let slices: Api<ResourceSlice> = Api::all(client);
    if let Ok(list) = slices
        .list(&ListParams::default().fields(&format!("spec.driver={driver}")))
        .await
    {
        for s in list.items {
            let _ = delete_ignore_missing(&slices, s.metadata.name.as_deref().unwrap_or_default())
                .await;
        }
    }
    let log = plugin.log.clone();
    let _ = plugin.terminate().await;
    if result.is_err() {
        eprintln!(
            "plugin log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    result
}
