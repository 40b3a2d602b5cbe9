//! Merging the configs that apply to a device into what prepare enforces.

use serde_json::Value;

use super::decode::decode_value;
use super::error::{ConfigError, Problem, ProblemKind, SourceRef};
use super::types::{
    Config, GpuSharingStrategy, Kind, MigSharingStrategy, MpsSettings, ProcessLimits, Quantity,
    TimeSliceInterval,
};
use crate::names;

/// Where a config entry was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Origin {
    /// A DeviceClass's `spec.config` (platform defaults). Lower precedence.
    Class,
    /// The claim's `spec.devices.config`. Higher precedence.
    Claim,
}

/// One opaque config entry addressed to this driver, as the driver found it
/// (normally in the claim's `status.allocation.devices.config`, whose
/// `source` gives the origin). Entries for other drivers are not passed in.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigSource {
    /// DeviceClass or claim.
    pub origin: Origin,
    /// Requests the entry is scoped to; empty means every request. A name
    /// also matches its subrequests (`gpu` matches `gpu/large`).
    pub requests: Vec<String>,
    /// The entry's position as users can find it (e.g. its index in
    /// `status.allocation.devices.config`); only used in error messages.
    pub index: usize,
    /// `opaque.parameters`.
    pub parameters: Value,
}

/// What kind of device a config is resolved for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceType {
    /// A whole GPU.
    Gpu,
    /// A MIG device.
    Mig,
    /// A share of a GPU, at the given isolation level.
    Share(IsolationLevel),
    /// A GPU's monitoring device (admin access): takes no config.
    Monitor,
}

impl DeviceType {
    /// The value of the `type` attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceType::Gpu => names::device_type::GPU,
            DeviceType::Mig => names::device_type::MIG,
            DeviceType::Share(_) => names::device_type::SHARE,
            DeviceType::Monitor => names::device_type::MONITOR,
        }
    }

    /// The config kind for this device type (`None`: it takes none).
    pub fn config_kind(self) -> Option<Kind> {
        match self {
            DeviceType::Gpu => Some(Kind::GpuConfig),
            DeviceType::Mig => Some(Kind::MigConfig),
            DeviceType::Share(_) => Some(Kind::ShareConfig),
            DeviceType::Monitor => None,
        }
    }
}

/// The `isolationLevel` of a share device: one vocabulary for the slice
/// model, the config API and the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IsolationLevel {
    /// Memory and compute limits enforced per claim.
    Isolated,
    /// Burstable time-slicing; capacity is accounting only.
    Shared,
}

impl IsolationLevel {
    /// The attribute value.
    pub fn as_str(self) -> &'static str {
        match self {
            IsolationLevel::Isolated => names::isolation_level::ISOLATED,
            IsolationLevel::Shared => names::isolation_level::SHARED,
        }
    }

    /// Used in device names.
    pub fn slug(self) -> &'static str {
        match self {
            IsolationLevel::Isolated => "isolated",
            IsolationLevel::Shared => "shared",
        }
    }
}

/// What one claim holds of one device: the whole device for GPUs and MIG
/// devices, the consumed capacity for shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holdings {
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// Compute in percent of the device (100 for whole devices).
    pub compute_percent: u32,
}

/// One device allocated to the claim by this driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTarget {
    /// The allocation result's request name (`gpu`, or `gpu/large` for a
    /// subrequest).
    pub request: String,
    /// Device name, for messages.
    pub device: String,
    /// Its type.
    pub device_type: DeviceType,
    /// What the claim holds of it.
    pub holds: Holdings,
}

/// Per-process limits after defaulting, and the claim's `/dev/shm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Device memory per process, bytes.
    pub memory_bytes: u64,
    /// Compute per process, percent of the device (1–100).
    pub compute_percent: u32,
    /// Size of the claim's `/dev/shm` under MPS (shared by its processes,
    /// not per process); `None`: the node's default. The node checks it
    /// against its maximum.
    pub shared_memory_bytes: Option<u64>,
}

/// How a whole GPU or MIG device is shared among the claim's consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// Leave the device alone.
    None,
    /// Set the compute time slice (whole GPUs only).
    TimeSlicing {
        /// The interval to set.
        interval: TimeSliceInterval,
    },
    /// Run the claim's processes under MPS with these defaults.
    Mps {
        /// Per-process limits.
        limits: Limits,
    },
}

/// The settings prepare enforces for one device: every field decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EffectiveConfig {
    /// A whole GPU.
    Gpu {
        /// Sharing among the claim's consumers.
        sharing: Sharing,
    },
    /// A MIG device; `sharing` is never `TimeSlicing`.
    Mig {
        /// Sharing among the claim's consumers.
        sharing: Sharing,
    },
    /// A share device.
    Share {
        /// Per-process limits for `Isolated` shares (defaulting to the
        /// consumed capacity); `None` for `Shared` ones.
        limits: Option<Limits>,
    },
    /// A monitoring device: nothing to set.
    Monitor,
}

impl EffectiveConfig {
    /// The built-in defaults for a device, before any config.
    pub fn defaults_for(device: &DeviceTarget) -> Self {
        match device.device_type {
            DeviceType::Gpu => EffectiveConfig::Gpu {
                sharing: Sharing::None,
            },
            DeviceType::Mig => EffectiveConfig::Mig {
                sharing: Sharing::None,
            },
            DeviceType::Share(IsolationLevel::Isolated) => EffectiveConfig::Share {
                limits: Some(full(device.holds)),
            },
            DeviceType::Share(IsolationLevel::Shared) => EffectiveConfig::Share { limits: None },
            DeviceType::Monitor => EffectiveConfig::Monitor,
        }
    }
}

fn full(h: Holdings) -> Limits {
    Limits {
        memory_bytes: h.memory_bytes,
        compute_percent: h.compute_percent,
        shared_memory_bytes: None,
    }
}

/// How specifically a source targets a device; higher wins within an origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scope {
    /// No `requests`: every device of the claim.
    All,
    /// Names the parent request of the device's subrequest.
    Parent,
    /// Names the device's request exactly.
    Exact,
}

fn scope_for(requests: &[String], device_request: &str) -> Option<Scope> {
    if requests.is_empty() {
        return Some(Scope::All);
    }
    let mut best = None;
    for r in requests {
        let s = if r == device_request {
            Scope::Exact
        } else if device_request
            .strip_prefix(r.as_str())
            .is_some_and(|rest| rest.starts_with('/'))
        {
            Scope::Parent
        } else {
            continue;
        };
        best = best.max(Some(s));
    }
    best
}

/// A leaf setting and the source that set it last.
type Leaf<T> = Option<(T, usize)>;

fn set<T: Copy>(leaf: &mut Leaf<T>, value: Option<T>, source: usize) {
    if let Some(v) = value {
        *leaf = Some((v, source));
    }
}

#[derive(Default)]
struct Merged {
    gpu_strategy: Leaf<GpuSharingStrategy>,
    mig_strategy: Leaf<MigSharingStrategy>,
    interval: Leaf<TimeSliceInterval>,
    memory: Leaf<Quantity>,
    compute: Leaf<u32>,
    shared_memory: Leaf<Quantity>,
}

impl Merged {
    fn limits(&mut self, l: &Option<ProcessLimits>, source: usize) {
        if let Some(l) = l {
            set(&mut self.memory, l.memory, source);
            set(&mut self.compute, l.compute_percent, source);
        }
    }

    fn mps(&mut self, mps: &Option<MpsSettings>, source: usize) {
        if let Some(mps) = mps {
            self.limits(&Some(mps.process_limits()), source);
            set(&mut self.shared_memory, mps.shared_memory, source);
        }
    }

    fn add(&mut self, config: &Config, source: usize) {
        match config {
            Config::Gpu(c) => {
                if let Some(s) = &c.sharing {
                    set(&mut self.gpu_strategy, s.strategy, source);
                    set(
                        &mut self.interval,
                        s.time_slicing.as_ref().and_then(|t| t.interval),
                        source,
                    );
                    self.mps(&s.mps, source);
                }
            }
            Config::Mig(c) => {
                if let Some(s) = &c.sharing {
                    set(&mut self.mig_strategy, s.strategy, source);
                    self.mps(&s.mps, source);
                }
            }
            Config::Share(c) => {
                self.limits(&c.process_limits, source);
                set(&mut self.shared_memory, c.shared_memory, source);
            }
        }
    }
}

/// Resolves the effective settings of every device of one claim.
///
/// Precedence, lowest first: built-in defaults, then DeviceClass configs,
/// then claim configs. Within one origin, configs scoped to the device's
/// request beat unscoped ones (a config naming the exact subrequest beats
/// one naming its parent request), and among equals the later entry in
/// `sources` wins. Merging is per setting: a config overrides only what it
/// states. Settings of a sharing strategy that is not the winning one are
/// ignored.
///
/// Errors, all naming `claim`: any entry that does not decode (even one that
/// would not apply); an entry scoped to a device's request whose kind does
/// not fit that device; an unscoped entry whose kind fits no device of the
/// claim; a setting the device cannot honour (limits above what the claim
/// holds, limits on a `Shared` share).
///
/// Returns one [`EffectiveConfig`] per entry of `devices`, in order.
pub fn resolve_claim(
    claim: &str,
    sources: &[ConfigSource],
    devices: &[DeviceTarget],
) -> Result<Vec<EffectiveConfig>, ConfigError> {
    let at = |i: usize| {
        let s = &sources[i];
        SourceRef {
            origin: s.origin,
            index: s.index,
            requests: s.requests.clone(),
        }
    };
    let error =
        |source: Option<usize>, problem: Problem| ConfigError::new(claim, source.map(at), problem);

    let decoded = sources
        .iter()
        .enumerate()
        .map(|(i, s)| decode_value(&s.parameters).map_err(|p| error(Some(i), p)))
        .collect::<Result<Vec<_>, _>>()?;

    // An unscoped config must fit at least one device of the claim.
    for (i, config) in decoded.iter().enumerate() {
        let kind = config.kind();
        if sources[i].requests.is_empty()
            && !devices
                .iter()
                .any(|d| d.device_type.config_kind() == Some(kind))
        {
            let mut types: Vec<&str> = devices.iter().map(|d| d.device_type.as_str()).collect();
            types.sort_unstable();
            types.dedup();
            return Err(error(
                Some(i),
                Problem::new(
                    ProblemKind::WrongKind,
                    "kind",
                    format!(
                        "{kind} applies to no device of this claim (its devices are of type: {})",
                        if types.is_empty() {
                            "none".to_owned()
                        } else {
                            types.join(", ")
                        }
                    ),
                    "use the kind for the devices you got (GpuConfig for gpu, MigConfig for \
                     mig, ShareConfig for share), or remove this config",
                ),
            ));
        }
    }

    devices
        .iter()
        .map(|device| {
            let want = device.device_type.config_kind();
            let mut applicable: Vec<(Origin, Scope, usize)> = Vec::new();
            for (i, source) in sources.iter().enumerate() {
                let Some(scope) = scope_for(&source.requests, &device.request) else {
                    continue;
                };
                let kind = decoded[i].kind();
                let Some(want) = want else {
                    if scope == Scope::All {
                        // Meant for the claim's other devices.
                        continue;
                    }
                    return Err(error(
                        Some(i),
                        Problem::new(
                            ProblemKind::NotApplicable,
                            "requests",
                            format!(
                                "device `{}` of request `{}` is a monitoring device, which \
                                 takes no config",
                                device.device, device.request
                            ),
                            "remove this request from the config's `requests`",
                        ),
                    ));
                };
                if kind != want {
                    if scope == Scope::All {
                        // Meant for other devices of the same claim.
                        continue;
                    }
                    return Err(error(
                        Some(i),
                        Problem::new(
                            ProblemKind::WrongKind,
                            "kind",
                            format!(
                                "{kind} does not apply to device `{}` of request `{}`, which \
                                 is of type {}",
                                device.device,
                                device.request,
                                device.device_type.as_str()
                            ),
                            format!(
                                "use kind {want} for this request, or scope the config to \
                                 requests that get {} devices",
                                kind_device_type(kind)
                            ),
                        ),
                    ));
                }
                applicable.push((source.origin, scope, i));
            }
            applicable.sort(); // stable order: origin, then scope, then position
            let mut merged = Merged::default();
            for &(_, _, i) in &applicable {
                merged.add(&decoded[i], i);
            }
            finish(device, merged).map_err(|(source, problem)| error(source, problem))
        })
        .collect()
}

fn kind_device_type(kind: Kind) -> &'static str {
    match kind {
        Kind::GpuConfig => names::device_type::GPU,
        Kind::MigConfig => names::device_type::MIG,
        Kind::ShareConfig => names::device_type::SHARE,
    }
}

type Failure = (Option<usize>, Problem);

/// Applies defaults to the merged leaves and checks them against the device.
fn finish(device: &DeviceTarget, m: Merged) -> Result<EffectiveConfig, Failure> {
    match device.device_type {
        DeviceType::Gpu => {
            let sharing = match m.gpu_strategy.map(|s| s.0) {
                None | Some(GpuSharingStrategy::None) => Sharing::None,
                Some(GpuSharingStrategy::TimeSlicing) => Sharing::TimeSlicing {
                    interval: m.interval.map_or(TimeSliceInterval::Default, |l| l.0),
                },
                Some(GpuSharingStrategy::Mps) => Sharing::Mps {
                    limits: limits(device, &m, "sharing.mps")?,
                },
            };
            Ok(EffectiveConfig::Gpu { sharing })
        }
        DeviceType::Mig => {
            let sharing = match m.mig_strategy.map(|s| s.0) {
                None | Some(MigSharingStrategy::None) => Sharing::None,
                Some(MigSharingStrategy::Mps) => Sharing::Mps {
                    limits: limits(device, &m, "sharing.mps")?,
                },
            };
            Ok(EffectiveConfig::Mig { sharing })
        }
        DeviceType::Share(IsolationLevel::Isolated) => Ok(EffectiveConfig::Share {
            limits: Some(limits(device, &m, "processLimits")?),
        }),
        DeviceType::Share(IsolationLevel::Shared) => {
            if let Some(source) = m.shared_memory.map(|l| l.1) {
                return Err((
                    Some(source),
                    Problem::new(
                        ProblemKind::NotApplicable,
                        "sharedMemory",
                        format!(
                            "device `{}` of request `{}` is a Shared (burstable) share; it runs \
                             no MPS daemon and its containers keep their own /dev/shm",
                            device.device, device.request
                        ),
                        "request an Isolated share, or remove sharedMemory",
                    ),
                ));
            }
            if let Some(source) = m.memory.map(|l| l.1).or(m.compute.map(|l| l.1)) {
                return Err((
                    Some(source),
                    Problem::new(
                        ProblemKind::NotApplicable,
                        "processLimits",
                        format!(
                            "device `{}` of request `{}` is a Shared (burstable) share; nothing \
                             enforces limits there",
                            device.device, device.request
                        ),
                        format!(
                            "request an Isolated share (DeviceClass gpu-isolated.<domain>, or a \
                             selector on isolationLevel == \"{}\"), or remove processLimits",
                            names::isolation_level::ISOLATED
                        ),
                    ),
                ));
            }
            Ok(EffectiveConfig::Share { limits: None })
        }
        DeviceType::Monitor => Ok(EffectiveConfig::Monitor),
    }
}

fn limits(device: &DeviceTarget, m: &Merged, at: &str) -> Result<Limits, Failure> {
    let holds = device.holds;
    let what = match device.device_type {
        DeviceType::Share(_) => "the claim was allocated",
        _ => "the device has",
    };
    let memory_bytes = match m.memory {
        None => holds.memory_bytes,
        Some((q, source)) if q.bytes() > holds.memory_bytes => {
            let held = Quantity::from_bytes(holds.memory_bytes);
            return Err((
                Some(source),
                Problem::new(
                    ProblemKind::NotApplicable,
                    format!("{at}.memory"),
                    format!(
                        "{q} is more than the {held} {what} (device `{}`)",
                        device.device
                    ),
                    format!("use at most {held}, or request more memory capacity"),
                ),
            ));
        }
        Some((q, _)) => q.bytes(),
    };
    let compute_percent = match m.compute {
        None => holds.compute_percent,
        Some((p, source)) if p > holds.compute_percent => {
            return Err((
                Some(source),
                Problem::new(
                    ProblemKind::NotApplicable,
                    format!("{at}.computePercent"),
                    format!(
                        "{p} is more than the {}% {what} (device `{}`)",
                        holds.compute_percent, device.device
                    ),
                    format!(
                        "use at most {}, or request more cores capacity",
                        holds.compute_percent
                    ),
                ),
            ));
        }
        Some((p, _)) => p,
    };
    Ok(Limits {
        memory_bytes,
        compute_percent,
        shared_memory_bytes: m.shared_memory.map(|(q, _)| q.bytes()),
    })
}
