//! One record's bytes: encoded with a version and a checksum, read back
//! with retries, decoded with what this version does not know kept aside.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::claim_uid::{ClaimUid, InvalidClaimUid};

/// The version records are written in.
pub(super) const FORMAT_VERSION: u32 = 2;
/// Version 1: every claim in one file, rewritten whole on each change.
const LEGACY_VERSION: u32 = 1;
/// Attempts to read a record before start-up fails.
pub(super) const READ_ATTEMPTS: u32 = 3;

/// One claim's record on disk.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Record {
    version: u32,
    boot_id: String,
    crc32: u32,
    entry: String,
}

/// Version 1's single file.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LegacyEnvelope {
    version: u32,
    boot_id: String,
    crc32: u32,
    claims: String,
}

/// The bytes of `entry`'s record, written in boot `boot_id`.
pub(super) fn encode_record<T: Serialize>(boot_id: &str, entry: &T) -> Vec<u8> {
    // Serializing plain data structs into JSON cannot fail.
    let entry = serde_json::to_string(entry).expect("checkpoint entries serialize");
    let record = Record {
        version: FORMAT_VERSION,
        boot_id: boot_id.to_owned(),
        crc32: crc32fast::hash(entry.as_bytes()),
        entry,
    };
    serde_json::to_vec(&record).expect("checkpoint record serializes")
}

/// Why a record (or a version 1 file) was not read. [`RecordError::Io`]
/// is a fault of the disk or the process, and the bytes may be fine; every
/// other variant says the bytes are not a record this version reads.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Reading the file failed (EIO, EMFILE, ...).
    #[error("cannot read it: {0}")]
    Io(#[source] std::io::Error),
    /// The file's name is not a claim UID.
    #[error(transparent)]
    Name(#[from] InvalidClaimUid),
    /// Not the JSON of a record.
    #[error("not a checkpoint record: {0}")]
    NotRecord(#[source] serde_json::Error),
    /// Not the JSON of a version 1 file.
    #[error("not a checkpoint envelope: {0}")]
    NotEnvelope(#[source] serde_json::Error),
    /// Written by a version whose format this one does not read.
    #[error("checkpoint version {found} is not supported here (expected version {expected})")]
    Version { found: u32, expected: u32 },
    /// The embedded text is not what was written (torn or bit-flipped).
    #[error("checksum mismatch: recorded {recorded:08x}, computed {computed:08x}")]
    Checksum { recorded: u32, computed: u32 },
    /// The entry is not one this version can read.
    #[error("checkpoint entry does not decode: {0}")]
    Entry(#[source] serde_json::Error),
    /// A version 1 file's entries are not ones this version can read.
    #[error("checkpoint entries do not decode: {0}")]
    Entries(#[source] serde_json::Error),
}

/// Checks a version and a checksum.
fn verify(version: u32, expected: u32, crc32: u32, text: &str) -> Result<(), RecordError> {
    if version != expected {
        return Err(RecordError::Version {
            found: version,
            expected,
        });
    }
    let computed = crc32fast::hash(text.as_bytes());
    if computed != crc32 {
        return Err(RecordError::Checksum {
            recorded: crc32,
            computed,
        });
    }
    Ok(())
}

/// One record as read.
pub(super) struct ReadRecord<T> {
    pub(super) claim: ClaimUid,
    pub(super) boot: String,
    pub(super) entry: T,
    /// Fields of the entry this version does not know.
    pub(super) unknown: Vec<String>,
}

/// Reads the record file `path` named `<stem>.json`: its claim (the file
/// name), boot and entry.
pub(super) fn read_record<T: DeserializeOwned + Serialize>(
    stem: &str,
    path: &Path,
) -> Result<ReadRecord<T>, RecordError> {
    let claim = ClaimUid::parse(stem)?;
    let bytes = read_retrying(path).map_err(RecordError::Io)?;
    let (boot, entry, unknown) = decode_known(&bytes)?;
    Ok(ReadRecord {
        claim,
        boot,
        entry,
        unknown,
    })
}

/// Reads a file, trying again after a failure that may pass (a process
/// out of file descriptors, an interrupted or timed-out device read).
fn read_retrying(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut attempt = 1;
    loop {
        match read_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound && attempt < READ_ATTEMPTS => {
                tracing::warn!("reading {} failed (attempt {attempt}): {e}", path.display());
                std::thread::sleep(std::time::Duration::from_millis(20 << attempt));
                attempt += 1;
            }
            read => return read,
        }
    }
}

#[cfg(not(test))]
fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    fs::read(path)
}

#[cfg(test)]
thread_local! {
    /// Errors the next reads of records on this thread fail with, in order.
    pub(super) static READ_FAULTS: std::cell::RefCell<std::collections::VecDeque<i32>> =
        Default::default();
}

#[cfg(test)]
fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    match READ_FAULTS.with(|f| f.borrow_mut().pop_front()) {
        Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
        None => fs::read(path),
    }
}

/// Decodes one claim's record: its boot and entry.
pub(crate) fn decode_record<T: DeserializeOwned + Serialize>(
    bytes: &[u8],
) -> Result<(String, T), RecordError> {
    decode_known(bytes).map(|(boot, entry, _)| (boot, entry))
}

/// Decodes one claim's record: its boot, its entry, and the fields of the
/// entry this version does not know (ignored by the decode).
fn decode_known<T: DeserializeOwned + Serialize>(
    bytes: &[u8],
) -> Result<(String, T, Vec<String>), RecordError> {
    let record: Record = serde_json::from_slice(bytes).map_err(RecordError::NotRecord)?;
    verify(record.version, FORMAT_VERSION, record.crc32, &record.entry)?;
    let written: serde_json::Value =
        serde_json::from_str(&record.entry).map_err(RecordError::Entry)?;
    let entry: T = serde_json::from_value(written.clone()).map_err(RecordError::Entry)?;
    let known = serde_json::to_value(&entry).unwrap_or_default();
    let mut unknown = Vec::new();
    unknown_fields(&written, &known, "entry", &mut unknown);
    Ok((record.boot_id, entry, unknown))
}

/// Paths of what `written` has and `known` (the same entry as this version
/// decoded it and would write it) lacks: fields, or list items, a newer
/// version added. Empty values are what this version leaves out itself.
fn unknown_fields(
    written: &serde_json::Value,
    known: &serde_json::Value,
    path: &str,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    match (written, known) {
        (Value::Object(w), Value::Object(k)) => {
            for (key, value) in w {
                let here = format!("{path}.{key}");
                match k.get(key) {
                    Some(known) => unknown_fields(value, known, &here, out),
                    None if is_empty(value) => {}
                    None => out.push(here),
                }
            }
        }
        (Value::Array(w), Value::Array(k)) if w.len() == k.len() => {
            for (i, (value, known)) in w.iter().zip(k).enumerate() {
                unknown_fields(value, known, &format!("{path}[{i}]"), out);
            }
        }
        (Value::Array(w), Value::Array(k)) => out.push(format!(
            "{path} ({} of {} items)",
            w.len().saturating_sub(k.len()),
            w.len()
        )),
        (Value::Array(w), _) if !w.is_empty() => out.push(path.to_owned()),
        (Value::Object(w), _) if !w.is_empty() => out.push(path.to_owned()),
        _ => {}
    }
}

fn is_empty(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Null => true,
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

/// Decodes a version 1 file: its boot and every claim's entry.
pub(crate) fn decode_legacy<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<(String, BTreeMap<ClaimUid, T>), RecordError> {
    let envelope: LegacyEnvelope =
        serde_json::from_slice(bytes).map_err(RecordError::NotEnvelope)?;
    verify(
        envelope.version,
        LEGACY_VERSION,
        envelope.crc32,
        &envelope.claims,
    )?;
    let claims = serde_json::from_str(&envelope.claims).map_err(RecordError::Entries)?;
    Ok((envelope.boot_id, claims))
}
