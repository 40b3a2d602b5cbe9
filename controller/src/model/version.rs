//! Version attributes as semver 2.0.0, which the API server requires for
//! `version` attributes (it rejects `550.90.07`: leading zero, and `9.0`:
//! only two components).

/// Normalizes a dotted numeric version as NVML reports it into semver:
/// leading zeros are dropped per component and missing components are
/// zero-filled (`550.90.07` -> `550.90.7`, `9.0` -> `9.0.0`, `12` -> `12.0.0`).
/// Components beyond the third become build metadata (`1.2.3.4` ->
/// `1.2.3+4`), which semver ignores for ordering, as NVIDIA's fourth
/// component carries no ordering meaning either.
///
/// Returns `None` for anything that is not dot-separated decimal digits;
/// the caller then omits the attribute instead of publishing a slice the
/// server would reject.
pub fn semver(raw: &str) -> Option<String> {
    let raw = raw.trim();
    if raw.is_empty() {
        return None;
    }
    let mut parts = Vec::new();
    for part in raw.split('.') {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let trimmed = part.trim_start_matches('0');
        parts.push(if trimmed.is_empty() { "0" } else { trimmed });
    }
    while parts.len() < 3 {
        parts.push("0");
    }
    let core = parts[..3].join(".");
    let version = if parts.len() > 3 {
        format!("{core}+{}", parts[3..].join("."))
    } else {
        core
    };
    // Attribute values are limited to 64 characters.
    (version.len() <= 64).then_some(version)
}

#[cfg(test)]
mod tests {
    use super::semver;

    #[test]
    fn nvidia_versions_become_semver() {
        assert_eq!(semver("550.90.07").as_deref(), Some("550.90.7"));
        assert_eq!(semver("535.104.05").as_deref(), Some("535.104.5"));
        assert_eq!(semver("9.0").as_deref(), Some("9.0.0"));
        assert_eq!(semver("12.4").as_deref(), Some("12.4.0"));
        assert_eq!(semver("8").as_deref(), Some("8.0.0"));
        assert_eq!(semver("00.000.1").as_deref(), Some("0.0.1"));
        assert_eq!(semver("1.2.3.04").as_deref(), Some("1.2.3+4"));
    }

    #[test]
    fn garbage_is_rejected() {
        for bad in ["", "abc", "1..2", "v1.2.3", "1.2-rc1", " . "] {
            assert_eq!(semver(bad), None, "{bad:?}");
        }
    }
}
