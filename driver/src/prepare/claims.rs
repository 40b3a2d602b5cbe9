//! Reading a ResourceClaim and picking what this driver on this node must
//! prepare from its allocation.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceRequestAllocationResult, ResourceClaim,
};
use kube::{Api, Client};
use tessera_api::config::{ConfigSource, Origin};

/// The claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// A per-claim failure: what is wrong, where, and what to do about it.
/// Rendered into the claim's entry of the kubelet's answer, which the
/// kubelet shows in the Pod's events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimError {
    pub claim: String,
    pub field: Option<String>,
    pub problem: String,
    pub fix: Option<String>,
    /// `problem` already names the claim (config errors).
    named: bool,
}

impl ClaimError {
    pub fn new(claim: &ClaimRef, problem: impl Into<String>) -> Self {
        ClaimError {
            claim: claim.to_string(),
            field: None,
            problem: problem.into(),
            fix: None,
            named: false,
        }
    }

    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    pub fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }

    /// A message that already names the claim (config errors).
    pub fn preformatted(claim: &ClaimRef, message: String) -> Self {
        ClaimError {
            claim: claim.to_string(),
            field: None,
            problem: message,
            fix: None,
            named: true,
        }
    }
}

impl fmt::Display for ClaimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.named {
            f.write_str(&self.problem)?;
        } else {
            write!(f, "claim {}: ", self.claim)?;
            if let Some(field) = &self.field {
                write!(f, "{field}: ")?;
            }
            f.write_str(&self.problem)?;
        }
        if let Some(fix) = &self.fix {
            write!(f, "; fix: {fix}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ClaimError {}

/// Why a claim could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchError {
    /// The API server answered 404.
    NotFound,
    /// Anything else: unreachable server, timeout, forbidden, ...
    Failed(String),
}

/// Future returned by [`ClaimSource::get`].
pub type FetchFuture<'a> =
    Pin<Box<dyn Future<Output = Result<ResourceClaim, FetchError>> + Send + 'a>>;

/// Where claims come from (the API server; a map in unit tests).
pub trait ClaimSource: Send + Sync {
    fn get<'a>(&'a self, namespace: &'a str, name: &'a str) -> FetchFuture<'a>;
}

/// Claims from the API server, each read bounded by a timeout so an
/// unreachable server fails the claim instead of hanging the kubelet.
pub struct ApiClaims {
    client: Client,
    timeout: Duration,
}

impl ApiClaims {
    pub fn new(client: Client, timeout: Duration) -> Self {
        ApiClaims { client, timeout }
    }
}

impl ClaimSource for ApiClaims {
    fn get<'a>(&'a self, namespace: &'a str, name: &'a str) -> FetchFuture<'a> {
        Box::pin(async move {
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
            match tokio::time::timeout(self.timeout, api.get(name)).await {
                Err(_) => Err(FetchError::Failed(format!(
                    "the API server did not answer within {:?}",
                    self.timeout
                ))),
                Ok(Ok(claim)) => Ok(claim),
                Ok(Err(kube::Error::Api(s))) if s.code == 404 => Err(FetchError::NotFound),
                Ok(Err(kube::Error::Api(s))) => Err(FetchError::Failed(format!(
                    "the API server refused: {} ({} {})",
                    s.message, s.code, s.reason
                ))),
                Ok(Err(e)) => Err(FetchError::Failed(format!(
                    "cannot reach the API server: {e}"
                ))),
            }
        })
    }
}

/// One allocation result this driver must prepare.
#[derive(Debug, Clone, PartialEq)]
pub struct Selected {
    /// Index in `status.allocation.devices.results`.
    pub index: usize,
    pub request: String,
    pub pool: String,
    pub device: String,
    pub share_id: Option<String>,
    /// `consumedCapacity`, as quantity strings.
    pub consumed: BTreeMap<String, String>,
    /// The result's `adminAccess` (monitoring devices require it).
    pub admin_access: bool,
}

/// What this driver on this node has to do for a claim.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    pub devices: Vec<Selected>,
    pub configs: Vec<ConfigSource>,
}

/// Checks the claim against the kubelet's request and picks the results for
/// `driver` in `pool` (this node's pool) and the opaque configs for
/// `driver`: the same claim -> allocated -> our results, all on this node
/// -> our configs.
pub fn select(
    claim_ref: &ClaimRef,
    claim: &ResourceClaim,
    driver: &str,
    pool: &str,
) -> Result<Allocation, ClaimError> {
    same_claim(claim_ref, claim)?;
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Err(ClaimError::new(claim_ref, "the claim is not allocated")
            .field("status.allocation")
            .fix("wait for the scheduler to allocate it (the kubelet retries)"));
    };
    let results = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    let ours = ours(claim_ref, results, driver)?;
    let devices = (here(claim_ref, ours, driver, pool)?.into_iter())
        .map(|(index, result)| selected(index, result))
        .collect();
    let configs = configs(claim_ref, allocation, driver)?;
    Ok(Allocation { devices, configs })
}

/// The API server's claim is the one the kubelet asked for, not one
/// deleted and created again under the same name.
fn same_claim(claim_ref: &ClaimRef, claim: &ResourceClaim) -> Result<(), ClaimError> {
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if uid == claim_ref.uid {
        return Ok(());
    }
    Err(ClaimError::new(
        claim_ref,
        format!(
            "the API server's claim {}/{} has uid {uid:?}, not the uid the kubelet asked for: \
             the claim was deleted and created again",
            claim_ref.namespace, claim_ref.name
        ),
    )
    .field("metadata.uid")
    .fix("delete the Pod so the kubelet picks up the new claim"))
}

/// The results of `driver`, with their index; there is at least one.
fn ours<'a>(
    claim_ref: &ClaimRef,
    results: &'a [DeviceRequestAllocationResult],
    driver: &str,
) -> Result<Vec<(usize, &'a DeviceRequestAllocationResult)>, ClaimError> {
    let ours: Vec<_> = (results.iter().enumerate())
        .filter(|(_, r)| r.driver == driver)
        .collect();
    if !ours.is_empty() {
        return Ok(ours);
    }
    let drivers: Vec<&str> = results.iter().map(|r| r.driver.as_str()).collect();
    Err(ClaimError::new(
        claim_ref,
        format!(
            "no device of driver {driver} is allocated to this claim (allocated drivers: {})",
            if drivers.is_empty() {
                "none".to_owned()
            } else {
                drivers.join(", ")
            }
        ),
    )
    .field("status.allocation.devices.results")
    .fix("this is a kubelet/driver mismatch: check which driver the claim's DeviceClass selects"))
}

/// Our results, which must all be in this node's `pool`.
fn here<'a>(
    claim_ref: &ClaimRef,
    ours: Vec<(usize, &'a DeviceRequestAllocationResult)>,
    driver: &str,
    pool: &str,
) -> Result<Vec<(usize, &'a DeviceRequestAllocationResult)>, ClaimError> {
    let (here, other): (Vec<_>, Vec<_>) = ours.into_iter().partition(|(_, r)| r.pool == pool);
    if here.is_empty() {
        let pools: Vec<&str> = other.iter().map(|(_, r)| r.pool.as_str()).collect();
        return Err(ClaimError::new(
            claim_ref,
            format!(
                "the claim's {driver} devices are in pool(s) {} , not in this node's pool {pool}: \
                 it was allocated for another node",
                pools.join(", ")
            ),
        )
        .field("status.allocation.devices.results[].pool")
        .fix("schedule the Pod on the node its claim was allocated for, or deallocate the claim"));
    }
    if !other.is_empty() {
        let other: Vec<String> = (other.iter())
            .map(|(_, r)| format!("{}/{}", r.pool, r.device))
            .collect();
        return Err(ClaimError::new(
            claim_ref,
            format!(
                "some of the claim's {driver} devices are on other nodes ({}): a claim's devices \
                 must all be on the node that prepares it",
                other.join(", ")
            ),
        )
        .field("status.allocation.devices.results[].pool")
        .fix("deallocate the claim and let the scheduler allocate it again"));
    }
    Ok(here)
}

/// One result, as prepare works with it.
fn selected(index: usize, result: &DeviceRequestAllocationResult) -> Selected {
    Selected {
        index,
        request: result.request.clone(),
        pool: result.pool.clone(),
        device: result.device.clone(),
        share_id: result.share_id.clone(),
        consumed: (result.consumed_capacity.iter().flatten())
            .map(|(k, q)| (k.clone(), q.0.clone()))
            .collect(),
        admin_access: result.admin_access == Some(true),
    }
}

/// The opaque configs for `driver`, each with where it came from.
fn configs(
    claim_ref: &ClaimRef,
    allocation: &AllocationResult,
    driver: &str,
) -> Result<Vec<ConfigSource>, ClaimError> {
    let entries = allocation
        .devices
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut configs = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let Some(opaque) = entry.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        configs.push(ConfigSource {
            origin: origin(claim_ref, index, &entry.source)?,
            requests: entry.requests.clone().unwrap_or_default(),
            index,
            parameters: opaque.parameters.0.clone(),
        });
    }
    Ok(configs)
}

/// Whether config `index` came from the device class or the claim.
fn origin(claim_ref: &ClaimRef, index: usize, source: &str) -> Result<Origin, ClaimError> {
    match source {
        "FromClass" => Ok(Origin::Class),
        "FromClaim" => Ok(Origin::Claim),
        other => Err(ClaimError::new(
            claim_ref,
            format!("config source {other:?} is unknown to this driver"),
        )
        .field(format!("status.allocation.devices.config[{index}].source"))
        .fix("expected FromClass or FromClaim; upgrade the driver if the API added a source")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(value: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(value).unwrap()
    }

    fn r() -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            name: "c".into(),
            uid: "0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e".into(),
        }
    }

    fn allocated(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        claim(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": r().uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
    }

    #[test]
    fn picks_our_results_and_configs() {
        let c = allocated(
            json!([
                {"request": "gpu", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-0"},
                {"request": "nic", "driver": "net.example.com", "pool": "node-a", "device": "eth0"},
                {"request": "share", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-1-shared",
                 "shareID": "7a0b8c0d-0000-4000-8000-000000000001", "consumedCapacity": {"memory": "4Gi", "cores": "10"}}
            ]),
            json!([
                {"source": "FromClass", "opaque": {"driver": "gpu.tessera.dev", "parameters": {"kind": "GpuConfig"}}},
                {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "net.example.com", "parameters": {}}},
                {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.tessera.dev", "parameters": {"a": 1}}}
            ]),
        );
        let a = select(&r(), &c, "gpu.tessera.dev", "node-a").unwrap();
        assert_eq!(a.devices.len(), 2);
        assert_eq!(a.devices[1].index, 2);
        assert_eq!(a.devices[1].consumed["memory"], "4Gi");
        assert_eq!(
            a.devices[1].share_id.as_deref(),
            Some("7a0b8c0d-0000-4000-8000-000000000001")
        );
        assert_eq!(a.configs.len(), 2);
        assert_eq!(a.configs[0].origin, Origin::Class);
        assert_eq!(a.configs[1].origin, Origin::Claim);
        assert_eq!(a.configs[1].index, 2);
        assert_eq!(a.configs[1].requests, vec!["gpu".to_owned()]);
    }

    #[test]
    fn each_mismatch_has_its_own_error() {
        let ok = allocated(
            json!([{"request": "gpu", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-0"}]),
            json!([]),
        );
        let err = select(&r(), &ok, "gpu.tessera.dev", "node-b").unwrap_err();
        assert!(
            err.to_string().contains("allocated for another node"),
            "{err}"
        );
        let err = select(&r(), &ok, "other.example.com", "node-a").unwrap_err();
        assert!(
            err.to_string()
                .contains("no device of driver other.example.com"),
            "{err}"
        );
        let mut wrong_uid = r();
        wrong_uid.uid = "11111111-2222-4333-8444-555555555555".into();
        let err = select(&wrong_uid, &ok, "gpu.tessera.dev", "node-a").unwrap_err();
        assert!(err.to_string().contains("metadata.uid"), "{err}");
        let unallocated = claim(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": r().uid}, "spec": {}
        }));
        let err = select(&r(), &unallocated, "gpu.tessera.dev", "node-a").unwrap_err();
        assert!(err.to_string().contains("not allocated"), "{err}");
        assert!(err.to_string().starts_with("claim ns/c (uid "), "{err}");
    }
}
