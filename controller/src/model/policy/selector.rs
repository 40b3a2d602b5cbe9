//! Which GPUs a rule selects.

use serde::Deserialize;
use tessera_api::inventory::Gpu;

use super::{PolicyError, invalid};

/// Selects GPUs; exactly one field must be set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuSelector {
    /// `true` selects every GPU.
    #[serde(default)]
    pub all: Option<bool>,
    /// A GPU UUID, `GPU-...`.
    #[serde(default)]
    pub uuid: Option<String>,
    /// The stable Tessera index `n` of device `gpu-<n>` (not the NVML index).
    #[serde(default)]
    pub index: Option<u32>,
    /// Glob over the product name, case-insensitive.
    #[serde(default)]
    pub product: Option<String>,
}

impl GpuSelector {
    pub(super) fn validate(&self, path: &str) -> Result<(), PolicyError> {
        let set = [
            self.all.is_some(),
            self.uuid.is_some(),
            self.index.is_some(),
            self.product.is_some(),
        ]
        .iter()
        .filter(|s| **s)
        .count();
        if set != 1 {
            return Err(invalid(
                path,
                format!("exactly one of all, uuid, index, product must be set ({set} set)"),
            ));
        }
        if self.all == Some(false) {
            return Err(invalid(
                format!("{path}.all"),
                "must be true when set (omit the rule instead)",
            ));
        }
        if let Some(uuid) = &self.uuid
            && !(uuid.starts_with("GPU-") && uuid.len() > 4)
        {
            return Err(invalid(
                format!("{path}.uuid"),
                format!("must be a GPU UUID (GPU-...), not {uuid:?}"),
            ));
        }
        if let Some(product) = &self.product
            && product.trim().is_empty()
        {
            return Err(invalid(format!("{path}.product"), "must not be empty"));
        }
        Ok(())
    }

    /// Whether this selector picks `gpu` (with stable index `index`).
    pub fn matches(&self, gpu: &Gpu, index: u32) -> bool {
        if self.all == Some(true) {
            return true;
        }
        if let Some(uuid) = &self.uuid {
            return uuid.eq_ignore_ascii_case(&gpu.uuid);
        }
        if let Some(i) = self.index {
            return i == index;
        }
        if let Some(product) = &self.product {
            return glob_match(
                &product.to_ascii_lowercase(),
                &gpu.product_name.to_ascii_lowercase(),
            );
        }
        false
    }
}

/// Shell-style matching with `*` (any run) and `?` (one character).
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            backtrack = Some((pi, ti));
            pi += 1;
        } else if let Some((star, matched)) = backtrack {
            pi = star + 1;
            ti = matched + 1;
            backtrack = Some((star, matched + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}
