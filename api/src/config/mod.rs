//! The opaque configuration API: what users and platform teams put into
//! `opaque.parameters` of a DeviceClass's or ResourceClaim's config for
//! driver `gpu.tessera.dev`.
//!
//! # Kinds (`apiVersion: gpu.tessera.dev/v1alpha1`)
//!
//! | kind | device type | settings |
//! |---|---|---|
//! | [`GpuConfig`] | `gpu` | `sharing.strategy` `None`/`TimeSlicing`/`MPS`, `sharing.timeSlicing.interval`, `sharing.mps.{memory,computePercent}` |
//! | [`MigConfig`] | `mig` | `sharing.strategy` `None`/`MPS`, `sharing.mps.{memory,computePercent}` |
//! | [`ShareConfig`] | `share` | `processLimits.{memory,computePercent}` (Isolated shares only) |
//!
//! Sharing settings govern the consumers of *one* claim (all containers of
//! all Pods referencing it). Sharing a card *between* claims is decided by
//! the device model (share devices, MIG) and node policy, never by a claim.
//!
//! # Decoding
//!
//! Strict: unknown fields, unknown enum values, wrong types and a missing or
//! foreign `apiVersion`/`kind` are errors, each naming the field and a fix
//! ([`decode`], [`decode_value`]). Decoding never panics on any input.
//!
//! # Precedence ([`resolve_claim`])
//!
//! built-in defaults < DeviceClass configs < claim configs; within one
//! origin, request-scoped beats unscoped and later beats earlier; merging is
//! per setting. A config of the wrong kind for a device it is scoped to is an
//! error; an unscoped config only applies to devices of its kind but must
//! fit at least one.
//!
//! # Admission ([`check_claim_spec`])
//!
//! What needs no allocation (decoding, request names) is checked again when
//! a claim or claim template is created, by `tessera webhook`, with the same
//! problems and fixes; [`ConfigError::admission_message`] renders them with
//! the field as a path in the object.

mod admission;
mod decode;
mod error;
mod resolve;
mod types;

#[cfg(test)]
mod tests;

pub use admission::check_claim_spec;
pub use decode::{decode, decode_value};
pub use error::{ConfigError, Problem, ProblemKind, SourceRef};
pub use resolve::{
    ConfigSource, DeviceTarget, DeviceType, EffectiveConfig, Holdings, IsolationLevel, Limits,
    Origin, Sharing, resolve_claim,
};
pub use types::{
    Config, GpuConfig, GpuSharing, GpuSharingStrategy, Kind, MigConfig, MigSharing,
    MigSharingStrategy, MpsSettings, ProcessLimits, Quantity, QuantityError, ShareConfig,
    TimeSliceInterval, TimeSlicing,
};

/// API group of the config kinds.
pub const API_GROUP: &str = "gpu.tessera.dev";

/// The one version served: `apiVersion` of every config.
pub const API_VERSION: &str = "gpu.tessera.dev/v1alpha1";

/// Largest `parameters` accepted by [`decode`], the same 10 KiB the API
/// server allows for opaque parameters.
pub const MAX_PARAMETERS_BYTES: usize = 10 * 1024;
