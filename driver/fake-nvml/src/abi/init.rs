//! Init, shutdown and system queries.

use std::ffi::{c_char, c_int, c_uint};

use nvml_wrapper_sys::bindings::*;

use crate::codes::*;
use crate::state::Access;
use crate::{ffi, lock, put, put_str, with_machine};
use crate::{load, visibility};

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
