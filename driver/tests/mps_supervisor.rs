//! The MPS supervisor against `fake-mps-control`, a simulated
//! `nvidia-cuda-mps-control` (daemon and client modes, pid file, control
//! endpoint, `quit`, default limits): one daemon per request of a claim and
//! device with the claim's limits as its defaults, adoption after a driver
//! restart, restart after a crash in a fresh pipe directory, the stop path's
//! guarantees, and a hostile container writing in the pipe directory it is
//! given.
//!
//! Every daemon runs as a real process; tests wait on observable state with
//! deadlines, never on fixed sleeps. Tests read the daemon's pid file to
//! find it; the driver never does.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::host::mps::{
    CONTROL, DaemonKey, HostCgroup, LAUNCH_ID_ENV, MpsConfig, MpsError, MpsSupervisor, PID_FILE,
    ProcessId, RECORD, ShmPolicy, kept_mask,
};
use tessera_driver::host::mps_client::ClientLimits;
use tessera_test_kit::artifacts::fake_mps_control;
use tessera_test_kit::wait::until as wait_until;

const GPU0: &str = "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10";
const GPU1: &str = "GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee";
const MIG0: &str = "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f";

const LIMITS: ClientLimits = ClientLimits {
    memory_bytes: 8 << 30,
    thread_percent: 25,
    shm_bytes: None,
};

fn claim(n: u8) -> ClaimUid {
    ClaimUid::parse(&format!("00000000-0000-4000-8000-0000000000{n:02x}")).unwrap()
}

/// The daemon of request `gpu` of claim `n` on `device`.
fn key(n: u8, device: &str) -> DaemonKey {
    DaemonKey {
        claim: claim(n),
        request: "gpu".into(),
        device: device.into(),
    }
}

/// A state directory whose daemons are all gone when the test ends, even if
/// it fails half way.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            dir: tempfile::Builder::new().prefix("mps").tempdir().unwrap(),
        }
    }

    fn config(&self) -> MpsConfig {
        let mut c = MpsConfig::new(Path::new("/nonexistent-driver-root"), self.dir.path());
        c.control_binary = fake_mps_control().to_owned();
        c.ready_timeout = Duration::from_secs(20);
        c.quit_timeout = Duration::from_secs(10);
        c
    }

    fn root(&self, key: &DaemonKey) -> PathBuf {
        self.dir.path().join(key.claim.as_str()).join(key.tag())
    }

    fn pipe_dir(&self, key: &DaemonKey) -> PathBuf {
        self.root(key).join("pipe")
    }

    fn log(&self, key: &DaemonKey) -> String {
        fs::read_to_string(self.root(key).join("log/control.log")).unwrap_or_default()
    }

    /// PID of the daemon the pipe directory names, if its file exists.
    fn pid_file(&self, key: &DaemonKey) -> Option<i32> {
        fs::read_to_string(self.pipe_dir(key).join(PID_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn record_path(&self, key: &DaemonKey) -> PathBuf {
        self.root(key).join(RECORD)
    }

    /// The daemon the supervisor recorded, if any.
    fn recorded_pid(&self, key: &DaemonKey) -> Option<i32> {
        let bytes = fs::read(self.record_path(key)).ok()?;
        let record: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        record["daemon"]["pid"].as_i64().map(|p| p as i32)
    }

    /// Every fake daemon still alive below the scratch dir (by the pid files
    /// and records there).
    fn daemons_left(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        let walk = |dir: &Path| fs::read_dir(dir).into_iter().flatten().flatten();
        for claim_dir in walk(self.dir.path()) {
            for tag in walk(&claim_dir.path()) {
                let root = tag.path();
                let from_file = fs::read_to_string(root.join("pipe").join(PID_FILE))
                    .ok()
                    .and_then(|p| p.trim().parse::<i32>().ok());
                let recorded = fs::read(root.join(RECORD))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|r| r["daemon"]["pid"].as_i64())
                    .map(|p| p as i32);
                pids.extend(from_file.into_iter().chain(recorded));
            }
        }
        pids.retain(|pid| {
            *pid != std::process::id() as i32
                && fs::read_to_string(format!("/proc/{pid}/comm"))
                    .unwrap_or_default()
                    .starts_with("fake-mps")
        });
        pids
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for pid in self.daemons_left() {
            // SAFETY: a daemon this test started in its own directory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // The daemons' tmpfs of a test that did not release them.
        common::detach_mounts_below(self.dir.path());
    }
}

fn alive(pid: i32) -> bool {
    ProcessId::of(pid).is_some()
}

/// Talk to a daemon the way a user would: `echo <cmd> | nvidia-cuda-mps-control`.
fn client(pipe_dir: &Path, command: &str) -> (bool, String) {
    let mut child = Command::new(fake_mps_control())
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    use std::io::Write;
    writeln!(child.stdin.take().unwrap(), "{command}").unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn kill9(pid: i32) {
    // SAFETY: a daemon this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    wait_until("the killed daemon is gone", || !alive(pid));
}

#[test]
fn every_claim_gets_its_own_daemon_with_its_limits_as_defaults() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let (k1, k2) = (key(1, GPU0), key(2, GPU0));
    let a = sup.ensure(&k1, LIMITS, Some(0)).unwrap();
    let other = ClientLimits {
        memory_bytes: 16 << 30,
        thread_percent: 50,
        shm_bytes: None,
    };
    let b = sup.ensure(&k2, other, Some(0)).unwrap();
    assert_eq!(a.pipe_dir, s.pipe_dir(&k1));
    assert_eq!(b.pipe_dir, s.pipe_dir(&k2));
    assert_ne!(a.pid, b.pid);
    assert!(alive(a.pid) && alive(b.pid));
    assert_eq!(s.pid_file(&k1), Some(a.pid));
    // Each daemon serves exactly its device, with its claim's limits as the
    // defaults every client gets.
    for (k, d, percent, limit) in [(&k1, &a, "25.0", "8192M"), (&k2, &b, "50.0", "16384M")] {
        assert!(
            s.log(k).contains(&format!("CUDA_VISIBLE_DEVICES={GPU0}")),
            "{}",
            s.log(k)
        );
        assert_eq!(
            client(&d.pipe_dir, "get_default_active_thread_percentage"),
            (true, format!("{percent}\n"))
        );
        assert_eq!(
            client(&d.pipe_dir, "get_default_device_pinned_mem_limit 0"),
            (true, format!("{limit}\n"))
        );
        // From the daemon's environment alone: no second process set them.
        assert!(!s.log(k).contains("set_default"), "{}", s.log(k));
    }
    // Idempotent per key; another request or device is another daemon.
    assert_eq!(sup.ensure(&k1, LIMITS, Some(0)).unwrap().pid, a.pid);
    assert_eq!(s.log(&k1).matches("Startup").count(), 1);
    let mut other_request = k1.clone();
    other_request.request = "second".into();
    let c = sup.ensure(&other_request, LIMITS, Some(0)).unwrap();
    let mig = sup.ensure(&key(3, MIG0), LIMITS, Some(0)).unwrap();
    assert!(alive(c.pid) && alive(mig.pid) && c.pid != a.pid);
    assert!(
        s.log(&key(3, MIG0))
            .contains(&format!("CUDA_VISIBLE_DEVICES={MIG0}"))
    );
    assert_eq!(sup.daemons().len(), 4);

    // Quitting one claim's daemon leaves the other's serving.
    assert!(client(&a.pipe_dir, "quit").0);
    wait_until("claim 1's daemon quit", || !alive(a.pid));
    assert!(alive(b.pid));
    assert!(client(&b.pipe_dir, "get_server_list").0);

    for k in [&k1, &k2, &other_request, &key(3, MIG0)] {
        sup.release(k).unwrap();
    }
    assert!(sup.daemons().is_empty());
    assert!(!alive(b.pid) && !alive(c.pid) && !alive(mig.pid));
}

/// The fake daemon's shared memory segments in `dir` (named after its PID).
fn segments(dir: &Path, pid: i32) -> Vec<String> {
    let prefix = format!("tessera-fake-mps.{pid}.");
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[test]
fn each_daemon_shares_memory_through_its_own_directory_only() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let (k1, k2) = (key(1, GPU0), key(2, GPU0));
    let a = sup.ensure(&k1, LIMITS, Some(0)).unwrap();
    let b = sup.ensure(&k2, LIMITS, Some(0)).unwrap();
    for (k, d) in [(&k1, &a), (&k2, &b)] {
        assert_eq!(d.shm_dir, s.root(k).join("shm"));
        // The daemon's /dev/shm is its directory: its segment is there, and
        // neither in the node's /dev/shm nor in the other claim's.
        assert_eq!(segments(&d.shm_dir, d.pid).len(), 1, "{d:?}");
        assert!(segments(Path::new("/dev/shm"), d.pid).is_empty());
    }
    assert!(segments(&a.shm_dir, b.pid).is_empty() && segments(&b.shm_dir, a.pid).is_empty());
    // A restarted daemon gets a fresh directory: nothing a container left.
    fs::write(a.shm_dir.join("planted"), "x").unwrap();
    kill9(a.pid);
    wait_until("claim 1's daemon died", || !alive(a.pid));
    let again = sup.ensure(&k1, LIMITS, Some(0)).unwrap();
    assert_ne!(again.pid, a.pid);
    assert!(!again.shm_dir.join("planted").exists());
    assert_eq!(segments(&again.shm_dir, again.pid).len(), 1);
    for k in [&k1, &k2] {
        sup.release(k).unwrap();
    }
    assert!(!a.shm_dir.exists() && !b.shm_dir.exists());
}

/// The cgroup paths of `pid`, one per hierarchy.
fn cgroups(pid: i32) -> Vec<String> {
    fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2).map(str::to_owned))
        .collect()
}

#[test]
fn daemons_in_a_host_cgroup_leave_the_node_process_cgroup() {
    let fs_root = Path::new("/sys/fs/cgroup");
    let writable = unsafe { libc::geteuid() } == 0
        && fs::metadata(fs_root).is_ok_and(|m| !m.permissions().readonly());
    let name = format!("tessera-test-{}", std::process::id());
    let cgroup = match HostCgroup::open(fs_root, &name) {
        Ok(c) => Arc::new(c),
        Err(e) if !writable => {
            eprintln!("SKIP: no writable cgroup filesystem here ({e})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    struct Cleanup(Vec<PathBuf>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for d in &self.0 {
                let _ = fs::remove_dir(d);
            }
        }
    }
    let _cleanup = Cleanup(cgroup.dirs().to_vec());
    cgroup.check().unwrap();
    let s = Scratch::new();
    let mut config = s.config();
    config.host_cgroup = Some(cgroup.clone());
    let sup = MpsSupervisor::new(config);
    let k = key(1, GPU0);
    let d = sup.ensure(&k, LIMITS, Some(0)).unwrap();
    // In that cgroup in every hierarchy; this process stays where it was.
    let want = format!("/{name}");
    let placed = cgroups(d.pid);
    assert!(
        !placed.is_empty() && placed.iter().all(|p| *p == want),
        "daemon {} is in {placed:?}, want {want} everywhere",
        d.pid
    );
    assert!(!cgroups(std::process::id() as i32).contains(&want));
    for dir in cgroup.dirs() {
        let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap();
        assert!(procs.lines().any(|p| p == d.pid.to_string()), "{dir:?}");
    }
    // It still serves with its limits, and stops as before.
    assert_eq!(
        client(&d.pipe_dir, "get_default_active_thread_percentage"),
        (true, "25.0\n".to_owned())
    );
    sup.release(&k).unwrap();
    assert!(!alive(d.pid));
}

#[test]
fn release_quits_the_daemon_and_removes_its_directory() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let k = key(1, GPU0);
    let pid = sup.ensure(&k, LIMITS, Some(0)).unwrap().pid;
    let log_before = s.root(&k).join("log/control.log");
    sup.release(&k).unwrap();
    assert!(!alive(pid), "release must stop the daemon");
    assert!(!s.root(&k).exists());
    assert!(!s.dir.path().join(claim(1).as_str()).exists());
    assert!(!log_before.exists());
    // Unknown keys, and device names that are not UUIDs.
    sup.release(&k).unwrap();
    sup.release(&key(9, GPU1)).unwrap();
    sup.release(&key(9, "../../etc")).unwrap();
    assert!(matches!(
        sup.ensure(&key(1, "GPU-../../x"), LIMITS, Some(0)),
        Err(MpsError::BadDevice(_))
    ));
}

/// Writes `dir/name` until the file system refuses; the bytes written and
/// the error that stopped it.
fn fill(dir: &Path, name: &str) -> (u64, std::io::Error) {
    use std::io::Write;
    let mut file = fs::File::create(dir.join(name)).unwrap();
    let chunk = vec![1u8; 64 << 10];
    let mut written = 0u64;
    loop {
        match file.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(e) => return (written, e),
        }
        assert!(written <= 1 << 30, "{} is not bounded", dir.display());
    }
}

#[test]
fn each_daemon_has_bounded_directories_of_its_own() {
    let s = Scratch::new();
    let mut config = s.config();
    config.shm = ShmPolicy {
        default_bytes: 2 << 20,
        max_bytes: 8 << 20,
        inodes: 128,
    };
    let sup = MpsSupervisor::new(config);
    let (a, b) = (key(1, GPU0), key(2, GPU0));
    let big = ClientLimits {
        shm_bytes: Some(4 << 20),
        ..LIMITS
    };
    let da = sup.ensure(&a, big, Some(0)).unwrap();
    let db = sup.ensure(&b, LIMITS, Some(0)).unwrap();
    // A tenant that fills its /dev/shm gets ENOSPC at its own size...
    let (written, err) = fill(&da.shm_dir, "fill");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!((3 << 20..=4 << 20).contains(&written), "{written} bytes");
    // ...and so does one that fills its pipe directory, or its files.
    let (_, err) = fill(&da.pipe_dir, "fill");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    // Nobody else is reached: the neighbour's daemon, its default-sized
    // /dev/shm, and the state directory the node writes records in.
    let (written, _) = fill(&db.shm_dir, "fill");
    assert!((1 << 20..=2 << 20).contains(&written), "{written} bytes");
    fs::remove_file(db.shm_dir.join("fill")).unwrap();
    fs::write(s.dir.path().join("still-writable"), vec![0u8; 8 << 20]).unwrap();
    assert_eq!(
        client(&db.pipe_dir, "get_default_active_thread_percentage"),
        (true, "25.0\n".into())
    );
    // Release takes the mounts with it.
    sup.release(&a).unwrap();
    let below = |k: &DaemonKey| {
        let root = s.root(k);
        common::mounts_below(s.dir.path())
            .into_iter()
            .filter(|m| Path::new(m).starts_with(&root))
            .count()
    };
    assert_eq!(below(&a), 0, "release left a mount");
    assert_eq!(below(&b), 2);
    assert!(!s.root(&a).exists());
}

/// A line `<name>:\t<hex>` of /proc/<pid>/status.
fn status_hex(pid: i32, name: &str) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let value = status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no {name} in the status of {pid}"))
        .trim();
    u64::from_str_radix(value, 16).unwrap_or_else(|_| value.parse().unwrap())
}

#[test]
fn a_daemon_has_only_the_capabilities_and_mounts_mps_needs() {
    let s = Scratch::new();
    // Two GPUs' nodes and the control node (plain files: only bound).
    let nodes = tempfile::tempdir().unwrap();
    fs::create_dir(nodes.path().join("dev")).unwrap();
    for name in ["nvidia0", "nvidia1", "nvidiactl"] {
        fs::write(nodes.path().join("dev").join(name), "").unwrap();
    }
    let mut config = s.config();
    config.dev_root = nodes.path().to_owned();
    let sup = MpsSupervisor::new(config);
    let (mine, other) = (key(1, GPU0), key(2, GPU0));
    let d = sup.ensure(&mine, LIMITS, Some(1)).unwrap();
    let neighbour = sup.ensure(&other, LIMITS, Some(0)).unwrap();
    // Capabilities: the kept ones, for good (bounding set), and no way
    // back through a setuid binary.
    assert_eq!(status_hex(d.pid, "CapEff"), kept_mask());
    assert_eq!(status_hex(d.pid, "CapBnd"), kept_mask());
    assert_eq!(status_hex(d.pid, "NoNewPrivs"), 1);
    // Mounts: the system's and the driver's files, its binary, /proc, the
    // device nodes, its claim's directories; nothing else.
    let binary = fs::canonicalize(fake_mps_control()).unwrap();
    let allowed = |m: &Path| {
        ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc"]
            .iter()
            .any(|d| m.starts_with(d))
            || m == Path::new("/")
            || m == Path::new("/proc")
            || m == binary
            || m == Path::new("/dev/shm")
            || m.parent() == Some(Path::new("/dev"))
            || m == d.pipe_dir
            || m == d.log_dir
    };
    let mountinfo = fs::read_to_string(format!("/proc/{}/mountinfo", d.pid)).unwrap();
    let points: Vec<&Path> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(Path::new)
        .collect();
    for point in &points {
        assert!(
            allowed(point),
            "the daemon sees {}:\n{mountinfo}",
            point.display()
        );
    }
    for must in [Path::new("/dev/shm"), &d.pipe_dir, &d.log_dir] {
        assert!(points.contains(&must), "{} is not mounted", must.display());
    }
    // Through its root: neither its record nor the neighbour's directories,
    // nor the node's state directory beyond its own two.
    let root = PathBuf::from(format!("/proc/{}/root", d.pid));
    let seen = |p: &Path| root.join(p.strip_prefix("/").unwrap()).exists();
    assert!(seen(&d.pipe_dir.join(CONTROL)));
    assert!(!seen(&s.root(&mine).join(RECORD)));
    assert!(!seen(&neighbour.pipe_dir));
    assert!(!seen(&neighbour.shm_dir));
    // Of the GPU nodes, its own GPU's only.
    assert!(seen(Path::new("/dev/nvidia1")));
    assert!(seen(Path::new("/dev/nvidiactl")));
    assert!(!seen(Path::new("/dev/nvidia0")));
    // It still serves: its limits are set and answered.
    assert_eq!(
        client(&d.pipe_dir, "get_default_active_thread_percentage"),
        (true, "25.0\n".into())
    );
}

#[test]
fn limits_a_daemon_cannot_express_fail_the_claim() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let err = sup
        .ensure(
            &key(1, GPU0),
            ClientLimits {
                memory_bytes: 1000,
                thread_percent: 10,
                shm_bytes: None,
            },
            Some(0),
        )
        .unwrap_err();
    assert!(matches!(err, MpsError::Limits { .. }), "{err}");
    assert!(err.to_string().contains("fix:"), "{err}");
    assert!(sup.daemons().is_empty());
    assert!(s.daemons_left().is_empty());
}

#[test]
fn a_restarted_driver_adopts_running_daemons() {
    let s = Scratch::new();
    let (k1, k2) = (key(1, GPU0), key(2, GPU0));
    let pids = {
        let before = MpsSupervisor::new(s.config());
        (
            before.ensure(&k1, LIMITS, Some(0)).unwrap().pid,
            before.ensure(&k2, LIMITS, Some(0)).unwrap().pid,
        )
        // The driver goes away; its daemons do not.
    };
    assert!(alive(pids.0) && alive(pids.1));

    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert_eq!(report.adopted, [k1.clone(), k2.clone()], "{report:?}");
    assert!(
        report.restarted.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );
    assert_eq!(after.ensure(&k1, LIMITS, Some(0)).unwrap().pid, pids.0);
    after.release(&k1).unwrap();
    assert!(!alive(pids.0) && alive(pids.1));
    after.release(&k2).unwrap();
    assert!(!alive(pids.1));
}

#[test]
fn a_daemon_spawned_but_not_yet_recorded_is_found_by_its_launch_id() {
    let s = Scratch::new();
    let k = key(1, GPU0);
    let pid = MpsSupervisor::new(s.config())
        .ensure(&k, LIMITS, Some(0))
        .unwrap()
        .pid;
    assert_eq!(s.recorded_pid(&k), Some(pid));
    // The crash came after the daemon was spawned and before its identity
    // was written: the record names the key, limits and launch id only.
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap();
    let prefix = format!("{LAUNCH_ID_ENV}=");
    let launch = environ
        .split(|b| *b == 0)
        .filter_map(|e| std::str::from_utf8(e).ok()?.strip_prefix(&prefix))
        .next()
        .expect("the daemon carries its launch id")
        .to_owned();
    fs::write(
        s.record_path(&k),
        serde_json::to_vec(&serde_json::json!({"key": k, "limits": LIMITS, "launch": launch}))
            .unwrap(),
    )
    .unwrap();

    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert_eq!(report.adopted, std::slice::from_ref(&k), "{report:?}");
    assert_eq!(after.ensure(&k, LIMITS, Some(0)).unwrap().pid, pid);
    assert_eq!(s.recorded_pid(&k), Some(pid));
    assert_eq!(s.log(&k).matches("Startup").count(), 1);
    after.release(&k).unwrap();
    assert!(!alive(pid));
}

#[test]
fn a_daemon_the_record_does_not_name_is_never_adopted_or_stopped() {
    let s = Scratch::new();
    let k = key(1, GPU0);
    let pid = MpsSupervisor::new(s.config())
        .ensure(&k, LIMITS, Some(0))
        .unwrap()
        .pid;
    // A live daemon answers on the pipe directory and its pid file names
    // it, but the record does not (nor does any launch id): it is not the
    // driver's to adopt or stop.
    fs::write(
        s.record_path(&k),
        serde_json::to_vec(&serde_json::json!({"key": k, "limits": LIMITS})).unwrap(),
    )
    .unwrap();
    assert_eq!(s.pid_file(&k), Some(pid));
    // Keep the foreign daemon's pipe directory where we can reach it: the
    // supervisor's restart makes a fresh one.
    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert!(
        report.adopted.is_empty() && report.stopped.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );
    assert_eq!(report.restarted, std::slice::from_ref(&k), "{report:?}");
    assert!(alive(pid), "a daemon the record does not name was stopped");
    let ours = after.ensure(&k, LIMITS, Some(0)).unwrap().pid;
    assert_ne!(ours, pid);
    after.release(&k).unwrap();
    assert!(!alive(ours));
    assert!(alive(pid));
    kill9(pid);
}

#[test]
fn a_crashed_daemon_is_restarted_in_a_fresh_pipe_directory() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let k = key(1, GPU0);
    let first = sup.ensure(&k, LIMITS, Some(0)).unwrap();
    // What a running container holds: the directory itself, not its path.
    let old_dir = fs::File::open(&first.pipe_dir).unwrap();
    fs::write(first.pipe_dir.join("left-by-a-tenant"), "x").unwrap();
    kill9(first.pid);

    let report = sup.supervise();
    assert_eq!(report.restarted, std::slice::from_ref(&k), "{report:?}");
    let second = s.pid_file(&k).unwrap();
    assert_ne!(second, first.pid);
    assert!(alive(second));
    // Nothing of the old directory is reused (a fresh tmpfs), and the
    // limits hold again.
    use std::os::unix::fs::MetadataExt;
    let (old, new) = (
        old_dir.metadata().unwrap(),
        fs::metadata(s.pipe_dir(&k)).unwrap(),
    );
    assert_ne!(
        (old.dev(), old.ino()),
        (new.dev(), new.ino()),
        "the old directory was reused"
    );
    assert!(!s.pipe_dir(&k).join("left-by-a-tenant").exists());
    assert_eq!(
        client(&s.pipe_dir(&k), "get_default_active_thread_percentage"),
        (true, "25.0\n".into())
    );
    // Nothing more to do on the next pass.
    let report = sup.supervise();
    assert!(
        report.restarted.is_empty() && report.adopted.is_empty(),
        "{report:?}"
    );
    // ensure() restarts too.
    kill9(second);
    let third = sup.ensure(&k, LIMITS, Some(0)).unwrap().pid;
    assert!(alive(third) && third != second);
    sup.release(&k).unwrap();
    assert!(!alive(third));
}

#[test]
fn the_watchdog_restarts_a_crashed_daemon_on_its_own() {
    let s = Scratch::new();
    let sup = Arc::new(MpsSupervisor::new(s.config()));
    let k = key(1, GPU0);
    let first = sup.ensure(&k, LIMITS, Some(0)).unwrap().pid;
    let (tx, rx) = std::sync::mpsc::channel();
    let watchdog = sup.spawn_watchdog(Duration::from_millis(20), move |report| {
        if !report.restarted.is_empty() {
            let _ = tx.send(report.restarted.clone());
        }
    });
    kill9(first);
    let restarted = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the watchdog did not restart the daemon");
    assert_eq!(restarted, std::slice::from_ref(&k));
    drop(watchdog);
    let second = s.pid_file(&k).unwrap();
    assert!(alive(second) && second != first);
    sup.release(&k).unwrap();
    assert!(!alive(second));
}

#[test]
fn a_daemon_that_ignores_quit_is_killed() {
    let s = Scratch::new();
    let mut config = s.config();
    config.quit_timeout = Duration::from_millis(300);
    config
        .env
        .push(("TESSERA_FAKE_MPS_IGNORE_QUIT".into(), "1".into()));
    let sup = MpsSupervisor::new(config.clone());
    let k = key(1, GPU0);
    let pid = sup.ensure(&k, LIMITS, Some(0)).unwrap().pid;
    sup.release(&k).unwrap();
    assert!(!alive(pid));

    // Adopted by a restarted driver: killed through a pidfd.
    let k2 = key(2, GPU0);
    let pid = sup.ensure(&k2, LIMITS, Some(0)).unwrap().pid;
    drop(sup);
    MpsSupervisor::new(config).release(&k2).unwrap();
    assert!(!alive(pid));
}

#[test]
fn a_daemon_that_never_gets_ready_fails_the_claim_cleanly() {
    let s = Scratch::new();
    let mut config = s.config();
    config.ready_timeout = Duration::from_millis(300);
    config
        .env
        .push(("TESSERA_FAKE_MPS_READY_DELAY_MS".into(), "60000".into()));
    let sup = MpsSupervisor::new(config);
    let k = key(1, GPU0);
    let pipe = s.pipe_dir(&k);
    let pid = Arc::new(std::sync::Mutex::new(None));
    let seen = {
        let (pipe, pid) = (pipe.clone(), pid.clone());
        std::thread::spawn(move || {
            wait_until("the daemon wrote its pid file", || {
                let p = fs::read_to_string(pipe.join(PID_FILE))
                    .ok()
                    .and_then(|p| p.trim().parse::<i32>().ok());
                *pid.lock().unwrap() = p;
                p.is_some()
            })
        })
    };
    let err = sup.ensure(&k, LIMITS, Some(0)).unwrap_err();
    seen.join().unwrap();
    assert!(matches!(err, MpsError::NotReady { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(GPU0) && msg.contains("control"), "{msg}");
    // The half-started daemon was stopped, and nothing of it is left.
    let pid = pid.lock().unwrap().unwrap();
    wait_until("the unready daemon is gone", || !alive(pid));
    assert!(sup.daemons().is_empty());
    assert!(!s.root(&k).exists());
}

#[test]
fn a_missing_control_binary_is_a_clear_error() {
    let s = Scratch::new();
    let mut config = MpsConfig::new(s.dir.path(), s.dir.path().join("state"));
    config.ready_timeout = Duration::from_secs(2);
    assert_eq!(
        config.control_binary,
        s.dir.path().join("usr/bin/nvidia-cuda-mps-control")
    );
    let sup = MpsSupervisor::new(config);
    let err = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap_err();
    assert!(matches!(err, MpsError::Launch { .. }), "{err}");
    assert!(err.to_string().contains("fix:"), "{err}");
    assert!(sup.daemons().is_empty());
}

#[test]
fn concurrent_claims_on_one_device_get_a_daemon_each() {
    let s = Scratch::new();
    let sup = Arc::new(MpsSupervisor::new(s.config()));
    let pids: Vec<i32> = (1..=6)
        .map(|n| {
            let sup = Arc::clone(&sup);
            std::thread::spawn(move || sup.ensure(&key(n, GPU0), LIMITS, Some(0)).unwrap().pid)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let distinct: std::collections::BTreeSet<_> = pids.iter().collect();
    assert_eq!(distinct.len(), 6, "{pids:?}");
    let releases: Vec<_> = (1..=6)
        .map(|n| {
            let sup = Arc::clone(&sup);
            std::thread::spawn(move || sup.release(&key(n, GPU0)).unwrap())
        })
        .collect();
    for t in releases {
        t.join().unwrap();
    }
    assert!(pids.iter().all(|p| !alive(*p)));
    assert!(sup.daemons().is_empty());
}

#[test]
fn a_state_dir_too_long_for_unix_sockets_is_refused() {
    let s = Scratch::new();
    let mut config = s.config();
    config.state_dir = s.dir.path().join("x".repeat(40));
    let err = MpsSupervisor::new(config)
        .ensure(&key(1, GPU0), LIMITS, Some(0))
        .unwrap_err();
    assert!(matches!(err, MpsError::PathTooLong { .. }), "{err}");
    assert!(err.to_string().contains("fix:"), "{err}");
}

#[test]
fn a_shared_daemon_of_an_earlier_version_is_retired() {
    let s = Scratch::new();
    // The layout an earlier version left: one daemon per device.
    let old = s.dir.path().join(GPU0);
    let pipe = old.join("pipe");
    fs::create_dir_all(&pipe).unwrap();
    let mut daemon = Command::new(fake_mps_control())
        .arg("-f")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", old.join("log"))
        .spawn()
        .unwrap();
    let id = ProcessId::of(daemon.id() as i32).unwrap();
    fs::write(
        old.join("supervisor.json"),
        serde_json::to_vec(&serde_json::json!({"claims": [claim(1)], "daemon": id})).unwrap(),
    )
    .unwrap();
    let report = MpsSupervisor::new(s.config()).supervise();
    assert!(report.failed.is_empty(), "{report:?}");
    // Stopped (and reaped through its pidfd, this test being its parent).
    wait_until("the shared daemon is gone", || !alive(id.pid));
    let _ = daemon.try_wait();
    assert!(!old.exists());
}

#[test]
fn the_prepare_trait_maps_targets_to_per_claim_daemons() {
    use tessera_api::config::Limits;
    use tessera_driver::host::port::{MpsControl, MpsTarget};

    let s = Scratch::new();
    let sharing: Arc<dyn MpsControl> = Arc::new(MpsSupervisor::new(s.config()));
    let limits = Limits {
        memory_bytes: 1 << 30,
        compute_percent: 50,
        shared_memory_bytes: None,
    };
    let whole = target(GPU0);
    let mig = MpsTarget {
        mig_uuid: Some(MIG0.into()),
        ..target(GPU0)
    };
    let a = sharing.acquire(&claim(1), &whole, &limits, 0).unwrap();
    // A client gets the pipe and shared memory directories and the limits,
    // nothing else.
    let pipe_dir = s.pipe_dir(&key(1, GPU0));
    assert_eq!(
        a,
        tessera_driver::host::port::MpsClient {
            shm_dir: pipe_dir.with_file_name("shm"),
            pipe_dir,
            limits,
        }
    );
    // A MIG device gets its own daemon, serving only that MIG device.
    let b = sharing.acquire(&claim(2), &mig, &limits, 0).unwrap();
    assert_eq!(b.pipe_dir, s.pipe_dir(&key(2, MIG0)));
    assert!(
        s.log(&key(2, MIG0))
            .contains(&format!("CUDA_VISIBLE_DEVICES={MIG0}"))
    );
    let pids = (
        s.pid_file(&key(1, GPU0)).unwrap(),
        s.pid_file(&key(2, MIG0)).unwrap(),
    );
    assert!(alive(pids.0) && alive(pids.1));

    sharing.release(&claim(1), &whole).unwrap();
    sharing.release(&claim(1), &whole).unwrap();
    assert!(!alive(pids.0) && alive(pids.1));
    sharing.release(&claim(2), &mig).unwrap();
    assert!(!alive(pids.1));
    // Errors reach prepare as text naming the device.
    let err = sharing
        .acquire(&claim(3), &target("GPU-../x"), &limits, 0)
        .unwrap_err();
    assert!(err.to_string().contains("GPU-../x"), "{err}");
}

// ---------------------------------------------------------------------------
// A hostile container.
//
// Every Isolated container gets its own claim's MPS pipe directory mounted
// read-write, and may run as root. These tests play
// such a container: it rewrites the daemon's pid file to name a process the
// driver must never touch, plants symlinks to a file the driver must never
// truncate or show, and makes the daemon quit behind the driver's back. The
// driver must keep its hands off both decoys, keep file contents out of its
// errors, and still recover.

use tessera_driver::host::port::{MpsClient, MpsControl, MpsTarget};

const SECRET: &str = "decoy-7f3a9c: the driver must never truncate, follow or show this";
const LOG_NAMES: [&str; 3] = ["launcher.log", "control.log", "server.log"];

struct Hostile {
    /// What the driver mounts into a client container (read-write).
    dirs: Vec<PathBuf>,
    /// A process the driver did not start.
    decoy: std::process::Child,
    /// A file outside every directory the driver manages.
    decoy_file: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Hostile {
    /// A container of `claim` on `device`: what it can write is exactly what
    /// the driver hands it through the prepare trait.
    fn new(sharing: &Arc<dyn MpsControl>, device: &str, claim: &ClaimUid) -> Self {
        let client = sharing
            .acquire(claim, &target(device), &share_limits(), 0)
            .unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let decoy_file = tmp.path().join("decoy");
        fs::write(&decoy_file, SECRET).unwrap();
        Hostile {
            dirs: container_dirs(&client),
            decoy: Command::new("sleep").arg("1000").spawn().unwrap(),
            decoy_file,
            _tmp: tmp,
        }
    }

    fn decoy_pid(&self) -> i32 {
        self.decoy.id() as i32
    }

    /// The pid file names the decoy, wherever the container can write it.
    fn forge_pid_file(&self) {
        for dir in &self.dirs {
            let path = dir.join(PID_FILE);
            let _ = fs::remove_file(&path);
            fs::write(&path, format!("{}\n", self.decoy_pid())).unwrap();
        }
    }

    /// `names` become symlinks to the decoy file in every writable directory.
    fn plant_symlinks(&self, names: &[&str]) {
        for dir in &self.dirs {
            for name in names {
                let path = dir.join(name);
                let _ = fs::remove_file(&path);
                std::os::unix::fs::symlink(&self.decoy_file, &path).unwrap();
            }
        }
    }

    /// `echo quit | nvidia-cuda-mps-control`, as any client may, and wait
    /// until the daemon is gone.
    fn quit_daemon(&self, pipe_dir: &Path, pid: i32) {
        assert!(client(pipe_dir, "quit").0, "the daemon did not take quit");
        wait_until("the daemon quit", || !alive(pid));
    }

    /// Neither decoy was touched and no error shows the decoy's content.
    fn assert_unharmed(&mut self, errors: &[String]) {
        // A decoy reaped by the driver is an error here (no child).
        assert!(
            matches!(self.decoy.try_wait(), Ok(None)) && alive(self.decoy_pid()),
            "the driver killed a process it did not start (the decoy named by the pid file)"
        );
        assert_eq!(
            fs::read_to_string(&self.decoy_file).unwrap(),
            SECRET,
            "the driver wrote through a symlink planted by a container"
        );
        for e in errors {
            assert!(
                !e.contains("decoy-7f3a9c"),
                "an error leaks a file's content: {e}"
            );
        }
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.decoy.kill();
        let _ = self.decoy.wait();
    }
}

fn target(device: &str) -> MpsTarget {
    MpsTarget {
        request: "gpu".into(),
        gpu_uuid: device.into(),
        mig_uuid: None,
    }
}

fn share_limits() -> tessera_api::config::Limits {
    tessera_api::config::Limits {
        memory_bytes: LIMITS.memory_bytes,
        compute_percent: LIMITS.thread_percent,
        shared_memory_bytes: None,
    }
}

fn container_dirs(client: &MpsClient) -> Vec<PathBuf> {
    vec![client.pipe_dir.clone(), client.shm_dir.clone()]
}

fn errors(report: &tessera_driver::host::mps::SupervisionReport) -> Vec<String> {
    report.failed.iter().map(|(_, e)| e.to_string()).collect()
}

/// A sharing stack as the plugin wires it, with a short readiness timeout.
fn hostile_setup(s: &Scratch) -> (Arc<MpsSupervisor>, Arc<dyn MpsControl>) {
    let mut config = s.config();
    config.ready_timeout = Duration::from_secs(3);
    let sup = Arc::new(MpsSupervisor::new(config));
    (sup.clone(), sup as Arc<dyn MpsControl>)
}

/// Our daemon, not the decoy: a live fake-mps-control answering on the pipe.
fn assert_serving(s: &Scratch, k: &DaemonKey, pid: i32, decoy: i32) {
    assert_ne!(pid, decoy);
    assert!(alive(pid));
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert!(comm.starts_with("fake-mps"), "pid {pid} is {comm:?}");
    assert!(client(&s.pipe_dir(k), "get_server_list").0);
}

#[test]
fn a_hostile_container_cannot_steer_a_restart() {
    let s = Scratch::new();
    let (sup, sharing) = hostile_setup(&s);
    let mut h = Hostile::new(&sharing, GPU0, &claim(1));
    let first = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;

    h.plant_symlinks(&LOG_NAMES);
    h.quit_daemon(&s.pipe_dir(&key(1, GPU0)), first);
    h.forge_pid_file();

    // The watchdog's pass finds the daemon gone and starts a fresh one.
    let report = sup.supervise();
    h.assert_unharmed(&errors(&report));
    assert_eq!(report.restarted, [key(1, GPU0)], "{report:?}");
    let second = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;
    assert_ne!(second, first);
    assert_serving(&s, &key(1, GPU0), second, h.decoy_pid());

    sup.release(&key(1, GPU0)).unwrap();
    assert!(!alive(second));
    h.assert_unharmed(&[]);
}

#[test]
fn a_hostile_container_cannot_steer_a_stop() {
    let s = Scratch::new();
    let (sup, sharing) = hostile_setup(&s);
    let mut h = Hostile::new(&sharing, GPU0, &claim(1));

    // The pid file names the decoy while our daemon runs: the last release
    // stops our daemon, and only it.
    let first = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;
    h.forge_pid_file();
    h.plant_symlinks(&LOG_NAMES);
    let result = sup.release(&key(1, GPU0));
    h.assert_unharmed(&[result
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default()]);
    result.unwrap();
    assert!(!alive(first), "the last release left the daemon running");

    // The daemon quit behind the driver's back, the pid file names the
    // decoy and the control endpoint is a symlink to the decoy file.
    let second = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;
    assert_serving(&s, &key(1, GPU0), second, h.decoy_pid());
    h.quit_daemon(&s.pipe_dir(&key(1, GPU0)), second);
    h.forge_pid_file();
    h.plant_symlinks(&[CONTROL]);
    h.plant_symlinks(&LOG_NAMES);
    let result = sup.release(&key(1, GPU0));
    h.assert_unharmed(&[result
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default()]);
    result.unwrap();
    assert!(sup.daemons().is_empty());
    assert!(!s.pipe_dir(&key(1, GPU0)).exists());
}

#[test]
fn a_hostile_container_cannot_steer_a_restarted_driver() {
    let s = Scratch::new();
    let (sup, sharing) = hostile_setup(&s);
    let mut h = Hostile::new(&sharing, GPU0, &claim(1));
    let first = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;
    // The driver goes away; while it is gone the container strikes.
    drop((sup, sharing));
    h.plant_symlinks(&LOG_NAMES);
    h.quit_daemon(&s.pipe_dir(&key(1, GPU0)), first);
    h.forge_pid_file();

    let (after, _sharing) = hostile_setup(&s);
    let report = after.supervise();
    h.assert_unharmed(&errors(&report));
    assert_eq!(report.restarted, [key(1, GPU0)], "{report:?}");
    let second = after.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;
    assert_serving(&s, &key(1, GPU0), second, h.decoy_pid());

    // The checkpoint no longer knows the claim: the daemon is stopped.
    h.forge_pid_file();
    let report = after.retain_claims(|_| false);
    h.assert_unharmed(&errors(&report));
    assert_eq!(report.stopped, [key(1, GPU0)], "{report:?}");
    assert!(!alive(second));
    h.assert_unharmed(&[]);
}

#[test]
fn a_daemon_that_listens_after_its_endpoint_appears_still_gets_its_limits() {
    let s = Scratch::new();
    let mut config = s.config();
    // `control` exists 300 ms before the daemon accepts on it: the first
    // connections are refused.
    config
        .env
        .push(("TESSERA_FAKE_MPS_LISTEN_DELAY_MS".into(), "300".into()));
    let sup = MpsSupervisor::new(config);
    let k = key(1, GPU0);
    let d = sup.ensure(&k, LIMITS, Some(0)).unwrap();
    assert!(alive(d.pid));
    assert_eq!(
        client(&d.pipe_dir, "get_default_active_thread_percentage"),
        (true, "25.0\n".to_owned())
    );
    assert_eq!(
        client(&d.pipe_dir, "get_default_device_pinned_mem_limit 0"),
        (true, "8192M\n".to_owned())
    );
}

#[test]
fn confirm_defaults_also_sets_the_limits_through_the_endpoint() {
    let s = Scratch::new();
    let mut config = s.config();
    config.confirm_defaults = true;
    config
        .env
        .push(("TESSERA_FAKE_MPS_LISTEN_DELAY_MS".into(), "200".into()));
    let sup = MpsSupervisor::new(config);
    let k = key(1, GPU0);
    let d = sup.ensure(&k, LIMITS, Some(0)).unwrap();
    let log = s.log(&k);
    assert!(
        log.contains("Command: set_default_active_thread_percentage 25")
            && log.contains("Command: set_default_device_pinned_mem_limit 0 8192M"),
        "{log}"
    );
    assert_eq!(
        client(&d.pipe_dir, "get_default_device_pinned_mem_limit 0"),
        (true, "8192M\n".to_owned())
    );
    sup.release(&k).unwrap();
}

#[test]
fn a_daemon_that_exits_at_start_is_reported_at_once_not_at_the_deadline() {
    let s = Scratch::new();
    let mut config = s.config();
    // A control binary that exits at once, before any endpoint exists.
    config.control_binary = which("false");
    config.ready_timeout = Duration::from_secs(30);
    let sup = MpsSupervisor::new(config);
    let began = Instant::now();
    let err = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap_err();
    assert!(matches!(err, MpsError::LaunchFailed { .. }), "{err}");
    // Its exit woke the wait (the deadline is 30 s away).
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "{:?}",
        began.elapsed()
    );
    assert!(sup.daemons().is_empty());
}

/// A command's path from `PATH`.
fn which(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not on PATH"))
}

#[test]
fn a_record_torn_before_this_boot_is_replaced_and_one_torn_now_is_not() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let (k, lost) = (key(1, GPU0), key(2, GPU0));
    let torn = |k: &DaemonKey| {
        let root = s.root(k);
        fs::create_dir_all(root.join("pipe")).unwrap();
        let record = root.join("daemon.json");
        fs::write(&record, b"{\"key\":{\"cla").unwrap();
        record
    };
    let before_boot = |record: &Path| {
        let file = fs::File::options().write(true).open(record).unwrap();
        file.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1))
            .unwrap();
    };
    // Torn in this boot: not guessed at.
    let record = torn(&k);
    let err = sup.ensure(&k, LIMITS, Some(0)).unwrap_err();
    assert!(err.to_string().contains("record"), "{err}");
    // Written before this boot (a power loss tore it): what it named ended
    // with that boot, so a new daemon replaces it ...
    before_boot(&record);
    let d = sup.ensure(&k, LIMITS, Some(0)).unwrap();
    assert!(alive(d.pid));
    // ... and the directory of one no claim holds any more goes.
    before_boot(&torn(&lost));
    sup.retain_claims(|c| *c == k.claim);
    assert!(!s.root(&lost).exists());
    assert!(alive(d.pid));
    sup.release(&k).unwrap();
}

#[test]
fn a_symlink_in_place_of_the_control_endpoint_is_not_readiness() {
    let s = Scratch::new();
    let mut config = s.config();
    // The daemon writes its pid file, then takes a while to bind `control`.
    config
        .env
        .push(("TESSERA_FAKE_MPS_READY_DELAY_MS".into(), "1000".into()));
    let (sup, sharing) = {
        let sup = Arc::new(MpsSupervisor::new(config));
        (sup.clone(), sup as Arc<dyn MpsControl>)
    };
    let mut h = Hostile::new(&sharing, GPU0, &claim(1));
    let first = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;
    h.quit_daemon(&s.pipe_dir(&key(1, GPU0)), first);

    // While the next daemon is starting, a symlink to an existing file
    // stands where its endpoint will be.
    let planter = {
        let pipe = s.pipe_dir(&key(1, GPU0));
        let decoy_file = h.decoy_file.clone();
        std::thread::spawn(move || {
            wait_until("the restarted daemon wrote its pid file", || {
                pipe.join(PID_FILE).exists()
            });
            std::os::unix::fs::symlink(&decoy_file, pipe.join(CONTROL)).unwrap();
        })
    };
    let result = sup.ensure(&key(1, GPU0), LIMITS, Some(0));
    planter.join().unwrap();
    match &result {
        // Ready means the daemon's own socket, not the symlink.
        Ok(_) => {
            let endpoint = s
                .pipe_dir(&key(1, GPU0))
                .join(CONTROL)
                .symlink_metadata()
                .unwrap();
            assert!(
                std::os::unix::fs::FileTypeExt::is_socket(&endpoint.file_type()),
                "ready with {endpoint:?} as the endpoint"
            );
        }
        // The fake cannot bind where the symlink stands: the start fails,
        // naming where the daemon's output is, not showing it.
        Err(e) => {
            assert!(matches!(e, MpsError::LaunchFailed { .. }), "{e}");
            h.assert_unharmed(&[e.to_string()]);
            assert!(e.to_string().contains("launcher.log"), "{e}");
            // Nothing of the failed start is left to supervise; the next
            // prepare starts a daemon in a fresh directory.
            let report = sup.supervise();
            h.assert_unharmed(&errors(&report));
            assert!(report.restarted.is_empty(), "{report:?}");
        }
    }
    let second = sup.ensure(&key(1, GPU0), LIMITS, Some(0)).unwrap().pid;
    assert_serving(&s, &key(1, GPU0), second, h.decoy_pid());
    sup.release(&key(1, GPU0)).unwrap();
    assert!(!alive(second));
    h.assert_unharmed(&[]);
}

#[test]
fn a_fast_watchdog_never_revives_a_released_daemon() {
    let s = Scratch::new();
    let mut config = s.config();
    // The stop takes the quit timeout, then kills: a pass comes meanwhile.
    config.quit_timeout = Duration::from_millis(300);
    config
        .env
        .push(("TESSERA_FAKE_MPS_IGNORE_QUIT".into(), "1".into()));
    let sup = Arc::new(MpsSupervisor::new(config));
    let k = key(1, GPU0);
    let pid = sup.ensure(&k, LIMITS, Some(0)).unwrap().pid;
    let passes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let revived = Arc::new(std::sync::Mutex::new(Vec::new()));
    let watchdog = {
        let (passes, revived) = (passes.clone(), revived.clone());
        sup.spawn_watchdog(Duration::from_millis(5), move |report| {
            revived.lock().unwrap().extend(report.restarted.clone());
            passes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        })
    };
    let count = || passes.load(std::sync::atomic::Ordering::SeqCst);
    wait_until("the watchdog ran", || count() >= 2);
    sup.release(&k).unwrap();
    let released_at = count();
    wait_until("three passes after the release", || {
        count() >= released_at + 3
    });
    drop(watchdog);
    assert!(!alive(pid));
    assert_eq!(
        *revived.lock().unwrap(),
        [],
        "a released daemon was revived"
    );
    assert!(!s.root(&k).exists(), "a record outlived the release");
    assert!(s.daemons_left().is_empty());
    assert_eq!(sup.supervised(), 0);
}

#[test]
fn other_limits_replace_a_daemon_of_an_earlier_run() {
    let s = Scratch::new();
    let k = key(1, GPU0);
    let first = MpsSupervisor::new(s.config())
        .ensure(&k, LIMITS, Some(0))
        .unwrap()
        .pid;
    // The driver restarted; the claim is prepared again with other limits
    // (its earlier prepare was rolled back).
    let after = MpsSupervisor::new(s.config());
    let other = ClientLimits {
        memory_bytes: 16 << 30,
        thread_percent: 50,
        shm_bytes: None,
    };
    let d = after.ensure(&k, other, Some(0)).unwrap();
    assert_ne!(d.pid, first, "the daemon with the old limits was adopted");
    assert!(!alive(first));
    assert_eq!(
        client(&d.pipe_dir, "get_default_active_thread_percentage"),
        (true, "50.0\n".to_owned())
    );
    assert_eq!(
        client(&d.pipe_dir, "get_default_device_pinned_mem_limit 0"),
        (true, "16384M\n".to_owned())
    );
    after.release(&k).unwrap();
    assert!(!alive(d.pid));
}

/// Restarted keys as the watchdog reports them, one report at a time.
fn restarts(
    sup: &Arc<MpsSupervisor>,
    every: Duration,
) -> (
    tessera_driver::host::mps::Watchdog,
    std::sync::mpsc::Receiver<tessera_driver::host::mps::SupervisionReport>,
) {
    let (tx, rx) = std::sync::mpsc::channel();
    let watchdog = sup.spawn_watchdog(every, move |report| {
        let mine = tessera_driver::host::mps::SupervisionReport {
            adopted: report.adopted.clone(),
            restarted: report.restarted.clone(),
            stopped: report.stopped.clone(),
            failed: Vec::new(),
        };
        if !(mine.restarted.is_empty() && mine.stopped.is_empty()) {
            let _ = tx.send(mine);
        }
    });
    (watchdog, rx)
}

#[test]
fn a_daemon_that_never_gets_ready_holds_up_no_other() {
    let s = Scratch::new();
    let mut config = s.config();
    config.ready_timeout = Duration::from_secs(10);
    let sup = Arc::new(MpsSupervisor::new(config));
    let (k1, k2) = (key(1, GPU0), key(2, GPU0));
    let hung = sup.ensure(&k1, LIMITS, Some(0)).unwrap();
    let other = sup.ensure(&k2, LIMITS, Some(0)).unwrap();
    // A tenant removes its daemon's endpoint: the daemon runs on, never
    // ready, and seeing to it takes the ready timeout. Another claim's
    // daemon dies meanwhile.
    fs::remove_file(hung.pipe_dir.join(CONTROL)).unwrap();
    kill9(other.pid);
    let (watchdog, reports) = restarts(&sup, Duration::from_millis(50));
    let first = reports
        .recv_timeout(Duration::from_secs(20))
        .expect("no restart reported");
    assert_eq!(
        first.restarted,
        std::slice::from_ref(&k2),
        "claim 1's hung daemon held up claim 2's restart"
    );
    // The hung one's turn ends when it dies (or its timeout passes).
    kill9(hung.pid);
    let next = reports
        .recv_timeout(Duration::from_secs(20))
        .expect("the hung daemon was not replaced");
    assert_eq!(next.restarted, std::slice::from_ref(&k1));
    drop(watchdog);
    for k in [&k1, &k2] {
        sup.release(k).unwrap();
    }
    assert!(s.daemons_left().is_empty());
}

#[test]
fn hung_daemons_at_start_are_seen_to_together_in_the_background() {
    let s = Scratch::new();
    let keys: Vec<_> = (1..=8).map(|n| key(n, GPU0)).collect();
    let pids: Vec<i32> = {
        let before = MpsSupervisor::new(s.config());
        keys.iter()
            .map(|k| before.ensure(k, LIMITS, Some(0)).unwrap().pid)
            .collect()
    };
    // Seven daemons run on without their endpoints: each makes a
    // supervisor wait the ready timeout before replacing it. The eighth's
    // claim is no longer prepared.
    let (hung, gone) = keys.split_at(7);
    for k in hung {
        fs::remove_file(s.pipe_dir(k).join(CONTROL)).unwrap();
    }
    let ready_timeout = Duration::from_secs(4);
    let mut config = s.config();
    config.ready_timeout = ready_timeout;
    let after = Arc::new(MpsSupervisor::new(config));

    // What the node process does before it serves.
    let started = Instant::now();
    let marked = after.release_claims_unless(|c| *c != claim(8));
    let (watchdog, reports) = restarts(&after, Duration::from_secs(60));
    let serving = started.elapsed();
    assert!(marked.failed.is_empty(), "{marked:?}");
    assert!(
        serving < Duration::from_secs(1),
        "supervision held up serving for {serving:?}"
    );
    assert!(
        alive(pids[7]),
        "stopped before serving: nothing should wait"
    );

    let (mut restarted, mut stopped) = (Vec::new(), Vec::new());
    while restarted.len() < hung.len() || stopped.is_empty() {
        let report = reports
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("restarted {restarted:?}, stopped {stopped:?} so far"));
        restarted.extend(report.restarted);
        stopped.extend(report.stopped);
    }
    let took = started.elapsed();
    restarted.sort();
    assert_eq!(restarted, hung);
    assert_eq!(stopped, gone);
    assert!(
        took < 3 * ready_timeout,
        "7 hung daemons took {took:?}: one after the other, not together"
    );
    drop(watchdog);
    assert!(pids.iter().all(|p| !alive(*p)));
    for k in hung {
        after.release(k).unwrap();
    }
    assert!(s.daemons_left().is_empty());
}
