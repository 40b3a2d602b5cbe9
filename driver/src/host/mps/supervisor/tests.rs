//! The stop/supervise window, held open: a supervision pass has found a
//! daemon and is about to take its lock when the daemon is stopped.

use std::sync::mpsc::{Receiver, channel};

use super::*;
use crate::host::port::MpsControl;
use tessera_test_kit::artifacts::fake_mps_control;

const GPU: &str = "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10";
const LIMITS: ClientLimits = ClientLimits {
    memory_bytes: 8 << 30,
    thread_percent: 25,
    shm_bytes: None,
};
const WAIT: Duration = Duration::from_secs(20);

fn key() -> DaemonKey {
    DaemonKey {
        claim: ClaimUid::parse("00000000-0000-4000-8000-000000000001").unwrap(),
        request: "gpu".into(),
        device: GPU.into(),
    }
}

fn alive(pid: i32) -> bool {
    ProcessId::of(pid).is_some()
}

/// A state directory whose daemons are killed when the test ends, even one
/// that fails half way.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new() -> Self {
        Scratch(tempfile::Builder::new().prefix("mps").tempdir().unwrap())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let walk = |dir: &Path| fs::read_dir(dir).into_iter().flatten().flatten();
        for claim in walk(self.0.path()) {
            for daemon in walk(&claim.path()) {
                let pid = fs::read(daemon.path().join(RECORD))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|r| r["daemon"]["pid"].as_i64());
                let comm = |pid: i64| fs::read_to_string(format!("/proc/{pid}/comm"));
                if let Some(pid) = pid.filter(|p| comm(*p).is_ok_and(|c| c.starts_with("fake-mps")))
                {
                    // SAFETY: a daemon this test started in its own directory.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
            }
        }
    }
}

/// A supervisor whose daemons ignore `quit` (so a stop takes its quit
/// timeout, then kills).
fn supervisor(state: &Path) -> Arc<MpsSupervisor> {
    let mut config = MpsConfig::new(Path::new("/nonexistent-driver-root"), state);
    config.control_binary = fake_mps_control().to_owned();
    config.quit_timeout = Duration::from_millis(300);
    config
        .env
        .push(("TESSERA_FAKE_MPS_IGNORE_QUIT".into(), "1".into()));
    Arc::new(MpsSupervisor::new(config))
}

/// Holds the next pass in the window for `key`: `reached` hears when it
/// is there; it goes on when the returned sender sends (or drops).
fn hold_pass_in_window(sup: &MpsSupervisor, key: DaemonKey) -> (Receiver<()>, mpsc::Sender<()>) {
    let (reached_tx, reached) = channel();
    let (go, go_rx) = channel::<()>();
    let go_rx = Mutex::new(go_rx);
    *sup.before_lock.locked() = Some(Arc::new(move |k: &DaemonKey| {
        if *k == key {
            let _ = reached_tx.send(());
            let _ = go_rx.locked().recv_timeout(WAIT);
        }
    }));
    (reached, go)
}

/// Stop the daemon in the window by `stop`; the pass that was about to
/// take its lock must not start it again, nor must any later pass.
fn stopped_in_the_window_stays_stopped(stop: impl FnOnce(&MpsSupervisor, &DaemonKey)) {
    let scratch = Scratch::new();
    let sup = supervisor(scratch.0.path());
    let k = key();
    let pid = sup.ensure(&k, LIMITS, Some(0)).unwrap().pid;
    let root = scratch.0.path().join(k.claim.as_str()).join(k.tag());
    assert!(root.join(RECORD).exists());

    let (reached, go) = hold_pass_in_window(&sup, k.clone());
    let pass = {
        let sup = Arc::clone(&sup);
        std::thread::spawn(move || sup.supervise())
    };
    reached
        .recv_timeout(WAIT)
        .expect("the pass did not reach the daemon");
    stop(&sup, &k);
    assert!(!alive(pid), "the stop left the daemon running");
    drop(go);
    let report = pass.join().unwrap();
    *sup.before_lock.locked() = None;

    assert!(
        report.restarted.is_empty() && report.adopted.is_empty(),
        "the pass revived a stopped daemon: {report:?}"
    );
    assert!(!root.exists(), "a record was left for a stopped daemon");
    assert_eq!(sup.supervised(), 0);
    let later = sup.supervise();
    assert!(
        later.restarted.is_empty() && later.adopted.is_empty(),
        "{later:?}"
    );
    assert!(!root.exists());
}

#[test]
fn a_pass_never_restarts_a_daemon_release_stopped() {
    stopped_in_the_window_stays_stopped(|sup, k| sup.release(k).unwrap());
}

#[test]
fn a_pass_never_restarts_a_daemon_of_a_released_lost_claim() {
    stopped_in_the_window_stays_stopped(|sup, k| sup.release_claim(&k.claim).unwrap());
}

#[test]
fn a_pass_never_restarts_a_daemon_whose_ensure_failed() {
    stopped_in_the_window_stays_stopped(|sup, k| {
        // Prepared again with limits no daemon can take: the running one
        // is killed, the new one never starts, and nothing stays.
        let unusable = ClientLimits {
            memory_bytes: 1000,
            thread_percent: 10,
            shm_bytes: None,
        };
        let err = sup.ensure(k, unusable, Some(0)).unwrap_err();
        assert!(matches!(err, MpsError::Limits { .. }), "{err}");
    });
}
