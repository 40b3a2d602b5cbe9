//! A record retired in place by an unprepare, and removed later.

use super::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Staged {
    device: String,
    #[serde(default)]
    leaving: bool,
}

impl super::super::Entry for Staged {}

fn open_staged(f: &Fixture) -> Checkpoint<Staged> {
    Checkpoint::open(&f.state(), &f.boot).unwrap().0
}

fn staged(device: &str) -> Staged {
    Staged {
        device: device.into(),
        leaving: false,
    }
}

#[test]
fn a_retired_record_is_marked_in_its_own_file_and_read_so_after_a_crash() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    let file = inode(&f.record(&uid(1)));
    let retired = cp.retire(&uid(1), |e| e.leaving = true).unwrap();
    assert_eq!(retired.map(|e| e.leaving), Some(true));
    assert!(!cp.lock().contains_key(&uid(1)), "forgotten in memory");
    assert_eq!(inode(&f.record(&uid(1))), file, "rewritten in place");
    assert!(spares(&f).is_empty());
    // A kill now: the next start reads the mark, checksum and all.
    let again = open_staged(&f);
    assert_eq!(
        again.lock()[&uid(1)],
        Staged {
            device: "gpu-0".into(),
            leaving: true
        }
    );
    // Retiring an unknown claim changes nothing.
    assert!(cp.retire(&uid(9), |e| e.leaving = true).unwrap().is_none());
}

#[test]
fn a_retired_record_goes_later_unless_recorded_again() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    cp.retire(&uid(1), |e| e.leaving = true).unwrap();
    cp.drop_retired(&uid(1)).unwrap();
    assert!(!f.record(&uid(1)).exists());
    assert_eq!(spares(&f).len(), 1, "its file kept as a spare");
    // Prepared again before the removal came: the new record stays.
    cp.put(uid(2), staged("gpu-1")).unwrap();
    cp.retire(&uid(2), |e| e.leaving = true).unwrap();
    cp.put(uid(2), staged("gpu-2")).unwrap();
    cp.drop_retired(&uid(2)).unwrap();
    assert_eq!(open_staged(&f).lock()[&uid(2)], staged("gpu-2"));
    // Already gone: fine.
    cp.drop_retired(&uid(1)).unwrap();
}

#[test]
fn a_shorter_mark_leaves_nothing_of_the_longer_record_behind() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged(&"g".repeat(200))).unwrap();
    let before = fs::metadata(f.record(&uid(1))).unwrap().len();
    cp.retire(&uid(1), |e| {
        e.device = "g".into();
        e.leaving = true;
    })
    .unwrap();
    assert_eq!(fs::metadata(f.record(&uid(1))).unwrap().len(), before);
    let snapshot = read_snapshot::<Staged>(&f.state(), Some("boot-a")).unwrap();
    assert!(snapshot.unreadable.is_empty(), "{:?}", snapshot.unreadable);
    assert_eq!(snapshot.claims[&uid(1)].device, "g");
}

#[test]
fn a_record_longer_than_a_page_is_removed_at_once() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged(&"g".repeat(5000))).unwrap();
    let retired = cp.retire(&uid(1), |e| e.leaving = true).unwrap();
    assert!(retired.is_some());
    assert!(!f.record(&uid(1)).exists(), "removed, not rewritten");
    assert_eq!(spares(&f).len(), 1);
}

#[test]
fn a_failed_mark_keeps_the_marked_entry_for_a_retry() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    // Something else in the record's place: never written through.
    let path = f.record(&uid(1));
    fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(f.dir.path().join("elsewhere"), &path).unwrap();
    fs::write(f.dir.path().join("elsewhere"), b"keep").unwrap();
    assert!(cp.retire(&uid(1), |e| e.leaving = true).is_err());
    assert!(cp.lock()[&uid(1)].leaving, "kept, marked, for the retry");
    assert_eq!(fs::read(f.dir.path().join("elsewhere")).unwrap(), b"keep");
}

#[test]
fn a_record_with_a_newer_versions_fields_is_removed_at_once() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    drop(cp);
    // What a newer version writes: the same version, one more field, which
    // a rewrite by this one would drop.
    let text = r#"{"device":"gpu-0","partition":{"slices":2}}"#;
    let record = serde_json::json!({
        "version": FORMAT_VERSION,
        "bootId": "boot-a",
        "crc32": crc32fast::hash(text.as_bytes()),
        "entry": text,
    });
    fs::write(f.record(&uid(1)), record.to_string()).unwrap();
    let cp = open_staged(&f);
    assert!(cp.unknown_fields(&uid(1)).is_some());
    assert!(cp.retire(&uid(1), |e| e.leaving = true).unwrap().is_some());
    assert!(!f.record(&uid(1)).exists(), "removed, not rewritten");
    assert_eq!(cp.unknown_fields(&uid(1)), None);
}
