//! What the API server says about the node's claims (their Pods) and
//! GPUs (their health taints).

use std::collections::BTreeMap;
use std::time::Duration;

use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::state::records::ClaimEntry;

use super::StatusArgs;

/// What the API server says about the node's claims and GPUs.
#[derive(Debug, Clone, Default)]
pub struct ApiView {
    /// Pods per claim UID (claims the API server has under that UID).
    pub pods: BTreeMap<String, Vec<String>>,
    /// Unhealthy GPUs by UUID, with the taint's cause.
    pub unhealthy: BTreeMap<String, String>,
}

/// Reads each claim's Pods and the GPUs' health taints, within a few
/// seconds; an error says why nothing could be read.
pub(super) fn read_api(
    args: &StatusArgs,
    entries: &[(ClaimUid, ClaimEntry)],
) -> Result<ApiView, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting a runtime: {e}"))?;
    let limit = Duration::from_secs(10);
    runtime.block_on(async {
        tokio::time::timeout(limit, api_view(args, entries))
            .await
            .unwrap_or_else(|_| Err(format!("the API server did not answer within {limit:?}")))
    })
}

async fn api_view(
    args: &StatusArgs,
    entries: &[(ClaimUid, ClaimEntry)],
) -> Result<ApiView, String> {
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    use kube::api::{Api, ListParams};

    let client = (args.kube)
        .client(Duration::from_secs(5))
        .await
        .map_err(|e| format!("{e:#}"))?;
    let lookups = entries.iter().map(|(uid, entry)| {
        let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &entry.namespace);
        async move {
            let claim = api
                .get_opt(&entry.name)
                .await
                .map_err(|e| format!("reading claim {}/{}: {e}", entry.namespace, entry.name))?;
            // A claim of that name with another UID is not the one prepared.
            let pods = claim
                .filter(|c| c.metadata.uid.as_deref() == Some(uid.as_str()))
                .and_then(|c| c.status?.reserved_for)
                .unwrap_or_default()
                .into_iter()
                .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
                .map(|r| format!("{}/{}", entry.namespace, r.name))
                .collect::<Vec<_>>();
            Ok::<_, String>((uid.as_str().to_owned(), pods))
        }
    });
    let pods = futures::future::try_join_all(lookups)
        .await?
        .into_iter()
        .collect();
    let slices: Api<ResourceSlice> = Api::all(client);
    let key = format!(
        "{}/{}",
        args.driver.driver_name,
        tessera_controller::model::taints::UNHEALTHY
    );
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.driver={}", args.driver.driver_name)))
        .await
        .map_err(|e| format!("listing ResourceSlices of {}: {e}", args.driver.driver_name))?;
    let mut unhealthy = BTreeMap::new();
    for device in list
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
    {
        let uuid = device
            .attributes
            .as_ref()
            .and_then(|a| a.get(tessera_api::names::attr::UUID))
            .and_then(|v| v.string.clone());
        let taint = device.taints.iter().flatten().find(|t| t.key == key);
        if let (Some(uuid), Some(taint)) = (uuid, taint) {
            unhealthy.insert(uuid, taint.value.clone().unwrap_or_default());
        }
    }
    Ok(ApiView { pods, unhealthy })
}
