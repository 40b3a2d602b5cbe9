//! Devices made before the pod binds (binding conditions, KEP-5007).
//!
//! Where the node publishes dynamic MIG devices with binding conditions,
//! the scheduler allocates one and waits, before it binds the pod, for the
//! node to set `DeviceMade` (or `DeviceNotMade`) in the claim's status.
//! The node does not watch claims: `tessera binder`, one component in the
//! cluster, sees each allocation that waits and lists it in this node's
//! ConfigMap ([`names::binding::requests`]), which the node watches by
//! name. For each claim listed the node prepares it ahead
//! ([`Preparer::prepare_ahead`]): `DeviceMade` goes with its status; a
//! failure is written as `DeviceNotMade` with the reason, and the scheduler
//! places the pod again. A claim prepared ahead whose listing goes (the pod
//! deleted while waiting, the binding timed out, the claim deallocated)
//! before the kubelet asked for it is unprepared here. The listing is read
//! again every [`RESYNC`], so a failed step is retried.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use serde_json::json;
use tessera_api::names::{self, binding::Request};
use tracing::{info, warn};

use crate::prepare::Preparer;
use crate::prepare::claims::ClaimRef;
use crate::state::records::DeviceCondition;

/// The field manager of `DeviceNotMade`.
const BINDING_MANAGER: &str = "tessera-binding";

/// How often the listing is acted on again without a change.
pub const RESYNC: Duration = Duration::from_secs(30);

/// Where this node's requests are.
#[derive(Debug, Clone)]
pub struct BindingConfig {
    /// The driver's namespace, where the binder writes.
    pub namespace: String,
    pub driver: String,
    pub node: String,
}

/// Claims listed for this node, by UID.
type Listed = BTreeMap<String, Request>;

/// Follows this node's listing until the runtime ends.
pub fn spawn(client: Client, config: BindingConfig, preparer: Arc<Preparer>) {
    tokio::spawn(async move {
        let name = names::binding::requests(&config.driver, &config.node);
        info!(namespace = %config.namespace, config_map = %name, "making devices ahead of binding on request");
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &config.namespace);
        let selected = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let events = watcher::watcher(api, selected).default_backoff();
        let node = Node {
            client,
            config,
            preparer,
        };
        node.follow(events).await;
    });
}

struct Node {
    client: Client,
    config: BindingConfig,
    preparer: Arc<Preparer>,
}

impl Node {
    async fn follow(
        &self,
        events: impl futures::Stream<Item = Result<Event<ConfigMap>, watcher::Error>>,
    ) {
        let mut events = std::pin::pin!(events);
        let mut listed: Option<Listed> = None;
        let mut initial: Option<Listed> = None;
        loop {
            let event = match tokio::time::timeout(RESYNC, events.next()).await {
                Ok(Some(event)) => event,
                Ok(None) => return,
                Err(_) => {
                    if let Some(listed) = &listed {
                        self.act(listed).await;
                    }
                    continue;
                }
            };
            match event {
                Ok(Event::Init) => initial = Some(Listed::new()),
                Ok(Event::InitApply(map)) => initial = Some(requests(&map)),
                Ok(Event::InitDone) => listed = initial.take().or(Some(Listed::new())),
                Ok(Event::Apply(map)) => listed = Some(requests(&map)),
                Ok(Event::Delete(_)) => listed = Some(Listed::new()),
                Err(e) => {
                    warn!("watching the binding requests: {e}");
                    continue;
                }
            }
            if let Some(listed) = &listed {
                self.act(listed).await;
            }
        }
    }

    /// Makes what is listed; ends what was made ahead and is not listed.
    async fn act(&self, listed: &Listed) {
        let made = listed.iter().map(|(uid, request)| self.make(uid, request));
        futures::future::join_all(made).await;
        let gone: Vec<ClaimRef> = self
            .preparer
            .ahead_claims()
            .into_iter()
            .filter(|c| !listed.contains_key(&c.uid))
            .collect();
        if gone.is_empty() {
            return;
        }
        for (claim, result) in self.preparer.unprepare(gone).await {
            match result {
                Ok(()) => info!(claim = %claim, "made ahead, no longer allocated: unprepared"),
                Err(e) => warn!("ending a claim made ahead: {e}"),
            }
        }
    }

    async fn make(&self, uid: &str, request: &Request) {
        let claim = ClaimRef {
            namespace: request.namespace.clone(),
            name: request.name.clone(),
            uid: uid.to_owned(),
        };
        match self.preparer.prepare_ahead(&claim).await {
            Ok(_) => {}
            Err(e) => {
                warn!("making a device ahead of binding: {e}");
                if let Err(why) = self.not_made(&claim, &e.to_string()).await {
                    warn!(claim = %claim, "writing DeviceNotMade: {why}");
                }
            }
        }
    }

    /// `DeviceNotMade` on each device of ours that the scheduler waits on (and
    /// a taint on it a while, see [`Preparer::not_made`]). Written under a field
    /// manager of its own: the claim status writer's applies leave it.
    async fn not_made(&self, claim: &ClaimRef, why: &str) -> Result<(), kube::Error> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let object = api.get(&claim.name).await?;
        if object.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Ok(());
        }
        let condition = DeviceCondition::not_made(why.to_owned());
        let waited_on: Vec<_> = object
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .into_iter()
            .flatten()
            .filter(|r| {
                r.driver == self.config.driver
                    && r.pool == self.config.node
                    && r.binding_conditions.as_ref().is_some_and(|c| !c.is_empty())
            })
            .collect();
        self.preparer
            .not_made(waited_on.iter().map(|r| r.device.clone()));
        let entries: Vec<_> = waited_on
            .iter()
            .map(|r| {
                json!({
                    "driver": r.driver,
                    "pool": r.pool,
                    "device": r.device,
                    "conditions": [condition],
                })
            })
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        let body = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": { "name": claim.name, "namespace": claim.namespace, "uid": claim.uid },
            "status": { "devices": entries },
        });
        let params = PatchParams::apply(BINDING_MANAGER).force();
        api.patch_status(&claim.name, &params, &Patch::Apply(&body))
            .await
            .map(|_| ())
    }
}

/// The requests of the listing; entries that do not decode are logged and
/// left out.
fn requests(map: &ConfigMap) -> Listed {
    let mut listed = Listed::new();
    for (uid, value) in map.data.iter().flatten() {
        match serde_json::from_str::<Request>(value) {
            Ok(request) => {
                listed.insert(uid.clone(), request);
            }
            Err(e) => warn!(uid = %uid, "a binding request that does not decode: {e}"),
        }
    }
    listed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_read_by_uid_and_bad_ones_left_out() {
        let map: ConfigMap = serde_json::from_value(json!({
            "metadata": { "name": "x" },
            "data": {
                "uid-1": r#"{"namespace":"ns","name":"a"}"#,
                "uid-2": "not json",
            },
        }))
        .unwrap();
        let listed = requests(&map);
        assert_eq!(listed.len(), 1);
        assert_eq!(
            listed["uid-1"],
            Request {
                namespace: "ns".into(),
                name: "a".into()
            }
        );
    }
}
