//! Counting the publisher's API requests: writes (the zero-write check on
//! restart, metrics) and the reads a reconcile makes (what a reconcile with
//! nothing changed costs the API server; the cluster-scale figures).

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

/// Reads a reconcile made, as plain numbers. The publisher's watch of its
/// own slices is not a read of a reconcile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadCounts {
    /// List requests for ResourceClaims (pages; only a reconcile whose model
    /// would drop a published device makes them, and the first one of a node
    /// with nothing published).
    pub claim_lists: u64,
    /// GETs of the Node (owner of the slices; cached, read again only
    /// before a write).
    pub node_gets: u64,
    /// Lists of this driver's slices of this node (field selectors).
    pub slice_lists: u64,
}

impl ReadCounts {
    /// All reads together.
    pub fn total(&self) -> u64 {
        self.claim_lists + self.node_gets + self.slice_lists
    }
}

impl std::ops::Sub for ReadCounts {
    type Output = ReadCounts;
    fn sub(self, rhs: ReadCounts) -> ReadCounts {
        ReadCounts {
            claim_lists: self.claim_lists - rhs.claim_lists,
            node_gets: self.node_gets - rhs.node_gets,
            slice_lists: self.slice_lists - rhs.slice_lists,
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
    claim_lists: AtomicU64,
    node_gets: AtomicU64,
    slice_lists: AtomicU64,
}

impl WriteCounters {
    pub fn snapshot(&self) -> WriteCounts {
        WriteCounts {
            creates: self.creates.load(Ordering::Relaxed),
            updates: self.updates.load(Ordering::Relaxed),
            deletes: self.deletes.load(Ordering::Relaxed),
        }
    }

    /// Reads made so far (subtract two snapshots for one reconcile's).
    pub fn reads(&self) -> ReadCounts {
        ReadCounts {
            claim_lists: self.claim_lists.load(Ordering::Relaxed),
            node_gets: self.node_gets.load(Ordering::Relaxed),
            slice_lists: self.slice_lists.load(Ordering::Relaxed),
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
    pub(crate) fn listed_claims(&self) {
        self.claim_lists.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn got_node(&self) {
        self.node_gets.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn listed_slices(&self) {
        self.slice_lists.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn reconciled(&self) {
        self.reconciles.fetch_add(1, Ordering::Relaxed);
    }
}
