//! Flag types shared by the `tessera` subcommands.

use clap::ValueEnum;
use tessera_controller::model::Capabilities;

/// What the model may assume the API server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CapabilityChoice {
    /// Detect from the API server (`publish`, `plugin`).
    Auto,
    /// Partitionable devices and consumable capacity: the full model.
    Full,
    /// Neither: the static per-GPU mode with share replicas.
    Legacy,
    /// Consumable capacity without partitionable devices (static mode with
    /// multi-allocatable share devices).
    ConsumableOnly,
    /// Partitionable devices without consumable capacity (static mode).
    PartitionableOnly,
}

impl CapabilityChoice {
    /// The capabilities chosen; `None` for `auto` (detect them).
    pub fn capabilities(self) -> Option<Capabilities> {
        let both = Capabilities::full();
        match self {
            CapabilityChoice::Auto => None,
            CapabilityChoice::Full => Some(both),
            CapabilityChoice::Legacy => Some(Capabilities::legacy()),
            CapabilityChoice::ConsumableOnly => Some(Capabilities {
                partitionable_devices: false,
                ..both
            }),
            CapabilityChoice::PartitionableOnly => Some(Capabilities {
                consumable_capacity: false,
                ..both
            }),
        }
    }
}
