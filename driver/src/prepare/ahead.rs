//! Claims prepared ahead of the kubelet: devices with binding conditions
//! (dynamic MIG) are made while the scheduler waits to bind the pod
//! (`crate::binding` asks), so a device that cannot be made sends the pod
//! elsewhere instead of leaving it in ContainerCreating.
//!
//! Such a claim is prepared in full (effects, spec, record) with the
//! record's `ahead` flag set and `DeviceMade` in its status. The kubelet's
//! own prepare later finds the record and takes the claim over: the flag is
//! cleared, and from then on the kubelet's unprepare ends it as any other.
//! Until then the node ends it itself when the allocation goes away (the pod
//! deleted while waiting, the binding timed out); a crash in between leaves
//! the flag in the record, so nothing is leaked.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::claims::{ClaimError, ClaimRef};
use super::make::Origin;
use super::{ClaimResult, Preparer};
use crate::claim_uid::ClaimUid;
use crate::state::records::ClaimEntry;
use crate::sync::Locked;

/// How long a device that could not be made is not offered again (its
/// taint): the scheduler places the pod elsewhere meanwhile, and a device
/// the node's view drops (a placement another actor took) is gone by then.
pub const NOT_MADE_FOR: Duration = Duration::from_secs(300);

/// Devices that could not be made ahead, and since when.
#[derive(Default)]
pub(super) struct NotMade(BTreeMap<String, (Instant, i64)>);

/// How many claims the kubelet unprepared are remembered.
const RELEASED_KEPT: usize = 4096;

/// Claims the kubelet unprepared lately. Their allocation may still be
/// listed for a moment (the pod's reservation is removed after it ends):
/// they are not made again ahead. Kept in memory only: after a restart
/// within that moment a claim may be made once more, and is then ended
/// like any whose allocation went away.
#[derive(Default)]
pub(super) struct Released {
    order: VecDeque<String>,
    uids: HashSet<String>,
}

impl Released {
    pub(super) fn note(&mut self, uid: &str) {
        if self.uids.insert(uid.to_owned()) {
            self.order.push_back(uid.to_owned());
        }
        while self.order.len() > RELEASED_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.uids.remove(&old);
            }
        }
    }

    fn contains(&self, uid: &str) -> bool {
        self.uids.contains(uid)
    }
}

impl Preparer {
    /// Prepares `claim` before its pod is bound; `false` when it is not
    /// made because the kubelet already unprepared it.
    pub async fn prepare_ahead(self: &Arc<Self>, claim: &ClaimRef) -> ClaimResult<bool> {
        if self.released.locked().contains(&claim.uid) {
            return Ok(false);
        }
        self.prepare_for(claim, Origin::Binding).await.map(|_| true)
    }

    /// `devices` (names in this node's pool) could not be made: tainted a
    /// while, so the scheduler does not pick them again at once.
    pub fn not_made(&self, devices: impl IntoIterator<Item = String>) {
        let since = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let mut not_made = self.not_made.locked();
        for device in devices {
            not_made.0.insert(device, (Instant::now(), since));
        }
        drop(not_made);
        self.changed(super::NodeChange::Records);
    }

    /// The devices that could not be made within [`NOT_MADE_FOR`], with
    /// when (seconds since the Unix epoch).
    pub fn not_made_devices(&self) -> BTreeMap<String, i64> {
        let mut not_made = self.not_made.locked();
        not_made.0.retain(|_, (at, _)| at.elapsed() < NOT_MADE_FOR);
        not_made
            .0
            .iter()
            .map(|(d, (_, since))| (d.clone(), *since))
            .collect()
    }

    /// The claims prepared ahead that the kubelet has not taken over.
    pub fn ahead_claims(&self) -> Vec<ClaimRef> {
        self.checkpoint
            .lock()
            .iter()
            .filter(|(_, e)| e.ahead)
            .map(|(uid, e)| ClaimRef {
                namespace: e.namespace.clone(),
                name: e.name.clone(),
                uid: uid.as_str().to_owned(),
            })
            .collect()
    }

    /// The kubelet asked for a claim prepared ahead: it owns it now.
    pub(super) fn kubelet_took_over(
        &self,
        claim: &ClaimRef,
        uid: &ClaimUid,
        entry: &ClaimEntry,
    ) -> ClaimResult<()> {
        let owned = ClaimEntry {
            ahead: false,
            ..entry.clone()
        };
        self.checkpoint
            .put(uid.clone(), owned)
            .map_err(|e| ClaimError::new(claim, format!("cannot record it in the checkpoint: {e}")))
    }
}
