//! The XID monitor: one thread registers every GPU's XID events in an NVML
//! event set and waits on it for the life of the process, telling the
//! [`HealthTracker`] of each event.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::struct_wrappers::event::EventData;
use tracing::{info, warn};

use super::HealthTracker;

/// Registers XID events of every GPU NVML lists and feeds them to `tracker`
/// from a thread of its own (NVML's wait blocks), for the life of the
/// process.
pub fn spawn_monitor(
    nvml: Arc<Nvml>,
    tracker: Arc<HealthTracker>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("xid-monitor".into())
        .spawn(move || monitor(&nvml, &tracker))
}

/// list the GPUs -> register their XID events in one set -> wait for
/// events, for good.
fn monitor(nvml: &Nvml, tracker: &HealthTracker) {
    let Some(gpus) = list_gpus(nvml) else {
        return;
    };
    let Some(set) = register_events(nvml, tracker, &gpus) else {
        return;
    };
    wait_for_events(set, tracker);
}

/// Each GPU's index and UUID; `None` if NVML cannot count them.
fn list_gpus(nvml: &Nvml) -> Option<Vec<(u32, String)>> {
    match nvml.device_count() {
        Ok(n) => Some(
            (0..n)
                .filter_map(|i| Some((i, nvml.device_by_index(i).ok()?.uuid().ok()?)))
                .collect(),
        ),
        Err(e) => {
            warn!("GPU health not watched: cannot count GPUs: {e}");
            None
        }
    }
}

/// One event set with the XID events of every GPU that supports them;
/// each GPU is marked watched or not. `None` if there is no set to wait
/// on (NVML could not make one, or dropped it).
fn register_events<'n>(
    nvml: &'n Nvml,
    tracker: &HealthTracker,
    gpus: &[(u32, String)],
) -> Option<EventSet<'n>> {
    let now = SystemTime::now;
    let mut set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            for (_, uuid) in gpus {
                tracker.not_watched(uuid, format!("cannot create an NVML event set: {e}"), now());
            }
            return None;
        }
    };
    let mut watched = 0;
    for (index, uuid) in gpus {
        let registered = nvml.device_by_index(*index).and_then(|d| {
            let supported = d.supported_event_types()?;
            if !supported.contains(EventTypes::CRITICAL_XID_ERROR) {
                return Err(NvmlError::NotSupported);
            }
            Ok(d)
        });
        let device = match registered {
            Ok(d) => d,
            Err(e) => {
                tracker.not_watched(uuid, format!("XID events: {e}"), now());
                continue;
            }
        };
        match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => {
                set = s;
                watched += 1;
                tracker.watching(uuid, now());
            }
            Err(e) => {
                // NVML freed the set: what was registered so far is lost.
                tracker.not_watched(uuid, format!("registering XID events: {}", e.error), now());
                warn!("GPU health: NVML dropped the event set; not watching any GPU");
                for (_, uuid) in gpus {
                    tracker.not_watched(uuid, "the NVML event set failed".into(), now());
                }
                return None;
            }
        }
    }
    info!(gpus = watched, "watching GPUs for XID errors");
    Some(set)
}

/// Waits for XID events for good, telling `tracker` of each; a failing
/// wait is retried every second, logged once until it works again.
fn wait_for_events(set: EventSet<'_>, tracker: &HealthTracker) {
    let now = SystemTime::now;
    let mut failing = false;
    loop {
        match set.wait(1000) {
            Ok(event) => {
                failing = false;
                apply_xid(event, tracker);
            }
            Err(NvmlError::Timeout) => failing = false,
            Err(e) => {
                if !failing {
                    warn!("waiting for XID events: {e}; retrying every second");
                }
                failing = true;
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        tracker.recover(now());
    }
}

/// Tells `tracker` of one XID event (of an unknown XID when NVML cannot
/// say which); an event without XID data is not one.
fn apply_xid(event: EventData<'_>, tracker: &HealthTracker) {
    let xid = match event.event_data {
        Some(XidError::Value(x)) => Some(x),
        Some(XidError::Unknown) => None,
        None => return,
    };
    match event.device.uuid() {
        Ok(uuid) => {
            tracker.xid(&uuid, xid, SystemTime::now());
        }
        Err(e) => warn!("XID {xid:?} on a GPU whose UUID NVML cannot read: {e}"),
    }
}
