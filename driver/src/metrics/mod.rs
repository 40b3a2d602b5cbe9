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
//! own ([`renders`]). Every name starts with `tessera_`; docs/operations.md
//! describes them all.

pub mod claims;
pub mod gpus;
pub mod memory;
pub mod renders;
pub mod server;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nvml_wrapper::Nvml;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tessera_controller::model::{DeviceKind, Model};
use tessera_controller::publisher::{NodeView, WriteCounters};
use tokio::sync::watch;
use tracing::debug;

use crate::health::{Health, HealthMap, HealthTracker};
use crate::prepare::{PrepareObserver, Preparer};
use crate::state::catalog::{Catalog, DeviceCatalog};
use crate::state::records::EntryState;
use crate::sync::Locked;

/// Latency buckets for prepare and unprepare, in seconds (1 ms .. 60 s).
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    operation: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardLabels {
    rule: &'static str,
    action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuInfoLabels {
    gpu: String,
    index: String,
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MigLabels {
    gpu: String,
    mig: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    namespace: String,
    claim: String,
    gpu: String,
}

/// A gauge of fractional values (ratios, watts).
type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabels {
    health: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuHealthLabels {
    gpu: String,
    health: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabels {
    gpu: String,
    xid: String,
}

/// Every metric of the node process.
pub struct Metrics {
    registry: Registry,
    prepare_seconds: Histogram,
    unprepare_seconds: Histogram,
    claim_read_seconds: Histogram,
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
        registry.register_with_unit(
            "prepare_duration",
            "Time to prepare one claim (NodePrepareResources, per claim)",
            Unit::Seconds,
            m.prepare_seconds.clone(),
        );
        registry.register_with_unit(
            "unprepare_duration",
            "Time to unprepare one claim (NodeUnprepareResources, per claim)",
            Unit::Seconds,
            m.unprepare_seconds.clone(),
        );
        registry.register_with_unit(
            "claim_read_duration",
            "Time prepare waited for the API server to return a claim (part of prepare_duration)",
            Unit::Seconds,
            m.claim_read_seconds.clone(),
        );
        registry.register(
            "claim_operations",
            "Claims prepared and unprepared, by operation (prepare, unprepare) and result (ok, error)",
            m.results.clone(),
        );
        registry.register(
            "prepared_claims",
            "Claims prepared on this node (completed checkpoint entries)",
            m.prepared_claims.clone(),
        );
        registry.register(
            "published_devices",
            "Devices in the slice model last built for this node, by kind (gpu, mig, share, monitor)",
            m.devices.clone(),
        );
        registry.register(
            "mps_daemons",
            "MPS control daemons the node process supervises (one per request of a claim and device)",
            m.mps_daemons.clone(),
        );
        registry.register(
            "mps_daemon_restarts",
            "MPS control daemons the watchdog found dead and started again",
            m.mps_restarts.clone(),
        );
        registry.register(
            "claim_guard_violations",
            "Processes the claim guard found breaking an Isolated claim's promise, by rule \
             (left-mps, claim-memory, no-claim) and what it did (killed, reported)",
            m.guard_violations.clone(),
        );
        registry.register(
            "slice_reconciles",
            "Reconcile passes of the ResourceSlice publisher, successful or not",
            m.slice_reconciles.clone(),
        );
        registry.register(
            "slice_writes",
            "ResourceSlice writes by the publisher, by result (create, update, delete: accepted; rejected: refused by the API server)",
            m.slice_writes.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_allocated",
            "Device memory allocated to prepared claims on a GPU (whole GPU: its memory; MIG: the instance's; share: consumed memory)",
            Unit::Bytes,
            m.gpu_allocated.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_used",
            "Device memory NVML reports used on a GPU",
            Unit::Bytes,
            m.gpu_used.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_total",
            "Device memory of a GPU, as NVML reports it",
            Unit::Bytes,
            m.gpu_total.clone(),
        );
        registry.register(
            "device_health",
            "Published devices by the health of their GPU (healthy, unhealthy, unknown), as the kubelet is told",
            m.device_health.clone(),
        );
        registry.register(
            "gpu_health",
            "1 for each GPU's current health (healthy, unhealthy, unknown)",
            m.gpu_health.clone(),
        );
        registry.register(
            "xid_errors",
            "NVML XID critical error events, by GPU and XID (0: NVML could not say which)",
            m.xid_errors.clone(),
        );
        m.register_activity(&mut registry);
        Metrics { registry, ..m }
    }

    /// What the GPUs and the claims' processes are doing.
    fn register_activity(&self, registry: &mut Registry) {
        registry.register(
            "gpu_info",
            "1 per GPU NVML lists, with its index and model (join on gpu for names)",
            self.gpu_info.clone(),
        );
        registry.register_with_unit(
            "gpu_utilization",
            "Fraction of the last sample period kernels ran on a GPU (NVML; absent in MIG mode)",
            Unit::Other("ratio".into()),
            self.gpu_utilization.clone(),
        );
        registry.register_with_unit(
            "gpu_temperature",
            "GPU die temperature (NVML)",
            Unit::Celsius,
            self.gpu_temperature.clone(),
        );
        registry.register_with_unit(
            "gpu_power",
            "GPU power draw (NVML)",
            Unit::Other("watts".into()),
            self.gpu_power.clone(),
        );
        registry.register_with_unit(
            "mig_memory_used",
            "Device memory NVML reports used on a MIG device",
            Unit::Bytes,
            self.mig_used.clone(),
        );
        registry.register_with_unit(
            "mig_memory_total",
            "Device memory of a MIG device, as NVML reports it",
            Unit::Bytes,
            self.mig_total.clone(),
        );
        registry.register_with_unit(
            "claim_memory_used",
            "Device memory the processes of a prepared claim's Pods hold on a GPU it holds (NVML per-process memory, Pods found through their cgroups)",
            Unit::Bytes,
            self.claim_memory.clone(),
        );
        registry.register_with_unit(
            "claim_sm_utilization",
            "Fraction of a GPU's SMs the processes of a prepared claim's Pods occupied in their latest NVML samples (absent where NVML samples no process: MIG mode)",
            Unit::Other("ratio".into()),
            self.claim_sm.clone(),
        );
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
    ) -> Option<Result<hyper::body::Bytes, String>> {
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
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_prefix_and_units() {
        let m = Metrics::new();
        m.prepared(Duration::from_millis(20), true);
        m.prepared(Duration::from_millis(20), false);
        m.unprepared(Duration::from_millis(3), true);
        m.claim_read(Duration::from_millis(2));
        let text = m.render();
        for line in [
            "tessera_prepare_duration_seconds_count 2",
            "tessera_unprepare_duration_seconds_count 1",
            "tessera_claim_read_duration_seconds_count 1",
            "tessera_claim_operations_total{operation=\"prepare\",result=\"ok\"} 1",
            "tessera_claim_operations_total{operation=\"prepare\",result=\"error\"} 1",
            "tessera_claim_operations_total{operation=\"unprepare\",result=\"ok\"} 1",
            "tessera_prepared_claims 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        assert!(!m.ready());
    }

    #[test]
    fn devices_and_gpus_are_counted_by_health() {
        use crate::health::{GpuHealth, XidPolicy};
        use std::time::SystemTime;
        use tessera_controller::model::DeviceRef;
        let device = |gpu: &str, kind| DeviceRef {
            gpu_uuid: gpu.into(),
            gpu_index: 0,
            kind,
        };
        let catalog = Catalog::new(
            Default::default(),
            [
                ("gpu-0".to_owned(), device("GPU-0", DeviceKind::Whole)),
                (
                    "gpu-0-monitor".to_owned(),
                    device("GPU-0", DeviceKind::Monitor),
                ),
                ("gpu-1".to_owned(), device("GPU-1", DeviceKind::Whole)),
                ("gpu-2".to_owned(), device("GPU-2", DeviceKind::Whole)),
            ]
            .into_iter()
            .collect(),
        );
        let at = SystemTime::UNIX_EPOCH;
        let map: HealthMap = [
            (
                "GPU-0".to_owned(),
                GpuHealth {
                    health: Health::Unhealthy { xid: 79 },
                    since: at,
                    unhealthy_since: Some(at),
                },
            ),
            (
                "GPU-1".to_owned(),
                GpuHealth {
                    health: Health::Healthy,
                    since: at,
                    unhealthy_since: None,
                },
            ),
        ]
        .into_iter()
        .collect();
        let tracker = HealthTracker::new(XidPolicy::default(), None);
        tracker.xid("GPU-0", Some(79), at);
        tracker.xid("GPU-0", Some(79), at);
        let m = Metrics::new();
        m.set_health(&map, Some(&catalog), &tracker.xid_counts());
        let text = m.render();
        for line in [
            "tessera_device_health{health=\"healthy\"} 1",
            "tessera_device_health{health=\"unhealthy\"} 2",
            "tessera_device_health{health=\"unknown\"} 1",
            "tessera_gpu_health{gpu=\"GPU-0\",health=\"unhealthy\"} 1",
            "tessera_gpu_health{gpu=\"GPU-1\",health=\"healthy\"} 1",
            "tessera_xid_errors_total{gpu=\"GPU-0\",xid=\"79\"} 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn gpu_and_claim_readings_render_with_their_units_and_only_what_nvml_gave() {
        let inventory = tessera_api::inventory::Inventory {
            gpus: vec![tessera_api::inventory::Gpu {
                uuid: "GPU-a".into(),
                product_name: "NVIDIA H100 80GB HBM3".into(),
                brand: "Nvidia".into(),
                architecture: "hopper".into(),
                cuda_compute_capability: "9.0".into(),
                pci_bus_id: "0000:07:00.0".into(),
                memory_bytes: 80 << 30,
                multiprocessors: 132,
                minor: 0,
                mig: tessera_api::inventory::Mig::NotSupported,
            }],
            ..Default::default()
        };
        let reading = gpus::GpuReading {
            uuid: "GPU-a".into(),
            utilization: Some(100),
            memory: Some((3 << 30, 80 << 30)),
            temperature_celsius: Some(72),
            power_milliwatts: None,
            migs: vec![
                ("MIG-1".into(), Some((1 << 30, 10 << 30))),
                ("MIG-2".into(), None),
            ],
            processes: Vec::new(),
            sm_percent: None,
        };
        let claim = claims::ClaimGpu {
            namespace: "ns".into(),
            name: "train".into(),
            gpu: "GPU-a".into(),
        };
        let uses = [(
            claim,
            claims::ClaimUse {
                memory_bytes: 3 << 30,
                sm_percent: Some(250),
            },
        )]
        .into_iter()
        .collect();
        let m = Metrics::new();
        m.set_gpus(&inventory, &[reading]);
        m.set_claims(&uses);
        let text = m.render();
        for line in [
            "tessera_gpu_info{gpu=\"GPU-a\",index=\"0\",model=\"NVIDIA H100 80GB HBM3\"} 1",
            "tessera_gpu_utilization_ratio{gpu=\"GPU-a\"} 1.0",
            "tessera_gpu_temperature_celsius{gpu=\"GPU-a\"} 72",
            "tessera_gpu_memory_used_bytes{gpu=\"GPU-a\"} 3221225472",
            "tessera_mig_memory_used_bytes{gpu=\"GPU-a\",mig=\"MIG-1\"} 1073741824",
            "tessera_claim_memory_used_bytes{namespace=\"ns\",claim=\"train\",gpu=\"GPU-a\"} 3221225472",
            // Several processes' samples never add up to more than the GPU.
            "tessera_claim_sm_utilization_ratio{namespace=\"ns\",claim=\"train\",gpu=\"GPU-a\"} 1.0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        for absent in ["tessera_gpu_power_watts{", "mig=\"MIG-2\""] {
            assert!(!text.contains(absent), "{absent} in\n{text}");
        }
        // The claim unprepared: its series go.
        m.set_claims(&Default::default());
        assert!(!m.render().contains("claim=\"train\""));
    }

    #[test]
    fn a_counter_catches_up_with_a_running_total() {
        let c = Counter::<u64>::default();
        catch_up(&c, 3);
        catch_up(&c, 3);
        catch_up(&c, 5);
        assert_eq!(c.get(), 5);
    }
}
