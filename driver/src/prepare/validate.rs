//! What the kubelet sent, checked before it is used in a path or a URL.

use super::ClaimResult;
use super::claims::{ClaimError, ClaimRef};
use crate::claim_uid::ClaimUid;

/// Checks what the kubelet sent before it is used in a path or a URL.
pub fn validate(claim: &ClaimRef) -> ClaimResult<ClaimUid> {
    let uid = ClaimUid::parse(&claim.uid)
        .map_err(|e| ClaimError::new(claim, e.to_string()).field("uid"))?;
    if !is_dns_label(&claim.namespace) {
        return Err(ClaimError::new(
            claim,
            format!(
                "namespace {:?} is not a valid namespace name",
                claim.namespace
            ),
        )
        .field("namespace")
        .fix("namespaces are DNS labels (lower-case letters, digits, '-', at most 63)"));
    }
    if !is_dns_subdomain(&claim.name) {
        return Err(ClaimError::new(
            claim,
            format!("name {:?} is not a valid ResourceClaim name", claim.name),
        )
        .field("name")
        .fix(
            "claim names are DNS subdomains (lower-case letters, digits, '-', '.', at most 253)",
        ));
    }
    Ok(uid)
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}
