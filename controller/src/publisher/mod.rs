//! The publisher: keeps this node's ResourceSlices on the API server equal
//! to what [`crate::model`] computes. A thin reconcile loop:
//!
//! 1. Know what the server serves ([`detect`]); until that is known nothing
//!    is written.
//! 2. Read the world: the Node (slices are owned by it, so they go when
//!    the node object goes; its UID is read once and cached, and read again
//!    before any write, in case the Node was recreated), this driver's
//!    slices of this node (a list with field selectors `spec.nodeName`,
//!    `spec.driver`: a handful of objects), and the devices of this pool
//!    that ResourceClaims hold (those stay published whatever the policy
//!    says: dropping an allocated device lets the scheduler over-commit its
//!    counters, kubernetes#140806). Held devices only matter to a model that
//!    would drop a device now published, so the claims are listed (paged)
//!    only then ([`dropped_devices`]): the model is first built from what
//!    the node prepared, which it knows itself, and built again with the
//!    listed held devices when it lacks a device that is published (on the
//!    server, or in the last model built) or has nothing to compare with
//!    (the first reconcile of a node without slices). A node whose model
//!    drops nothing makes no ResourceClaim request at all, so its API
//!    traffic does not grow with the claims of the cluster.
//! 3. Build the model. If the server already has exactly that content
//!    ([`slices::same_content`](crate::model::slices::same_content), one
//!    generation on every slice): no write at all. This is what makes a
//!    restart with an unchanged inventory cost zero writes.
//! 4. Otherwise write every desired slice with the next pool generation
//!    (highest existing + 1) by server-side apply (field manager `tessera`,
//!    forced), so fields newer than our API types are not dropped, then
//!    delete slices that are no longer desired.
//!
//! A write the server refuses is logged with the server's reason and
//! retried with exponential backoff (capped), never hammered; capabilities
//! are detected again before the retry, in case the server changed under
//! us. Should the server keep normalising our content (so it never compares
//! equal), the publisher notices that nothing changed since its own last
//! write and stops writing instead of looping.
//!
//! In the node process the publisher is told what only the node knows
//! ([`NodeView`], [`NodeState`]): devices its prepared claims hold, MIG
//! instances it created, the GPUs it holds unhealthy, its GPU numbering; and it hands every model it builds back
//! ([`NodeState::model_built`]) before writing it, so the catalog prepare
//! resolves device names through is always the published model.
//!
//! [`Publisher::run`] re-reconciles when the caller sends a new inventory,
//! when someone else changes or deletes our slices (watch), and
//! periodically (re-detecting capabilities, in case the server was
//! upgraded). Nothing tells it when a claim is deallocated, so while the
//! model keeps a device only because a listed claim holds it, it
//! reconciles again every `held_recheck` until the device can go.

pub mod backoff;
pub mod counts;
pub mod detect;
pub mod version;

mod api;
mod held;
mod reconcile;
mod run;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Client;
use tessera_api::inventory::Inventory;

pub use backoff::Backoff;
pub use counts::{ReadCounts, WriteCounters, WriteCounts};
pub use detect::Detected;
pub use held::{Published, dropped_devices, held_in, indices_from_slices, published_devices};
pub use version::{MIN_FULL_MODEL, ServerVersion};

use crate::model::naming::GpuIndices;
use crate::model::{Capabilities, DriverName, Model, ModelError, NodePolicy, Optional, Unhealthy};

/// What a reconcile works from: the GPUs NVML reported and, in the node
/// process, what the node itself had done to them at that moment. Taken
/// together, so an instance the driver created is never seen without
/// knowing it is the driver's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeView {
    pub inventory: Inventory,
    /// UUIDs of the MIG devices the driver created for claims.
    pub owned_mig: BTreeSet<String>,
    /// Devices of this pool that claims prepared on the node hold.
    pub prepared: BTreeSet<String>,
    /// GPUs (by UUID) the node's health monitor holds unhealthy: their
    /// devices are tainted where the server serves device taints.
    pub unhealthy: BTreeMap<String, Unhealthy>,
    /// Devices (by name) the node could not make ahead of binding lately,
    /// since when (seconds since the Unix epoch): tainted.
    pub not_made: BTreeMap<String, i64>,
}

impl From<Inventory> for NodeView {
    fn from(inventory: Inventory) -> Self {
        NodeView {
            inventory,
            owned_mig: BTreeSet::new(),
            prepared: BTreeSet::new(),
            unhealthy: BTreeMap::new(),
            not_made: BTreeMap::new(),
        }
    }
}

/// What the node process keeps about its own pool, which the publisher
/// must not learn back from the API server.
pub trait NodeState: Send + Sync {
    /// The GPU numbering the node recorded (wins over what the slices say).
    fn gpu_indices(&self) -> GpuIndices;
    /// Every model built, before any of it is written.
    fn model_built(&self, inventory: &Inventory, model: &Model);
    /// After each reconcile that left the server with the model: the
    /// pool's generation there.
    fn published(&self, _generation: i64) {}
}

/// Field manager of every write.
pub const FIELD_MANAGER: &str = "tessera";

/// Why a reconcile failed. Every variant is retried by [`Publisher::run`].
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{what}: {}", describe(.source))]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The server refused one of our slices; `message` is its reason.
    #[error("the API server rejected slice {slice}: {message}")]
    Rejected { slice: String, message: String },
    #[error("cannot publish: {0}")]
    NotServed(String),
    #[error("node {0} does not exist (slices are owned by the Node object)")]
    NodeNotFound(String),
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl PublishError {
    pub(crate) fn api(what: impl Into<String>, source: kube::Error) -> Self {
        PublishError::Api {
            what: what.into(),
            source,
        }
    }
}

/// The server's own words for an API error, without kube's debug dump.
fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({} {})", s.message, s.code, s.reason),
        other => other.to_string(),
    }
}

/// Settings of a [`Publisher`].
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    pub node: String,
    pub driver: DriverName,
    pub policy: NodePolicy,
    /// Oldest server that gets the full model ([`MIN_FULL_MODEL`]).
    pub min_full_model: ServerVersion,
    /// Skip detection and use these (tests; operators who know better).
    pub capabilities: Option<Capabilities>,
    /// Compatibility groups and binding conditions, where the server keeps
    /// them and the operator allows.
    pub optional: Optional,
    /// Periodic reconcile, re-detecting capabilities first.
    pub resync: Duration,
    /// Backoff after a failed reconcile.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// How long to collect slice watch events before reconciling.
    pub debounce: Duration,
    /// How often the claims are listed again while the model keeps a
    /// device only because a claim holds it (its release is not watched).
    pub held_recheck: Duration,
}

impl PublisherConfig {
    pub fn new(node: impl Into<String>, driver: DriverName, policy: NodePolicy) -> Self {
        PublisherConfig {
            node: node.into(),
            driver,
            policy,
            min_full_model: MIN_FULL_MODEL,
            capabilities: None,
            optional: Optional::default(),
            resync: Duration::from_secs(600),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(120),
            debounce: Duration::from_millis(300),
            held_recheck: Duration::from_secs(60),
        }
    }
}

/// What one reconcile did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reconciled {
    /// The server already had the desired content (no write).
    pub unchanged: bool,
    /// Pool generation on the server afterwards.
    pub generation: i64,
    pub slices: usize,
    pub devices: usize,
    /// Full model (counters, share devices, dynamic MIG) or static mode.
    pub full_model: bool,
    /// Devices kept because claims hold them.
    pub held_devices: usize,
    /// Writes made by this reconcile.
    pub writes: WriteCounts,
    /// Reads made by this reconcile.
    pub reads: ReadCounts,
    /// Operator notes from the model (odd inventory, policy overrides).
    pub notes: Vec<String>,
}

/// Our last write: its content (generation 0) and the resourceVersions the
/// server gave the slices. Used to stop writing when the server stores our
/// content in a form that never compares equal.
#[derive(Debug, Clone)]
struct LastWrite {
    desired: Vec<ResourceSlice>,
    versions: BTreeMap<String, String>,
}

/// Publishes one node's pool. See the module docs.
pub struct Publisher {
    client: Client,
    config: PublisherConfig,
    counters: Arc<WriteCounters>,
    detected: Option<Detected>,
    indices: GpuIndices,
    node_state: Option<Arc<dyn NodeState>>,
    last_write: Option<LastWrite>,
    warned_normalising: bool,
    /// The devices of the last model built, with their GPUs (None before
    /// the first): what a reconcile must not drop unseen, also if someone
    /// deleted our slices meanwhile.
    published: Option<Published>,
    /// Devices the last model keeps only because listed claims hold them.
    kept_for_claims: BTreeSet<String>,
    /// Devices the last model keeps only because something holds them (a
    /// claim or the node's own prepare).
    kept_for_holders: BTreeSet<String>,
    /// The Node as owner, as last read.
    owner: Option<OwnerReference>,
    /// What the last successful reconcile built its model from (None: a
    /// reconcile is due whatever the node says).
    last_inputs: Option<Inputs>,
    /// What the reconcile under way builds from.
    pending_inputs: Option<Inputs>,
}

/// What a model is built from besides the policy, the capabilities, the
/// numbering and what holds devices: a node change that leaves them equal,
/// and prepares only devices published anyway, needs no reconcile (holding
/// a device changes a model only by keeping a device it would drop).
#[derive(Debug, Clone, PartialEq)]
struct Inputs {
    inventory: Inventory,
    owned_mig: BTreeSet<String>,
    unhealthy: BTreeMap<String, Unhealthy>,
    prepared: BTreeSet<String>,
}

impl From<&NodeView> for Inputs {
    fn from(view: &NodeView) -> Self {
        Inputs {
            inventory: view.inventory.clone(),
            owned_mig: view.owned_mig.clone(),
            unhealthy: view.unhealthy.clone(),
            prepared: view.prepared.clone(),
        }
    }
}

impl Publisher {
    pub fn new(client: Client, config: PublisherConfig) -> Self {
        Publisher {
            client,
            config,
            counters: Arc::new(WriteCounters::default()),
            detected: None,
            indices: GpuIndices::new(),
            node_state: None,
            last_write: None,
            warned_normalising: false,
            published: None,
            kept_for_claims: BTreeSet::new(),
            kept_for_holders: BTreeSet::new(),
            owner: None,
            last_inputs: None,
            pending_inputs: None,
        }
    }

    /// The write counters (shared; they keep counting while [`Publisher::run`] runs).
    pub fn counters(&self) -> Arc<WriteCounters> {
        self.counters.clone()
    }

    /// What the last detection found.
    pub fn detected(&self) -> Option<&Detected> {
        self.detected.as_ref()
    }

    /// The node process's own knowledge, consulted on every reconcile.
    pub fn with_node_state(mut self, state: Arc<dyn NodeState>) -> Self {
        self.node_state = Some(state);
        self
    }

    /// Detects capabilities now (or takes the configured override).
    pub async fn detect(&mut self) -> Result<Detected, PublishError> {
        let detected = match self.config.capabilities {
            Some(capabilities) => Detected {
                capabilities,
                git_version: String::new(),
                version: None,
                partitionable_served: capabilities.partitionable_devices,
                consumable_served: capabilities.consumable_capacity,
                taints_served: capabilities.device_taints,
                groups_served: capabilities.compatibility_groups,
                binding_served: capabilities.binding_conditions,
                version_ok: true,
                reasons: vec!["capabilities set by configuration".into()],
            },
            None => {
                detect::detect(
                    &self.client,
                    &self.config.node,
                    &self.config.driver,
                    self.config.min_full_model,
                    self.config.optional,
                )
                .await?
            }
        };
        self.detected = Some(detected.clone());
        Ok(detected)
    }
}

#[cfg(test)]
mod fake_api;
#[cfg(test)]
mod tests;
