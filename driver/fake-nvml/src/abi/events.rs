//! Events: event sets and the XID errors they deliver.

use std::ffi::{c_uint, c_ulonglong};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::events;
use crate::machine::handles::{self, DeviceRef, Kind};
use crate::machine::{Machine, QueuedEvent};
use crate::{NO_INSTANCE, ffi, gpu_handle, handle, put, with_machine};

/// Event types every simulated GPU supports: ECC errors, P-state and clock
/// changes and critical XID errors.
const SUPPORTED_EVENTS: u64 = (nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypeClock) as u64;

fn event_set_id(set: nvmlEventSet_t) -> Result<u32, Ret> {
    handles::decode(Kind::EventSet, set.addr())
        .map(|(id, _, _)| id as u32)
        .ok_or(INVALID_ARGUMENT)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    ffi(|| {
        if set.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let id = with_machine(|m| {
            // Only lines appended after the set exists are its events.
            let offset = m.events_path.as_deref().map_or(0, events::file_len);
            m.new_event_set(offset)
                .ok_or(nvmlReturn_enum_NVML_ERROR_MEMORY)
        })?;
        // SAFETY: checked non-null; valid for a handle by contract.
        unsafe { put(set, handle(Kind::EventSet, id as usize, None, None)) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    ffi(|| {
        let id = event_set_id(set)?;
        with_machine(|m| m.event_sets.remove(&id).map(|_| ()).ok_or(INVALID_ARGUMENT))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    event_types: *mut c_ulonglong,
) -> nvmlReturn_t {
    ffi(|| {
        with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Gpu(_) => Ok(()),
            DeviceRef::Mig { .. } => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned long long.
        unsafe { put(event_types, SUPPORTED_EVENTS) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    event_types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    ffi(|| {
        let id = event_set_id(set)?;
        with_machine(|m| {
            let g = match m.live_device(device.addr())? {
                DeviceRef::Gpu(g) => g,
                DeviceRef::Mig { .. } => return Err(NOT_SUPPORTED),
            };
            if event_types & !SUPPORTED_EVENTS != 0 {
                return Err(NOT_SUPPORTED);
            }
            let s = m.event_sets.get_mut(&id).ok_or(INVALID_ARGUMENT)?;
            match s.registrations.iter_mut().find(|(gpu, _)| *gpu == g) {
                Some((_, mask)) => *mask |= event_types,
                None => s.registrations.push((g, event_types)),
            }
            Ok(())
        })
    })
}

/// Pulls new injected lines into the set's queue and pops one event.
fn next_event(m: &mut Machine, id: u32) -> Result<Option<nvmlEventData_t>, Ret> {
    let offset = m.event_sets.get(&id).ok_or(INVALID_ARGUMENT)?.offset;
    let mut new_offset = offset;
    let injected = match &m.events_path {
        Some(path) => events::read_new(path, &mut new_offset),
        None => Vec::new(),
    };
    let resolved: Vec<(DeviceRef, u64)> = injected
        .into_iter()
        .filter_map(|e| match m.by_uuid(&e.uuid) {
            Some(d) => Some((d, e.xid)),
            None => {
                eprintln!(
                    "tessera-fake-nvml: event for unknown UUID {} ignored",
                    e.uuid
                );
                None
            }
        })
        .collect();
    let set = m.event_sets.get_mut(&id).ok_or(INVALID_ARGUMENT)?;
    set.offset = new_offset;
    for (d, xid) in resolved {
        let listening = set
            .registrations
            .iter()
            .any(|(g, mask)| *g == d.gpu() && mask & u64::from(nvmlEventTypeXidCriticalError) != 0);
        if !listening {
            continue;
        }
        let (gi, ci) = match d {
            DeviceRef::Mig { gi, ci, .. } => (gi, ci),
            DeviceRef::Gpu(_) => (NO_INSTANCE, NO_INSTANCE),
        };
        set.queue.push_back(QueuedEvent {
            gpu: d.gpu(),
            xid,
            gpu_instance: gi,
            compute_instance: ci,
        });
    }
    Ok(set.queue.pop_front().map(|e| nvmlEventData_t {
        device: gpu_handle(e.gpu),
        eventType: u64::from(nvmlEventTypeXidCriticalError),
        eventData: e.xid,
        gpuInstanceId: e.gpu_instance,
        computeInstanceId: e.compute_instance,
    }))
}

/// Waits up to `timeoutms` for an event; blocks on file notifications, never spins.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if data.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let id = event_set_id(set)?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeoutms));
        let path = with_machine(|m| {
            m.event_sets.get(&id).ok_or(INVALID_ARGUMENT)?;
            Ok(m.events_path.clone())
        })?;
        // Watch before the first read so nothing appended in between is missed.
        let watcher = path.as_deref().and_then(events::Watcher::new);
        loop {
            if let Some(event) = with_machine(|m| next_event(m, id))? {
                // SAFETY: checked non-null; valid for the struct by contract.
                return unsafe { put(data, event) };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TIMEOUT);
            }
            // Slices keep a lost notification from delaying delivery long.
            let slice = (deadline - now).min(Duration::from_millis(200));
            match &watcher {
                Some(w) => w.wait(slice),
                None => std::thread::sleep(slice),
            }
        }
    })
}
