//! What a claim's containers get to reach their MPS daemon: the limits as
//! environment variables in the claim's CDI spec, and how its directories
//! are mounted.
//!
//! NVIDIA's MPS documentation ("Appendix: Environment Variables") defines
//! the two client-side limits Tessera sets:
//!
//! - `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`: the share of the device's threads
//!   (SMs) a client's contexts may use, a percentage.
//! - `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: device memory a client may allocate,
//!   a comma-separated list of `<device>=<amount>` entries, the amount a
//!   number with a unit suffix (`M`/`MB`, `G`/`GB`), e.g. `0=1G,1=512MB`.
//!
//! The device in the memory limit is written as the ordinal the *client*
//! enumerates, not as a UUID. NVIDIA's own Kubernetes device plugin
//! (v0.15.0 release notes: "Set MPS memory limit by device index and not
//! device UUID ... these limits are not applied for devices if set by UUID")
//! moved to ordinals for that reason. Tessera starts one control daemon per
//! device with `CUDA_VISIBLE_DEVICES=<that uuid>` and a client container
//! sees exactly its claim's device through one daemon's pipe directory, so
//! the device is always ordinal `0` for the client.
//!
//! Amounts are whole MiB, rounded *down* from the allocated bytes so a
//! client never gets more than the scheduler accounted for.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Name of the compute limit variable.
pub const ACTIVE_THREAD_PERCENTAGE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// Name of the memory limit variable.
pub const PINNED_DEVICE_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// Name of the variable that tells a client where its daemon's pipes are.
pub const PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// Name of the variable that tells the daemon where to log.
pub const LOG_DIRECTORY: &str = "CUDA_MPS_LOG_DIRECTORY";

/// Mount options for a pipe or shared memory directory in a client
/// container: clients connect to sockets, open pipes and map segments
/// there, they never need to execute or open a device node from it.
pub const PIPE_MOUNT_OPTIONS: [&str; 5] = ["rw", "nosuid", "nodev", "noexec", "bind"];

const MIB: u64 = 1024 * 1024;

/// A limit that cannot be expressed for MPS.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error(
        "MPS memory limit for {device}: {bytes} bytes is less than 1 MiB, the smallest limit MPS \
         accepts; fix: request at least 1Mi of memory"
    )]
    MemoryTooSmall { device: String, bytes: u64 },
    #[error(
        "MPS compute limit for {device}: {percent}% is outside 1..=100; fix: request cores \
         between 1 and 100"
    )]
    PercentOutOfRange { device: String, percent: u32 },
    #[error(
        "MPS limits: {device:?} is not a GPU or MIG device UUID (GPU-... or MIG-..., letters, \
         digits and '-')"
    )]
    BadDevice { device: String },
}

/// The limits of every client of one MPS daemon on its device: the daemon's
/// defaults, and the same values in the clients' environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientLimits {
    /// Device memory the client may pin, bytes.
    pub memory_bytes: u64,
    /// Share of the device's threads, percent (1..=100).
    pub thread_percent: u32,
    /// Bytes of the daemon's `/dev/shm`, which its clients share; `None`:
    /// the node policy's default when the daemon starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_bytes: Option<u64>,
}

impl fmt::Display for ClientLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} MiB, {}% of threads",
            self.memory_bytes / MIB,
            self.thread_percent
        )
    }
}

/// The environment entries (`NAME=value`) that apply `limits` to a client of
/// the MPS daemon serving `device_uuid`, in a stable order: memory first.
///
/// ```
/// use tessera_driver::host::mps_client::{ClientLimits, client_limit_env};
/// let env = client_limit_env(
///     "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10",
///     ClientLimits { memory_bytes: 10 << 30, thread_percent: 25, shm_bytes: None },
/// )
/// .unwrap();
/// assert_eq!(
///     env,
///     [
///         "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M",
///         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
///     ]
/// );
/// ```
pub fn client_limit_env(
    device_uuid: &str,
    limits: ClientLimits,
) -> Result<Vec<String>, LimitError> {
    if !is_device_uuid(device_uuid) {
        return Err(LimitError::BadDevice {
            device: device_uuid.to_owned(),
        });
    }
    let mib = limits.memory_bytes / MIB;
    if mib == 0 {
        return Err(LimitError::MemoryTooSmall {
            device: device_uuid.to_owned(),
            bytes: limits.memory_bytes,
        });
    }
    if !(1..=100).contains(&limits.thread_percent) {
        return Err(LimitError::PercentOutOfRange {
            device: device_uuid.to_owned(),
            percent: limits.thread_percent,
        });
    }
    Ok(vec![
        format!("{PINNED_DEVICE_MEM_LIMIT}=0={mib}M"),
        format!("{ACTIVE_THREAD_PERCENTAGE}={}", limits.thread_percent),
    ])
}

/// The control commands that make `limits` a daemon's defaults for every
/// client it serves (the daemon serves one device, ordinal 0). The pinned
/// limit is in whole MiB, rounded down like [`client_limit_env`].
pub fn daemon_default_commands(limits: ClientLimits) -> String {
    format!(
        "set_default_active_thread_percentage {}\nset_default_device_pinned_mem_limit 0 {}M\n",
        limits.thread_percent,
        limits.memory_bytes / MIB
    )
}

/// A GPU (`GPU-…`) or MIG (`MIG-…`) UUID in the form current drivers print:
/// only ASCII letters, digits and `-`, so it is also safe as a file name.
pub fn is_device_uuid(s: &str) -> bool {
    let rest = s.strip_prefix("GPU-").or_else(|| s.strip_prefix("MIG-"));
    rest.is_some_and(|r| {
        !r.is_empty() && r.len() <= 64 && r.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: &str = "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10";

    fn env(memory_bytes: u64, thread_percent: u32) -> Result<Vec<String>, LimitError> {
        client_limit_env(
            GPU,
            ClientLimits {
                memory_bytes,
                thread_percent,
                shm_bytes: None,
            },
        )
    }

    #[test]
    fn renders_ordinal_zero_with_mebibytes() {
        assert_eq!(
            env(20 * 1024 * MIB, 50).unwrap(),
            [
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"
            ]
        );
    }

    #[test]
    fn memory_rounds_down_never_up() {
        // One byte short of 2 MiB is 1 MiB: never more than allocated.
        assert_eq!(
            env(2 * MIB - 1, 100).unwrap()[0],
            format!("{PINNED_DEVICE_MEM_LIMIT}=0=1M")
        );
        // A Kubernetes quantity like 1500Mi stays exact.
        assert_eq!(
            env(1500 * MIB, 100).unwrap()[0],
            format!("{PINNED_DEVICE_MEM_LIMIT}=0=1500M")
        );
    }

    #[test]
    fn rejects_what_mps_cannot_express() {
        assert!(matches!(
            env(MIB - 1, 50),
            Err(LimitError::MemoryTooSmall { .. })
        ));
        assert!(matches!(env(0, 50), Err(LimitError::MemoryTooSmall { .. })));
        assert!(matches!(
            env(MIB, 0),
            Err(LimitError::PercentOutOfRange { .. })
        ));
        assert!(matches!(
            env(MIB, 101),
            Err(LimitError::PercentOutOfRange { .. })
        ));
        assert_eq!(
            env(MIB, 1).unwrap()[1],
            format!("{ACTIVE_THREAD_PERCENTAGE}=1")
        );
        assert_eq!(
            env(MIB, 100).unwrap()[1],
            format!("{ACTIVE_THREAD_PERCENTAGE}=100")
        );
        let err = env(MIB, 101).unwrap_err().to_string();
        assert!(
            err.contains(GPU) && err.contains("101%") && err.contains("fix:"),
            "{err}"
        );
    }

    #[test]
    fn device_uuids_are_checked() {
        let limits = ClientLimits {
            memory_bytes: MIB,
            thread_percent: 10,
            shm_bytes: None,
        };
        assert!(client_limit_env("MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f", limits).is_ok());
        for bad in [
            "",
            "GPU-",
            "0",
            "GPU-1/../x",
            "MIG-GPU-1/1/0",
            "gpu-1",
            "GPU-a b",
        ] {
            assert!(
                matches!(
                    client_limit_env(bad, limits),
                    Err(LimitError::BadDevice { .. })
                ),
                "{bad:?}"
            );
        }
    }
}
