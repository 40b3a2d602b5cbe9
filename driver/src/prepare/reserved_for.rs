//! The Pods each claim is reserved for (`status.reservedFor`), as prepare
//! read them with the claim: the claim guard and the metrics attribute a
//! GPU's processes to Pods through them.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use k8s_openapi::api::resource::v1::ResourceClaim;

use super::Preparer;
use crate::claim_uid::ClaimUid;
use crate::sync::Locked;

impl Preparer {
    /// The Pods (UIDs) of each claim prepared since this process started,
    /// by claim UID, as they were when it was fetched.
    pub fn consumers(&self) -> BTreeMap<String, Vec<String>> {
        self.reserved_for.all()
    }

    /// The Pods, with their names, of each claim prepared by this process.
    pub fn consumer_pods(&self) -> BTreeMap<String, Vec<PodRef>> {
        self.reserved_for.pods()
    }
}

/// Pods per prepared claim (UID and name), in memory.
#[derive(Default)]
pub(super) struct ReservedFor(Mutex<BTreeMap<String, Vec<PodRef>>>);

/// A Pod a claim is reserved for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub uid: String,
    pub name: String,
}

impl ReservedFor {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Vec<PodRef>>> {
        self.0.locked()
    }

    pub(super) fn remember(&self, uid: &ClaimUid, pods: Vec<PodRef>) {
        self.lock().insert(uid.as_str().to_owned(), pods);
    }

    pub(super) fn forget(&self, uid: &ClaimUid) {
        self.lock().remove(uid.as_str());
    }

    fn all(&self) -> BTreeMap<String, Vec<String>> {
        self.lock()
            .iter()
            .map(|(claim, pods)| (claim.clone(), pods.iter().map(|p| p.uid.clone()).collect()))
            .collect()
    }

    fn pods(&self) -> BTreeMap<String, Vec<PodRef>> {
        self.lock().clone()
    }
}

/// The Pods (UID and name) a claim is reserved for.
pub fn consumer_pods(claim: &ResourceClaim) -> Vec<PodRef> {
    let reserved = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
    reserved
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods")
        .map(|r| PodRef {
            uid: r.uid.clone(),
            name: r.name.clone(),
        })
        .collect()
}

/// The UIDs of the Pods a claim is reserved for.
pub fn consumers(claim: &ResourceClaim) -> Vec<String> {
    let reserved = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
    reserved
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods")
        .map(|r| r.uid.clone())
        .collect()
}
