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
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use tessera_api::inventory::Inventory;

pub const TOPOLOGY_ENV: &str = "TESSERA_FAKE_NVML_TOPOLOGY";
pub const EVENTS_ENV: &str = "TESSERA_FAKE_NVML_EVENTS";
pub const STATE_ENV: &str = "TESSERA_FAKE_NVML_STATE";
pub const DRIVER_ROOT_ENV: &str = "TESSERA_FAKE_NVML_DRIVER_ROOT";

/// File name of the built fake library.
const FAKE_LIB: &str = "libtessera_fake_nvml.so";

/// A directory holding `libnvidia-ml.so.1`, the simulated NVML, for
/// `LD_LIBRARY_PATH`.
///
/// `tessera-fake-nvml` is a dev-dependency of this crate, so `cargo test`
/// builds its cdylib next to the test binaries (`target/<profile>/deps`)
/// before any test runs. Should it not be there (another runner's layout),
/// it is built with cargo here.
pub fn fake_nvml_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let lib = built_fake_lib().unwrap_or_else(build_fake_lib);
        let dir = scratch_dir("fake-nvml");
        // Replace atomically: other test binaries may be using the link now.
        let tmp = dir.join(format!(".libnvidia-ml.so.1.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&lib, &tmp).expect("linking the fake NVML");
        std::fs::rename(&tmp, dir.join("libnvidia-ml.so.1")).expect("placing the fake NVML");
        dir
    })
}

/// Path of the built fake library itself.
pub fn fake_nvml_lib() -> PathBuf {
    fake_nvml_dir().join("libnvidia-ml.so.1")
}

fn built_fake_lib() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    [deps.to_path_buf(), deps.parent()?.to_path_buf()]
        .into_iter()
        .map(|d| d.join(FAKE_LIB))
        .find(|p| p.is_file())
}

fn build_fake_lib() -> PathBuf {
    let out = Command::new(env!("CARGO"))
        .args(["build", "-p", "tessera-fake-nvml", "--message-format=json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo build -p tessera-fake-nvml");
    assert!(
        out.status.success(),
        "cargo build -p tessera-fake-nvml failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| {
            m["reason"] == "compiler-artifact" && m["target"]["name"] == "tessera_fake_nvml"
        })
        .flat_map(|m| m["filenames"].as_array().cloned().unwrap_or_default())
        .filter_map(|f| f.as_str().map(PathBuf::from))
        .find(|f| f.extension().is_some_and(|e| e == "so"))
        .expect("cargo reported no cdylib for tessera-fake-nvml")
}

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
