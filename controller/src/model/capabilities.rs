//! What the API server can represent, which decides the device model.
//!
//! The publisher detects these (discovery, and whether fields survive a
//! round trip) and hands them to the model; the model never guesses.

/// Features of `resource.k8s.io/v1` the device model depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Partitionable devices (KEP-4815) in the 1.35+ layout: `sharedCounters`
    /// live in their own ResourceSlices of the pool, devices reference them
    /// by counter-set name through `consumesCounters`. The 1.33/1.34 alpha
    /// layout (counters beside devices) is deliberately not supported: treat
    /// such a server as not having the feature.
    pub partitionable_devices: bool,
    /// Consumable capacity (KEP-5075): `allowMultipleAllocations` and
    /// capacity `requestPolicy`.
    pub consumable_capacity: bool,
    /// Device taints (KEP-5055, `DRADeviceTaints`, beta and on by default
    /// since 1.36): `devices[].taints` survive a write. Without them the
    /// health of a GPU reaches the kubelet and the Node's events only.
    pub device_taints: bool,
    /// Compatibility groups (KEP-5963, `DRADeviceCompatibilityGroups`,
    /// alpha in 1.37): `consumesCounters[].compatibilityGroups` survive a
    /// write, and the operator has not turned them off. A scheduler
    /// without the gate ignores slices that declare them, so they are
    /// never assumed: only detected.
    pub compatibility_groups: bool,
    /// Device binding conditions (KEP-5007, `DRADeviceBindingConditions`,
    /// beta and on by default since 1.36): `bindingConditions` survive a
    /// write, and something in the cluster (`tessera binder`) gets the node
    /// to make such devices before their pod binds. Without it the
    /// scheduler would wait for conditions nobody sets, so never assumed.
    pub binding_conditions: bool,
    /// Validation limits of the server.
    pub limits: SliceLimits,
}

impl Capabilities {
    /// A server serving both features (and device taints) with the v1.36
    /// limits: the full device model (dynamic MIG, share devices, counters).
    pub const fn full() -> Self {
        Capabilities {
            partitionable_devices: true,
            consumable_capacity: true,
            device_taints: true,
            compatibility_groups: false,
            binding_conditions: false,
            limits: SliceLimits::V1_36,
        }
    }

    /// A server with neither feature (nor device taints): the static
    /// per-GPU mode from policy.
    pub const fn legacy() -> Self {
        Capabilities {
            partitionable_devices: false,
            consumable_capacity: false,
            device_taints: false,
            compatibility_groups: false,
            binding_conditions: false,
            limits: SliceLimits::V1_36,
        }
    }

    /// Whether the full model (counters + consumable share devices) can be
    /// published. Anything less falls back to the static per-GPU mode,
    /// because the mutual exclusion of modes needs counters and the share
    /// devices need consumable capacity.
    pub const fn full_model(&self) -> bool {
        self.partitionable_devices && self.consumable_capacity
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities::full()
    }
}

/// ResourceSlice validation limits (`pkg/apis/resource/types.go`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceLimits {
    /// `ResourceSliceMaxDevices`.
    pub max_devices: usize,
    /// Devices per slice when any device in it consumes counters or has
    /// taints: `ResourceSliceMaxDevicesWithAdvancedFeatures` (v1.36).
    pub max_devices_with_counters: usize,
    /// `ResourceSliceMaxCounterSets`.
    pub max_counter_sets: usize,
    /// `ResourceSliceMaxCountersPerCounterSet`.
    pub max_counters_per_set: usize,
    /// `ResourceSliceMaxCountersPerDeviceCounterConsumption`.
    pub max_counters_per_consumption: usize,
    /// `ResourceSliceMaxDeviceCounterConsumptionsPerDevice`.
    pub max_consumptions_per_device: usize,
    /// `ResourceSliceMaxAttributesAndCapacitiesPerDevice`.
    pub max_attributes_and_capacities: usize,
    /// `DeviceTaintsMaxLength`: taints per device.
    pub max_taints_per_device: usize,
}

impl SliceLimits {
    /// Limits of Kubernetes v1.35 and v1.36.
    pub const V1_36: SliceLimits = SliceLimits {
        max_devices: 128,
        max_devices_with_counters: 64,
        max_counter_sets: 8,
        max_counters_per_set: 32,
        max_counters_per_consumption: 32,
        max_consumptions_per_device: 2,
        max_attributes_and_capacities: 32,
        max_taints_per_device: 16,
    };
}

impl Default for SliceLimits {
    fn default() -> Self {
        SliceLimits::V1_36
    }
}

/// What the operator lets the publisher use where the server serves it:
/// features that need more than the API server (a scheduler with the same
/// gate, a component that acts on them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Optional {
    /// Compatibility groups: the scheduler's gate is on wherever the API
    /// server's is (`--compatibility-groups auto`).
    pub compatibility_groups: bool,
    /// Binding conditions: `tessera binder` runs in the cluster
    /// (`--binding-conditions auto`).
    pub binding_conditions: bool,
}

impl Default for Optional {
    fn default() -> Self {
        Optional {
            compatibility_groups: true,
            binding_conditions: false,
        }
    }
}
