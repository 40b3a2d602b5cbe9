//! Errors of the config API. Every message names the claim, the config it
//! came from, the field, and what to do about it, because the message ends
//! up in the claim's prepare error and in Events that users read.

use std::fmt;

use super::resolve::Origin;

/// A config problem, tied to the claim being prepared. Boxed inside, so
/// `Result<_, ConfigError>` stays one pointer wide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("claim {}: {}{}", .0.claim, .0.at.as_ref().map(|a| format!("{a}: ")).unwrap_or_default(), .0.problem)]
pub struct ConfigError(Box<Inner>);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Inner {
    claim: String,
    at: Option<SourceRef>,
    problem: Problem,
}

impl ConfigError {
    /// An error about `claim`, in the config entry `at` if known.
    pub fn new(claim: impl Into<String>, at: Option<SourceRef>, problem: Problem) -> Self {
        ConfigError(Box::new(Inner {
            claim: claim.into(),
            at,
            problem,
        }))
    }

    /// The claim as the caller named it, e.g. `namespace/name`.
    pub fn claim(&self) -> &str {
        &self.0.claim
    }

    /// Which config entry, when the problem is in one.
    pub fn at(&self) -> Option<&SourceRef> {
        self.0.at.as_ref()
    }

    /// What is wrong.
    pub fn problem(&self) -> &Problem {
        &self.0.problem
    }
}

/// Where a config entry came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceRef {
    /// DeviceClass or claim.
    pub origin: Origin,
    /// The entry's index as the caller numbered it (see
    /// [`super::ConfigSource::index`]).
    pub index: usize,
    /// The requests it is scoped to; empty means all.
    pub requests: Vec<String>,
}

impl fmt::Display for SourceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let origin = match self.origin {
            Origin::Class => "DeviceClass",
            Origin::Claim => "claim",
        };
        write!(f, "{origin} config #{}", self.index)?;
        if self.requests.is_empty() {
            f.write_str(" (all requests)")
        } else {
            write!(f, " (requests: {})", self.requests.join(", "))
        }
    }
}

/// What is wrong, where, and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("field `{field}`: {message}; fix: {fix}")]
pub struct Problem {
    /// Category, for callers that react differently (and for tests).
    pub kind: ProblemKind,
    /// Dotted path of the offending field (`sharing.timeSlicing.interval`),
    /// or `parameters` for the object as a whole.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
    /// What the user should do.
    pub fix: String,
}

impl Problem {
    pub(crate) fn new(
        kind: ProblemKind,
        field: impl Into<String>,
        message: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Problem {
            kind,
            field: field.into(),
            message: message.into(),
            fix: fix.into(),
        }
    }
}

/// Categories of [`Problem`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProblemKind {
    /// Not JSON, not an object, or too large.
    Malformed,
    /// `apiVersion` or `kind` missing.
    MissingField,
    /// `apiVersion` names a group or version this driver does not serve.
    UnsupportedApiVersion,
    /// `kind` is not one of ours.
    UnknownKind,
    /// A field the schema does not have (strict decoding).
    UnknownField,
    /// A value of the wrong type, out of range, or inconsistent.
    InvalidValue,
    /// A config that targets a device of another type.
    WrongKind,
    /// A setting that the device it applies to cannot honour.
    NotApplicable,
    /// A config scoped to a request the claim does not have.
    UnknownRequest,
}
