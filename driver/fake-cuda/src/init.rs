//! Initialization: `cuInit` reads the process's environment and the
//! machine once, and `cuDriverGetVersion`.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint};

use crate::codes::*;
use crate::{
    Device, FIRST_ADDRESS, LoadRecord, Session, VISIBLE_DEVICES_ENV, env_var, ffi, lock, put,
    with_session,
};
use crate::{machine, mps, visible};

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
