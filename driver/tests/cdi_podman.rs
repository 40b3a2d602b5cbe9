//! A real container runtime consumes the CDI spec prepare writes.
//!
//! The claim is prepared by the driver's own prepare engine
//! ([`Preparer`]) exactly as NodePrepareResources does it, on the inventory
//! `tessera inventory` discovers through the simulated NVML (8x H100), with
//! device nodes made by `mknod` under a temporary driver root. Then podman
//! (Debian's 4.3, runc) runs a container from a busybox-static rootfs with
//! the CDI id prepare returned, and the container must see its GPU's device
//! node and visible-devices variables, and nothing else; a container without
//! the id sees none of it; and a spec with a `cdiVersion` podman 4.3 does
//! not know is refused, which is why the spec writer emits the lowest
//! version its content needs.
//!
//! podman 4.3 has no option for the CDI spec directory: it reads `/etc/cdi`
//! and `/var/run/cdi` only. Prepare writes into a temporary CDI directory
//! (its start-up cleanup of unknown specs must not touch a shared one); the
//! test copies that file, byte for byte, into `/var/run/cdi` under the same
//! (claim-UID-unique) name and removes exactly that file afterwards.
//!
//! Without podman, runc or busybox-static, or where podman cannot run a
//! container at all, the test prints why and returns; with
//! `TESSERA_REQUIRE_PODMAN=1` (set by `conformance/test-all.sh`, which
//! installs them) it fails instead. See docs/development.md.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod common;

use std::collections::HashMap;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tessera_api::inventory::{Gpu, Inventory};
use tessera_controller::model::naming::DriverName;
use tessera_controller::model::{
    Capabilities, DeviceKind, DeviceRef, IsolationLevel, NodePolicy, SliceModel,
};
use tessera_driver::cdi::Spec;
use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::host::driver_root::Layout;
use tessera_driver::host::mps::{MpsConfig, MpsSupervisor, PID_FILE, Pidfd, ProcessId};
use tessera_driver::host::port::{MpsControl, Unsupported};
use tessera_driver::prepare::claims::{ClaimRef, ClaimSource, FetchError, FetchFuture};
use tessera_driver::prepare::{Dependencies, PrepareConfig, Preparer};
use tessera_driver::state::catalog::{Catalog, DeviceCatalog};
use tessera_test_kit::artifacts::fake_mps_control;
use tessera_test_kit::driver_root::DriverRootBuilder;

const NODE: &str = "podman-node";
const DRIVER: &str = "gpu.tessera.dev";
const RUNC: &str = "/usr/sbin/runc";
const REQUIRE_ENV: &str = "TESSERA_REQUIRE_PODMAN";
/// Where podman 4.3 looks for CDI specs (besides /etc/cdi).
const RUNTIME_CDI_DIR: &str = "/var/run/cdi";
/// NVIDIA's character device major for /dev/nvidia* (not uvm).
const NVIDIA_MAJOR: u32 = 195;

/// What the container reports: its NVIDIA device nodes with type and
/// major:minor, and the two variables (or `<unset>`).
const PROBE: &str = r#"for f in /dev/nvidia*; do [ -e "$f" ] && echo "node $f $(stat -c '%F %t:%T' "$f")"; done
for v in NVIDIA_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_PINNED_DEVICE_MEM_LIMIT CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; do
  eval "echo \"env $v=\${$v-<unset>}\""
done
[ -S "${CUDA_MPS_PIPE_DIRECTORY:-/nonexistent}/control" ] && echo "mps-control reachable"
echo probe-done"#;

/// A simulated node: 8x H100 as discovery reports them through the fake
/// NVML, their device nodes (mknod) under a temporary driver root, a
/// busybox rootfs, and the device names the published model offers.
struct Node {
    dir: tempfile::TempDir,
    root: PathBuf,
    rootfs: PathBuf,
    inventory: Inventory,
    driver: DriverName,
    devices: Vec<(String, DeviceRef)>,
}

impl Node {
    fn new(env: &Environment) -> Node {
        let dir = tempfile::Builder::new().prefix("cdi").tempdir().unwrap();
        let root = dir.path().join("root");
        let rootfs = env.rootfs(dir.path());
        let inventory = common::inventory(&common::topology("h100x8.yaml"));
        assert_eq!(inventory.gpus.len(), 8);
        DriverRootBuilder::new()
            .nvidiactl()
            .gpus(inventory.gpus.iter().map(|gpu| gpu.minor))
            .build(&root)
            .expect("building the driver root (mknod; checked by Environment::check)");
        let driver = DriverName::new(DRIVER).unwrap();
        let model = SliceModel::new(
            &inventory,
            &NodePolicy::default(),
            Capabilities::full(),
            NODE,
        )
        .driver(driver.clone())
        .build()
        .unwrap();
        Node {
            dir,
            root,
            rootfs,
            inventory,
            driver,
            devices: model.devices.into_iter().collect(),
        }
    }

    /// The device of the wanted kind on the highest-numbered GPU (not GPU
    /// 0, so "the first node happens to match" cannot pass), and its GPU.
    fn device(&self, want: impl Fn(&DeviceKind) -> bool) -> (String, Gpu) {
        let (name, reference) = self
            .devices
            .iter()
            .filter(|(_, r)| want(&r.kind))
            .max_by_key(|(_, r)| r.gpu_index)
            .expect("no device of the wanted kind");
        let gpu = self
            .inventory
            .gpus
            .iter()
            .find(|g| g.uuid == reference.gpu_uuid)
            .unwrap()
            .clone();
        assert_ne!(gpu.minor, 0);
        (name.clone(), gpu)
    }

    /// The driver's spec, written when the preparer opened, installed
    /// where podman reads specs. Its name is the driver's, not a claim's:
    /// the tests of this file take turns with it.
    fn install_driver_spec(&self) -> DriverSpec {
        static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.dir.path().join("cdi/gpu.tessera.dev-driver.json");
        DriverSpec {
            _installed: Installed::new(path.file_name().unwrap(), &fs::read(&path).unwrap()),
            _turn: turn,
        }
    }

    /// Prepares `claim` as NodePrepareResources does, with `mps` for
    /// MPS; returns the preparer, the claim's reference, its CDI ids (the
    /// claim's and the driver's) and the claim's spec file.
    async fn prepare(
        &self,
        claim: ResourceClaim,
        mps: Arc<dyn MpsControl>,
    ) -> (Arc<Preparer>, ClaimRef, Vec<String>, PathBuf) {
        let model = SliceModel::new(
            &self.inventory,
            &NodePolicy::default(),
            Capabilities::full(),
            NODE,
        )
        .driver(self.driver.clone())
        .build()
        .unwrap();
        // The CDI spec is the subject here, not MIG mode switching: no GPU
        // whose mode the driver manages.
        let catalog = Catalog::new(self.inventory.clone(), model.devices);
        let base = self.dir.path();
        fs::write(base.join("boot_id"), "podman-test-boot\n").unwrap();
        let config = PrepareConfig {
            driver: DRIVER.into(),
            node: NODE.into(),
            cdi_dir: base.join("cdi"),
            state_dir: base.join("state"),
            boot_id_file: base.join("boot_id"),
            layout: Layout {
                driver_root: self.root.clone(),
                dev_root: self.root.clone(),
                driver_files: Vec::new(),
                hami_core_dir: self.root.join("usr/local/vgpu"),
            },
        };
        let claim_ref = ClaimRef {
            namespace: claim.metadata.namespace.clone().unwrap(),
            name: claim.metadata.name.clone().unwrap(),
            uid: claim.metadata.uid.clone().unwrap(),
        };
        let deps = Dependencies {
            claims: Arc::new(OneClaim(claim)),
            catalog: Arc::new(DeviceCatalog::fixed(catalog)),
            mps,
            time_slice: Arc::new(Unsupported),
            mig: Arc::new(Unsupported),
            status: None,
            events: None,
            on_change: None,
        };
        let (preparer, _) = Preparer::open(config, deps).await.unwrap();
        let mut answers = preparer.prepare(vec![claim_ref.clone()]).await;
        let prepared = answers.remove(0).1.expect("prepare failed");
        assert_eq!(prepared.len(), 1);
        // The claim's device and the driver's, whose spec is written at open.
        let cdi_ids = prepared[0].cdi_device_ids.clone();
        assert_eq!(cdi_ids.len(), 2, "{cdi_ids:?}");
        assert_eq!(cdi_ids[1], "gpu.tessera.dev/driver=cuda");
        let spec_file = fs::read_dir(base.join("cdi"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .as_bytes()
                    .starts_with(b"gpu.tessera.dev-claim_")
            })
            .expect("prepare wrote no CDI spec");
        (preparer, claim_ref, cdi_ids, spec_file)
    }
}

fn claim_json(uid: &ClaimUid, result: serde_json::Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "podman-claim", "namespace": "default", "uid": uid.as_str()},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}},
        "status": {"allocation": {"devices": {"results": [result]}}}
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_a_container_with_the_cdi_id_prepare_returned() {
    let Some(env) = Environment::check() else {
        return;
    };
    let node = Node::new(&env);
    let rootfs = &node.rootfs;
    let (device, gpu) = node.device(|k| matches!(k, DeviceKind::Whole));
    let uid = random_uid();
    let claim = claim_json(
        &uid,
        json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}),
    );
    let (preparer, claim_ref, cdi_ids, spec_file) =
        node.prepare(claim, Arc::new(Unsupported)).await;
    let cdi_id = &cdi_ids.join(" ");

    // The specs prepare wrote, installed where podman reads specs.
    let bytes = fs::read(&spec_file).unwrap();
    let spec: Spec = serde_json::from_slice(&bytes).unwrap();
    // hostPath on device nodes needs 0.5.0, the newest podman 4.3 accepts.
    assert_eq!(spec.cdi_version, "0.5.0");
    let installed = Installed::new(spec_file.file_name().unwrap(), &bytes);
    let _driver = node.install_driver_spec();

    // 1. With the claim's CDI ids: exactly its GPU and the control node.
    let out = env.podman(rootfs, &cdi_ids);
    let seen = Probe::parse(&out);
    eprintln!("container with {cdi_id} reports:\n{}", seen.text);
    let gpu_node = format!("/dev/nvidia{}", gpu.minor);
    assert_eq!(
        seen.nodes,
        HashMap::from([
            (gpu_node.clone(), (NVIDIA_MAJOR, gpu.minor)),
            ("/dev/nvidiactl".to_string(), (NVIDIA_MAJOR, 255)),
        ]),
        "{}",
        seen.text
    );
    assert_eq!(
        seen.env("NVIDIA_VISIBLE_DEVICES"),
        gpu.uuid,
        "{}",
        seen.text
    );
    assert_eq!(seen.env("CUDA_VISIBLE_DEVICES"), gpu.uuid, "{}", seen.text);
    assert_eq!(seen.env("CUDA_MPS_PIPE_DIRECTORY"), "<unset>");
    assert!(!seen.text.contains("mps-control reachable"));

    // 2. Without it: no NVIDIA node, no variable.
    let out = env.podman(rootfs, &[]);
    let bare = Probe::parse(&out);
    eprintln!("container without a CDI id reports:\n{}", bare.text);
    assert!(bare.nodes.is_empty(), "{}", bare.text);
    assert_eq!(bare.env("NVIDIA_VISIBLE_DEVICES"), "<unset>");
    assert_eq!(bare.env("CUDA_VISIBLE_DEVICES"), "<unset>");

    // 3. The same spec claiming cdiVersion 0.6.0 is not usable by podman
    // 4.3: the version cap is what makes case 1 work.
    let mut newer: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    newer["cdiVersion"] = json!("0.6.0");
    installed.replace(&serde_json::to_vec(&newer).unwrap());
    let out = env.podman(rootfs, &cdi_ids);
    assert!(
        !out.status.success(),
        "podman accepted cdiVersion 0.6.0:\n{}",
        text(&out)
    );
    assert!(
        text(&out).contains("unresolvable CDI devices"),
        "{}",
        text(&out)
    );
    drop(installed);

    // Unprepare removes the spec (after its answer: the claim changed
    // nothing on the host).
    let mut answers = preparer.unprepare(vec![claim_ref]).await;
    answers.remove(0).1.expect("unprepare failed");
    removed(&spec_file).await;
}

/// Waits until `path` is gone (10 s at most).
async fn removed(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} is still there",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_of_an_isolated_share_reaches_its_mps_daemon() {
    let Some(env) = Environment::check() else {
        return;
    };
    let node = Node::new(&env);
    let (device, gpu) = node.device(|k| {
        matches!(
            k,
            DeviceKind::Share {
                level: IsolationLevel::Isolated,
                ..
            }
        )
    });
    // The driver's own MPS supervision, with the simulated control binary.
    let mut mps = MpsConfig::new(Path::new("/nonexistent"), node.dir.path().join("mps"));
    mps.control_binary = fake_mps_control().to_owned();
    let supervisor = Arc::new(MpsSupervisor::new(mps));
    let mps: Arc<dyn MpsControl> = supervisor.clone();

    let uid = random_uid();
    let claim = claim_json(
        &uid,
        json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
               "shareID": random_uid().as_str(),
               "consumedCapacity": {"memory": "8Gi", "cores": "25"}}),
    );
    let (preparer, claim_ref, cdi_ids, spec_file) = node.prepare(claim, mps).await;
    let cdi_id = cdi_ids.join(" ");
    // The claim's own daemon for request `gpu` on the GPU.
    let daemons = supervisor.daemons();
    assert_eq!(daemons.len(), 1, "{daemons:?}");
    assert_eq!(
        (
            daemons[0].key.claim.as_str(),
            daemons[0].key.request.as_str()
        ),
        (uid.as_str(), "gpu")
    );
    assert_eq!(daemons[0].key.device, gpu.uuid);
    let pipe_dir = daemons[0].pipe_dir.clone();
    assert!(pipe_dir.starts_with(node.dir.path().join("mps").join(uid.as_str())));
    let pid: i32 = fs::read_to_string(pipe_dir.join(PID_FILE))
        .expect("prepare started no MPS daemon")
        .trim()
        .parse()
        .unwrap();
    let daemon = ProcessId::of(pid).expect("the claim's MPS daemon is not running");
    let _left = StopIfFailed {
        daemon: Pidfd::open(&daemon).unwrap(),
        mps_dir: node.dir.path().join("mps"),
    };

    let bytes = fs::read(&spec_file).unwrap();
    let installed = Installed::new(spec_file.file_name().unwrap(), &bytes);
    let driver = node.install_driver_spec();
    let out = env.podman(&node.rootfs, &cdi_ids);
    let seen = Probe::parse(&out);
    eprintln!("container with {cdi_id} reports:\n{}", seen.text);
    drop(installed);
    drop(driver);
    assert_eq!(
        seen.nodes,
        HashMap::from([
            (
                format!("/dev/nvidia{}", gpu.minor),
                (NVIDIA_MAJOR, gpu.minor)
            ),
            ("/dev/nvidiactl".to_string(), (NVIDIA_MAJOR, 255)),
        ]),
        "{}",
        seen.text
    );
    assert_eq!(seen.env("CUDA_VISIBLE_DEVICES"), gpu.uuid);
    assert_eq!(
        seen.env("CUDA_MPS_PIPE_DIRECTORY"),
        pipe_dir.to_str().unwrap()
    );
    // The allocation's consumed capacity is the claim's limit.
    assert_eq!(seen.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), "0=8192M");
    assert_eq!(seen.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), "25");
    // The daemon's control endpoint is inside the container.
    assert!(seen.text.contains("mps-control reachable"), "{}", seen.text);

    // Unprepare stops the claim's daemon.
    let mut answers = preparer.unprepare(vec![claim_ref]).await;
    answers.remove(0).1.expect("unprepare failed");
    assert!(
        ProcessId::of(pid).is_none(),
        "the MPS daemon outlived its last claim"
    );
    assert!(supervisor.daemons().is_empty());
    removed(&spec_file).await;
}

/// A test that fails before unprepare stopped the claim's daemon stops it
/// (and detaches its directories' tmpfs), so no daemon outlives the test.
struct StopIfFailed {
    daemon: Option<Pidfd>,
    mps_dir: PathBuf,
}

impl Drop for StopIfFailed {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        if let Some(daemon) = &self.daemon {
            let _ = daemon.kill();
            daemon.wait(Duration::from_secs(5));
        }
        common::detach_mounts_below(&self.mps_dir);
    }
}

struct OneClaim(ResourceClaim);

impl ClaimSource for OneClaim {
    fn get<'a>(&'a self, _namespace: &'a str, name: &'a str) -> FetchFuture<'a> {
        let found = (self.0.metadata.name.as_deref() == Some(name)).then(|| self.0.clone());
        Box::pin(async move { found.ok_or(FetchError::NotFound) })
    }
}

/// A fresh claim UID, so concurrent runs never share a spec file or CDI
/// device name.
fn random_uid() -> ClaimUid {
    let mut bytes = [0u8; 16];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .unwrap();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    ClaimUid::parse(&format!(
        "{}-{}-4{}-8{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        &hex[17..20],
        &hex[20..32]
    ))
    .unwrap()
}

/// The driver's spec installed, and this test's turn with it (given back
/// after the file is removed).
struct DriverSpec {
    _installed: Installed,
    _turn: std::sync::MutexGuard<'static, ()>,
}

/// Our spec file in the runtime's CDI directory; removed on drop.
struct Installed {
    path: PathBuf,
}

impl Installed {
    fn new(name: &std::ffi::OsStr, bytes: &[u8]) -> Self {
        fs::create_dir_all(RUNTIME_CDI_DIR).unwrap();
        let installed = Installed {
            path: Path::new(RUNTIME_CDI_DIR).join(name),
        };
        assert!(
            !installed.path.exists(),
            "{} exists already",
            installed.path.display()
        );
        installed.replace(bytes);
        installed
    }

    fn replace(&self, bytes: &[u8]) {
        tessera_driver::cdi::write_atomically(&self.path, bytes).unwrap();
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// The container's report.
struct Probe {
    nodes: HashMap<String, (u32, u32)>,
    env: HashMap<String, String>,
    text: String,
}

impl Probe {
    fn parse(out: &Output) -> Probe {
        let text = text(out);
        assert!(
            out.status.success() && text.contains("probe-done"),
            "the container failed:\n{text}"
        );
        let mut nodes = HashMap::new();
        let mut env = HashMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("node ") {
                // `/dev/nvidia3 character special file c3:3`
                let (path, rest) = rest.split_once(' ').unwrap();
                let (kind, numbers) = rest.rsplit_once(' ').unwrap();
                assert_eq!(kind, "character special file", "{line}");
                let (major, minor) = numbers.split_once(':').unwrap();
                let hex = |s| u32::from_str_radix(s, 16).unwrap();
                nodes.insert(path.to_string(), (hex(major), hex(minor)));
            } else if let Some(rest) = line.strip_prefix("env ") {
                let (k, v) = rest.split_once('=').unwrap();
                env.insert(k.to_string(), v.to_string());
            }
        }
        Probe { nodes, env, text }
    }

    fn env(&self, name: &str) -> &str {
        self.env.get(name).map_or("<missing>", String::as_str)
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// podman, runc and a static busybox, or why the test cannot run here.
struct Environment {
    busybox: PathBuf,
}

impl Environment {
    /// `None` (after saying why, loudly) where podman cannot run here and
    /// the run does not require it.
    fn check() -> Option<Environment> {
        match Self::probe() {
            Ok(env) => Some(env),
            Err(why) => {
                if std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1") {
                    panic!("{REQUIRE_ENV}=1 but podman cannot run here: {why}");
                }
                eprintln!(
                    "\n*** SKIPPED podman CDI test: {why}\n*** install podman, runc and \
                     busybox-static (conformance/test-all.sh does), see docs/development.md\n"
                );
                None
            }
        }
    }

    fn probe() -> Result<Environment, String> {
        let version = Command::new("podman")
            .arg("--version")
            .output()
            .map_err(|e| format!("no podman on PATH ({e})"))?;
        if !version.status.success() {
            return Err(format!("podman --version failed: {}", text(&version)));
        }
        if !Path::new(RUNC).is_file() {
            return Err(format!("no runc at {RUNC}"));
        }
        let busybox = ["/bin/busybox", "/usr/bin/busybox"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file() && is_static_elf(p))
            .ok_or("no statically linked busybox (package busybox-static)")?;
        let env = Environment { busybox };
        let scratch = tempfile::tempdir().map_err(|e| e.to_string())?;
        let node = scratch.path().join("node");
        let c = std::ffi::CString::new(node.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path in our own temp dir.
        if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) } != 0 {
            return Err(format!(
                "mknod is not permitted ({}); podman refuses CDI device nodes that are \
                 regular files (\"not a device node\")",
                std::io::Error::last_os_error()
            ));
        }
        // A plain container must work before CDI can be judged.
        let rootfs = env.rootfs(scratch.path());
        let out = env.podman(&rootfs, &[]);
        if !out.status.success() {
            return Err(format!(
                "podman cannot run a plain container here: {}",
                text(&out)
            ));
        }
        Ok(env)
    }

    /// A minimal rootfs: busybox and the applets the probe uses.
    fn rootfs(&self, dir: &Path) -> PathBuf {
        let rootfs = dir.join("rootfs");
        fs::create_dir_all(rootfs.join("bin")).unwrap();
        fs::copy(&self.busybox, rootfs.join("bin/busybox")).unwrap();
        for applet in ["sh", "stat", "echo", "env", "ls", "cat"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        rootfs
    }

    fn podman(&self, rootfs: &Path, cdi_ids: &[String]) -> Output {
        let mut cmd = Command::new("podman");
        cmd.args([
            "--cgroup-manager=cgroupfs",
            "--runtime",
            RUNC,
            "run",
            "--rm",
        ])
        .args(["--network=none", "--ulimit", "nofile=1024:1024"])
        .args(["--ulimit", "nproc=1024:1024"]);
        for id in cdi_ids {
            cmd.args(["--device", id]);
        }
        cmd.arg("--rootfs")
            .arg(rootfs)
            .args(["/bin/sh", "-c", PROBE])
            .stdin(Stdio::null());
        output_within(cmd, Duration::from_secs(180))
    }
}

/// Runs `cmd`, killing it past `limit`.
fn output_within(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting podman");
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("podman did not finish within {limit:?}:\n{}", text(&out));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether an ELF file has no program interpreter (statically linked).
fn is_static_elf(path: &Path) -> bool {
    let Ok(b) = fs::read(path) else {
        return false;
    };
    // 64-bit little-endian ELF only (what Debian's busybox-static is here).
    if b.len() < 64 || &b[0..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    (0..phnum).all(|i| {
        let at = phoff + i * phentsize;
        b.get(at..at + 4)
            .is_some_and(|t| u32::from_le_bytes(t.try_into().unwrap()) != PT_INTERP)
    })
}
