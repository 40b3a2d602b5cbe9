use super::*;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::process::Command;

struct Pipe {
    _dir: tempfile::TempDir,
    spec: ViewSpec,
    _control: UnixListener,
    endpoint: (u64, u64),
    outside: UnixListener,
}

/// A pipe directory with a listening control endpoint, and a socket
/// outside it a tenant would like the client to reach.
fn pipe() -> Pipe {
    let dir = tempfile::tempdir().unwrap();
    let at = |p: &str| dir.path().join(p);
    for d in ["view", "pipe", "log", "shm"] {
        std::fs::create_dir(at(d)).unwrap();
    }
    let control = UnixListener::bind(at("pipe/control")).unwrap();
    let meta = std::fs::symlink_metadata(at("pipe/control")).unwrap();
    let outside = UnixListener::bind(at("outside")).unwrap();
    outside.set_nonblocking(true).unwrap();
    std::fs::write(at("pipe/left-by-a-tenant"), "x").unwrap();
    let spec = ViewSpec {
        root: at("view"),
        driver_root: "/".into(),
        dev_root: "/".into(),
        gpu_minor: None,
        binary: "/bin/sh".into(),
        pipe_dir: at("pipe"),
        log_dir: at("log"),
        shm_dir: at("shm"),
    };
    Pipe {
        spec,
        _control: control,
        endpoint: (meta.dev(), meta.ino()),
        outside,
        _dir: dir,
    }
}

/// `sh -c script` in the view; `None` where this process may not make
/// mount namespaces (then there is nothing to test).
fn run_in(view: View, script: &str) -> Option<std::io::Result<std::process::ExitStatus>> {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c").arg(script);
    // SAFETY: `enter` makes only async-signal-safe system calls.
    unsafe { cmd.pre_exec(move || view.enter()) };
    match cmd.status() {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => None,
        other => Some(other),
    }
}

#[test]
fn the_client_sees_only_the_endpoint_it_was_given() {
    let p = pipe();
    let pipe_dir = p.spec.pipe_dir.display().to_string();
    let view = View::prepare(
        &p.spec,
        Role::Client {
            endpoint: p.endpoint,
        },
    )
    .unwrap();
    let script = format!(
        "test -S {pipe_dir}/control && test ! -e {pipe_dir}/left-by-a-tenant && \
         test ! -e {outside} && test ! -e /proc/1",
        outside = p.spec.root.parent().unwrap().join("outside").display()
    );
    let Some(status) = run_in(view, &script) else {
        return;
    };
    assert!(
        status.unwrap().success(),
        "the client saw more than its endpoint"
    );
}

#[test]
fn a_link_swapped_in_for_the_endpoint_is_never_reached() {
    let p = pipe();
    let view = View::prepare(
        &p.spec,
        Role::Client {
            endpoint: p.endpoint,
        },
    )
    .unwrap();
    // After the driver looked: the endpoint becomes a link outside.
    let control = p.spec.pipe_dir.join("control");
    std::fs::rename(&control, p.spec.pipe_dir.join("moved")).unwrap();
    std::os::unix::fs::symlink(p.spec.root.parent().unwrap().join("outside"), &control).unwrap();
    let Some(result) = run_in(view, "exit 0") else {
        return;
    };
    let err = result.expect_err("the client must not start on a swapped endpoint");
    assert_eq!(err.raw_os_error(), Some(libc::ESTALE), "{err}");
    assert!(
        p.outside.accept().is_err(),
        "something connected to the socket outside"
    );
}

#[test]
fn the_kept_capabilities_are_those_mps_needs() {
    assert_eq!(kept_mask(), 0b1110_1011);
}

/// A daemon of GPU 1 sees `nvidia1` and the driver's nodes, not
/// another GPU's (`nvidia10` is not `nvidia1`); an earlier version's
/// daemon, recorded without its GPU, sees every GPU node.
#[test]
fn a_daemon_sees_its_own_gpu_node_only() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("dev");
    std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
    for name in [
        "nvidia0",
        "nvidia1",
        "nvidia10",
        "nvidiactl",
        "nvidia-uvm",
        "null",
    ] {
        std::fs::write(dev.join(name), "").unwrap();
    }
    let names = |minor| -> Vec<String> {
        gpu_nodes(&dev, minor)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(
        names(Some(1)),
        ["nvidia-caps", "nvidia-uvm", "nvidia1", "nvidiactl"]
    );
    assert_eq!(
        names(None),
        [
            "nvidia-caps",
            "nvidia-uvm",
            "nvidia0",
            "nvidia1",
            "nvidia10",
            "nvidiactl"
        ]
    );
}
