//! The MPS supervisor against `fake-mps-control`, a simulated
//! `nvidia-cuda-mps-control` (daemon and client modes, pid file, control
//! endpoint, `quit`): start, reuse, reference counting, adoption after a
//! driver restart, restart after a crash, the stop path's guarantees, and a
//! hostile container writing in the pipe directory it is given.
//!
//! Every daemon runs as a real process; tests wait on observable state with
//! deadlines, never on fixed sleeps. Tests read the daemon's pid file to
//! find it; the driver never does.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::mps::{
    CONTROL, ClientLimits, LAUNCH_ID_ENV, MpsConfig, MpsError, MpsSharing, MpsSupervisor, PID_FILE,
    ProcessId,
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

impl Scratch {
    /// The daemon the supervisor recorded, if any.
    fn recorded_pid(&self, uuid: &str) -> Option<i32> {
        let bytes = fs::read(self.dir.path().join(uuid).join("supervisor.json")).ok()?;
        let record: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        record["daemon"]["pid"].as_i64().map(|p| p as i32)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for uuid in [GPU0, GPU1, MIG0] {
            for pid in [self.pid_file(uuid), self.recorded_pid(uuid)]
                .into_iter()
                .flatten()
            {
                let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                if pid != std::process::id() as i32 && comm.starts_with("fake-mps") {
                    // SAFETY: a daemon this test started in its own directory.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
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
    assert_eq!(report.adopted, [GPU0], "{report:?}");
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
fn a_daemon_spawned_but_not_yet_recorded_is_found_by_its_launch_id() {
    let s = Scratch::new();
    let pid = MpsSupervisor::new(s.config())
        .ensure(GPU0, &claim(1))
        .unwrap()
        .pid;
    assert_eq!(s.recorded_pid(GPU0), Some(pid));
    // The crash came after the daemon was spawned and before its identity
    // was written: the record names the claim and the launch id only.
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap();
    let prefix = format!("{LAUNCH_ID_ENV}=");
    let launch = environ
        .split(|b| *b == 0)
        .filter_map(|e| std::str::from_utf8(e).ok()?.strip_prefix(&prefix))
        .next()
        .expect("the daemon carries its launch id")
        .to_owned();
    let record_path = s.dir.path().join(GPU0).join("supervisor.json");
    fs::write(
        &record_path,
        serde_json::to_vec(&serde_json::json!({"claims": [claim(1)], "launch": launch})).unwrap(),
    )
    .unwrap();

    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert_eq!(report.adopted, [GPU0], "{report:?}");
    assert_eq!(after.ensure(GPU0, &claim(1)).unwrap().pid, pid);
    assert_eq!(s.recorded_pid(GPU0), Some(pid));
    assert_eq!(s.log(GPU0).matches("Startup").count(), 1);
    after.release(GPU0, &claim(1)).unwrap();
    assert!(!alive(pid));
}

#[test]
fn a_daemon_the_record_does_not_name_is_never_adopted_or_stopped() {
    let s = Scratch::new();
    let pid = MpsSupervisor::new(s.config())
        .ensure(GPU0, &claim(1))
        .unwrap()
        .pid;
    // A live daemon answers on the pipe directory and its pid file names
    // it, but the record does not (nor does any launch id): it is not the
    // driver's to adopt or stop.
    let record_path = s.dir.path().join(GPU0).join("supervisor.json");
    fs::write(&record_path, br#"{"claims":[]}"#).unwrap();
    assert_eq!(s.pid_file(GPU0), Some(pid));

    let after = MpsSupervisor::new(s.config());
    let report = after.supervise();
    assert!(
        report.adopted.is_empty() && report.stopped.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );
    assert!(alive(pid), "a daemon the record does not name was stopped");
    // A claim gets a daemon of the driver's own.
    let ours = after.ensure(GPU0, &claim(2)).unwrap().pid;
    assert_ne!(ours, pid);
    assert!(alive(ours) && alive(pid));
    after.release(GPU0, &claim(2)).unwrap();
    assert!(!alive(ours));
    assert!(alive(pid));
    kill9(pid);
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

    // Ours, adopted by a restarted driver: killed through a pidfd.
    let pid = sup.ensure(GPU0, &claim(2)).unwrap().pid;
    drop(sup);
    let after = MpsSupervisor::new(config.clone());
    after.release(GPU0, &claim(2)).unwrap();
    assert!(!alive(pid));

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
    assert!(
        report.failed.is_empty() && report.stopped.is_empty(),
        "{report:?}"
    );
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
    // The pipe directory only: never the logs or the supervisor's record.
    assert_eq!(edits.mounts.len(), 1);
    assert_eq!(edits.mounts[0].host_path, pipe);
    assert_eq!(edits.mounts[0].container_path, pipe);
    for option in ["nosuid", "nodev", "noexec"] {
        assert!(
            edits.mounts[0].options.iter().any(|o| o == option),
            "{:?}",
            edits.mounts[0].options
        );
    }
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
    use tessera_driver::prepare::sharing::{MpsTarget, SharingControl, Unsupported};

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
    // A client gets the pipe directory, nothing else of the daemon's.
    assert_eq!(
        a,
        tessera_driver::prepare::sharing::MpsClient {
            pipe_dir: s.pipe_dir(GPU0)
        }
    );
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

// ---------------------------------------------------------------------------
// A hostile container.
//
// Every Isolated container on a device gets that device's MPS pipe directory
// mounted read-write, in any namespace, and may run as root. These tests play
// such a container: it rewrites the daemon's pid file to name a process the
// driver must never touch, plants symlinks to a file the driver must never
// truncate or show, and makes the daemon quit behind the driver's back. The
// driver must keep its hands off both decoys, keep file contents out of its
// errors, and still recover.

use tessera_driver::prepare::sharing::{MpsClient, MpsTarget, SharingControl, Unsupported};

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
    fn new(sharing: &MpsSharing<Unsupported>, device: &str, claim: &ClaimUid) -> Self {
        let client = sharing
            .mps_acquire(claim, &target(device), &share_limits())
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
        gpu_uuid: device.into(),
        mig_uuid: None,
    }
}

fn share_limits() -> tessera_api::config::Limits {
    tessera_api::config::Limits {
        memory_bytes: 1 << 30,
        compute_percent: 50,
    }
}

fn container_dirs(client: &MpsClient) -> Vec<PathBuf> {
    vec![client.pipe_dir.clone()]
}

fn errors(report: &tessera_driver::mps::SupervisionReport) -> Vec<String> {
    report.failed.iter().map(|(_, e)| e.to_string()).collect()
}

/// A sharing stack as the plugin wires it, with a short readiness timeout.
fn hostile_setup(s: &Scratch) -> (Arc<MpsSupervisor>, MpsSharing<Unsupported>) {
    let mut config = s.config();
    config.ready_timeout = Duration::from_secs(3);
    let sup = Arc::new(MpsSupervisor::new(config));
    (sup.clone(), MpsSharing::new(sup, Unsupported))
}

/// Our daemon, not the decoy: a live fake-mps-control answering on the pipe.
fn assert_serving(s: &Scratch, pid: i32, decoy: i32) {
    assert_ne!(pid, decoy);
    assert!(alive(pid));
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert!(comm.starts_with("fake-mps"), "pid {pid} is {comm:?}");
    assert!(client(&s.pipe_dir(GPU0), "get_server_list").0);
}

#[test]
fn a_hostile_container_cannot_steer_a_restart() {
    let s = Scratch::new();
    let (sup, sharing) = hostile_setup(&s);
    let mut h = Hostile::new(&sharing, GPU0, &claim(1));
    let first = sup.ensure(GPU0, &claim(1)).unwrap().pid;

    h.plant_symlinks(&LOG_NAMES);
    h.quit_daemon(&s.pipe_dir(GPU0), first);
    h.forge_pid_file();

    // The watchdog's pass finds the daemon gone and starts a fresh one.
    let report = sup.supervise();
    h.assert_unharmed(&errors(&report));
    assert_eq!(report.restarted, [GPU0], "{report:?}");
    let second = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    assert_ne!(second, first);
    assert_serving(&s, second, h.decoy_pid());

    sup.release(GPU0, &claim(1)).unwrap();
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
    let first = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    h.forge_pid_file();
    h.plant_symlinks(&LOG_NAMES);
    let result = sup.release(GPU0, &claim(1));
    h.assert_unharmed(&[result
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default()]);
    result.unwrap();
    assert!(!alive(first), "the last release left the daemon running");

    // The daemon quit behind the driver's back, the pid file names the
    // decoy and the control endpoint is a symlink to the decoy file.
    let second = sup.ensure(GPU0, &claim(2)).unwrap().pid;
    assert_serving(&s, second, h.decoy_pid());
    h.quit_daemon(&s.pipe_dir(GPU0), second);
    h.forge_pid_file();
    h.plant_symlinks(&[CONTROL]);
    h.plant_symlinks(&LOG_NAMES);
    let result = sup.release(GPU0, &claim(2));
    h.assert_unharmed(&[result
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default()]);
    result.unwrap();
    assert!(sup.claims().is_empty());
    assert!(!s.pipe_dir(GPU0).exists());
}

#[test]
fn a_hostile_container_cannot_steer_a_restarted_driver() {
    let s = Scratch::new();
    let (sup, sharing) = hostile_setup(&s);
    let mut h = Hostile::new(&sharing, GPU0, &claim(1));
    let first = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    // The driver goes away; while it is gone the container strikes.
    drop((sup, sharing));
    h.plant_symlinks(&LOG_NAMES);
    h.quit_daemon(&s.pipe_dir(GPU0), first);
    h.forge_pid_file();

    let (after, _sharing) = hostile_setup(&s);
    let report = after.supervise();
    h.assert_unharmed(&errors(&report));
    assert_eq!(report.restarted, [GPU0], "{report:?}");
    let second = after.ensure(GPU0, &claim(1)).unwrap().pid;
    assert_serving(&s, second, h.decoy_pid());

    // The checkpoint no longer knows the claim: the daemon is stopped.
    h.forge_pid_file();
    let report = after.retain_claims(|_| false);
    h.assert_unharmed(&errors(&report));
    assert_eq!(report.stopped, [GPU0], "{report:?}");
    assert!(!alive(second));
    h.assert_unharmed(&[]);
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
        (sup.clone(), MpsSharing::new(sup, Unsupported))
    };
    let mut h = Hostile::new(&sharing, GPU0, &claim(1));
    let first = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    h.quit_daemon(&s.pipe_dir(GPU0), first);

    // While the next daemon is starting, a symlink to an existing file
    // stands where its endpoint will be.
    let planter = {
        let pipe = s.pipe_dir(GPU0);
        let decoy_file = h.decoy_file.clone();
        std::thread::spawn(move || {
            wait_until("the restarted daemon wrote its pid file", || {
                pipe.join(PID_FILE).exists()
            });
            std::os::unix::fs::symlink(&decoy_file, pipe.join(CONTROL)).unwrap();
        })
    };
    let result = sup.ensure(GPU0, &claim(1));
    planter.join().unwrap();
    match &result {
        // Ready means the daemon's own socket, not the symlink.
        Ok(_) => {
            let endpoint = s.pipe_dir(GPU0).join(CONTROL).symlink_metadata().unwrap();
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
            // The next pass clears the symlink and starts a daemon.
            let report = sup.supervise();
            h.assert_unharmed(&errors(&report));
            assert_eq!(report.restarted, [GPU0], "{report:?}");
        }
    }
    let second = sup.ensure(GPU0, &claim(1)).unwrap().pid;
    assert_serving(&s, second, h.decoy_pid());
    sup.release(GPU0, &claim(1)).unwrap();
    assert!(!alive(second));
    h.assert_unharmed(&[]);
}
