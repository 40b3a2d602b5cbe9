//! One reconcile pass (see the module docs of [`super`]): read the world,
//! build the model, and write only what the server lacks.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, Patch, PatchParams};
use tessera_api::inventory::Inventory;
use tracing::{info, warn};

use super::{
    FIELD_MANAGER, Inputs, LastWrite, NodeView, PublishError, Publisher, ReadCounts, Reconciled,
    WriteCounts, dropped_devices, indices_from_slices, published_devices,
};
use crate::model::naming::GpuIndices;
use crate::model::slices::same_content;
use crate::model::{Capabilities, Model, ModelError, SliceModel};

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
    /// One reconcile pass for what the node saw. See the module docs.
    pub async fn reconcile(&mut self, view: &NodeView) -> Result<Reconciled, PublishError> {
        let reads_before = self.counters.reads();
        let mut result = self.reconcile_inner(view).await;
        let inputs = self.pending_inputs.take();
        self.last_inputs = match &mut result {
            Ok(r) => {
                r.reads = self.counters.reads() - reads_before;
                if let Some(node) = &self.node_state {
                    node.published(r.generation);
                }
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
    pub(super) fn same_inputs(&self, view: &NodeView) -> bool {
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
        .not_made_devices(view.not_made.clone())
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
