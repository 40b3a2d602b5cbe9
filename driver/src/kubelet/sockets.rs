//! The plugin's unix sockets: names, permissions, cleanup.
//!
//! Rolling updates: during a DaemonSet update with `maxSurge`, the old and
//! the new plugin instance run side by side. The kubelet's plugin watcher
//! treats every socket in its registry directory as one registration; it
//! keeps several registrations of the same DRA driver, uses the newest, and
//! falls back to a remaining one when a socket disappears. That only works
//! if every instance has socket names of its own: an instance that reused a
//! fixed name would unlink and recreate the old instance's socket, and the
//! kubelet would see the driver disappear. So both sockets carry a per-
//! process instance id:
//!
//! * registration: `<registry dir>/<driver>-<instance>-reg.sock`
//! * DRA service:  `<plugins dir>/<driver>/dra-<instance>.sock`
//!
//! An instance never removes another live instance's sockets; at start it
//! removes sockets of this driver that nobody listens on any more (left by
//! a killed instance), found by a connect attempt that is refused.

use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// A short id unique to this process instance.
pub fn instance_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    // The pid spread over all bits (a shift would land above the 40 kept).
    let mixed = (nanos as u64) ^ u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    format!("{:010x}", mixed & 0xff_ffff_ffff)
}

pub fn registration_socket(registry_dir: &Path, driver: &str, instance: &str) -> PathBuf {
    registry_dir.join(format!("{driver}-{instance}-reg.sock"))
}

pub fn dra_socket_dir(plugins_dir: &Path, driver: &str) -> PathBuf {
    plugins_dir.join(driver)
}

pub fn dra_socket(plugins_dir: &Path, driver: &str, instance: &str) -> PathBuf {
    dra_socket_dir(plugins_dir, driver).join(format!("dra-{instance}.sock"))
}

/// Creates `dir` (mode 0700) if missing. An existing directory is left as
/// it is (the kubelet owns its registry directory).
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(io::Error::other(format!(
            "{} exists and is not a directory",
            dir.display()
        ))),
        Err(_) => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir),
    }
}

/// Binds a listening socket at `path`, readable and writable by its owner
/// only (0600) from the first moment on.
pub fn bind(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    if path.exists() {
        // Our own name: only a previous process with the same instance id
        // (practically impossible) could have left it.
        std::fs::remove_file(path)?;
    }
    // Bound in a directory of its own that only the owner can enter, made
    // private (0600), then moved into place: open to nobody else from the
    // first moment, without the process-wide umask, which would also
    // narrow or widen files other threads create meanwhile.
    let dir = path.parent().unwrap_or(Path::new("."));
    let private = dir.join(format!(".bind-{}-{}", std::process::id(), next_bind()));
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let inner = private.join("s");
    let bound = (|| {
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700))?;
        let listener = std::os::unix::net::UnixListener::bind(&inner)?;
        #[cfg(test)]
        tests::AFTER_BIND.with(|hook| hook.take().map(|f| f()));
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&inner, path)?;
        listener.set_nonblocking(true)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_file(&inner);
    let _ = std::fs::remove_dir(&private);
    bound
}

/// A number unique to each bind of this process (two may run at once).
fn next_bind() -> usize {
    static BINDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    BINDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Removes sockets in `dir` named `<prefix>...<suffix>` that no process
/// accepts connections on. Returns what was removed.
pub fn remove_stale(dir: &Path, prefix: &str, suffix: &str, keep: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if path == keep || !name.starts_with(prefix) || !name.ends_with(suffix) {
            continue;
        }
        let is_socket = entry
            .file_type()
            .map(|t| std::os::unix::fs::FileTypeExt::is_socket(&t))
            .unwrap_or(false);
        if !is_socket {
            continue;
        }
        let dead = matches!(
            std::os::unix::net::UnixStream::connect(&path),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused
        );
        if dead && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    thread_local! {
        /// Runs once right after the next socket is bound.
        pub(super) static AFTER_BIND: std::cell::Cell<Option<Box<dyn FnOnce()>>> =
            std::cell::Cell::new(None);
    }

    /// The process's file mode mask, as the kernel reports it.
    fn umask() -> String {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
        line.to_owned()
    }

    /// Other threads create files while a socket is bound: the process's
    /// umask must stay as it is throughout.
    #[test]
    fn binding_a_socket_leaves_the_process_umask_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let before = umask();
        let during = std::sync::Arc::new(std::sync::Mutex::new(None));
        let seen = during.clone();
        AFTER_BIND.with(|hook| {
            hook.set(Some(Box::new(move || {
                *seen.lock().unwrap() = Some(umask());
            })))
        });
        let listener = bind(&path).unwrap();
        assert_eq!(during.lock().unwrap().as_deref(), Some(before.as_str()));
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        std::os::unix::net::UnixStream::connect(&path).expect("reachable where it was moved");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "no private directory left: {left:?}");
        drop(listener);
    }

    #[test]
    fn names_are_per_instance_and_sockets_private() {
        let dir = tempfile::tempdir().unwrap();
        let a = registration_socket(dir.path(), "gpu.tessera.dev", "aaaa");
        let b = registration_socket(dir.path(), "gpu.tessera.dev", "bbbb");
        assert_ne!(a, b);
        assert!(
            a.to_str()
                .unwrap()
                .ends_with("gpu.tessera.dev-aaaa-reg.sock")
        );
        let listener = bind(&a).unwrap();
        assert_eq!(std::fs::metadata(&a).unwrap().mode() & 0o777, 0o600);
        let private = dra_socket_dir(dir.path(), "gpu.tessera.dev");
        ensure_private_dir(&private).unwrap();
        assert_eq!(std::fs::metadata(&private).unwrap().mode() & 0o777, 0o700);
        // A live socket is kept, a dead one removed.
        {
            let _dead = bind(&b).unwrap();
        }
        let removed = remove_stale(dir.path(), "gpu.tessera.dev-", "-reg.sock", Path::new("/"));
        assert_eq!(removed, vec![b.clone()]);
        assert!(a.exists() && !b.exists());
        drop(listener);
        assert_ne!(instance_id(), "");
    }
}
