//! The node process's heap: how glibc's allocator is tuned, and the
//! scavenger that hands freed memory back to the kernel.
//!
//! glibc keeps what a program frees for reuse and returns only the top of
//! each arena, so one burst (the publisher's first list and model build, a
//! thousand prepares) leaves the process at its peak for good: measured at
//! start, 13.9 MiB anonymous of which 0.8 MiB was in use. Go's runtime
//! scavenges freed pages in the background; this is the same for glibc: a
//! check once a second, and `malloc_trim` (which also releases free pages
//! in the middle of an arena) when it holds more freed memory than after
//! the last one.

use std::time::Duration;

use tracing::debug;

/// glibc gives every thread that allocates an arena of its own (up to 8 per
/// core), each keeping freed memory for reuse; two are enough for a process
/// whose threads mostly wait. Call before any other thread exists.
pub fn limit_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator tunable; the caller runs it
    // before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// How often the scavenger looks.
pub const SCAVENGE_PERIOD: Duration = Duration::from_secs(1);

/// Memory faulted in or freed since the last trim that makes the next one
/// worth its cost (a walk of the free lists and an `madvise` per free run
/// of pages; pages fault back in when reused).
const TRIM_AFTER: u64 = 1 << 20;

/// Returns freed heap to the kernel while the process lives: every
/// `period`, when since the last trim the process grew (what a burst
/// faulted in may have been freed meanwhile) or freed (a thousand claims
/// unprepared frees what they held without shrinking the process) by
/// [`TRIM_AFTER`]. A trim takes well under a millisecond.
pub async fn scavenge(period: Duration) {
    let mut last = Heap {
        anonymous: 0,
        in_use: 0,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(before) = Heap::now() else {
            return;
        };
        if before.moved_since(&last) < TRIM_AFTER {
            continue;
        }
        trim();
        last = Heap::now().unwrap_or(before);
        debug!(
            before_kib = before.anonymous >> 10,
            after_kib = last.anonymous >> 10,
            in_use_kib = last.in_use >> 10,
            "returned freed heap to the kernel"
        );
    }
}

/// What the process holds, in bytes.
#[derive(Debug, Clone, Copy)]
struct Heap {
    /// Resident anonymous memory (resident minus file-backed and shared
    /// pages, `/proc/self/statm`): heap, stacks, relocated data.
    anonymous: u64,
    /// The allocator's bytes handed out and not freed (`mallinfo2`).
    in_use: u64,
}

impl Heap {
    /// `None` where the figures cannot be read (no `/proc`, another libc).
    fn now() -> Option<Heap> {
        Some(Heap {
            anonymous: anonymous_bytes()?,
            in_use: allocated()?,
        })
    }

    /// Bytes faulted in plus bytes freed since `last` (each measured
    /// against its own figure there: the allocator's count includes
    /// allocations never touched, so the two are not compared).
    fn moved_since(&self, last: &Heap) -> u64 {
        self.anonymous.saturating_sub(last.anonymous) + last.in_use.saturating_sub(self.in_use)
    }
}

/// The process's resident anonymous memory in bytes (resident minus
/// file-backed and shared pages, `/proc/self/statm`); `None` without
/// `/proc`.
pub fn anonymous_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    Some(parse_statm_anonymous(&statm)? * page_size())
}

#[cfg(target_env = "gnu")]
fn allocated() -> Option<u64> {
    // SAFETY: mallinfo2 only reads the allocator's counters under its locks.
    let info = unsafe { libc::mallinfo2() };
    Some((info.uordblks + info.hblkhd) as u64)
}

#[cfg(not(target_env = "gnu"))]
fn allocated() -> Option<u64> {
    None
}

/// Releases every free page of every arena.
fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes the allocator's own locks; it is safe to
    // call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `statm` is `size resident shared text lib data dt`, in pages.
fn parse_statm_anonymous(statm: &str) -> Option<u64> {
    let mut fields = statm.split_whitespace().skip(1);
    let resident: u64 = fields.next()?.parse().ok()?;
    let shared: u64 = fields.next()?.parse().ok()?;
    Some(resident.saturating_sub(shared))
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the running kernel.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statm_gives_resident_minus_shared_pages() {
        assert_eq!(
            parse_statm_anonymous("9000 3000 1000 400 0 5000 0\n"),
            Some(2000)
        );
        assert_eq!(parse_statm_anonymous("9000"), None);
        assert_eq!(parse_statm_anonymous("9000 x 1"), None);
    }
}
