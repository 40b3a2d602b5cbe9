//! What `fake-mps-control` and the simulated `libcuda.so.1`
//! (`driver/fake-cuda`) agree on: the MPS limit syntax both read from their
//! environment, and the one private control command the simulated CUDA
//! library sends at `cuInit` to learn what the daemon imposes on its clients.
//!
//! This file is compiled into both (the daemon declares it as a module, the
//! CUDA library includes it by path), so the two sides cannot drift apart.
//!
//! Limit syntax, as NVIDIA documents it for MPS:
//!
//! - a thread percentage is a decimal number in `(0, 100]` (`25`, `12.5`);
//! - a memory amount is a whole number with a unit, `M`/`MB` (MiB) or
//!   `G`/`GB` (GiB), any case (`8G`, `8GB`, `512M`, `512MB`); no unit, a
//!   fraction, zero or anything else is refused;
//! - `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` is a comma-separated list of
//!   `<ordinal>=<amount>` (`0=8G,1=512MB`); one bad entry refuses the list.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The private command. Its reply is one line: [`ClientConfig`] as JSON.
pub const CLIENT_CONFIG_COMMAND: &str = "tessera_fake_get_client_config";

/// Where the MPS server and its clients share memory. A client whose
/// `/dev/shm` is not the daemon's cannot work with it: NVIDIA documents
/// that MPS clients and the server must share `/dev/shm` (containers need
/// the daemon's mounted there).
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of the segment a daemon creates in [`SHM_DIR`] at start, named in
/// [`ClientConfig::shared_memory`] and holding that same name.
pub const SHM_PREFIX: &str = "tessera-fake-mps.";

/// Environment variable of a client's (and the daemon's default) thread
/// percentage.
pub const THREAD_PERCENTAGE_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// Environment variable of a client's (and the daemon's default) pinned
/// device memory limits.
pub const PINNED_MEM_LIMIT_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// What a daemon imposes on every client it serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConfig {
    /// The entries of the daemon's `CUDA_VISIBLE_DEVICES` (UUIDs, as Tessera
    /// starts its daemons, or whatever else was given), in order; `None`
    /// when the daemon was started without the variable (all devices).
    pub devices: Option<Vec<String>>,
    /// The default active thread percentage, `(0, 100]`.
    pub active_thread_percentage: f64,
    /// Default pinned device memory limits in bytes, by the ordinal of the
    /// device among the daemon's devices.
    pub pinned_mem_limits: BTreeMap<u32, u64>,
    /// The daemon's segment in its `/dev/shm` ([`SHM_DIR`]): a client must
    /// find it, with this name as its content, in its own.
    pub shared_memory: String,
}

/// Parses a thread percentage.
pub fn parse_percentage(s: &str) -> Result<f64, String> {
    let s = s.trim();
    match s.parse::<f64>() {
        Ok(p) if p.is_finite() && p > 0.0 && p <= 100.0 && !s.starts_with('+') => Ok(p),
        _ => Err(format!(
            "invalid thread percentage {s:?}: want a number in (0, 100]"
        )),
    }
}

/// Parses a memory amount (`8G`, `512MB`) into bytes.
pub fn parse_amount(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let bad = || format!("invalid memory amount {s:?}: want a whole number of M, MB, G or GB");
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let unit = match unit.to_ascii_uppercase().as_str() {
        "M" | "MB" => MIB,
        "G" | "GB" => GIB,
        _ => return Err(bad()),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    if n == 0 {
        return Err(bad());
    }
    n.checked_mul(unit).ok_or_else(bad)
}

/// Parses `<ordinal>=<amount>[,...]` into bytes by ordinal.
pub fn parse_pinned_limits(s: &str) -> Result<BTreeMap<u32, u64>, String> {
    let mut limits = BTreeMap::new();
    for entry in s.split(',') {
        let (ordinal, amount) = entry.split_once('=').ok_or_else(|| {
            format!("invalid pinned memory limit {entry:?}: want <ordinal>=<amount>")
        })?;
        let ordinal: u32 = ordinal
            .trim()
            .parse()
            .map_err(|_| format!("invalid device ordinal {ordinal:?} in {entry:?}"))?;
        let amount = parse_amount(amount)?;
        if limits.insert(ordinal, amount).is_some() {
            return Err(format!("device ordinal {ordinal} given twice"));
        }
    }
    Ok(limits)
}

/// An amount as the control daemon prints it: whole MiB, `8192M`.
pub fn format_amount(bytes: u64) -> String {
    format!("{}M", bytes / MIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages() {
        assert_eq!(parse_percentage("25"), Ok(25.0));
        assert_eq!(parse_percentage(" 12.5 "), Ok(12.5));
        assert_eq!(parse_percentage("100"), Ok(100.0));
        for bad in ["0", "-5", "100.5", "", "25%", "abc", "NaN", "inf", "+25"] {
            assert!(parse_percentage(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn amounts() {
        assert_eq!(parse_amount("8G"), Ok(8 * GIB));
        assert_eq!(parse_amount("8GB"), Ok(8 * GIB));
        assert_eq!(parse_amount("8gb"), Ok(8 * GIB));
        assert_eq!(parse_amount("512M"), Ok(512 * MIB));
        assert_eq!(parse_amount("512MB"), Ok(512 * MIB));
        assert_eq!(parse_amount("10240M"), Ok(10 * GIB));
        for bad in [
            "",
            "8",
            "0G",
            "G",
            "1.5G",
            "8T",
            "8 G",
            "-1G",
            "8GiB",
            "99999999999999G",
        ] {
            assert!(parse_amount(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(format_amount(8 * GIB), "8192M");
    }

    #[test]
    fn pinned_limit_lists() {
        assert_eq!(
            parse_pinned_limits("0=8G,1=512MB"),
            Ok(BTreeMap::from([(0, 8 * GIB), (1, 512 * MIB)]))
        );
        assert_eq!(parse_pinned_limits("3=1G"), Ok(BTreeMap::from([(3, GIB)])));
        for bad in [
            "",
            "0",
            "0=",
            "=1G",
            "a=1G",
            "0=1G,",
            "0=1G,0=2G",
            "0=1G;1=1G",
            "-1=1G",
        ] {
            assert!(parse_pinned_limits(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn client_config_round_trips_as_one_json_line() {
        let c = ClientConfig {
            devices: Some(vec!["GPU-1".into()]),
            active_thread_percentage: 25.0,
            pinned_mem_limits: BTreeMap::from([(0, 8 * GIB)]),
            shared_memory: "tessera-fake-mps.7".into(),
        };
        let line = serde_json::to_string(&c).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(
            line,
            r#"{"devices":["GPU-1"],"activeThreadPercentage":25.0,"pinnedMemLimits":{"0":8589934592},"sharedMemory":"tessera-fake-mps.7"}"#
        );
        assert_eq!(serde_json::from_str::<ClientConfig>(&line).unwrap(), c);
    }
}
