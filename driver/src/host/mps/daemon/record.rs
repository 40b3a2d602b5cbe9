//! A daemon's host-only record (`daemon.json`): which claim, request and
//! device, the limits, and the daemon's identity or the secret launch id of
//! one being spawned.

use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::DaemonKey;
use crate::cdi;
use crate::host::mps::config::MpsError;
use crate::host::mps::paths::RECORD;
use crate::host::mps_client::ClientLimits;
use crate::host::process::ProcessId;

/// The state of one daemon, as recorded on disk (host-only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(in crate::host::mps) struct Record {
    pub key: DaemonKey,
    pub limits: ClientLimits,
    /// The minor of the GPU whose device node (`/dev/nvidia<minor>`) the
    /// daemon sees; absent in records of earlier versions, whose daemons
    /// see every GPU node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_minor: Option<u32>,
    /// The daemon this driver spawned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemon: Option<ProcessId>,
    /// The secret launch id of a daemon being spawned, until its identity
    /// is recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<String>,
}

impl Record {
    /// The record of `key` in its directory `root`, else a new one with
    /// `limits` (`None` without either). A record of another key (a clash
    /// of the directory's hash) is an error.
    pub fn read(
        root: &Path,
        key: &DaemonKey,
        limits: Option<ClientLimits>,
    ) -> Result<Option<Self>, MpsError> {
        let path = root.join(RECORD);
        let io = |source| MpsError::Io {
            device: key.device.clone(),
            what: "reading the record",
            path: path.clone(),
            source,
        };
        let read = fs::read(&path).and_then(|bytes| {
            serde_json::from_slice::<Record>(&bytes)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        });
        let record = match read {
            Ok(record) => record,
            // Unreadable and written before this boot: torn by a power loss
            // or crash, as a record written without fsync may be; what it
            // named ended with that boot.
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound || written_before_this_boot(&path) =>
            {
                match limits {
                    Some(limits) => Record {
                        key: key.clone(),
                        limits,
                        gpu_minor: None,
                        daemon: None,
                        launch: None,
                    },
                    None => return Ok(None),
                }
            }
            Err(e) => return Err(io(e)),
        };
        if record.key != *key {
            return Err(io(std::io::Error::other(format!(
                "its directory is also the hash of {}",
                record.key
            ))));
        }
        Ok(Some(record))
    }

    /// Written atomically into `root`, made if missing, for this boot (no
    /// fsync: the daemon it names ends with the boot; a record torn by a
    /// power loss is told apart by its age at the next boot).
    pub fn write(&self, root: &Path) -> Result<(), MpsError> {
        let io = |what, path: &Path| {
            let device = self.key.device.clone();
            let path = path.to_owned();
            move |source| MpsError::Io {
                device,
                what,
                path,
                source,
            }
        };
        fs::create_dir_all(root).map_err(io("creating", root))?;
        let path = root.join(RECORD);
        let bytes = serde_json::to_vec_pretty(self).expect("a record serializes");
        cdi::write_for_this_boot(&path, &bytes).map_err(io("writing the record", &path))
    }
}

/// Whether the file at `path` was last written before the running kernel
/// booted (for a record found unreadable: torn by that boot's end).
pub(in crate::host::mps) fn written_before_this_boot(path: &Path) -> bool {
    let written = fs::metadata(path).and_then(|m| m.modified()).ok();
    written.zip(booted_at()).is_some_and(|(w, b)| w < b)
}

/// When the running kernel booted (`btime` of `/proc/stat`).
fn booted_at() -> Option<SystemTime> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let secs = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(secs))
}
