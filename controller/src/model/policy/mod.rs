//! Node policy: which GPUs offer which modes.
//!
//! A platform team writes one YAML document per node (a file today, a
//! ConfigMap later):
//!
//! ```yaml
//! apiVersion: tessera.dev/v1alpha1   # optional, checked when present
//! kind: NodePolicy                   # optional, checked when present
//! gpus:
//!   - select: {all: true}
//!     modes: [whole, mig, isolated, shared]
//!   - select: {product: "NVIDIA H100*"}
//!     migProfiles: ["1g.*", "3g.40gb"]
//!     timeSlice: short
//!   - select: {uuid: GPU-5d2c...}
//!     isolationProvider: hami-core
//!     static: {mode: shared, replicas: 8}
//!   - select: {product: "NVIDIA H100*"}
//!     mpsServerReserveMiB: 128       # each Isolated claim's MPS server
//! claimGuard:                        # node-wide; these are the defaults
//!   action: enforce                  # enforce | report
//!   periodMillis: 1000
//! mps:                               # each MPS daemon's own tmpfs; defaults
//!   sharedMemory: 256Mi              # its /dev/shm, unless the claim asks
//!   maxSharedMemory: 4Gi             # the most a claim's sharedMemory may be
//!   inodes: 4096                     # files in its /dev/shm (its pipe directory: 1/8)
//!   confirmDefaults: false           # also set the limits through the control endpoint
//! ```
//!
//! Rules apply in order and field by field: for each GPU, every rule whose
//! selector matches overrides the fields it sets, so later rules refine
//! earlier ones. With no rules (or no matching rule) everything is on: every
//! mode, every MIG profile, default time slice, `mps` isolation.
//!
//! Decoding is strict (unknown fields are errors) and validation errors name
//! the offending field, e.g. `gpus[1].static.replicas: must be between 1 and
//! 64`.

mod guard;
mod mps;
mod selector;

use serde::Deserialize;
use tessera_api::inventory::Gpu;
use tessera_api::names::isolation_provider;

pub use guard::{ClaimGuardPolicy, GuardAction};
pub use mps::MpsPolicy;
pub use selector::{GpuSelector, glob_match};

/// API version accepted in `apiVersion`.
pub const POLICY_API_VERSION: &str = "tessera.dev/v1alpha1";
/// Kind accepted in `kind`.
pub const POLICY_KIND: &str = "NodePolicy";

const MAX_REPLICAS: u32 = 64;

/// GPU memory reserved by default for each Isolated claim's MPS server
/// (see [`GpuRule::mps_server_reserve_mib`]).
pub const DEFAULT_MPS_SERVER_RESERVE_MIB: u64 = 64;
/// The largest reserve a policy may set: far above any server context, low
/// enough that a typo cannot silently take every Isolated share off a GPU.
pub const MAX_MPS_SERVER_RESERVE_MIB: u64 = 8192;
const MIB: u64 = 1 << 20;

/// The whole policy document.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodePolicy {
    #[serde(default)]
    pub api_version: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    /// Per-GPU rules, applied in order.
    #[serde(default)]
    pub gpus: Vec<GpuRule>,
    /// What the node does about a process that breaks an Isolated claim's
    /// promise (see the driver's `guard` module).
    #[serde(default)]
    pub claim_guard: ClaimGuardPolicy,
    /// The bounds of each MPS daemon's directories.
    #[serde(default)]
    pub mps: MpsPolicy,
}

/// One rule: a selector and the fields it sets for the GPUs it selects.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuRule {
    pub select: GpuSelector,
    /// Modes offered; an empty list offers nothing on the selected GPUs.
    #[serde(default)]
    pub modes: Option<Vec<Mode>>,
    /// Glob patterns (`*`, `?`) over MIG profile names, e.g. `1g.*`.
    #[serde(default)]
    pub mig_profiles: Option<Vec<String>>,
    /// May the driver switch MIG mode on this GPU at prepare time, where the
    /// hardware can do that without a GPU reset? `false` offers only the
    /// modes the GPU's current MIG mode allows.
    #[serde(default)]
    pub mig_mode_switch: Option<bool>,
    /// Time-slice interval for `Shared` claims on this GPU.
    #[serde(default)]
    pub time_slice: Option<TimeSlice>,
    /// Who enforces `Isolated` limits.
    #[serde(default)]
    pub isolation_provider: Option<IsolationProvider>,
    /// Share consumed by a share claim that asks for no explicit `memory` or
    /// `cores`, in percent of the GPU.
    #[serde(default)]
    pub default_share_percent: Option<u32>,
    /// Static mode, used only when the API server cannot represent the full
    /// model (no partitionable devices or no consumable capacity).
    #[serde(default, rename = "static")]
    pub static_mode: Option<StaticRule>,
    /// GPU memory, in MiB, that each Isolated claim's MPS server takes for
    /// its own context beside the claim's memory. No counter sees it, so the
    /// Isolated share device publishes less memory than the GPU has: as much
    /// as lets every set of claims the scheduler can place fit together with
    /// one server each (see `devices::isolated_share_memory`).
    #[serde(default, rename = "mpsServerReserveMiB")]
    pub mps_server_reserve_mib: Option<u64>,
}

/// Static-mode settings of a rule.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StaticRule {
    #[serde(default)]
    pub mode: Option<StaticMode>,
    /// Share replicas per GPU when the static mode is a share level and the
    /// server has no consumable capacity.
    #[serde(default)]
    pub replicas: Option<u32>,
}

/// A way of using a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Whole,
    Mig,
    Isolated,
    Shared,
}

/// The single mode a GPU offers in static (degraded) mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StaticMode {
    /// Existing MIG instances if there are any, else the first allowed of
    /// whole, isolated, shared.
    #[default]
    Auto,
    Whole,
    Mig,
    Isolated,
    Shared,
}

/// NVML compute time-slice setting for `Shared`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TimeSlice {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

impl TimeSlice {
    pub fn as_str(self) -> &'static str {
        match self {
            TimeSlice::Default => "Default",
            TimeSlice::Short => "Short",
            TimeSlice::Medium => "Medium",
            TimeSlice::Long => "Long",
        }
    }
}

/// Enforcer of `Isolated` limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum IsolationProvider {
    #[default]
    #[serde(rename = "mps")]
    Mps,
    #[serde(rename = "hami-core")]
    HamiCore,
}

impl IsolationProvider {
    pub fn as_str(self) -> &'static str {
        match self {
            IsolationProvider::Mps => isolation_provider::MPS,
            IsolationProvider::HamiCore => isolation_provider::HAMI_CORE,
        }
    }
}

/// The resolved policy of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPolicy {
    pub modes: Vec<Mode>,
    pub mig_profiles: Vec<String>,
    pub mig_mode_switch: bool,
    pub time_slice: TimeSlice,
    pub isolation_provider: IsolationProvider,
    pub default_share_percent: u32,
    pub static_mode: StaticMode,
    pub replicas: u32,
    /// Bytes each Isolated claim's MPS server takes on the GPU.
    pub mps_server_reserve_bytes: u64,
}

impl Default for GpuPolicy {
    fn default() -> Self {
        GpuPolicy {
            modes: vec![Mode::Whole, Mode::Mig, Mode::Isolated, Mode::Shared],
            mig_profiles: vec!["*".to_string()],
            mig_mode_switch: true,
            time_slice: TimeSlice::Default,
            isolation_provider: IsolationProvider::Mps,
            default_share_percent: 10,
            static_mode: StaticMode::Auto,
            replicas: 4,
            mps_server_reserve_bytes: DEFAULT_MPS_SERVER_RESERVE_MIB * MIB,
        }
    }
}

impl GpuPolicy {
    pub fn allows(&self, mode: Mode) -> bool {
        self.modes.contains(&mode)
    }

    pub fn allows_profile(&self, profile: &str) -> bool {
        self.mig_profiles.iter().any(|p| glob_match(p, profile))
    }
}

/// Why a policy was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// YAML that does not decode; the message carries serde's field path.
    #[error("node policy: {0}")]
    Decode(String),
    /// A decoded value that is not acceptable.
    #[error("node policy: {field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> PolicyError {
    PolicyError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

impl NodePolicy {
    /// Decodes (strictly) and validates a policy document.
    pub fn from_yaml(text: &str) -> Result<Self, PolicyError> {
        let policy: NodePolicy = if text.trim().is_empty() {
            NodePolicy::default()
        } else {
            serde_yaml::from_str(text).map_err(|e| PolicyError::Decode(e.to_string()))?
        };
        policy.validate()?;
        Ok(policy)
    }

    /// Checks every field; the first problem is reported with its path.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if let Some(v) = &self.api_version
            && v != POLICY_API_VERSION
        {
            return Err(invalid(
                "apiVersion",
                format!("must be {POLICY_API_VERSION}, not {v:?}"),
            ));
        }
        if let Some(k) = &self.kind
            && k != POLICY_KIND
        {
            return Err(invalid("kind", format!("must be {POLICY_KIND}, not {k:?}")));
        }
        for (i, rule) in self.gpus.iter().enumerate() {
            rule.validate(&format!("gpus[{i}]"))?;
        }
        self.mps.validate()?;
        let period = self.claim_guard.period_millis;
        if !ClaimGuardPolicy::PERIOD_MILLIS.contains(&period) {
            let range = ClaimGuardPolicy::PERIOD_MILLIS;
            return Err(invalid(
                "claimGuard.periodMillis",
                format!(
                    "must be between {} and {}, not {period}",
                    range.start(),
                    range.end()
                ),
            ));
        }
        Ok(())
    }

    /// The resolved policy for one GPU with stable index `index`.
    pub fn for_gpu(&self, gpu: &Gpu, index: u32) -> GpuPolicy {
        let mut resolved = GpuPolicy::default();
        for rule in self.gpus.iter().filter(|r| r.select.matches(gpu, index)) {
            rule.apply(&mut resolved);
        }
        resolved
    }
}

impl GpuRule {
    fn validate(&self, path: &str) -> Result<(), PolicyError> {
        self.select.validate(&format!("{path}.select"))?;
        if let Some(patterns) = &self.mig_profiles {
            for (i, p) in patterns.iter().enumerate() {
                if p.trim().is_empty() {
                    return Err(invalid(
                        format!("{path}.migProfiles[{i}]"),
                        "must not be empty",
                    ));
                }
            }
        }
        if let Some(pct) = self.default_share_percent
            && !(1..=100).contains(&pct)
        {
            return Err(invalid(
                format!("{path}.defaultSharePercent"),
                format!("must be between 1 and 100, not {pct}"),
            ));
        }
        if let Some(StaticRule {
            replicas: Some(r), ..
        }) = &self.static_mode
            && !(1..=MAX_REPLICAS).contains(r)
        {
            return Err(invalid(
                format!("{path}.static.replicas"),
                format!("must be between 1 and {MAX_REPLICAS}, not {r}"),
            ));
        }
        if let Some(mib) = self.mps_server_reserve_mib
            && mib > MAX_MPS_SERVER_RESERVE_MIB
        {
            return Err(invalid(
                format!("{path}.mpsServerReserveMiB"),
                format!(
                    "must be at most {MAX_MPS_SERVER_RESERVE_MIB} (MiB of GPU memory per MPS \
                     server), not {mib}"
                ),
            ));
        }
        Ok(())
    }

    fn apply(&self, into: &mut GpuPolicy) {
        if let Some(modes) = &self.modes {
            let mut modes = modes.clone();
            modes.sort();
            modes.dedup();
            into.modes = modes;
        }
        if let Some(p) = &self.mig_profiles {
            into.mig_profiles = p.iter().map(|s| s.trim().to_string()).collect();
        }
        if let Some(v) = self.mig_mode_switch {
            into.mig_mode_switch = v;
        }
        if let Some(v) = self.time_slice {
            into.time_slice = v;
        }
        if let Some(v) = self.isolation_provider {
            into.isolation_provider = v;
        }
        if let Some(v) = self.default_share_percent {
            into.default_share_percent = v;
        }
        if let Some(s) = &self.static_mode {
            if let Some(m) = s.mode {
                into.static_mode = m;
            }
            if let Some(r) = s.replicas {
                into.replicas = r;
            }
        }
        if let Some(mib) = self.mps_server_reserve_mib {
            into.mps_server_reserve_bytes = mib * MIB;
        }
    }
}

#[cfg(test)]
mod tests;
