use super::*;
use crate::cdi::{Device, DeviceNode, Mount, Spec};
use std::os::unix::fs::PermissionsExt;

fn spec(kind: &str, devices: &[(&str, &str)]) -> Spec {
    Spec {
        cdi_version: "0.5.0".into(),
        kind: kind.into(),
        devices: devices
            .iter()
            .map(|(name, var)| Device {
                name: (*name).into(),
                container_edits: ContainerEdits {
                    env: vec![format!("{var}=1")],
                    device_nodes: vec![DeviceNode {
                        path: "/dev/nvidia0".into(),
                        host_path: None,
                        permissions: None,
                    }],
                    mounts: Vec::new(),
                },
            })
            .collect(),
        container_edits: ContainerEdits {
            env: vec!["COMMON=1".into()],
            mounts: vec![Mount {
                host_path: "/opt/x/libcuda.so.1".into(),
                container_path: "/usr/lib/libcuda.so.1".into(),
                options: Vec::new(),
                mount_type: None,
            }],
            ..ContainerEdits::default()
        },
    }
}

fn write(dir: &Path, file: &str, spec: &Spec) {
    std::fs::write(dir.join(file), serde_json::to_vec(spec).unwrap()).unwrap();
}

#[test]
fn a_device_gets_its_specs_common_edits_then_its_own() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "a.json",
        &spec("gpu.tessera.dev/claim", &[("u-0", "A"), ("u-1", "B")]),
    );
    std::fs::write(
        dir.path().join("other.json"),
        r#"{"cdiVersion":"0.7.0","kind":"x/y","devices":[],"annotations":{}}"#,
    )
    .unwrap();
    let got = find(dir.path(), "gpu.tessera.dev/claim=u-1").unwrap();
    assert_eq!(got.edits.env, ["COMMON=1", "B=1"]);
    assert_eq!(got.edits.device_nodes.len(), 1);
    assert_eq!(got.edits.mounts[0].container_path, "/usr/lib/libcuda.so.1");
}

/// A claim's device and the driver's, as prepare answers them: their
/// edits in order, a node or mount of one path once (a device listed twice
/// is applied once, as runtimes do).
#[test]
fn devices_edits_add_up_in_order_and_a_path_is_made_once() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "claim.json",
        &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
    );
    write(
        dir.path(),
        "driver.json",
        &spec("gpu.tessera.dev/driver", &[("cuda", "C")]),
    );
    let ids = [
        "gpu.tessera.dev/claim=u-0",
        "gpu.tessera.dev/driver=cuda",
        "gpu.tessera.dev/driver=cuda",
    ]
    .map(String::from);
    let got = find_all(dir.path(), &ids).unwrap();
    assert_eq!(got.device, ids.join(","));
    assert_eq!(
        got.edits.env,
        ["COMMON=1", "A=1", "COMMON=1", "C=1", "COMMON=1", "C=1"]
    );
    assert_eq!(got.edits.device_nodes.len(), 1, "{:?}", got.edits);
    assert_eq!(got.edits.mounts.len(), 1, "{:?}", got.edits);
    let e = find_all(dir.path(), &["gpu.tessera.dev/driver=nvml".into()]).unwrap_err();
    assert!(e.to_string().contains("driver=nvml"), "{e}");
}

#[test]
fn a_missing_or_ambiguous_device_is_named_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "a.json",
        &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
    );
    let e = find(dir.path(), "gpu.tessera.dev/claim=u-9").unwrap_err();
    assert!(e.to_string().contains("is the claim prepared?"), "{e}");
    let e = find(dir.path(), "u-0").unwrap_err();
    assert!(e.to_string().contains("VENDOR/CLASS=NAME"), "{e}");
    write(
        dir.path(),
        "b.json",
        &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
    );
    let e = find(dir.path(), "gpu.tessera.dev/claim=u-0").unwrap_err();
    assert!(e.to_string().contains("2 specs"), "{e}");
}

#[test]
fn only_plain_paths_under_dev_are_made_there() {
    assert_eq!(below_dev("/dev/shm"), Some("shm"));
    assert_eq!(below_dev("/dev/dri/card0"), Some("dri/card0"));
    for path in [
        "/dev",
        "/dev/",
        "/dev/../etc/passwd",
        "/dev/shm/../../x",
        "/dev/./shm",
        "/dev//shm",
        "/dev/shm/",
        "dev/shm",
        "/tmp/tessera-mps/x/pipe",
    ] {
        assert_eq!(below_dev(path), None, "{path}");
    }
    assert!(plain_absolute("/usr/lib/libcuda.so.1"));
    assert!(!plain_absolute("/usr/lib/../../etc"));
    assert!(!plain_absolute("relative"));
    assert!(!plain_absolute("/"));
}

#[test]
fn a_device_node_or_dev_mount_outside_dev_is_refused_before_anything_is_made() {
    let mut edits = Edits {
        device: "gpu.tessera.dev/claim=c-0".into(),
        edits: ContainerEdits::default(),
    };
    edits.edits.device_nodes.push(DeviceNode {
        path: "/tmp/nvidia0".into(),
        host_path: Some("/dev/null".into()),
        permissions: None,
    });
    // Refused before unshare(2): nothing of this test process changes.
    let e = enter(
        &edits,
        &Shape {
            driver_root: "/".into(),
            ..Shape::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("\"/tmp/nvidia0\" is not a plain path under /dev"),
        "{e}"
    );
    edits.edits.device_nodes.clear();
    edits.edits.mounts.push(Mount {
        host_path: "/dev/shm".into(),
        container_path: "/dev/../tmp/x".into(),
        options: Vec::new(),
        mount_type: None,
    });
    let e = enter(
        &edits,
        &Shape {
            driver_root: "/".into(),
            ..Shape::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("\"/dev/../tmp/x\" is not a plain absolute path"),
        "{e}"
    );
}

#[test]
fn libcuda_is_loaded_only_from_the_driver_root() {
    let root = tempfile::tempdir().unwrap();
    let lib = root.path().join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libcuda.so.1"), "").unwrap();
    let real = std::fs::canonicalize(lib.join("libcuda.so.1")).unwrap();
    let mount = |host: &Path| Mount {
        host_path: host.to_str().unwrap().into(),
        container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
        options: Vec::new(),
        mount_type: None,
    };
    let got = driver_library("d", root.path(), &mount(&real)).unwrap();
    assert_eq!(got, real);
    let elsewhere = tempfile::tempdir().unwrap();
    let evil = elsewhere.path().join("libcuda.so.1");
    std::fs::write(&evil, "").unwrap();
    let e = driver_library("d", root.path(), &mount(&evil)).unwrap_err();
    assert!(e.to_string().contains("not the driver's library"), "{e}");
}

#[test]
fn a_cdi_dir_others_can_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "a.json",
        &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
    );
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = find(dir.path(), "gpu.tessera.dev/claim=u-0").unwrap_err();
    assert!(
        e.to_string()
            .contains("writable by its group or others (mode 777)"),
        "{e}"
    );
    assert!(e.to_string().contains("chmod go-w"), "{e}");
}

/// A spec dir holding `a.json` (device u-0) beside `b.json`, which the
/// test spoils.
fn beside_a_good_spec() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    write(
        dir.path(),
        "a.json",
        &spec("gpu.tessera.dev/claim", &[("u-0", "A")]),
    );
    dir
}

fn refused(dir: &Path) -> String {
    find(dir, "gpu.tessera.dev/claim=u-0")
        .unwrap_err()
        .to_string()
}

#[test]
fn spec_files_are_regular_not_writable_by_others_and_small() {
    let dir = beside_a_good_spec();
    let b = dir.path().join("b.json");
    std::fs::write(&b, "{}").unwrap();
    std::fs::set_permissions(&b, std::fs::Permissions::from_mode(0o666)).unwrap();
    let e = refused(dir.path());
    assert!(e.contains("b.json: writable by its group or others"), "{e}");

    std::fs::remove_file(&b).unwrap();
    std::os::unix::fs::symlink(dir.path().join("a.json"), &b).unwrap();
    let e = refused(dir.path());
    assert!(
        e.contains("b.json: opening it (symlinks are not followed"),
        "{e}"
    );

    // A FIFO is refused at once, not read (which would block).
    std::fs::remove_file(&b).unwrap();
    let c = CString::new(b.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let e = refused(dir.path());
    assert!(e.contains("b.json: not a regular file (a FIFO)"), "{e}");

    std::fs::remove_file(&b).unwrap();
    let big = File::create(&b).unwrap();
    big.set_len(MAX_SPEC_BYTES + 1).unwrap();
    let e = refused(dir.path());
    assert!(e.contains("b.json: larger than 1048576 bytes"), "{e}");

    std::fs::remove_file(&b).unwrap();
    assert!(find(dir.path(), "gpu.tessera.dev/claim=u-0").is_ok());
}

#[test]
fn a_spec_owned_by_another_user_is_refused() {
    // SAFETY: plain syscalls.
    if unsafe { libc::geteuid() } != 0 {
        println!("*** SKIPPED: giving a file to another user needs root");
        return;
    }
    let dir = beside_a_good_spec();
    let b = dir.path().join("b.json");
    std::fs::write(&b, "{}").unwrap();
    std::os::unix::fs::chown(&b, Some(65534), None).unwrap();
    let e = refused(dir.path());
    assert!(e.contains("b.json: owned by uid 65534, not root"), "{e}");
}

#[test]
fn only_a_gpus_own_node_is_withheld() {
    for gpu in ["/dev/nvidia0", "/dev/nvidia7", "/dev/nvidia15"] {
        assert!(is_gpu_node(gpu), "{gpu}");
    }
    for other in [
        "/dev/nvidia",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
        "/dev/nvidia-caps/nvidia-cap21",
        "/dev/nvidia0x",
        "/dev/dri/card0",
    ] {
        assert!(!is_gpu_node(other), "{other}");
    }
}

#[test]
fn a_failed_step_says_what_it_did_and_keeps_the_systems_reason() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let e = find(&missing, "gpu.tessera.dev/claim=u-0").unwrap_err();
    assert!(matches!(e, ContainerError::OpenDir { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!("--cdi-dir {}: opening it", missing.display())
    );
    let source = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .expect("the io error as the source");
    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
}
