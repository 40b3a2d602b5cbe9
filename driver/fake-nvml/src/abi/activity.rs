//! Activity: utilization, processes, temperature, power (see
//! [`crate::load`] and [`crate::activity`]).

use std::ffi::{c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::machine::Machine;
use crate::machine::handles::DeviceRef;
use crate::{NO_INSTANCE, ffi, live_loads, put, with_machine};
use crate::{activity, load};

/// The uses of a live device handle by running processes, and the device.
fn device_uses(
    m: &Machine,
    device: nvmlDevice_t,
    live: &[load::Live],
) -> Result<(DeviceRef, Vec<activity::Use>), Ret> {
    let d = m.live_device(device.addr())?;
    Ok((d, activity::uses(m, d, live)))
}

/// A physical GPU's utilization: NOT_SUPPORTED on a MIG device handle and
/// on a GPU in MIG mode, where NVML keeps no utilization counters.
fn utilization_of(m: &Machine, d: DeviceRef, uses: &[activity::Use]) -> Result<u32, Ret> {
    let DeviceRef::Gpu(g) = d else {
        return Err(NOT_SUPPORTED);
    };
    if m.gpus[g].mig.as_ref().is_some_and(|mig| mig.enabled) {
        return Err(NOT_SUPPORTED);
    }
    Ok(activity::gpu_percent(uses))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    ffi(|| {
        let live = live_loads();
        let gpu = with_machine(|m| {
            let (d, uses) = device_uses(m, device, &live)?;
            utilization_of(m, d, &uses)
        })?;
        // A kernel that only spins touches no memory.
        let rates = nvmlUtilization_t { gpu, memory: 0 };
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(utilization, rates) }
    })
}

/// Writes `items` to a caller's array of `*count` entries, or says how many
/// are needed: `*count` becomes the number of items either way.
///
/// # Safety
/// `count` is null or valid for an unsigned int; `out` is null or valid
/// for writing `*count` entries.
unsafe fn put_list<T>(count: *mut c_uint, out: *mut T, items: Vec<T>) -> Result<(), Ret> {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid by the contract above.
    let room = unsafe { count.read_unaligned() } as usize;
    // SAFETY: as above.
    unsafe { count.write_unaligned(items.len() as c_uint) };
    if items.is_empty() {
        return Ok(());
    }
    if out.is_null() || room < items.len() {
        return Err(INSUFFICIENT_SIZE);
    }
    for (i, item) in items.into_iter().enumerate() {
        // SAFETY: i < room, the array's length by the contract above.
        unsafe { out.add(i).write_unaligned(item) };
    }
    Ok(())
}

/// Processes with a context on the device: host pids where this process
/// sees every process (inside a container, only its own container's), the
/// memory each holds, and for a MIG device its GPU and compute instance
/// (NVML's "none" on a GPU not in MIG mode). A GPU in MIG mode lists the
/// processes of all its MIG devices, a MIG device its own. `mps`: the MPS
/// clients, else the processes with a context of their own.
unsafe fn put_processes(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
    mps: bool,
) -> nvmlReturn_t {
    ffi(|| {
        let live = live_loads();
        let uses = with_machine(|m| Ok(device_uses(m, device, &live)?.1))?;
        let items = uses
            .iter()
            .filter(|u| u.mps_client == mps)
            .map(|u| {
                let (gi, ci) = match u.device {
                    DeviceRef::Mig { gi, ci, .. } => (gi, ci),
                    DeviceRef::Gpu(_) => (NO_INSTANCE, NO_INSTANCE),
                };
                nvmlProcessInfo_t {
                    pid: u.pid,
                    usedGpuMemory: u.memory_bytes,
                    gpuInstanceId: gi,
                    computeInstanceId: ci,
                }
            })
            .collect();
        // SAFETY: NVML contract: null or valid for the count and array.
        unsafe { put_list(info_count, infos, items) }
    })
}

/// Processes with a CUDA context of their own on the device (not MPS
/// clients; see [`put_processes`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: the caller's, passed on.
    unsafe { put_processes(device, info_count, infos, false) }
}

/// MPS clients on the device, each with the memory it holds (see
/// [`put_processes`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: the caller's, passed on.
    unsafe { put_processes(device, info_count, infos, true) }
}

/// One sample per process whose kernels ran after `last_seen` (µs after
/// the epoch): stamped when they last ran (now, while they still do), with
/// the process's SM share while busy. None: NOT_FOUND. NOT_SUPPORTED where
/// utilization is (MIG).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    process_samples_count: *mut c_uint,
    last_seen_time_stamp: c_ulonglong,
) -> nvmlReturn_t {
    ffi(|| {
        let live = live_loads();
        let uses = with_machine(|m| {
            let (d, uses) = device_uses(m, device, &live)?;
            utilization_of(m, d, &uses)?;
            Ok(uses)
        })?;
        let now = load::now_ms();
        let samples: Vec<nvmlProcessUtilizationSample_t> = uses
            .iter()
            .filter(|u| u.busy_until_ms > 0)
            .map(|u| nvmlProcessUtilizationSample_t {
                pid: u.pid,
                timeStamp: u.busy_until_ms.min(now) * 1000,
                smUtil: if u.busy(now) { u.sm_percent } else { 0 },
                memUtil: 0,
                encUtil: 0,
                decUtil: 0,
            })
            .filter(|s| s.timeStamp > last_seen_time_stamp)
            .collect();
        if samples.is_empty() {
            return Err(NOT_FOUND);
        }
        // SAFETY: NVML contract: null or valid for the count and array.
        unsafe { put_list(process_samples_count, utilization, samples) }
    })
}

/// The GPU's die temperature (`NVML_TEMPERATURE_GPU`, the only sensor),
/// warmer while busy; NOT_SUPPORTED on a MIG device handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor_type: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let live = live_loads();
        let percent = with_machine(|m| physical_activity(m, device, &live))?;
        if sensor_type != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(temp, activity::temperature(percent)) }
    })
}

/// The GPU's power draw in milliwatts, higher while busy; NOT_SUPPORTED on
/// a MIG device handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let live = live_loads();
        let percent = with_machine(|m| physical_activity(m, device, &live))?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(power, activity::power(percent)) }
    })
}

/// How busy a physical GPU is (whether or not in MIG mode, its sensors see
/// every kernel on it); NOT_SUPPORTED on a MIG device handle.
fn physical_activity(m: &Machine, device: nvmlDevice_t, live: &[load::Live]) -> Result<u32, Ret> {
    let (d, uses) = device_uses(m, device, live)?;
    match d {
        DeviceRef::Gpu(_) => Ok(activity::gpu_percent(&uses)),
        DeviceRef::Mig { .. } => Err(NOT_SUPPORTED),
    }
}
