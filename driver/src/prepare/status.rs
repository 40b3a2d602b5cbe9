//! Writing `status.devices[]` of prepared claims, and Node Events.
//!
//! After a successful prepare the claim's status gets one entry per device
//! of ours (driver, pool, device, shareID, `data` = [`DeviceData`]) by
//! server-side apply on the status subresource with the driver name as field
//! manager; unprepare applies an empty list, which removes exactly the
//! entries this manager owns. The apply carries the claim's UID, so a claim
//! deleted and re-created under the same name is never written to.
//!
//! Writing status is best effort: it runs in the background with retries
//! and never fails or delays prepare (the container does not need it). A
//! newer write for the same claim supersedes older ones still retrying.
//!
//! [`DeviceData`]: super::state::DeviceData

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tracing::{debug, info, warn};

use super::state::DeviceStatus;

/// How often and how long a status write is retried.
const ATTEMPTS: u32 = 8;
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Background writer of our `status.devices` entries.
pub struct StatusWriter {
    client: Client,
    driver: String,
    latest: Mutex<HashMap<String, u64>>,
    next: std::sync::atomic::AtomicU64,
}

impl StatusWriter {
    pub fn new(client: Client, driver: impl Into<String>) -> Arc<Self> {
        Arc::new(StatusWriter {
            client,
            driver: driver.into(),
            latest: Mutex::new(HashMap::new()),
            next: std::sync::atomic::AtomicU64::new(1),
        })
    }

    /// Apply `devices` as this driver's entries of the claim's status
    /// (empty: remove ours), in the background.
    pub fn spawn(
        self: &Arc<Self>,
        namespace: &str,
        name: &str,
        uid: &str,
        devices: Vec<DeviceStatus>,
    ) {
        let seq = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(uid.to_owned(), seq);
        let this = self.clone();
        let (namespace, name, uid) = (namespace.to_owned(), name.to_owned(), uid.to_owned());
        tokio::spawn(async move {
            this.write(&namespace, &name, &uid, &devices, seq).await;
        });
    }

    fn current(&self, uid: &str, seq: u64) -> bool {
        self.latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .is_none_or(|s| *s == seq)
    }

    async fn write(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        devices: &[DeviceStatus],
        seq: u64,
    ) {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
        let entries: Vec<serde_json::Value> = devices
            .iter()
            .map(|d| {
                let mut e = json!({
                    "driver": self.driver,
                    "pool": d.pool,
                    "device": d.device,
                    "data": d.data,
                });
                if let Some(share) = &d.share_id {
                    e["shareID"] = json!(share);
                }
                e
            })
            .collect();
        let body = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": { "name": name, "namespace": namespace, "uid": uid },
            "status": { "devices": entries },
        });
        let params = PatchParams::apply(&self.driver).force();
        let mut backoff = FIRST_BACKOFF;
        for attempt in 1..=ATTEMPTS {
            if !self.current(uid, seq) {
                debug!(claim = %format!("{namespace}/{name}"), "status write superseded");
                return;
            }
            match api.patch_status(name, &params, &Patch::Apply(&body)).await {
                Ok(_) => {
                    debug!(claim = %format!("{namespace}/{name}"), devices = devices.len(), "claim status written");
                    self.forget(uid, seq);
                    return;
                }
                // Gone, or re-created (UID precondition): nothing to write.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {
                    info!(claim = %format!("{namespace}/{name}"), "claim gone or re-created; status not written: {}", s.message);
                    self.forget(uid, seq);
                    return;
                }
                Err(e) => {
                    warn!(
                        claim = %format!("{namespace}/{name}"),
                        attempt,
                        "cannot write the claim's status.devices (retrying in {backoff:?}; prepare is not affected): {e}"
                    );
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        warn!(claim = %format!("{namespace}/{name}"), "giving up writing the claim's status.devices after {ATTEMPTS} attempts");
        self.forget(uid, seq);
    }

    fn forget(&self, uid: &str, seq: u64) {
        let mut latest = self.latest.lock().unwrap_or_else(|p| p.into_inner());
        if latest.get(uid) == Some(&seq) {
            latest.remove(uid);
        }
    }
}

/// Events on this node's Node object (things an operator must see).
pub struct NodeEvents {
    client: Client,
    node: String,
    component: String,
}

impl NodeEvents {
    pub fn new(client: Client, node: impl Into<String>, component: impl Into<String>) -> Self {
        NodeEvents {
            client,
            node: node.into(),
            component: component.into(),
        }
    }

    /// Records a Warning event; failures are logged, never fatal.
    pub async fn warning(&self, reason: &str, message: &str) {
        self.record("Warning", reason, message).await
    }

    /// Records a Normal event; failures are logged, never fatal.
    pub async fn normal(&self, reason: &str, message: &str) {
        self.record("Normal", reason, message).await
    }

    async fn record(&self, kind: &str, reason: &str, message: &str) {
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        );
        let event: Result<Event, _> = serde_json::from_value(json!({
            "metadata": { "generateName": format!("{}.", self.node), "namespace": "default" },
            "involvedObject": { "apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": { "component": self.component, "host": self.node },
            "reportingComponent": self.component,
            "reportingInstance": self.node,
            "count": 1,
        }));
        let Ok(mut event) = event else {
            warn!("cannot build the Node event {reason}");
            return;
        };
        event.first_timestamp = Some(now.clone());
        event.last_timestamp = Some(now);
        let api: Api<Event> = Api::namespaced(self.client.clone(), "default");
        if let Err(e) = api.create(&PostParams::default(), &event).await {
            warn!("cannot record Node event {reason} ({message}): {e}");
        }
    }
}
