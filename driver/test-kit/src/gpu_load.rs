//! Load on the simulated GPUs from real processes, as the claim guard, the
//! metrics and their tests see it (the fake NVML's `load` channel).

use std::io;
use std::path::Path;
use std::process::{Child, Command};

use tessera_fake_nvml::load::{Channel, DeviceLoad, Record};

/// Points this process's fake NVML at `topology` and machine state `state`,
/// with load recording and reading on.
///
/// # Safety
/// Sets environment variables: call it before any other thread runs.
pub unsafe fn simulate_with_load(topology: &Path, state: &Path) {
    // SAFETY: the caller's (no other thread yet).
    unsafe {
        std::env::set_var("TESSERA_FAKE_NVML_TOPOLOGY", topology);
        std::env::set_var("TESSERA_FAKE_NVML_STATE", state);
        std::env::set_var(tessera_fake_nvml::load::LOAD_ENV, "1");
    }
}

/// `bytes` held on `gpu` with every SM counted busy, as an MPS client or
/// with a context of its own.
pub fn holding(gpu: &str, bytes: u64, mps_client: bool) -> DeviceLoad {
    DeviceLoad {
        uuid: gpu.to_owned(),
        memory_bytes: bytes,
        busy_until_ms: 0,
        sm_percent: 100,
        mps_client,
    }
}

/// A `sleep` holding a record that names it and says `load`, written once
/// `before(pid)` has run (what must exist before the load shows, such as
/// the process's cgroup file in a stand-in `/proc`). The caller ends it.
pub fn loaded_process(
    load: DeviceLoad,
    before: impl FnOnce(u32) -> io::Result<()>,
) -> io::Result<Child> {
    let channel = Channel::inheritable()?;
    let child = Command::new("sleep").arg("3600").spawn()?;
    let pid = child.id();
    before(pid)?;
    let identity = Record::of_process(&Path::new("/proc").join(pid.to_string()))
        .ok_or_else(|| io::Error::other(format!("/proc does not say who process {pid} is")))?;
    channel.publish(&Record {
        devices: vec![load],
        ..identity
    })?;
    Ok(child)
}
