//! `tessera-fake-nvml`: a simulated `libnvidia-ml.so.1`.
//!
//! Tests copy (or link) the built cdylib as `libnvidia-ml.so.1` into a
//! directory on `LD_LIBRARY_PATH`, point `TESSERA_FAKE_NVML_TOPOLOGY` at a
//! topology file (see `topologies/README.md`) and run the real driver code:
//! nvml-wrapper loads this library exactly as it loads NVIDIA's, so the code
//! path is the one that runs on real GPUs.
//!
//! Only the NVML C ABI subset Tessera uses is exported; nvml-wrapper resolves
//! symbols lazily, so a missing one only fails (with a clear "function symbol
//! failed to load") when it is actually called. Every function follows NVML's
//! documented contract: it validates handles and pointers, answers
//! `NVML_ERROR_UNINITIALIZED` before `nvmlInit*`, `NVML_ERROR_INSUFFICIENT_SIZE`
//! for short buffers, `NVML_ERROR_INVALID_ARGUMENT` for null or unknown
//! arguments, `NVML_ERROR_NOT_SUPPORTED` for MIG calls on GPUs without MIG, and
//! `NVML_ERROR_GPU_IS_LOST` for every query on a GPU the topology marks lost.
//!
//! # Hardware state is machine-wide
//!
//! As on a real GPU, what one process changes every other process sees: a
//! MIG instance created by the node plugin is listed by `tessera inventory`
//! in another shell, by a restarted plugin and inside a container. Static
//! facts (names, memory, PCI, MIG profiles) come from the topology, loaded
//! once per process. Run-time state (per GPU: MIG mode current and pending,
//! GPU instances with id, profile, start and size, their compute instances
//! with id, profile, slices, start and UUID, the compute mode; the counter
//! that makes created UUIDs unique; the driver root below) lives in a JSON
//! state file (`"version": 1`):
//!
//! - `TESSERA_FAKE_NVML_STATE` ([`STATE_ENV`]) names it; by default it is
//!   `<topology file>.state` beside the topology. Processes meant to be one
//!   machine use the same path; tests give every machine its own.
//! - A missing file is seeded from the topology (at the first call that
//!   needs it, normally `nvmlInit*`). A file that is corrupt, of another
//!   version or of another machine (other GPU UUIDs) is never replaced: init
//!   and every call answer `NVML_ERROR_UNKNOWN`, and stderr says once what is
//!   wrong with which file.
//! - Every call that reads or changes run-time state takes an exclusive
//!   `flock` on `<state>.lock`, re-reads the file (parsing it only when its
//!   bytes changed), and a call that changed something writes it back
//!   atomically (temporary file + rename, still under the lock). Calls that
//!   change nothing do not write.
//!
//! `TESSERA_FAKE_NVML_DRIVER_ROOT` ([`DRIVER_ROOT_ENV`]) makes the library
//! keep the MIG capability files the NVIDIA kernel driver publishes, below
//! that root: `proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access`
//! and `.../gi<G>/ci<C>/access` for every GPU and compute instance that
//! exists (plus `capabilities/mig/config` and `mig/monitor`), with the
//! kernel driver's minor numbering (`gi = 3 + 135 * gpu minor + 9 * G`,
//! `ci = gi + 1 + C`). The root is recorded in the state file at init, so
//! every process on the machine keeps the same tree in step, with or without
//! the variable.
//!
//! # What a process sees: `TESSERA_FAKE_NVML_DEV_ROOT`
//!
//! Real NVML in a container answers only for the device nodes the runtime
//! gave it. [`DEV_ROOT_ENV`] names the directory to look in (`/dev` in a
//! container); unset or empty, every GPU and MIG device is seen. Set, a GPU
//! is seen when `<dir>/nvidia<minor>` is a character device 195:`<minor>`
//! (only `stat`ed: there is no kernel module to open it), and a MIG device
//! of a seen GPU when both its capability nodes
//! `<dir>/nvidia-caps/nvidia-cap<N>` (GPU instance and compute instance, the
//! minors above) are character devices of minor `N`. The nodes are looked
//! at once per `nvmlInit*`. Indices count only the GPUs seen (topology
//! order), so index 0 is the first of them; count, handles by index, UUID
//! and PCI bus id agree, and a hidden device's UUID answers
//! `NVML_ERROR_NOT_FOUND`. Such a process may change nothing (MIG mode,
//! instances, compute mode): `NVML_ERROR_NO_PERMISSION`.
//!
//! A state file (or its lock) this process may not write (a read-only mount
//! in a container) is still read: the lock is taken shared on a read-only
//! descriptor, and a call that would change the state answers
//! `NVML_ERROR_NO_PERMISSION` with a line on stderr.
//!
//! # Load: what the GPUs are doing
//!
//! With `TESSERA_FAKE_NVML_LOAD` ([`load::LOAD_ENV`]) set, the simulated
//! libcuda records, per process and where only that process can (a memory
//! file it holds, see [`load`]), the memory it holds on each device, until
//! when its kernels keep the device busy and whether it is an MPS client.
//! From the records of processes still running:
//! `nvmlDeviceGetMemoryInfo(_v2)` counts their memory as used,
//! `nvmlDeviceGetComputeRunningProcesses_v3` lists the processes with a
//! context of their own and `nvmlDeviceGetMPSComputeRunningProcesses_v3`
//! the MPS clients, each with its memory (host pids; a process in a
//! container finds only its own container's),
//! `nvmlDeviceGetUtilizationRates` is 100 % while any runs kernels
//! (time-based, as NVML's), `nvmlDeviceGetProcessUtilization` samples each
//! busy process's SM share (NOT_FOUND when no sample is newer than the
//! timestamp asked for), and `nvmlDeviceGetTemperature` (C) and
//! `nvmlDeviceGetPowerUsage` (mW) rise with it. On a MIG device handle, and
//! on a GPU in MIG mode, utilization answers NOT_SUPPORTED; temperature and
//! power NOT_SUPPORTED on a MIG device handle. Unset: every GPU is idle and
//! runs no process.
//!
//! # Faults and events
//!
//! Faults a topology can provoke: `faults.init` (every init fails with that
//! code) and `lost: true` on a card. XID errors are injected at run time by
//! appending `<uuid> <xid>` lines to the file named by
//! `TESSERA_FAKE_NVML_EVENTS`; `nvmlEventSetWait_v2` delivers them to event
//! sets registered for XID events on that GPU (a MIG UUID targets its parent
//! GPU and fills in the GPU/compute instance ids). Event sets belong to the
//! process that created them.
//!
//! Safety contract of every exported function (the same as NVML's): each
//! pointer argument is either null or valid for reading/writing the type (or,
//! for string buffers, the length) the NVML header documents. Handles are
//! opaque tagged integers validated on every call, never dereferenced.

// The exported names are NVML's.
#![allow(non_snake_case)]
// Each exported function's safety contract is the NVML one stated above.
#![allow(clippy::missing_safety_doc)]

mod activity;
pub mod caps;
mod codes;
mod events;
pub mod load;
mod machine;
mod state;
pub mod topology;
mod visibility;

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::ptr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::machine::{
    DeviceRef, Kind, Machine, QueuedEvent, compute_instance_sizes, compute_placements, encode,
};
use crate::state::{Access, ComputeMode, Store};
use crate::topology::{Profile, Topology};

/// Environment variable naming the topology file.
pub const TOPOLOGY_ENV: &str = "TESSERA_FAKE_NVML_TOPOLOGY";
/// Environment variable naming the XID injection file.
pub const EVENTS_ENV: &str = "TESSERA_FAKE_NVML_EVENTS";
/// Environment variable naming the machine-wide state file (default:
/// `<topology file>.state`).
pub const STATE_ENV: &str = "TESSERA_FAKE_NVML_STATE";
/// Environment variable naming the driver root below which the MIG
/// capability files (`proc/driver/nvidia/capabilities/...`) are kept.
pub const DRIVER_ROOT_ENV: &str = "TESSERA_FAKE_NVML_DRIVER_ROOT";
/// Environment variable naming the directory whose NVIDIA device nodes
/// decide which GPUs and MIG devices this process sees (`/dev` in a
/// container); unset or empty: all of them.
pub const DEV_ROOT_ENV: &str = "TESSERA_FAKE_NVML_DEV_ROOT";

/// Event types every simulated GPU supports: ECC errors, P-state and clock
/// changes and critical XID errors.
const SUPPORTED_EVENTS: u64 = (nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypeClock) as u64;

/// NVML's "no GPU/compute instance" value in event data.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

struct Lib {
    init_count: u32,
    /// The topology (loaded once) and the process's copy of the run-time
    /// state, with the state file it is kept in step with.
    sim: Option<Sim>,
}

struct Sim {
    machine: Machine,
    store: Store,
    /// `TESSERA_FAKE_NVML_DRIVER_ROOT` of this process.
    driver_root: Option<PathBuf>,
    /// `TESSERA_FAKE_NVML_DEV_ROOT` of this process.
    dev_root: Option<PathBuf>,
    /// `TESSERA_FAKE_NVML_LOAD` of this process: read the processes' load.
    load: bool,
}

static LIB: Mutex<Lib> = Mutex::new(Lib {
    init_count: 0,
    sim: None,
});

fn lock() -> MutexGuard<'static, Lib> {
    LIB.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on the machine, up to date with the state file, or answers
/// UNINITIALIZED outside init/shutdown. `f` must not change run-time state.
fn with_machine<R>(f: impl FnOnce(&mut Machine) -> Result<R, Ret>) -> Result<R, Ret> {
    synced(Access::Read, f)
}

/// Like [`with_machine`] for calls that change run-time state: what `f`
/// changes is written back to the state file. A process that sees only
/// some devices (a container) may change none: NO_PERMISSION.
fn with_machine_mut<R>(f: impl FnOnce(&mut Machine) -> Result<R, Ret>) -> Result<R, Ret> {
    synced(Access::Write, |m| {
        if m.visible.is_some() {
            return Err(NO_PERMISSION);
        }
        f(m)
    })
}

fn synced<R>(access: Access, f: impl FnOnce(&mut Machine) -> Result<R, Ret>) -> Result<R, Ret> {
    let mut lib = lock();
    if lib.init_count == 0 {
        return Err(UNINITIALIZED);
    }
    let sim = lib.sim.as_mut().ok_or(UNINITIALIZED)?;
    sim.store.sync(&mut sim.machine, access, f)
}

/// The load records of running processes, as this process sees them; read
/// before the machine is locked (finding processes in /proc takes a while).
fn live_loads() -> Vec<load::Live> {
    let on = lock().sim.as_ref().is_some_and(|s| s.load);
    if on { load::live() } else { Vec::new() }
}

/// Turns a body into an NVML return code; a panic becomes UNKNOWN instead of
/// unwinding into C.
fn ffi(f: impl FnOnce() -> Result<(), Ret>) -> Ret {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// Writes `value` through an out-pointer.
///
/// # Safety
/// `ptr` is null or valid for writing a `T` (the caller's NVML contract).
unsafe fn put<T>(ptr: *mut T, value: T) -> Result<(), Ret> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and, by the contract above, valid for a T; unaligned
    // writes tolerate callers that pack their structs.
    unsafe { ptr.write_unaligned(value) };
    Ok(())
}

/// Copies `s` and its NUL into a caller buffer of `len` bytes.
///
/// # Safety
/// `buf` is null or valid for writing `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), Ret> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: `bytes.len() + 1 <= len`, the buffer's size, and a Rust string
    // cannot overlap a caller buffer.
    unsafe {
        ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
        buf.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Reads a caller's C string.
///
/// # Safety
/// `s` is null or a valid NUL-terminated string.
unsafe fn get_str<'a>(s: *const c_char) -> Result<&'a str, Ret> {
    if s.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated by the contract above.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| INVALID_ARGUMENT)
}

/// Copies a Rust string into a fixed C char array, truncating and NUL-terminating.
fn fill_name<const N: usize>(dst: &mut [c_char; N], s: &str) {
    for (d, b) in dst.iter_mut().zip(s.bytes().take(N - 1)) {
        *d = b as c_char;
    }
    dst[s.len().min(N - 1)] = 0;
}

fn handle<T>(kind: Kind, gpu: usize, gi: Option<u32>, ci: Option<u32>) -> *mut T {
    ptr::without_provenance_mut(encode(kind, gpu, gi, ci))
}

fn gpu_handle(gpu: usize) -> nvmlDevice_t {
    handle(Kind::Device, gpu, None, None)
}

/// NVML's struct version word: size in the low bits, version in the top byte.
const fn struct_version<T>(version: u32) -> u32 {
    (std::mem::size_of::<T>() as u32) | (version << 24)
}

// ---------------------------------------------------------------------------
// Init and system queries

/// Where the simulated machine comes from.
#[derive(Debug, Clone)]
struct Config {
    topology: Topology,
    events: Option<PathBuf>,
    state: PathBuf,
    driver_root: Option<PathBuf>,
    dev_root: Option<PathBuf>,
    load: bool,
}

/// In-process tests configure the machine here instead of the environment.
#[cfg(test)]
#[derive(Debug, Clone)]
struct TestConfig {
    topology: String,
    events: Option<PathBuf>,
    state: PathBuf,
    driver_root: Option<PathBuf>,
    dev_root: Option<PathBuf>,
    load: bool,
}

#[cfg(test)]
static TEST_CONFIG: Mutex<Option<TestConfig>> = Mutex::new(None);

fn config() -> Result<Config, String> {
    #[cfg(test)]
    if let Some(c) = TEST_CONFIG
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
    {
        return Ok(Config {
            topology: Topology::parse(&c.topology)?,
            events: c.events,
            state: c.state,
            driver_root: c.driver_root,
            dev_root: c.dev_root,
            load: c.load,
        });
    }
    let path = std::env::var_os(TOPOLOGY_ENV)
        .map(PathBuf::from)
        .ok_or_else(|| format!("{TOPOLOGY_ENV} is not set; it must name a topology file"))?;
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let topology =
        Topology::parse(&text).map_err(|e| format!("topology {}: {e}", path.display()))?;
    let state = std::env::var_os(STATE_ENV)
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let mut state = path.into_os_string();
            state.push(".state");
            PathBuf::from(state)
        });
    let non_empty = |name| std::env::var_os(name).filter(|s| !s.is_empty());
    Ok(Config {
        topology,
        events: non_empty(EVENTS_ENV).map(PathBuf::from),
        state,
        driver_root: non_empty(DRIVER_ROOT_ENV).map(PathBuf::from),
        dev_root: non_empty(DEV_ROOT_ENV).map(PathBuf::from),
        load: load::enabled_from_env(),
    })
}

/// The topology, once per process, and a store for the state file; the
/// state seeded into a missing file is the topology's.
fn load() -> Result<Sim, String> {
    let config = config()?;
    let mut machine = Machine::new(config.topology, config.events)?;
    machine.driver_root = config.driver_root.clone();
    let store = Store::new(config.state, machine.snapshot());
    Ok(Sim {
        machine,
        store,
        driver_root: config.driver_root,
        dev_root: config.dev_root,
        load: config.load,
    })
}

fn init() -> Ret {
    ffi(|| {
        let mut lib = lock();
        if lib.sim.is_none() {
            // The topology is loaded once per process; run-time state lives
            // in the state file, like hardware state outliving NVML sessions
            // and processes.
            let sim = load().map_err(|msg| {
                eprintln!("tessera-fake-nvml: {msg}");
                UNKNOWN
            })?;
            lib.sim = Some(sim);
        }
        let sim = lib.sim.as_mut().ok_or(UNKNOWN)?;
        if let Some(code) = sim.machine.init_fault {
            return Err(code);
        }
        // Load (or seed) the state now, so a broken state file fails init;
        // a driver root given to this process becomes the machine's.
        let root = sim.driver_root.clone();
        sim.store.sync(&mut sim.machine, Access::Write, |m| {
            if root.is_some() {
                m.driver_root = root;
            }
            Ok(())
        })?;
        // A container's device nodes are fixed when it starts: one look
        // per init, like NVML enumerating devices at init.
        sim.machine.visible = sim.dev_root.as_deref().map(|d| {
            let minors: Vec<u32> = sim.machine.gpus.iter().map(|g| g.minor).collect();
            visibility::Visible::scan(d, minors)
        });
        lib.init_count += 1;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    ffi(|| {
        let mut lib = lock();
        if lib.init_count == 0 {
            return Err(UNINITIALIZED);
        }
        lib.init_count -= 1;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    message(result)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let v = with_machine(|m| Ok(m.driver_version.clone()))?;
        // SAFETY: NVML contract: `version` is valid for `length` bytes.
        unsafe { put_str(version, length, &v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let v = with_machine(|m| Ok(m.nvml_version.clone()))?;
        // SAFETY: NVML contract: `version` is valid for `length` bytes.
        unsafe { put_str(version, length, &v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(
    cuda_driver_version: *mut c_int,
) -> nvmlReturn_t {
    ffi(|| {
        let v = with_machine(|m| Ok(m.cuda_version))?;
        // SAFETY: NVML contract: null or valid for an int.
        unsafe { put(cuda_driver_version, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(
    cuda_driver_version: *mut c_int,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlSystemGetCudaDriverVersion_v2(cuda_driver_version) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(device_count: *mut c_uint) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| Ok(m.visible_gpus().len() as c_uint))?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(device_count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(device_count: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetCount_v2(device_count) }
}

// ---------------------------------------------------------------------------
// Device handles

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        // Indices count only the GPUs this process sees, as NVML's do.
        let gpu = with_machine(|m| {
            m.visible_gpus()
                .get(index as usize)
                .copied()
                .ok_or(INVALID_ARGUMENT)
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(device, gpu_handle(gpu)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        // SAFETY: NVML contract: null or a NUL-terminated string.
        let uuid = unsafe { get_str(uuid) }?;
        let d = with_machine(|m| {
            let d = m.by_uuid(uuid).ok_or(NOT_FOUND)?;
            if m.gpus[d.gpu()].card.lost {
                return Err(GPU_IS_LOST);
            }
            Ok(d)
        })?;
        let h = match d {
            DeviceRef::Gpu(g) => gpu_handle(g),
            DeviceRef::Mig { gpu, gi, ci } => handle(Kind::Device, gpu, Some(gi), Some(ci)),
        };
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(device, h) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pci_bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        // SAFETY: NVML contract: null or a NUL-terminated string.
        let wanted = unsafe { get_str(pci_bus_id) }?;
        let wanted = topology::PciAddress::parse(wanted).ok_or(INVALID_ARGUMENT)?;
        let gpu = with_machine(|m| {
            let gpu = m
                .visible_gpus()
                .into_iter()
                .find(|g| m.gpus[*g].bus == wanted)
                .ok_or(NOT_FOUND)?;
            if m.gpus[gpu].card.lost {
                return Err(GPU_IS_LOST);
            }
            Ok(gpu)
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(device, gpu_handle(gpu)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    pci_bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id, device) }
}

// ---------------------------------------------------------------------------
// Device queries

/// Profile name of a MIG device's GPU instance, with a `<n>c.` prefix when its
/// compute instance spans only part of it.
fn mig_device_profile_name(m: &Machine, gpu: usize, gi: u32, ci: u32) -> String {
    let Some((_, profile)) = m.gpu_instance_profile(gpu, gi) else {
        return String::new();
    };
    match m.compute_instance(gpu, gi, ci) {
        Some(c) if c.slices < profile.slices => format!("{}c.{}", c.slices, profile.name),
        _ => profile.name.clone(),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let text = with_machine(|m| {
            Ok(match m.live_device(device.addr())? {
                DeviceRef::Gpu(g) => m.gpus[g].card.model.name.clone(),
                DeviceRef::Mig { gpu, gi, ci } => format!(
                    "{} MIG {}",
                    m.gpus[gpu].card.model.name,
                    mig_device_profile_name(m, gpu, gi, ci)
                ),
            })
        })?;
        // SAFETY: NVML contract: `name` is valid for `length` bytes.
        unsafe { put_str(name, length, &text) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let text = with_machine(|m| {
            Ok(match m.live_device(device.addr())? {
                DeviceRef::Gpu(g) => m.gpus[g].card.uuid.clone(),
                DeviceRef::Mig { gpu, gi, ci } => m
                    .compute_instance(gpu, gi, ci)
                    .map(|c| c.uuid.clone())
                    .ok_or(INVALID_ARGUMENT)?,
            })
        })?;
        // SAFETY: NVML contract: `uuid` is valid for `length` bytes.
        unsafe { put_str(uuid, length, &text) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let i = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Gpu(g) => {
                Ok(m.visible_gpus().iter().take_while(|v| **v != g).count() as c_uint)
            }
            DeviceRef::Mig { .. } => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(index, i) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    type_: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    ffi(|| {
        let b = with_machine(|m| {
            Ok(m.gpus[m.live_device(device.addr())?.gpu()]
                .card
                .model
                .brand
                .nvml())
        })?;
        // SAFETY: NVML contract: null or valid for the enum.
        unsafe { put(type_, b) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    ffi(|| {
        let a = with_machine(|m| {
            Ok(m.gpus[m.live_device(device.addr())?.gpu()]
                .card
                .model
                .architecture
                .nvml())
        })?;
        // SAFETY: NVML contract: null or valid for the enum.
        unsafe { put(arch, a) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    ffi(|| {
        if major.is_null() || minor.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (a, b) = with_machine(|m| {
            Ok(topology::compute_capability(
                &m.gpus[m.live_device(device.addr())?.gpu()].card.model,
            ))
        })?;
        // SAFETY: NVML contract: both valid for an int (checked non-null).
        unsafe {
            put(major, a)?;
            put(minor, b)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let info = with_machine(|m| {
            let g = &m.gpus[m.live_device(device.addr())?.gpu()];
            let mut info = nvmlPciInfo_t {
                busIdLegacy: [0; 16],
                domain: g.bus.domain,
                bus: g.bus.bus,
                device: g.bus.device,
                pciDeviceId: g.card.model.pci_device_id,
                pciSubSystemId: g.card.model.pci_sub_system_id,
                busId: [0; 32],
            };
            fill_name(&mut info.busIdLegacy, &g.bus.legacy());
            fill_name(&mut info.busId, &g.bus.nvml());
            Ok(info)
        })?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(pci, info) }
    })
}

const MIB: u64 = 1024 * 1024;

/// (total, reserved) bytes of a device.
fn memory_of(m: &Machine, d: DeviceRef) -> (u64, u64) {
    match d {
        DeviceRef::Gpu(g) => {
            let model = &m.gpus[g].card.model;
            (model.memory_mib * MIB, model.reserved_memory_mib * MIB)
        }
        DeviceRef::Mig { gpu, gi, .. } => (
            m.gpu_instance_profile(gpu, gi)
                .map_or(0, |(_, p)| p.memory_mib * MIB),
            0,
        ),
    }
}

/// (total, reserved, held by processes) bytes of a live device.
fn memory_with_load(
    m: &Machine,
    device: nvmlDevice_t,
    live: &[load::Live],
) -> Result<(u64, u64, u64), Ret> {
    let d = m.live_device(device.addr())?;
    let (total, reserved) = memory_of(m, d);
    Ok((
        total,
        reserved,
        activity::memory_used(&activity::uses(m, d, live)),
    ))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    ffi(|| {
        let live = live_loads();
        let (total, reserved, held) = with_machine(|m| memory_with_load(m, device, &live))?;
        // v1 counts what the driver reserves as used.
        let used = (reserved + held).min(total);
        let info = nvmlMemory_t {
            total,
            free: total - used,
            used,
        };
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(memory, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        if memory.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null and, by contract, valid for the struct; only the
        // version word is read.
        let version = unsafe { ptr::addr_of!((*memory).version).read_unaligned() };
        if version != struct_version::<nvmlMemory_v2_t>(2) {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let live = live_loads();
        let (total, reserved, held) = with_machine(|m| memory_with_load(m, device, &live))?;
        let used = held.min(total - reserved);
        let info = nvmlMemory_v2_t {
            version,
            total,
            reserved,
            free: total - reserved - used,
            used,
        };
        // SAFETY: as above.
        unsafe { put(memory, info) }
    })
}

/// Only MIG device handles have attributes (as in NVML).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    ffi(|| {
        let attrs = with_machine(|m| {
            let DeviceRef::Mig { gpu, gi, ci } = m.live_device(device.addr())? else {
                return Err(NOT_SUPPORTED);
            };
            let (_, p) = m.gpu_instance_profile(gpu, gi).ok_or(INVALID_ARGUMENT)?;
            let c = m.compute_instance(gpu, gi, ci).ok_or(INVALID_ARGUMENT)?;
            Ok(nvmlDeviceAttributes_t {
                multiprocessorCount: p.multiprocessors * c.slices / p.slices.max(1),
                sharedCopyEngineCount: p.engines.copy,
                sharedDecoderCount: p.engines.decoders,
                sharedEncoderCount: p.engines.encoders,
                sharedJpegCount: p.engines.jpeg,
                sharedOfaCount: p.engines.ofa,
                gpuInstanceSliceCount: p.slices,
                computeInstanceSliceCount: c.slices,
                memorySizeMB: p.memory_mib,
            })
        })?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(attributes, attrs) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor_number: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Gpu(g) => Ok(m.gpus[g].minor),
            DeviceRef::Mig { .. } => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(minor_number, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumGpuCores(
    device: nvmlDevice_t,
    num_cores: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Gpu(g) => Ok(m.gpus[g].card.model.cuda_cores),
            DeviceRef::Mig { .. } => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(num_cores, n) }
    })
}

/// The GPU's compute mode; a MIG device has none of its own (NOT_SUPPORTED).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    ffi(|| {
        let value = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Gpu(g) => Ok(m.gpus[g].compute_mode.nvml()),
            DeviceRef::Mig { .. } => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for the enum.
        unsafe { put(mode, value) }
    })
}

/// Sets the GPU's compute mode, machine-wide. EXCLUSIVE_THREAD is no longer
/// supported by NVIDIA's drivers (NOT_SUPPORTED); values beyond the enum
/// are INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(
    device: nvmlDevice_t,
    mode: nvmlComputeMode_t,
) -> nvmlReturn_t {
    ffi(|| {
        let wanted = ComputeMode::from_nvml(mode).ok_or(INVALID_ARGUMENT)?;
        with_machine_mut(|m| {
            let g = match m.live_device(device.addr())? {
                DeviceRef::Gpu(g) => g,
                DeviceRef::Mig { .. } => return Err(NOT_SUPPORTED),
            };
            if wanted == ComputeMode::ExclusiveThread {
                return Err(NOT_SUPPORTED);
            }
            m.gpus[g].compute_mode = wanted;
            Ok(())
        })
    })
}

/// Simulation-only (not NVML): the GPU's compute time slice, 0 (default)
/// to 3 (long). The real `nvidia-smi compute-policy` reaches it through the
/// driver; the stand-in `nvidia-smi` finds this symbol in the loaded library.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tesseraFakeDeviceGetTimeslice(
    device: nvmlDevice_t,
    level: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let value = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Gpu(g) => Ok(m.gpus[g].time_slice),
            DeviceRef::Mig { .. } => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: caller's contract: null or valid for an unsigned int.
        unsafe { put(level, value) }
    })
}

/// Simulation-only (not NVML): sets the GPU's compute time slice,
/// machine-wide; a level above 3 is INVALID_ARGUMENT, a read-only state
/// NO_PERMISSION.
#[unsafe(no_mangle)]
pub extern "C" fn tesseraFakeDeviceSetTimeslice(
    device: nvmlDevice_t,
    level: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if level > 3 {
            return Err(INVALID_ARGUMENT);
        }
        with_machine_mut(|m| {
            let g = match m.live_device(device.addr())? {
                DeviceRef::Gpu(g) => g,
                DeviceRef::Mig { .. } => return Err(NOT_SUPPORTED),
            };
            m.gpus[g].time_slice = level;
            Ok(())
        })
    })
}

// ---------------------------------------------------------------------------
// MIG: mode, profiles, placements

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current_mode: *mut c_uint,
    pending_mode: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if current_mode.is_null() || pending_mode.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (c, p) = with_machine(|m| {
            let DeviceRef::Gpu(g) = m.live_device(device.addr())? else {
                return Err(NOT_SUPPORTED);
            };
            let mig = m.mig(g)?;
            Ok((c_uint::from(mig.enabled), c_uint::from(mig.pending)))
        })?;
        // SAFETY: NVML contract: both valid for an unsigned int (checked non-null).
        unsafe {
            put(current_mode, c)?;
            put(pending_mode, p)
        }
    })
}

/// Switches MIG mode. The simulated GPU applies it at once (no reset
/// needed); turning MIG off while GPU instances exist answers IN_USE.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activation_status: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    ffi(|| {
        if activation_status.is_null() || mode > 1 {
            return Err(INVALID_ARGUMENT);
        }
        let status = with_machine_mut(|m| {
            let g = m.live_gpu(device.addr())?;
            // Hopper and newer take a new MIG mode at once; older boards
            // only at the next GPU reset (the mode stays pending, as in a
            // VM where NVML cannot reset the GPU itself).
            let immediate = matches!(
                m.gpus[g].card.model.architecture,
                topology::Architecture::Hopper | topology::Architecture::Blackwell
            );
            let mig = m.mig_mut(g)?;
            if mode == 0 && !mig.gpu_instances.is_empty() {
                return Err(IN_USE);
            }
            mig.pending = mode == 1;
            if immediate || mig.pending == mig.enabled {
                mig.enabled = mig.pending;
                Ok(SUCCESS)
            } else {
                Ok(nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED)
            }
        })?;
        // SAFETY: NVML contract: valid for a return code (checked non-null).
        unsafe { put(activation_status, status) }
    })
}

/// The GPU's profile for an `NVML_GPU_INSTANCE_PROFILE_*` index.
fn profile_by_index(m: &Machine, device: nvmlDevice_t, index: c_uint) -> Result<Profile, Ret> {
    let g = m.live_gpu(device.addr())?;
    let mig = m.mig(g)?;
    if index >= NVML_GPU_INSTANCE_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    mig.cap
        .profiles
        .iter()
        .find(|p| p.index == index)
        .cloned()
        .ok_or(NOT_SUPPORTED)
}

/// The GPU's profile with NVML profile id `id`.
fn profile_by_id(m: &Machine, device: nvmlDevice_t, id: c_uint) -> Result<(usize, Profile), Ret> {
    let g = m.live_gpu(device.addr())?;
    let mig = m.mig(g)?;
    let p = mig.cap.profiles.iter().find(|p| p.id == id).cloned();
    Ok((g, p.ok_or(INVALID_ARGUMENT)?))
}

fn profile_info_v1(p: &Profile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: c_uint::from(p.p2p),
        sliceCount: p.slices,
        instanceCount: p.instances,
        multiprocessorCount: p.multiprocessors,
        copyEngineCount: p.engines.copy,
        decoderCount: p.engines.decoders,
        encoderCount: p.engines.encoders,
        jpegCount: p.engines.jpeg,
        ofaCount: p.engines.ofa,
        memorySizeMB: p.memory_mib,
    }
}

/// Writes a v2 or v3 profile info, whichever the caller's version word asks for.
///
/// # Safety
/// `info` is null or valid for the struct version its `version` word names.
unsafe fn put_profile_info_versioned(
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
    p: &Profile,
) -> Result<(), Ret> {
    if info.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null; both versions start with the version word.
    let version = unsafe { ptr::addr_of!((*info).version).read_unaligned() };
    let v1 = profile_info_v1(p);
    let name = format!("MIG {}", p.name);
    if version == struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2) {
        let mut out = nvmlGpuInstanceProfileInfo_v2_t {
            version,
            id: v1.id,
            isP2pSupported: v1.isP2pSupported,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            copyEngineCount: v1.copyEngineCount,
            decoderCount: v1.decoderCount,
            encoderCount: v1.encoderCount,
            jpegCount: v1.jpegCount,
            ofaCount: v1.ofaCount,
            memorySizeMB: v1.memorySizeMB,
            name: [0; 96],
        };
        fill_name(&mut out.name, &name);
        // SAFETY: the caller declared a v2 struct.
        unsafe { put(info, out) }
    } else if version == struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3) {
        let mut out = nvmlGpuInstanceProfileInfo_v3_t {
            version,
            id: v1.id,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            copyEngineCount: v1.copyEngineCount,
            decoderCount: v1.decoderCount,
            encoderCount: v1.encoderCount,
            jpegCount: v1.jpegCount,
            ofaCount: v1.ofaCount,
            memorySizeMB: v1.memorySizeMB,
            name: [0; 96],
            capabilities: if p.p2p {
                NVML_GPU_INSTANCE_PROFILE_CAPS_P2P
            } else {
                0
            },
        };
        fill_name(&mut out.name, &name);
        // SAFETY: the caller declared a v3 struct (larger than v2).
        unsafe { put(info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(), out) }
    } else {
        Err(ARGUMENT_VERSION_MISMATCH)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let p = with_machine(|m| profile_by_index(m, device, profile))?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, profile_info_v1(&p)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        let p = with_machine(|m| profile_by_index(m, device, profile))?;
        // SAFETY: NVML contract: null or valid for the version it names.
        unsafe { put_profile_info_versioned(info, &p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profile_id: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, p) = with_machine(|m| profile_by_id(m, device, profile_id))?;
        // SAFETY: NVML contract: null or valid for the version it names.
        unsafe { put_profile_info_versioned(info, &p) }
    })
}

/// The NVML count protocol for arrays: a null array asks for the count; a
/// short one gets INSUFFICIENT_SIZE and the count needed.
///
/// # Safety
/// `count` is null or valid; `out` is null or valid for `*count` elements.
unsafe fn put_array<T: Copy>(out: *mut T, count: *mut c_uint, items: &[T]) -> Result<(), Ret> {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let n = items.len() as c_uint;
    // SAFETY: `count` is non-null and valid by contract.
    let capacity = unsafe { count.read_unaligned() };
    // SAFETY: as above.
    unsafe { count.write_unaligned(n) };
    if out.is_null() {
        return Ok(());
    }
    if capacity < n {
        return Err(INSUFFICIENT_SIZE);
    }
    for (i, item) in items.iter().enumerate() {
        // SAFETY: i < n <= capacity, the caller's array length.
        unsafe { out.add(i).write_unaligned(*item) };
    }
    Ok(())
}

/// Every placement of a profile, whatever MIG mode is (as NVML documents).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, p) = with_machine(|m| profile_by_id(m, device, profile_id))?;
        let items: Vec<nvmlGpuInstancePlacement_t> = p
            .placements
            .starts
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.placements.size,
            })
            .collect();
        // SAFETY: NVML contract on `placements`/`count`.
        unsafe { put_array(placements, count, &items) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| {
            let (g, p) = profile_by_id(m, device, profile_id)?;
            m.mig_enabled(g)?;
            Ok(m.gpu_instance_room(g, &p).0)
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| {
            let g = m.live_gpu(device.addr())?;
            Ok(m.mig(g)?.cap.max_devices)
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let h = with_machine(|m| {
            let g = m.live_gpu(device.addr())?;
            let mig = m.mig_enabled(g)?;
            if index >= mig.cap.max_devices {
                return Err(INVALID_ARGUMENT);
            }
            let (gi, ci) = *m.mig_devices(g).get(index as usize).ok_or(NOT_FOUND)?;
            Ok(handle(Kind::Device, g, Some(gi), Some(ci)))
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(mig_device, h) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig_device: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let is_mig =
            with_machine(|m| Ok(matches!(m.device(device.addr())?, DeviceRef::Mig { .. })))?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(is_mig_device, c_uint::from(is_mig)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let g = with_machine(|m| match m.live_device(mig_device.addr())? {
            DeviceRef::Mig { gpu, .. } => Ok(gpu),
            DeviceRef::Gpu(_) => Err(INVALID_ARGUMENT),
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(device, gpu_handle(g)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let gi = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Mig { gi, .. } => Ok(gi),
            DeviceRef::Gpu(_) => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(id, gi) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let ci = with_machine(|m| match m.live_device(device.addr())? {
            DeviceRef::Mig { ci, .. } => Ok(ci),
            DeviceRef::Gpu(_) => Err(NOT_SUPPORTED),
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(id, ci) }
    })
}

// ---------------------------------------------------------------------------
// MIG: GPU instances

/// Writes the instance handles of a profile and their count.
///
/// # Safety
/// `count` is valid; `out` is valid for the profile's instanceCount
/// entries (NVML's contract), which bounds how many instances of it can
/// exist, so for `handles.len()`.
unsafe fn put_instances<T: Copy>(
    out: *mut T,
    count: *mut c_uint,
    handles: &[T],
) -> Result<(), Ret> {
    for (i, h) in handles.iter().enumerate() {
        // SAFETY: i < handles.len() <= instanceCount <= the array length.
        unsafe { out.add(i).write_unaligned(*h) };
    }
    // SAFETY: valid by the caller's contract.
    unsafe { put(count, handles.len() as c_uint) }
}

fn gi_handle(gpu: usize, gi: u32) -> nvmlGpuInstance_t {
    handle(Kind::GpuInstance, gpu, Some(gi), None)
}

fn ci_handle(gpu: usize, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    handle(Kind::ComputeInstance, gpu, Some(gi), Some(ci))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if gpu_instance.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (g, gi) = with_machine_mut(|m| {
            let g = m.live_gpu(device.addr())?;
            Ok((g, m.create_gpu_instance(g, profile_id, None)?))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(gpu_instance, gi_handle(g, gi)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if gpu_instance.is_null() || placement.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null and valid for the struct by contract.
        let wanted = unsafe { placement.read_unaligned() };
        let (g, gi) = with_machine_mut(|m| {
            let (g, p) = profile_by_id(m, device, profile_id)?;
            if wanted.size != p.placements.size {
                return Err(INVALID_ARGUMENT);
            }
            Ok((g, m.create_gpu_instance(g, profile_id, Some(wanted.start))?))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(gpu_instance, gi_handle(g, gi)) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    ffi(|| {
        with_machine_mut(|m| {
            let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
            let mig = m.mig_enabled_mut(g)?;
            if mig
                .gpu_instances
                .get(&gi)
                .is_some_and(|i| !i.compute_instances.is_empty())
            {
                return Err(IN_USE);
            }
            mig.gpu_instances.remove(&gi);
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if gpu_instances.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let handles = with_machine(|m| {
            let (g, p) = profile_by_id(m, device, profile_id)?;
            Ok(m.mig_enabled(g)?
                .gpu_instances
                .iter()
                .filter(|(id, i)| i.profile_id == p.id && m.instance_visible(g, **id, None))
                .map(|(id, _)| gi_handle(g, *id))
                .collect::<Vec<_>>())
        })?;
        // SAFETY: checked non-null; NVML contract on the array's length.
        unsafe { put_instances(gpu_instances, count, &handles) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let g = with_machine(|m| {
            let g = m.live_gpu(device.addr())?;
            m.mig_enabled(g)?.gpu_instances.get(&id).ok_or(NOT_FOUND)?;
            if !m.instance_visible(g, id, None) {
                return Err(NOT_FOUND);
            }
            Ok(g)
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(gpu_instance, gi_handle(g, id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let out = with_machine(|m| {
            let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
            let (inst, _) = m.gpu_instance_profile(g, gi).ok_or(INVALID_ARGUMENT)?;
            Ok(nvmlGpuInstanceInfo_t {
                device: gpu_handle(g),
                id: gi,
                profileId: inst.profile_id,
                placement: nvmlGpuInstancePlacement_t {
                    start: inst.start,
                    size: inst.size,
                },
            })
        })?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, out) }
    })
}

// ---------------------------------------------------------------------------
// MIG: compute instances

/// Compute instance profile info for a GPU instance, as
/// (gpu, gi, slices, GPU instance profile).
fn compute_profile(
    m: &Machine,
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
) -> Result<(usize, u32, u32, Profile), Ret> {
    let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
    if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
        return Err(INVALID_ARGUMENT);
    }
    if profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        return Err(INVALID_ARGUMENT);
    }
    let slices = machine::compute_profile_slices(profile).ok_or(NOT_SUPPORTED)?;
    let (_, p) = m.gpu_instance_profile(g, gi).ok_or(INVALID_ARGUMENT)?;
    if !compute_instance_sizes(p.slices).contains(&slices) {
        return Err(NOT_SUPPORTED);
    }
    Ok((g, gi, slices, p.clone()))
}

fn compute_profile_info(
    profile_id: u32,
    slices: u32,
    p: &Profile,
) -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        id: profile_id,
        sliceCount: slices,
        instanceCount: p.slices / slices,
        multiprocessorCount: p.multiprocessors * slices / p.slices.max(1),
        sharedCopyEngineCount: p.engines.copy,
        sharedDecoderCount: p.engines.decoders,
        sharedEncoderCount: p.engines.encoders,
        sharedJpegCount: p.engines.jpeg,
        sharedOfaCount: p.engines.ofa,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, _, slices, p) =
            with_machine(|m| compute_profile(m, gpu_instance, profile, eng_profile))?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, compute_profile_info(profile, slices, &p)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        if info.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (_, _, slices, p) =
            with_machine(|m| compute_profile(m, gpu_instance, profile, eng_profile))?;
        let v1 = compute_profile_info(profile, slices, &p);
        let name = if slices == p.slices {
            format!("MIG {}", p.name)
        } else {
            format!("MIG {slices}c.{}", p.name)
        };
        // SAFETY: non-null; both versions start with the version word.
        let version = unsafe { ptr::addr_of!((*info).version).read_unaligned() };
        let mut v2 = nvmlComputeInstanceProfileInfo_v2_t {
            version,
            id: v1.id,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            sharedCopyEngineCount: v1.sharedCopyEngineCount,
            sharedDecoderCount: v1.sharedDecoderCount,
            sharedEncoderCount: v1.sharedEncoderCount,
            sharedJpegCount: v1.sharedJpegCount,
            sharedOfaCount: v1.sharedOfaCount,
            name: [0; 96],
        };
        fill_name(&mut v2.name, &name);
        if version == struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2) {
            // SAFETY: the caller declared a v2 struct.
            unsafe { put(info, v2) }
        } else if version == struct_version::<nvmlComputeInstanceProfileInfo_v3_t>(3) {
            let v3 = nvmlComputeInstanceProfileInfo_v3_t {
                version,
                id: v2.id,
                sliceCount: v2.sliceCount,
                instanceCount: v2.instanceCount,
                multiprocessorCount: v2.multiprocessorCount,
                sharedCopyEngineCount: v2.sharedCopyEngineCount,
                sharedDecoderCount: v2.sharedDecoderCount,
                sharedEncoderCount: v2.sharedEncoderCount,
                sharedJpegCount: v2.sharedJpegCount,
                sharedOfaCount: v2.sharedOfaCount,
                name: v2.name,
                capabilities: 0,
            };
            // SAFETY: the caller declared a v3 struct.
            unsafe { put(info.cast::<nvmlComputeInstanceProfileInfo_v3_t>(), v3) }
        } else {
            Err(ARGUMENT_VERSION_MISMATCH)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let n = with_machine(|m| {
            let (g, gi, slices, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            Ok(m.compute_instance_room(g, gi, slices).len() as c_uint)
        })?;
        // SAFETY: NVML contract: null or valid for an unsigned int.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placements: *mut nvmlComputeInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let (_, _, slices, p) = with_machine(|m| compute_profile(m, gpu_instance, profile_id, 0))?;
        let items: Vec<nvmlComputeInstancePlacement_t> = compute_placements(p.slices, slices)
            .into_iter()
            .map(|start| nvmlComputeInstancePlacement_t {
                start,
                size: slices,
            })
            .collect();
        // SAFETY: NVML contract on `placements`/`count`.
        unsafe { put_array(placements, count, &items) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if compute_instance.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (g, gi, ci) = with_machine_mut(|m| {
            let (g, gi, _, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            Ok((g, gi, m.create_compute_instance(g, gi, profile_id, None)?))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(compute_instance, ci_handle(g, gi, ci)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placement: *const nvmlComputeInstancePlacement_t,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        if compute_instance.is_null() || placement.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null and valid for the struct by contract.
        let wanted = unsafe { placement.read_unaligned() };
        let (g, gi, ci) = with_machine_mut(|m| {
            let (g, gi, slices, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            if wanted.size != slices {
                return Err(INVALID_ARGUMENT);
            }
            Ok((
                g,
                gi,
                m.create_compute_instance(g, gi, profile_id, Some(wanted.start))?,
            ))
        })?;
        // SAFETY: NVML contract: valid for a handle (checked non-null).
        unsafe { put(compute_instance, ci_handle(g, gi, ci)) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(
    compute_instance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        with_machine_mut(|m| {
            let (g, gi, ci) = m.compute_instance_handle(compute_instance.addr())?;
            let mig = m.mig_enabled_mut(g)?;
            if let Some(inst) = mig.gpu_instances.get_mut(&gi) {
                inst.compute_instances.remove(&ci);
            }
            Ok(())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        if compute_instances.is_null() || count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let handles = with_machine(|m| {
            let (g, gi, _, _) = compute_profile(m, gpu_instance, profile_id, 0)?;
            let (inst, _) = m.gpu_instance_profile(g, gi).ok_or(INVALID_ARGUMENT)?;
            Ok(inst
                .compute_instances
                .iter()
                .filter(|(id, c)| {
                    c.profile_id == profile_id && m.instance_visible(g, gi, Some(**id))
                })
                .map(|(id, _)| ci_handle(g, gi, *id))
                .collect::<Vec<_>>())
        })?;
        // SAFETY: checked non-null; NVML contract on the array's length.
        unsafe { put_instances(compute_instances, count, &handles) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: nvmlGpuInstance_t,
    id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let (g, gi) = with_machine(|m| {
            let (g, gi) = m.gpu_instance(gpu_instance.addr())?;
            m.compute_instance(g, gi, id).ok_or(NOT_FOUND)?;
            Ok((g, gi))
        })?;
        // SAFETY: NVML contract: null or valid for a handle.
        unsafe { put(compute_instance, ci_handle(g, gi, id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let out = with_machine(|m| {
            let (g, gi, ci) = m.compute_instance_handle(compute_instance.addr())?;
            let c = m.compute_instance(g, gi, ci).ok_or(INVALID_ARGUMENT)?;
            Ok(nvmlComputeInstanceInfo_t {
                device: gpu_handle(g),
                gpuInstance: gi_handle(g, gi),
                id: ci,
                profileId: c.profile_id,
                placement: nvmlComputeInstancePlacement_t {
                    start: c.start,
                    size: c.slices,
                },
            })
        })?;
        // SAFETY: NVML contract: null or valid for the struct.
        unsafe { put(info, out) }
    })
}

// ---------------------------------------------------------------------------
// Events

fn event_set_id(set: nvmlEventSet_t) -> Result<u32, Ret> {
    machine::decode(Kind::EventSet, set.addr())
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

// ---------------------------------------------------------------------------
// Activity: utilization, processes, temperature, power (see `load` and
// `activity`)

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

#[cfg(test)]
mod tests;
