//! The bounds of each MPS daemon's own tmpfs.

use serde::Deserialize;
use tessera_api::config::Quantity;

use super::{PolicyError, invalid};

/// Each MPS daemon's `/dev/shm` (shared with its claim's containers) and
/// pipe directory are a tmpfs of their own, bounded here: a claim that
/// fills them gets ENOSPC and reaches no other claim, nor the node's `/run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MpsPolicy {
    /// The `/dev/shm` of a claim that does not ask for a size.
    #[serde(default = "MpsPolicy::default_shared_memory")]
    pub shared_memory: Quantity,
    /// The most a claim's `sharedMemory` may ask for.
    #[serde(default = "MpsPolicy::default_max_shared_memory")]
    pub max_shared_memory: Quantity,
    /// Files (inodes) in a daemon's `/dev/shm`; its pipe directory, where
    /// MPS keeps a few sockets and fifos per client, gets an eighth.
    #[serde(default = "MpsPolicy::default_inodes")]
    pub inodes: u64,
    /// Also set each new daemon's limits through its control endpoint (a
    /// second process per daemon). Off: the limits are the daemon's
    /// defaults from its environment at start, which NVIDIA documents as
    /// binding every server it starts; on, for a driver shown otherwise.
    #[serde(default)]
    pub confirm_defaults: bool,
}

impl MpsPolicy {
    /// The range of `inodes`: MPS needs a few, and more than a million
    /// files is no longer a bound.
    pub const INODES: std::ops::RangeInclusive<u64> = 64..=1 << 20;
    /// The smallest `/dev/shm` a policy may set.
    pub const MIN_SHARED_MEMORY: u64 = 1 << 20;

    fn default_shared_memory() -> Quantity {
        Quantity::from_bytes(256 << 20)
    }

    fn default_max_shared_memory() -> Quantity {
        Quantity::from_bytes(4 << 30)
    }

    fn default_inodes() -> u64 {
        4096
    }

    pub(super) fn validate(&self) -> Result<(), PolicyError> {
        if self.shared_memory.bytes() < Self::MIN_SHARED_MEMORY {
            return Err(invalid(
                "mps.sharedMemory",
                format!("must be at least 1Mi, not {}", self.shared_memory),
            ));
        }
        if self.max_shared_memory < self.shared_memory {
            return Err(invalid(
                "mps.maxSharedMemory",
                format!(
                    "{} is less than mps.sharedMemory ({}); raise it or lower the default",
                    self.max_shared_memory, self.shared_memory
                ),
            ));
        }
        if !Self::INODES.contains(&self.inodes) {
            return Err(invalid(
                "mps.inodes",
                format!(
                    "must be between {} and {}, not {}",
                    Self::INODES.start(),
                    Self::INODES.end(),
                    self.inodes
                ),
            ));
        }
        Ok(())
    }
}

impl Default for MpsPolicy {
    fn default() -> Self {
        MpsPolicy {
            shared_memory: Self::default_shared_memory(),
            max_shared_memory: Self::default_max_shared_memory(),
            inodes: Self::default_inodes(),
            confirm_defaults: false,
        }
    }
}
