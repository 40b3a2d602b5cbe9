//! The node under test: `tessera plugin` over the GPUs (real, or the
//! simulated machine of a topology), its registration and plugin sockets
//! in the self-test's own directory (no kubelet reads them), and what a
//! CUDA process on the node is given (its environment, the probe).

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use tessera_api::inventory::Inventory;
use tessera_test_kit::driver_root::{DriverRootBuilder, Fakes, MPS_CONTROL, NVML};

use crate::bench::grpc;
use crate::cluster::wait_for;
use crate::procs;

/// The GPUs the node process drives.
#[derive(Debug, Clone)]
pub enum Gpus {
    /// The host's GPUs through its NVIDIA driver (libnvidia-ml.so.1 as the
    /// loader finds it unless named; the driver's files under the root).
    Real {
        nvml_library: Option<PathBuf>,
        driver_root: PathBuf,
    },
    /// The simulated machine of `topology`: the fake NVML, CUDA and MPS
    /// control binaries built in `fakes` (cargo's profile directory).
    Simulated { topology: PathBuf, fakes: PathBuf },
}

/// A running `tessera plugin` and its directories.
pub struct Node {
    pub name: String,
    pub driver: String,
    pub dir: PathBuf,
    gpus: Gpus,
    tessera: PathBuf,
    child: Option<Child>,
    /// The plugin's DRA socket (found as the kubelet finds it).
    pub endpoint: PathBuf,
}

impl Node {
    /// Starts the node process for `node` under `dir` and waits until it
    /// serves its DRA socket and has published its slices.
    pub async fn start(
        tessera: &Path,
        gpus: Gpus,
        node: &str,
        driver: &str,
        kubeconfig: &Path,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Node> {
        for d in ["registry", "plugins", "cdi", "state", "mps", "driver"] {
            std::fs::create_dir_all(dir.join(d))?;
        }
        let mut me = Node {
            name: node.to_owned(),
            driver: driver.to_owned(),
            dir: dir.to_path_buf(),
            gpus,
            tessera: tessera.to_path_buf(),
            child: None,
            endpoint: PathBuf::new(),
        };
        if let Gpus::Simulated { .. } = me.gpus {
            me.simulated_driver_root()?;
        }
        let log = File::create(dir.join("plugin.log"))?;
        let mut cmd = me.tessera_cmd();
        cmd.arg("plugin")
            .args(["--node-name", node, "--driver-name", driver])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--kubelet-registry-dir")
            .arg(dir.join("registry"))
            .arg("--kubelet-plugins-dir")
            .arg(dir.join("plugins"))
            .arg("--cdi-dir")
            .arg(me.cdi_dir())
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--mps-dir")
            .arg(me.mps_dir())
            .arg("--driver-root")
            .arg(me.driver_root())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        me.child = Some(cmd.spawn().context("starting tessera plugin")?);
        let registry = dir.join("registry");
        let deadline = Instant::now() + timeout;
        me.endpoint = loop {
            me.check_running()?;
            if let Ok(endpoint) = grpc::dra_endpoint(&registry, driver).await {
                break endpoint;
            }
            ensure!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for tessera plugin's registration in {}",
                registry.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        Ok(me)
    }

    /// `tessera` with the node's NVML: the library and, simulated, the
    /// machine's environment.
    fn tessera_cmd(&self) -> Command {
        let mut cmd = Command::new(&self.tessera);
        match &self.gpus {
            Gpus::Real { nvml_library, .. } => {
                if let Some(lib) = nvml_library {
                    cmd.arg("--nvml-library").arg(lib);
                }
            }
            Gpus::Simulated { .. } => {
                cmd.arg("--nvml-library")
                    .arg(self.driver_root().join(NVML))
                    .envs(self.simulated_env())
                    .env(
                        "TESSERA_FAKE_NVML_DRIVER_ROOT",
                        self.driver_root().as_os_str(),
                    );
            }
        }
        cmd
    }

    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.join("cdi")
    }
    pub fn mps_dir(&self) -> PathBuf {
        self.dir.join("mps")
    }
    pub fn records_dir(&self) -> PathBuf {
        self.dir.join("state/prepared-claims")
    }
    pub fn driver_root(&self) -> PathBuf {
        match &self.gpus {
            Gpus::Real { driver_root, .. } => driver_root.clone(),
            Gpus::Simulated { .. } => self.dir.join("driver"),
        }
    }
    /// The MPS control tool a tenant could bring.
    pub fn mps_control(&self) -> PathBuf {
        self.driver_root().join(MPS_CONTROL)
    }

    /// Whether the GPUs are the simulated machine's.
    pub fn simulated(&self) -> bool {
        matches!(self.gpus, Gpus::Simulated { .. })
    }

    /// The simulated machine's state, as every process on it sees it, and
    /// each process's load recorded (the claim guard sees what processes
    /// hold through it, as NVML lists them on a real GPU).
    fn simulated_env(&self) -> Vec<(&'static str, OsString)> {
        match &self.gpus {
            Gpus::Simulated { topology, .. } => vec![
                ("TESSERA_FAKE_NVML_TOPOLOGY", topology.into()),
                (
                    "TESSERA_FAKE_NVML_STATE",
                    self.dir.join("nvml.state").into(),
                ),
                (tessera_fake_nvml::load::LOAD_ENV, "1".into()),
            ],
            Gpus::Real { .. } => Vec::new(),
        }
    }

    /// The environment a container's process starts with before its CDI
    /// edits: a plain `PATH`, the loader's path on a real node (the
    /// driver's libraries where `ld.so.conf` may not list them), and on the
    /// simulated one where the simulated GPUs' state is and that `/dev` is
    /// the container's own.
    pub fn process_env(&self) -> Vec<(&'static str, OsString)> {
        let mut env = vec![("PATH", "/usr/sbin:/usr/bin:/sbin:/bin".into())];
        match &self.gpus {
            Gpus::Real { .. } => {
                if let Some(path) = std::env::var_os("LD_LIBRARY_PATH") {
                    env.push(("LD_LIBRARY_PATH", path));
                }
            }
            Gpus::Simulated { .. } => {
                env.extend(self.simulated_env());
                env.push(("TESSERA_FAKE_NVML_DEV_ROOT", "/dev".into()));
            }
        }
        env
    }

    /// `tessera probe` as a container of CDI device `cdi_device` would run
    /// it, with `args` after.
    pub fn probe_cmd(&self, cdi_device: &str, args: &[String]) -> Command {
        let mut cmd = Command::new(&self.tessera);
        cmd.env_clear()
            .envs(self.process_env())
            .arg("probe")
            .arg("--cdi-dir")
            .arg(self.cdi_dir())
            .args(["--cdi-device", cdi_device])
            // The probe loads the spec's libcuda.so.1 only if it is this driver's.
            .arg("--driver-root")
            .arg(self.driver_root())
            .args(args);
        cmd
    }

    /// Fails once the process has exited, naming its log.
    pub fn check_running(&mut self) -> Result<()> {
        let Some(child) = self.child.as_mut() else {
            bail!("tessera plugin is not running");
        };
        if let Some(status) = child.try_wait()? {
            let log = std::fs::read_to_string(self.dir.join("plugin.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            bail!(
                "tessera plugin exited ({status}); the end of its log:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }

    /// Stops the node process (SIGTERM, then waits up to `timeout`).
    pub async fn stop(&mut self, timeout: Duration) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = i32::try_from(child.id()).context("pid")?;
        // SAFETY: a signal to our own child, which has not been reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let exited = wait_for("tessera plugin to exit", timeout, || {
            let status = child.try_wait();
            async move { Ok(status?.map(|_| ())) }
        })
        .await;
        if exited.is_err() {
            child.kill()?;
            child.wait()?;
        }
        exited
    }

    /// The simulated machine's driver root, built as every test builds it:
    /// the device nodes the NVIDIA driver would create (for the minors the
    /// simulated GPUs have), its libraries and tools where a driver install
    /// has them.
    fn simulated_driver_root(&self) -> Result<()> {
        let Gpus::Simulated { fakes, .. } = &self.gpus else {
            return Ok(());
        };
        DriverRootBuilder::simulated(&Fakes::in_profile_dir(fakes)?)
            .gpus_asked(|_| Ok(self.inventory()?.gpus.iter().map(|g| g.minor).collect()))
            .build(&self.driver_root())?;
        Ok(())
    }

    /// `tessera inventory` on the node.
    pub fn inventory(&self) -> Result<Inventory> {
        let out = self
            .tessera_cmd()
            .args(["inventory", "--output", "json"])
            .output()
            .context("running tessera inventory")?;
        ensure!(
            out.status.success(),
            "tessera inventory failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).context("tessera inventory's JSON")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// PIDs of the MPS control daemons serving `pipe` (processes of an
/// `*mps-control` binary in daemon mode with that pipe directory).
pub fn daemons_of(pipe: &Path) -> Vec<i32> {
    let want = [
        b"CUDA_MPS_PIPE_DIRECTORY=".as_slice(),
        pipe.as_os_str().as_encoded_bytes(),
    ]
    .concat();
    procs::pids()
        .into_iter()
        .filter(|pid| {
            let Some(args) = procs::args(*pid) else {
                return false;
            };
            let is_control = args.first().is_some_and(|a| a.ends_with(b"mps-control"));
            let daemon_mode = args.iter().any(|a| a == b"-d" || a == b"-f");
            is_control
                && daemon_mode
                && procs::running(*pid)
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == want.as_slice()))
        })
        .collect()
}
