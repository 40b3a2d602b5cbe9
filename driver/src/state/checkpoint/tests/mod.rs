use serde::Deserialize;

use super::lost::{QUARANTINE_MARK, moved_files};
use super::record::{FORMAT_VERSION, READ_ATTEMPTS, READ_FAULTS};
use super::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Entry {
    device: String,
}

impl super::Entry for Entry {
    fn retire(&mut self) {}
}

struct Fixture {
    dir: tempfile::TempDir,
    boot: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let boot = dir.path().join("boot_id");
        fs::write(&boot, "boot-a\n").unwrap();
        Fixture { dir, boot }
    }
    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }
    fn open(&self) -> (Checkpoint<Entry>, LoadOutcome) {
        Checkpoint::open(&self.state(), &self.boot).unwrap()
    }
    fn record(&self, claim: &ClaimUid) -> PathBuf {
        self.state()
            .join(RECORDS_DIR)
            .join(format!("{}.json", claim.as_str()))
    }
    /// Records claims 1 (`gpu-0`) and 2 (`gpu-1`), then flips one byte
    /// inside the first's embedded entry (valid JSON, bad checksum, the
    /// entry still decodes as `gpu-9`); the first's record path.
    fn two_claims_first_flipped(&self) -> PathBuf {
        let (cp, _) = self.open();
        cp.put(uid(1), entry("gpu-0")).unwrap();
        cp.put(uid(2), entry("gpu-1")).unwrap();
        let path = self.record(&uid(1));
        let text = fs::read_to_string(&path).unwrap().replace("gpu-0", "gpu-9");
        fs::write(&path, text).unwrap();
        path
    }
}

fn entry(device: &str) -> Entry {
    Entry {
        device: device.into(),
    }
}

fn uid(n: u8) -> ClaimUid {
    ClaimUid::parse(&format!("{n:08x}-0000-4000-8000-000000000000")).unwrap()
}

#[test]
fn entries_survive_restart_in_same_boot() {
    let f = Fixture::new();
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Fresh);
    cp.put(uid(1), entry("gpu-0")).unwrap();
    cp.put(uid(2), entry("gpu-1")).unwrap();
    cp.remove(&uid(2)).unwrap();
    assert!(!f.record(&uid(2)).exists(), "unprepare leaves no record");
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
    assert_eq!(cp.lock()[&uid(1)].device, "gpu-0");
    assert!(!cp.lock().contains_key(&uid(2)));
}

#[test]
fn a_change_writes_only_its_claims_record() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    cp.put(uid(1), entry("gpu-0")).unwrap();
    let first = fs::read(f.record(&uid(1))).unwrap();
    for n in 2..50 {
        cp.put(uid(n), entry(&format!("gpu-{n}"))).unwrap();
    }
    // The record of claim 1 is as written, whatever came after.
    assert_eq!(fs::read(f.record(&uid(1))).unwrap(), first);
    assert!(first.len() < 200, "{} bytes", first.len());
}

#[test]
fn concurrent_changes_are_all_on_disk_when_acknowledged() {
    let f = Fixture::new();
    let shared = std::sync::Arc::new(f.open().0);
    let threads: Vec<_> = (0..32u8)
        .map(|n| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                shared.put(uid(n), entry(&format!("gpu-{n}"))).unwrap();
                if n % 2 == 1 {
                    assert!(shared.remove(&uid(n)).unwrap().is_some());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 16 });
    for n in 0..32u8 {
        assert_eq!(cp.lock().contains_key(&uid(n)), n % 2 == 0, "claim {n}");
    }
    assert_eq!(shared.remove(&uid(1)).unwrap(), None);
}

#[test]
fn a_failed_write_undoes_the_change_in_memory() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    cp.put(uid(1), entry("gpu-0")).unwrap();
    // The records directory becomes a file: every write fails.
    let records = f.state().join(RECORDS_DIR);
    fs::remove_dir_all(&records).unwrap();
    fs::write(&records, "").unwrap();
    assert!(matches!(
        cp.put(uid(2), entry("gpu-1")),
        Err(CheckpointError::Write { .. })
    ));
    assert!(matches!(
        cp.put(uid(1), entry("gpu-7")),
        Err(CheckpointError::Write { .. })
    ));
    assert!(cp.remove(&uid(1)).is_err());
    let claims = cp.lock();
    assert!(
        !claims.contains_key(&uid(2)),
        "a change that failed to persist stays"
    );
    assert_eq!(claims[&uid(1)].device, "gpu-0");
}

#[test]
fn a_staged_entry_is_seen_at_once_and_written_with_the_claim() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    cp.stage(uid(1), entry("held"));
    assert_eq!(cp.lock()[&uid(1)].device, "held");
    assert!(!f.record(&uid(1)).exists());
    cp.put(uid(1), entry("done")).unwrap();
    assert_eq!(f.open().0.lock()[&uid(1)].device, "done");
}

#[test]
fn reboot_discards_entries() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    cp.put(uid(1), entry("gpu-0")).unwrap();
    fs::write(&f.boot, "boot-b\n").unwrap();
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::PreviousBoot { claims: 1 });
    assert!(cp.lock().is_empty());
    assert!(!f.record(&uid(1)).exists());
    // A complete account: no claim of this boot is lost.
    let lost = cp.lost();
    assert!(lost.claims.is_empty() && !lost.unnamed);
    assert_eq!(f.open().1, LoadOutcome::Fresh);
}

#[test]
fn corruption_is_quarantined_not_fatal() {
    let f = Fixture::new();
    let path = f.two_claims_first_flipped();
    let (cp, outcome) = f.open();
    let LoadOutcome::Quarantined {
        reason,
        moved_to,
        restored,
    } = &outcome
    else {
        panic!("expected quarantine, got {outcome:?}");
    };
    assert!(reason.contains("checksum mismatch"), "{reason}");
    assert!(reason.contains(uid(1).as_str()), "{reason}");
    assert_eq!(moved_to.len(), 1);
    assert!(moved_to[0].exists());
    assert!(!path.exists());
    assert_eq!(*restored, 1, "the other claim's record is intact");
    assert_eq!(cp.lock().keys().collect::<Vec<_>>(), [&uid(2)]);
    // Not a complete account: the claim of the moved-aside record may
    // still be prepared.
    assert!(cp.lost().may_hold(&uid(1)));
    // Moved aside for good: the next start finds only the intact one.
    assert_eq!(f.open().1, LoadOutcome::Restored { claims: 1 });
}

#[test]
fn a_lost_claim_stays_lost_across_restarts_until_released() {
    let f = Fixture::new();
    f.two_claims_first_flipped();
    let (cp, _) = f.open();
    let lost = cp.lost();
    assert!(!lost.unnamed);
    // Salvaged as the bytes say, checksum or not: a hint of what to
    // release, never a record.
    assert_eq!(lost.claims[&uid(1)], Some(entry("gpu-9")));
    assert!(lost.may_hold(&uid(1)) && !lost.may_hold(&uid(2)));
    assert!(!cp.lock().contains_key(&uid(1)));

    // The next start (same boot) still knows it is lost.
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
    assert!(cp.lost().may_hold(&uid(1)));
    assert_eq!(
        cp.release_lost(&uid(1)).unwrap(),
        Some(Some(entry("gpu-9")))
    );
    assert!(!cp.lost().may_hold(&uid(1)));
    assert_eq!(cp.release_lost(&uid(1)).unwrap(), None);
}

#[test]
fn lost_records_of_another_boot_or_without_a_name_are_told_apart() {
    let f = Fixture::new();
    let records = f.state().join(RECORDS_DIR);
    fs::create_dir_all(&records).unwrap();
    let foreign = r#"{"version":2,"bootId":"boot-z","crc32":1,"entry":"{}"}"#;
    fs::write(records.join(format!("{}.json", uid(1).as_str())), foreign).unwrap();
    fs::write(
        records.join(format!("{}.json", uid(2).as_str())),
        b"{\"vers",
    )
    .unwrap();
    let (cp, _) = f.open();
    let lost = cp.lost();
    // Its own bytes say it is of another boot: nothing it named exists.
    assert!(!lost.may_hold(&uid(1)));
    // Unreadable: lost, with nothing salvaged.
    assert_eq!(lost.claims.get(&uid(2)), Some(&None));
    assert!(!lost.unnamed);
    fs::write(records.join("not-a-uid.json"), b"{}").unwrap();
    assert!(f.open().0.lost().unnamed);
}

/// A moved-aside record's name, as start-up gives it in `boot`.
fn moved_name(claim: &ClaimUid, stamp: u64, boot: &str) -> String {
    format!("{}.json{QUARANTINE_MARK}{stamp}.{boot}", claim.as_str())
}

#[test]
fn moved_aside_records_that_mark_no_lost_claim_are_pruned_to_the_newest() {
    let f = Fixture::new();
    let records = f.state().join(RECORDS_DIR);
    fs::create_dir_all(&records).unwrap();
    let total = QUARANTINE_KEPT + 5;
    // Of an earlier boot: nothing they name exists.
    for n in 0..total {
        let name = moved_name(&uid(1), 1000 + n as u64, "boot-old");
        fs::write(records.join(name), b"x").unwrap();
    }
    f.open();
    let left = moved_files(&records);
    assert_eq!(left.len(), QUARANTINE_KEPT);
    assert_eq!(left[0].stamp, 1005, "the oldest go first");
}

#[test]
fn seventy_moved_aside_records_are_seventy_lost_claims_across_restarts() {
    let f = Fixture::new();
    let records = f.state().join(RECORDS_DIR);
    fs::create_dir_all(&records).unwrap();
    for n in 0..70u8 {
        fs::write(
            f.record(&uid(n)),
            b"{\"version\":2,\"bootId\":\"boot-a\",\"crc",
        )
        .unwrap();
    }
    let (cp, outcome) = f.open();
    assert!(
        matches!(outcome, LoadOutcome::Quarantined { .. }),
        "{outcome:?}"
    );
    assert_eq!(cp.lost().claims.len(), 70);
    let (cp, _) = f.open();
    assert_eq!(cp.lost().claims.len(), 70, "none pruned at the next start");
    assert_eq!(moved_files(&records).len(), 70);
}

#[test]
fn seventy_records_with_a_newer_field_are_kept_with_what_is_known() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    for n in 0..70u8 {
        cp.put(uid(n), entry(&format!("gpu-{n}"))).unwrap();
    }
    drop(cp);
    // What a newer version writes: the same version, one more field.
    for n in 0..70u8 {
        let text = format!(r#"{{"device":"gpu-{n}","partition":{{"slices":2}}}}"#);
        let record = serde_json::json!({
            "version": FORMAT_VERSION,
            "bootId": "boot-a",
            "crc32": crc32fast::hash(text.as_bytes()),
            "entry": text,
        });
        fs::write(f.record(&uid(n)), record.to_string()).unwrap();
    }
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 70 });
    assert_eq!(cp.lock()[&uid(7)], entry("gpu-7"));
    let lost = cp.lost();
    assert!(lost.claims.is_empty() && !lost.unnamed);
    let newer = cp.with_unknown_fields();
    assert_eq!(newer.len(), 70);
    assert_eq!(newer[&uid(7)], ["entry.partition"]);
    assert!(cp.remove(&uid(7)).unwrap().is_some());
    assert_eq!(cp.unknown_fields(&uid(7)), None);
}

#[test]
fn a_record_that_cannot_be_read_is_retried_and_never_lost() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    cp.put(uid(1), entry("gpu-0")).unwrap();
    drop(cp);
    let fail_next = |errnos: &[i32]| READ_FAULTS.with(|q| q.borrow_mut().extend(errnos));

    // Out of file descriptors once: read again.
    fail_next(&[libc::EMFILE]);
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
    assert!(cp.lost().claims.is_empty());
    drop(cp);

    // The disk keeps failing: start-up fails, the record stays as it is.
    fail_next(&[libc::EIO; READ_ATTEMPTS as usize]);
    let err = Checkpoint::<Entry>::open(&f.state(), &f.boot).unwrap_err();
    assert!(matches!(err, CheckpointError::Read { .. }), "{err}");
    assert!(err.to_string().contains(uid(1).as_str()), "{err}");
    assert!(f.record(&uid(1)).exists());
    assert!(moved_files(&f.state().join(RECORDS_DIR)).is_empty());

    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
    assert!(!cp.lost().may_hold(&uid(1)));
}

#[test]
fn a_released_lost_claim_stays_released_after_a_restart() {
    let f = Fixture::new();
    f.two_claims_first_flipped();
    let (cp, _) = f.open();
    assert_eq!(
        cp.release_lost(&uid(1)).unwrap(),
        Some(Some(entry("gpu-9")))
    );
    let (cp, _) = f.open();
    assert!(!cp.lost().may_hold(&uid(1)), "released for this boot");
    // Still there for inspection.
    let moved = moved_files(&f.state().join(RECORDS_DIR));
    assert!(moved.len() == 1 && moved[0].released, "{:?}", moved[0].name);
}

#[test]
fn a_record_moved_aside_in_an_earlier_boot_marks_no_claim_lost() {
    let f = Fixture::new();
    let records = f.state().join(RECORDS_DIR);
    fs::create_dir_all(&records).unwrap();
    // Unreadable bytes: only the name tells the boot.
    fs::write(records.join(moved_name(&uid(1), 5, "boot-old")), b"\xff").unwrap();
    fs::write(records.join(moved_name(&uid(2), 5, "boot-a")), b"\xff").unwrap();
    let lost = f.open().0.lost();
    assert!(!lost.may_hold(&uid(1)));
    assert_eq!(lost.claims.get(&uid(2)), Some(&None));
    assert!(lost.in_part.contains(&uid(2)));
}

#[test]
fn truncated_foreign_and_misnamed_records_are_quarantined() {
    for (name, content) in [
        (
            format!("{}.json", uid(1).as_str()),
            &b"{\"version\":2,\"bootId\":\"boot-a\",\"crc"[..],
        ),
        (
            format!("{}.json", uid(1).as_str()),
            b"{\"version\":7,\"bootId\":\"boot-a\",\"crc32\":0,\"entry\":\"{}\"}",
        ),
        (format!("{}.json", uid(1).as_str()), b"\xff\xfe"),
        ("not-a-uid.json".to_owned(), b"{}"),
    ] {
        let f = Fixture::new();
        let records = f.state().join(RECORDS_DIR);
        fs::create_dir_all(&records).unwrap();
        fs::write(records.join(&name), content).unwrap();
        let (_, outcome) = f.open();
        assert!(
            matches!(outcome, LoadOutcome::Quarantined { .. }),
            "{name}: {outcome:?}"
        );
    }
}

#[test]
fn a_version_1_file_is_split_into_records() {
    let f = Fixture::new();
    let claims = BTreeMap::from([(uid(1), entry("gpu-0")), (uid(2), entry("gpu-1"))]);
    let text = serde_json::to_string(&claims).unwrap();
    let legacy = serde_json::json!({
        "version": 1,
        "bootId": "boot-a",
        "crc32": crc32fast::hash(text.as_bytes()),
        "claims": text,
    });
    fs::create_dir_all(f.state()).unwrap();
    fs::write(f.state().join(LEGACY_FILE), legacy.to_string()).unwrap();
    let snapshot = read_snapshot::<Entry>(&f.state(), Some("boot-a")).unwrap();
    assert_eq!(
        snapshot.claims, claims,
        "status reads a file not yet migrated"
    );

    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 2 });
    assert_eq!(*cp.lock(), claims);
    assert!(!f.state().join(LEGACY_FILE).exists());
    assert!(f.record(&uid(2)).exists());
    assert_eq!(*f.open().0.lock(), claims);
}

#[test]
fn a_snapshot_keeps_the_boot_asked_for() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    cp.put(uid(1), entry("gpu-0")).unwrap();
    let records = f.state().join(RECORDS_DIR);
    fs::write(
        records.join(format!("{}.json", uid(3).as_str())),
        "nonsense",
    )
    .unwrap();
    fs::write(records.join(".x.json.tmp-1"), "half").unwrap();
    let mine = read_snapshot::<Entry>(&f.state(), Some("boot-a")).unwrap();
    assert_eq!(mine.claims.keys().collect::<Vec<_>>(), [&uid(1)]);
    assert_eq!(mine.unreadable.len(), 1, "{:?}", mine.unreadable);
    let other = read_snapshot::<Entry>(&f.state(), Some("boot-b")).unwrap();
    assert!(other.claims.is_empty());
    assert_eq!(other.other_boots, 1);
    let none = read_snapshot::<Entry>(&f.dir.path().join("nowhere"), None).unwrap();
    assert!(none.claims.is_empty() && none.unreadable.is_empty());
}

#[test]
fn legacy_entries_with_crafted_uids_are_rejected() {
    let claims = r#"{"../../etc/passwd":{"device":"gpu-0"}}"#;
    let envelope = format!(
        r#"{{"version":1,"bootId":"boot-a","crc32":{},"claims":{}}}"#,
        crc32fast::hash(claims.as_bytes()),
        serde_json::to_string(claims).unwrap()
    );
    let err = decode_legacy::<Entry>(envelope.as_bytes()).unwrap_err();
    assert!(err.to_string().contains("not a Kubernetes UID"), "{err}");
}

#[test]
fn why_a_record_is_refused_reads_as_before_and_keeps_its_cause() {
    use std::error::Error as _;
    let err = decode_record::<Entry>(b"nonsense").unwrap_err();
    assert!(
        err.to_string().starts_with("not a checkpoint record: "),
        "{err}"
    );
    assert!(err.source().is_some(), "the JSON error is kept");
    let newer = String::from_utf8(encode_record("b", &entry("gpu-0")))
        .unwrap()
        .replace(r#""version":2"#, r#""version":3"#);
    let err = decode_record::<Entry>(newer.as_bytes()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "checkpoint version 3 is not supported here (expected version 2)"
    );
    let flipped = String::from_utf8(encode_record("b", &entry("gpu-0")))
        .unwrap()
        .replace("gpu-0", "gpu-9");
    let err = decode_record::<Entry>(flipped.as_bytes()).unwrap_err();
    assert!(
        matches!(err, RecordError::Checksum { recorded, computed } if recorded != computed),
        "{err:?}"
    );
    assert!(err.to_string().starts_with("checksum mismatch: recorded "));
}

#[test]
fn decoder_never_panics_on_noise() {
    // Deterministic xorshift noise plus mutations of a valid record.
    let mut state = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let valid = encode_record("b", &entry("gpu-0"));
    for _ in 0..2000 {
        let mut bytes = valid.clone();
        for _ in 0..(next() % 4 + 1) {
            let i = (next() as usize) % bytes.len();
            bytes[i] = next() as u8;
        }
        fuzz_decode(&bytes);
        let noise: Vec<u8> = (0..next() % 64).map(|_| next() as u8).collect();
        fuzz_decode(&noise);
    }
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::symlink_metadata(path).unwrap().ino()
}

fn spares(f: &Fixture) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(f.state().join(RECORDS_DIR))
        .unwrap()
        .flatten()
        .filter(|e| crate::cdi::spare::is_spare(e.file_name().to_str().unwrap(), ".spare-"))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

#[test]
fn a_removed_record_file_is_reused_by_the_next_write() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    cp.put(uid(1), entry("gpu-0")).unwrap();
    let file = inode(&f.record(&uid(1)));
    cp.remove(&uid(1)).unwrap();
    assert!(!f.record(&uid(1)).exists());
    assert_eq!(spares(&f).len(), 1, "kept as a spare, not unlinked");
    // The next record goes into that file: no file is created.
    cp.put(uid(2), entry("gpu-1")).unwrap();
    assert_eq!(inode(&f.record(&uid(2))), file);
    assert!(spares(&f).is_empty());
    // Spares are never read as records, by this process or the next.
    cp.put(uid(3), entry("gpu-3")).unwrap();
    cp.remove(&uid(3)).unwrap();
    let (again, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 1 });
    assert_eq!(again.lock()[&uid(2)].device, "gpu-1");
    assert_eq!(again.spares.count(), 1, "adopted");
    let snapshot = read_snapshot::<Entry>(&f.state(), Some("boot-a")).unwrap();
    assert_eq!(snapshot.claims.len(), 1);
}

#[test]
fn a_spare_holding_anything_is_overwritten_whole_and_links_are_not_followed() {
    let f = Fixture::new();
    let records = f.state().join(RECORDS_DIR);
    fs::create_dir_all(&records).unwrap();
    // A long half-written spare, and a spare that is a link to a file
    // elsewhere (as if planted).
    fs::write(records.join(".spare-1-0"), vec![b'x'; 64 << 10]).unwrap();
    let outside = f.dir.path().join("outside");
    fs::write(&outside, "keep").unwrap();
    std::os::unix::fs::symlink(&outside, records.join(".spare-1-1")).unwrap();
    let (cp, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Fresh);
    cp.put(uid(1), entry("gpu-0")).unwrap();
    cp.put(uid(2), entry("gpu-1")).unwrap();
    assert_eq!(fs::read_to_string(&outside).unwrap(), "keep");
    let (again, outcome) = f.open();
    assert_eq!(outcome, LoadOutcome::Restored { claims: 2 });
    assert_eq!(again.lock()[&uid(1)].device, "gpu-0");
    assert_eq!(again.lock()[&uid(2)].device, "gpu-1");
}

#[test]
fn spares_are_kept_up_to_their_bound() {
    let f = Fixture::new();
    let (cp, _) = f.open();
    let n = crate::cdi::spare::MAX_SPARES + 3;
    for i in 0..n {
        let claim = ClaimUid::parse(&format!("{i:08x}-0000-4000-8000-000000000001")).unwrap();
        cp.put(claim, entry("gpu-0")).unwrap();
    }
    let claims: Vec<ClaimUid> = cp.lock().keys().cloned().collect();
    for claim in claims {
        cp.remove(&claim).unwrap();
    }
    assert_eq!(spares(&f).len(), crate::cdi::spare::MAX_SPARES);
}

mod retire;
