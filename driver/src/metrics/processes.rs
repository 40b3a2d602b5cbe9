//! NVML's lists of the processes on a device, in one call where they fit.
//!
//! nvml-wrapper asks NVML for a list's length and then for the list: two
//! calls, each a round trip to the kernel driver (on the simulated GPU, a
//! walk over every process's descriptors). The claim guard reads two lists
//! per guarded GPU every period, so a list is asked for with room for the
//! usual number of processes, and asked again with the length NVML answered
//! only when more run. A list that grew between two calls is asked for
//! again too, where nvml-wrapper's MPS list fails.

use std::ffi::c_uint;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlProcessInfo_t, nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE as INSUFFICIENT_SIZE,
};

/// Which of a device's two process lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessList {
    /// Processes with a compute context of their own (MPS servers too).
    Compute,
    /// Clients of an MPS server.
    MpsClients,
}

/// Room on the first call: more than a device usually runs.
const FIRST_ROOM: usize = 32;
/// Extra room when asking again, for processes started in between.
const HEADROOM: usize = 8;
/// Calls before a list that keeps outgrowing its room is given up.
const CALLS: usize = 4;

/// The processes in `list` on `device`.
pub fn running(
    nvml: &Nvml,
    device: &Device,
    list: ProcessList,
) -> Result<Vec<ProcessInfo>, NvmlError> {
    let lib = nvml.lib();
    let sym = nvml_sym(match list {
        ProcessList::Compute => lib.nvmlDeviceGetComputeRunningProcesses_v3.as_ref(),
        ProcessList::MpsClients => lib.nvmlDeviceGetMPSComputeRunningProcesses_v3.as_ref(),
    })?;
    let mut room = FIRST_ROOM;
    for _ in 0..CALLS {
        let empty = nvmlProcessInfo_t {
            pid: 0,
            usedGpuMemory: 0,
            gpuInstanceId: 0,
            computeInstanceId: 0,
        };
        let mut infos = vec![empty; room];
        let mut count = room as c_uint;
        // SAFETY: the device handle belongs to `nvml`, which outlives the
        // call; `infos` holds `count` entries of the type the v3 call fills.
        let code = unsafe { sym(device.handle(), &mut count, infos.as_mut_ptr()) };
        if code == INSUFFICIENT_SIZE {
            room = count as usize + HEADROOM;
            continue;
        }
        nvml_try(code)?;
        infos.truncate(count as usize);
        return Ok(infos.into_iter().map(ProcessInfo::from).collect());
    }
    Err(NvmlError::InsufficientSize(Some(room)))
}
