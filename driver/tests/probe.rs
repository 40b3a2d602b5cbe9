//! `tessera probe` against the simulated `libcuda.so.1`
//! (`driver/fake-cuda`) on a simulated 8x H100 machine: what a CUDA process
//! gets outside MPS, under a `fake-mps-control` daemon's limits (which its
//! own environment cannot raise), after the daemon quits, in a container
//! (device nodes), and how failures are reported.
//!
//! Every probe is a real `tessera` process loading the fake library as
//! `libcuda.so.1`; daemons are real processes; tests wait on observable
//! state with deadlines, never on fixed sleeps.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tessera_driver::probe::{ProbeAllocation, ProbeReport};
use tessera_test_kit::wait::until as wait_until;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// An H100 80GB HBM3 as the topology (and `nvidia-smi`) has it.
const H100_BYTES: u64 = 81559 * MIB;
const H100_SMS: i32 = 132;

/// A directory holding `libcuda.so.1`, the simulated CUDA driver, for
/// `LD_LIBRARY_PATH`.
use tessera_test_kit::artifacts::{fake_cuda_dir, fake_mps_control};
use tessera_test_kit::driver_root::{DriverRootBuilder, LIBCUDA};

/// The UUIDs of the shipped 8x H100 topology, in order.
fn h100_uuids() -> Vec<String> {
    let text = std::fs::read_to_string(topology("h100x8.yaml")).unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    doc["gpus"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|g| g["uuid"].as_str().unwrap().to_owned())
        .collect()
}

/// One simulated 8x H100 machine (its own state file) and a pipe
/// directory no daemon serves unless a test starts one there.
struct Machine {
    dir: tempfile::TempDir,
    topology: PathBuf,
    state: PathBuf,
}

impl Machine {
    fn new() -> Machine {
        Machine::of("h100x8.yaml")
    }

    /// A machine of a shipped topology.
    fn of(name: &str) -> Machine {
        Machine::at(topology(name))
    }

    /// A machine of the topology file `topology`.
    fn at(topology: PathBuf) -> Machine {
        Machine {
            dir: tempfile::Builder::new().prefix("probe").tempdir().unwrap(),
            topology,
            state: fresh_state("probe"),
        }
    }

    fn quiet_pipe(&self) -> PathBuf {
        self.dir.path().join("no-daemon")
    }

    /// `tessera probe <args>` with the fake `libcuda.so.1` on
    /// `LD_LIBRARY_PATH` and `env` (CUDA variables; the pipe directory
    /// defaults to one without a daemon).
    fn probe(&self, args: &[&str], env: &[(&str, &str)]) -> (Output, ProbeReport) {
        let out = self
            .probe_command(args, env)
            .output()
            .expect("running tessera probe");
        let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "tessera probe printed no report ({e}):\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (out, report)
    }

    /// The `tessera probe` command [`Machine::probe`] runs.
    fn probe_command(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut cmd = clean(Command::new(env!("CARGO_BIN_EXE_tessera")));
        cmd.arg("probe")
            .args(args)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .env_remove("TESSERA_FAKE_NVML_DEV_ROOT")
            .env("CUDA_MPS_PIPE_DIRECTORY", self.quiet_pipe())
            .env("LD_LIBRARY_PATH", fake_cuda_dir())
            .env(TOPOLOGY_ENV, &self.topology)
            .env(STATE_ENV, &self.state)
            .envs(env.iter().copied());
        cmd
    }

    /// A probe that must succeed.
    fn probe_ok(&self, args: &[&str], env: &[(&str, &str)]) -> ProbeReport {
        let (out, report) = self.probe(args, env);
        assert!(
            out.status.success(),
            "tessera probe failed ({}): {report:#?}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        report
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        remove_state(&self.state);
    }
}

/// (uuid, SMs, free bytes) per device.
fn summary(report: &ProbeReport) -> Vec<(String, i32, Option<u64>)> {
    report
        .devices
        .iter()
        .map(|d| (d.uuid.clone(), d.multiprocessors, d.memory_free_bytes))
        .collect()
}

fn allocations(report: &ProbeReport) -> Vec<Option<ProbeAllocation>> {
    report
        .devices
        .iter()
        .map(|d| d.allocation.clone())
        .collect()
}

fn refused(bytes: u64) -> Option<ProbeAllocation> {
    Some(ProbeAllocation {
        bytes,
        ok: false,
        error: Some("CUDA_ERROR_OUT_OF_MEMORY".into()),
    })
}

fn granted(bytes: u64) -> Option<ProbeAllocation> {
    Some(ProbeAllocation {
        bytes,
        ok: true,
        error: None,
    })
}

/// A control daemon in the foreground, killed if the test ends early.
struct Daemon {
    child: Child,
    pipe: PathBuf,
}

impl Daemon {
    fn start(machine: &Machine, name: &str, env: &[(&str, &str)]) -> Daemon {
        let pipe = machine.dir.path().join(name).join("pipe");
        let child = Command::new(fake_mps_control())
            .arg("-f")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env(
                "CUDA_MPS_LOG_DIRECTORY",
                machine.dir.path().join(name).join("log"),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .expect("starting fake-mps-control -f");
        let daemon = Daemon { child, pipe };
        wait_until("the daemon's control socket is there", || {
            daemon.pipe.join("control").exists()
        });
        daemon
    }

    fn pipe(&self) -> &str {
        self.pipe.to_str().unwrap()
    }

    /// `echo <commands> | nvidia-cuda-mps-control`.
    fn control(&self, commands: &str) -> String {
        let mut child = Command::new(fake_mps_control())
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(commands.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{commands:?} failed");
        String::from_utf8(out.stdout).unwrap()
    }

    fn quit(&mut self) {
        self.control("quit\n");
        let child = &mut self.child;
        wait_until("the daemon exits after quit", || {
            child.try_wait().unwrap().is_some()
        });
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------

#[test]
fn outside_mps_every_gpu_is_whole() {
    let m = Machine::new();
    let uuids = h100_uuids();
    let report = m.probe_ok(&["--alloc", "8Gi"], &[]);
    assert_eq!(report.cuda_driver_version, Some(12080));
    assert_eq!(report.library, "libcuda.so.1");
    assert_eq!(
        summary(&report),
        uuids
            .iter()
            .map(|u| (u.clone(), H100_SMS, Some(H100_BYTES)))
            .collect::<Vec<_>>()
    );
    for (i, d) in report.devices.iter().enumerate() {
        assert_eq!(d.ordinal, i as i32);
        assert_eq!(d.name, "NVIDIA H100 80GB HBM3");
        assert_eq!(d.memory_total_bytes, H100_BYTES);
        assert_eq!(d.gpu_uuid, d.uuid);
        assert_eq!(d.allocation, granted(8 * GIB));
        assert_eq!(d.error, None);
    }
    assert_eq!(
        report.environment.cuda_mps_pipe_directory.as_deref(),
        m.quiet_pipe().to_str()
    );
    assert_eq!(report.environment.cuda_visible_devices, None);
    // The client limit variables do nothing without a daemon.
    let report = m.probe_ok(
        &["--alloc", "79Gi"],
        &[
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8G"),
        ],
    );
    assert_eq!(report.devices[0].multiprocessors, H100_SMS);
    assert_eq!(report.devices[0].allocation, granted(79 * GIB));
    assert_eq!(
        report
            .environment
            .cuda_mps_active_thread_percentage
            .as_deref(),
        Some("25")
    );
}

#[test]
fn cuda_visible_devices_picks_and_orders_and_library_overrides_the_loader() {
    let m = Machine::new();
    let uuids = h100_uuids();
    let prefix = &uuids[1][..12];
    let report = m.probe_ok(
        &[
            "--library",
            fake_cuda_dir().join("libcuda.so.1").to_str().unwrap(),
        ],
        &[
            ("CUDA_VISIBLE_DEVICES", &format!("5,{prefix},99,0")),
            ("LD_LIBRARY_PATH", "/nonexistent"),
        ],
    );
    assert_eq!(
        report
            .devices
            .iter()
            .map(|d| d.uuid.as_str())
            .collect::<Vec<_>>(),
        [uuids[5].as_str(), uuids[1].as_str()],
        "99 ends the list"
    );
    assert_eq!(
        report.environment.cuda_visible_devices,
        Some(format!("5,{prefix},99,0"))
    );
}

/// Limits given to the daemon hold against a client that asks for more;
/// lower ones in the client's environment win; after `quit` the next
/// process has the whole GPU.
#[test]
fn an_mps_daemons_limits_bind_the_probe_until_it_quits() {
    let m = Machine::new();
    let uuids = h100_uuids();
    let gpu = uuids[3].as_str();
    let mut daemon = Daemon::start(
        &m,
        "limits",
        &[
            ("CUDA_VISIBLE_DEVICES", gpu),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8G"),
        ],
    );
    let pipe_dir = daemon.pipe().to_owned();
    let pipe = [("CUDA_MPS_PIPE_DIRECTORY", pipe_dir.as_str())];

    // Only the daemon's GPU, 25% of 132 SMs (rounded down to even: 32) and
    // 8 GiB: more does not fit, less does.
    let report = m.probe_ok(&["--alloc", "9Gi"], &pipe);
    assert_eq!(summary(&report), [(gpu.to_owned(), 32, Some(8 * GIB))]);
    assert_eq!(report.devices[0].memory_total_bytes, H100_BYTES);
    assert_eq!(allocations(&report), [refused(9 * GIB)]);
    let report = m.probe_ok(&["--alloc", "7Gi"], &pipe);
    assert_eq!(allocations(&report), [granted(7 * GIB)]);

    // Asking for more in the client's environment changes nothing.
    let greedy = [
        pipe[0],
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=64G"),
    ];
    let report = m.probe_ok(&["--alloc", "9Gi"], &greedy);
    assert_eq!(summary(&report), [(gpu.to_owned(), 32, Some(8 * GIB))]);
    assert_eq!(allocations(&report), [refused(9 * GIB)]);
    assert_eq!(
        report
            .environment
            .cuda_mps_active_thread_percentage
            .as_deref(),
        Some("100"),
        "the probe shows what it asked for"
    );

    // Asking for less gets less.
    let modest = [
        pipe[0],
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2G"),
    ];
    let report = m.probe_ok(&["--alloc", "3Gi"], &modest);
    assert_eq!(summary(&report), [(gpu.to_owned(), 12, Some(2 * GIB))]);
    assert_eq!(allocations(&report), [refused(3 * GIB)]);

    // A GPU the daemon does not serve is no device for its clients.
    let (out, report) = m.probe(&[], &[pipe[0], ("CUDA_VISIBLE_DEVICES", &uuids[0])]);
    assert!(!out.status.success());
    assert_eq!(
        report.error.as_deref(),
        Some("cuInit: CUDA_ERROR_NO_DEVICE")
    );

    daemon.quit();
    let report = m.probe_ok(&["--alloc", "9Gi"], &greedy);
    assert_eq!(report.devices.len(), 8, "outside MPS again: every GPU");
    assert_eq!(
        summary(&report)[3],
        (gpu.to_owned(), H100_SMS, Some(H100_BYTES))
    );
    assert_eq!(allocations(&report)[3], granted(9 * GIB));
}

/// Defaults set through the control commands, as a supervisor sets them
/// after start, bind clients the same way.
#[test]
fn limits_set_through_the_control_commands_bind_the_probe() {
    let m = Machine::new();
    let uuids = h100_uuids();
    let gpu = uuids[6].as_str();
    let mut daemon = Daemon::start(&m, "commands", &[("CUDA_VISIBLE_DEVICES", gpu)]);
    assert_eq!(
        daemon.control(
            "set_default_active_thread_percentage 30\nset_default_device_pinned_mem_limit 0 4096M\n"
        ),
        "30.0\n"
    );
    assert_eq!(
        daemon.control("get_default_device_pinned_mem_limit 0\n"),
        "4096M\n"
    );
    let pipe = [
        ("CUDA_MPS_PIPE_DIRECTORY", daemon.pipe()),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
    ];
    let report = m.probe_ok(&["--alloc", "4Gi"], &pipe);
    assert_eq!(summary(&report), [(gpu.to_owned(), 38, Some(4 * GIB))]);
    assert_eq!(allocations(&report), [granted(4 * GIB)]);
    let report = m.probe_ok(&["--alloc", "4097Mi"], &pipe);
    assert_eq!(allocations(&report), [refused(4097 * MIB)]);
    daemon.quit();
}

#[test]
fn failures_are_a_report_with_an_error_and_exit_1() {
    let m = Machine::new();
    let (out, report) = m.probe(&["--library", "/nonexistent/libcuda.so.1"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let error = report.error.unwrap();
    assert!(
        error.starts_with("loading /nonexistent/libcuda.so.1: "),
        "{error}"
    );
    assert_eq!(report.cuda_driver_version, None);

    let (out, report) = m.probe(&[], &[("CUDA_VISIBLE_DEVICES", "")]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        report.error.as_deref(),
        Some("cuInit: CUDA_ERROR_NO_DEVICE")
    );
    assert_eq!(report.cuda_driver_version, Some(12080));
    assert!(report.devices.is_empty());
    assert_eq!(report.environment.cuda_visible_devices.as_deref(), Some(""));

    let bad = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["probe", "--alloc", "8GB"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "a bad --alloc is a usage error");
}

/// In a container the process sees only the GPUs whose device nodes it has
/// (the fake NVML's `TESSERA_FAKE_NVML_DEV_ROOT`), and so does CUDA.
#[test]
fn a_container_gets_only_the_gpus_of_its_device_nodes() {
    let m = Machine::new();
    let uuids = h100_uuids();
    let dev = m.dir.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    let made = [(2, 195, 2), (6, 195, 6)].iter().all(|(n, major, minor)| {
        tessera_fake_nvml::caps::mknod_char(&dev.join(format!("nvidia{n}")), *major, *minor)
            .map_err(|e| println!("*** SKIPPED container probe test: mknod: {e}"))
            .is_ok()
    });
    if !made {
        return;
    }
    let dev_root = [("TESSERA_FAKE_NVML_DEV_ROOT", dev.to_str().unwrap())];
    let report = m.probe_ok(&[], &dev_root);
    assert_eq!(
        summary(&report),
        [
            (uuids[2].clone(), H100_SMS, Some(H100_BYTES)),
            (uuids[6].clone(), H100_SMS, Some(H100_BYTES)),
        ]
    );
    // Indices count what the container sees.
    let report = m.probe_ok(&[], &[dev_root[0], ("CUDA_VISIBLE_DEVICES", "1")]);
    assert_eq!(summary(&report)[0].0, uuids[6]);
}

/// `--cdi-device`: the probe makes itself the container a CDI device
/// describes: only that device's GPU, its MPS daemon reached through the
/// spec's environment (limits bound) and the daemon's shared memory at
/// `/dev/shm` (mounted into the probe's fresh `/dev`), and the spec's
/// `libcuda.so.1`.
#[test]
fn cdi_device_probes_as_that_devices_container() {
    // SAFETY: a plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        println!("*** SKIPPED cdi-device probe test: a mount namespace needs root");
        return;
    }
    let m = Machine::new();
    let uuids = h100_uuids();
    let host_dev = m.dir.path().join("driver/dev");
    std::fs::create_dir_all(&host_dev).unwrap();
    if let Err(e) = tessera_fake_nvml::caps::mknod_char(&host_dev.join("nvidia3"), 195, 3) {
        println!("*** SKIPPED cdi-device probe test: mknod: {e}");
        return;
    }
    let daemon = Daemon::start(
        &m,
        "claim",
        &[
            ("CUDA_VISIBLE_DEVICES", uuids[3].as_str()),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4G"),
        ],
    );
    // The daemon's shared memory is the host's /dev/shm (it has no
    // private one here); a client without it there cannot connect.
    let shm = "/dev/shm";
    let cdi = m.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let (driver_root, libcuda) = driver_root_with_libcuda(&m);
    let spec = serde_json::json!({
        "cdiVersion": "0.5.0",
        "kind": "gpu.tessera.dev/claim",
        "devices": [{ "name": "c-0", "containerEdits": {
            "env": [format!("CUDA_MPS_PIPE_DIRECTORY={}", daemon.pipe()), "TESSERA_FAKE_NVML_DEV_ROOT=/dev"],
            "deviceNodes": [{ "path": "/dev/nvidia3", "hostPath": host_dev.join("nvidia3") }],
            "mounts": [
                { "hostPath": shm, "containerPath": "/dev/shm", "options": ["rbind", "rw"] },
                { "hostPath": libcuda,
                  "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "options": ["ro", "bind"] },
            ],
        }}],
    });
    std::fs::write(cdi.join("gpu.tessera.dev-claim_c.json"), spec.to_string()).unwrap();
    let cdi_args = [
        "--cdi-dir",
        cdi.to_str().unwrap(),
        "--cdi-device",
        "gpu.tessera.dev/claim=c-0",
        "--driver-root",
        driver_root.to_str().unwrap(),
    ];
    let mut args = cdi_args.to_vec();
    args.extend(["--alloc", "6Gi"]);
    // No LD_LIBRARY_PATH: the library is the one the spec mounts.
    let report = m.probe_ok(&args, &[("LD_LIBRARY_PATH", "/nonexistent")]);
    assert_eq!(report.library, libcuda.to_str().unwrap());
    assert_eq!(
        summary(&report),
        [(uuids[3].clone(), 32, Some(4 * GIB))],
        "the device's GPU alone, under its daemon's limits"
    );
    assert_eq!(allocations(&report), [refused(6 * GIB)]);
    let container = report.container.expect("the report says what it applied");
    assert_eq!(container.cdi_device, "gpu.tessera.dev/claim=c-0");
    assert_eq!(container.device_nodes, ["/dev/nvidia3"]);
    assert_eq!(container.mounts, ["/dev/shm"]);
    assert_eq!(
        container.from_host,
        ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]
    );
    assert_eq!(
        container.env,
        ["CUDA_MPS_PIPE_DIRECTORY", "TESSERA_FAKE_NVML_DEV_ROOT"]
    );
    // Without the device, the same process sees no GPU at all in /dev.
    let (_, bare) = m.probe(&[], &[("TESSERA_FAKE_NVML_DEV_ROOT", "/nonexistent-dev")]);
    assert!(bare.devices.is_empty(), "{bare:#?}");

    // The GPU's own node withheld: the container keeps the rest of the
    // edits, and the simulated driver (which reads /dev) gives no GPU.
    let mut withheld = cdi_args.to_vec();
    withheld.push("--withhold-gpu-nodes");
    let (_, without) = m.probe(&withheld, &[]);
    let container = without.container.as_ref().expect("what it applied");
    assert!(container.device_nodes.is_empty(), "{container:?}");
    assert_eq!(container.mounts, ["/dev/shm"]);
    assert!(without.devices.is_empty(), "{without:#?}");

    // With a Pod's hosts file bound as the kubelet binds it, the node's
    // attribution (metrics, claim guard) maps the probe to that Pod.
    let pod = "0f3c8b7e-5d2a-4c61-9e8f-7a6b5c4d3e21";
    let hosts = m
        .dir
        .path()
        .join("kubelet/pods")
        .join(pod)
        .join("etc-hosts");
    std::fs::create_dir_all(hosts.parent().unwrap()).unwrap();
    std::fs::write(&hosts, "127.0.0.1 localhost\n").unwrap();
    let mut held = cdi_args.to_vec();
    held.extend(["--pod-hosts-file", hosts.to_str().unwrap()]);
    held.extend(["--alloc", "1Gi", "--busy", "60"]);
    let mut child = m
        .probe_command(&held, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut seen = None;
    wait_until("the probe runs as the Pod's process", || {
        seen = tessera_driver::metrics::claims::pod_of(Path::new("/proc"), pid);
        seen.is_some() || child.try_wait().unwrap().is_some()
    });
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(seen.as_deref(), Some(pod), "the probe ended unattributed");
}

/// A driver root under `m` whose `libcuda.so.1` is the simulated one, as
/// the node process mounts it: (the root, the library's real path).
fn driver_root_with_libcuda(m: &Machine) -> (PathBuf, PathBuf) {
    let root = m.dir.path().join("driver-root");
    let real = std::fs::canonicalize(fake_cuda_dir().join("libcuda.so.1")).unwrap();
    DriverRootBuilder::new()
        .file(&real, LIBCUDA)
        .build(&root)
        .unwrap();
    (root, real)
}

/// `tessera probe --cdi-device c-0` with `edits` as the device's edits,
/// given at most `WAIT` (a probe that blocks is killed and fails the test).
fn probe_edits(m: &Machine, edits: serde_json::Value) -> Output {
    const WAIT: Duration = Duration::from_secs(20);
    let cdi = m.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let spec = serde_json::json!({
        "cdiVersion": "0.5.0",
        "kind": "gpu.tessera.dev/claim",
        "devices": [{ "name": "c-0", "containerEdits": edits }],
    });
    std::fs::write(cdi.join("gpu.tessera.dev-claim_c.json"), spec.to_string()).unwrap();
    let mut child = clean(Command::new(env!("CARGO_BIN_EXE_tessera")))
        .args([
            "probe",
            "--cdi-device",
            "gpu.tessera.dev/claim=c-0",
            "--cdi-dir",
        ])
        .arg(&cdi)
        .env("LD_LIBRARY_PATH", fake_cuda_dir())
        .env(TOPOLOGY_ENV, &m.topology)
        .env(STATE_ENV, &m.state)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running tessera probe");
    let deadline = Instant::now() + WAIT;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("tessera probe --cdi-device still runs after {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn refused_with(out: &Output, words: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the probe ran: {stderr}");
    assert!(stderr.contains(words), "want {words:?} in:\n{stderr}");
}

fn needs_root(test: &str) -> bool {
    // SAFETY: a plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        println!("*** SKIPPED {test}: a mount namespace needs root");
    }
    root
}

/// A spec cannot make the probe change the host: no file truncated
/// through `/dev/..`, nothing made inside a host directory an earlier
/// edit bound under `/dev`, no node made outside `/dev`.
#[test]
fn cdi_device_makes_nothing_outside_its_own_dev() {
    if !needs_root("cdi-device confinement test") {
        return;
    }
    let m = Machine::new();
    let victim = m.dir.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let source = m.dir.path().join("source");
    std::fs::write(&source, "").unwrap();
    let through_dotdot = format!("/dev/..{}", victim.display());
    let out = probe_edits(
        &m,
        serde_json::json!({ "mounts": [
            { "hostPath": source, "containerPath": through_dotdot, "options": ["bind"] },
        ]}),
    );
    refused_with(&out, "is not a plain absolute path");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");

    // /dev/shm binds a host directory; a target below it would be made there.
    let host_dir = m.dir.path().join("host-shm");
    std::fs::create_dir(&host_dir).unwrap();
    let out = probe_edits(
        &m,
        serde_json::json!({ "mounts": [
            { "hostPath": host_dir, "containerPath": "/dev/shm", "options": ["rbind"] },
            { "hostPath": source, "containerPath": "/dev/shm/sub/file", "options": ["bind"] },
        ]}),
    );
    refused_with(
        &out,
        "shm is an earlier edit's mount, not the probe's own /dev",
    );
    assert_eq!(
        std::fs::read_dir(&host_dir).unwrap().count(),
        0,
        "made in the host directory"
    );

    let outside = m.dir.path().join("node");
    let out = probe_edits(
        &m,
        serde_json::json!({ "deviceNodes": [{ "path": outside, "hostPath": "/dev/null" }] }),
    );
    refused_with(&out, "is not a plain path under /dev");
    assert!(!outside.exists(), "a node was made outside /dev");
}

/// Host paths are not followed through a final symlink nor opened: a FIFO
/// as a mount source or node is refused at once (opening one would block),
/// a symlink to a device is not taken for the device.
#[test]
fn cdi_device_sources_are_checked_without_following_or_opening_them() {
    if !needs_root("cdi-device source test") {
        return;
    }
    let m = Machine::new();
    let fifo = m.dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let out = probe_edits(
        &m,
        serde_json::json!({ "mounts": [
            { "hostPath": fifo, "containerPath": "/dev/shm", "options": ["bind"] },
        ]}),
    );
    refused_with(&out, "is a FIFO; a mount under /dev binds");
    let out = probe_edits(
        &m,
        serde_json::json!({ "deviceNodes": [{ "path": "/dev/nvidia0", "hostPath": fifo }] }),
    );
    refused_with(&out, "is a FIFO, not a character device");

    let link = m.dir.path().join("null-link");
    std::os::unix::fs::symlink("/dev/null", &link).unwrap();
    let out = probe_edits(
        &m,
        serde_json::json!({ "deviceNodes": [{ "path": "/dev/nvidia0", "hostPath": link }] }),
    );
    refused_with(&out, "is a symlink, not a character device");
}

/// The spec's `libcuda.so.1` is loaded only when it is the driver root's.
#[test]
fn cdi_device_loads_libcuda_only_from_the_driver_root() {
    if !needs_root("cdi-device library test") {
        return;
    }
    let m = Machine::new();
    let real = std::fs::canonicalize(fake_cuda_dir().join("libcuda.so.1")).unwrap();
    // The default driver root (/) has no such library.
    let out = probe_edits(
        &m,
        serde_json::json!({ "mounts": [
            { "hostPath": real, "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
              "options": ["ro", "bind"] },
        ]}),
    );
    refused_with(
        &out,
        "which is not the driver's library below --driver-root /",
    );
}

/// MIG devices are CUDA devices of their own: the probe prints their MIG
/// UUID beside their GPU's, the GPU instance's SMs and memory.
#[test]
fn mig_devices_are_devices_with_their_own_uuid() {
    let m = Machine::of("h100x8-mig.yaml");
    // The whole GPU as one 7g.80gb, and a 1g.10gb of the first GPU.
    let report = m.probe_ok(
        &["--alloc", "10Gi"],
        &[(
            "CUDA_VISIBLE_DEVICES",
            "MIG-10d71306-14d1-45dc-8a44-75400dc0c3b5,MIG-4ed9be02",
        )],
    );
    let got: Vec<_> = report
        .devices
        .iter()
        .map(|d| {
            (
                d.uuid.as_str(),
                d.gpu_uuid.as_str(),
                d.name.as_str(),
                d.multiprocessors,
                d.memory_total_bytes,
                d.allocation.as_ref().map(|a| a.ok),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                "MIG-10d71306-14d1-45dc-8a44-75400dc0c3b5",
                "GPU-3f2b46cc-1275-4ed1-bb07-2ee419bfd46c",
                "NVIDIA H100 80GB HBM3 MIG 7g.80gb",
                132,
                81152 * MIB,
                Some(true),
            ),
            (
                "MIG-4ed9be02-ad66-4e46-883e-9be7143d655b",
                "GPU-f5d76e8b-97cf-4197-87a8-b1330122d060",
                "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                16,
                9984 * MIB,
                Some(false),
            ),
        ]
    );
}

/// The fake `libcuda.so.1` exports CUDA's functions and not the fake NVML
/// it links in, so it can never stand in for `libnvidia-ml.so.1`.
#[test]
fn the_fake_libcuda_exports_only_the_driver_api() {
    let path = fake_cuda_dir().join("libcuda.so.1");
    // SAFETY: the simulated library; its initializers do nothing.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    for symbol in [
        "cuInit",
        "cuDeviceGetCount",
        "cuDeviceGetUuid_v2",
        "cuMemAlloc_v2",
        "cuModuleLoadData",
        "cuLaunchKernel",
        "cuCtxSynchronize",
        "cuGetErrorName",
    ] {
        // SAFETY: only looked up, never called.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) };
        assert!(found.is_ok(), "{symbol} is not exported");
    }
    for symbol in [
        "nvmlInit_v2",
        "nvmlDeviceGetCount_v2",
        "tesseraFakeDeviceGetTimeslice",
    ] {
        // SAFETY: only looked up, never called.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) };
        assert!(found.is_err(), "{symbol} is exported");
    }
}

#[test]
fn busy_runs_kernels_on_every_device_holding_the_memory_until_it_ends() {
    let m = Machine::of("l4x2.yaml");
    let report = m.probe_ok(
        &["--alloc", "64Mi", "--busy", "1"],
        &[("TESSERA_FAKE_NVML_LOAD", "1")],
    );
    assert_eq!(report.devices.len(), 2);
    for d in &report.devices {
        assert!(d.kernels.is_some_and(|k| k > 0), "no kernels ran: {d:?}");
    }
}

// ------------------------------------------------- claims and MPS servers

/// One 2 GiB GPU: a handful of Isolated claims fill it.
const SMALL_GPU: &str = "\
driverVersion: \"535.183.01\"
cudaDriverVersion: \"12.2\"
gpus:
  - model:
      name: Small GPU
      brand: nvidia
      architecture: turing
      computeCapability: \"7.5\"
      pciDeviceId: 0x1EB810DE
      pciSubSystemId: 0x12A210DE
      memoryMiB: 2048
      multiprocessors: 40
      cudaCores: 2560
    uuid: GPU-5e1a11a0-0000-4000-8000-000000002048
    pciBusId: \"00000000:00:04.0\"
";
const SMALL_GPU_UUID: &str = "GPU-5e1a11a0-0000-4000-8000-000000002048";
const SHARE_STEP: u64 = 256 * MIB;

/// The `memory` the node publishes on the Isolated share of `topology`
/// (`tessera slices`, the node's publish path) under `policy`.
fn isolated_capacity(topology: &Path, policy: &str) -> u64 {
    let file = write_topology("isolated-capacity-policy.yaml", policy);
    let out = tessera(
        topology,
        &["slices", "--node-name", "node-a", "-o", "json", "--policy"]
            .into_iter()
            .chain([file.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let device = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .find(|d| d["name"] == "gpu-0-isolated")
        .expect("an Isolated share is published")
        .clone();
    let value = device["capacity"]["memory"]["value"].as_str().unwrap();
    let quantity = k8s_openapi::apimachinery::pkg::api::resource::Quantity(value.to_owned());
    tessera_controller::model::quantity::parse_integer(&quantity).expect("memory in bytes")
}

/// Runs `claims` Isolated claims of one memory step each the way prepare
/// serves them (a daemon of its own per claim, its limit the claim's
/// memory), one client per claim allocating all of it and holding it. Each
/// client starts after the one before holds its memory or gave up. Returns
/// whether each client got its memory, and the daemons and clients, still
/// running.
fn fill(m: &Machine, claims: u64) -> (Vec<bool>, Vec<Daemon>, Vec<Child>) {
    let limit = format!("0={}M", SHARE_STEP / MIB);
    let alloc = format!("{}", SHARE_STEP);
    let (mut got, mut daemons, mut clients) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..claims {
        let daemon = Daemon::start(
            m,
            &format!("claim-{i}"),
            &[
                ("CUDA_VISIBLE_DEVICES", SMALL_GPU_UUID),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", &limit),
                ("TESSERA_FAKE_NVML_LOAD", "1"),
            ],
        );
        let mut client = m
            .probe_command(
                &["--alloc", &alloc, "--busy", "120"],
                &[
                    ("CUDA_MPS_PIPE_DIRECTORY", daemon.pipe()),
                    ("TESSERA_FAKE_NVML_LOAD", "1"),
                ],
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting tessera probe");
        let pid = client.id();
        let mut memory = None;
        wait_until("the client holds its memory or gives up", || {
            let exited = client.try_wait().unwrap().is_some();
            memory = held_by(pid).filter(|(_, busy)| *busy).map(|(m, _)| m);
            memory.is_some() || exited
        });
        got.push(memory == Some(SHARE_STEP));
        daemons.push(daemon);
        clients.push(client);
    }
    (got, daemons, clients)
}

/// What process `pid` holds on the small GPU, and whether its kernels run
/// (it reached `--busy`, holding its memory), by the fake NVML's records.
fn held_by(pid: u32) -> Option<(u64, bool)> {
    let live = tessera_fake_nvml::load::live();
    let record = &live.iter().find(|l| l.pid == pid)?.record;
    let d = record.devices.iter().find(|d| d.uuid == SMALL_GPU_UUID)?;
    Some((d.memory_bytes, d.busy_until_ms > 0))
}

/// Memory held on the small GPU by every running process, servers included.
fn used_on_small_gpu() -> u64 {
    tessera_fake_nvml::load::live()
        .iter()
        .flat_map(|l| &l.record.devices)
        .filter(|d| d.uuid == SMALL_GPU_UUID)
        .map(|d| d.memory_bytes)
        .sum()
}

fn stop(daemons: Vec<Daemon>, clients: Vec<Child>) {
    for mut c in clients {
        let _ = c.kill();
        let _ = c.wait();
    }
    drop(daemons);
}

/// Every Isolated claim the published capacity admits gets its memory with
/// its MPS server beside it: the node keeps each server's context (48 MiB
/// in the simulation, 64 reserved by default) out of what it publishes.
/// Published without the reserve (what the node did before), the claims
/// the scheduler would place do not all fit.
#[test]
fn every_isolated_claim_the_node_publishes_fits_beside_its_mps_server() {
    let m = Machine::at(write_topology("small-gpu.yaml", SMALL_GPU));
    let total = 2048 * MIB;
    let capacity = isolated_capacity(&m.topology, "");
    assert!(capacity < total, "{capacity} published of {total}");
    let claims = capacity / SHARE_STEP;
    assert!(claims >= 2, "{capacity}");
    let (got, daemons, clients) = fill(&m, claims);
    let used = used_on_small_gpu();
    stop(daemons, clients);
    assert!(
        got.iter().all(|g| *g),
        "claims without their memory: {got:?}"
    );
    assert!(used <= total, "{used} bytes used of {total}");
    assert!(
        used >= claims * SHARE_STEP,
        "the servers' contexts count: {used}"
    );

    let m = Machine::at(write_topology("small-gpu.yaml", SMALL_GPU));
    let unreserved = isolated_capacity(
        &m.topology,
        "gpus: [{select: {all: true}, mpsServerReserveMiB: 0}]",
    );
    assert_eq!(unreserved, total);
    let (got, daemons, clients) = fill(&m, unreserved / SHARE_STEP);
    stop(daemons, clients);
    assert!(
        got.iter().any(|g| !*g),
        "every claim fitted without a reserve: {got:?}"
    );
}
