//! The claim guard's node-wide settings.

use serde::Deserialize;

/// The claim guard's settings: node-wide, one guard per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClaimGuardPolicy {
    /// `enforce` (the default): the offending process is killed and
    /// reported; `report`: only reported.
    #[serde(default)]
    pub action: GuardAction,
    /// How often the GPUs that hold Isolated claims are looked at.
    #[serde(default = "ClaimGuardPolicy::default_period_millis")]
    pub period_millis: u64,
}

impl ClaimGuardPolicy {
    /// The shortest and longest period a policy may set: shorter costs CPU
    /// for nothing NVML updates that fast, longer leaves a tenant minutes.
    pub const PERIOD_MILLIS: std::ops::RangeInclusive<u64> = 100..=60_000;

    fn default_period_millis() -> u64 {
        1000
    }
}

impl Default for ClaimGuardPolicy {
    fn default() -> Self {
        ClaimGuardPolicy {
            action: GuardAction::default(),
            period_millis: Self::default_period_millis(),
        }
    }
}

/// What the claim guard does about a violation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuardAction {
    #[default]
    Enforce,
    Report,
}

impl GuardAction {
    pub fn as_str(self) -> &'static str {
        match self {
            GuardAction::Enforce => "enforce",
            GuardAction::Report => "report",
        }
    }
}
