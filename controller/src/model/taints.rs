//! GPU health in the slices: every device of a GPU the node process found
//! unhealthy carries a device taint, where the API server serves them
//! ([`super::Capabilities::device_taints`]).
//!
//! * Key `<driver>/unhealthy` (`gpu.tessera.dev/unhealthy`), value the cause
//!   (`xid-79`), `timeAdded` when the GPU became unhealthy. The time comes
//!   from the node's health record, not from a clock, so the same health
//!   yields the same slices (and no write).
//! * Effect `NoSchedule` on every device a workload can get: the scheduler
//!   no longer allocates it to claims that do not tolerate the taint;
//!   running Pods stay (the driver evicts nothing).
//! * Effect `None` on the monitoring device: the taint is visible to
//!   whoever reads the slice, and a monitoring agent (adminAccess) can still
//!   watch the sick GPU without a toleration.
//!
//! A GPU that is healthy again loses its taints on the next reconcile.
//!
//! A device the node could not make ahead of its pod's binding (binding
//! conditions) carries `<driver>/not-made` (`NoSchedule`) for a while: the
//! claim still names it when the scheduler tries again (a device a claim
//! holds is never dropped), and must not get it again.

use k8s_openapi::api::resource::v1::{Device, DeviceTaint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::naming::DriverName;

/// Name part of the taint key (the prefix is the driver name).
pub const UNHEALTHY: &str = "unhealthy";

/// Name part of the key of the taint on a device the node could not make.
pub const NOT_MADE: &str = "not-made";

/// `NoSchedule`: claims that do not tolerate it are not allocated the device.
pub const NO_SCHEDULE: &str = "NoSchedule";

/// `None`: informational.
pub const EFFECT_NONE: &str = "None";

/// Why the node process holds a GPU unhealthy.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unhealthy {
    /// The taint's value: a label value naming the cause, e.g. `xid-79`.
    pub reason: String,
    /// When the GPU became unhealthy, seconds since the Unix epoch (the
    /// taint's `timeAdded`; the API server keeps whole seconds).
    pub since: i64,
}

/// The taint key of `driver`: `<driver>/unhealthy`.
pub fn unhealthy_key(driver: &DriverName) -> String {
    format!("{driver}/{UNHEALTHY}")
}

/// The taint a device of an unhealthy GPU carries.
pub fn taint(driver: &DriverName, unhealthy: &Unhealthy, effect: &str) -> DeviceTaint {
    DeviceTaint {
        key: unhealthy_key(driver),
        value: Some(label_value(&unhealthy.reason)).filter(|v| !v.is_empty()),
        effect: effect.to_string(),
        time_added: k8s_openapi::jiff::Timestamp::from_second(unhealthy.since)
            .ok()
            .map(Time),
    }
}

/// The taint of a device the node could not make, since `since` (seconds
/// since the Unix epoch).
pub fn not_made(driver: &DriverName, since: i64) -> DeviceTaint {
    DeviceTaint {
        key: format!("{driver}/{NOT_MADE}"),
        value: Some("create-failed".to_owned()),
        effect: NO_SCHEDULE.to_owned(),
        time_added: k8s_openapi::jiff::Timestamp::from_second(since)
            .ok()
            .map(Time),
    }
}

/// Taints `device` (replacing any health taint of ours it had).
pub fn apply(device: &mut Device, taint: DeviceTaint) {
    let taints = device.taints.get_or_insert_with(Vec::new);
    taints.retain(|t| t.key != taint.key);
    taints.push(taint);
}

/// A valid label value: at most 63 characters of `[A-Za-z0-9._-]`,
/// beginning and ending alphanumeric (anything else becomes `-`).
fn label_value(reason: &str) -> String {
    let mut v: String = reason
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    while v.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        v.pop();
    }
    let start = v
        .find(|c: char| c.is_ascii_alphanumeric())
        .unwrap_or(v.len());
    v.split_off(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taints_are_valid_and_deterministic() {
        let driver = DriverName::default();
        let u = Unhealthy {
            reason: "xid-79".into(),
            since: 1_700_000_000,
        };
        let t = taint(&driver, &u, NO_SCHEDULE);
        assert_eq!(t.key, "gpu.tessera.dev/unhealthy");
        assert_eq!(t.value.as_deref(), Some("xid-79"));
        assert_eq!(t.effect, "NoSchedule");
        assert_eq!(
            serde_json::to_value(&t).unwrap()["timeAdded"],
            "2023-11-14T22:13:20Z"
        );
        assert_eq!(t, taint(&driver, &u, NO_SCHEDULE));
        assert_eq!(label_value("-XID 79: bus!-"), "XID-79--bus");
        assert_eq!(label_value(&"x".repeat(80)).len(), 63);
        assert_eq!(label_value("!!"), "");
    }

    #[test]
    fn applying_replaces_our_taint_only() {
        let mut d = Device {
            taints: Some(vec![DeviceTaint {
                key: "example.com/other".into(),
                effect: NO_SCHEDULE.into(),
                ..DeviceTaint::default()
            }]),
            ..Device::default()
        };
        let driver = DriverName::default();
        for reason in ["xid-48", "xid-79"] {
            let u = Unhealthy {
                reason: reason.into(),
                since: 1,
            };
            apply(&mut d, taint(&driver, &u, NO_SCHEDULE));
        }
        let keys: Vec<(&str, Option<&str>)> = d
            .taints
            .iter()
            .flatten()
            .map(|t| (t.key.as_str(), t.value.as_deref()))
            .collect();
        assert_eq!(
            keys,
            [
                ("example.com/other", None),
                ("gpu.tessera.dev/unhealthy", Some("xid-79"))
            ]
        );
    }
}
