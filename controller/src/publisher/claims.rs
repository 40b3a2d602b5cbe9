//! The devices of this pool that allocated ResourceClaims hold, kept from a
//! watch of every claim in the cluster instead of listed on each reconcile.
//!
//! Each claim is projected, as it arrives, to the names of the devices of
//! this driver in this node's pool that its allocation holds ([`held_in`]);
//! only claims that hold at least one are kept, as claim UID -> device
//! names. Memory therefore grows with the claims on this node, not with the
//! claims (or their size) in the cluster. A claim whose allocation goes
//! away, or that is deleted, drops out.
//!
//! The watcher's (re)lists are applied like a reflector's: the listed claims
//! are collected apart and replace the map only once the list is complete
//! (`InitDone`), so a relist (e.g. after 410 Gone) never shows a partial
//! set. Until the first list is complete the index is not
//! [`synced`](HeldClaims::synced) and the publisher does not publish from it.

use std::collections::{BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::watcher;

use super::held_in;

/// Claim UID (namespace/name where a claim has none) -> held device names.
type ByClaim = HashMap<String, BTreeSet<String>>;

/// Held devices of one pool, indexed by claim. See the module docs.
#[derive(Debug, Clone)]
pub struct HeldClaims {
    driver: String,
    pool: String,
    by_claim: ByClaim,
    /// Claims of a list in progress (between `Init` and `InitDone`).
    listing: Option<ByClaim>,
    synced: bool,
    /// Union of `by_claim`.
    held: BTreeSet<String>,
}

impl HeldClaims {
    pub fn new(driver: impl Into<String>, pool: impl Into<String>) -> Self {
        HeldClaims {
            driver: driver.into(),
            pool: pool.into(),
            by_claim: ByClaim::new(),
            listing: None,
            synced: false,
            held: BTreeSet::new(),
        }
    }

    /// Whether a complete list of the claims has been applied.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Devices of the pool that some claim holds.
    pub fn held(&self) -> &BTreeSet<String> {
        &self.held
    }

    /// Claims that hold devices of the pool.
    pub fn claims(&self) -> usize {
        self.by_claim.len()
    }

    /// Applies one watch event. True when the pool's held set changed (a
    /// claim of another pool, or one whose devices of this pool stay the
    /// same, changes nothing).
    pub fn apply(&mut self, event: watcher::Event<ResourceClaim>) -> bool {
        match event {
            watcher::Event::Init => {
                self.listing = Some(ByClaim::new());
                false
            }
            watcher::Event::InitApply(claim) => {
                let (key, devices) = self.project(&claim);
                if !devices.is_empty() {
                    self.listing
                        .get_or_insert_with(ByClaim::new)
                        .insert(key, devices);
                }
                false
            }
            watcher::Event::InitDone => {
                self.by_claim = self.listing.take().unwrap_or_default();
                self.synced = true;
                self.refresh()
            }
            watcher::Event::Apply(claim) => {
                let (key, devices) = self.project(&claim);
                let before = if devices.is_empty() {
                    self.by_claim.remove(&key)
                } else {
                    self.by_claim.insert(key, devices.clone())
                };
                before.unwrap_or_default() != devices && self.refresh()
            }
            watcher::Event::Delete(claim) => {
                let (key, _) = self.project(&claim);
                self.by_claim.remove(&key).is_some() && self.refresh()
            }
        }
    }

    fn project(&self, claim: &ResourceClaim) -> (String, BTreeSet<String>) {
        let key = claim.metadata.uid.clone().unwrap_or_else(|| {
            format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            )
        });
        let devices = held_in(std::slice::from_ref(claim), &self.driver, &self.pool);
        (key, devices)
    }

    /// Recomputes the union; true when it changed.
    fn refresh(&mut self) -> bool {
        let held: BTreeSet<String> = self.by_claim.values().flatten().cloned().collect();
        let changed = held != self.held;
        self.held = held;
        changed
    }
}
