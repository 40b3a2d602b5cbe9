//! The API server's version and the minimum that gets the full device model.
//!
//! The full model (counters tying whole GPU, MIG and share devices together)
//! is only correct with a kube-scheduler that contains the 2026 fixes to the
//! composition of partitionable devices and consumable capacity:
//!
//! * kubernetes#139040 (fixes #139034): counters of committed shares were
//!   ignored when the allocator rebuilt counters in a later scheduling
//!   cycle, so a whole GPU could be allocated beside its shares.
//! * kubernetes#140431 (release-1.36 cherry pick #140663): counters reserved
//!   for a rejected candidate were not rolled back, leaving schedulable pods
//!   pending.
//!
//! Both are in v1.36.3: its structured allocator (the `incubating` variant
//! that 1.36 selects with these gates) rebuilds counters through
//! `IsDeviceAllocated` and has `rollbackDevice`. v1.36.3 is also the
//! release the local control plane is pinned to, so it is the version our
//! scheduler tests prove; hence [`MIN_FULL_MODEL`]. Older servers get the
//! static per-GPU mode even when they serve the fields.
//!
//! Not needed by our model, and not in v1.36.3: #140437 (a persisted share
//! without consumed capacity re-charged counters: Tessera's share devices
//! always have request-policy defaults, so an allocation always records
//! consumed capacity) and #140435 (counter caches keyed by pool name only:
//! matters only when another driver publishes a pool with the same name and
//! counter-set names on the same node).
//!
//! The API server's version stands in for the scheduler's: in a cluster
//! they come from the same release. Operators whose distribution backports
//! the fixes can lower the minimum (`--full-model-min-version`).

use std::fmt;
use std::str::FromStr;

/// The oldest server version that gets the full device model.
pub const MIN_FULL_MODEL: ServerVersion = ServerVersion {
    major: 1,
    minor: 36,
    patch: 3,
};

/// `major.minor.patch` of a Kubernetes server; vendor suffixes
/// (`v1.36.3-gke.100`, `+k3s1`) and pre-release tags are ignored, so a
/// pre-release counts as its release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServerVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl ServerVersion {
    /// Parses `gitVersion` (`v1.36.3`, `1.36`, `v1.36.3-eks-abc`).
    pub fn parse(text: &str) -> Option<ServerVersion> {
        let text = text.trim();
        let text = text.strip_prefix('v').unwrap_or(text);
        let core = text.split(['-', '+']).next()?;
        let mut parts = core.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        let patch = match parts.next() {
            Some(p) => p.parse().ok()?,
            None => 0,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(ServerVersion {
            major,
            minor,
            patch,
        })
    }

    /// From the `/version` answer: `gitVersion`, else `major`/`minor`
    /// (which some distributions suffix with `+`).
    pub fn from_info(info: &k8s_openapi::apimachinery::pkg::version::Info) -> Option<Self> {
        ServerVersion::parse(&info.git_version).or_else(|| {
            let digits = |s: &str| -> Option<u32> {
                s.trim_end_matches(|c: char| !c.is_ascii_digit())
                    .parse()
                    .ok()
            };
            Some(ServerVersion {
                major: digits(&info.major)?,
                minor: digits(&info.minor)?,
                patch: 0,
            })
        })
    }
}

impl fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for ServerVersion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ServerVersion::parse(s).ok_or_else(|| format!("not a Kubernetes version: {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_release_vendor_and_prerelease_versions() {
        let v = |a, b, c| ServerVersion {
            major: a,
            minor: b,
            patch: c,
        };
        assert_eq!(ServerVersion::parse("v1.36.3"), Some(v(1, 36, 3)));
        assert_eq!(ServerVersion::parse("1.36"), Some(v(1, 36, 0)));
        assert_eq!(ServerVersion::parse("v1.36.3-gke.1200"), Some(v(1, 36, 3)));
        assert_eq!(ServerVersion::parse("v1.35.1+k3s1"), Some(v(1, 35, 1)));
        assert_eq!(
            ServerVersion::parse("v1.37.0-alpha.2.12+abc"),
            Some(v(1, 37, 0))
        );
        assert_eq!(
            ServerVersion::parse("v0.0.0-master+$Format:%H$"),
            Some(v(0, 0, 0))
        );
        assert_eq!(ServerVersion::parse("latest"), None);
        assert_eq!(ServerVersion::parse("v1.2.3.4"), None);
    }

    #[test]
    fn minimum_orders_by_patch_and_minor() {
        let ok = |s: &str| ServerVersion::parse(s).unwrap() >= MIN_FULL_MODEL;
        assert!(ok("v1.36.3"));
        assert!(ok("v1.36.10"));
        assert!(ok("v1.37.0"));
        assert!(!ok("v1.36.2"));
        assert!(!ok("v1.35.9"));
        assert!(!ok("v1.4.99"));
    }

    #[test]
    fn falls_back_to_major_minor_fields() {
        let info = k8s_openapi::apimachinery::pkg::version::Info {
            git_version: "custom".into(),
            major: "1".into(),
            minor: "36+".into(),
            ..Default::default()
        };
        assert_eq!(
            ServerVersion::from_info(&info),
            Some(ServerVersion {
                major: 1,
                minor: 36,
                patch: 0
            })
        );
    }
}
