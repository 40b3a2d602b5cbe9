//! A record retired by an unprepare (named in the journal of retired
//! records), and removed later.

use super::*;
use crate::state::checkpoint::retired::JOURNAL_FILE;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Staged {
    device: String,
    #[serde(default)]
    leaving: bool,
}

impl super::super::Entry for Staged {
    fn retire(&mut self) {
        self.leaving = true;
    }
}

fn open_staged(f: &Fixture) -> Checkpoint<Staged> {
    Checkpoint::open(&f.state(), &f.boot).unwrap().0
}

fn staged(device: &str) -> Staged {
    Staged {
        device: device.into(),
        leaving: false,
    }
}

fn leaving(device: &str) -> Staged {
    Staged {
        device: device.into(),
        leaving: true,
    }
}

fn journal(f: &Fixture) -> PathBuf {
    f.state().join(RECORDS_DIR).join(JOURNAL_FILE)
}

/// The journal's lines (none when it is not there).
fn journal_lines(f: &Fixture) -> Vec<String> {
    let text = fs::read_to_string(journal(f)).unwrap_or_default();
    text.lines().map(str::to_owned).collect()
}

#[test]
fn a_retired_record_is_named_in_the_journal_and_read_so_after_a_crash() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    let record = fs::read(f.record(&uid(1))).unwrap();
    let retired = cp.retire(&uid(1)).unwrap();
    assert_eq!(retired, Some(leaving("gpu-0")));
    assert!(!cp.lock().contains_key(&uid(1)), "forgotten in memory");
    assert_eq!(
        fs::read(f.record(&uid(1))).unwrap(),
        record,
        "not rewritten"
    );
    assert_eq!(journal_lines(&f), [format!("retired {}", uid(1))]);
    // A kill now: the next start and a reader beside the node read the mark.
    let snapshot = read_snapshot::<Staged>(&f.state(), Some("boot-a")).unwrap();
    assert_eq!(snapshot.claims[&uid(1)], leaving("gpu-0"));
    assert_eq!(open_staged(&f).lock()[&uid(1)], leaving("gpu-0"));
    // Retiring an unknown claim changes nothing.
    assert!(cp.retire(&uid(9)).unwrap().is_none());
}

#[test]
fn a_retired_record_goes_later_unless_recorded_again() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    cp.retire(&uid(1)).unwrap();
    cp.drop_retired(&uid(1)).unwrap();
    assert!(!f.record(&uid(1)).exists());
    assert_eq!(spares(&f).len(), 1, "its file kept as a spare");
    assert!(journal_lines(&f).is_empty(), "no retired record left");
    // Prepared again before the removal came: the new record stays, and
    // a kill does not take it for the retired one.
    cp.put(uid(2), staged("gpu-1")).unwrap();
    cp.retire(&uid(2)).unwrap();
    cp.put(uid(2), staged("gpu-2")).unwrap();
    assert_eq!(open_staged(&f).lock()[&uid(2)], staged("gpu-2"));
    cp.drop_retired(&uid(2)).unwrap();
    assert_eq!(open_staged(&f).lock()[&uid(2)], staged("gpu-2"));
    // Already gone: fine.
    cp.drop_retired(&uid(1)).unwrap();
}

#[test]
fn a_claim_recorded_again_after_its_retired_record_went_is_not_marked() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    for n in [1, 3] {
        cp.put(uid(n), staged("gpu-0")).unwrap();
        cp.retire(&uid(n)).unwrap();
    }
    // Claim 3's record keeps the journal: claim 1's line stays in it.
    cp.drop_retired(&uid(1)).unwrap();
    assert_eq!(journal_lines(&f).len(), 2);
    cp.put(uid(1), staged("gpu-1")).unwrap();
    let again = open_staged(&f);
    assert_eq!(again.lock()[&uid(1)], staged("gpu-1"));
    assert_eq!(again.lock()[&uid(3)], leaving("gpu-0"));
    assert_eq!(journal_lines(&f), [format!("retired {}", uid(3))]);
    // The last retired record gone: the journal is emptied.
    again.remove(&uid(3)).unwrap();
    assert!(journal_lines(&f).is_empty());
}

#[test]
fn start_up_keeps_only_whole_lines_of_records_on_disk() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    cp.put(uid(2), staged("gpu-1")).unwrap();
    drop(cp);
    // Claim 4 has no record; a line torn by a power loss names claim 2.
    let text = format!(
        "retired {}\nretired {}\nsomething else\nretired {}",
        uid(1),
        uid(4),
        uid(2)
    );
    fs::write(journal(&f), text).unwrap();
    let cp = open_staged(&f);
    assert_eq!(cp.lock()[&uid(1)], leaving("gpu-0"));
    assert_eq!(cp.lock()[&uid(2)], staged("gpu-1"));
    assert_eq!(journal_lines(&f), [format!("retired {}", uid(1))]);
}

#[test]
fn the_journal_is_rewritten_when_it_grows_past_its_bound() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    cp.retire(&uid(1)).unwrap();
    // Claim 1's record stays on disk throughout: never emptied.
    for _ in 0..super::super::retired::MAX_LINES {
        cp.put(uid(2), staged("gpu-1")).unwrap();
        cp.retire(&uid(2)).unwrap();
    }
    let lines = journal_lines(&f).len();
    assert!(lines <= super::super::retired::MAX_LINES, "{lines} lines");
    let again = open_staged(&f);
    assert_eq!(again.lock()[&uid(1)], leaving("gpu-0"));
    assert_eq!(again.lock()[&uid(2)], leaving("gpu-1"));
}

#[test]
fn a_failed_mark_keeps_the_marked_entry_for_a_retry() {
    let f = Fixture::new();
    let cp = open_staged(&f);
    cp.put(uid(1), staged("gpu-0")).unwrap();
    // Something else in the journal's place: never written through.
    fs::create_dir(journal(&f)).unwrap();
    assert!(cp.retire(&uid(1)).is_err());
    assert!(cp.lock()[&uid(1)].leaving, "kept, marked, for the retry");
    fs::remove_dir(journal(&f)).unwrap();
    assert!(cp.retire(&uid(1)).unwrap().is_some());
    assert_eq!(open_staged(&f).lock()[&uid(1)], leaving("gpu-0"));
}

#[test]
fn a_retired_record_keeps_a_newer_versions_fields() {
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
    assert!(cp.retire(&uid(1)).unwrap().is_some());
    assert_eq!(cp.unknown_fields(&uid(1)), None);
    let again = open_staged(&f);
    assert_eq!(again.lock()[&uid(1)], leaving("gpu-0"));
    assert!(
        again.unknown_fields(&uid(1)).is_some(),
        "still in the record"
    );
}
