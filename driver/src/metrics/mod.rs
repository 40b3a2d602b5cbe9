//! The node process's Prometheus metrics (`/metrics`, OpenMetrics text) and
//! its readiness (`/healthz`), served by [`server`].
//!
//! Most values are events counted where they happen (prepare and
//! unprepare latency and results, the devices of every model built); the
//! rest is read for each render by a [`Sampler`] (prepared claims from the
//! checkpoint, MPS daemons, the publisher's write counters, per-GPU memory
//! allocated to claims vs used according to NVML, what each GPU and MIG
//! device is doing ([`gpus`]) and what each claim's processes use on them
//! ([`claims`])). Scrapes share renders, one at a time on a thread of their
//! own ([`renders`]). Every name starts with `tessera_` ([`families`]);
//! docs/operations.md describes them all.

pub mod access;
pub mod claims;
mod families;
pub mod gpus;
pub mod memory;
pub mod processes;
pub mod renders;
pub mod server;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nvml_wrapper::Nvml;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tessera_controller::model::{DeviceKind, Model};
use tessera_controller::publisher::{NodeView, WriteCounters};
use tokio::sync::watch;
use tracing::debug;

use crate::health::{Health, HealthMap, HealthTracker};
use crate::prepare::{Phase, PrepareObserver, Preparer};
use crate::state::catalog::{Catalog, DeviceCatalog};
use crate::state::records::EntryState;
use crate::sync::Locked;
use families::{
    ClaimLabels, FloatGauge, GpuHealthLabels, GpuInfoLabels, GpuLabels, GuardLabels, HealthLabels,
    KindLabels, LATENCY_BUCKETS, MigLabels, PhaseFamily, PhaseLabels, ResultLabels, WriteLabels,
    XidLabels,
};

/// Every metric of the node process.
pub struct Metrics {
    registry: Registry,
    prepare_seconds: Histogram,
    unprepare_seconds: Histogram,
    claim_read_seconds: Histogram,
    prepare_phases: PhaseFamily,
    results: Family<ResultLabels, Counter>,
    prepared_claims: Gauge,
    devices: Family<KindLabels, Gauge>,
    mps_daemons: Gauge,
    mps_restarts: Counter,
    guard_violations: Family<GuardLabels, Counter>,
    slice_reconciles: Counter,
    slice_writes: Family<WriteLabels, Counter>,
    gpu_allocated: Family<GpuLabels, Gauge>,
    gpu_used: Family<GpuLabels, Gauge>,
    gpu_total: Family<GpuLabels, Gauge>,
    device_health: Family<HealthLabels, Gauge>,
    gpu_health: Family<GpuHealthLabels, Gauge>,
    xid_errors: Family<XidLabels, Counter>,
    gpu_info: Family<GpuInfoLabels, Gauge>,
    gpu_utilization: Family<GpuLabels, FloatGauge>,
    gpu_temperature: Family<GpuLabels, Gauge>,
    gpu_power: Family<GpuLabels, FloatGauge>,
    mig_used: Family<MigLabels, Gauge>,
    mig_total: Family<MigLabels, Gauge>,
    claim_memory: Family<ClaimLabels, Gauge>,
    claim_sm: Family<ClaimLabels, FloatGauge>,
    ready: AtomicBool,
    sampler: OnceLock<Box<dyn Sample>>,
    renders: renders::Handle,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tessera");
        let latency = || Histogram::new(LATENCY_BUCKETS);
        let m = Metrics {
            prepare_seconds: latency(),
            unprepare_seconds: latency(),
            claim_read_seconds: latency(),
            prepare_phases: families::phase_family(),
            results: Family::default(),
            prepared_claims: Gauge::default(),
            devices: Family::default(),
            mps_daemons: Gauge::default(),
            mps_restarts: Counter::default(),
            guard_violations: Family::default(),
            slice_reconciles: Counter::default(),
            slice_writes: Family::default(),
            gpu_allocated: Family::default(),
            gpu_used: Family::default(),
            gpu_total: Family::default(),
            device_health: Family::default(),
            gpu_health: Family::default(),
            xid_errors: Family::default(),
            gpu_info: Family::default(),
            gpu_utilization: Family::default(),
            gpu_temperature: Family::default(),
            gpu_power: Family::default(),
            mig_used: Family::default(),
            mig_total: Family::default(),
            claim_memory: Family::default(),
            claim_sm: Family::default(),
            ready: AtomicBool::new(false),
            sampler: OnceLock::new(),
            renders: renders::Handle::default(),
            registry: Registry::default(),
        };
        m.register(&mut registry);
        Metrics { registry, ..m }
    }

    fn count(&self, operation: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.results
            .get_or_create(&ResultLabels { operation, result })
            .inc();
    }

    /// The publisher built a model: count its devices; the node is ready.
    pub fn model_built(&self, model: &Model) {
        let (mut gpu, mut mig, mut share, mut monitor) = (0, 0, 0, 0);
        for device in model.devices.values() {
            match device.kind {
                DeviceKind::Whole => gpu += 1,
                DeviceKind::Mig { .. } => mig += 1,
                DeviceKind::Share { .. } | DeviceKind::Replica { .. } => share += 1,
                DeviceKind::Monitor => monitor += 1,
            }
        }
        for (kind, n) in [
            ("gpu", gpu),
            ("mig", mig),
            ("share", share),
            ("monitor", monitor),
        ] {
            self.devices.get_or_create(&KindLabels { kind }).set(n);
        }
        self.ready.store(true, Ordering::SeqCst);
    }

    /// MPS daemons the watchdog restarted.
    pub fn mps_restarted(&self, n: usize) {
        self.mps_restarts.inc_by(n as u64);
    }

    /// A process the claim guard found breaking `rule`, and what it did.
    pub fn guard_violation(&self, rule: &'static str, action: &'static str) {
        self.guard_violations
            .get_or_create(&GuardLabels { rule, action })
            .inc();
    }

    /// Whether the first model is built (prepare can resolve devices).
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// What is read for every render; set once.
    pub fn set_sampler(&self, sampler: impl Sample + 'static) {
        let _ = self.sampler.set(Box::new(sampler));
    }

    /// The text for a scrape: the first render that starts after this call,
    /// shared with the scrapes waiting beside it; `None` if it did not
    /// finish within `limit`. Never blocks the runtime or its blocking pool.
    pub async fn scrape(
        self: &Arc<Self>,
        limit: Duration,
    ) -> Option<Result<hyper::body::Bytes, renders::RenderError>> {
        self.renders.0.clone().scrape(self, limit).await
    }

    /// Scrapes waiting for a render now.
    pub fn scrapes_waiting(&self) -> usize {
        self.renders.0.waiting()
    }

    /// Samples (blocking: NVML) and encodes every metric as OpenMetrics
    /// text. Scrapes go through [`Metrics::scrape`].
    pub fn render(&self) -> String {
        if let Some(sampler) = self.sampler.get() {
            sampler.sample(self);
        }
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    fn set_gpu_memory(&self, family: &Family<GpuLabels, Gauge>, values: &[(String, u64)]) {
        family.clear();
        for (gpu, bytes) in values {
            family
                .get_or_create(&GpuLabels { gpu: gpu.clone() })
                .set(self::bytes(*bytes));
        }
    }
}

/// Prepare reports each claim here; the metrics depend on prepare, never
/// the other way round.
impl PrepareObserver for Metrics {
    fn prepared(&self, took: Duration, ok: bool) {
        self.prepare_seconds.observe(took.as_secs_f64());
        self.count("prepare", ok);
    }

    fn unprepared(&self, took: Duration, ok: bool) {
        self.unprepare_seconds.observe(took.as_secs_f64());
        self.count("unprepare", ok);
    }

    fn claim_read(&self, took: Duration) {
        self.claim_read_seconds.observe(took.as_secs_f64());
    }

    fn prepare_phase(&self, phase: Phase, took: Duration) {
        (self.prepare_phases)
            .get_or_create(&PhaseLabels {
                phase: phase.as_str(),
            })
            .observe(took.as_secs_f64());
    }
}

/// What a render reads besides the counted events (blocking: it runs on
/// the render thread).
pub trait Sample: Send + Sync {
    fn sample(&self, metrics: &Metrics);
}

/// What a render reads from the running node process.
pub struct Sampler {
    pub preparer: Arc<Preparer>,
    /// The node's latest view (its inventory names the GPUs).
    pub view: watch::Receiver<NodeView>,
    pub nvml: Arc<Nvml>,
    /// How many MPS daemons are supervised now (counted without any
    /// daemon's lock).
    pub mps_daemons: Box<dyn Fn() -> usize + Send + Sync>,
    pub publisher: Arc<WriteCounters>,
    pub health: Arc<HealthTracker>,
    /// The published devices (by GPU), for devices by health.
    pub catalog: Arc<DeviceCatalog>,
    /// Claims' consumers read after prepare.
    pub consumers: Arc<claims::Consumers>,
    /// When the last render read NVML's per-process samples (µs after the
    /// epoch).
    pub sampled_at: Mutex<Option<u64>>,
}

/// Microseconds after the Unix epoch, now.
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Sample for Sampler {
    fn sample(&self, m: &Metrics) {
        let entries = self.preparer.entries();
        let completed = entries
            .iter()
            .filter(|(_, e)| e.state == EntryState::Completed)
            .count();
        m.prepared_claims.set(completed as i64);
        // Counted without any daemon's lock, which a prepare starting that
        // daemon holds for seconds.
        m.mps_daemons.set((self.mps_daemons)() as i64);

        let counts = self.publisher.snapshot();
        catch_up(&m.slice_reconciles, self.publisher.reconciles());
        for (result, total) in [
            ("create", counts.creates),
            ("update", counts.updates),
            ("delete", counts.deletes),
            ("rejected", self.publisher.rejected()),
        ] {
            catch_up(
                &m.slice_writes.get_or_create(&WriteLabels { result }),
                total,
            );
        }

        let inventory = self.view.borrow().inventory.clone();
        let allocated: Vec<(String, u64)> =
            memory::allocated_by_gpu(entries.iter().map(|(_, e)| e), &inventory)
                .into_iter()
                .collect();
        m.set_gpu_memory(&m.gpu_allocated, &allocated);
        let now = now_us();
        let since = self
            .sampled_at
            .locked()
            .replace(now)
            .unwrap_or(now.saturating_sub(1_000_000));
        let readings: Vec<gpus::GpuReading> = inventory
            .gpus
            .iter()
            .filter_map(|gpu| {
                let reading = gpus::read(&self.nvml, gpu, since);
                if reading.is_none() {
                    debug!(gpu = %gpu.uuid, "NVML does not find the GPU; no readings of it");
                }
                reading
            })
            .collect();
        m.set_gpus(&inventory, &readings);
        // Pods per claim: as prepare fetched it, or as read again since.
        let mut known = self.preparer.consumers();
        known.extend(self.consumers.known(&entries));
        let proc = std::path::Path::new("/proc");
        let (uses, stale) =
            claims::attribute(&entries, &known, &readings, |pid| claims::pod_of(proc, pid));
        m.set_claims(&uses);
        self.consumers.refresh(stale, &entries);

        let catalog = self.catalog.subscribe().borrow().clone();
        m.set_health(
            &self.health.current(),
            catalog.as_deref(),
            &self.health.xid_counts(),
        );
    }
}

impl Metrics {
    /// Per GPU and MIG device, what NVML read; a GPU or reading missing
    /// leaves no series.
    fn set_gpus(
        &self,
        inventory: &tessera_api::inventory::Inventory,
        readings: &[gpus::GpuReading],
    ) {
        let mut used = Vec::new();
        let mut total = Vec::new();
        self.gpu_info.clear();
        self.gpu_temperature.clear();
        self.gpu_utilization.clear();
        self.gpu_power.clear();
        self.mig_used.clear();
        self.mig_total.clear();
        for (index, gpu) in inventory.gpus.iter().enumerate() {
            self.gpu_info
                .get_or_create(&GpuInfoLabels {
                    gpu: gpu.uuid.clone(),
                    index: index.to_string(),
                    model: gpu.product_name.clone(),
                })
                .set(1);
        }
        for r in readings {
            let labels = GpuLabels {
                gpu: r.uuid.clone(),
            };
            if let Some((u, t)) = r.memory {
                used.push((r.uuid.clone(), u));
                total.push((r.uuid.clone(), t));
            }
            if let Some(percent) = r.utilization {
                self.gpu_utilization
                    .get_or_create(&labels)
                    .set(f64::from(percent) / 100.0);
            }
            if let Some(c) = r.temperature_celsius {
                self.gpu_temperature
                    .get_or_create(&labels)
                    .set(i64::from(c));
            }
            if let Some(mw) = r.power_milliwatts {
                self.gpu_power
                    .get_or_create(&labels)
                    .set(f64::from(mw) / 1000.0);
            }
            for (mig, memory) in &r.migs {
                let Some((u, t)) = memory else { continue };
                let labels = MigLabels {
                    gpu: r.uuid.clone(),
                    mig: mig.clone(),
                };
                self.mig_used.get_or_create(&labels).set(bytes(*u));
                self.mig_total.get_or_create(&labels).set(bytes(*t));
            }
        }
        self.set_gpu_memory(&self.gpu_used, &used);
        self.set_gpu_memory(&self.gpu_total, &total);
    }

    /// Per prepared claim and GPU it holds, what its Pods use; series of
    /// claims gone go with them.
    fn set_claims(&self, uses: &std::collections::BTreeMap<claims::ClaimGpu, claims::ClaimUse>) {
        self.claim_memory.clear();
        self.claim_sm.clear();
        for (c, u) in uses {
            let labels = ClaimLabels {
                namespace: c.namespace.clone(),
                claim: c.name.clone(),
                gpu: c.gpu.clone(),
            };
            self.claim_memory
                .get_or_create(&labels)
                .set(bytes(u.memory_bytes));
            if let Some(sm) = u.sm_percent {
                self.claim_sm
                    .get_or_create(&labels)
                    .set((f64::from(sm) / 100.0).min(1.0));
            }
        }
    }
}

fn bytes(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn health_label(health: Option<&Health>) -> &'static str {
    match health {
        Some(Health::Healthy) => "healthy",
        Some(Health::Unhealthy { .. }) => "unhealthy",
        Some(Health::Unknown { .. }) | None => "unknown",
    }
}

impl Metrics {
    /// Health gauges from the tracker's map and the published devices; the
    /// XID counters catch up with the tracker's counts.
    fn set_health(
        &self,
        map: &HealthMap,
        catalog: Option<&Catalog>,
        xids: &std::collections::BTreeMap<(String, u64), u64>,
    ) {
        let mut by_health =
            std::collections::BTreeMap::from([("healthy", 0), ("unhealthy", 0), ("unknown", 0)]);
        for (_, device) in catalog.into_iter().flat_map(Catalog::devices) {
            let label = health_label(map.get(&device.gpu_uuid).map(|g| &g.health));
            *by_health.entry(label).or_default() += 1;
        }
        for (health, n) in by_health {
            self.device_health
                .get_or_create(&HealthLabels { health })
                .set(n);
        }
        self.gpu_health.clear();
        for (gpu, g) in map {
            self.gpu_health
                .get_or_create(&GpuHealthLabels {
                    gpu: gpu.clone(),
                    health: health_label(Some(&g.health)),
                })
                .set(1);
        }
        for ((gpu, xid), n) in xids {
            catch_up(
                &self.xid_errors.get_or_create(&XidLabels {
                    gpu: gpu.clone(),
                    xid: xid.to_string(),
                }),
                *n,
            );
        }
    }
}

/// Brings a counter up to an external running total.
fn catch_up(counter: &Counter, total: u64) {
    let have = counter.get();
    if total > have {
        counter.inc_by(total - have);
    }
}

#[cfg(test)]
mod tests;
