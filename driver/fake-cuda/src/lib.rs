//! `tessera-fake-cuda`: a simulated `libcuda.so.1` (the CUDA driver API).
//!
//! It answers the driver API calls a probe needs (what devices a process
//! gets, with how many SMs and how much memory, and whether it can allocate)
//! for the machine the fake NVML simulates, with the MPS rules NVIDIA's
//! driver applies, and as unforgivingly as NVIDIA's library: calls before
//! `cuInit` answer `CUDA_ERROR_NOT_INITIALIZED`, null pointers
//! `CUDA_ERROR_INVALID_VALUE`, bad ordinals `CUDA_ERROR_INVALID_DEVICE`,
//! memory calls without a live current context `CUDA_ERROR_INVALID_CONTEXT`.
//!
//! # Using it
//!
//! Link (or copy) the built cdylib `libtessera_fake_cuda.so` as
//! `libcuda.so.1` into a directory and put that directory on
//! `LD_LIBRARY_PATH` (or `dlopen` the path). The process needs the fake
//! NVML's environment: `TESSERA_FAKE_NVML_TOPOLOGY` (the topology file),
//! usually `TESSERA_FAKE_NVML_STATE` (the machine's state file) and, in a
//! container, `TESSERA_FAKE_NVML_DEV_ROOT`. No `libnvidia-ml.so.1` is
//! needed: this library reads the machine through the fake NVML linked
//! into it (its rlib), so it sees exactly what the fake NVML shows the same
//! process: the same GPUs and MIG devices, the container's device nodes,
//! the machine-wide MIG state.
//!
//! # Devices
//!
//! At `cuInit` the library takes the devices the process may see (the fake
//! NVML's view): in PCI order every GPU not in MIG mode, and for a GPU in
//! MIG mode its MIG devices (a GPU in MIG mode is never a device itself; one
//! with no MIG devices contributes none). Lost GPUs are left out. Then
//! `CUDA_VISIBLE_DEVICES` filters and orders them (indices, UUIDs, unique
//! UUID prefixes; the first entry that names no device ends the list; empty:
//! no device; see `visible.rs`). No device left: `cuInit` answers
//! `CUDA_ERROR_NO_DEVICE`. `cuInit`'s outcome is kept for the life of the
//! process, as CUDA keeps it: a later daemon or environment change is seen
//! by new processes only. `CUDA_DEVICE_ORDER` is not read (PCI order
//! always).
//!
//! UUIDs: `cuDeviceGetUuid_v2` gives the device's (a MIG device's own),
//! `cuDeviceGetUuid` the physical GPU's. The 16 bytes are the 32 hex digits
//! of the fake's `GPU-`/`MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` string;
//! a UUID string not of that form gets 16 bytes of a stable hash of it.
//!
//! Names, memory and compute capability are NVML's (a MIG device is named
//! `<GPU name> MIG <profile>`); SMs are the topology's `multiprocessors`
//! for a GPU, NVML's multiprocessor count for a MIG device.
//!
//! # MPS
//!
//! At `cuInit` the library looks for a control daemon on
//! `<CUDA_MPS_PIPE_DIRECTORY>/control` (default `/tmp/nvidia-mps`), see
//! `mps.rs`. None answering (no socket, connection refused: a daemon that
//! quit or died), the process runs outside MPS with whole devices: all SMs,
//! all memory. A daemon that answers (`fake-mps-control`, asked with its
//! private `tessera_fake_get_client_config` command) makes the process its
//! client:
//!
//! - it sees only the daemon's devices (the daemon's `CUDA_VISIBLE_DEVICES`
//!   entries, each read in the client's view; ones the client cannot see
//!   are left out), then its own `CUDA_VISIBLE_DEVICES` picks among those;
//! - its thread percentage is the lower of the daemon's default and its
//!   own valid `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`; its SMs
//!   (`CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`) are that share of the
//!   device's, rounded down to an even number, at least 2 (what an H100
//!   with driver 580 gives: 25% of 132 SMs is 32, 30% is 38, 50% is 66);
//! - per device, the memory it may allocate is the lowest of the device's
//!   memory, the daemon's default pinned limit (by the daemon's ordinal)
//!   and its own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` entry (by its ordinal).
//!
//! The client's environment lowers and never raises, as on real MPS.
//! Invalid client values are ignored.
//!
//! # Memory and contexts
//!
//! `cuMemGetInfo_v2` (under a current context) answers total = the device's
//! memory and free = what this process may allocate on it (the lower of
//! its MPS limit and the memory the driver does not reserve) minus what it
//! has allocated there, and never more than the device has left after the
//! memory every other running process holds on it (with load recorded:
//! one physical memory serves MPS clients and other processes alike). `cuMemAlloc_v2` rounds sizes up to 2 MiB and fails
//! with `CUDA_ERROR_OUT_OF_MEMORY` beyond free; `cuMemFree_v2` gives it
//! back, as does destroying (or finally releasing) the context that
//! allocated it. No memory goes to the context itself.
//!
//! Contexts: `cuCtxCreate_v2` makes a context current on the calling thread;
//! the primary context is retained and released with a reference count and
//! made current with `cuCtxSetCurrent`. There is one current context per
//! thread, not a stack (`cuCtxPushCurrent`/`cuCtxPopCurrent` are not
//! exported). Handles are tagged integers, validated on every call, never
//! dereferenced.
//!
//! # Load
//!
//! With `TESSERA_FAKE_NVML_LOAD` set, the library records this process's
//! load in a memory file only it holds, for the fake NVML to report
//! (see the fake NVML's `load` module): per device, the memory it has
//! allocated (after every allocation, free, context destroy and final
//! primary context release), its SM share (100 %, or an MPS client's
//! active thread percentage), whether it is an MPS client there, and until
//! when launched kernels keep the device busy (see `kernels.rs`: PTX
//! modules, `cuLaunchKernel`, `cuCtxSynchronize`). The record goes with the
//! process, as the kernel driver forgets a process's memory when it exits.
//!
//! Compute modes: a GPU set to PROHIBITED refuses contexts with
//! `CUDA_ERROR_DEVICE_UNAVAILABLE`; EXCLUSIVE_PROCESS is not enforced (that
//! would need the other processes' contexts).
//!
//! # What is exported
//!
//! `cuInit`, `cuDriverGetVersion`, `cuDeviceGetCount`, `cuDeviceGet`,
//! `cuDeviceGetName`, `cuDeviceGetUuid`, `cuDeviceGetUuid_v2`,
//! `cuDeviceTotalMem_v2`, `cuDeviceGetAttribute` (multiprocessor count, compute
//! mode, PCI bus/device/domain, compute capability, max threads per block,
//! integrated; any other attribute answers `CUDA_ERROR_INVALID_VALUE`),
//! `cuCtxCreate_v2`, `cuCtxDestroy_v2`, `cuCtxSetCurrent`, `cuCtxGetCurrent`,
//! `cuCtxGetDevice`, `cuDevicePrimaryCtxRetain`,
//! `cuDevicePrimaryCtxRelease_v2`, `cuMemGetInfo_v2`, `cuMemAlloc_v2`,
//! `cuMemFree_v2`, `cuModuleLoadData`, `cuModuleUnload`,
//! `cuModuleGetFunction`, `cuLaunchKernel`, `cuCtxSynchronize`,
//! `cuGetErrorName`, `cuGetErrorString`, with the ABI and
//! numeric codes of NVIDIA's `cuda.h`. Nothing else: the fake NVML's `nvml*`
//! functions linked in (its rlib) stay local to the library (the build
//! script links with `--exclude-libs=ALL`), so this library never stands in
//! for `libnvidia-ml.so.1`. Check with
//! `nm -D --defined-only libtessera_fake_cuda.so`.
//!
//! Safety contract of every exported function (the same as CUDA's): each
//! pointer argument is either null or valid for writing the type (or, for
//! name buffers, the length) `cuda.h` documents.

// The exported names (functions and types) are CUDA's.
#![allow(non_snake_case, non_camel_case_types)]
// Each exported function's safety contract is the CUDA one stated above.
#![allow(clippy::missing_safety_doc)]

mod codes;
mod contexts;
mod devices;
mod errors;
mod init;
mod kernels;
mod machine;
mod memory;
mod mps;
mod visible;

#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

pub use codes::CUresult;
use codes::*;
pub use contexts::*;
pub use devices::*;
pub use errors::*;
pub use init::*;
use machine::Physical;
pub use memory::*;
use tessera_fake_nvml::sync::Locked;

/// `CUdevice`: a device ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CUdeviceptr = c_ulonglong;
/// `CUdevice_attribute`: an `enum` in `cuda.h`, an `int` in the ABI.
pub type CUdevice_attribute = c_int;

/// The opaque struct a `CUcontext` points to.
#[repr(C)]
pub struct CUctx_st {
    _opaque: [u8; 0],
}

/// `CUcontext`.
pub type CUcontext = *mut CUctx_st;

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [c_char; 16],
}

/// Variables a CUDA process reads.
pub const VISIBLE_DEVICES_ENV: &str = "CUDA_VISIBLE_DEVICES";

const MIB: u64 = 1 << 20;
/// Where device addresses start (an address range the real driver uses).
const FIRST_ADDRESS: u64 = 0x7f00_0000_0000;

const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: c_int = 1;
const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
const CU_DEVICE_ATTRIBUTE_INTEGRATED: c_int = 18;
const CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: c_int = 20;
const CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: c_int = 33;
const CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: c_int = 34;
const CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: c_int = 50;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// `CU_COMPUTEMODE_PROHIBITED`.
const COMPUTE_MODE_PROHIBITED: u32 = 2;

struct Lib {
    /// `cuInit`'s outcome, kept for the life of the process.
    init: Option<Result<Session, CUresult>>,
    /// Sessions started so far (more than one only in tests, which reset
    /// the library): context handles carry it, so a handle of an earlier
    /// session is never taken for one of the current.
    generation: u16,
}

static LIB: Mutex<Lib> = Mutex::new(Lib {
    init: None,
    generation: 0,
});

thread_local! {
    /// The calling thread's current context handle (0: none).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn lock() -> MutexGuard<'static, Lib> {
    LIB.locked()
}

/// One initialized library: the devices and what this process did with them.
#[derive(Debug)]
struct Session {
    generation: u16,
    driver_version: c_int,
    devices: Vec<Device>,
    /// Live contexts by id; a device's primary context has id `ordinal + 1`
    /// and is here while retained.
    contexts: BTreeMap<u32, Context>,
    next_context: u32,
    allocations: BTreeMap<u64, Allocation>,
    next_address: u64,
    /// Loaded modules by id (see `kernels.rs`).
    modules: BTreeMap<u32, kernels::Module>,
    next_module: u32,
    /// Where this process records its load, if anywhere.
    load: Option<LoadRecord>,
}

/// This process's load record and the file only it holds it in (see the
/// fake NVML's `load` module).
#[derive(Debug)]
struct LoadRecord {
    channel: tessera_fake_nvml::load::Channel,
    record: tessera_fake_nvml::load::Record,
    /// A write failed and was reported: said once, not on every call.
    failed: bool,
}

#[derive(Debug)]
struct Device {
    physical: Physical,
    multiprocessors: u32,
    /// Bytes this process may allocate on the device.
    usable: u64,
    /// Bytes it has allocated there.
    allocated: u64,
    primary_refs: u32,
    /// The share of the device's SMs this process's kernels occupy, in
    /// percent: 100, or an MPS client's active thread percentage.
    sm_percent: u32,
    /// It reaches the device through an MPS server.
    mps_client: bool,
    /// When the kernels launched so far finish.
    in_flight_until: Option<Instant>,
    /// Until when the device counts as busy in the load record (ms after
    /// the epoch).
    busy_until_ms: u64,
}

#[derive(Debug, Clone, Copy)]
struct Context {
    device: usize,
    primary: bool,
}

#[derive(Debug, Clone, Copy)]
struct Allocation {
    context: u32,
    device: usize,
    bytes: u64,
}

// ---------------------------------------------------------------------------
// Plumbing

/// Turns a body into a `CUresult`; a panic becomes UNKNOWN instead of
/// unwinding into C.
fn ffi(f: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// Runs `f` on the initialized library; NOT_INITIALIZED before a
/// successful `cuInit`.
fn with_session<R>(f: impl FnOnce(&mut Session) -> Result<R, CUresult>) -> Result<R, CUresult> {
    let mut lib = lock();
    match lib.init.as_mut() {
        Some(Ok(session)) => f(session),
        _ => Err(NOT_INITIALIZED),
    }
}

/// Writes `value` through an out-pointer.
///
/// # Safety
/// `ptr` is null or valid for writing a `T` (the caller's CUDA contract).
unsafe fn put<T>(ptr: *mut T, value: T) -> Result<(), CUresult> {
    if ptr.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null and, by the contract above, valid for a T.
    unsafe { ptr.write_unaligned(value) };
    Ok(())
}

/// Reads an environment variable of the CUDA process (tests substitute
/// their own).
fn env_var(name: &str) -> Option<String> {
    #[cfg(test)]
    if let Some(env) = tests::env_override() {
        return env.get(name).cloned();
    }
    std::env::var(name).ok()
}

const CONTEXT_MAGIC: u64 = 0x7E5C << 48;

fn context_handle(generation: u16, id: u32) -> usize {
    (CONTEXT_MAGIC | u64::from(generation) << 32 | u64::from(id)) as usize
}

impl Session {
    fn device(&self, dev: CUdevice) -> Result<&Device, CUresult> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or(INVALID_DEVICE)
    }

    fn handle(&self, id: u32) -> CUcontext {
        ptr::without_provenance_mut(context_handle(self.generation, id))
    }

    /// The id of a live context of this session a handle names.
    fn context_id(&self, handle: usize) -> Option<u32> {
        let value = handle as u64;
        if value & (0xFFFF << 48) != CONTEXT_MAGIC
            || (value >> 32) & 0xFFFF != u64::from(self.generation)
        {
            return None;
        }
        let id = value as u32;
        self.contexts.contains_key(&id).then_some(id)
    }

    /// The calling thread's current context, which must be live.
    fn current(&self) -> Result<(u32, Context), CUresult> {
        let id = self
            .context_id(CURRENT.with(Cell::get))
            .ok_or(INVALID_CONTEXT)?;
        Ok((id, self.contexts[&id]))
    }

    /// Whether the device's GPU accepts contexts.
    fn usable(&self, dev: CUdevice) -> Result<usize, CUresult> {
        let d = self.device(dev)?;
        if d.physical.compute_mode == COMPUTE_MODE_PROHIBITED {
            return Err(DEVICE_UNAVAILABLE);
        }
        Ok(dev as usize)
    }

    /// What this process may still allocate on device `dev`: its own limit
    /// less what it holds, and never more than the device has left after
    /// every other process's memory on it (as one physical memory is
    /// shared, MPS or not; known only with load recorded).
    fn free_on(&self, dev: usize) -> u64 {
        let d = &self.devices[dev];
        let mine = d.usable.saturating_sub(d.allocated);
        if self.load.is_none() {
            return mine;
        }
        let me = std::process::id();
        let others: u64 = tessera_fake_nvml::load::live()
            .iter()
            .filter(|l| l.pid != me)
            .flat_map(|l| &l.record.devices)
            .filter(|u| u.uuid.eq_ignore_ascii_case(&d.physical.uuid))
            .map(|u| u.memory_bytes)
            .sum();
        let device_left = d
            .physical
            .memory_bytes
            .saturating_sub(d.physical.reserved_bytes)
            .saturating_sub(others)
            .saturating_sub(d.allocated);
        mine.min(device_left)
    }

    /// Frees every allocation of context `id`.
    fn free_context_memory(&mut self, id: u32) {
        let gone: Vec<u64> = self
            .allocations
            .iter()
            .filter(|(_, a)| a.context == id)
            .map(|(addr, _)| *addr)
            .collect();
        for addr in gone {
            if let Some(a) = self.allocations.remove(&addr) {
                self.devices[a.device].allocated -= a.bytes;
            }
        }
        self.publish_load();
    }

    /// Records what this process holds and runs on each device where the
    /// fake NVML reads it (nothing without a load directory). A failed
    /// write is said on stderr once; the call that changed the load still
    /// succeeds, as the device did what it was asked.
    fn publish_load(&mut self) {
        let Some(load) = self.load.as_mut() else {
            return;
        };
        load.record.devices = self
            .devices
            .iter()
            .map(|d| tessera_fake_nvml::load::DeviceLoad {
                uuid: d.physical.uuid.clone(),
                memory_bytes: d.allocated,
                busy_until_ms: d.busy_until_ms,
                sm_percent: d.sm_percent,
                mps_client: d.mps_client,
            })
            .collect();
        match load.channel.publish(&load.record) {
            Ok(()) => load.failed = false,
            Err(e) if !load.failed => {
                load.failed = true;
                eprintln!("tessera-fake-cuda: recording this process's load: {e}");
            }
            Err(_) => {}
        }
    }
}
