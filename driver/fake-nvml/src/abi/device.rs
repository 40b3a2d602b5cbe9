//! Device queries: names, identity, PCI, memory, compute mode and time slice.

use std::ffi::{c_char, c_int, c_uint};
use std::ptr;

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::machine::Machine;
use crate::machine::handles::DeviceRef;
use crate::state::ComputeMode;
use crate::topology;
use crate::{
    MIB, ffi, fill_name, live_loads, put, put_str, struct_version, with_machine, with_machine_mut,
};
use crate::{activity, load};

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
