//! The simulated machine (GPUs, GPU instances, compute instances, event
//! sets) and the opaque handles NVML hands out for them.
//!
//! A `Machine` is one process's copy: the run-time part (MIG mode, GPU and
//! compute instances, compute mode, the UUID counter) is loaded from and
//! written back to the machine-wide state file by `state::Store` around every
//! call, so every process sees what any process changed.
//!
//! Handles are never pointers to memory: they are tagged integers that only
//! this library decodes (see [`handles`]) and validates against the current
//! state, so a stale or forged handle is answered with INVALID_ARGUMENT
//! instead of touching freed memory. Where instances may go is in
//! [`placements`].

pub mod handles;
pub mod placements;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;

use crate::caps;
use crate::codes::*;
use crate::state::ComputeMode;
use crate::topology::{
    self, Card, CardMig, Instance, MigCapability, MigMode, PciAddress, Profile, Topology,
};
use crate::visibility::Visible;

use self::handles::{DeviceRef, Kind, decode};
use self::placements::{
    compute_instance_sizes, compute_placements, compute_profile_id, compute_profile_slices,
    overlaps,
};

/// The whole machine.
#[derive(Debug)]
pub struct Machine {
    pub driver_version: String,
    pub nvml_version: String,
    pub cuda_version: i32,
    pub init_fault: Option<Ret>,
    pub gpus: Vec<Gpu>,
    /// File the test appends `<uuid> <xid>` lines to.
    pub events_path: Option<PathBuf>,
    pub event_sets: BTreeMap<u32, EventSet>,
    /// Makes every created compute instance's UUID unique (machine-wide: it
    /// is part of the state file).
    pub created: u64,
    /// Where the MIG capability files are kept (`None`: nowhere); part of
    /// the state file.
    pub driver_root: Option<PathBuf>,
    /// The device nodes this process was given (`TESSERA_FAKE_NVML_DEV_ROOT`);
    /// `None`: it sees every GPU and MIG device. Per process, never saved.
    pub visible: Option<Visible>,
}

#[derive(Debug)]
pub struct Gpu {
    pub card: Card,
    pub bus: PciAddress,
    pub minor: u32,
    /// `nvmlDeviceGetComputeMode`.
    pub compute_mode: ComputeMode,
    /// The compute time slice (`nvidia-smi compute-policy --set-timeslice`):
    /// 0 default, 1 short, 2 medium, 3 long.
    pub time_slice: u32,
    /// `None`: the model cannot do MIG.
    pub mig: Option<MigState>,
}

#[derive(Debug)]
pub struct MigState {
    pub cap: MigCapability,
    pub enabled: bool,
    pub pending: bool,
    pub gpu_instances: BTreeMap<u32, GpuInstance>,
}

#[derive(Debug, Clone)]
pub struct GpuInstance {
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    pub compute_instances: BTreeMap<u32, ComputeInstance>,
}

#[derive(Debug, Clone)]
pub struct ComputeInstance {
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*`, which is also the profile's id.
    pub profile_id: u32,
    pub slices: u32,
    pub start: u32,
    pub uuid: String,
}

/// An event set: which GPUs it listens to and how far it has read the events file.
#[derive(Debug, Default)]
pub struct EventSet {
    pub registrations: Vec<(usize, u64)>,
    pub offset: u64,
    pub queue: VecDeque<QueuedEvent>,
}

/// An XID event waiting to be delivered.
#[derive(Debug, Clone, Copy)]
pub struct QueuedEvent {
    pub gpu: usize,
    pub xid: u64,
    /// GPU/compute instance ids, or NVML's "none" value.
    pub gpu_instance: u32,
    pub compute_instance: u32,
}

impl Machine {
    /// The machine a topology describes, before the state file is read.
    pub fn new(topology: Topology, events_path: Option<PathBuf>) -> Result<Machine, String> {
        let cuda_version = topology.cuda_version_number()?;
        let init_fault = topology.faults.init.as_deref().and_then(by_name);
        let cuda_major = cuda_version / 1000;
        let nvml_version = topology
            .nvml_version
            .clone()
            .unwrap_or_else(|| format!("{cuda_major}.{}", topology.driver_version));
        let gpus = topology
            .gpus
            .into_iter()
            .enumerate()
            .map(|(index, card)| Gpu::from_card(index, card))
            .collect::<Result<_, _>>()?;
        Ok(Machine {
            driver_version: topology.driver_version,
            nvml_version,
            cuda_version,
            init_fault,
            gpus,
            events_path,
            event_sets: BTreeMap::new(),
            created: 0,
            driver_root: None,
            visible: None,
        })
    }

    /// Whether this process may see the GPU at (unfiltered) index `gpu`.
    pub fn gpu_visible(&self, gpu: usize) -> bool {
        let Some(g) = self.gpus.get(gpu) else {
            return false;
        };
        self.visible
            .as_ref()
            .is_none_or(|v| v.gpu_minors.contains(&g.minor))
    }

    /// Whether this process may see GPU instance `gi` (and, if given,
    /// compute instance `ci` in it) of a visible GPU: their capability nodes
    /// must all be there.
    pub fn instance_visible(&self, gpu: usize, gi: u32, ci: Option<u32>) -> bool {
        if !self.gpu_visible(gpu) {
            return false;
        }
        let Some(v) = &self.visible else {
            return true;
        };
        let minor = self.gpus[gpu].minor;
        let has = |n: Option<u32>| n.is_some_and(|n| v.cap_minors.contains(&n));
        has(caps::gi_minor(minor, gi)) && ci.is_none_or(|ci| has(caps::ci_minor(minor, gi, ci)))
    }

    /// The GPUs this process sees, in NVML index order: position `i` is
    /// the GPU that index `i` names.
    pub fn visible_gpus(&self) -> Vec<usize> {
        (0..self.gpus.len())
            .filter(|g| self.gpu_visible(*g))
            .collect()
    }

    /// Validates a device handle value against the current state.
    pub fn device(&self, value: usize) -> Result<DeviceRef, Ret> {
        let (gpu, gi, ci) = decode(Kind::Device, value).ok_or(INVALID_ARGUMENT)?;
        if !self.gpu_visible(gpu) {
            return Err(INVALID_ARGUMENT);
        }
        match (gi, ci) {
            (None, None) => Ok(DeviceRef::Gpu(gpu)),
            (Some(gi), Some(ci)) => {
                self.compute_instance(gpu, gi, ci).ok_or(INVALID_ARGUMENT)?;
                Ok(DeviceRef::Mig { gpu, gi, ci })
            }
            _ => Err(INVALID_ARGUMENT),
        }
    }

    /// Like [`Machine::device`], but a lost GPU (or a MIG device on one) answers GPU_IS_LOST.
    pub fn live_device(&self, value: usize) -> Result<DeviceRef, Ret> {
        let d = self.device(value)?;
        if self.gpus[d.gpu()].card.lost {
            return Err(GPU_IS_LOST);
        }
        Ok(d)
    }

    /// A live physical GPU (not a MIG device).
    pub fn live_gpu(&self, value: usize) -> Result<usize, Ret> {
        match self.live_device(value)? {
            DeviceRef::Gpu(g) => Ok(g),
            DeviceRef::Mig { .. } => Err(INVALID_ARGUMENT),
        }
    }

    /// MIG state of a live GPU: NOT_SUPPORTED when the model cannot do MIG.
    pub fn mig(&self, gpu: usize) -> Result<&MigState, Ret> {
        self.gpus[gpu].mig.as_ref().ok_or(NOT_SUPPORTED)
    }

    pub fn mig_mut(&mut self, gpu: usize) -> Result<&mut MigState, Ret> {
        self.gpus[gpu].mig.as_mut().ok_or(NOT_SUPPORTED)
    }

    /// MIG state of a GPU with MIG mode on.
    pub fn mig_enabled(&self, gpu: usize) -> Result<&MigState, Ret> {
        let mig = self.mig(gpu)?;
        if !mig.enabled {
            return Err(NOT_SUPPORTED);
        }
        Ok(mig)
    }

    /// MIG state of a GPU with MIG mode on.
    pub fn mig_enabled_mut(&mut self, gpu: usize) -> Result<&mut MigState, Ret> {
        let mig = self.mig_mut(gpu)?;
        if !mig.enabled {
            return Err(NOT_SUPPORTED);
        }
        Ok(mig)
    }

    /// A compute instance this process may see.
    pub fn compute_instance(&self, gpu: usize, gi: u32, ci: u32) -> Option<&ComputeInstance> {
        let mig = self.gpus.get(gpu)?.mig.as_ref()?;
        if !mig.enabled || !self.instance_visible(gpu, gi, Some(ci)) {
            return None;
        }
        mig.gpu_instances.get(&gi)?.compute_instances.get(&ci)
    }

    /// A GPU instance handle value, validated; the GPU must be live.
    pub fn gpu_instance(&self, value: usize) -> Result<(usize, u32), Ret> {
        let (gpu, gi, ci) = decode(Kind::GpuInstance, value).ok_or(INVALID_ARGUMENT)?;
        let (Some(gi), None) = (gi, ci) else {
            return Err(INVALID_ARGUMENT);
        };
        let g = self.gpus.get(gpu).ok_or(INVALID_ARGUMENT)?;
        let mig = g.mig.as_ref().ok_or(INVALID_ARGUMENT)?;
        if !mig.enabled
            || !mig.gpu_instances.contains_key(&gi)
            || !self.instance_visible(gpu, gi, None)
        {
            return Err(INVALID_ARGUMENT);
        }
        if g.card.lost {
            return Err(GPU_IS_LOST);
        }
        Ok((gpu, gi))
    }

    /// A compute instance handle value, validated; the GPU must be live.
    pub fn compute_instance_handle(&self, value: usize) -> Result<(usize, u32, u32), Ret> {
        let (gpu, gi, ci) = decode(Kind::ComputeInstance, value).ok_or(INVALID_ARGUMENT)?;
        let (Some(gi), Some(ci)) = (gi, ci) else {
            return Err(INVALID_ARGUMENT);
        };
        self.compute_instance(gpu, gi, ci).ok_or(INVALID_ARGUMENT)?;
        if self.gpus[gpu].card.lost {
            return Err(GPU_IS_LOST);
        }
        Ok((gpu, gi, ci))
    }

    /// MIG devices of a GPU this process sees, in NVML index order: by GPU
    /// instance id, then compute instance id.
    pub fn mig_devices(&self, gpu: usize) -> Vec<(u32, u32)> {
        let Some(mig) = self.gpus[gpu].mig.as_ref().filter(|m| m.enabled) else {
            return Vec::new();
        };
        mig.gpu_instances
            .iter()
            .flat_map(|(gi, inst)| inst.compute_instances.keys().map(move |ci| (*gi, *ci)))
            .filter(|(gi, ci)| self.instance_visible(gpu, *gi, Some(*ci)))
            .collect()
    }

    /// Finds a GPU or MIG device this process sees by UUID.
    pub fn by_uuid(&self, uuid: &str) -> Option<DeviceRef> {
        for gpu in self.visible_gpus() {
            let g = &self.gpus[gpu];
            if g.card.uuid.eq_ignore_ascii_case(uuid) {
                return Some(DeviceRef::Gpu(gpu));
            }
            for (gi, ci) in self.mig_devices(gpu) {
                if self
                    .compute_instance(gpu, gi, ci)
                    .is_some_and(|c| c.uuid.eq_ignore_ascii_case(uuid))
                {
                    return Some(DeviceRef::Mig { gpu, gi, ci });
                }
            }
        }
        None
    }

    /// How many more GPU instances of `profile` fit now, and the first free start.
    pub fn gpu_instance_room(&self, gpu: usize, profile: &Profile) -> (u32, Option<u32>) {
        let Some(mig) = self.gpus[gpu].mig.as_ref() else {
            return (0, None);
        };
        if !mig.enabled {
            return (0, None);
        }
        let existing = mig
            .gpu_instances
            .values()
            .filter(|gi| gi.profile_id == profile.id)
            .count() as u32;
        let compute_used: u32 = mig
            .gpu_instances
            .values()
            .filter_map(|gi| mig.cap.profiles.iter().find(|p| p.id == gi.profile_id))
            .map(|p| p.slices)
            .sum();
        let mut taken: Vec<(u32, u32)> = mig
            .gpu_instances
            .values()
            .map(|gi| (gi.start, gi.size))
            .collect();
        let mut free = Vec::new();
        for &start in &profile.placements.starts {
            let range = (start, profile.placements.size);
            if taken.iter().all(|t| !overlaps(*t, range)) {
                free.push(start);
                taken.push(range);
            }
        }
        let by_instances = profile.instances.saturating_sub(existing);
        let by_compute =
            mig.cap.compute_slices.saturating_sub(compute_used) / profile.slices.max(1);
        let room = (free.len() as u32).min(by_instances).min(by_compute);
        (room, free.first().copied().filter(|_| room > 0))
    }

    /// Creates a GPU instance (and no compute instance), like NVML does.
    pub fn create_gpu_instance(
        &mut self,
        gpu: usize,
        profile_id: u32,
        start: Option<u32>,
    ) -> Result<u32, Ret> {
        let mig = self.mig_enabled_mut(gpu)?;
        let profile = mig
            .cap
            .profiles
            .iter()
            .find(|p| p.id == profile_id)
            .cloned()
            .ok_or(INVALID_ARGUMENT)?;
        let memory_slices = mig.cap.memory_slices;
        if let Some(start) = start
            && !profile.placements.starts.contains(&start)
        {
            return Err(INVALID_ARGUMENT);
        }
        let (room, first_free) = self.gpu_instance_room(gpu, &profile);
        if room == 0 {
            return Err(INSUFFICIENT_RESOURCES);
        }
        let start = match start {
            Some(s) => s,
            None => first_free.ok_or(INSUFFICIENT_RESOURCES)?,
        };
        let mig = self.mig_enabled_mut(gpu)?;
        let range = (start, profile.placements.size);
        if mig
            .gpu_instances
            .values()
            .any(|gi| overlaps((gi.start, gi.size), range))
        {
            return Err(INSUFFICIENT_RESOURCES);
        }
        let mut id =
            topology::default_gpu_instance_id(memory_slices, start, profile.placements.size);
        while mig.gpu_instances.contains_key(&id) {
            id += 1;
        }
        mig.gpu_instances.insert(
            id,
            GpuInstance {
                profile_id,
                start,
                size: profile.placements.size,
                compute_instances: BTreeMap::new(),
            },
        );
        Ok(id)
    }

    /// Profile of an existing GPU instance.
    pub fn gpu_instance_profile(&self, gpu: usize, gi: u32) -> Option<(&GpuInstance, &Profile)> {
        let mig = self.gpus.get(gpu)?.mig.as_ref()?;
        let inst = mig.gpu_instances.get(&gi)?;
        let profile = mig.cap.profiles.iter().find(|p| p.id == inst.profile_id)?;
        Some((inst, profile))
    }

    /// Free compute-slice starts for a compute instance of `slices` in a GPU instance.
    pub fn compute_instance_room(&self, gpu: usize, gi: u32, slices: u32) -> Vec<u32> {
        let Some((inst, profile)) = self.gpu_instance_profile(gpu, gi) else {
            return Vec::new();
        };
        let mut taken: Vec<(u32, u32)> = inst
            .compute_instances
            .values()
            .map(|c| (c.start, c.slices))
            .collect();
        let mut free = Vec::new();
        for start in compute_placements(profile.slices, slices) {
            let range = (start, slices);
            if taken.iter().all(|t| !overlaps(*t, range)) {
                free.push(start);
                taken.push(range);
            }
        }
        free
    }

    pub fn create_compute_instance(
        &mut self,
        gpu: usize,
        gi: u32,
        profile_id: u32,
        start: Option<u32>,
    ) -> Result<u32, Ret> {
        let slices = compute_profile_slices(profile_id).ok_or(INVALID_ARGUMENT)?;
        let (_, profile) = self.gpu_instance_profile(gpu, gi).ok_or(INVALID_ARGUMENT)?;
        if !compute_instance_sizes(profile.slices).contains(&slices) {
            return Err(NOT_SUPPORTED);
        }
        if let Some(s) = start
            && !compute_placements(profile.slices, slices).contains(&s)
        {
            return Err(INVALID_ARGUMENT);
        }
        let free = self.compute_instance_room(gpu, gi, slices);
        let start = match start {
            Some(s) if free.contains(&s) => s,
            Some(_) => return Err(INSUFFICIENT_RESOURCES),
            None => *free.first().ok_or(INSUFFICIENT_RESOURCES)?,
        };
        self.created += 1;
        let uuid = mig_uuid(&self.gpus[gpu].card.uuid, gi, self.created);
        let mig = self.mig_enabled_mut(gpu)?;
        let inst = mig.gpu_instances.get_mut(&gi).ok_or(INVALID_ARGUMENT)?;
        let id = (0..)
            .find(|id| !inst.compute_instances.contains_key(id))
            .unwrap_or(0);
        inst.compute_instances.insert(
            id,
            ComputeInstance {
                profile_id,
                slices,
                start,
                uuid,
            },
        );
        Ok(id)
    }

    /// Registers a new event set under the lowest free id (ids fit the
    /// handle's 16-bit field); `None` when all are taken.
    pub fn new_event_set(&mut self, offset: u64) -> Option<u32> {
        let id = (1..=0xFFFF).find(|id| !self.event_sets.contains_key(id))?;
        self.event_sets.insert(
            id,
            EventSet {
                offset,
                ..EventSet::default()
            },
        );
        Some(id)
    }
}

impl Gpu {
    /// Card `index` of the topology, in the MIG layout the topology gives it.
    fn from_card(index: usize, card: Card) -> Result<Gpu, String> {
        let bus = PciAddress::parse(&card.pci_bus_id).ok_or("bad pciBusId")?;
        let mig = card
            .model
            .mig
            .clone()
            .map(|cap| MigState::from_topology(cap, card.mig.as_ref()));
        Ok(Gpu {
            minor: card.minor.unwrap_or(index as u32),
            compute_mode: ComputeMode::Default,
            time_slice: 0,
            bus,
            card,
            mig,
        })
    }
}

impl MigState {
    /// A MIG-capable GPU's mode and instances as its card's `mig` entry
    /// describes them (none given: MIG disabled, no instances).
    fn from_topology(cap: MigCapability, state: Option<&CardMig>) -> MigState {
        let mut gpu_instances = BTreeMap::new();
        for inst in state.iter().flat_map(|s| s.instances.iter()) {
            // Validated by Topology::parse: the profile exists.
            let Some(p) = cap.profiles.iter().find(|p| p.name == inst.profile) else {
                continue;
            };
            let id = inst.gpu_instance_id.unwrap_or_else(|| {
                topology::default_gpu_instance_id(cap.memory_slices, inst.start, p.placements.size)
            });
            gpu_instances.insert(id, GpuInstance::from_topology(inst, p));
        }
        let enabled = state.is_some_and(|s| s.mode == MigMode::Enabled);
        let pending = state
            .and_then(|s| s.pending)
            .map_or(enabled, |p| p == MigMode::Enabled);
        MigState {
            cap,
            enabled,
            pending,
            gpu_instances,
        }
    }
}

impl GpuInstance {
    /// A GPU instance of profile `p` the topology lists, with its compute
    /// instances.
    fn from_topology(inst: &Instance, p: &Profile) -> GpuInstance {
        let compute_instances = inst
            .compute_layout(p)
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(id, ci)| {
                let c = ComputeInstance {
                    profile_id: compute_profile_id(ci.slices).unwrap_or(0),
                    slices: ci.slices,
                    start: ci.start,
                    uuid: ci.uuid,
                };
                (id as u32, c)
            })
            .collect();
        GpuInstance {
            profile_id: p.id,
            start: inst.start,
            size: p.placements.size,
            compute_instances,
        }
    }
}

/// A made-up but well-formed and unique MIG UUID for a created compute instance.
fn mig_uuid(gpu_uuid: &str, gi: u32, serial: u64) -> String {
    let hash = |seed: u64| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
        for b in gpu_uuid
            .bytes()
            .chain(gi.to_le_bytes())
            .chain(serial.to_le_bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    };
    let (a, b) = (hash(1), hash(2));
    format!(
        "MIG-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xFFFF,
        a & 0xFFFF,
        b >> 48,
        b & 0xFFFF_FFFF_FFFF
    )
}

#[cfg(test)]
mod tests;
