//! Claim UIDs as they may be used in file names.
//!
//! A UID arrives from the kubelet (and the checkpoint) as an arbitrary string.
//! It names CDI spec files and checkpoint entries, so it is parsed once into a
//! type that can only hold the canonical UUID form Kubernetes generates:
//! nothing like `../../etc` can ever reach a path.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A Kubernetes object UID in canonical lower-case UUID form.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ClaimUid(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "claim UID {0:?} is not a Kubernetes UID (expected 36 characters: lower-case hex digits in groups 8-4-4-4-12 separated by '-')"
)]
pub struct InvalidClaimUid(pub String);

impl ClaimUid {
    pub fn parse(raw: &str) -> Result<Self, InvalidClaimUid> {
        const GROUPS: [usize; 5] = [8, 4, 4, 4, 12];
        let groups: Vec<&str> = raw.split('-').collect();
        let well_formed = groups.len() == GROUPS.len()
            && groups.iter().zip(GROUPS).all(|(g, len)| {
                g.len() == len && g.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            });
        if well_formed {
            Ok(ClaimUid(raw.to_owned()))
        } else {
            Err(InvalidClaimUid(raw.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ClaimUid {
    type Error = InvalidClaimUid;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        ClaimUid::parse(&raw)
    }
}

impl From<ClaimUid> for String {
    fn from(uid: ClaimUid) -> String {
        uid.0
    }
}

impl fmt::Display for ClaimUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_canonical_uids() {
        let uid = ClaimUid::parse("0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e").unwrap();
        assert_eq!(uid.to_string(), "0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e");
    }

    #[test]
    fn rejects_path_traversal_and_odd_forms() {
        for bad in [
            "",
            "../../../../etc/passwd",
            "0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e/../x",
            "0b9d2a3e/5c4f-4a7b-9e0d-1f2a3b4c5d6e",
            "0B9D2A3E-5C4F-4A7B-9E0D-1F2A3B4C5D6E",
            "0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6",
            "0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e0",
            "0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6\0",
            "0b9d2a3e5c4f-4a7b-9e0d--1f2a3b4c5d6e",
        ] {
            let err = ClaimUid::parse(bad).unwrap_err();
            assert!(err.to_string().contains("not a Kubernetes UID"), "{bad:?}");
        }
    }

    #[test]
    fn deserializing_validates() {
        let ok: ClaimUid =
            serde_json::from_str("\"0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e\"").unwrap();
        assert_eq!(ok.as_str().len(), 36);
        assert!(serde_json::from_str::<ClaimUid>("\"../x\"").is_err());
    }
}
