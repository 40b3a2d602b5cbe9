use super::ledger::Ledger;
use super::*;
use crate::state::records::DeviceData;

thread_local! {
    /// Runs once at the start of the next [`StatusWriter::remove`].
    pub(super) static BEFORE_REMOVE: std::cell::Cell<Option<Box<dyn FnOnce()>>> =
        std::cell::Cell::new(None);
}

fn entry(device: &str) -> DeviceStatus {
    DeviceStatus {
        pool: "node".into(),
        device: device.into(),
        share_id: None,
        data: DeviceData {
            device_type: "gpu".into(),
            gpu_uuid: format!("GPU-{device}"),
            mig_uuid: None,
            profile: None,
            isolation_level: None,
            isolation_provider: None,
            sharing: None,
            time_slice: None,
            limits: None,
            consumed: None,
        },
        conditions: Vec::new(),
    }
}

fn want(devices: &[&str], not_before: Instant) -> Want {
    Want {
        namespace: "ns".into(),
        name: "c".into(),
        devices: devices.iter().map(|d| entry(d)).collect(),
        attempts: 0,
        not_before,
        queued: not_before,
        reported: false,
    }
}

fn devices(w: &Want) -> Vec<&str> {
    w.devices.iter().map(|d| d.device.as_str()).collect()
}

#[test]
fn a_claim_queued_again_before_its_turn_is_written_once_with_the_newest() {
    let now = Instant::now();
    let mut q = Queue::default();
    q.put("a", want(&["gpu-0"], now));
    q.put("b", want(&["gpu-1"], now));
    q.put("a", want(&["gpu-2"], now));
    let (uid, w) = q.take(now).unwrap();
    assert_eq!((uid.as_str(), devices(&w)), ("a", vec!["gpu-2"]));
    let (uid, _) = q.take(now).unwrap();
    assert_eq!(uid, "b");
    assert_eq!(q.take(now).unwrap_err(), None, "nothing more");
}

#[test]
fn a_claim_in_flight_waits_and_a_newer_want_wins_over_a_retry() {
    let now = Instant::now();
    let mut q = Queue::default();
    q.put("a", want(&["gpu-0"], now));
    let (_, first) = q.take(now).unwrap();
    // Unprepared while its write is in flight: the removal waits.
    q.put("a", want(&[], now));
    assert!(!q.cancel_unwritten("a", false), "in flight: it may land");
    assert_eq!(q.take(now).unwrap_err(), None);
    // The write failed; its retry does not replace the removal.
    q.retry("a", first);
    q.busy.remove("a");
    let (_, w) = q.take(now).unwrap();
    assert!(w.devices.is_empty(), "the removal, not the stale write");
}

#[test]
fn an_unwritten_claim_unprepared_is_never_written() {
    let now = Instant::now();
    let mut q = Queue::default();
    q.put("a", want(&["gpu-0"], now));
    assert!(q.cancel_unwritten("a", false));
    assert_eq!(q.take(now).unwrap_err(), None);
    q.put("b", want(&["gpu-0"], now));
    assert!(
        !q.cancel_unwritten("b", true),
        "written: its entries must go"
    );
}

#[test]
fn a_retry_waits_for_its_backoff() {
    let now = Instant::now();
    let later = now + Duration::from_secs(3);
    let mut q = Queue::default();
    q.put("a", want(&["gpu-0"], later));
    q.put("b", want(&["gpu-1"], now));
    assert_eq!(q.take(now).unwrap().0, "b", "a is not due yet");
    assert_eq!(q.take(now).unwrap_err(), Some(later));
    assert_eq!(q.take(later).unwrap().0, "a");
}

#[test]
fn a_replaced_want_keeps_how_long_it_has_waited() {
    let now = Instant::now();
    let later = now + Duration::from_secs(1);
    let mut q = Queue::default();
    q.put("a", want(&["gpu-0"], now));
    q.put("b", want(&["gpu-1"], later));
    q.put("a", want(&["gpu-2"], later));
    assert_eq!(q.yield_deadline(), Some(now + MAX_DEFER));
    q.take(later).unwrap();
    assert_eq!(q.yield_deadline(), Some(later + MAX_DEFER));
}

fn offline_client() -> Client {
    let config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
    Client::try_from(config).unwrap()
}

/// Writes wait while a kubelet call is in flight and for QUIET after it, or
/// until their deadline (the clock is paused: tokio advances it when
/// every task waits).
#[tokio::test(start_paused = true)]
async fn writes_yield_to_the_kubelet_until_quiet_or_their_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let writer = StatusWriter::unstarted(offline_client(), "d", dir.path(), None).unwrap();

    let start = Instant::now();
    let call = writer.call_started();
    writer.yield_to_kubelet(start + MAX_DEFER).await;
    assert_eq!(
        start.elapsed(),
        MAX_DEFER,
        "a call in flight: until the deadline"
    );

    drop(call);
    let ended = Instant::now();
    writer.yield_to_kubelet(ended + MAX_DEFER).await;
    assert_eq!(ended.elapsed(), QUIET, "QUIET after the last call");

    let now = Instant::now();
    writer.yield_to_kubelet(now + MAX_DEFER).await;
    assert_eq!(now.elapsed(), Duration::ZERO, "quiet already: no wait");

    let call = writer.call_started();
    let begun = Instant::now();
    let write = async {
        writer.yield_to_kubelet(begun + MAX_DEFER).await;
        Instant::now()
    };
    let finish = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(call);
        Instant::now()
    };
    let (written, finished) = tokio::join!(write, finish);
    assert_eq!(written - finished, QUIET, "the call ended: QUIET after it");
}

/// A write that settles while an unprepare asks for the removal: the
/// removal is queued, never skipped as if nothing had been written.
#[tokio::test]
async fn a_removal_is_not_skipped_while_the_write_settles() {
    let dir = tempfile::tempdir().unwrap();
    let writer = StatusWriter::unstarted(offline_client(), "d", dir.path(), None).unwrap();
    writer.write("ns", "c", "a", vec![entry("gpu-0")]);
    let (uid, taken) = writer.lock().take(Instant::now()).unwrap();
    let settling = writer.clone();
    BEFORE_REMOVE.with(|hook| {
        hook.set(Some(Box::new(move || {
            let settled = settling.settle(&uid, taken, Ok(Applied::Written));
            // A written outcome awaits nothing.
            futures::FutureExt::now_or_never(settled).expect("settles at once");
        })))
    });
    writer.remove("ns", "c", "a");
    assert!(writer.ledger.contains("a"), "the write settled");
    let q = writer.lock();
    let removal = q.wants.get("a").expect("the removal is queued");
    assert!(removal.devices.is_empty());
}

/// At start: a prepared claim the ledger does not name is written, one
/// it names is not; a claim it names that is no longer prepared has its
/// entries removed, unless the records may be incomplete.
#[tokio::test]
async fn resume_follows_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let client = offline_client();
    let mut ledger = Ledger::open(dir.path());
    for (ns, name) in [("ns", "written"), ("ns2", "gone")] {
        let marked = Marked {
            namespace: ns.into(),
            name: name.into(),
        };
        ledger.written(name, marked).unwrap();
    }
    drop(ledger);
    let prepared = vec![
        (
            "new".into(),
            "ns".into(),
            "new".into(),
            vec![entry("gpu-0")],
        ),
        (
            "written".into(),
            "ns".into(),
            "written".into(),
            vec![entry("gpu-1")],
        ),
    ];

    let writer = StatusWriter::unstarted(client.clone(), "d", dir.path(), None).unwrap();
    writer.resume(prepared.clone(), true, |_| false);
    let q = writer.lock();
    let mut got: Vec<(&str, &str, usize)> = q
        .wants
        .iter()
        .map(|(uid, w)| (uid.as_str(), w.name.as_str(), w.devices.len()))
        .collect();
    got.sort();
    assert_eq!(got, [("gone", "gone", 0), ("new", "new", 1)]);
    assert!(q.busy.is_empty());
    drop(q);

    let writer = StatusWriter::unstarted(client, "d", dir.path(), None).unwrap();
    writer.resume(prepared, false, |_| false);
    let uids: Vec<String> = writer.lock().wants.keys().cloned().collect();
    assert_eq!(uids, ["new"], "records may be lost: no removal");
}
