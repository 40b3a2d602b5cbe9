//! The devices this process may use, as the simulated machine has them.
//!
//! Everything is read through the fake NVML's C ABI, in-process (the rlib of
//! `tessera-fake-nvml`, not a second copy of `libnvidia-ml.so.1`): the same
//! topology and machine-wide state file, the same container visibility
//! (`TESSERA_FAKE_NVML_DEV_ROOT`), the same MIG devices and compute modes
//! any other process on the machine sees. Only a whole GPU's SM count is
//! not an NVML query; it comes from the topology file (parsed by the fake
//! NVML's own `topology` module).

use std::ffi::{CStr, c_char, c_uint};
use std::ptr;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlDeviceAttributes_t, nvmlMemory_v2_t, nvmlPciInfo_t,
    nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST, nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};
use tessera_fake_nvml as nvml;
use tessera_fake_nvml::topology::Topology;

use crate::codes::*;

/// One device CUDA could enumerate: a GPU not in MIG mode, or a MIG device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Physical {
    /// `GPU-...` or `MIG-...`, as NVML spells it.
    pub uuid: String,
    /// The physical GPU's UUID (the same as `uuid` for a GPU).
    pub gpu_uuid: String,
    pub name: String,
    /// Total memory, bytes.
    pub memory_bytes: u64,
    /// Memory the driver keeps for itself, bytes.
    pub reserved_bytes: u64,
    pub multiprocessors: u32,
    pub compute_capability: (i32, i32),
    /// PCI domain, bus and device of the GPU.
    pub pci: (u32, u32, u32),
    /// `nvmlComputeMode_t` of the GPU, which `CUcomputemode` numbers alike.
    pub compute_mode: u32,
}

/// Turns an NVML return code into a Result.
fn ok(ret: nvmlReturn_t) -> Result<(), nvmlReturn_t> {
    if ret == nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(ret)
    }
}

/// Holds an NVML session open; shut down on drop.
struct Session;

impl Session {
    fn open() -> Result<Session, CUresult> {
        match nvml::nvmlInit_v2() {
            r if r == nvmlReturn_enum_NVML_SUCCESS => Ok(Session),
            // The machine has no usable driver (a topology's init fault).
            r if r != nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_UNKNOWN => {
                Err(NO_DEVICE)
            }
            // No or a broken topology or state file; the fake NVML said
            // what on stderr.
            _ => Err(UNKNOWN),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        nvml::nvmlShutdown();
    }
}

/// The CUDA driver version the machine's driver supports
/// (`1000 * major + 10 * minor`).
pub fn driver_version() -> Result<i32, CUresult> {
    let _session = Session::open()?;
    let mut v = 0;
    // SAFETY: a valid out-pointer.
    ok(unsafe { nvml::nvmlSystemGetCudaDriverVersion_v2(&mut v) }).map_err(|_| UNKNOWN)?;
    Ok(v)
}

/// The devices this process sees, in CUDA's default order: GPUs in NVML
/// (PCI) order; a GPU in MIG mode stands for its MIG devices (in NVML
/// order), never for itself; a lost GPU is left out.
pub fn devices() -> Result<(i32, Vec<Physical>), CUresult> {
    let _session = Session::open()?;
    let topology = topology()?;
    let mut version = 0;
    // SAFETY: a valid out-pointer.
    ok(unsafe { nvml::nvmlSystemGetCudaDriverVersion_v2(&mut version) }).map_err(|_| UNKNOWN)?;
    let mut count: c_uint = 0;
    // SAFETY: a valid out-pointer.
    ok(unsafe { nvml::nvmlDeviceGetCount_v2(&mut count) }).map_err(|_| UNKNOWN)?;
    let mut out = Vec::new();
    for index in 0..count {
        let mut gpu: nvmlDevice_t = ptr::null_mut();
        // SAFETY: a valid out-pointer.
        ok(unsafe { nvml::nvmlDeviceGetHandleByIndex_v2(index, &mut gpu) }).map_err(|_| UNKNOWN)?;
        match gpu_devices(gpu, &topology) {
            Ok(mut found) => out.append(&mut found),
            Err(r) if r == nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => {}
            Err(_) => return Err(UNKNOWN),
        }
    }
    Ok((version, out))
}

/// The topology the fake NVML loaded, for the SM counts of whole GPUs.
fn topology() -> Result<Topology, CUresult> {
    let path = std::env::var_os(nvml::TOPOLOGY_ENV).ok_or(UNKNOWN)?;
    let text = std::fs::read_to_string(&path).map_err(|_| UNKNOWN)?;
    Topology::parse(&text).map_err(|_| UNKNOWN)
}

/// The CUDA devices of one GPU: itself, or its MIG devices.
fn gpu_devices(gpu: nvmlDevice_t, topology: &Topology) -> Result<Vec<Physical>, nvmlReturn_t> {
    let gpu_uuid = uuid(gpu)?;
    let (mut current, mut pending) = (0, 0);
    // SAFETY: valid out-pointers. Models without MIG answer NOT_SUPPORTED.
    let mig = unsafe { nvml::nvmlDeviceGetMigMode(gpu, &mut current, &mut pending) }
        == nvmlReturn_enum_NVML_SUCCESS
        && current == 1;
    let mut pci: nvmlPciInfo_t = unsafe_zeroed();
    // SAFETY: a valid out-pointer.
    ok(unsafe { nvml::nvmlDeviceGetPciInfo_v3(gpu, &mut pci) })?;
    let mut compute_mode = 0;
    // SAFETY: a valid out-pointer.
    ok(unsafe { nvml::nvmlDeviceGetComputeMode(gpu, &mut compute_mode) })?;
    let base = Physical {
        uuid: gpu_uuid.clone(),
        gpu_uuid: gpu_uuid.clone(),
        name: name(gpu)?,
        memory_bytes: 0,
        reserved_bytes: 0,
        multiprocessors: 0,
        compute_capability: compute_capability(gpu)?,
        pci: (pci.domain, pci.bus, pci.device),
        compute_mode,
    };
    if !mig {
        let (memory_bytes, reserved_bytes) = memory(gpu)?;
        let multiprocessors = topology
            .gpus
            .iter()
            .find(|c| c.uuid.eq_ignore_ascii_case(&gpu_uuid))
            .map_or(0, |c| c.model.multiprocessors);
        return Ok(vec![Physical {
            memory_bytes,
            reserved_bytes,
            multiprocessors,
            ..base
        }]);
    }
    let mut max: c_uint = 0;
    // SAFETY: a valid out-pointer.
    ok(unsafe { nvml::nvmlDeviceGetMaxMigDeviceCount(gpu, &mut max) })?;
    let mut out = Vec::new();
    for i in 0..max {
        let mut dev: nvmlDevice_t = ptr::null_mut();
        // SAFETY: a valid out-pointer.
        if unsafe { nvml::nvmlDeviceGetMigDeviceHandleByIndex(gpu, i, &mut dev) }
            != nvmlReturn_enum_NVML_SUCCESS
        {
            break;
        }
        let mut attrs: nvmlDeviceAttributes_t = unsafe_zeroed();
        // SAFETY: a valid out-pointer.
        ok(unsafe { nvml::nvmlDeviceGetAttributes_v2(dev, &mut attrs) })?;
        let (memory_bytes, reserved_bytes) = memory(dev)?;
        out.push(Physical {
            uuid: uuid(dev)?,
            name: name(dev)?,
            memory_bytes,
            reserved_bytes,
            multiprocessors: attrs.multiprocessorCount,
            ..base.clone()
        });
    }
    Ok(out)
}

/// A zeroed NVML struct (plain C data: all-zero is a valid value).
fn unsafe_zeroed<T: Copy>() -> T {
    // SAFETY: only used for NVML's plain-data structs.
    unsafe { std::mem::zeroed() }
}

fn text(f: impl FnOnce(*mut c_char, c_uint) -> nvmlReturn_t) -> Result<String, nvmlReturn_t> {
    let mut buf = [0 as c_char; 128];
    ok(f(buf.as_mut_ptr(), buf.len() as c_uint))?;
    // SAFETY: NVML NUL-terminates what it writes into the buffer.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

fn uuid(d: nvmlDevice_t) -> Result<String, nvmlReturn_t> {
    // SAFETY: the buffer is valid for its length.
    text(|b, n| unsafe { nvml::nvmlDeviceGetUUID(d, b, n) })
}

fn name(d: nvmlDevice_t) -> Result<String, nvmlReturn_t> {
    // SAFETY: the buffer is valid for its length.
    text(|b, n| unsafe { nvml::nvmlDeviceGetName(d, b, n) })
}

/// The device's memory and what its driver reserves. Not v1's `used`:
/// that also counts what running processes hold, which the library counts
/// itself, at the moment it asks rather than at cuInit.
fn memory(d: nvmlDevice_t) -> Result<(u64, u64), nvmlReturn_t> {
    let mut m: nvmlMemory_v2_t = unsafe_zeroed();
    // nvml.h's nvmlMemory_v2: the struct's size with version 2 on top.
    m.version = std::mem::size_of::<nvmlMemory_v2_t>() as u32 | (2 << 24);
    // SAFETY: a valid out-pointer with its version set.
    ok(unsafe { nvml::nvmlDeviceGetMemoryInfo_v2(d, &mut m) })?;
    Ok((m.total, m.reserved))
}

fn compute_capability(d: nvmlDevice_t) -> Result<(i32, i32), nvmlReturn_t> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { nvml::nvmlDeviceGetCudaComputeCapability(d, &mut major, &mut minor) })?;
    Ok((major, minor))
}
