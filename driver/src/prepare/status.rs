//! Writing `status.devices[]` of prepared claims.
//!
//! After a successful prepare the claim's status gets one entry per device
//! of ours (driver, pool, device, shareID, `data` = [`DeviceData`]) by
//! server-side apply on the status subresource with the driver name as field
//! manager; unprepare applies an empty list, which removes exactly the
//! entries this manager owns. The apply carries the claim's UID, so a claim
//! deleted and re-created under the same name is never written to.
//!
//! Off the critical path: prepare and unprepare only queue what the claim's
//! entries should be and return; [`WORKERS`] tasks apply the queue in order,
//! and yield to the kubelet: while one of its calls is in flight (and for
//! [`QUIET`] after the last), writes wait, up to [`MAX_DEFER`] after a claim
//! was queued. A prepare waits on its claim read, and on a loaded API server
//! that read queues behind the writes; an unprepare waits on CPUs the API
//! server spends on them; the kubelet, and the Pod, wait with both, while
//! nobody waits on a status write. A claim queued again before its turn is
//! written once, with the newest content; one unprepared before its entries
//! were ever written is not written at all. A write that fails is retried
//! with backoff, without end (a Warning Node Event says when one lags),
//! until the claim is gone.
//!
//! Nothing is lost across a restart: the [`Ledger`] says which claims have
//! entries on the API server (a line after each apply, another after each
//! removal). At start ([`StatusWriter::resume`]) a prepared claim with
//! entries to write that the ledger does not name is queued again, and a
//! claim the ledger names that is no longer prepared is a removal still to
//! make.
//!
//! [`DeviceData`]: crate::state::records::DeviceData

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::state::events::NodeEvents;
use crate::state::records::DeviceStatus;
use crate::sync::Locked;

mod ledger;
use ledger::{Marked, SharedLedger};

/// Applies in flight at once: enough to keep up with prepares, few enough
/// that they do not compete with the claim reads prepares wait on.
pub const WORKERS: usize = 2;
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long after the kubelet's last call ended writes still wait: it
/// sends a Pod's claims, and a burst of Pods, back to back.
pub const QUIET: Duration = Duration::from_millis(20);
/// The longest a queued write yields to the kubelet: what a status lags at
/// most behind its prepare under a continuous stream of calls.
pub const MAX_DEFER: Duration = Duration::from_secs(2);
/// Failed attempts before a Node Event says a claim's status lags.
const ATTEMPTS_BEFORE_EVENT: u32 = 5;

/// What a claim's entries should be, and how the writes went.
#[derive(Debug, Clone)]
struct Want {
    namespace: String,
    name: String,
    /// Empty: remove ours.
    devices: Vec<DeviceStatus>,
    attempts: u32,
    not_before: Instant,
    /// When the claim was first queued (kept when a newer want replaces
    /// this one): how long its write has yielded.
    queued: Instant,
    reported: bool,
}

#[derive(Debug, Default)]
struct Queue {
    /// Claim UIDs in the order their writes are due; a UID no longer in
    /// `wants` (superseded, cancelled, taken) is skipped.
    order: VecDeque<String>,
    wants: HashMap<String, Want>,
    /// Being applied now: a newer want waits for the next turn.
    busy: HashSet<String>,
}

impl Queue {
    /// Queues `want`; one queued earlier and not yet taken is replaced
    /// (keeping its place).
    fn put(&mut self, uid: &str, mut want: Want) {
        if let Some(earlier) = self.wants.get(uid) {
            want.queued = want.queued.min(earlier.queued);
        }
        if self.wants.insert(uid.to_owned(), want).is_none() {
            self.order.push_back(uid.to_owned());
        }
    }

    /// When the longest-waiting queued write stops yielding to the kubelet.
    fn yield_deadline(&self) -> Option<Instant> {
        (self.wants.values())
            .filter(|w| w.attempts == 0)
            .map(|w| w.queued + MAX_DEFER)
            .min()
    }

    /// Puts back a failed want, unless a newer one came meanwhile.
    fn retry(&mut self, uid: &str, want: Want) {
        if !self.wants.contains_key(uid) {
            self.put(uid, want);
        }
    }

    /// Drops a queued write of a claim whose entries were never written
    /// (`written`: the ledger names it) and that has none in flight.
    fn cancel_unwritten(&mut self, uid: &str, written: bool) -> bool {
        if self.busy.contains(uid) || written {
            return false;
        }
        self.wants.remove(uid);
        true
    }

    /// The first due claim not in flight, taken (marked busy); else when
    /// the first one waiting for its backoff is due.
    fn take(&mut self, now: Instant) -> Result<(String, Want), Option<Instant>> {
        let mut next = None::<Instant>;
        let mut i = 0;
        while i < self.order.len() {
            let uid = &self.order[i];
            let Some(want) = self.wants.get(uid) else {
                self.order.remove(i);
                continue;
            };
            if self.busy.contains(uid) {
                i += 1;
                continue;
            }
            if want.not_before > now {
                next = Some(next.map_or(want.not_before, |n| n.min(want.not_before)));
                i += 1;
                continue;
            }
            let uid = self.order.remove(i).unwrap_or_default();
            if let Some(want) = self.wants.remove(&uid) {
                self.busy.insert(uid.clone());
                return Ok((uid, want));
            }
        }
        Err(next)
    }
}

/// The kubelet's calls in flight, and when the last one ended.
#[derive(Debug, Clone, Copy)]
struct KubeletCalls {
    in_flight: usize,
    last_end: Instant,
}

impl KubeletCalls {
    /// When writes may go: `None` while a call is in flight.
    fn quiet_from(&self) -> Option<Instant> {
        (self.in_flight == 0).then_some(self.last_end + QUIET)
    }
}

/// A prepare or unprepare in flight, from [`StatusWriter::call_started`];
/// writes yield to it until it is dropped.
#[must_use = "writes yield only while the guard lives"]
pub struct KubeletCall<'a>(&'a Mutex<KubeletCalls>);

impl Drop for KubeletCall<'_> {
    fn drop(&mut self) {
        let mut calls = self.0.locked();
        calls.in_flight -= 1;
        calls.last_end = Instant::now();
    }
}

/// Background writer of our `status.devices` entries.
pub struct StatusWriter {
    client: Client,
    driver: String,
    ledger: SharedLedger,
    queue: Mutex<Queue>,
    wake: Notify,
    /// Read by the workers when they look, never pushed to them: a burst
    /// of calls wakes no worker per call.
    calls: Mutex<KubeletCalls>,
    events: Option<NodeEvents>,
}

impl StatusWriter {
    /// A writer keeping its ledger under `state_dir`, with its workers
    /// started; `events` hears of claims whose status lags.
    pub fn new(
        client: Client,
        driver: impl Into<String>,
        state_dir: &std::path::Path,
        events: Option<NodeEvents>,
    ) -> std::io::Result<Arc<Self>> {
        let writer = Self::unstarted(client, driver, state_dir, events)?;
        for _ in 0..WORKERS {
            tokio::spawn(writer.clone().work());
        }
        Ok(writer)
    }

    fn unstarted(
        client: Client,
        driver: impl Into<String>,
        state_dir: &std::path::Path,
        events: Option<NodeEvents>,
    ) -> std::io::Result<Arc<Self>> {
        let ledger = SharedLedger::open(state_dir)?;
        Ok(Arc::new(StatusWriter {
            client,
            driver: driver.into(),
            ledger,
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            calls: Mutex::new(KubeletCalls {
                in_flight: 0,
                last_end: Instant::now(),
            }),
            events,
        }))
    }

    /// The kubelet called: writes yield until the guard is dropped (and
    /// for [`QUIET`] after).
    pub fn call_started(&self) -> KubeletCall<'_> {
        self.calls.locked().in_flight += 1;
        KubeletCall(&self.calls)
    }

    /// Waits until no call of the kubelet has been in flight for
    /// [`QUIET`], or until `deadline`. While calls are in flight it looks
    /// again every [`QUIET`]: a call that ends meanwhile is seen by the
    /// next look, which then waits until exactly [`QUIET`] after its end.
    async fn yield_to_kubelet(&self, deadline: Instant) {
        loop {
            let now = Instant::now();
            let quiet_from = self.calls.locked().quiet_from();
            if now >= deadline || quiet_from.is_some_and(|q| now >= q) {
                return;
            }
            let until = quiet_from.unwrap_or(now + QUIET).min(deadline);
            tokio::time::sleep_until(until).await;
        }
    }

    /// Queue the removal of this driver's entries of the claim's status;
    /// nothing, if none were ever written and no write is in flight.
    pub fn remove(&self, namespace: &str, name: &str, uid: &str) {
        #[cfg(test)]
        tests::BEFORE_REMOVE.with(|hook| hook.take().map(|f| f()));
        let mut queue = self.lock();
        // Read under the queue lock: a write that settles meanwhile marks
        // the ledger before it leaves `busy`, so one of the two says its
        // entries may be there (the ledger alone, read first, may not).
        let written = self.ledger.contains(uid);
        if queue.cancel_unwritten(uid, written) {
            return;
        }
        drop(queue);
        self.write(namespace, name, uid, Vec::new());
    }

    /// Removes the entries of a claim known only by the ledger (one whose
    /// record was lost); nothing if the ledger does not name it.
    pub fn remove_marked(&self, uid: &str) {
        let marked = self.ledger.get(uid);
        if let Some(m) = marked {
            self.remove(&m.namespace, &m.name, uid);
        }
    }

    /// At start: `prepared` (UID, namespace, name, entries) are the
    /// prepared claims; what the ledger says is on the API server is
    /// brought in line with them (other claims it names are removals still
    /// to make, when `complete`: `prepared` is every prepared claim, except
    /// those `kept`, which may be prepared without a record).
    pub fn resume(
        &self,
        prepared: Vec<(String, String, String, Vec<DeviceStatus>)>,
        complete: bool,
        kept: impl Fn(&str) -> bool,
    ) {
        let mut with_entries = HashSet::new();
        for (uid, namespace, name, devices) in prepared {
            if devices.is_empty() {
                continue;
            }
            if !self.ledger.contains(&uid) {
                self.write(&namespace, &name, &uid, devices);
            }
            with_entries.insert(uid);
        }
        if !complete {
            return;
        }
        let removals: Vec<(String, Marked)> = (self.ledger.marked().into_iter())
            .filter(|(uid, _)| !with_entries.contains(uid) && !kept(uid))
            .collect();
        for (uid, m) in removals {
            self.write(&m.namespace, &m.name, &uid, Vec::new());
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.locked()
    }

    /// Queue `devices` as this driver's entries of the claim's status
    /// (empty: remove ours).
    pub fn write(&self, namespace: &str, name: &str, uid: &str, devices: Vec<DeviceStatus>) {
        let want = Want {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            devices,
            attempts: 0,
            not_before: Instant::now(),
            queued: Instant::now(),
            reported: false,
        };
        self.lock().put(uid, want);
        self.wake.notify_one();
    }

    async fn work(self: Arc<Self>) {
        loop {
            let deadline = self.lock().yield_deadline();
            if let Some(deadline) = deadline {
                self.yield_to_kubelet(deadline).await;
            }
            let taken = self.lock().take(Instant::now());
            match taken {
                Ok((uid, want)) => {
                    let outcome = self.apply(&uid, &want).await;
                    self.settle(&uid, want, outcome).await;
                }
                Err(Some(at)) => {
                    let _ = tokio::time::timeout_at(at, self.wake.notified()).await;
                }
                Err(None) => self.wake.notified().await,
            }
        }
    }

    /// After an apply: the ledger follows what the API server has; a
    /// failure goes back in the queue (unless a newer want came).
    async fn settle(&self, uid: &str, mut want: Want, outcome: Result<Applied, kube::Error>) {
        let claim = format!("{}/{}", want.namespace, want.name);
        match outcome {
            Ok(Applied::Written) if !want.devices.is_empty() => {
                let marked = Marked {
                    namespace: want.namespace.clone(),
                    name: want.name.clone(),
                };
                self.ledger.written(uid, marked);
            }
            Ok(_) => {
                self.ledger.removed(uid);
            }
            Err(e) => {
                want.attempts += 1;
                let backoff = FIRST_BACKOFF
                    .saturating_mul(1 << want.attempts.min(8).saturating_sub(1))
                    .min(MAX_BACKOFF);
                warn!(claim = %claim, attempt = want.attempts,
                    "cannot write the claim's status.devices (retrying in {backoff:?}; prepare is not affected): {e}");
                if want.attempts >= ATTEMPTS_BEFORE_EVENT && !want.reported {
                    want.reported = true;
                    if let Some(events) = &self.events {
                        let note = format!(
                            "status.devices of claim {claim} not written after {} attempts \
                             (still retrying): {e}",
                            want.attempts
                        );
                        let related = ObjectReference {
                            api_version: Some("resource.k8s.io/v1".into()),
                            kind: Some("ResourceClaim".into()),
                            namespace: Some(want.namespace.clone()),
                            name: Some(want.name.clone()),
                            uid: Some(uid.into()),
                            ..Default::default()
                        };
                        events
                            .publish(
                                EventType::Warning,
                                "ClaimStatusLagging",
                                "WriteClaimStatus",
                                &note,
                                Some(related),
                            )
                            .await;
                    }
                }
                want.not_before = Instant::now() + backoff;
                self.lock().retry(uid, want);
            }
        }
        self.lock().busy.remove(uid);
        self.wake.notify_one();
    }

    async fn apply(&self, uid: &str, want: &Want) -> Result<Applied, kube::Error> {
        let (namespace, name) = (&want.namespace, &want.name);
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
        let entries: Vec<serde_json::Value> = want
            .devices
            .iter()
            .map(|d| {
                let mut e = json!({
                    "driver": self.driver,
                    "pool": d.pool,
                    "device": d.device,
                    "data": d.data,
                });
                if let Some(share) = &d.share_id {
                    e["shareID"] = json!(share);
                }
                if !d.conditions.is_empty() {
                    e["conditions"] = json!(d.conditions);
                }
                e
            })
            .collect();
        let body = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": { "name": name, "namespace": namespace, "uid": uid },
            "status": { "devices": entries },
        });
        let params = PatchParams::apply(&self.driver).force();
        match api.patch_status(name, &params, &Patch::Apply(&body)).await {
            Ok(_) => {
                debug!(claim = %format!("{namespace}/{name}"), devices = want.devices.len(), "claim status written");
                Ok(Applied::Written)
            }
            // Gone, or re-created (UID precondition): nothing to write.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                info!(claim = %format!("{namespace}/{name}"), "claim gone or re-created; status not written: {}", s.message);
                Ok(Applied::Gone)
            }
            Err(e) => Err(e),
        }
    }
}

/// How an apply ended.
enum Applied {
    Written,
    /// The claim is gone (or another of that name): nothing of ours there.
    Gone,
}

#[cfg(test)]
mod tests;
