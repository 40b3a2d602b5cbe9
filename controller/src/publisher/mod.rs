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
//!    ([`slices::same_content`], one generation on every slice): no write
//!    at all. This is what makes a restart with an unchanged inventory
//!    cost zero writes.
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

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tessera_api::inventory::Inventory;
use tessera_api::names::{attr, device_type};
use tokio::sync::watch;
use tokio::time::Interval;
use tracing::{debug, error, info, warn};

pub use backoff::Backoff;
pub use counts::{ReadCounts, WriteCounters, WriteCounts};
pub use detect::Detected;
pub use version::{MIN_FULL_MODEL, ServerVersion};

use crate::model::naming::GpuIndices;
use crate::model::{
    Capabilities, DriverName, Model, ModelError, NodePolicy, SliceModel, Unhealthy,
    slices::same_content,
};

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
}

impl From<Inventory> for NodeView {
    fn from(inventory: Inventory) -> Self {
        NodeView {
            inventory,
            owned_mig: BTreeSet::new(),
            prepared: BTreeSet::new(),
            unhealthy: BTreeMap::new(),
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

/// Published devices: name -> UUID of the GPU they belong to.
pub type Published = BTreeMap<String, Option<String>>;

/// What a reconcile reads before it builds the model.
struct World {
    capabilities: Capabilities,
    /// The Node as owner of our slices, or why it is not known.
    owner: Result<OwnerReference, PublishError>,
    /// `owner` came from the cache: it is read again before a write.
    owner_cached: bool,
    pool: ServerPool,
    indices: GpuIndices,
}

/// Our slices as the server has them.
struct ServerPool {
    slices: Vec<ResourceSlice>,
    /// The highest pool generation among them.
    current: Option<i64>,
    /// Every slice has that generation.
    uniform: bool,
}

impl ServerPool {
    fn of(slices: Vec<ResourceSlice>) -> Self {
        let current = slices.iter().map(|s| s.spec.pool.generation).max();
        let uniform = slices
            .iter()
            .all(|s| Some(s.spec.pool.generation) == current);
        ServerPool {
            slices,
            current,
            uniform,
        }
    }

    fn generation(&self) -> i64 {
        self.current.unwrap_or(0)
    }

    /// The server has exactly `desired`, at one generation.
    fn holds(&self, desired: &[ResourceSlice]) -> bool {
        self.uniform && same_content(desired, &self.slices)
    }
}

/// What a reconcile reports of the model it built, written or not.
struct Outcome {
    slices: usize,
    devices: usize,
    full_model: bool,
    held_devices: usize,
    notes: Vec<String>,
}

impl Outcome {
    fn of(model: &Model, held: &BTreeSet<String>) -> Self {
        Outcome {
            slices: model.slices.len(),
            devices: model.devices.len(),
            full_model: model.full,
            held_devices: held
                .iter()
                .filter(|d| model.devices.contains_key(*d))
                .count(),
            notes: model.notes.iter().map(ToString::to_string).collect(),
        }
    }

    fn unchanged(self, generation: i64) -> Reconciled {
        Reconciled {
            unchanged: true,
            ..self.written(generation, WriteCounts::default())
        }
    }

    fn written(self, generation: i64, writes: WriteCounts) -> Reconciled {
        Reconciled {
            unchanged: false,
            generation,
            slices: self.slices,
            devices: self.devices,
            full_model: self.full_model,
            held_devices: self.held_devices,
            writes,
            reads: ReadCounts::default(),
            notes: self.notes,
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
                version_ok: true,
                reasons: vec!["capabilities set by configuration".into()],
            },
            None => {
                detect::detect(
                    &self.client,
                    &self.config.node,
                    &self.config.driver,
                    self.config.min_full_model,
                )
                .await?
            }
        };
        self.detected = Some(detected.clone());
        Ok(detected)
    }

    fn slices_api(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }

    fn field_selector(&self) -> String {
        format!(
            "spec.nodeName={},spec.driver={}",
            self.config.node, self.config.driver
        )
    }

    /// This driver's slices of this node, by name.
    async fn existing(&self) -> Result<Vec<ResourceSlice>, PublishError> {
        let lp = ListParams::default().fields(&self.field_selector());
        self.counters.listed_slices();
        let list = self
            .slices_api()
            .list(&lp)
            .await
            .map_err(|e| PublishError::api("listing our ResourceSlices", e))?;
        let mut slices: Vec<ResourceSlice> = list
            .items
            .into_iter()
            // The field selector already did this; be certain anyway.
            .filter(|s| {
                s.spec.driver == self.config.driver.as_str()
                    && s.spec.node_name.as_deref() == Some(self.config.node.as_str())
            })
            .collect();
        slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        Ok(slices)
    }

    /// The Node as owner of our slices, read from the server (and cached).
    async fn fetch_owner(&mut self) -> Result<OwnerReference, PublishError> {
        self.owner = None;
        self.counters.got_node();
        let node = Api::<Node>::all(self.client.clone())
            .get_opt(&self.config.node)
            .await
            .map_err(|e| PublishError::api(format!("reading node {}", self.config.node), e))?
            .ok_or_else(|| PublishError::NodeNotFound(self.config.node.clone()))?;
        let uid = node
            .metadata
            .uid
            .ok_or_else(|| PublishError::NodeNotFound(self.config.node.clone()))?;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.config.node.clone(),
            uid,
            controller: Some(true),
            block_owner_deletion: None,
        };
        self.owner = Some(owner.clone());
        Ok(owner)
    }

    /// Devices of our pool that allocated claims hold, listed (every
    /// claim, paged).
    async fn held_devices(&self) -> Result<BTreeSet<String>, PublishError> {
        let api: Api<ResourceClaim> = Api::all(self.client.clone());
        let mut held = BTreeSet::new();
        let mut lp = ListParams::default().limit(500);
        loop {
            self.counters.listed_claims();
            let page = api
                .list(&lp)
                .await
                .map_err(|e| PublishError::api("listing ResourceClaims", e))?;
            held.extend(held_in(
                &page.items,
                self.config.driver.as_str(),
                &self.config.node,
            ));
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => lp = lp.continue_token(&token),
                None => break,
            }
        }
        Ok(held)
    }

    /// One reconcile pass for what the node saw. See the module docs.
    pub async fn reconcile(&mut self, view: &NodeView) -> Result<Reconciled, PublishError> {
        let reads_before = self.counters.reads();
        let mut result = self.reconcile_inner(view).await;
        let inputs = self.pending_inputs.take();
        self.last_inputs = match &mut result {
            Ok(r) => {
                r.reads = self.counters.reads() - reads_before;
                inputs
            }
            Err(_) => None,
        };
        result
    }

    /// Whether `view` builds what the last successful reconcile built: the
    /// same node, except for prepares of devices that model publishes and
    /// unprepares of devices it would publish anyway. (An unprepared device
    /// kept only for being held may still be allocated: the reconcile lists
    /// the claims to know.)
    fn same_inputs(&self, view: &NodeView) -> bool {
        let (Some(last), Some(published)) = (&self.last_inputs, &self.published) else {
            return false;
        };
        let prepared_published = view
            .prepared
            .difference(&last.prepared)
            .all(|d| published.contains_key(d));
        let unprepared_stay = last
            .prepared
            .difference(&view.prepared)
            .all(|d| !self.kept_for_holders.contains(d));
        last.inventory == view.inventory
            && last.owned_mig == view.owned_mig
            && last.unhealthy == view.unhealthy
            && prepared_published
            && unprepared_stay
    }

    async fn reconcile_inner(&mut self, view: &NodeView) -> Result<Reconciled, PublishError> {
        self.counters.reconciled();
        let world = self.read_world(view).await?;
        let (mut model, held) = self.build_model(view, &world).await?;
        self.remember(&view.inventory, &model);
        // Without its Node nothing is written, but the node's devices are
        // known (prepare resolves names through the model).
        let owner = world.owner?;
        let pool = world.pool;
        let outcome = Outcome::of(&model, &held);
        if self.up_to_date(&model, &pool) {
            return Ok(outcome.unchanged(pool.generation()));
        }
        if world.owner_cached
            && self.owner_recreated(&owner, &mut model).await?
            && pool.holds(&model.slices)
        {
            return Ok(outcome.unchanged(pool.generation()));
        }
        let generation = pool.generation() + 1;
        let writes = self.write(model, &pool.slices, generation).await?;
        Ok(outcome.written(generation, writes))
    }

    /// Reads what the model is built from besides the node's view: the
    /// server's capabilities, the Node as owner, our slices and the GPU
    /// numbering.
    async fn read_world(&mut self, view: &NodeView) -> Result<World, PublishError> {
        let detected = match &self.detected {
            Some(d) => d.clone(),
            None => self.detect().await?,
        };
        let owner_cached = self.owner.is_some();
        let owner = match self.owner.clone() {
            Some(owner) => Ok(owner),
            None => self.fetch_owner().await,
        };
        let existing = self.existing().await?;
        self.pending_inputs = Some(Inputs::from(view));
        // Read back from the slices only for GPUs the node has no number
        // for (a lost state directory); what this process numbered wins.
        let mut indices = indices_from_slices(&existing);
        indices.extend(self.indices.clone());
        if let Some(node) = &self.node_state {
            indices.extend(node.gpu_indices());
        }
        Ok(World {
            capabilities: detected.capabilities,
            owner,
            owner_cached,
            pool: ServerPool::of(existing),
            indices,
        })
    }

    /// The model of `view` that keeps `held` published.
    fn model_for(
        &self,
        view: &NodeView,
        world: &World,
        held: &BTreeSet<String>,
    ) -> Result<Model, ModelError> {
        let mut builder = SliceModel::new(
            &view.inventory,
            &self.config.policy,
            world.capabilities,
            &self.config.node,
        )
        .driver(self.config.driver.clone())
        .held_devices(held.iter().cloned())
        .owned_mig_instances(view.owned_mig.iter().cloned())
        .unhealthy_gpus(view.unhealthy.clone())
        .previous_indices(world.indices.clone());
        if let Ok(owner) = &world.owner {
            builder = builder.owner(owner.clone());
        }
        builder.build()
    }

    /// The model to publish, with the devices it was told are held. What
    /// the node prepared, it knows; the scheduler's allocations it learns
    /// from the claims, read only if the model would drop a device.
    async fn build_model(
        &mut self,
        view: &NodeView,
        world: &World,
    ) -> Result<(Model, BTreeSet<String>), PublishError> {
        let mut held = view.prepared.clone();
        let mut model = self.model_for(view, world, &held)?;
        let mut before = published_devices(&world.pool.slices);
        before.extend(self.published.clone().unwrap_or_default());
        let dropped = dropped_devices(&before, &published_devices(&model.slices));
        self.kept_for_claims.clear();
        // Without any holder (a model that fails counts every device as held).
        let free = self
            .model_for(view, world, &BTreeSet::new())
            .map(|m| m.devices)
            .unwrap_or_default();
        if !dropped.is_empty() || self.published.is_none() && world.pool.slices.is_empty() {
            model = self
                .keep_claimed(view, world, &dropped, &mut held, model)
                .await?;
        }
        self.kept_for_holders = model
            .devices
            .keys()
            .filter(|d| !free.contains_key(*d))
            .cloned()
            .collect();
        Ok((model, held))
    }

    /// Lists the claims and builds the model again keeping what they hold
    /// (added to `held`); remembers the devices kept only for them.
    async fn keep_claimed(
        &mut self,
        view: &NodeView,
        world: &World,
        dropped: &BTreeSet<String>,
        held: &mut BTreeSet<String>,
        without: Model,
    ) -> Result<Model, PublishError> {
        if !dropped.is_empty() {
            info!(
                "the model drops published device(s) {}: listing ResourceClaims to keep those a claim holds",
                dropped.iter().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        let claimed = self.held_devices().await?;
        held.extend(claimed.iter().cloned());
        let model = self.model_for(view, world, held)?;
        self.kept_for_claims = claimed
            .into_iter()
            .filter(|d| model.devices.contains_key(d) && !without.devices.contains_key(d))
            .collect();
        Ok(model)
    }

    /// Keeps what the next reconcile must know of the model built (its
    /// devices, not to be dropped unseen, and its numbering) and hands it
    /// to the node before any of it is written.
    fn remember(&mut self, inventory: &Inventory, model: &Model) {
        self.published = Some(published_devices(&model.slices));
        self.indices = model.gpu_indices.clone();
        if let Some(node) = &self.node_state {
            node.model_built(inventory, model);
        }
    }

    /// Whether nothing needs writing: the server has the model's content,
    /// or keeps our last write in a form that never compares equal (then
    /// writing again would loop).
    fn up_to_date(&mut self, model: &Model, pool: &ServerPool) -> bool {
        if pool.holds(&model.slices) {
            info!(
                "{} slices up to date (generation {})",
                pool.slices.len(),
                pool.generation()
            );
            return true;
        }
        let normalised = self.last_write.as_ref().is_some_and(|last| {
            same_content(&last.desired, &model.slices) && versions(&pool.slices) == last.versions
        });
        if normalised && !self.warned_normalising {
            warn!(
                "the API server stores our slices in a form that differs from what we \
                 wrote (fields dropped or normalised?); not rewriting until the inventory \
                 or the slices change"
            );
            self.warned_normalising = true;
        }
        normalised
    }

    /// About to write: the cached owner may be stale (the Node recreated
    /// under the same name; the garbage collector then deletes slices
    /// owned by the old one, which brings us here). Reads it again; whether
    /// it was recreated, and then the slices have the new owner.
    async fn owner_recreated(
        &mut self,
        cached: &OwnerReference,
        model: &mut Model,
    ) -> Result<bool, PublishError> {
        let fresh = self.fetch_owner().await?;
        if fresh.uid == cached.uid {
            return Ok(false);
        }
        info!(
            "node {} was recreated (uid {} -> {}); slices get the new owner",
            self.config.node, cached.uid, fresh.uid
        );
        for slice in &mut model.slices {
            slice.metadata.owner_references = Some(vec![fresh.clone()]);
        }
        Ok(true)
    }

    /// Writes `model` at `generation`: every slice applied, those no longer
    /// desired deleted. The writes made.
    async fn write(
        &mut self,
        model: Model,
        existing: &[ResourceSlice],
        generation: i64,
    ) -> Result<WriteCounts, PublishError> {
        let desired = model.slices.clone();
        let model = model.with_generation(generation);
        let existing_names: BTreeSet<String> = existing
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect();
        let before = self.counters.snapshot();
        let written = self.apply(&model.slices, &existing_names).await?;
        self.delete_obsolete(&model.slices, &existing_names).await?;
        self.last_write = Some(LastWrite {
            desired,
            versions: written,
        });
        self.warned_normalising = false;
        let writes = self.counters.snapshot() - before;
        info!(
            "published {} slices ({} devices, {}) at generation {generation}: {} created, {} updated, {} deleted",
            model.slices.len(),
            model.devices.len(),
            if model.full {
                "full model"
            } else {
                "static mode"
            },
            writes.creates,
            writes.updates,
            writes.deletes
        );
        Ok(writes)
    }

    /// Applies every slice (server-side apply, forced); the resourceVersion
    /// the server gave each, by name.
    async fn apply(
        &mut self,
        slices: &[ResourceSlice],
        existing_names: &BTreeSet<String>,
    ) -> Result<BTreeMap<String, String>, PublishError> {
        let api = self.slices_api();
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let mut written = BTreeMap::new();
        for slice in slices {
            let name = slice.metadata.name.clone().unwrap_or_default();
            match api.patch(&name, &params, &Patch::Apply(slice)).await {
                Ok(stored) => {
                    if existing_names.contains(&name) {
                        self.counters.updated();
                    } else {
                        self.counters.created();
                    }
                    if let Some(rv) = stored.metadata.resource_version {
                        written.insert(name, rv);
                    }
                }
                Err(kube::Error::Api(s)) if matches!(s.code, 400 | 403 | 409 | 422) => {
                    self.counters.refused();
                    // The server may have changed (downgrade, gates): look again.
                    self.detected = None;
                    self.last_write = None;
                    self.owner = None;
                    return Err(PublishError::Rejected {
                        slice: name,
                        message: format!("{} ({} {})", s.message, s.code, s.reason),
                    });
                }
                Err(e) => {
                    self.last_write = None;
                    self.owner = None;
                    return Err(PublishError::api(format!("applying slice {name}"), e));
                }
            }
        }
        Ok(written)
    }

    /// Deletes our slices that `desired` no longer names.
    async fn delete_obsolete(
        &mut self,
        desired: &[ResourceSlice],
        existing_names: &BTreeSet<String>,
    ) -> Result<(), PublishError> {
        let api = self.slices_api();
        let desired_names: BTreeSet<&str> = desired
            .iter()
            .filter_map(|s| s.metadata.name.as_deref())
            .collect();
        for name in existing_names
            .iter()
            .filter(|n| !desired_names.contains(n.as_str()))
        {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => self.counters.deleted(),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    self.last_write = None;
                    return Err(PublishError::api(
                        format!("deleting obsolete slice {name}"),
                        e,
                    ));
                }
            }
        }
        Ok(())
    }

    /// Reconciles until `shutdown` completes or the inventory sender is
    /// dropped: at once, then on each node change that alters what the
    /// model is built from, on changes to our slices made by anyone
    /// (including deletion), every `held_recheck` while the model keeps a
    /// device only for a claim, and every `resync`. Failures back off
    /// exponentially up to `backoff_max`; nothing here returns an error or
    /// panics on a server that is old, down or refusing.
    pub async fn run(
        mut self,
        mut inventory: watch::Receiver<NodeView>,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown.fuse());
        let cfg = watcher::Config::default().fields(&self.field_selector());
        let mut events = std::pin::pin!(watcher(self.slices_api(), cfg).default_backoff());
        let mut backoff = Backoff::new(self.config.backoff_initial, self.config.backoff_max);
        let mut resync = tokio::time::interval(self.config.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        resync.tick().await; // the first tick is immediate; we reconcile anyway
        let mut notes_logged: Vec<String> = Vec::new();

        loop {
            let current = inventory.borrow_and_update().clone();
            let failed = if self.same_inputs(&current) {
                debug!("the node changed, but not what the model is built from");
                None
            } else {
                self.reconcile_logged(&current, &mut backoff, &mut notes_logged)
                    .await
            };
            let pause = match failed {
                // Back off: only shutdown interrupts.
                Some(delay) => delay,
                None => match self
                    .next_wake(&mut inventory, &mut events, &mut resync, &mut shutdown)
                    .await
                {
                    Wake::Stop => return,
                    Wake::Now => continue,
                    // API events come in bursts: collect them first.
                    Wake::Debounce => self.config.debounce,
                },
            };
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(pause) => {}
            }
            // Slice events that arrived meanwhile: the reconcile reads the
            // slices anyway.
            drain(&mut events);
        }
    }

    /// Waits for a reason to reconcile: the node changed, someone changed
    /// our slices, devices kept for claims are due a look (a claim's
    /// release is not watched), or the periodic resync.
    async fn next_wake<S, E>(
        &mut self,
        inventory: &mut watch::Receiver<NodeView>,
        events: &mut Pin<&mut E>,
        resync: &mut Interval,
        shutdown: &mut Pin<&mut S>,
    ) -> Wake
    where
        S: Future<Output = ()>,
        E: Stream<Item = Result<watcher::Event<ResourceSlice>, watcher::Error>>,
    {
        let recheck = tokio::time::sleep(self.config.held_recheck);
        let mut recheck = std::pin::pin!(recheck);
        let kept_for_claims = !self.kept_for_claims.is_empty();
        loop {
            tokio::select! {
                _ = shutdown.as_mut() => return Wake::Stop,
                changed = inventory.changed() => {
                    if changed.is_err() {
                        info!("inventory source closed; publisher stops");
                        return Wake::Stop;
                    }
                    debug!("inventory changed");
                    return Wake::Now;
                }
                event = events.next() => {
                    if self.slices_changed(event) {
                        return Wake::Debounce;
                    }
                }
                _ = &mut recheck, if kept_for_claims => {
                    debug!("devices kept for claims: are they still held?");
                    self.last_inputs = None;
                    return Wake::Now;
                }
                _ = resync.tick() => {
                    // Re-detect: the server may have been upgraded or
                    // its feature gates changed.
                    self.detected = None;
                    self.last_inputs = None;
                    return Wake::Now;
                }
            }
        }
    }

    /// Whether an event of the slice watch means our slices may differ
    /// from what we wrote (then the next reconcile builds again).
    fn slices_changed(
        &mut self,
        event: Option<Result<watcher::Event<ResourceSlice>, watcher::Error>>,
    ) -> bool {
        match event {
            Some(Ok(event)) if self.slice_event_matters(&event) => {
                self.last_inputs = None;
                true
            }
            Some(Ok(_)) | None => false,
            // The watcher relists after an error; that relist brings us
            // back here.
            Some(Err(e)) => {
                warn!("watching ResourceSlices: {e}");
                false
            }
        }
    }
    /// One reconcile of [`Publisher::run`], logged; the delay before the
    /// next try when it failed.
    async fn reconcile_logged(
        &mut self,
        view: &NodeView,
        backoff: &mut Backoff,
        notes_logged: &mut Vec<String>,
    ) -> Option<Duration> {
        match self.reconcile(view).await {
            Ok(r) => {
                backoff.reset();
                debug!(
                    "reconciled: {} reads ({} claim lists, {} node gets, {} slice lists), {} writes",
                    r.reads.total(),
                    r.reads.claim_lists,
                    r.reads.node_gets,
                    r.reads.slice_lists,
                    r.writes.total()
                );
                if r.notes != *notes_logged {
                    for n in &r.notes {
                        info!("model: {n}");
                    }
                    *notes_logged = r.notes;
                }
                None
            }
            Err(e) => {
                let d = backoff.next_delay();
                match &e {
                    PublishError::Rejected { .. } | PublishError::NotServed(_) => {
                        error!("{e}; retrying in {d:?}")
                    }
                    _ => warn!("{e}; retrying in {d:?}"),
                }
                Some(d)
            }
        }
    }

    /// Whether an event of the slice watch may mean that our slices on the
    /// server differ from the model: not our own writes coming back (the
    /// resourceVersion the server gave our last write), and not each slice
    /// of a (re)list, only its end.
    fn slice_event_matters(&self, event: &watcher::Event<ResourceSlice>) -> bool {
        match event {
            watcher::Event::Init | watcher::Event::InitApply(_) => false,
            watcher::Event::InitDone | watcher::Event::Delete(_) => true,
            watcher::Event::Apply(slice) => {
                let ours = self
                    .last_write
                    .as_ref()
                    .zip(slice.metadata.name.as_ref())
                    .and_then(|(last, name)| last.versions.get(name));
                ours.is_none() || ours != slice.metadata.resource_version.as_ref()
            }
        }
    }
}

/// What ends a wait of [`Publisher::run`].
enum Wake {
    /// Shutdown, or the node's view can no longer change.
    Stop,
    /// Reconcile at once.
    Now,
    /// Reconcile after the debounce: more slice events may follow.
    Debounce,
}

/// Consumes whatever watch events are ready without waiting.
fn drain<S>(events: &mut std::pin::Pin<&mut S>)
where
    S: futures::Stream,
{
    while let Some(Some(_)) = events.next().now_or_never() {}
}

/// resourceVersion of each slice, by name.
fn versions(slices: &[ResourceSlice]) -> BTreeMap<String, String> {
    slices
        .iter()
        .filter_map(|s| {
            Some((
                s.metadata.name.clone()?,
                s.metadata.resource_version.clone()?,
            ))
        })
        .collect()
}

/// Names of the devices of pool `node` of `driver` that `claims` hold.
pub fn held_in(claims: &[ResourceClaim], driver: &str, node: &str) -> BTreeSet<String> {
    claims
        .iter()
        .filter_map(|c| c.status.as_ref()?.allocation.as_ref()?.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == driver && r.pool == node)
        .map(|r| r.device.clone())
        .collect()
}

/// The devices of `slices`, each with the UUID of its GPU.
pub fn published_devices(slices: &[ResourceSlice]) -> Published {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| (d.name.clone(), gpu_of(d)))
        .collect()
}

/// Devices of `before` that `after` lacks, or publishes for another GPU
/// (a vanished GPU's number taken by a new one): for a claim holding one,
/// either would be a device dropped under it.
pub fn dropped_devices(before: &Published, after: &Published) -> BTreeSet<String> {
    before
        .iter()
        .filter(|(name, gpu)| after.get(*name) != Some(*gpu))
        .map(|(name, _)| name.clone())
        .collect()
}

/// The card a published device belongs to: `parentUUID` on share and MIG
/// devices, `uuid` on whole GPUs.
fn gpu_of(device: &k8s_openapi::api::resource::v1::Device) -> Option<String> {
    let attrs = device.attributes.as_ref();
    let get = |key: &str| {
        attrs
            .and_then(|a| a.get(key))
            .and_then(|v| v.string.clone())
    };
    get(attr::PARENT_UUID).or_else(|| {
        (get(attr::TYPE).as_deref() == Some(device_type::GPU))
            .then(|| get(attr::UUID))
            .flatten()
    })
}

/// The GPU numbering the published slices use, read back from device names
/// (`gpu-<n>...`) and the card UUID they carry (`parentUUID` on share and
/// MIG devices, `uuid` on whole GPUs). This keeps a GPU's number across a
/// restart even if another GPU vanished meanwhile.
pub fn indices_from_slices(slices: &[ResourceSlice]) -> GpuIndices {
    let mut indices = GpuIndices::new();
    let mut taken = BTreeSet::new();
    for device in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
        let Some(n) = device
            .name
            .strip_prefix("gpu-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(uuid) = gpu_of(device)
            && !indices.contains_key(&uuid)
            && taken.insert(n)
        {
            indices.insert(uuid, n);
        }
    }
    indices
}

#[cfg(test)]
mod fake_api;
#[cfg(test)]
mod tests;
