//! `tessera binder`: the one component in the cluster that watches
//! ResourceClaims for devices with binding conditions (KEP-5007).
//!
//! A claim allocated a device of the driver that carries binding conditions
//! and reserved for a pod is waiting on the node: the scheduler binds the
//! pod only once the node set `DeviceMade`. The binder lists each such claim
//! in its node's ConfigMap ([`names::binding::requests`], one key per claim
//! UID) in the driver's namespace; each node watches only its own. The
//! listing holds as long as the allocation is reserved: a claim deallocated,
//! deleted or no longer reserved leaves it, and a node that made its device
//! ahead and was never asked by the kubelet unprepares it then.
//!
//! Every ConfigMap is applied whole (server-side apply, the binder the only
//! manager of its keys), so a restart converges: after the first list every
//! node's listing is written again, stale keys dropped.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use futures::{FutureExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use serde_json::json;
use tessera_api::names::{self, binding::Request};
use tracing::{info, warn};

/// The field manager of the binder's writes.
pub const FIELD_MANAGER: &str = "tessera-binder";

/// Which driver's claims, and where its nodes read their listings.
#[derive(Debug, Clone)]
pub struct BinderConfig {
    pub driver: String,
    pub namespace: String,
}

/// Why the binder stopped.
#[derive(Debug, thiserror::Error)]
pub enum BinderError {
    #[error("the claim watch ended")]
    WatchEnded,
}

/// A claim that waits on nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Waiting {
    request: Request,
    nodes: BTreeSet<String>,
}

/// What the binder knows: the waiting claims by UID.
#[derive(Default)]
struct Listings {
    waiting: HashMap<String, Waiting>,
}

impl Listings {
    /// Every node some claim waits on.
    fn nodes(&self) -> impl Iterator<Item = String> + '_ {
        self.waiting.values().flat_map(|w| w.nodes.iter().cloned())
    }

    /// Each node's listing.
    fn of(&self, node: &str) -> BTreeMap<String, Request> {
        self.waiting
            .iter()
            .filter(|(_, w)| w.nodes.contains(node))
            .map(|(uid, w)| (uid.clone(), w.request.clone()))
            .collect()
    }

    /// Records `claim` (or its end); the nodes whose listing changed.
    fn update(&mut self, driver: &str, uid: &str, claim: Option<&ResourceClaim>) -> Vec<String> {
        let now = claim.and_then(|c| waiting(driver, c));
        let before = match &now {
            Some(w) => self.waiting.insert(uid.to_owned(), w.clone()),
            None => self.waiting.remove(uid),
        };
        if before == now {
            return Vec::new();
        }
        let nodes = before.iter().chain(now.iter()).flat_map(|w| w.nodes.iter());
        nodes
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }
}

/// The nodes `claim` waits on: pools of the driver's allocated devices that
/// carry binding conditions, while the allocation is reserved for a pod.
fn waiting(driver: &str, claim: &ResourceClaim) -> Option<Waiting> {
    if claim.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = claim.status.as_ref()?;
    if status.reserved_for.as_ref().is_none_or(Vec::is_empty) {
        return None;
    }
    let results = status
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .as_ref()?;
    let nodes: BTreeSet<String> = results
        .iter()
        .filter(|r| r.driver == driver)
        .filter(|r| r.binding_conditions.as_ref().is_some_and(|c| !c.is_empty()))
        .map(|r| r.pool.clone())
        .collect();
    (!nodes.is_empty()).then(|| Waiting {
        request: Request {
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
        },
        nodes,
    })
}

/// Watch events taken together at most (a cluster's busy claim churn must
/// not hold the writes back).
const EVENTS_PER_ROUND: usize = 1024;

/// Node listings written at once.
const WRITES_IN_FLIGHT: usize = 8;

/// Watches the claims and keeps every node's listing; runs until the watch
/// ends. Events that already arrived are taken together, so a burst of
/// allocations costs one write per node, not one per claim.
pub async fn run(client: Client, config: BinderConfig) -> Result<(), BinderError> {
    info!(driver = %config.driver, namespace = %config.namespace, "listing claims that wait on their node");
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let mut binder = Binder {
        maps: Api::namespaced(client, &config.namespace),
        config,
        listings: Listings::default(),
        initial: None,
    };
    let mut events =
        std::pin::pin!(watcher::watcher(claims, watcher::Config::default()).default_backoff());
    while let Some(event) = events.next().await {
        let mut dirty = BTreeSet::new();
        binder.take(event, &mut dirty).await;
        for _ in 1..EVENTS_PER_ROUND {
            let Some(Some(event)) = events.next().now_or_never() else {
                break;
            };
            binder.take(event, &mut dirty).await;
        }
        binder.write(dirty).await;
    }
    Err(BinderError::WatchEnded)
}

struct Binder {
    config: BinderConfig,
    maps: Api<ConfigMap>,
    listings: Listings,
    /// The listings being rebuilt by a (re)list, until it is done.
    initial: Option<Listings>,
}

impl Binder {
    /// Records one watch event; adds the nodes whose listing changed.
    async fn take(
        &mut self,
        event: Result<Event<ResourceClaim>, watcher::Error>,
        dirty: &mut BTreeSet<String>,
    ) {
        let driver = &self.config.driver;
        match event {
            Ok(Event::Init) => self.initial = Some(Listings::default()),
            Ok(Event::InitApply(claim)) => {
                if let Some(next) = &mut self.initial {
                    next.update(driver, &uid_of(&claim), Some(&claim));
                }
            }
            Ok(Event::InitDone) => {
                // Every node listed before or now, or with a ConfigMap:
                // a restart drops what ended while it was away.
                dirty.extend(self.listings.nodes());
                self.listings = self.initial.take().unwrap_or_default();
                dirty.extend(self.listings.nodes());
                dirty.extend(listed_nodes(&self.maps, driver).await);
            }
            Ok(Event::Apply(claim)) => {
                dirty.extend(self.listings.update(driver, &uid_of(&claim), Some(&claim)));
            }
            Ok(Event::Delete(claim)) => {
                dirty.extend(self.listings.update(driver, &uid_of(&claim), None));
            }
            Err(e) => warn!("watching ResourceClaims: {e}"),
        }
    }

    /// Writes the listing of each node in `dirty`.
    async fn write(&self, dirty: BTreeSet<String>) {
        futures::stream::iter(dirty)
            .for_each_concurrent(WRITES_IN_FLIGHT, |node| async move {
                let listed = self.listings.of(&node);
                write(&self.maps, &self.config.driver, &node, &listed).await;
            })
            .await;
    }
}

fn uid_of(claim: &ResourceClaim) -> String {
    claim.metadata.uid.clone().unwrap_or_default()
}

/// The nodes that have a listing of `driver` now.
async fn listed_nodes(maps: &Api<ConfigMap>, driver: &str) -> Vec<String> {
    let selector = format!("{}={driver}", names::binding::DRIVER_LABEL);
    let prefix = names::binding::requests(driver, "");
    match maps.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => list
            .items
            .iter()
            .filter_map(|m| m.metadata.name.as_deref()?.strip_prefix(&prefix))
            .map(str::to_owned)
            .collect(),
        Err(e) => {
            warn!("listing the binding ConfigMaps: {e}");
            Vec::new()
        }
    }
}

/// Applies `node`'s listing whole; a failure is logged (the next change or
/// the next list writes it again).
async fn write(
    maps: &Api<ConfigMap>,
    driver: &str,
    node: &str,
    listed: &BTreeMap<String, Request>,
) {
    let name = names::binding::requests(driver, node);
    let data: BTreeMap<&String, String> = listed
        .iter()
        .filter_map(|(uid, r)| Some((uid, serde_json::to_string(r).ok()?)))
        .collect();
    let body = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "labels": { names::binding::DRIVER_LABEL: driver },
        },
        "data": data,
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match maps.patch(&name, &params, &Patch::Apply(&body)).await {
        Ok(_) => info!(node, claims = listed.len(), "binding requests written"),
        Err(e) => warn!(node, "writing the binding requests: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(uid: &str, reserved: bool, bound: &[(&str, &str, bool)]) -> ResourceClaim {
        let results: Vec<_> = bound
            .iter()
            .map(|(driver, pool, conditions)| {
                let mut r = json!({"request": "r", "driver": driver, "pool": pool, "device": "d"});
                if *conditions {
                    r["bindingConditions"] = json!(["DeviceMade"]);
                    r["bindingFailureConditions"] = json!(["DeviceNotMade"]);
                }
                r
            })
            .collect();
        let reserved_for = if reserved {
            json!([{"resource": "pods", "name": "p", "uid": "pod-uid"}])
        } else {
            json!([])
        };
        serde_json::from_value(json!({
            "metadata": {"name": format!("c-{uid}"), "namespace": "ns", "uid": uid},
            "spec": {},
            "status": {
                "allocation": {"devices": {"results": results}},
                "reservedFor": reserved_for,
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_reserved_allocation_with_binding_conditions_waits_on_its_node() {
        let d = "gpu.tessera.dev";
        let c = claim("u1", true, &[(d, "node-a", true), (d, "node-b", false)]);
        let w = waiting(d, &c).unwrap();
        assert_eq!(w.nodes, BTreeSet::from(["node-a".to_owned()]));
        assert_eq!(w.request.name, "c-u1");
        // Not reserved, another driver's, or without conditions: nothing.
        assert!(waiting(d, &claim("u2", false, &[(d, "node-a", true)])).is_none());
        assert!(waiting(d, &claim("u3", true, &[("other.dev", "node-a", true)])).is_none());
        assert!(waiting(d, &claim("u4", true, &[(d, "node-a", false)])).is_none());
    }

    #[test]
    fn listings_change_only_the_nodes_a_claim_enters_or_leaves() {
        let d = "gpu.tessera.dev";
        let mut l = Listings::default();
        let c = claim("u1", true, &[(d, "node-a", true)]);
        assert_eq!(l.update(d, "u1", Some(&c)), vec!["node-a".to_owned()]);
        assert!(
            l.update(d, "u1", Some(&c)).is_empty(),
            "no change, no write"
        );
        assert_eq!(l.of("node-a").len(), 1);
        let released = claim("u1", false, &[(d, "node-a", true)]);
        assert_eq!(
            l.update(d, "u1", Some(&released)),
            vec!["node-a".to_owned()]
        );
        assert!(l.of("node-a").is_empty());
        l.update(d, "u1", Some(&c));
        assert_eq!(l.update(d, "u1", None), vec!["node-a".to_owned()]);
    }
}
