//! What the API server serves, detected rather than assumed.
//!
//! 1. Discovery: `resource.k8s.io/v1` must list `resourceslices` (Kubernetes
//!    1.34+). Without it nothing can be published; the publisher says so and
//!    retries with backoff (an upgrade may bring it), it never crashes.
//! 2. Dropped fields: with a feature gate off the API server silently drops
//!    that feature's fields on write. Server-side dry-run creates of
//!    probe slices for this node show what survives:
//!    * a slice with only `sharedCounters`, and a slice whose device
//!      `consumesCounters` from a set it does not define (the 1.35+ layout;
//!      a 1.33/1.34 server rejects it, which also counts as "not served"):
//!      partitionable devices;
//!    * a slice with an `allowMultipleAllocations` device whose capacity has
//!      a `requestPolicy`: consumable capacity;
//!    * a slice with a device carrying a taint: device taints
//!      (`DRADeviceTaints`, beta and on by default since 1.36). Without
//!      them unhealthy GPUs are not tainted (their health still reaches the
//!      kubelet and the Node's events);
//!    * a slice whose device's counter consumption names a compatibility
//!      group: compatibility groups (`DRADeviceCompatibilityGroups`, alpha
//!      in 1.37). The scheduler's gate cannot be read through the API; a
//!      scheduler without it ignores slices with groups, so the operator
//!      can turn them off (`--compatibility-groups off`) where the two
//!      differ;
//!    * a device with binding conditions: binding conditions
//!      (`DRADeviceBindingConditions`, beta and on by default since 1.36),
//!      used only where the operator says `tessera binder` runs
//!      (`--binding-conditions auto`).
//!
//!    A dry run persists nothing and is not counted as a write.
//! 3. Version: the full model additionally needs a scheduler with the fixes
//!    listed in [`super::version`]; below [`super::version::MIN_FULL_MODEL`]
//!    partitionable devices are treated as absent, which selects the static
//!    per-GPU mode (consumable capacity may still be used there: it involves
//!    no counters).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device, DeviceCapacity,
    DeviceCounterConsumption, DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client};
use tracing::{info, warn};

use super::PublishError;
use super::version::ServerVersion;
use crate::model::{Capabilities, DriverName, Optional, SliceLimits};
use tessera_api::names::binding;

/// The group/version the publisher writes.
pub const RESOURCE_API: &str = "resource.k8s.io/v1";

/// The outcome of [`detect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detected {
    /// What the model is given.
    pub capabilities: Capabilities,
    /// `gitVersion` as the server reports it.
    pub git_version: String,
    pub version: Option<ServerVersion>,
    /// The server keeps the partitionable-device fields.
    pub partitionable_served: bool,
    /// The server keeps the consumable-capacity fields.
    pub consumable_served: bool,
    /// The server keeps device taints.
    pub taints_served: bool,
    /// The server keeps compatibility groups.
    pub groups_served: bool,
    /// The server keeps binding conditions.
    pub binding_served: bool,
    /// The version is at least the configured minimum for the full model.
    pub version_ok: bool,
    /// Why a feature counts as absent, for logs and `publish --once`.
    pub reasons: Vec<String>,
}

impl Detected {
    /// One line for logs.
    pub fn summary(&self) -> String {
        let mode = if self.capabilities.full_model() {
            "full model"
        } else {
            "static per-GPU mode"
        };
        format!(
            "server {}: partitionable devices {}, consumable capacity {}, device taints {}, \
             compatibility groups {}, binding conditions {}, {}",
            self.git_version,
            yes_no(self.capabilities.partitionable_devices),
            yes_no(self.capabilities.consumable_capacity),
            yes_no(self.capabilities.device_taints),
            yes_no(self.capabilities.compatibility_groups),
            yes_no(self.capabilities.binding_conditions),
            mode
        )
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// Detects the server's capabilities for publishing `driver` slices of
/// `node`; the optional features only where `allowed`. Errors are
/// transport/authorization failures worth retrying; a feature that is
/// simply absent is not an error.
pub async fn detect(
    client: &Client,
    node: &str,
    driver: &DriverName,
    min_full_model: ServerVersion,
    allowed: Optional,
) -> Result<Detected, PublishError> {
    served(client).await?;
    let info = client
        .apiserver_version()
        .await
        .map_err(|e| PublishError::api("reading the server version", e))?;
    let version = ServerVersion::from_info(&info);
    let mut reasons = Vec::new();

    let api: Api<ResourceSlice> = Api::all(client.clone());
    let probes = Probes::new(node, driver);
    let partitionable_served = partitionable(&api, &probes, &mut reasons).await?;
    let consumable_served = keeps(&api, &probes.multi, &CONSUMABLE, &mut reasons).await?;
    let taints_served = keeps(&api, &probes.taints, &TAINTS, &mut reasons).await?;
    let groups_served = keeps(&api, &probes.groups, &GROUPS, &mut reasons).await?;
    if groups_served && !allowed.compatibility_groups {
        reasons.push(
            "compatibility groups: served, but turned off (--compatibility-groups off)".into(),
        );
    }
    let binding_served = keeps(&api, &probes.binding, &BINDING, &mut reasons).await?;
    if binding_served && !allowed.binding_conditions {
        reasons.push(
            "binding conditions: served, but off (--binding-conditions off: no tessera binder)"
                .into(),
        );
    }

    let version_ok = version.is_some_and(|v| v >= min_full_model);
    if partitionable_served && consumable_served && !version_ok {
        reasons.push(format!(
            "server {} is older than {min_full_model}, the first release whose scheduler \
             has the counter fixes the full model needs: using the static per-GPU mode",
            info.git_version
        ));
    }
    let detected = Detected {
        capabilities: Capabilities {
            partitionable_devices: partitionable_served && version_ok,
            consumable_capacity: consumable_served,
            device_taints: taints_served,
            compatibility_groups: groups_served && allowed.compatibility_groups,
            binding_conditions: binding_served && allowed.binding_conditions,
            limits: SliceLimits::V1_36,
        },
        git_version: info.git_version,
        version,
        partitionable_served,
        consumable_served,
        taints_served,
        groups_served,
        binding_served,
        version_ok,
        reasons,
    };
    info!("{}", detected.summary());
    for r in &detected.reasons {
        info!("capabilities: {r}");
    }
    Ok(detected)
}

/// Whether the server keeps what partitionable devices are made of: a
/// slice of counters, and devices consuming from a set defined elsewhere.
async fn partitionable(
    api: &Api<ResourceSlice>,
    probes: &Probes,
    reasons: &mut Vec<String>,
) -> Result<bool, PublishError> {
    let counters = probe(api, &probes.counters, "sharedCounters").await?;
    let consumes = probe(api, &probes.consumes, "consumesCounters").await?;
    Ok(match (&counters, &consumes) {
        (Probe::Kept(c), Probe::Kept(d)) => {
            let kept_counters = c
                .spec
                .shared_counters
                .as_ref()
                .is_some_and(|s| !s.is_empty());
            let kept_consumes = d
                .spec
                .devices
                .iter()
                .flatten()
                .any(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()));
            if !kept_counters || !kept_consumes {
                reasons.push(
                    "partitionable devices: the server drops sharedCounters/consumesCounters \
                     (feature gate DRAPartitionableDevices off)"
                        .to_string(),
                );
            }
            kept_counters && kept_consumes
        }
        (Probe::Rejected(why), _) | (_, Probe::Rejected(why)) => {
            reasons.push(format!(
                "partitionable devices: the server rejects the 1.35+ layout: {why}"
            ));
            false
        }
    })
}

/// A feature the server shows by keeping a field of a probe's device.
struct DeviceField {
    /// How the reasons name it.
    feature: &'static str,
    /// The field, as the probe's log names it.
    field: &'static str,
    /// Why the server would drop it, and what that costs.
    dropped: &'static str,
    kept: fn(&Device) -> bool,
}

const CONSUMABLE: DeviceField = DeviceField {
    feature: "consumable capacity",
    field: "allowMultipleAllocations",
    dropped: "the server drops allowMultipleAllocations/requestPolicy \
              (feature gate DRAConsumableCapacity off)",
    kept: |d| {
        d.allow_multiple_allocations == Some(true)
            && d.capacity
                .iter()
                .flatten()
                .any(|(_, c)| c.request_policy.is_some())
    },
};

const TAINTS: DeviceField = DeviceField {
    feature: "device taints",
    field: "taints",
    dropped: "the server drops devices[].taints (feature gate DRADeviceTaints off): \
              unhealthy GPUs are not tainted",
    kept: |d| d.taints.as_ref().is_some_and(|t| !t.is_empty()),
};

const GROUPS: DeviceField = DeviceField {
    feature: "compatibility groups",
    field: "compatibilityGroups",
    dropped: "the server drops consumesCounters[].compatibilityGroups \
              (feature gate DRADeviceCompatibilityGroups off)",
    kept: |d| {
        d.consumes_counters.iter().flatten().any(|c| {
            c.compatibility_groups
                .as_ref()
                .is_some_and(|g| !g.is_empty())
        })
    },
};

const BINDING: DeviceField = DeviceField {
    feature: "binding conditions",
    field: "bindingConditions",
    dropped: "the server drops bindingConditions (feature gate \
              DRADeviceBindingConditions or DRAResourceClaimDeviceStatus off)",
    kept: |d| {
        d.binding_conditions.as_ref().is_some_and(|c| !c.is_empty())
            && d.binding_failure_conditions
                .as_ref()
                .is_some_and(|c| !c.is_empty())
    },
};

/// Whether the server keeps `f` of the probe slice's devices.
async fn keeps(
    api: &Api<ResourceSlice>,
    slice: &ResourceSlice,
    f: &DeviceField,
    reasons: &mut Vec<String>,
) -> Result<bool, PublishError> {
    Ok(match probe(api, slice, f.field).await? {
        Probe::Kept(s) => {
            let kept = s.spec.devices.iter().flatten().any(f.kept);
            if !kept {
                reasons.push(format!("{}: {}", f.feature, f.dropped));
            }
            kept
        }
        Probe::Rejected(why) => {
            reasons.push(format!("{}: probe rejected: {why}", f.feature));
            false
        }
    })
}

/// Fails unless `resource.k8s.io/v1` serves ResourceSlices.
async fn served(client: &Client) -> Result<(), PublishError> {
    match client.list_api_group_resources(RESOURCE_API).await {
        Ok(list) if list.resources.iter().any(|r| r.name == "resourceslices") => Ok(()),
        Ok(_) => Err(PublishError::NotServed(format!(
            "{RESOURCE_API} is served without resourceslices"
        ))),
        Err(kube::Error::Api(s)) if s.code == 404 => Err(PublishError::NotServed(format!(
            "{RESOURCE_API} is not served (Kubernetes 1.34 or newer is needed)"
        ))),
        Err(e) => Err(PublishError::api("discovering resource.k8s.io/v1", e)),
    }
}

enum Probe {
    /// The server accepted the dry run; what it would have stored.
    Kept(Box<ResourceSlice>),
    /// The server refused it as invalid.
    Rejected(String),
}

async fn probe(
    api: &Api<ResourceSlice>,
    slice: &ResourceSlice,
    what: &str,
) -> Result<Probe, PublishError> {
    let params = PostParams {
        dry_run: true,
        field_manager: Some(super::FIELD_MANAGER.to_string()),
    };
    match api.create(&params, slice).await {
        Ok(s) => Ok(Probe::Kept(Box::new(s))),
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => {
            warn!("capability probe ({what}) rejected: {}", s.message);
            Ok(Probe::Rejected(s.message))
        }
        Err(e) => Err(PublishError::api("probing capabilities (dry run)", e)),
    }
}

/// The probe slices.
struct Probes {
    counters: ResourceSlice,
    consumes: ResourceSlice,
    multi: ResourceSlice,
    taints: ResourceSlice,
    groups: ResourceSlice,
    binding: ResourceSlice,
}

impl Probes {
    fn new(node: &str, driver: &DriverName) -> Self {
        let slice = |what: &str, spec: ResourceSliceSpec| probe_slice(node, driver, what, spec);
        Probes {
            counters: slice("counters", counters_spec()),
            consumes: slice("consumes", consumes_spec()),
            multi: slice("multi", multi_spec()),
            taints: slice("taints", taints_spec(driver)),
            groups: slice("groups", groups_spec()),
            binding: slice("binding", binding_spec()),
        }
    }
}

/// A probe slice of this node's pool with the devices or counters of `spec`.
fn probe_slice(
    node: &str,
    driver: &DriverName,
    what: &str,
    spec: ResourceSliceSpec,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(probe_name(node, driver, what)),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.as_str().to_string(),
            node_name: Some(node.to_string()),
            pool: ResourcePool {
                name: node.to_string(),
                generation: 0,
                resource_slice_count: 1,
            },
            ..spec
        },
    }
}

fn q(s: &str) -> Quantity {
    Quantity(s.to_string())
}

/// Only a counter set.
fn counters_spec() -> ResourceSliceSpec {
    ResourceSliceSpec {
        shared_counters: Some(vec![CounterSet {
            name: "probe".into(),
            counters: BTreeMap::from([("units".to_string(), Counter { value: q("1") })]),
        }]),
        ..ResourceSliceSpec::default()
    }
}

/// A device consuming from a counter set the slice does not define.
fn consumes_spec() -> ResourceSliceSpec {
    ResourceSliceSpec {
        devices: Some(vec![Device {
            name: "probe".into(),
            consumes_counters: Some(vec![DeviceCounterConsumption {
                counter_set: "probe".into(),
                counters: BTreeMap::from([("units".to_string(), Counter { value: q("1") })]),
                compatibility_groups: None,
            }]),
            ..Device::default()
        }]),
        ..ResourceSliceSpec::default()
    }
}

/// A device made at prepare: binding and failure conditions.
fn binding_spec() -> ResourceSliceSpec {
    ResourceSliceSpec {
        devices: Some(vec![Device {
            name: "probe".into(),
            binding_conditions: Some(vec![binding::MADE.into()]),
            binding_failure_conditions: Some(vec![binding::NOT_MADE.into()]),
            ..Device::default()
        }]),
        ..ResourceSliceSpec::default()
    }
}

/// [`consumes_spec`] with a compatibility group on the consumption.
fn groups_spec() -> ResourceSliceSpec {
    let mut spec = consumes_spec();
    for device in spec.devices.iter_mut().flatten() {
        for consumption in device.consumes_counters.iter_mut().flatten() {
            consumption.compatibility_groups = Some(vec!["probe".into()]);
        }
    }
    spec
}

/// A multi-allocatable device whose capacity has a request policy.
fn multi_spec() -> ResourceSliceSpec {
    ResourceSliceSpec {
        devices: Some(vec![Device {
            name: "probe".into(),
            allow_multiple_allocations: Some(true),
            capacity: Some(BTreeMap::from([(
                "memory".to_string(),
                DeviceCapacity {
                    value: q("2Gi"),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(q("1Gi")),
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: q("1Gi"),
                            max: Some(q("2Gi")),
                            step: Some(q("1Gi")),
                        }),
                        valid_values: None,
                    }),
                },
            )])),
            ..Device::default()
        }]),
        ..ResourceSliceSpec::default()
    }
}

/// A device with a taint that has no effect.
fn taints_spec(driver: &DriverName) -> ResourceSliceSpec {
    ResourceSliceSpec {
        devices: Some(vec![Device {
            name: "probe".into(),
            taints: Some(vec![DeviceTaint {
                key: format!("{driver}/probe"),
                value: None,
                effect: "None".into(),
                time_added: None,
            }]),
            ..Device::default()
        }]),
        ..ResourceSliceSpec::default()
    }
}

/// `<node>-<driver>-probe-<what>`, shortened to a valid object name.
fn probe_name(node: &str, driver: &DriverName, what: &str) -> String {
    let mut name = format!("{node}-{driver}");
    let tail = format!("-probe-{what}");
    name.truncate(253 - tail.len());
    let name = name.trim_end_matches(['-', '.']);
    format!("{name}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_names_are_valid_and_bounded() {
        let d = DriverName::default();
        assert_eq!(
            probe_name("node-a", &d, "multi"),
            "node-a-gpu.tessera.dev-probe-multi"
        );
        // A node name at the length limit (labels of at most 63 characters).
        let long = vec!["n".repeat(63); 4].join(".")[..253].to_string();
        assert!(crate::model::naming::is_dns_subdomain(&long));
        let name = probe_name(&long, &d, "counters");
        assert!(name.len() <= 253);
        assert!(crate::model::naming::is_dns_subdomain(&name), "{name}");
    }

    #[test]
    fn probes_pass_the_models_own_checks() {
        // The probes must be valid slices on a server that serves everything,
        // or detection would report a feature missing that is there.
        let p = Probes::new("node-a", &DriverName::default());
        for s in [&p.counters, &p.consumes, &p.multi, &p.taints] {
            let spec = &s.spec;
            assert!(spec.devices.is_some() != spec.shared_counters.is_some());
            assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        }
    }
}
