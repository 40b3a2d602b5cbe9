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
mod kernels;
mod machine;
mod mps;
mod visible;

#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

pub use codes::CUresult;
use codes::*;
use machine::Physical;

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
/// Allocation granularity.
const GRANULE: u64 = 2 * MIB;
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
/// The `cuCtxCreate` flags that exist (scheduling, map host, local memory
/// resize, coredump, sync memops).
const CTX_FLAGS: c_uint = 0xFF;
const CTX_SCHED_MASK: c_uint = 0x07;

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
    LIB.lock().unwrap_or_else(PoisonError::into_inner)
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

/// The 16 bytes of a UUID string: its 32 hex digits when it is
/// `GPU-`/`MIG-` + `8-4-4-4-12` hex, else a stable hash of it.
pub fn uuid_bytes(uuid: &str) -> [u8; 16] {
    let body = uuid
        .strip_prefix("GPU-")
        .or_else(|| uuid.strip_prefix("MIG-"))
        .unwrap_or("");
    let groups: Vec<&str> = body.split('-').collect();
    let well_formed = groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()));
    let mut out = [0u8; 16];
    if well_formed {
        let hex: String = groups.concat();
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
        }
        return out;
    }
    // FNV-1a, twice with different seeds.
    for (half, seed) in [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142]
        .iter()
        .enumerate()
    {
        let mut h = *seed;
        for b in uuid.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        out[half * 8..half * 8 + 8].copy_from_slice(&h.to_be_bytes());
    }
    out
}

// ---------------------------------------------------------------------------
// Initialization

/// What the process asked for, read once at `cuInit`.
#[derive(Debug, Clone, Default)]
struct Env {
    visible: Option<String>,
    pipe_directory: Option<String>,
    client: mps::ClientEnv,
    /// `TESSERA_FAKE_NVML_LOAD` is set: record this process's load.
    load: bool,
}

impl Env {
    fn read() -> Env {
        Env {
            visible: env_var(VISIBLE_DEVICES_ENV),
            pipe_directory: env_var(mps::PIPE_DIRECTORY_ENV),
            client: mps::ClientEnv {
                thread_percentage: env_var(mps::protocol::THREAD_PERCENTAGE_ENV),
                pinned_mem_limit: env_var(mps::protocol::PINNED_MEM_LIMIT_ENV),
            },
            load: env_var(tessera_fake_nvml::load::LOAD_ENV).is_some_and(|v| !v.is_empty()),
        }
    }
}

fn start(generation: u16) -> Result<Session, CUresult> {
    let env = Env::read();
    let (driver_version, physical) = machine::devices()?;
    let uuids: Vec<&str> = physical.iter().map(|p| p.uuid.as_str()).collect();
    let daemon = mps::ask_daemon(&mps::pipe_directory(env.pipe_directory.as_deref()))?;
    // The devices before the process's own CUDA_VISIBLE_DEVICES, each with
    // its ordinal among the daemon's devices under MPS.
    let base: Vec<(usize, Option<u32>)> = match &daemon {
        None => (0..physical.len()).map(|i| (i, None)).collect(),
        Some(d) => mps::daemon_devices(d, &uuids)
            .into_iter()
            .map(|(i, o)| (i, Some(o)))
            .collect(),
    };
    let base_uuids: Vec<&str> = base.iter().map(|(i, _)| uuids[*i]).collect();
    let chosen = visible::select(env.visible.as_deref(), &base_uuids);
    if chosen.is_empty() {
        return Err(NO_DEVICE);
    }
    let devices = chosen
        .into_iter()
        .enumerate()
        .map(|(ordinal, b)| {
            let (i, daemon_ordinal) = base[b];
            let p = physical[i].clone();
            let whole = p.memory_bytes.saturating_sub(p.reserved_bytes);
            let (multiprocessors, usable, sm_percent) = match (&daemon, daemon_ordinal) {
                (Some(d), Some(o)) => {
                    let l = mps::limits(d, &env.client, o, ordinal as u32);
                    (
                        mps::multiprocessors(p.multiprocessors, l.thread_percentage),
                        l.pinned_bytes.map_or(whole, |b| b.min(whole)),
                        l.thread_percentage.round().clamp(1.0, 100.0) as u32,
                    )
                }
                _ => (p.multiprocessors, whole, 100),
            };
            Device {
                physical: p,
                multiprocessors,
                usable,
                allocated: 0,
                primary_refs: 0,
                sm_percent,
                mps_client: daemon_ordinal.is_some() && daemon.is_some(),
                in_flight_until: None,
                busy_until_ms: 0,
            }
        })
        .collect::<Vec<_>>();
    Ok(Session {
        generation,
        driver_version,
        next_context: devices.len() as u32 + 1,
        devices,
        contexts: BTreeMap::new(),
        allocations: BTreeMap::new(),
        next_address: FIRST_ADDRESS,
        modules: BTreeMap::new(),
        next_module: 1,
        load: env.load.then(open_load_record).flatten(),
    })
}

/// This process's load file, said on stderr when it cannot be made (the
/// process then runs unrecorded, as with load off).
fn open_load_record() -> Option<LoadRecord> {
    let channel = tessera_fake_nvml::load::Channel::open()
        .inspect_err(|e| eprintln!("tessera-fake-cuda: no load file for this process: {e}"))
        .ok()?;
    Some(LoadRecord {
        channel,
        record: tessera_fake_nvml::load::Record::for_this_process()?,
        failed: false,
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    ffi(|| {
        if flags != 0 {
            return Err(INVALID_VALUE);
        }
        let mut lib = lock();
        if lib.init.is_none() {
            lib.generation = lib.generation.wrapping_add(1);
            let generation = lib.generation;
            lib.init = Some(start(generation));
        }
        match &lib.init {
            Some(Ok(_)) => Ok(()),
            Some(Err(code)) => Err(*code),
            None => Err(UNKNOWN),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    ffi(|| {
        if version.is_null() {
            return Err(INVALID_VALUE);
        }
        let known = with_session(|s| Ok(s.driver_version)).ok();
        let v = match known {
            Some(v) => v,
            None => machine::driver_version()?,
        };
        // SAFETY: CUDA contract: null or valid for an int.
        unsafe { put(version, v) }
    })
}

// ---------------------------------------------------------------------------
// Devices

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    ffi(|| {
        let n = with_session(|s| Ok(s.devices.len() as c_int))?;
        // SAFETY: CUDA contract: null or valid for an int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    ffi(|| {
        with_session(|s| s.device(ordinal).map(|_| ()))?;
        // SAFETY: CUDA contract: null or valid for a CUdevice.
        unsafe { put(device, ordinal) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    ffi(|| {
        let text = with_session(|s| Ok(s.device(dev)?.physical.name.clone()))?;
        if name.is_null() || len <= 0 {
            return Err(INVALID_VALUE);
        }
        // Truncated to the buffer, always NUL-terminated.
        let n = text.len().min(len as usize - 1);
        // SAFETY: CUDA contract: `name` is valid for `len` bytes, and
        // `n + 1 <= len`.
        unsafe {
            ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

fn uuid_of(uuid: *mut CUuuid, dev: CUdevice, own: bool) -> CUresult {
    ffi(|| {
        let text = with_session(|s| {
            let p = &s.device(dev)?.physical;
            Ok(if own {
                p.uuid.clone()
            } else {
                p.gpu_uuid.clone()
            })
        })?;
        let bytes = uuid_bytes(&text).map(|b| b as c_char);
        // SAFETY: CUDA contract: null or valid for a CUuuid.
        unsafe { put(uuid, CUuuid { bytes }) }
    })
}

/// The physical GPU's UUID (for a MIG device, its parent's).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    uuid_of(uuid, dev, false)
}

/// The device's own UUID (for a MIG device, the MIG device's).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    uuid_of(uuid, dev, true)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    ffi(|| {
        let total = with_session(|s| Ok(s.device(dev)?.physical.memory_bytes))?;
        // SAFETY: CUDA contract: null or valid for a size_t.
        unsafe { put(bytes, total as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: CUdevice_attribute,
    dev: CUdevice,
) -> CUresult {
    ffi(|| {
        let v = with_session(|s| {
            let d = s.device(dev)?;
            let p = &d.physical;
            let v = match attribute {
                CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
                CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => d.multiprocessors as c_int,
                CU_DEVICE_ATTRIBUTE_INTEGRATED => 0,
                CU_DEVICE_ATTRIBUTE_COMPUTE_MODE => p.compute_mode as c_int,
                CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => p.pci.1 as c_int,
                CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID => p.pci.2 as c_int,
                CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID => p.pci.0 as c_int,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => p.compute_capability.0,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => p.compute_capability.1,
                _ => return Err(INVALID_VALUE),
            };
            Ok(v)
        })?;
        // SAFETY: CUDA contract: null or valid for an int.
        unsafe { put(value, v) }
    })
}

// ---------------------------------------------------------------------------
// Contexts

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    context: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if context.is_null()
                || flags & !CTX_FLAGS != 0
                || !matches!(flags & CTX_SCHED_MASK, 0 | 1 | 2 | 4)
            {
                return Err(INVALID_VALUE);
            }
            let device = s.usable(dev)?;
            let id = s.next_context;
            s.next_context += 1;
            s.contexts.insert(
                id,
                Context {
                    device,
                    primary: false,
                },
            );
            let handle = s.handle(id);
            CURRENT.with(|c| c.set(handle.addr()));
            // SAFETY: CUDA contract: valid for a CUcontext (checked non-null).
            unsafe { put(context, handle) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(context: CUcontext) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if context.is_null() {
                return Err(INVALID_VALUE);
            }
            let id = s.context_id(context.addr()).ok_or(INVALID_CONTEXT)?;
            if s.contexts[&id].primary {
                return Err(INVALID_CONTEXT);
            }
            s.free_context_memory(id);
            s.unload_context_modules(id);
            s.contexts.remove(&id);
            CURRENT.with(|c| {
                if c.get() == context.addr() {
                    c.set(0);
                }
            });
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(context: CUcontext) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if !context.is_null() {
                s.context_id(context.addr()).ok_or(INVALID_CONTEXT)?;
            }
            CURRENT.with(|c| c.set(context.addr()));
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut CUcontext) -> CUresult {
    ffi(|| {
        let current =
            with_session(|s| Ok(s.current().map_or(ptr::null_mut(), |(id, _)| s.handle(id))))?;
        // SAFETY: CUDA contract: null or valid for a CUcontext.
        unsafe { put(context, current) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    ffi(|| {
        let d = with_session(|s| Ok(s.current()?.1.device as CUdevice))?;
        // SAFETY: CUDA contract: null or valid for a CUdevice.
        unsafe { put(device, d) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut CUcontext,
    dev: CUdevice,
) -> CUresult {
    ffi(|| {
        with_session(|s| {
            if context.is_null() {
                return Err(INVALID_VALUE);
            }
            let device = s.usable(dev)?;
            let id = device as u32 + 1;
            s.devices[device].primary_refs += 1;
            s.contexts.insert(
                id,
                Context {
                    device,
                    primary: true,
                },
            );
            // SAFETY: CUDA contract: valid for a CUcontext (checked non-null).
            unsafe { put(context, s.handle(id)) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    ffi(|| {
        with_session(|s| {
            s.device(dev)?;
            let device = dev as usize;
            let id = device as u32 + 1;
            match s.devices[device].primary_refs {
                0 => Err(INVALID_CONTEXT),
                1 => {
                    s.devices[device].primary_refs = 0;
                    s.free_context_memory(id);
                    s.unload_context_modules(id);
                    s.contexts.remove(&id);
                    Ok(())
                }
                _ => {
                    s.devices[device].primary_refs -= 1;
                    Ok(())
                }
            }
        })
    })
}

// ---------------------------------------------------------------------------
// Memory

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    ffi(|| {
        let (f, t) = with_session(|s| {
            let (_, ctx) = s.current()?;
            Ok((
                s.free_on(ctx.device),
                s.devices[ctx.device].physical.memory_bytes,
            ))
        })?;
        if free.is_null() || total.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: CUDA contract: both valid for a size_t (checked non-null).
        unsafe {
            put(free, f as usize)?;
            put(total, t as usize)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(address: *mut CUdeviceptr, bytes: usize) -> CUresult {
    ffi(|| {
        with_session(|s| {
            let (id, ctx) = s.current()?;
            if address.is_null() || bytes == 0 {
                return Err(INVALID_VALUE);
            }
            let rounded = (bytes as u64)
                .checked_next_multiple_of(GRANULE)
                .ok_or(OUT_OF_MEMORY)?;
            if rounded > s.free_on(ctx.device) {
                return Err(OUT_OF_MEMORY);
            }
            s.devices[ctx.device].allocated += rounded;
            s.publish_load();
            let at = s.next_address;
            s.next_address += rounded;
            s.allocations.insert(
                at,
                Allocation {
                    context: id,
                    device: ctx.device,
                    bytes: rounded,
                },
            );
            // SAFETY: CUDA contract: valid for a CUdeviceptr (checked non-null).
            unsafe { put(address, at) }
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(address: CUdeviceptr) -> CUresult {
    ffi(|| {
        with_session(|s| {
            s.current()?;
            let a = s.allocations.remove(&address).ok_or(INVALID_VALUE)?;
            s.devices[a.device].allocated -= a.bytes;
            s.publish_load();
            Ok(())
        })
    })
}

// ---------------------------------------------------------------------------
// Errors

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, text: *mut *const c_char) -> CUresult {
    error_text(error, text, codes::name)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, text: *mut *const c_char) -> CUresult {
    error_text(error, text, codes::description)
}

fn error_text(
    error: CUresult,
    text: *mut *const c_char,
    lookup: fn(CUresult) -> Option<*const c_char>,
) -> CUresult {
    ffi(|| {
        // Works before cuInit, as CUDA's does. An unknown code: NULL and
        // INVALID_VALUE.
        let found = lookup(error);
        // SAFETY: CUDA contract: null or valid for a pointer.
        unsafe { put(text, found.unwrap_or(ptr::null())) }?;
        found.map(|_| ()).ok_or(INVALID_VALUE)
    })
}
