//! The publisher's loop: when to reconcile again, and how long to wait.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::time::Interval;
use tracing::{debug, error, info, warn};

use super::{Backoff, NodeView, PublishError, Publisher};

impl Publisher {
    /// Reconciles until `shutdown` completes or the inventory sender is
    /// dropped: at once, then on each node change that alters what the
    /// model is built from, on changes to our slices made by anyone
    /// (including deletion), every `held_recheck` while the model keeps a
    /// device only for a claim, and every `resync`. Failures back off
    /// exponentially up to `backoff_max`; nothing here returns an error or
    /// panics on a server that is old, down or refusing.
    pub async fn run(
        mut self,
        mut inventory: watch::Receiver<NodeView>,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown.fuse());
        let cfg = watcher::Config::default().fields(&self.field_selector());
        let mut events = std::pin::pin!(watcher(self.slices_api(), cfg).default_backoff());
        let mut backoff = Backoff::new(self.config.backoff_initial, self.config.backoff_max);
        let mut resync = tokio::time::interval(self.config.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        resync.tick().await; // the first tick is immediate; we reconcile anyway
        let mut notes_logged: Vec<String> = Vec::new();

        loop {
            let current = inventory.borrow_and_update().clone();
            let failed = if self.same_inputs(&current) {
                debug!("the node changed, but not what the model is built from");
                None
            } else {
                self.reconcile_logged(&current, &mut backoff, &mut notes_logged)
                    .await
            };
            let pause = match failed {
                // Back off: only shutdown interrupts.
                Some(delay) => delay,
                None => match self
                    .next_wake(&mut inventory, &mut events, &mut resync, &mut shutdown)
                    .await
                {
                    Wake::Stop => return,
                    Wake::Now => continue,
                    // API events come in bursts: collect them first.
                    Wake::Debounce => self.config.debounce,
                },
            };
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(pause) => {}
            }
            // Slice events that arrived meanwhile: the reconcile reads the
            // slices anyway.
            drain(&mut events);
        }
    }

    /// Waits for a reason to reconcile: the node changed, someone changed
    /// our slices, devices kept for claims are due a look (a claim's
    /// release is not watched), or the periodic resync.
    async fn next_wake<S, E>(
        &mut self,
        inventory: &mut watch::Receiver<NodeView>,
        events: &mut Pin<&mut E>,
        resync: &mut Interval,
        shutdown: &mut Pin<&mut S>,
    ) -> Wake
    where
        S: Future<Output = ()>,
        E: Stream<Item = Result<watcher::Event<ResourceSlice>, watcher::Error>>,
    {
        let recheck = tokio::time::sleep(self.config.held_recheck);
        let mut recheck = std::pin::pin!(recheck);
        let kept_for_claims = !self.kept_for_claims.is_empty();
        loop {
            tokio::select! {
                _ = shutdown.as_mut() => return Wake::Stop,
                changed = inventory.changed() => {
                    if changed.is_err() {
                        info!("inventory source closed; publisher stops");
                        return Wake::Stop;
                    }
                    debug!("inventory changed");
                    return Wake::Now;
                }
                event = events.next() => {
                    if self.slices_changed(event) {
                        return Wake::Debounce;
                    }
                }
                _ = &mut recheck, if kept_for_claims => {
                    debug!("devices kept for claims: are they still held?");
                    self.last_inputs = None;
                    return Wake::Now;
                }
                _ = resync.tick() => {
                    // Re-detect: the server may have been upgraded or
                    // its feature gates changed.
                    self.detected = None;
                    self.last_inputs = None;
                    return Wake::Now;
                }
            }
        }
    }

    /// Whether an event of the slice watch means our slices may differ
    /// from what we wrote (then the next reconcile builds again).
    fn slices_changed(
        &mut self,
        event: Option<Result<watcher::Event<ResourceSlice>, watcher::Error>>,
    ) -> bool {
        match event {
            Some(Ok(event)) if self.slice_event_matters(&event) => {
                self.last_inputs = None;
                true
            }
            Some(Ok(_)) | None => false,
            // The watcher relists after an error; that relist brings us
            // back here.
            Some(Err(e)) => {
                warn!("watching ResourceSlices: {e}");
                false
            }
        }
    }
    /// One reconcile of [`Publisher::run`], logged; the delay before the
    /// next try when it failed.
    async fn reconcile_logged(
        &mut self,
        view: &NodeView,
        backoff: &mut Backoff,
        notes_logged: &mut Vec<String>,
    ) -> Option<Duration> {
        match self.reconcile(view).await {
            Ok(r) => {
                backoff.reset();
                debug!(
                    "reconciled: {} reads ({} claim lists, {} node gets, {} slice lists), {} writes",
                    r.reads.total(),
                    r.reads.claim_lists,
                    r.reads.node_gets,
                    r.reads.slice_lists,
                    r.writes.total()
                );
                if r.notes != *notes_logged {
                    for n in &r.notes {
                        info!("model: {n}");
                    }
                    *notes_logged = r.notes;
                }
                None
            }
            Err(e) => {
                let d = backoff.next_delay();
                match &e {
                    PublishError::Rejected { .. } | PublishError::NotServed(_) => {
                        error!("{e}; retrying in {d:?}")
                    }
                    _ => warn!("{e}; retrying in {d:?}"),
                }
                Some(d)
            }
        }
    }

    /// Whether an event of the slice watch may mean that our slices on the
    /// server differ from the model: not our own writes coming back (the
    /// resourceVersion the server gave our last write), and not each slice
    /// of a (re)list, only its end.
    fn slice_event_matters(&self, event: &watcher::Event<ResourceSlice>) -> bool {
        match event {
            watcher::Event::Init | watcher::Event::InitApply(_) => false,
            watcher::Event::InitDone | watcher::Event::Delete(_) => true,
            watcher::Event::Apply(slice) => {
                let ours = self
                    .last_write
                    .as_ref()
                    .zip(slice.metadata.name.as_ref())
                    .and_then(|(last, name)| last.versions.get(name));
                ours.is_none() || ours != slice.metadata.resource_version.as_ref()
            }
        }
    }
}

/// What ends a wait of [`Publisher::run`].
enum Wake {
    /// Shutdown, or the node's view can no longer change.
    Stop,
    /// Reconcile at once.
    Now,
    /// Reconcile after the debounce: more slice events may follow.
    Debounce,
}

/// Consumes whatever watch events are ready without waiting.
fn drain<S>(events: &mut std::pin::Pin<&mut S>)
where
    S: futures::Stream,
{
    while let Some(Some(_)) = events.next().now_or_never() {}
}
