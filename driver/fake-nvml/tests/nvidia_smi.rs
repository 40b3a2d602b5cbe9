//! The `nvidia-smi` stand-in run as a program, loading the built fake
//! library as `libnvidia-ml.so.1` through the dynamic loader, as in a
//! container on a simulated node.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use tessera_fake_nvml::topology::Topology;
use tessera_fake_nvml::{DEV_ROOT_ENV, DRIVER_ROOT_ENV, EVENTS_ENV, STATE_ENV, TOPOLOGY_ENV};

const SMI: &str = env!("CARGO_BIN_EXE_nvidia-smi");
const H100X8: &str = "h100x8.yaml";
const A100: &str = "a100-40gb-x2-mig.yaml";

/// A fresh directory: the machine's state file, its device nodes and the
/// library link live here.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tessera-nvidia-smi-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("lib")).unwrap();
        std::os::unix::fs::symlink(fake_lib(), dir.join("lib/libnvidia-ml.so.1")).unwrap();
        Scratch(dir)
    }

    /// Runs the stand-in on `topology`, seeing only `dev_root`'s nodes if given.
    fn smi(&self, topology: &str, dev_root: Option<&Path>, args: &[&str]) -> Output {
        let mut cmd = Command::new(SMI);
        cmd.args(args)
            .env("LD_LIBRARY_PATH", self.0.join("lib"))
            .env(TOPOLOGY_ENV, topology_path(topology))
            .env(STATE_ENV, self.0.join(format!("{topology}.state")))
            .env_remove(EVENTS_ENV)
            .env_remove(DRIVER_ROOT_ENV)
            .env_remove(DEV_ROOT_ENV);
        if let Some(d) = dev_root {
            cmd.env(DEV_ROOT_ENV, d);
        }
        cmd.output().expect("running nvidia-smi")
    }

    /// The stand-in's stdout, which must have succeeded.
    fn ok(&self, topology: &str, dev_root: Option<&Path>, args: &[&str]) -> String {
        let out = self.smi(topology, dev_root, args);
        assert!(
            out.status.success(),
            "nvidia-smi {args:?}: {:?}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The built cdylib: next to this test binary (`deps`) or one level up.
fn fake_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libtessera_fake_nvml.so"))
        .find(|p| p.is_file())
        .expect("cargo builds the cdylib with this crate's tests")
}

fn topology_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("topologies")
        .join(name)
}

fn gpu_uuids(topology: &str) -> Vec<String> {
    let text = std::fs::read_to_string(topology_path(topology)).unwrap();
    let t = Topology::parse(&text).unwrap();
    t.gpus.iter().map(|g| g.uuid.clone()).collect()
}

/// Makes a character device node; false (reason printed) where this process may not.
fn mknod(path: &Path, major: u32, minor: u32) -> bool {
    tessera_fake_nvml::caps::mknod_char(path, major, minor)
        .map_err(|e| println!("skipped: mknod {}: {e}", path.display()))
        .is_ok()
}

/// The kernel driver's MIG capability minor of GPU instance `gi` (and
/// compute instance `ci`) on GPU minor 0: `3 + 9 * gi`, then `+ 1 + ci`.
fn cap_minor(gi: u64, ci: Option<u64>) -> u32 {
    let g = 3 + 9 * gi;
    ci.map_or(g, |c| g + 1 + c) as u32
}

#[test]
fn lists_and_queries_every_gpu() {
    let s = Scratch::new();
    let uuids = gpu_uuids(H100X8);
    let listed: String = uuids
        .iter()
        .enumerate()
        .map(|(i, u)| format!("GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {u})\n"))
        .collect();
    assert_eq!(s.ok(H100X8, None, &["-L"]), listed);
    let csv: String = uuids
        .iter()
        .map(|u| format!("{u}, NVIDIA H100 80GB HBM3, 81559 MiB\n"))
        .collect();
    assert_eq!(
        s.ok(
            H100X8,
            None,
            &["--query-gpu=uuid,name,memory.total", "--format=csv"]
        ),
        format!("uuid, name, memory.total [MiB]\n{csv}")
    );
    assert_eq!(
        s.ok(
            H100X8,
            None,
            &[
                "--query-gpu=memory.total,index,mig.mode.current",
                "--format=csv,noheader,nounits",
                "-i",
                "2"
            ]
        ),
        "81559, 2, Disabled\n"
    );
    assert_eq!(
        s.ok(
            H100X8,
            None,
            &[
                "--query-gpu=index",
                "--format=csv,noheader",
                "-i",
                &uuids[5]
            ]
        ),
        "5\n"
    );
}

#[test]
fn lists_mig_devices_under_their_gpu() {
    let s = Scratch::new();
    let uuids = gpu_uuids(A100);
    let out = s.ok(A100, None, &["-L"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5, "{out}");
    assert_eq!(
        lines[0],
        format!("GPU 0: NVIDIA A100-SXM4-40GB (UUID: {})", uuids[0])
    );
    assert!(
        lines[1].starts_with("  MIG 3g.20gb     Device  0: (UUID: MIG-"),
        "{out}"
    );
    assert!(
        lines[3].starts_with("  MIG 1g.5gb      Device  2: (UUID: MIG-"),
        "{out}"
    );
    assert_eq!(
        lines[4],
        format!("GPU 1: NVIDIA A100-SXM4-40GB (UUID: {})", uuids[1])
    );
}

#[test]
fn a_container_sees_only_its_device_nodes() {
    let s = Scratch::new();
    let uuids = gpu_uuids(H100X8);
    let dev = s.0.join("dev");
    if !(mknod(&dev.join("nvidia3"), 195, 3) && mknod(&dev.join("nvidiactl"), 195, 255)) {
        return;
    }
    assert_eq!(
        s.ok(H100X8, Some(&dev), &["-L"]),
        format!("GPU 0: NVIDIA H100 80GB HBM3 (UUID: {})\n", uuids[3])
    );
    assert_eq!(
        s.ok(
            H100X8,
            Some(&dev),
            &["--query-gpu=index,uuid", "--format=csv,noheader"]
        ),
        format!("0, {}\n", uuids[3])
    );
    let hidden = s.smi(H100X8, Some(&dev), &["-L", "-i", &uuids[0]]);
    assert_eq!(hidden.status.code(), Some(6));
    assert_eq!(
        String::from_utf8_lossy(&hidden.stdout),
        "No devices were found\n"
    );
    // No node at all: no devices.
    std::fs::remove_file(dev.join("nvidia3")).unwrap();
    assert_eq!(s.smi(H100X8, Some(&dev), &["-L"]).status.code(), Some(6));
}

#[test]
fn a_container_given_one_mig_device_sees_it_and_its_gpu_only() {
    let s = Scratch::new();
    let uuids = gpu_uuids(A100);
    // Seed the state, then read the second MIG device's ids from it.
    s.ok(A100, None, &["-L"]);
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.0.join(format!("{A100}.state"))).unwrap()).unwrap();
    let gi = &state["gpus"][0]["mig"]["gpuInstances"][1];
    let ci = &gi["computeInstances"][0];
    let (gi_id, ci_id) = (gi["id"].as_u64().unwrap(), ci["id"].as_u64().unwrap());
    let mig_uuid = ci["uuid"].as_str().unwrap();
    let dev = s.0.join("dev");
    let caps = dev.join("nvidia-caps");
    let (g, c) = (cap_minor(gi_id, None), cap_minor(gi_id, Some(ci_id)));
    if !(mknod(&dev.join("nvidia0"), 195, 0)
        && mknod(&caps.join(format!("nvidia-cap{g}")), 241, g)
        && mknod(&caps.join(format!("nvidia-cap{c}")), 241, c))
    {
        return;
    }
    assert_eq!(
        s.ok(A100, Some(&dev), &["-L"]),
        format!(
            "GPU 0: NVIDIA A100-SXM4-40GB (UUID: {})\n  MIG 2g.10gb     Device  0: (UUID: {mig_uuid})\n",
            uuids[0]
        )
    );
    // The whole GPU without capability nodes: no MIG devices.
    std::fs::remove_dir_all(&caps).unwrap();
    assert_eq!(
        s.ok(A100, Some(&dev), &["-L"]),
        format!("GPU 0: NVIDIA A100-SXM4-40GB (UUID: {})\n", uuids[0])
    );
}

#[test]
fn the_summary_names_the_driver_and_cuda_versions_and_each_gpu() {
    let s = Scratch::new();
    let text = std::fs::read_to_string(topology_path(H100X8)).unwrap();
    let t = Topology::parse(&text).unwrap();
    let gpu_rows = |out: &str| {
        out.lines()
            .filter(|l| l.contains(" NVIDIA H100 80GB HBM3 "))
            .count()
    };
    let out = s.ok(H100X8, None, &[]);
    let header = out.lines().nth(1).unwrap();
    assert!(
        header.contains(&format!("Driver Version: {} ", t.driver_version))
            && header.contains(&format!("CUDA Version: {} ", t.cuda_driver_version)),
        "{out}"
    );
    assert_eq!(gpu_rows(&out), 8, "{out}");
    // In a container given one GPU's node: that GPU alone.
    let dev = s.0.join("dev");
    if mknod(&dev.join("nvidia3"), 195, 3) && mknod(&dev.join("nvidiactl"), 195, 255) {
        let one = s.ok(H100X8, Some(&dev), &[]);
        assert_eq!(gpu_rows(&one), 1, "{one}");
    }
}

#[test]
fn failures_answer_like_the_real_tool() {
    let s = Scratch::new();
    let code = |out: Output| out.status.code();
    assert_eq!(code(s.smi(H100X8, None, &["--bogus"])), Some(2));
    assert_eq!(code(s.smi(H100X8, None, &["--query-gpu=uuid"])), Some(2));
    assert_eq!(
        code(s.smi(H100X8, None, &["--query-gpu=power.draw", "--format=csv"])),
        Some(2)
    );
    assert_eq!(code(s.smi(H100X8, None, &["-L", "-i", "8"])), Some(6));
    let broken = s.smi("no-such-topology.yaml", None, &["-L"]);
    assert_eq!(code(broken.clone()), Some(9));
    assert!(String::from_utf8_lossy(&broken.stdout).starts_with(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    ),);
}

#[test]
fn compute_policy_sets_the_time_slice_machine_wide() {
    let scratch = Scratch::new();
    let uuids = gpu_uuids(H100X8);
    let set = scratch.ok(
        H100X8,
        None,
        &["compute-policy", "-i", &uuids[1], "--set-timeslice=3"],
    );
    assert!(set.contains("Set timeslice to 3 (Long)"), "{set}");
    // Another process reads it back: GPU 1 long, GPU 0 still the default.
    let one = scratch.ok(H100X8, None, &["compute-policy", "-i", "1", "-l"]);
    assert!(
        one.contains("Timeslice                 : 3 (Long)"),
        "{one}"
    );
    let zero = scratch.ok(H100X8, None, &["compute-policy", "--list", "-i", "0"]);
    assert!(zero.contains(": 0 (Default)"), "{zero}");
    let state = std::fs::read_to_string(scratch.0.join(format!("{H100X8}.state"))).unwrap();
    assert!(state.contains("\"timeSlice\": 3"), "{state}");
    scratch.ok(
        H100X8,
        None,
        &["compute-policy", "-i", &uuids[1], "--set-timeslice", "0"],
    );
    let one = scratch.ok(H100X8, None, &["compute-policy", "-i", "1", "-l"]);
    assert!(one.contains(": 0 (Default)"), "{one}");

    // Bad values and combinations are usage errors.
    for args in [
        &["compute-policy", "--set-timeslice=4"][..],
        &["compute-policy", "-l", "--set-timeslice=1"],
        &["compute-policy"],
    ] {
        assert_eq!(
            scratch.smi(H100X8, None, args).status.code(),
            Some(2),
            "{args:?}"
        );
    }
}

#[test]
fn compute_policy_is_refused_where_the_state_is_read_only() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } == 0 {
        // Root writes through permission bits; nothing to check.
        return;
    }
    let scratch = Scratch::new();
    scratch.ok(H100X8, None, &["compute-policy", "-l"]);
    let state = scratch.0.join(format!("{H100X8}.state"));
    let lock = scratch.0.join(format!("{H100X8}.state.lock"));
    use std::os::unix::fs::PermissionsExt;
    for p in [&state, &lock] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o444)).unwrap();
    }
    std::fs::set_permissions(&scratch.0, std::fs::Permissions::from_mode(0o555)).unwrap();
    let out = scratch.smi(
        H100X8,
        None,
        &["compute-policy", "-i", "0", "--set-timeslice=2"],
    );
    std::fs::set_permissions(&scratch.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(4), "{stdout}");
    assert!(stdout.contains("Insufficient Permissions"), "{stdout}");
    // Reading still works, and nothing changed.
    let zero = scratch.ok(H100X8, None, &["compute-policy", "-i", "0", "-l"]);
    assert!(zero.contains(": 0 (Default)"), "{zero}");
}
