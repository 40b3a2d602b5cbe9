//! One render of the metrics at a time, shared by every scrape waiting
//! for it.
//!
//! A render samples the node (NVML for each GPU, the checkpoint, the
//! publisher's counters) and encodes every metric. It runs on a thread of
//! its own, never on the runtime's blocking pool, which prepare needs: a
//! flood of scrapes costs one render in flight and some waiting futures,
//! not a thread and an NVML pass each.
//!
//! A scrape is answered with the first render that starts after it
//! arrived, so it never sees the node as it was before it asked (a scrape
//! right after a prepare counts that claim); scrapes that arrive during a
//! render share the next one. Renders start at least [`MIN_GAP`] apart.

use crate::sync::Locked;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use tokio::sync::watch;
use tracing::error;

use super::Metrics;

/// The shortest time between the starts of two renders: a flood of scrapes
/// costs at most a few renders a second.
pub const MIN_GAP: Duration = Duration::from_millis(250);

/// Why a render has no text. Clone: every scrape waiting for the render
/// gets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// Sampling the node panicked; the panic is in the log.
    #[error("sampling the metrics panicked (see the log)")]
    Panicked,
}

/// A rendered text (or why there is none), numbered by when its render
/// started.
#[derive(Clone)]
struct Rendered {
    generation: u64,
    text: Result<Bytes, RenderError>,
}

impl Default for Rendered {
    fn default() -> Self {
        Rendered {
            generation: 0,
            text: Ok(Bytes::new()),
        }
    }
}

#[derive(Default)]
struct Demand {
    /// The render every scrape waiting now is answered with.
    requested: u64,
    /// The last render started.
    started: u64,
    /// The metrics are gone: the render thread ends.
    closed: bool,
}

/// Renders of one [`Metrics`], and the scrapes waiting for them.
#[derive(Default)]
pub struct Renders {
    demand: Mutex<Demand>,
    wake: Condvar,
    done: watch::Sender<Rendered>,
    thread: OnceLock<()>,
    waiting: AtomicUsize,
}

impl Renders {
    fn demand(&self) -> MutexGuard<'_, Demand> {
        self.demand.locked()
    }

    /// Scrapes waiting for a render now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// The text of the first render that starts after this call; `None`
    /// if none finished within `limit`.
    pub(super) async fn scrape(
        self: &Arc<Self>,
        metrics: &Arc<Metrics>,
        limit: Duration,
    ) -> Option<Result<Bytes, RenderError>> {
        self.start_thread(metrics);
        let _waiting = Waiting::count(&self.waiting);
        // Subscribed before asking: the answer cannot be missed.
        let mut done = self.done.subscribe();
        let wanted = self.request();
        let rendered = tokio::time::timeout(limit, done.wait_for(|r| r.generation >= wanted))
            .await
            .ok()?
            .ok()?;
        Some(rendered.text.clone())
    }

    /// Asks for a render that has not started yet; its generation.
    fn request(&self) -> u64 {
        let mut demand = self.demand();
        demand.requested = demand.started + 1;
        self.wake.notify_one();
        demand.requested
    }

    fn start_thread(self: &Arc<Self>, metrics: &Arc<Metrics>) {
        self.thread.get_or_init(|| {
            let renders = Arc::clone(self);
            let metrics = Arc::downgrade(metrics);
            std::thread::Builder::new()
                .name("metrics-render".into())
                .spawn(move || renders.run(metrics))
                .expect("spawning the metrics render thread");
        });
    }

    /// The render thread: renders on demand until the metrics are dropped.
    fn run(&self, metrics: Weak<Metrics>) {
        let mut last_start = None;
        while let Some(generation) = self.next(last_start) {
            last_start = Some(Instant::now());
            let Some(metrics) = metrics.upgrade() else {
                return;
            };
            let text = std::panic::catch_unwind(AssertUnwindSafe(|| metrics.render()))
                .map(Bytes::from)
                .map_err(|_| {
                    error!("sampling the metrics panicked");
                    RenderError::Panicked
                });
            drop(metrics);
            self.done.send_replace(Rendered { generation, text });
        }
    }

    /// Waits until a render is asked for and [`MIN_GAP`] has passed since
    /// `last_start`; the generation it starts. `None` once closed.
    fn next(&self, last_start: Option<Instant>) -> Option<u64> {
        let mut demand = self.demand();
        loop {
            if demand.closed {
                return None;
            }
            if demand.requested <= demand.started {
                demand = self
                    .wake
                    .wait(demand)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            let pause = last_start
                .map(|t| (t + MIN_GAP).saturating_duration_since(Instant::now()))
                .unwrap_or_default();
            if pause.is_zero() {
                demand.started += 1;
                return Some(demand.started);
            }
            // Pacing, not synchronization: a close still wakes it.
            demand = self
                .wake
                .wait_timeout(demand, pause)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Ends the render thread.
    fn close(&self) {
        self.demand().closed = true;
        self.wake.notify_all();
    }
}

/// The renders of one [`Metrics`]: the render thread ends when it drops.
#[derive(Default)]
pub struct Handle(pub(super) Arc<Renders>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Counts a scrape as waiting until dropped (answered, timed out, or its
/// connection gone).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn count(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
