//! What NVML says each GPU is doing, read for every render: utilization,
//! memory, temperature and power per GPU, memory per MIG device, and the
//! processes using it with their memory and (where NVML samples it) SM
//! share.
//!
//! A reading NVML does not support (utilization on a GPU in MIG mode,
//! temperature of some models) is simply absent; any other failure is
//! logged at debug level and also leaves the value absent. One GPU failing
//! a reading never keeps the others from being read.

use std::collections::BTreeMap;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use tessera_api::inventory::Gpu;
use tracing::debug;

use super::processes::{ProcessList, running};

/// One GPU's reading.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuReading {
    pub uuid: String,
    /// Percent of the last sample period kernels ran.
    pub utilization: Option<u32>,
    /// (used, total) bytes.
    pub memory: Option<(u64, u64)>,
    pub temperature_celsius: Option<u32>,
    pub power_milliwatts: Option<u32>,
    /// MIG devices: (UUID, (used, total) bytes).
    pub migs: Vec<(String, Option<(u64, u64)>)>,
    pub processes: Vec<ProcessUse>,
    /// SM percent per pid, from NVML's per-process samples newer than the
    /// last render; `None` where NVML keeps none (MIG mode).
    pub sm_percent: Option<BTreeMap<u32, u32>>,
}

/// A process with a context on the GPU (or one of its MIG devices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUse {
    /// Its pid as NVML reports it: the host's.
    pub pid: u32,
    /// The GPU's UUID, or the MIG device's the process runs on.
    pub device: String,
    pub memory_bytes: u64,
}

/// Keeps a value NVML gave; a missing one is absent (logged unless NVML
/// does not support it).
fn optional<T>(gpu: &str, what: &str, read: Result<T, NvmlError>) -> Option<T> {
    match read {
        Ok(v) => Some(v),
        Err(NvmlError::NotSupported) => None,
        Err(e) => {
            debug!(%gpu, "no {what} for the metrics: {e}");
            None
        }
    }
}

/// Reads one GPU of the inventory; `None` when NVML cannot find it.
/// `since_us`: the time of the last render (µs after the epoch), for the
/// per-process samples.
pub fn read(nvml: &Nvml, gpu: &Gpu, since_us: u64) -> Option<GpuReading> {
    let uuid = gpu.uuid.as_str();
    let device = optional(uuid, "device", nvml.device_by_uuid(uuid))?;
    let memory = optional(uuid, "memory info", device.memory_info()).map(|m| (m.used, m.total));
    let migs = gpu
        .mig
        .instances()
        .iter()
        .map(|i| {
            let info = nvml
                .device_by_uuid(i.uuid.as_str())
                .and_then(|d| d.memory_info());
            let memory = optional(&i.uuid, "MIG memory info", info).map(|m| (m.used, m.total));
            (i.uuid.clone(), memory)
        })
        .collect();
    // MPS clients are listed apart from processes with a context of their
    // own; a pid in both counts once, with the larger figure.
    let mut processes: Vec<ProcessUse> = Vec::new();
    let own = optional(
        uuid,
        "processes",
        running(nvml, &device, ProcessList::Compute),
    );
    let mps = optional(
        uuid,
        "MPS processes",
        running(nvml, &device, ProcessList::MpsClients),
    );
    for p in own.into_iter().chain(mps).flatten() {
        let on_mig = gpu.mig.instances().iter().find(|i| {
            Some(i.gpu_instance_id) == p.gpu_instance_id
                && Some(i.compute_instance_id) == p.compute_instance_id
        });
        let used = ProcessUse {
            pid: p.pid,
            device: on_mig.map_or_else(|| gpu.uuid.clone(), |i| i.uuid.clone()),
            memory_bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => bytes,
                UsedGpuMemory::Unavailable => 0,
            },
        };
        match processes
            .iter_mut()
            .find(|q| q.pid == used.pid && q.device == used.device)
        {
            Some(q) => q.memory_bytes = q.memory_bytes.max(used.memory_bytes),
            None => processes.push(used),
        }
    }
    let sm_percent = match device.process_utilization_stats(since_us) {
        Ok(samples) => Some(newest_per_pid(
            samples.iter().map(|s| (s.pid, s.timestamp, s.sm_util)),
        )),
        // No sample newer than the last render: nothing ran.
        Err(NvmlError::NotFound) => Some(BTreeMap::new()),
        other => optional(uuid, "process utilization", other.map(|_| BTreeMap::new())),
    };
    Some(GpuReading {
        uuid: gpu.uuid.clone(),
        utilization: optional(uuid, "utilization", device.utilization_rates()).map(|u| u.gpu),
        memory,
        temperature_celsius: optional(
            uuid,
            "temperature",
            device.temperature(TemperatureSensor::Gpu),
        ),
        power_milliwatts: optional(uuid, "power", device.power_usage()),
        migs,
        processes,
        sm_percent,
    })
}

/// Each pid's newest sample: (pid, timestamp, SM percent).
fn newest_per_pid(samples: impl Iterator<Item = (u32, u64, u32)>) -> BTreeMap<u32, u32> {
    let mut newest: BTreeMap<u32, (u64, u32)> = BTreeMap::new();
    for (pid, at, sm) in samples {
        let e = newest.entry(pid).or_insert((at, sm));
        if at >= e.0 {
            *e = (at, sm);
        }
    }
    newest.into_iter().map(|(pid, (_, sm))| (pid, sm)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_keeps_its_newest_sample() {
        let newest =
            newest_per_pid([(7, 10, 50), (7, 30, 25), (7, 20, 90), (8, 5, 10)].into_iter());
        assert_eq!(newest, [(7, 25), (8, 10)].into_iter().collect());
    }
}
