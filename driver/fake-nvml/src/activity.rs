//! What NVML reports a device is doing, from the load records of running
//! processes (see [`crate::load`]): its utilization, the processes using
//! it and their memory and SM share, the memory they hold, and the
//! temperature and power draw that follow from being busy.
//!
//! Utilization is time-based, as NVML's is: a GPU on which any process's
//! kernels run is 100 % utilized over the sample period, however few SMs
//! they occupy (an MPS client with 25 % of the threads still keeps the GPU
//! busy all the time); each process's own sample gives its SM share.

use crate::load::{Live, now_ms};
use crate::machine::Machine;
use crate::machine::handles::DeviceRef;

/// A GPU's temperature idle, and how much warmer it is fully busy (C).
const IDLE_CELSIUS: u32 = 32;
const BUSY_CELSIUS: u32 = 40;
/// A GPU's power draw idle, and how much more it draws fully busy (mW).
const IDLE_MILLIWATTS: u32 = 70_000;
const BUSY_MILLIWATTS: u32 = 330_000;

/// One process's use of one device (a GPU, or a MIG device of it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Use {
    pub pid: u32,
    pub device: DeviceRef,
    pub memory_bytes: u64,
    /// Until when its kernels keep the device busy (ms after the epoch).
    pub busy_until_ms: u64,
    pub sm_percent: u32,
    /// An MPS client: NVML lists it among the MPS compute processes.
    pub mps_client: bool,
}

impl Use {
    pub fn busy(&self, now_ms: u64) -> bool {
        self.busy_until_ms > now_ms
    }
}

/// The device a UUID names on this machine, whatever this process may see
/// (the records are the machine's; visibility applies to the handle asked
/// about).
fn device_of(m: &Machine, uuid: &str) -> Option<DeviceRef> {
    for (gpu, g) in m.gpus.iter().enumerate() {
        if g.card.uuid.eq_ignore_ascii_case(uuid) {
            return Some(DeviceRef::Gpu(gpu));
        }
        let Some(mig) = g.mig.as_ref().filter(|m| m.enabled) else {
            continue;
        };
        for (gi, inst) in &mig.gpu_instances {
            for (ci, c) in &inst.compute_instances {
                if c.uuid.eq_ignore_ascii_case(uuid) {
                    return Some(DeviceRef::Mig {
                        gpu,
                        gi: *gi,
                        ci: *ci,
                    });
                }
            }
        }
    }
    None
}

/// The uses of `device` by running processes: for a GPU, of it and of its
/// MIG devices; for a MIG device, of it alone. A record naming a device
/// that no longer exists (a MIG device destroyed under it) counts for
/// nothing.
pub fn uses(m: &Machine, device: DeviceRef, live: &[Live]) -> Vec<Use> {
    let mut out = Vec::new();
    for l in live {
        for d in &l.record.devices {
            let Some(on) = device_of(m, &d.uuid) else {
                continue;
            };
            let counts = match device {
                DeviceRef::Gpu(g) => on.gpu() == g,
                DeviceRef::Mig { .. } => on == device,
            };
            if counts && (d.memory_bytes > 0 || d.busy_until_ms > 0) {
                out.push(Use {
                    pid: l.pid,
                    device: on,
                    memory_bytes: d.memory_bytes,
                    busy_until_ms: d.busy_until_ms,
                    sm_percent: d.sm_percent.min(100),
                    mps_client: d.mps_client,
                });
            }
        }
    }
    out
}

/// Device memory the processes hold.
pub fn memory_used(uses: &[Use]) -> u64 {
    uses.iter().map(|u| u.memory_bytes).sum()
}

/// Percent of the sample period kernels ran: 100 while any process keeps
/// the device busy, else 0.
pub fn gpu_percent(uses: &[Use]) -> u32 {
    let now = now_ms();
    if uses.iter().any(|u| u.busy(now)) {
        100
    } else {
        0
    }
}

/// Celsius, rising with utilization.
pub fn temperature(percent: u32) -> u32 {
    IDLE_CELSIUS + BUSY_CELSIUS * percent / 100
}

/// Milliwatts, rising with utilization.
pub fn power(percent: u32) -> u32 {
    IDLE_MILLIWATTS + BUSY_MILLIWATTS / 100 * percent
}
