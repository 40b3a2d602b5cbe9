//! `admin-access-class`: monitoring claims ask the monitoring class.
//!
//! Other drivers document monitoring as `adminAccess: true` on their GPU
//! class; on Tessera's work classes such a claim stays Pending or gets a
//! device prepared for work (why: `tessera_api::classes`). The check reads
//! every ResourceClaim and ResourceClaimTemplate of the cluster and names
//! each request that does so, with the fix: the driver's monitoring class.

use anyhow::Result;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::Value;
use tessera_api::classes::{WorkClassAdminAccess, monitor_class, work_class_admin_access};

use super::Ctx;
use super::checks::Outcome;

/// A claim spec as the check reads it: who it is and its `devices`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimSpec {
    /// `claim ns/name` or `claim template ns/name`.
    pub label: String,
    /// Path of `devices` in the object.
    pub devices_path: &'static str,
    pub devices: Value,
}

pub async fn admin_access_class(ctx: &Ctx) -> Result<Outcome> {
    let client = &ctx.kube.client;
    let monitor = monitor_class(&ctx.driver);
    if Api::<DeviceClass>::all(client.clone())
        .get_opt(&monitor)
        .await?
        .is_none()
    {
        return Ok(Outcome::skip(format!(
            "DeviceClass {monitor} does not exist: no monitoring class of driver {} to point \
             admin access at",
            ctx.driver
        )));
    }
    let specs = match claim_specs(client).await {
        Ok(specs) => specs,
        Err(kube::Error::Api(status)) if status.code == 403 => {
            return Ok(Outcome::skip(format!(
                "cannot list ResourceClaims and ResourceClaimTemplates in all namespaces \
                 ({}); grant list on both to check them",
                status.message
            )));
        }
        Err(e) => return Err(e.into()),
    };
    Ok(admin_access_verdict(&ctx.driver, &specs))
}

/// Every ResourceClaim and ResourceClaimTemplate of the cluster.
async fn claim_specs(client: &Client) -> kube::Result<Vec<ClaimSpec>> {
    let mut specs = Vec::new();
    for claim in Api::<ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        specs.push(ClaimSpec {
            label: format!("claim {}", qualified(&claim.metadata)),
            devices_path: "spec.devices",
            devices: serde_json::to_value(claim.spec.as_ref().map(|s| &s.devices))
                .unwrap_or_default(),
        });
    }
    for template in Api::<ResourceClaimTemplate>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        specs.push(ClaimSpec {
            label: format!("claim template {}", qualified(&template.metadata)),
            devices_path: "spec.spec.devices",
            devices: serde_json::to_value(
                template
                    .spec
                    .as_ref()
                    .and_then(|s| s.spec.as_ref())
                    .map(|s| &s.devices),
            )
            .unwrap_or_default(),
        });
    }
    Ok(specs)
}

fn qualified(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// Fails naming every request that asks a work class of `driver` for admin
/// access, with its fix; passes otherwise, counting the requests that use
/// the monitoring class.
pub fn admin_access_verdict(driver: &str, specs: &[ClaimSpec]) -> Outcome {
    let monitor = monitor_class(driver);
    let wrong: Vec<WorkClassAdminAccess> = specs
        .iter()
        .flat_map(|s| work_class_admin_access(driver, &s.label, &s.devices, s.devices_path))
        .collect();
    if let Some(first) = wrong.first() {
        let more = match wrong.len() {
            1 => String::new(),
            n => format!(" ({} more in the details)", n - 1),
        };
        return Outcome::fail(
            format!("{first}{more}"),
            wrong.iter().map(ToString::to_string).collect(),
        );
    }
    let monitoring = specs
        .iter()
        .flat_map(|s| {
            s.devices["requests"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|r| {
            r["exactly"]["deviceClassName"].as_str() == Some(&monitor)
                && r["exactly"]["adminAccess"] == Value::Bool(true)
        })
        .count();
    Outcome::pass(
        format!(
            "no claim or claim template of the {} in the cluster asks a work class of {driver} \
             for admin access; {monitoring} request(s) ask {monitor} for it",
            specs.len()
        ),
        Vec::new(),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::suite::report::Status;

    fn spec(label: &str, class: &str, admin: bool) -> ClaimSpec {
        ClaimSpec {
            label: label.to_owned(),
            devices_path: "spec.devices",
            devices: json!({"requests": [
                {"name": "gpus", "exactly": {"deviceClassName": class, "adminAccess": admin}}
            ]}),
        }
    }

    #[test]
    fn names_each_work_class_admin_request_with_the_monitoring_class() {
        let specs = [
            spec("claim mon/ok", "gpu-monitor.nvidia.com", true),
            spec("claim mon/dcgm", "gpu.nvidia.com", true),
            spec("claim team/train", "gpu.nvidia.com", false),
            spec("claim mon/mig", "mig.nvidia.com", true),
        ];
        let outcome = admin_access_verdict("gpu.nvidia.com", &specs);
        assert_eq!(outcome.status, Status::Fail);
        assert!(
            outcome.message.starts_with(
                "claim mon/dcgm: spec.devices.requests[0].exactly.adminAccess: request `gpus` \
                 asks work class gpu.nvidia.com for admin access"
            ),
            "{}",
            outcome.message
        );
        assert!(
            outcome.message.ends_with(" (1 more in the details)"),
            "{}",
            outcome.message
        );
        assert_eq!(outcome.details.len(), 2);
        assert!(outcome.details[1].starts_with("claim mon/mig: "));
        assert!(
            outcome
                .details
                .iter()
                .all(|d| d.contains("deviceClassName to gpu-monitor.nvidia.com")),
            "{:?}",
            outcome.details
        );
    }

    #[test]
    fn passes_counting_monitoring_requests() {
        let specs = [
            spec("claim mon/ok", "gpu-monitor.tessera.dev", true),
            spec("claim team/train", "gpu.tessera.dev", false),
            spec("claim other/x", "gpu.example.com", true),
        ];
        let outcome = admin_access_verdict("gpu.tessera.dev", &specs);
        assert_eq!(outcome.status, Status::Pass, "{}", outcome.message);
        assert_eq!(
            outcome.message,
            "no claim or claim template of the 3 in the cluster asks a work class of \
             gpu.tessera.dev for admin access; 1 request(s) ask gpu-monitor.tessera.dev for it"
        );
    }
}
