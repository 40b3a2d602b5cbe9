//! The MPS supervisor against `fake-mps-control`, a simulated
//! `nvidia-cuda-mps-control` (daemon and client modes, pid file, control
//! endpoint, `quit`): start, reuse, reference counting, adoption after a
//! driver restart, restart after a crash, and the stop path's guarantees.
//!
//! Every daemon runs as a real background process; tests wait on observable
//! state with deadlines, never on fixed sleeps.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::mps::{
    CONTROL, ClientLimits, MpsConfig, MpsError, MpsSupervisor, PID_FILE, ProcessId,
};

const GPU0: &str = "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10";
const GPU1: &str = "GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee";
const MIG0: &str = "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f";

fn claim(n: u8) -> ClaimUid {
    ClaimUid::parse(&format!("00000000-0000-4000-8000-0000000000{n:02x}")).unwrap()
}

/// The built `fake-mps-control` (cargo builds it on first use; a no-op when
/// it is fresh).
fn fake_mps_control() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let out = Command::new(env!("CARGO"))
            .args([
                "build",
                "-p",
                "tessera-fake-nvml",
                "--bin",
                "fake-mps-control",
                "--message-format=json",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(Stdio::inherit())
            .output()
            .expect("running cargo build -p tessera-fake-nvml");
        assert!(out.status.success(), "building fake-mps-control failed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| {
                m["reason"] == "compiler-artifact" && m["target"]["name"] == "fake-mps-control"
            })
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported no fake-mps-control executable")
    })
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

    fn pipe_dir(&self, uuid: &str) -> PathBuf {
        self.dir.path().join(uuid).join("pipe")
    }

    fn log(&self, uuid: &str) -> String {
        fs::read_to_string(self.dir.path().join(uuid).join("log/control.log")).unwrap_or_default()
    }

    /// PID of the daemon the pipe directory names, if its file exists.
    fn pid_file(&self, uuid: &str) -> Option<i32> {
        fs::read_to_string(self.pipe_dir(uuid).join(PID_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for uuid in [GPU0, GPU1, MIG0] {
            let Some(pid) = self.pid_file(uuid) else {
                continue;
            };
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if pid != std::process::id() as i32 && comm.starts_with("fake-mps") {
                // SAFETY: a daemon this test started in its own directory.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

fn alive(pid: i32) -> bool {
    ProcessId::of(pid).is_some()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
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
fn starts_one_daemon_per_device_and_reuses_it() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());

    let a = sup.ensure(GPU0, &claim(1)).unwrap();
    assert_eq!(a.device_uuid, GPU0);
    assert_eq!(a.pipe_dir, s.pipe_dir(GPU0));
    assert!(alive(a.pid));
    assert_eq!(s.pid_file(GPU0), Some(a.pid));
    assert!(a.pipe_dir.join(CONTROL).exists());
    // The daemon serves exactly this device and answers on its pipe dir.
    assert!(
        s.log(GPU0)
            .contains(&format!("CUDA_VISIBLE_DEVICES={GPU0}")),
        "{}",
        s.log(GPU0)
    );
    assert_eq!(
        client(&a.pipe_dir, "get_default_active_thread_percentage"),
        (true, "100.0\n".into())
    );

    // A second claim and a repeated call share the daemon.
    let b = sup.ensure(GPU0, &claim(2)).unwrap();
    let again = sup.ensure(GPU0, &claim(1)).unwrap();
    assert_eq!((b.pid, again.pid), (a.pid, a.pid));
    assert_eq!(s.log(GPU0).matches("Startup").count(), 1);

    // Another device (a MIG device too) gets its own daemon.
    let other = sup.ensure(GPU1, &claim(1)).unwrap();
    let mig = sup.ensure(MIG0, &claim(3)).unwrap();
    assert!(alive(other.pid) && alive(mig.pid));
    assert_ne!(other.pid, a.pid);
    assert_ne!(mig.pid, other.pid);
    assert!(
        s.log(MIG0)
            .contains(&format!("CUDA_VISIBLE_DEVICES={MIG0}"))
    );

    let claims = sup.claims();
    assert_eq!(claims[GPU0], BTreeSet::from([claim(1), claim(2)]));
    assert_eq!(claims[GPU1], BTreeSet::from([claim(1)]));

    for (uuid, c) in [(GPU0, 1), (GPU0, 2), (GPU1, 1), (MIG0, 3)] {
        sup.release(uuid, &claim(c)).unwrap();
    }
    assert!(sup.claims().is_empty());
}

#[test]
fn last_release_quits_the_daemon() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let pid = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    sup.ensure(GPU0, &claim(2)).unwrap();

    sup.release(GPU0, &claim(1)).unwrap();
    // Releasing the same claim twice never drops another claim's reference.
    sup.release(GPU0, &claim(1)).unwrap();
    assert!(alive(pid), "daemon stopped while claim 2 holds it");
    assert_eq!(sup.ensure(GPU0, &claim(2)).unwrap().pid, pid);

    sup.release(GPU0, &claim(2)).unwrap();
    assert!(!alive(pid), "the last release must stop the daemon");
    // It was asked to quit (not killed), and its pipe dir is gone.
    let log = s.log(GPU0);
    assert!(
        log.contains("Command: quit") && log.contains("Exit"),
        "{log}"
    );
    assert!(!s.pipe_dir(GPU0).exists());
    assert!(!s.dir.path().join(GPU0).join("supervisor.json").exists());

    // Unknown claims and devices, and device names that are not UUIDs.
    sup.release(GPU0, &claim(2)).unwrap();
    sup.release(GPU1, &claim(9)).unwrap();
    sup.release("../../etc", &claim(9)).unwrap();
    assert!(matches!(
        sup.ensure("GPU-../../x", &claim(1)),
        Err(MpsError::BadDevice(_))
    ));
}

#[test]
fn a_restarted_driver_adopts_running_daemons() {
    let s = Scratch::new();
    let pid = {
        let before = MpsSupervisor::new(s.config());
        before.ensure(GPU0, &claim(1)).unwrap();
        before.ensure(GPU0, &claim(2)).unwrap().pid
        // The driver goes away; its daemon does not.
    };
    assert!(alive(pid));

    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert!(
        report.restarted.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );
    // The references survived the restart.
    assert_eq!(after.claims()[GPU0], BTreeSet::from([claim(1), claim(2)]));
    assert_eq!(after.ensure(GPU0, &claim(3)).unwrap().pid, pid);
    after.release(GPU0, &claim(1)).unwrap();
    after.release(GPU0, &claim(3)).unwrap();
    assert!(alive(pid));
    after.release(GPU0, &claim(2)).unwrap();
    assert!(!alive(pid));
}

#[test]
fn a_daemon_started_before_it_was_recorded_is_adopted_by_probing_its_pipe() {
    let s = Scratch::new();
    let pid = MpsSupervisor::new(s.config())
        .ensure(GPU0, &claim(1))
        .unwrap()
        .pid;
    // The crash came after the daemon started and before its identity was
    // written: the record names the claim but no process.
    let record_path = s.dir.path().join(GPU0).join("supervisor.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&fs::read(&record_path).unwrap()).unwrap();
    assert!(record["daemon"]["pid"] == pid, "{record}");
    record.as_object_mut().unwrap().remove("daemon");
    fs::write(&record_path, serde_json::to_vec(&record).unwrap()).unwrap();

    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert_eq!(report.adopted, [GPU0], "{report:?}");
    assert_eq!(after.ensure(GPU0, &claim(1)).unwrap().pid, pid);
    assert_eq!(s.log(GPU0).matches("Startup").count(), 1);
    after.release(GPU0, &claim(1)).unwrap();
    assert!(!alive(pid));
}

#[test]
fn stale_files_with_a_recycled_pid_are_not_adopted() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let pid = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    kill9(pid);
    // The control endpoint is left behind, and the pid file now names a
    // live process that is no daemon (this test process).
    assert!(s.pipe_dir(GPU0).join(CONTROL).exists());
    fs::write(
        s.pipe_dir(GPU0).join(PID_FILE),
        format!("{}\n", std::process::id()),
    )
    .unwrap();

    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert_eq!(report.restarted, [GPU0], "{report:?}");
    let new_pid = s.pid_file(GPU0).unwrap();
    assert_ne!(new_pid, std::process::id() as i32);
    assert!(alive(new_pid));
    after.release(GPU0, &claim(1)).unwrap();
    assert!(!alive(new_pid));
}

#[test]
fn a_crashed_daemon_is_restarted() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let first = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    kill9(first);

    let report = sup.supervise();
    assert_eq!(report.restarted, [GPU0], "{report:?}");
    let second = s.pid_file(GPU0).unwrap();
    assert_ne!(second, first);
    assert!(alive(second));
    assert!(client(&s.pipe_dir(GPU0), "get_server_list").0);
    // Nothing more to do on the next pass.
    let report = sup.supervise();
    assert!(
        report.restarted.is_empty() && report.adopted.is_empty(),
        "{report:?}"
    );

    // ensure() restarts too, for a claim arriving before the next pass.
    kill9(second);
    let third = sup.ensure(GPU0, &claim(2)).unwrap().pid;
    assert!(alive(third) && third != second);
    assert_eq!(s.log(GPU0).matches("Startup").count(), 3);

    sup.release(GPU0, &claim(1)).unwrap();
    sup.release(GPU0, &claim(2)).unwrap();
    assert!(!alive(third));
}

#[test]
fn the_watchdog_restarts_a_crashed_daemon_on_its_own() {
    let s = Scratch::new();
    let sup = Arc::new(MpsSupervisor::new(s.config()));
    let first = sup.ensure(GPU0, &claim(1)).unwrap().pid;
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
    assert_eq!(restarted, [GPU0]);
    drop(watchdog);
    let second = s.pid_file(GPU0).unwrap();
    assert!(alive(second) && second != first);
    sup.release(GPU0, &claim(1)).unwrap();
    assert!(!alive(second));
}

#[test]
fn a_daemon_that_ignores_quit_is_killed_only_if_it_is_ours() {
    let s = Scratch::new();
    let mut config = s.config();
    config.quit_timeout = Duration::from_millis(300);
    config
        .env
        .push(("TESSERA_FAKE_MPS_IGNORE_QUIT".into(), "1".into()));
    let sup = MpsSupervisor::new(config.clone());

    // Ours: quit is ignored, so the recorded process is killed.
    let pid = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    sup.release(GPU0, &claim(1)).unwrap();
    assert!(!alive(pid));
    assert!(s.log(GPU0).contains("quit ignored"));

    // Not ours: a daemon someone else started on the pipe directory of a
    // device whose record has no claims and no process.
    let pipe = s.pipe_dir(GPU1);
    let status = Command::new(fake_mps_control())
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env(
            "CUDA_MPS_LOG_DIRECTORY",
            s.dir.path().join(GPU1).join("log"),
        )
        .env("TESSERA_FAKE_MPS_IGNORE_QUIT", "1")
        .status()
        .unwrap();
    assert!(status.success());
    wait_until("the foreign daemon is ready", || {
        pipe.join(CONTROL).exists()
    });
    let foreign = s.pid_file(GPU1).unwrap();
    fs::write(
        s.dir.path().join(GPU1).join("supervisor.json"),
        br#"{"claims":[]}"#,
    )
    .unwrap();
    let report = MpsSupervisor::new(config).supervise();
    assert_eq!(report.failed.len(), 1, "{report:?}");
    let (uuid, err) = &report.failed[0];
    assert_eq!(uuid, GPU1);
    assert!(
        matches!(err, MpsError::WontQuit { pid, .. } if *pid == foreign),
        "{err}"
    );
    assert!(err.to_string().contains("echo quit"), "{err}");
    assert!(
        alive(foreign),
        "a daemon the driver did not start was killed"
    );
    kill9(foreign);
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
    let err = sup.ensure(GPU0, &claim(1)).unwrap_err();
    assert!(matches!(err, MpsError::NotReady { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(GPU0) && msg.contains("control"), "{msg}");
    // The half-started daemon was stopped, and the failed claim holds nothing.
    let pid = s.pid_file(GPU0).expect("the daemon wrote its pid file");
    wait_until("the unready daemon is gone", || !alive(pid));
    assert!(sup.claims().is_empty());
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
    let err = sup.ensure(GPU0, &claim(1)).unwrap_err();
    assert!(matches!(err, MpsError::Launch { .. }), "{err}");
    assert!(err.to_string().contains("fix:"), "{err}");
    assert!(sup.claims().is_empty());
}

#[test]
fn client_edits_point_containers_at_the_daemon_with_limits() {
    let s = Scratch::new();
    let sup = MpsSupervisor::new(s.config());
    let daemon = sup.ensure(GPU0, &claim(1)).unwrap();
    let edits = daemon
        .client_edits(Some(ClientLimits {
            memory_bytes: 4 << 30,
            thread_percent: 30,
        }))
        .unwrap();
    let pipe = daemon.pipe_dir.to_str().unwrap();
    assert_eq!(
        edits.env,
        [
            format!("CUDA_MPS_PIPE_DIRECTORY={pipe}"),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M".into(),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30".into(),
        ]
    );
    assert_eq!(edits.mounts.len(), 1);
    assert_eq!(edits.mounts[0].host_path, pipe);
    assert_eq!(edits.mounts[0].container_path, pipe);
    // A container with those settings reaches the daemon.
    assert!(client(Path::new(pipe), "get_server_list").0);
    sup.release(GPU0, &claim(1)).unwrap();
}

#[test]
fn concurrent_claims_on_one_device_share_one_daemon() {
    let s = Scratch::new();
    let sup = Arc::new(MpsSupervisor::new(s.config()));
    let pids: Vec<i32> = (1..=8)
        .map(|n| {
            let sup = Arc::clone(&sup);
            std::thread::spawn(move || sup.ensure(GPU0, &claim(n)).unwrap().pid)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(pids.iter().all(|p| *p == pids[0]), "{pids:?}");
    assert_eq!(s.log(GPU0).matches("Startup").count(), 1);
    let releases: Vec<_> = (1..=8)
        .map(|n| {
            let sup = Arc::clone(&sup);
            std::thread::spawn(move || sup.release(GPU0, &claim(n)).unwrap())
        })
        .collect();
    for t in releases {
        t.join().unwrap();
    }
    assert!(!alive(pids[0]));
    assert!(sup.claims().is_empty());
}

#[test]
fn a_state_dir_too_long_for_unix_sockets_is_refused() {
    let s = Scratch::new();
    let mut config = s.config();
    config.state_dir = s.dir.path().join("x".repeat(60));
    let err = MpsSupervisor::new(config)
        .ensure(GPU0, &claim(1))
        .unwrap_err();
    assert!(matches!(err, MpsError::PathTooLong { .. }), "{err}");
    assert!(err.to_string().contains("fix:"), "{err}");
}

#[test]
fn the_prepare_trait_maps_targets_to_per_device_daemons() {
    use tessera_api::config::{Limits, TimeSliceInterval};
    use tessera_driver::mps::MpsSharing;
    use tessera_driver::prepare::sharing::{MpsTarget, Sharing, Unsupported};

    let s = Scratch::new();
    let sharing = MpsSharing::new(Arc::new(MpsSupervisor::new(s.config())), Unsupported);
    let limits = Limits {
        memory_bytes: 1 << 30,
        compute_percent: 50,
    };
    let whole = MpsTarget {
        gpu_uuid: GPU0.into(),
        mig_uuid: None,
    };
    let mig = MpsTarget {
        gpu_uuid: GPU0.into(),
        mig_uuid: Some(MIG0.into()),
    };
    let a = sharing.mps_acquire(&claim(1), &whole, &limits).unwrap();
    assert_eq!(a.pipe_dir, s.pipe_dir(GPU0));
    assert_eq!(a.log_dir, s.dir.path().join(GPU0).join("log"));
    // A MIG device gets its own daemon, serving only that MIG device.
    let b = sharing.mps_acquire(&claim(2), &mig, &limits).unwrap();
    assert_eq!(b.pipe_dir, s.pipe_dir(MIG0));
    assert!(
        s.log(MIG0)
            .contains(&format!("CUDA_VISIBLE_DEVICES={MIG0}"))
    );
    let pids = (s.pid_file(GPU0).unwrap(), s.pid_file(MIG0).unwrap());
    assert!(alive(pids.0) && alive(pids.1));

    // Time slices are the inner implementation's business.
    let err = sharing
        .set_time_slice(&claim(1), GPU0, TimeSliceInterval::Short)
        .unwrap_err();
    assert!(err.0.contains("not implemented"), "{err}");

    sharing.mps_release(&claim(1), &whole).unwrap();
    sharing.mps_release(&claim(1), &whole).unwrap();
    assert!(!alive(pids.0) && alive(pids.1));
    sharing.mps_release(&claim(2), &mig).unwrap();
    assert!(!alive(pids.1));
    // Errors reach prepare as text naming the device.
    let err = sharing
        .mps_acquire(
            &claim(3),
            &MpsTarget {
                gpu_uuid: "GPU-../x".into(),
                mig_uuid: None,
            },
            &limits,
        )
        .unwrap_err();
    assert!(err.0.contains("GPU-../x"), "{err}");
}
