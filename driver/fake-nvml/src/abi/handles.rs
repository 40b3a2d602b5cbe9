//! Device handles: by index, UUID and PCI bus id.

use std::ffi::{c_char, c_uint};

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::machine::handles::{DeviceRef, Kind};
use crate::topology;
use crate::{ffi, get_str, gpu_handle, handle, put, with_machine};

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
