//! Counting the publisher's API writes: the zero-write check on restart,
//! and later metrics.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Writes made, as plain numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WriteCounts {
    /// Slices created (server-side apply of a slice that did not exist).
    pub creates: u64,
    /// Slices updated (server-side apply of an existing slice).
    pub updates: u64,
    /// Slices deleted.
    pub deletes: u64,
}

impl WriteCounts {
    /// All writes together.
    pub fn total(&self) -> u64 {
        self.creates + self.updates + self.deletes
    }
}

impl std::ops::Sub for WriteCounts {
    type Output = WriteCounts;
    fn sub(self, rhs: WriteCounts) -> WriteCounts {
        WriteCounts {
            creates: self.creates - rhs.creates,
            updates: self.updates - rhs.updates,
            deletes: self.deletes - rhs.deletes,
        }
    }
}

/// Running totals, shared with whoever reports them (cheap to clone via
/// `Arc`). Only calls the server accepted are counted as writes; refused
/// ones count in `rejected`. Dry runs (capability probes) are not writes.
#[derive(Debug, Default)]
pub struct WriteCounters {
    creates: AtomicU64,
    updates: AtomicU64,
    deletes: AtomicU64,
    rejected: AtomicU64,
    reconciles: AtomicU64,
}

impl WriteCounters {
    pub fn snapshot(&self) -> WriteCounts {
        WriteCounts {
            creates: self.creates.load(Ordering::Relaxed),
            updates: self.updates.load(Ordering::Relaxed),
            deletes: self.deletes.load(Ordering::Relaxed),
        }
    }

    /// Writes the server refused (invalid, forbidden, ...).
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Reconcile passes run, successful or not.
    pub fn reconciles(&self) -> u64 {
        self.reconciles.load(Ordering::Relaxed)
    }

    pub(crate) fn created(&self) {
        self.creates.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn updated(&self) {
        self.updates.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn deleted(&self) {
        self.deletes.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn refused(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn reconciled(&self) {
        self.reconciles.fetch_add(1, Ordering::Relaxed);
    }
}
