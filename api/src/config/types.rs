//! The config kinds as users write them (`gpu.tessera.dev/v1alpha1`).
//!
//! Every field is optional: a config only states what it wants to change,
//! and [`super::resolve`] fills the rest from lower-precedence configs and
//! the built-in defaults. Unknown fields are rejected everywhere.

use std::fmt;

use serde::Deserialize;

/// The config kinds, one per device type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// [`GpuConfig`]: whole GPUs (`type: gpu`).
    GpuConfig,
    /// [`MigConfig`]: MIG devices (`type: mig`).
    MigConfig,
    /// [`ShareConfig`]: shares of a GPU (`type: share`).
    ShareConfig,
}

impl Kind {
    /// All kinds, in documentation order.
    pub const ALL: [Kind; 3] = [Kind::GpuConfig, Kind::MigConfig, Kind::ShareConfig];

    /// The `kind` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::GpuConfig => "GpuConfig",
            Kind::MigConfig => "MigConfig",
            Kind::ShareConfig => "ShareConfig",
        }
    }

    /// Parses a `kind` string (exact, case-sensitive).
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One decoded config object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Config {
    /// `kind: GpuConfig`.
    Gpu(GpuConfig),
    /// `kind: MigConfig`.
    Mig(MigConfig),
    /// `kind: ShareConfig`.
    Share(ShareConfig),
}

impl Config {
    /// The kind of this config.
    pub fn kind(&self) -> Kind {
        match self {
            Config::Gpu(_) => Kind::GpuConfig,
            Config::Mig(_) => Kind::MigConfig,
            Config::Share(_) => Kind::ShareConfig,
        }
    }
}

/// Settings for a whole, exclusively allocated GPU.
///
/// ```yaml
/// apiVersion: gpu.tessera.dev/v1alpha1
/// kind: GpuConfig
/// sharing:
///   strategy: TimeSlicing
///   timeSlicing:
///     interval: Long
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with field sharing"
)]
pub struct GpuConfig {
    /// How the containers and Pods that share this claim share the GPU.
    pub sharing: Option<GpuSharing>,
}

/// Sharing among the consumers of one claim (every container of every Pod
/// that references it). The claim owns the whole card, so it may tune it;
/// settings are undone when the claim is unprepared.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with fields strategy, timeSlicing, mps"
)]
pub struct GpuSharing {
    /// `None` (default): the card is left as the node has it; processes are
    /// time-sliced by the CUDA driver's defaults. `TimeSlicing`: set the
    /// compute time-slice (see `timeSlicing`). `MPS`: run the claim's
    /// processes under an MPS control daemon the driver supervises (see
    /// `mps`).
    pub strategy: Option<GpuSharingStrategy>,
    /// Only with `strategy: TimeSlicing` (stated in the same config).
    pub time_slicing: Option<TimeSlicing>,
    /// Only with `strategy: MPS` (stated in the same config).
    pub mps: Option<MpsSettings>,
}

/// `sharing.mps` of a [`GpuConfig`] or [`MigConfig`]: the per-process
/// limits of [`ProcessLimits`], and the claim's `/dev/shm`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with fields memory, computePercent, sharedMemory"
)]
pub struct MpsSettings {
    /// As [`ProcessLimits::memory`].
    pub memory: Option<Quantity>,
    /// As [`ProcessLimits::compute_percent`].
    pub compute_percent: Option<u32>,
    /// As [`ShareConfig::shared_memory`].
    pub shared_memory: Option<Quantity>,
}

impl MpsSettings {
    /// The per-process part.
    pub fn process_limits(&self) -> ProcessLimits {
        ProcessLimits {
            memory: self.memory,
            compute_percent: self.compute_percent,
        }
    }
}

/// `sharing.strategy` of a [`GpuConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum GpuSharingStrategy {
    /// Leave the card's scheduling alone.
    None,
    /// Set the compute time-slice interval while the claim holds the card.
    TimeSlicing,
    /// NVIDIA Multi-Process Service for the claim's processes.
    #[serde(rename = "MPS")]
    Mps,
}

/// `sharing.timeSlicing`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with field interval"
)]
pub struct TimeSlicing {
    /// Length of a compute time slice: `Default` (the driver's), `Short`,
    /// `Medium` or `Long`. Longer slices favour throughput, shorter ones
    /// latency. Default: `Default`.
    pub interval: Option<TimeSliceInterval>,
}

/// The NVIDIA driver's compute time-slice settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
pub enum TimeSliceInterval {
    /// The driver's default slice.
    Default,
    /// Short slices.
    Short,
    /// Medium slices.
    Medium,
    /// Long slices.
    Long,
}

impl TimeSliceInterval {
    /// The driver's numeric setting (`nvidia-smi compute-policy
    /// --set-timeslice`): 0 default, 1 short, 2 medium, 3 long.
    pub fn level(self) -> u32 {
        match self {
            TimeSliceInterval::Default => 0,
            TimeSliceInterval::Short => 1,
            TimeSliceInterval::Medium => 2,
            TimeSliceInterval::Long => 3,
        }
    }
}

/// Settings for a MIG device.
///
/// ```yaml
/// apiVersion: gpu.tessera.dev/v1alpha1
/// kind: MigConfig
/// sharing:
///   strategy: MPS
///   mps:
///     computePercent: 50
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with field sharing"
)]
pub struct MigConfig {
    /// How the consumers of this claim share the MIG device.
    pub sharing: Option<MigSharing>,
}

/// Sharing of a MIG device among the consumers of one claim. There is no
/// time-slicing setting: the time slice is a property of the parent GPU,
/// whose other MIG devices belong to other claims; it is node policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with fields strategy, mps"
)]
pub struct MigSharing {
    /// `None` (default) or `MPS` (an MPS control daemon on this MIG device).
    pub strategy: Option<MigSharingStrategy>,
    /// Only with `strategy: MPS` (stated in the same config).
    pub mps: Option<MpsSettings>,
}

/// `sharing.strategy` of a [`MigConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum MigSharingStrategy {
    /// No MPS.
    None,
    /// NVIDIA Multi-Process Service on the MIG device.
    #[serde(rename = "MPS")]
    Mps,
}

/// Settings for a share of a GPU.
///
/// ```yaml
/// apiVersion: gpu.tessera.dev/v1alpha1
/// kind: ShareConfig
/// processLimits:
///   memory: 4Gi
///   computePercent: 20
/// sharedMemory: 1Gi
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with fields processLimits, sharedMemory"
)]
pub struct ShareConfig {
    /// Tighter per-process limits inside what the claim was allocated; only
    /// for `Isolated` share devices (on `Shared` ones nothing is enforced, so
    /// asking for limits is an error rather than a silent no-op). Default:
    /// each process may use everything the claim consumed (`memory`,
    /// `cores`).
    pub process_limits: Option<ProcessLimits>,
    /// Size of the claim's `/dev/shm` under MPS (its processes and their
    /// MPS server share memory there): a tmpfs of its own per daemon, so
    /// filling it reaches no other claim. Default: the node policy's
    /// `mps.sharedMemory`; at most its `mps.maxSharedMemory`, which the node
    /// checks at prepare. Only for `Isolated` shares (and `sharing.mps` of
    /// whole GPUs and MIG devices).
    pub shared_memory: Option<Quantity>,
}

/// Limits applied to each CUDA process of a claim by the isolation provider.
///
/// Under MPS, `memory` becomes `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` and
/// `computePercent` `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, per process. Under
/// a `hami-core` provider they become `CUDA_DEVICE_MEMORY_LIMIT_<i>` and
/// `CUDA_DEVICE_SM_LIMIT_<i>`, shared by the processes of one container.
/// Useful when several processes share one claim and each should stay
/// within a part of it. Neither may exceed what the claim holds:
/// the whole device for GPUs and MIG devices, the consumed capacity for
/// shares.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "an object with fields memory, computePercent"
)]
pub struct ProcessLimits {
    /// Device memory each process may allocate, a Kubernetes quantity
    /// (`4Gi`, `512Mi`, `8G`). Greater than zero.
    pub memory: Option<Quantity>,
    /// Share of the device's compute (SMs) each process may use, 1–100.
    pub compute_percent: Option<u32>,
}

/// A byte count written as a Kubernetes quantity: an unsigned decimal
/// number with an optional binary (`Ki` `Mi` `Gi` `Ti` `Pi` `Ei`) or decimal
/// (`k` `M` `G` `T` `P` `E`) suffix, e.g. `4Gi`, `1.5Gi`, `500M`, or a plain
/// JSON integer. Fractions of a byte round up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Quantity(u64);

impl Quantity {
    /// A quantity of `bytes`.
    pub const fn from_bytes(bytes: u64) -> Self {
        Quantity(bytes)
    }

    /// The value in bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }

    /// Parses the string form.
    pub fn parse(s: &str) -> Result<Self, QuantityError> {
        parse_quantity(s).map(Quantity)
    }
}

/// Why a string is not a quantity of bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("quantity `{0}` has unknown suffix `{1}`")]
    Suffix(String, String),
    #[error("`{0}` is not a quantity")]
    NotANumber(String),
    #[error("quantity `{0}` is too large or too precise")]
    TooPrecise(String),
    #[error("quantity `{0}` does not fit in 64 bits of bytes")]
    TooLarge(String),
}

impl fmt::Display for Quantity {
    /// The shortest exact binary form (`4Gi`), or plain bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["Ei", "Pi", "Ti", "Gi", "Mi", "Ki"];
        for (i, unit) in UNITS.iter().enumerate() {
            let size = 1u64 << (10 * (6 - i));
            if self.0 != 0 && self.0.is_multiple_of(size) {
                return write!(f, "{}{unit}", self.0 / size);
            }
        }
        write!(f, "{}", self.0)
    }
}

fn parse_quantity(s: &str) -> Result<u64, QuantityError> {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    let multiplier: u128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        other => {
            return Err(QuantityError::Suffix(s.into(), other.into()));
        }
    };
    let (whole, frac) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() || (number.contains('.') && frac.is_empty()) || frac.contains('.') {
        return Err(QuantityError::NotANumber(s.into()));
    }
    // At most 19 fractional digits keeps every intermediate within u128.
    if whole.len() > 20 || frac.len() > 19 {
        return Err(QuantityError::TooPrecise(s.into()));
    }
    let too_large = || QuantityError::TooLarge(s.into());
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let mut bytes = whole.checked_mul(multiplier).ok_or_else(too_large)?;
    if !frac.is_empty() {
        let scale = 10u128.pow(frac.len() as u32);
        let frac: u128 = frac.parse().map_err(|_| too_large())?;
        // Round fractions of a byte up, as Kubernetes does.
        let part = (frac * multiplier).div_ceil(scale);
        bytes = bytes.checked_add(part).ok_or_else(too_large)?;
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quantity string such as \"4Gi\" or a byte count")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Quantity, E> {
                Quantity::parse(v).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity(v))
            }
        }
        d.deserialize_any(Visitor)
    }
}
