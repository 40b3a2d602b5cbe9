//! Event injection: tests append `<uuid> <xid>` lines to the file named by
//! `TESSERA_FAKE_NVML_EVENTS`; `nvmlEventSetWait_v2` delivers them.
//!
//! Waiting blocks on inotify (watching the file's directory, so the file may
//! be created after the event set), never spins. Each wait slice is capped so
//! that a file system without inotify support still sees new lines, just
//! later.

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

/// One parsed injection line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injected {
    pub uuid: String,
    pub xid: u64,
}

/// Current length of the events file (0 when it does not exist yet).
pub fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Reads the complete lines after `offset` and advances it past them. A line
/// still being written (no newline yet) is left for the next read. A file that
/// shrank (truncated by the test) is read again from the start.
pub fn read_new(path: &Path, offset: &mut u64) -> Vec<Injected> {
    let Ok(mut file) = File::open(path) else {
        return Vec::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if len < *offset {
        *offset = 0;
    }
    let mut buf = Vec::new();
    if file.seek(SeekFrom::Start(*offset)).is_err() || file.read_to_end(&mut buf).is_err() {
        return Vec::new();
    }
    let Some(end) = buf.iter().rposition(|b| *b == b'\n') else {
        return Vec::new();
    };
    *offset += end as u64 + 1;
    String::from_utf8_lossy(&buf[..end])
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                return None;
            }
            let parsed = parse_line(line);
            if parsed.is_none() {
                eprintln!("tessera-fake-nvml: ignoring malformed event line {line:?} (want `<uuid> <xid>`)");
            }
            parsed
        })
        .collect()
}

fn parse_line(line: &str) -> Option<Injected> {
    let mut parts = line.split_whitespace();
    let uuid = parts.next()?.to_string();
    let xid = parts.next()?.parse().ok()?;
    if parts.next().is_some() {
        return None;
    }
    Some(Injected { uuid, xid })
}

/// Blocks until something changes in the events file's directory, or a timeout.
pub struct Watcher {
    fd: libc::c_int,
}

impl Watcher {
    /// `None` when inotify is unavailable; callers then wait in slices.
    pub fn new(path: &Path) -> Option<Watcher> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let dir = CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: inotify_init1 takes only flags and returns a new fd or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        let watcher = Watcher { fd };
        let mask = libc::IN_MODIFY | libc::IN_CREATE | libc::IN_MOVED_TO | libc::IN_CLOSE_WRITE;
        // SAFETY: `fd` is the inotify instance made above and `dir` is a
        // NUL-terminated string that outlives the call.
        let wd = unsafe { libc::inotify_add_watch(watcher.fd, dir.as_ptr(), mask) };
        (wd >= 0).then_some(watcher)
    }

    /// Waits up to `timeout` for a change, then drains pending notifications.
    pub fn wait(&self, timeout: Duration) {
        let mut pfd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `pfd` is one valid pollfd and the count passed is 1.
        let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ready > 0 {
            let mut buf = [0u8; 4096];
            // Drain so the next poll blocks again; the fd is non-blocking, so
            // this stops with EAGAIN once empty.
            loop {
                // SAFETY: `buf` is writable for `buf.len()` bytes.
                let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
                if n <= 0 {
                    break;
                }
            }
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // SAFETY: the fd is owned by this watcher and closed exactly once.
        unsafe {
            libc::close(self.fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn parses_lines_and_keeps_partial_ones() {
        let dir =
            std::env::temp_dir().join(format!("tessera-fake-nvml-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("events");
        std::fs::write(&path, "").unwrap();
        let mut offset = 0;
        assert!(read_new(&path, &mut offset).is_empty());
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        write!(f, "# comment\nGPU-a 79\nbogus\nGPU-b 4").unwrap();
        let got = read_new(&path, &mut offset);
        assert_eq!(
            got,
            vec![Injected {
                uuid: "GPU-a".into(),
                xid: 79
            }]
        );
        writeln!(f, "8").unwrap();
        let got = read_new(&path, &mut offset);
        assert_eq!(
            got,
            vec![Injected {
                uuid: "GPU-b".into(),
                xid: 48
            }]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
