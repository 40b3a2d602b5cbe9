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
fn run_in(view: View<'static>, script: &str) -> Option<std::io::Result<std::process::ExitStatus>> {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c").arg(script);
    // SAFETY: `enter` makes only async-signal-safe system calls.
    unsafe { cmd.pre_exec(move || view.enter()) };
    match cmd.status() {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => None,
        other => Some(other),
    }
}

/// Every way of making a view: from a template (kept for the test
/// process's life, as the node process keeps its own), and by copying the
/// node's namespace.
fn makings() -> Vec<Option<&'static Template>> {
    match Template::build() {
        Ok(template) => vec![Some(Box::leak(Box::new(template))), None],
        // Not allowed here: neither are copies (`run_in` says so).
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => vec![None],
        Err(e) => panic!("no template on a kernel that allows namespaces: {e}"),
    }
}

#[test]
fn the_client_sees_only_the_endpoint_it_was_given() {
    for template in makings() {
        let p = pipe();
        let pipe_dir = p.spec.pipe_dir.display().to_string();
        let role = Role::Client {
            endpoint: p.endpoint,
        };
        let view = View::prepare_from(&p.spec, role, template).unwrap();
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
            "the client saw more than its endpoint (template: {})",
            template.is_some()
        );
    }
}

#[test]
fn a_link_swapped_in_for_the_endpoint_is_never_reached() {
    for template in makings() {
        let p = pipe();
        // After the driver looked: the endpoint becomes a link outside.
        let control = p.spec.pipe_dir.join("control");
        std::fs::rename(&control, p.spec.pipe_dir.join("moved")).unwrap();
        std::os::unix::fs::symlink(p.spec.root.parent().unwrap().join("outside"), &control)
            .unwrap();
        let role = Role::Client {
            endpoint: p.endpoint,
        };
        // From a template the endpoint is opened now; a copy binds it in
        // the child.
        let err = match View::prepare_from(&p.spec, role, template) {
            Err(e) => e,
            Ok(view) => match run_in(view, "exit 0") {
                None => return,
                Some(result) => result.expect_err("the client must not start"),
            },
        };
        assert_eq!(err.raw_os_error(), Some(libc::ESTALE), "{err}");
        assert!(
            p.outside.accept().is_err(),
            "something connected to the socket outside"
        );
    }
}

/// A daemon's system files are read-only all through, its claim's
/// directories writable, and its root is the view's own.
#[test]
fn a_daemon_writes_only_its_claims_directories() {
    for template in makings() {
        let p = pipe();
        let view = View::prepare_from(&p.spec, Role::Daemon, template).unwrap();
        let pipe_dir = p.spec.pipe_dir.display();
        let script = format!(
            "! touch /usr/tessera-probe 2>/dev/null && ! mkdir /etc/tessera-probe 2>/dev/null \
             && touch /dev/shm/x {pipe_dir}/y && test -e /proc/self/status \
             && test ! -e /v"
        );
        let Some(status) = run_in(view, &script) else {
            return;
        };
        assert!(
            status.unwrap().success(),
            "template: {}",
            template.is_some()
        );
        assert!(p.spec.shm_dir.join("x").exists());
    }
}

/// The template's root is shared by every view made from it: nothing may
/// be written there, and it holds only where views mount their roots.
#[test]
fn the_template_root_is_empty_and_read_only() {
    let Some(Some(template)) = makings().into_iter().next() else {
        return;
    };
    let ns = template.ns();
    let mut cmd = Command::new("/");
    // SAFETY: in the forked child, system calls only, then _exit(2) with
    // what they showed (the template holds nothing to execute).
    unsafe {
        cmd.pre_exec(move || {
            let code = if libc::setns(ns, libc::CLONE_NEWNS) != 0 {
                1
            } else if libc::mkdir(c"/w".as_ptr(), 0o755) == 0 {
                2
            } else if io::Error::last_os_error().raw_os_error() != Some(libc::EROFS) {
                3
            } else if libc::access(c"/v".as_ptr(), libc::F_OK) != 0 {
                4
            } else if libc::access(c"/usr".as_ptr(), libc::F_OK) == 0 {
                5
            } else {
                0
            };
            libc::_exit(code)
        });
    }
    assert_eq!(cmd.status().unwrap().code(), Some(0));
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
