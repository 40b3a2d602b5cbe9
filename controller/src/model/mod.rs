//! The ResourceSlice model: inventory + node policy + API capabilities ->
//! the ResourceSlices of one node's pool. Pure: no API server, no clock, no
//! randomness; the same inputs give identical objects.
//!
//! Per physical GPU `n` (see [`counters`] for how they exclude each other,
//! [`plan`] for when each is offered, [`naming`] for names):
//!
//! * `gpu-<n>`: the whole GPU, exclusive.
//! * `gpu-<n>-isolated`, `gpu-<n>-shared`: share devices,
//!   `allowMultipleAllocations`, consumable `memory` (bytes) and `cores`
//!   (percent); attribute `isolationLevel`.
//! * `gpu-<n>-mig-<profile>-<start>`: MIG devices, existing (static) and
//!   every placement of every offered profile (dynamic).
//! * `gpu-<n>-monitor`: the monitoring device, in every model: no counters,
//!   no capacity, for claims with `adminAccess` (monitoring agents on busy
//!   GPUs).
//!
//! Devices of a GPU the node holds unhealthy carry a taint ([`taints`])
//! where the server serves device taints.
//!
//! On servers without partitionable devices or consumable capacity the model
//! degrades to one static mode per GPU from policy (see [`plan::plan_static`]).
//!
//! The publisher is meant to be a thin loop: build the [`Model`], compare
//! its slices with what the server has (ignoring the generation), and only
//! when they differ write them all with the next pool generation
//! ([`Model::with_generation`]) and delete slices that are no longer
//! desired.

pub mod capabilities;
pub mod counters;
pub mod devices;
mod held;
pub mod naming;
pub mod plan;
pub mod policy;
pub mod quantity;
pub mod scheduling;
pub mod slices;
pub mod taints;
pub mod version;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use tessera_api::inventory::{Gpu, Inventory};

pub use capabilities::{Capabilities, Optional, SliceLimits};
pub use devices::{DeviceKind, DeviceRef, IsolationLevel};
pub use naming::{DriverName, GpuIndices};
pub use policy::{NodePolicy, PolicyError};
pub use taints::Unhealthy;

/// Why no slices could be computed. Odd inventory values (an unparsable
/// version, a PCI id of the wrong shape) are not errors: the attribute is
/// omitted and a [`Note`] says so.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("invalid {what} {name:?}")]
    InvalidName { what: &'static str, name: String },
    #[error("GPU {0} appears twice in the inventory")]
    DuplicateGpu(String),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The computed pool would violate an API limit or invariant.
    #[error("slice limits: {0}")]
    Limit(String),
}

/// Something the operator should know (published as an Event later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// UUID of the GPU concerned, if any.
    pub gpu: Option<String>,
    pub message: String,
}

impl Note {
    pub fn gpu(gpu: &Gpu, message: impl Into<String>) -> Self {
        Note {
            gpu: Some(gpu.uuid.clone()),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Note {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.gpu {
            Some(gpu) => write!(f, "{gpu}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// The computed pool of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// The slices, in name order `<node>-<driver>-0..`.
    pub slices: Vec<ResourceSlice>,
    /// Every published device and what it stands for.
    pub devices: BTreeMap<String, DeviceRef>,
    /// The stable GPU numbering used; persist it and pass it back as
    /// [`SliceModel::previous_indices`].
    pub gpu_indices: GpuIndices,
    /// Whether the full model (counters, share devices, dynamic MIG) was
    /// published, as opposed to the static per-GPU mode.
    pub full: bool,
    /// UUIDs of the GPUs whose MIG mode the driver switches at prepare
    /// (MIG on for a MIG device, off for a whole GPU or a share; off again
    /// when the GPU is idle). See [`plan`].
    pub mig_managed: BTreeSet<String>,
    pub notes: Vec<Note>,
}

impl Model {
    /// The same slices with pool generation `generation`.
    pub fn with_generation(mut self, generation: i64) -> Self {
        for slice in &mut self.slices {
            slice.spec.pool.generation = generation;
        }
        self
    }
}

/// Builder for a node's [`Model`].
#[derive(Debug, Clone)]
pub struct SliceModel<'a> {
    inventory: &'a Inventory,
    policy: &'a NodePolicy,
    capabilities: Capabilities,
    node: String,
    driver: DriverName,
    generation: i64,
    previous_indices: GpuIndices,
    owned_mig: BTreeSet<String>,
    held: BTreeSet<String>,
    unhealthy: BTreeMap<String, Unhealthy>,
    not_made: BTreeMap<String, i64>,
    owner: Option<OwnerReference>,
}

impl<'a> SliceModel<'a> {
    pub fn new(
        inventory: &'a Inventory,
        policy: &'a NodePolicy,
        capabilities: Capabilities,
        node: &str,
    ) -> Self {
        SliceModel {
            inventory,
            policy,
            capabilities,
            node: node.to_string(),
            driver: DriverName::default(),
            generation: 0,
            previous_indices: GpuIndices::new(),
            owned_mig: BTreeSet::new(),
            held: BTreeSet::new(),
            unhealthy: BTreeMap::new(),
            not_made: BTreeMap::new(),
            owner: None,
        }
    }

    /// Driver name (default `gpu.tessera.dev`).
    pub fn driver(mut self, driver: DriverName) -> Self {
        self.driver = driver;
        self
    }

    /// Pool generation written into every slice (default 0).
    pub fn generation(mut self, generation: i64) -> Self {
        self.generation = generation;
        self
    }

    /// GPU numbering from an earlier run, so numbers survive a GPU vanishing.
    pub fn previous_indices(mut self, indices: GpuIndices) -> Self {
        self.previous_indices = indices;
        self
    }

    /// MIG UUIDs of instances Tessera created for claims (dynamic MIG).
    pub fn owned_mig_instances(mut self, uuids: impl IntoIterator<Item = String>) -> Self {
        self.owned_mig = uuids.into_iter().collect();
        self
    }

    /// Names of devices currently allocated to claims (and prepared by the
    /// node): kept published when the policy, the inventory or the server's
    /// capabilities change, and nothing that could double-book their GPU is
    /// published beside them (see [`plan`], "Held devices"). A GPU that left
    /// the inventory keeps its number while a claim holds one of its devices.
    pub fn held_devices(mut self, names: impl IntoIterator<Item = String>) -> Self {
        self.held = names.into_iter().collect();
        self
    }

    /// Devices (by name) the node could not make ahead of binding, since
    /// when (seconds since the Unix epoch): tainted `NoSchedule` where the
    /// server serves device taints.
    pub fn not_made_devices(mut self, devices: BTreeMap<String, i64>) -> Self {
        self.not_made = devices;
        self
    }

    /// GPUs (by UUID) the node holds unhealthy: their devices are tainted
    /// where the server serves device taints (see [`taints`]).
    pub fn unhealthy_gpus(mut self, gpus: BTreeMap<String, Unhealthy>) -> Self {
        self.unhealthy = gpus;
        self
    }

    /// Owner of every slice (the Node object), set by the publisher.
    pub fn owner(mut self, owner: OwnerReference) -> Self {
        self.owner = Some(owner);
        self
    }

    pub fn build(self) -> Result<Model, ModelError> {
        self.validate()?;
        let reserved = self.reserved_numbers();
        let reserved_numbers: BTreeSet<u32> = reserved.values().copied().collect();
        let mut indices = naming::assign_gpu_indices_reserving(
            self.inventory,
            &self.previous_indices,
            &reserved_numbers,
        )?;
        let full = self.capabilities.full_model();

        let mut notes = Vec::new();
        let numbers: BTreeSet<u32> = indices.values().copied().collect();
        held::note_vanished(&self.held, &numbers, &self.previous_indices, &mut notes);
        let pool = self.plan_gpus(&indices, full, &mut notes)?;

        let identity = slices::PoolIdentity {
            node: &self.node,
            driver: &self.driver,
            generation: self.generation,
            owner: self.owner.as_ref(),
        };
        // Reserved numbers are part of the numbering handed back, so they
        // stay reserved on the next run.
        for (uuid, n) in reserved {
            indices.entry(uuid).or_insert(n);
        }
        let slices = slices::assemble(&identity, &self.capabilities.limits, pool.outputs);
        slices::check_pool(&slices, &self.capabilities.limits)?;
        Ok(Model {
            slices,
            devices: pool.devices,
            gpu_indices: indices,
            full,
            mig_managed: pool.mig_managed,
            notes,
        })
    }

    fn validate(&self) -> Result<(), ModelError> {
        if !naming::is_dns_subdomain(&self.node) {
            return Err(ModelError::InvalidName {
                what: "node name",
                name: self.node.clone(),
            });
        }
        Ok(self.policy.validate()?)
    }

    /// The numbers of vanished GPUs to keep: a vanished GPU's number stays
    /// reserved while claims hold its devices, so no other card is
    /// published under their names.
    fn reserved_numbers(&self) -> GpuIndices {
        let present: BTreeSet<&str> = self
            .inventory
            .gpus
            .iter()
            .map(|g| g.uuid.as_str())
            .collect();
        let held_numbers: BTreeSet<u32> = self
            .held
            .iter()
            .filter_map(|h| naming::gpu_index_of(h))
            .collect();
        let known_present: BTreeSet<u32> = self
            .previous_indices
            .iter()
            .filter(|(uuid, _)| present.contains(uuid.as_str()))
            .map(|(_, n)| *n)
            .collect();
        self.previous_indices
            .iter()
            .filter(|(uuid, n)| {
                !present.contains(uuid.as_str())
                    && held_numbers.contains(n)
                    && !known_present.contains(n)
            })
            .map(|(uuid, n)| (uuid.clone(), *n))
            .collect()
    }

    /// Every GPU's devices, in GPU number order.
    fn plan_gpus(
        &self,
        indices: &GpuIndices,
        full: bool,
        notes: &mut Vec<Note>,
    ) -> Result<PoolPlan, ModelError> {
        let mut gpus: Vec<(&Gpu, u32)> = self
            .inventory
            .gpus
            .iter()
            .map(|g| (g, indices[&g.uuid]))
            .collect();
        gpus.sort_by_key(|(_, n)| *n);

        let mut pool = PoolPlan::default();
        for (gpu, n) in gpus {
            let output = self.plan_gpu(gpu, n, full, notes);
            if output.mig_managed {
                pool.mig_managed.insert(gpu.uuid.clone());
            }
            for planned in &output.devices {
                if pool
                    .devices
                    .insert(planned.device.name.clone(), planned.reference.clone())
                    .is_some()
                {
                    return Err(ModelError::Limit(format!(
                        "device name {} generated twice",
                        planned.device.name
                    )));
                }
            }
            pool.outputs.push(output);
        }
        Ok(pool)
    }

    /// One GPU's devices in the model the server can take, its monitoring
    /// device, and their taints if the node holds it unhealthy.
    fn plan_gpu(&self, gpu: &Gpu, n: u32, full: bool, notes: &mut Vec<Note>) -> plan::GpuOutput {
        let input = plan::GpuInput {
            inventory: self.inventory,
            gpu,
            index: n,
            policy: self.policy.for_gpu(gpu, n),
            owned_mig: &self.owned_mig,
            held: &self.held,
        };
        let mut output = if full {
            plan::plan_full(&input, notes)
        } else {
            plan::plan_static(&input, &self.capabilities, notes)
        };
        output.devices.push(plan::monitor(&input));
        self.taint_unhealthy(gpu, &mut output);
        self.taint_not_made(&mut output);
        if self.capabilities.compatibility_groups {
            scheduling::label(&mut output);
        }
        if self.capabilities.binding_conditions {
            scheduling::bind_when_made(&mut output);
        }
        output
    }

    /// Devices the node could not make are not allocated again a while.
    fn taint_not_made(&self, output: &mut plan::GpuOutput) {
        if !self.capabilities.device_taints || self.not_made.is_empty() {
            return;
        }
        for planned in &mut output.devices {
            if let Some(since) = self.not_made.get(&planned.device.name) {
                taints::apply(&mut planned.device, taints::not_made(&self.driver, *since));
            }
        }
    }

    /// Where the server serves device taints, every device of a GPU the
    /// node holds unhealthy gets one: NoSchedule, except the monitoring
    /// device (effect None: an agent may still watch the sick GPU).
    fn taint_unhealthy(&self, gpu: &Gpu, output: &mut plan::GpuOutput) {
        if !self.capabilities.device_taints {
            return;
        }
        let Some(unhealthy) = self.unhealthy.get(&gpu.uuid) else {
            return;
        };
        for planned in &mut output.devices {
            let effect = if matches!(planned.reference.kind, DeviceKind::Monitor) {
                taints::EFFECT_NONE
            } else {
                taints::NO_SCHEDULE
            };
            taints::apply(
                &mut planned.device,
                taints::taint(&self.driver, unhealthy, effect),
            );
        }
    }
}

/// The planned GPUs of a pool, with every device and what it stands for.
#[derive(Default)]
struct PoolPlan {
    outputs: Vec<plan::GpuOutput>,
    devices: BTreeMap<String, DeviceRef>,
    mig_managed: BTreeSet<String>,
}

/// The slices for one node with default options (generation 0, no previous
/// numbering, no owned or held devices).
pub fn desired_slices(
    inventory: &Inventory,
    policy: &NodePolicy,
    capabilities: Capabilities,
    node: &str,
    driver: &DriverName,
) -> Result<Vec<ResourceSlice>, ModelError> {
    SliceModel::new(inventory, policy, capabilities, node)
        .driver(driver.clone())
        .build()
        .map(|m| m.slices)
}
