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

mod abi;
mod activity;
pub mod caps;
mod codes;
mod events;
pub mod gpu_info;
pub mod load;
mod machine;
mod state;
pub mod sync;
pub mod topology;
mod visibility;

pub use abi::*;

use std::ffi::{CStr, c_char, c_uint};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::ptr;
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::machine::Machine;
use crate::machine::handles::{Kind, encode};
use crate::state::{Access, Store};
use crate::sync::Locked;
use crate::topology::Topology;

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
    LIB.locked()
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

fn gi_handle(gpu: usize, gi: u32) -> nvmlGpuInstance_t {
    handle(Kind::GpuInstance, gpu, Some(gi), None)
}

fn ci_handle(gpu: usize, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    handle(Kind::ComputeInstance, gpu, Some(gi), Some(ci))
}

/// NVML's struct version word: size in the low bits, version in the top byte.
const fn struct_version<T>(version: u32) -> u32 {
    (std::mem::size_of::<T>() as u32) | (version << 24)
}

/// Bytes in a MiB, the unit of the topology's memory sizes.
const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------
// Loading: where the simulated machine comes from

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
    if let Some(c) = TEST_CONFIG.locked().clone() {
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

#[cfg(test)]
mod tests;
