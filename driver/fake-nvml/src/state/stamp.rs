//! Whether the state file may have changed since this process read it,
//! without reading it again: the driver's NVML calls on an unchanged
//! machine cost a `stat`, as the real library's cost one ioctl, instead of
//! an open, a read and a comparison of the whole file.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime};

/// File timestamps come from the kernel's coarse clock (one tick: up to
/// 10 ms): a write in place within the tick of the previous change keeps
/// them. A file last changed longer than this before it was read is
/// trusted to show any later write in its timestamps.
const SETTLED: Duration = Duration::from_millis(50);

/// What the metadata of the file at the state path says of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    pub(super) fn of(meta: &Metadata) -> Stamp {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// Whether the file was last changed [`SETTLED`] before `read_at`.
    fn settled_before(&self, read_at: SystemTime) -> bool {
        let (secs, nanos) = self.ctime;
        let Ok(secs) = u64::try_from(secs) else {
            return false;
        };
        let changed =
            SystemTime::UNIX_EPOCH + Duration::new(secs, nanos.clamp(0, 999_999_999) as u32);
        changed + SETTLED < read_at
    }
}

/// The file as this process last read it: its stamp then, and when.
#[derive(Debug, Clone, Copy)]
pub(super) struct Read {
    pub(super) stamp: Stamp,
    pub(super) at: SystemTime,
}

impl Read {
    /// Whether the file now at the path, `now`, is the one read and holds
    /// what it held then.
    pub(super) fn unchanged(&self, now: &Metadata) -> bool {
        Stamp::of(now) == self.stamp && self.stamp.settled_before(self.at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_write_in_place_is_seen_and_a_fresh_change_never_trusted() {
        let path =
            std::env::temp_dir().join(format!("tessera-fake-nvml-stamp-{}", std::process::id()));
        std::fs::write(&path, "aaaa").unwrap();
        let read = |path: &std::path::Path| Read {
            stamp: Stamp::of(&std::fs::metadata(path).unwrap()),
            at: SystemTime::now(),
        };
        // Changed just before the read: a write in the same tick would
        // keep its timestamps, so it is read again.
        let fresh = read(&path);
        assert!(!fresh.unchanged(&std::fs::metadata(&path).unwrap()));
        std::thread::sleep(SETTLED + Duration::from_millis(20));
        let settled = read(&path);
        assert!(settled.unchanged(&std::fs::metadata(&path).unwrap()));
        // The same size, in place, right after the read.
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all(b"bbbb").unwrap();
        assert!(!settled.unchanged(&std::fs::metadata(&path).unwrap()));
        std::fs::remove_file(&path).unwrap();
    }
}
