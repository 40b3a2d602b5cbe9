//! Tessera's DeviceClasses, named after the driver name's domain, and the
//! one way of asking them for admin access that can never work.
//!
//! The classes are `gpu.<domain>`, `mig.<domain>`, `gpu-isolated.<domain>`,
//! `gpu-shared.<domain>` (the work classes) and `gpu-monitor.<domain>`, where
//! the domain is the driver name without a leading `gpu.`: `tessera.dev` by
//! default, `nvidia.com` with the chart's `nvidiaCompatibleNames`.
//!
//! # Admin access on a work class is refused, not warned about
//!
//! Other drivers document monitoring as `adminAccess: true` on their GPU
//! class. On Tessera's work classes that claim is wrong whatever the
//! cluster publishes:
//!
//! * With partitionable devices (the full model) every work device consumes
//!   its GPU's counters, and the scheduler checks counters for admin access
//!   too: the claim is allocated only while nothing holds the GPU, which is
//!   when there is nothing to watch, and otherwise stays Pending with
//!   "cannot allocate all claims".
//! * In the static per-GPU model the devices consume no counters, so the
//!   scheduler may allocate a busy GPU's device to it, but prepare then
//!   sets that device up for work as for any claim of its class (CUDA, and
//!   the MIG mode, MPS daemon or time slice it needs) beside the claim that
//!   holds it, instead of the read-only monitoring set.
//!
//! The monitoring class works in both models (its device is published in
//! every model and consumes nothing), so no claim loses anything by being
//! pointed at it, and a warning would be lost where it matters most: on the
//! claims the ResourceClaim controller makes from a template.

use std::fmt;

use serde_json::Value;

/// The label a namespace needs before the API server admits `adminAccess`
/// in its claims.
pub const ADMIN_ACCESS_LABEL: &str = "resource.kubernetes.io/admin-access";

/// The DeviceClass domain of a driver name: `gpu.tessera.dev` →
/// `tessera.dev`; a name without the `gpu.` prefix is its own domain.
pub fn domain(driver: &str) -> &str {
    driver.strip_prefix("gpu.").unwrap_or(driver)
}

/// The monitoring class: per-GPU devices for admin access that consume
/// nothing.
pub fn monitor_class(driver: &str) -> String {
    format!("gpu-monitor.{}", domain(driver))
}

/// The work classes: whole GPU, MIG, Isolated and Shared shares.
pub fn work_classes(driver: &str) -> [String; 4] {
    let domain = domain(driver);
    ["gpu", "mig", "gpu-isolated", "gpu-shared"].map(|class| format!("{class}.{domain}"))
}

/// A request of a claim spec that asks a work class for admin access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkClassAdminAccess {
    /// The object, as messages name it (`claim ns/name`, `claim template
    /// ns/name`).
    pub claim: String,
    /// The request's name.
    pub request: String,
    /// Where its `adminAccess` and `deviceClassName` are, e.g.
    /// `spec.devices.requests[0].exactly`.
    pub path: String,
    /// The work class it asks for.
    pub class: String,
    /// The monitoring class of the same driver.
    pub monitor_class: String,
}

impl WorkClassAdminAccess {
    /// What is wrong.
    pub fn problem(&self) -> String {
        format!(
            "request `{}` asks work class {} for admin access: its devices consume their GPU's \
             counters, which the scheduler checks even for admin access, so the claim stays \
             Pending (\"cannot allocate all claims\") while a workload holds the GPU, and where \
             it is allocated the device is prepared for work, not for monitoring",
            self.request, self.class
        )
    }

    /// How to fix it.
    pub fn fix(&self) -> String {
        format!(
            "set {}.deviceClassName to {} and keep adminAccess: true (the namespace needs the \
             label {ADMIN_ACCESS_LABEL}: \"true\"); monitoring agents get every GPU of a node \
             with allocationMode: All",
            self.path, self.monitor_class
        )
    }
}

impl fmt::Display for WorkClassAdminAccess {
    /// `claim ns/c: spec.devices.requests[0].exactly.adminAccess: ...; fix:
    /// ...`, the shape of the webhook's other messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}.adminAccess: {}; fix: {}",
            self.claim,
            self.path,
            self.problem(),
            self.fix()
        )
    }
}

/// Every request of a claim spec's `devices` (at `devices_path`, e.g.
/// `spec.devices`) with `adminAccess: true` on one of `driver`'s work
/// classes. `claim` names the object in messages.
///
/// In `resource.k8s.io/v1` admin access is only on `exactly` requests
/// (`firstAvailable` subrequests have no such field); a v1beta1 request
/// carries the same fields on itself and is read there.
pub fn work_class_admin_access(
    driver: &str,
    claim: &str,
    devices: &Value,
    devices_path: &str,
) -> Vec<WorkClassAdminAccess> {
    let work = work_classes(driver);
    let requests = devices["requests"].as_array().map(Vec::as_slice);
    requests
        .unwrap_or_default()
        .iter()
        .enumerate()
        .filter_map(|(i, request)| {
            let (exact, path) = match request.get("exactly") {
                Some(exact) => (exact, format!("{devices_path}.requests[{i}].exactly")),
                None => (request, format!("{devices_path}.requests[{i}]")),
            };
            let class = exact["deviceClassName"].as_str()?;
            (exact["adminAccess"] == Value::Bool(true) && work.iter().any(|w| w == class)).then(
                || WorkClassAdminAccess {
                    claim: claim.to_owned(),
                    request: request["name"].as_str().unwrap_or_default().to_owned(),
                    path,
                    class: class.to_owned(),
                    monitor_class: monitor_class(driver),
                },
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn class_names_follow_the_driver_names_domain() {
        assert_eq!(monitor_class("gpu.tessera.dev"), "gpu-monitor.tessera.dev");
        assert_eq!(monitor_class("gpu.nvidia.com"), "gpu-monitor.nvidia.com");
        assert_eq!(
            monitor_class("accel.example.com"),
            "gpu-monitor.accel.example.com"
        );
        assert_eq!(
            work_classes("gpu.nvidia.com"),
            [
                "gpu.nvidia.com",
                "mig.nvidia.com",
                "gpu-isolated.nvidia.com",
                "gpu-shared.nvidia.com"
            ]
        );
    }

    #[test]
    fn only_admin_access_on_a_work_class_of_the_driver_is_found() {
        let devices = json!({"requests": [
            {"name": "ok", "exactly": {"deviceClassName": "gpu-monitor.nvidia.com", "adminAccess": true}},
            {"name": "work", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
            {"name": "off", "exactly": {"deviceClassName": "mig.nvidia.com", "adminAccess": false}},
            {"name": "other", "exactly": {"deviceClassName": "gpu.tessera.dev", "adminAccess": true}},
            {"name": "alt", "firstAvailable": [{"name": "a", "deviceClassName": "gpu.nvidia.com"}]},
            {"name": "mon", "exactly": {"deviceClassName": "gpu-shared.nvidia.com", "adminAccess": true}},
        ]});
        let found =
            work_class_admin_access("gpu.nvidia.com", "claim ns/c", &devices, "spec.devices");
        assert_eq!(
            found,
            vec![WorkClassAdminAccess {
                claim: "claim ns/c".into(),
                request: "mon".into(),
                path: "spec.devices.requests[5].exactly".into(),
                class: "gpu-shared.nvidia.com".into(),
                monitor_class: "gpu-monitor.nvidia.com".into(),
            }]
        );
        assert!(
            work_class_admin_access("gpu.nvidia.com", "c", &Value::Null, "spec.devices").is_empty()
        );
    }

    #[test]
    fn a_v1beta1_request_is_read_on_itself() {
        let devices = json!({"requests": [
            {"name": "gpu", "deviceClassName": "gpu.tessera.dev", "adminAccess": true},
        ]});
        let found =
            work_class_admin_access("gpu.tessera.dev", "claim ns/c", &devices, "spec.devices");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].path, "spec.devices.requests[0]");
    }

    #[test]
    fn the_message_names_claim_field_and_the_monitoring_class() {
        let devices = json!({"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": "gpu.tessera.dev",
                                         "allocationMode": "All", "adminAccess": true}},
        ]});
        let found = work_class_admin_access(
            "gpu.tessera.dev",
            "claim template mon/agent",
            &devices,
            "spec.spec.devices",
        );
        let message = found[0].to_string();
        assert!(
            message.starts_with(
                "claim template mon/agent: spec.spec.devices.requests[0].exactly.adminAccess: \
                 request `gpus` asks work class gpu.tessera.dev for admin access"
            ),
            "{message}"
        );
        assert!(
            message.contains(
                "; fix: set spec.spec.devices.requests[0].exactly.deviceClassName to \
                 gpu-monitor.tessera.dev and keep adminAccess: true (the namespace needs the \
                 label resource.kubernetes.io/admin-access: \"true\")"
            ),
            "{message}"
        );
        assert!(message.contains("cannot allocate all claims"), "{message}");
    }
}
