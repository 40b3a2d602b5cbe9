//! The simulated GPUs' run-time state is machine-wide, as on real hardware:
//! a MIG device created by one process (as the node plugin does, through the
//! driver's NVML bindings `tessera_driver::host::mig::raw`) is seen by another (`tessera inventory`, a
//! restarted plugin), one destroyed elsewhere is gone here, the MIG
//! capability files the kernel driver would publish come and go with it, and
//! MIG or compute mode switched by another process is seen without a new
//! `nvmlInit`.
//!
//! The first process is this test binary re-run on the ignored
//! `child_first_process` test with the fake library on its library path; it
//! starts the other processes itself (`tessera inventory`, and this binary
//! again on `child_destroy` / `child_switch_modes`), all on the same state
//! file, so they are one machine. Expected ids and minors are written here
//! from the topology and NVML's / the kernel driver's numbering.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use nvml_wrapper::enum_wrappers::device::ComputeMode;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use tessera_driver::host::mig::raw;
use tessera_driver::prepare::enforce::mig_caps::{self, MigCaps};

const CHILD_ENV: &str = "TESSERA_TEST_MACHINE_WIDE_CHILD";
const TOPOLOGY: &str = "a100-40gb-x2-mig.yaml";
/// a100-40gb-x2-mig.yaml, GPU 0 (minor 0): 3g.20gb at 4:4 (GI 1), 2g.10gb
/// at 0:2 (GI 5), 1g.5gb at 2:1 (GI 13); memory slice 3 is free.
const GPU0: &str = "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10";
/// a100-40gb-x2-mig.yaml, GPU 1 (minor 1): MIG off.
const GPU1: &str = "GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee";
// GPU instance profile ids (`nvidia-smi mig -lgip`).
const P_1G: u32 = 19;
// Compute instance profile NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE.
const CI_1: u32 = 0;

/// Capability minors in the kernel driver's table: GPU instance `gi` on GPU
/// minor `gpu` is `3 + 135*gpu + 9*gi`, its compute instance `ci` follows.
fn minors(gpu: u32, gi: u32, ci: u32) -> MigCaps {
    let gpu_instance = 3 + 135 * gpu + 9 * gi;
    MigCaps {
        gpu_instance,
        compute_instance: gpu_instance + 1 + ci,
    }
}

/// This test binary on `child_<name>`, with the environment set for the
/// machine of `state` (inherited by what the child starts).
fn child(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        &format!("child_{name}"),
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

fn require_success(name: &str, cmd: &mut Command) {
    let out = cmd.output().expect("starting the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child_{name} failed:\n{text}");
    // The child must actually have run its scenario (not been filtered out).
    assert!(
        text.contains("test result: ok. 1 passed"),
        "child_{name} did not run:\n{text}"
    );
}

#[test]
fn mig_and_mode_changes_are_seen_by_every_process_of_the_machine() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("nvml.state");
    let root = dir.path().join("driver");
    let mut cmd = clean(child("first_process"));
    cmd.env(CHILD_ENV, "1")
        .env("LD_LIBRARY_PATH", fake_nvml_dir())
        .env(TOPOLOGY_ENV, topology(TOPOLOGY))
        .env(STATE_ENV, &state)
        .env(DRIVER_ROOT_ENV, &root);
    require_success("first_process", &mut cmd);
}

/// In a child: the state file and driver root of the machine.
fn child_env() -> Option<(PathBuf, PathBuf)> {
    std::env::var_os(CHILD_ENV)?;
    let var = |name| PathBuf::from(std::env::var_os(name).expect(name));
    Some((var(STATE_ENV), var(DRIVER_ROOT_ENV)))
}

fn mig_uuids(state: &Path, gpu: usize) -> Vec<String> {
    let inventory = inventory_on(&topology(TOPOLOGY), state);
    assert_eq!(inventory.gpus[gpu].uuid, [GPU0, GPU1][gpu]);
    inventory.gpus[gpu]
        .mig
        .instances()
        .iter()
        .map(|i| i.uuid.clone())
        .collect()
}

fn gi_dir(root: &Path, gpu: u32, gi: u32) -> PathBuf {
    mig_caps::caps_dir(root, gpu).join(format!("gi{gi}"))
}

/// Creates a GPU instance of `profile` at `start:size` with one compute
/// instance of `compute_profile`, as dynamic MIG does; returns the GPU and
/// compute instance ids and the MIG device's UUID.
fn create(
    nvml: &Nvml,
    gpu: &Device,
    profile: u32,
    (start, size): (u32, u32),
    compute_profile: u32,
) -> (u32, u32, String) {
    let gi = raw::create_gpu_instance(nvml, gpu, profile, start, size).unwrap();
    let gi_id = raw::gpu_instance_info(nvml, gi).unwrap().id;
    let ci = raw::create_compute_instance(nvml, gi, compute_profile).unwrap();
    let ci_id = raw::compute_instance_info(nvml, ci).unwrap().id;
    let uuid = (0..gpu.mig_device_count().unwrap())
        .map_while(|i| gpu.mig_device_by_index(i).ok())
        .find(|d| raw::mig_device_ids(nvml, d).unwrap() == (gi_id, ci_id))
        .expect("the new MIG device is listed")
        .uuid()
        .unwrap();
    (gi_id, ci_id, uuid)
}

/// Destroys GPU instance `gi_id` and its compute instances.
fn destroy(nvml: &Nvml, gpu: &Device, gi_id: u32, compute_profile: u32) {
    let gi = raw::gpu_instance_by_id(nvml, gpu, gi_id).unwrap();
    for ci in raw::compute_instances(nvml, gi, compute_profile, 8).unwrap() {
        raw::destroy_compute_instance(nvml, ci).unwrap();
    }
    raw::destroy_gpu_instance(nvml, gi).unwrap();
}

#[test]
#[ignore = "run in a child process by mig_and_mode_changes_are_seen_by_every_process_of_the_machine"]
fn child_first_process() {
    let Some((state, root)) = child_env() else {
        return;
    };
    let nvml = Nvml::init().expect("NVML (simulated) init");

    // Seeded from the topology: the capability files of GPU 0's MIG devices.
    assert_eq!(mig_caps::read(&root, 0, 1, 0).unwrap(), minors(0, 1, 0));
    assert_eq!(mig_caps::read(&root, 0, 13, 0).unwrap(), minors(0, 13, 0));
    assert!(!gi_dir(&root, 0, 14).exists());
    let before = mig_uuids(&state, 0);
    assert_eq!(before.len(), 3);

    // This process creates a MIG device the way the plugin does...
    let gpu0 = nvml.device_by_uuid(GPU0).unwrap();
    let (gi, ci, made) = create(&nvml, &gpu0, P_1G, (3, 1), CI_1);
    assert_eq!((gi, ci), (14, 0), "1g.5gb on the free slice 3");
    assert!(!before.contains(&made));
    // ...its capability files appear...
    assert_eq!(mig_caps::read(&root, 0, 14, 0).unwrap(), minors(0, 14, 0));
    // ...and another process of the machine sees it.
    let after = mig_uuids(&state, 0);
    assert_eq!(after.len(), 4);
    assert!(after.contains(&made), "{after:?}");

    // Another process (one without the driver root in its environment: the
    // machine remembers it) destroys it...
    require_success(
        "destroy",
        child("destroy")
            .env("LD_LIBRARY_PATH", fake_nvml_dir())
            .env_remove(DRIVER_ROOT_ENV),
    );
    // ...and it is gone here, without a new init, and from the /proc tree.
    assert!(matches!(
        nvml.device_by_uuid(made.as_str()),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        raw::gpu_instance_by_id(&nvml, &gpu0, 14),
        Err(NvmlError::NotFound)
    ));
    assert!(!gi_dir(&root, 0, 14).exists());
    assert!(mig_caps::read(&root, 0, 14, 0).is_err());
    assert_eq!(mig_uuids(&state, 0), before);

    // Another process asks for GPU 1's MIG mode on and sets GPU 0's compute mode:
    // seen here without a new init.
    let gpu1 = nvml.device_by_uuid(GPU1).unwrap();
    assert_eq!(gpu1.mig_mode().unwrap().current, 0);
    assert_eq!(gpu0.compute_mode().unwrap(), ComputeMode::Default);
    require_success(
        "switch_modes",
        child("switch_modes").env("LD_LIBRARY_PATH", fake_nvml_dir()),
    );
    // An A100 takes the new MIG mode at its next reset: pending, seen here.
    let mode = gpu1.mig_mode().unwrap();
    assert_eq!((mode.current, mode.pending), (0, 1));
    assert_eq!(gpu0.compute_mode().unwrap(), ComputeMode::ExclusiveProcess);
    assert!(mig_uuids(&state, 1).is_empty());
}

#[test]
#[ignore = "run in a child process by child_first_process"]
fn child_destroy() {
    let Some(_) = child_env_without_root() else {
        return;
    };
    let nvml = Nvml::init().expect("NVML (simulated) init");
    // Created by the other process: this one finds and destroys it.
    let gpu0 = nvml.device_by_uuid(GPU0).unwrap();
    let gi = raw::gpu_instance_by_id(&nvml, &gpu0, 14).expect("GPU instance 14 is there");
    let info = raw::gpu_instance_info(&nvml, gi).unwrap();
    assert_eq!(
        (info.profileId, info.placement.start, info.placement.size),
        (P_1G, 3, 1)
    );
    destroy(&nvml, &gpu0, 14, CI_1);
}

/// In a child started without the driver root: its state file.
fn child_env_without_root() -> Option<PathBuf> {
    std::env::var_os(CHILD_ENV)?;
    assert!(std::env::var_os(DRIVER_ROOT_ENV).is_none());
    Some(PathBuf::from(std::env::var_os(STATE_ENV).expect(STATE_ENV)))
}

#[test]
#[ignore = "run in a child process by child_first_process"]
fn child_switch_modes() {
    if child_env().is_none() {
        return;
    }
    let nvml = Nvml::init().expect("NVML (simulated) init");
    nvml.device_by_uuid(GPU1)
        .unwrap()
        .set_mig_mode(true)
        .unwrap();
    nvml.device_by_uuid(GPU0)
        .unwrap()
        .set_compute_mode(ComputeMode::ExclusiveProcess)
        .unwrap();
}
