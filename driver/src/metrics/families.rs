//! The metric families and their labels, and their registration: every
//! name, help text and unit the node serves (docs/operations.md lists
//! them). Families are registered in the order they are rendered.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::Metrics;

/// Latency buckets for prepare and unprepare, in seconds (1 ms .. 60 s).
pub(super) const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// Buckets for the steps of one prepare, in seconds (50 µs .. 1 s).
pub(super) const PHASE_BUCKETS: [f64; 12] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0,
];

/// A histogram family of prepare steps.
pub(super) type PhaseFamily = Family<PhaseLabels, Histogram, fn() -> Histogram>;

pub(super) fn phase_family() -> PhaseFamily {
    Family::new_with_constructor(|| Histogram::new(PHASE_BUCKETS))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PhaseLabels {
    pub(super) phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ResultLabels {
    pub(super) operation: &'static str,
    pub(super) result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct GuardLabels {
    pub(super) rule: &'static str,
    pub(super) action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct WriteLabels {
    pub(super) result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabels {
    pub(super) kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct GpuLabels {
    pub(super) gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct GpuInfoLabels {
    pub(super) gpu: String,
    pub(super) index: String,
    pub(super) model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct MigLabels {
    pub(super) gpu: String,
    pub(super) mig: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ClaimLabels {
    pub(super) namespace: String,
    pub(super) claim: String,
    pub(super) gpu: String,
}

/// A gauge of fractional values (ratios, watts).
pub(super) type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct HealthLabels {
    pub(super) health: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct GpuHealthLabels {
    pub(super) gpu: String,
    pub(super) health: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct XidLabels {
    pub(super) gpu: String,
    pub(super) xid: String,
}

impl Metrics {
    /// Registers every family in `registry`, in the order they render.
    pub(super) fn register(&self, registry: &mut Registry) {
        self.register_prepare(registry);
        self.register_model(registry);
        self.register_mps(registry);
        self.register_guard(registry);
        self.register_publisher(registry);
        self.register_memory(registry);
        self.register_health(registry);
        self.register_activity(registry);
    }

    /// Prepare and unprepare: how long each claim took, how it ended, and how
    /// many are prepared.
    fn register_prepare(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "prepare_duration",
            "Time to prepare one claim (NodePrepareResources, per claim)",
            Unit::Seconds,
            self.prepare_seconds.clone(),
        );
        registry.register_with_unit(
            "unprepare_duration",
            "Time to unprepare one claim (NodeUnprepareResources, per claim)",
            Unit::Seconds,
            self.unprepare_seconds.clone(),
        );
        registry.register_with_unit(
            "claim_read_duration",
            "Time prepare waited for the API server to return a claim (part of prepare_duration)",
            Unit::Seconds,
            self.claim_read_seconds.clone(),
        );
        registry.register_with_unit(
            "prepare_phase_duration",
            "Time of each step of prepare, by phase (recorded, resolve, handover, effects, spec, record; after_read: all but the claim read)",
            Unit::Seconds,
            self.prepare_phases.clone(),
        );
        registry.register(
            "claim_operations",
            "Claims prepared and unprepared, by operation (prepare, unprepare) and result (ok, error)",
            self.results.clone(),
        );
        registry.register(
            "prepared_claims",
            "Claims prepared on this node (completed checkpoint entries)",
            self.prepared_claims.clone(),
        );
    }

    /// The devices of the slice model last built.
    fn register_model(&self, registry: &mut Registry) {
        registry.register(
            "published_devices",
            "Devices in the slice model last built for this node, by kind (gpu, mig, share, monitor)",
            self.devices.clone(),
        );
    }

    /// The MPS control daemons the node supervises.
    fn register_mps(&self, registry: &mut Registry) {
        registry.register(
            "mps_daemons",
            "MPS control daemons the node process supervises (one per request of a claim and device)",
            self.mps_daemons.clone(),
        );
        registry.register(
            "mps_daemon_restarts",
            "MPS control daemons the watchdog found dead and started again",
            self.mps_restarts.clone(),
        );
    }

    /// What the claim guard found and did.
    fn register_guard(&self, registry: &mut Registry) {
        registry.register(
            "claim_guard_violations",
            "Processes the claim guard found breaking an Isolated claim's promise, by rule \
             (left-mps, claim-memory, no-claim) and what it did (killed, reported)",
            self.guard_violations.clone(),
        );
    }

    /// The ResourceSlice publisher's passes and writes.
    fn register_publisher(&self, registry: &mut Registry) {
        registry.register(
            "slice_reconciles",
            "Reconcile passes of the ResourceSlice publisher, successful or not",
            self.slice_reconciles.clone(),
        );
        registry.register(
            "slice_writes",
            "ResourceSlice writes by the publisher, by result (create, update, delete: accepted; rejected: refused by the API server)",
            self.slice_writes.clone(),
        );
    }

    /// Device memory per GPU: allocated to claims, used, in all.
    fn register_memory(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "gpu_memory_allocated",
            "Device memory allocated to prepared claims on a GPU (whole GPU: its memory; MIG: the instance's; share: consumed memory)",
            Unit::Bytes,
            self.gpu_allocated.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_used",
            "Device memory NVML reports used on a GPU",
            Unit::Bytes,
            self.gpu_used.clone(),
        );
        registry.register_with_unit(
            "gpu_memory_total",
            "Device memory of a GPU, as NVML reports it",
            Unit::Bytes,
            self.gpu_total.clone(),
        );
    }

    /// The health of devices and GPUs, and XID events.
    fn register_health(&self, registry: &mut Registry) {
        registry.register(
            "device_health",
            "Published devices by the health of their GPU (healthy, unhealthy, unknown), as the kubelet is told",
            self.device_health.clone(),
        );
        registry.register(
            "gpu_health",
            "1 for each GPU's current health (healthy, unhealthy, unknown)",
            self.gpu_health.clone(),
        );
        registry.register(
            "xid_errors",
            "NVML XID critical error events, by GPU and XID (0: NVML could not say which)",
            self.xid_errors.clone(),
        );
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
}
