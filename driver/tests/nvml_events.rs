//! XID errors injected while a process runs reach it through nvml-wrapper's
//! event API, the way the driver's health monitoring will receive them.
//!
//! NVML is process-global, so the watching side runs in a child process: this
//! same test binary, re-run on the ignored `child_watch_xids` test with the
//! simulated NVML on its library path.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use common::*;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use tessera_driver::health::{Health, HealthTracker, XidPolicy, spawn_monitor};

const CHILD_ENV: &str = "TESSERA_TEST_XID_CHILD";
/// Lines of the child's protocol start with this, to tell them from libtest's output.
const TAG: &str = "xid-child:";

const GPU0: &str = "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10";
const GPU1: &str = "GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee";
/// A MIG device on GPU 0; its XIDs are reported on GPU 0.
const GPU0_MIG: &str = "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f";

/// Runs the ignored test `name` of this binary in a child process on the
/// simulated NVML, whose XID events are read from `events`; the child and
/// the lines it reports.
fn start_child(name: &str, events: &Path) -> (KillOnDrop, mpsc::Receiver<String>) {
    let mut child = clean(Command::new(std::env::current_exe().unwrap()))
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("LD_LIBRARY_PATH", fake_nvml_dir())
        .env(TOPOLOGY_ENV, topology("a100-40gb-x2-mig.yaml"))
        .env(STATE_ENV, fresh_state("xid"))
        .env(EVENTS_ENV, events)
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the child");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest may print `test child_watch_xids ... ` on the same line.
            if let Some(at) = line.find(TAG) {
                let _ = tx.send(line[at + TAG.len()..].trim().to_string());
            }
        }
    });
    (KillOnDrop(child), rx)
}

/// The next line the child reports, within `deadline`.
fn next_line(rx: &mpsc::Receiver<String>, deadline: Instant) -> String {
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .expect("the child stopped reporting before the deadline")
}

/// An empty file of XID events to inject, unique to this process.
fn event_file(test: &str) -> PathBuf {
    let events = scratch_dir(test).join(format!("events-{}", std::process::id()));
    std::fs::write(&events, "").unwrap();
    events
}

#[test]
fn injected_xids_reach_nvml_wrapper_event_sets() {
    let events = event_file("xid-injection");
    let (mut child, rx) = start_child("child_watch_xids", &events);
    let deadline = Instant::now() + Duration::from_secs(60);
    let next = || next_line(&rx, deadline);

    assert_eq!(next(), "no events yet");
    assert_eq!(next(), "ready");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&events)
        .unwrap();
    // GPU 1 is not registered: its XID must not show up.
    writeln!(f, "{GPU1} 31").unwrap();
    writeln!(f, "{GPU0} 79").unwrap();
    writeln!(f, "{GPU0_MIG} 94").unwrap();
    drop(f);
    assert_eq!(next(), format!("event {GPU0} xid 79"));
    assert_eq!(next(), format!("event {GPU0} xid 94"));
    assert_eq!(next(), "done");

    let status = child.0.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    let _ = std::fs::remove_file(&events);
}

/// Stops the child when the parent test fails early.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The watching process: registers GPU 0 for XIDs, reports what arrives.
#[test]
#[ignore = "run in a child process by injected_xids_reach_nvml_wrapper_event_sets"]
fn child_watch_xids() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let say = |msg: &str| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{TAG} {msg}").unwrap();
        out.flush().unwrap();
    };
    let nvml = Nvml::init().expect("NVML (simulated) init");
    let gpu0 = nvml.device_by_index(0).unwrap();
    assert!(
        gpu0.supported_event_types()
            .unwrap()
            .contains(EventTypes::CRITICAL_XID_ERROR)
    );
    let set = gpu0
        .register_events(
            EventTypes::CRITICAL_XID_ERROR,
            nvml.create_event_set().unwrap(),
        )
        .unwrap();
    match set.wait(50) {
        Err(NvmlError::Timeout) => say("no events yet"),
        other => panic!("expected a timeout before any injection, got {other:?}"),
    }
    say("ready");
    let deadline = Instant::now() + Duration::from_secs(50);
    let mut seen = 0;
    while seen < 2 {
        assert!(
            Instant::now() < deadline,
            "no XID events before the deadline"
        );
        match set.wait(1000) {
            Ok(event) => {
                assert!(event.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
                let uuid = event.device.uuid().unwrap();
                let Some(XidError::Value(xid)) = event.event_data else {
                    panic!("XID event without an XID: {:?}", event.event_data);
                };
                say(&format!("event {uuid} xid {xid}"));
                seen += 1;
            }
            Err(NvmlError::Timeout) => continue,
            Err(e) => panic!("waiting for events: {e}"),
        }
    }
    // Nothing else (GPU 1's XID) may arrive.
    assert!(matches!(set.wait(200), Err(NvmlError::Timeout)));
    say("done");
}

#[test]
fn the_xid_monitor_marks_the_gpu_of_a_fatal_xid_unhealthy() {
    let events = event_file("xid-monitor");
    let (mut child, rx) = start_child("child_monitor_health", &events);
    let deadline = Instant::now() + Duration::from_secs(60);
    let next = || next_line(&rx, deadline);

    // Listed by UUID: GPU 1 first.
    assert_eq!(next(), format!("{GPU1} Healthy, {GPU0} Healthy"));
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&events)
        .unwrap();
    writeln!(f, "{GPU0} 79").unwrap();
    drop(f);
    assert_eq!(
        next(),
        format!("{GPU1} Healthy, {GPU0} Unhealthy {{ xid: 79 }}")
    );
    let status = child.0.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    let _ = std::fs::remove_file(&events);
}

/// The monitoring process: the driver's XID monitor on every GPU; reports
/// each GPU's health when all are watched, and again once one changed.
#[test]
#[ignore = "run in a child process by the_xid_monitor_marks_the_gpu_of_a_fatal_xid_unhealthy"]
fn child_monitor_health() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let nvml = Arc::new(Nvml::init().expect("NVML (simulated) init"));
    let tracker = Arc::new(HealthTracker::new(XidPolicy::default(), None));
    let _monitor = spawn_monitor(nvml, tracker.clone()).unwrap();
    let health = || {
        let map = tracker.current();
        let text: Vec<String> = (map.iter())
            .map(|(gpu, g)| format!("{gpu} {:?}", g.health))
            .collect();
        (map, text.join(", "))
    };
    let deadline = Instant::now() + Duration::from_secs(50);
    let mut last = String::new();
    loop {
        assert!(Instant::now() < deadline, "health stayed {last}");
        let (map, text) = health();
        if map.len() == 2 && text != last {
            println!("{TAG} {text}");
            if map.values().any(|g| g.health != Health::Healthy) {
                return;
            }
            last = text;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
