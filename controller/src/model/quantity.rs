//! Quantities in the API server's canonical spelling.
//!
//! The API server re-serializes every `resource.Quantity` in canonical form
//! (`1024Mi` is stored as `1Gi`, `3000` as `3k`). If we emitted anything else,
//! a publisher comparing desired with stored objects would see a difference
//! that is not there, and rewrite slices on every restart. So every quantity
//! the model produces goes through [`bytes`] or [`count`], which spell integers
//! the way the server would.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

const DECIMAL_SUFFIXES: [&str; 7] = ["", "k", "M", "G", "T", "P", "E"];
const BINARY_SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];

/// A byte count. Multiples of 1024 use binary suffixes (`81559Mi`), anything
/// else the decimal form, matching how the server canonicalizes a quantity
/// that was written with (or without) a binary suffix.
pub fn bytes(value: u64) -> Quantity {
    if value >= 1024 && value.is_multiple_of(1024) {
        Quantity(scaled(value, 1024, &BINARY_SUFFIXES))
    } else {
        count(value)
    }
}

/// A plain integer (percent, engine count, counter token) in canonical
/// decimal form: `100`, `7`, `3k`.
pub fn count(value: u64) -> Quantity {
    Quantity(scaled(value, 1000, &DECIMAL_SUFFIXES))
}

fn scaled(mut value: u64, base: u64, suffixes: &[&str]) -> String {
    if value == 0 {
        return "0".to_string();
    }
    let mut exponent = 0;
    while exponent + 1 < suffixes.len() && value.is_multiple_of(base) {
        value /= base;
        exponent += 1;
    }
    format!("{value}{}", suffixes[exponent])
}

/// Parses a quantity this module produced back into an integer. Only used to
/// check our own output (tests, limit checks), so it understands exactly the
/// spellings above and nothing else.
pub fn parse_integer(quantity: &Quantity) -> Option<u64> {
    let text = quantity.0.as_str();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(digits_end);
    let mantissa: u64 = digits.parse().ok()?;
    let (base, exponent) = if let Some(i) = BINARY_SUFFIXES.iter().position(|s| *s == suffix) {
        (1024u64, i)
    } else {
        (1000u64, DECIMAL_SUFFIXES.iter().position(|s| *s == suffix)?)
    };
    mantissa.checked_mul(base.checked_pow(u32::try_from(exponent).ok()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_use_binary_suffix_when_exact() {
        assert_eq!(bytes(81559 * 1024 * 1024).0, "81559Mi");
        assert_eq!(bytes(80 * 1024 * 1024 * 1024).0, "80Gi");
        assert_eq!(bytes(256 * 1024 * 1024).0, "256Mi");
        assert_eq!(bytes(1024).0, "1Ki");
    }

    #[test]
    fn bytes_fall_back_to_decimal() {
        assert_eq!(bytes(0).0, "0");
        assert_eq!(bytes(512).0, "512");
        assert_eq!(bytes(1500).0, "1500");
        assert_eq!(bytes(3000).0, "3k");
    }

    #[test]
    fn counts_are_canonical_decimal() {
        assert_eq!(count(1).0, "1");
        assert_eq!(count(100).0, "100");
        assert_eq!(count(1000).0, "1k");
        assert_eq!(count(2_000_000).0, "2M");
    }

    #[test]
    fn parse_round_trips() {
        for v in [
            0,
            1,
            7,
            100,
            1000,
            1500,
            81559 * 1024 * 1024,
            40 << 30,
            3_000_000,
        ] {
            assert_eq!(parse_integer(&bytes(v)), Some(v), "bytes {v}");
            assert_eq!(parse_integer(&count(v)), Some(v), "count {v}");
        }
        assert_eq!(parse_integer(&Quantity("1.5Gi".into())), None);
    }
}
