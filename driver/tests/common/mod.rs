//! Shared by the integration tests: the simulated NVML and running `tessera`
//! against it.
//!
//! NVML is process-global (one library, one topology per process), so every
//! scenario runs in its own process: the `tessera` binary, or this test binary
//! re-run as a child. The simulated GPUs' run-time state (MIG instances, MIG
//! and compute mode) is machine-wide, in a state file: every simulated
//! machine gets one of its own ([`fresh_state`]), and processes meant to be
//! the same machine share it ([`tessera_on`], [`inventory_on`]).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use tessera_api::inventory::Inventory;

pub const TOPOLOGY_ENV: &str = "TESSERA_FAKE_NVML_TOPOLOGY";
pub const EVENTS_ENV: &str = "TESSERA_FAKE_NVML_EVENTS";
pub const STATE_ENV: &str = "TESSERA_FAKE_NVML_STATE";
pub const DRIVER_ROOT_ENV: &str = "TESSERA_FAKE_NVML_DRIVER_ROOT";

/// A directory holding `libnvidia-ml.so.1`, the simulated NVML, for
/// `LD_LIBRARY_PATH`.
pub use tessera_test_kit::artifacts::fake_nvml_dir;

/// A directory of this crate's under cargo's per-target scratch space.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).expect("creating a scratch directory");
    dir
}

/// A state file path no other simulated machine uses: one machine, seeded
/// from its topology by the first process that uses it. Left over from an
/// earlier run under the same name, it is removed first.
pub fn fresh_state(name: &str) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let path = scratch_dir("nvml-state").join(format!(
        "{name}-{}-{}.state",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    remove_state(&path);
    path
}

/// Removes a state file and its lock.
pub fn remove_state(state: &Path) {
    let _ = std::fs::remove_file(state);
    let mut lock = state.as_os_str().to_owned();
    lock.push(".lock");
    let _ = std::fs::remove_file(lock);
}

/// A shipped topology file.
pub fn topology(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fake-nvml/topologies")
        .join(name)
}

/// Writes a test-only topology and returns its path.
pub fn write_topology(name: &str, text: &str) -> PathBuf {
    let path = scratch_dir("topologies").join(name);
    std::fs::write(&path, text).expect("writing a topology");
    path
}

/// A command with no NVML-related settings inherited from the caller.
pub fn clean(mut cmd: Command) -> Command {
    cmd.env_remove(TOPOLOGY_ENV)
        .env_remove(EVENTS_ENV)
        .env_remove(STATE_ENV)
        .env_remove(DRIVER_ROOT_ENV)
        .env_remove("TESSERA_NVML_LIBRARY")
        .env_remove("LD_LIBRARY_PATH");
    cmd
}

/// `tessera <args>` with the simulated NVML on a fresh machine of `topology`.
pub fn tessera(topology: &Path, args: &[&str]) -> Output {
    let state = fresh_state("tessera");
    let out = tessera_on(topology, &state, args);
    remove_state(&state);
    out
}

/// `tessera <args>` on the simulated machine of `topology` whose run-time
/// state is in `state` (shared with whatever else uses that file).
pub fn tessera_on(topology: &Path, state: &Path, args: &[&str]) -> Output {
    let mut cmd = clean(Command::new(env!("CARGO_BIN_EXE_tessera")));
    cmd.args(args)
        .env("LD_LIBRARY_PATH", fake_nvml_dir())
        .env(TOPOLOGY_ENV, topology)
        .env(STATE_ENV, state);
    cmd.output().expect("running tessera")
}

/// `tessera inventory --output json` on a fresh machine of `topology`,
/// which must succeed.
pub fn inventory(topology: &Path) -> Inventory {
    let state = fresh_state("inventory");
    let inventory = inventory_on(topology, &state);
    remove_state(&state);
    inventory
}

/// `tessera inventory --output json` on the machine whose state is in
/// `state`, which must succeed.
pub fn inventory_on(topology: &Path, state: &Path) -> Inventory {
    let out = tessera_on(topology, state, &["inventory", "--output", "json"]);
    assert!(
        out.status.success(),
        "tessera inventory failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}):\n{}", String::from_utf8_lossy(&out.stdout)))
}

/// Mount points below `dir`, from this process's mountinfo.
pub fn mounts_below(dir: &Path) -> Vec<String> {
    let prefix = format!("{}/", dir.display());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(str::to_owned)
        .collect()
}

/// Detaches every mount below `dir`: the tmpfs an MPS daemon's directories
/// get, left by a test that failed before releasing them.
pub fn detach_mounts_below(dir: &Path) {
    for mount in mounts_below(dir) {
        let Ok(mount) = std::ffi::CString::new(mount) else {
            continue;
        };
        // SAFETY: a NUL-terminated path of a mount below the test's directory.
        unsafe { libc::umount2(mount.as_ptr(), libc::MNT_DETACH) };
    }
}
