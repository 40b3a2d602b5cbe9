//! A mount namespace holding nothing but an empty, read-only root with one
//! directory, [`AT`], shared by every view the node process builds.
//!
//! A view made by copying the node's namespace (`unshare`) has to detach
//! the node's whole mount table again (`pivot_root` and a lazy unmount of
//! the old root). Every unmount waits for an RCU grace period, and under a
//! burst of daemon starts on a busy node that wait dominated a start
//! (measured: 13 ms of 26 per start at 16 at once). A view made from this
//! template copies one mount, gets its files as detached copies of the
//! node's mounts (`open_tree`, opened by the node process before the
//! fork) attached below [`AT`] (`move_mount`), and is entered with
//! `chroot`: nothing is ever unmounted, and nothing of the node's mount
//! table is in the view's namespace, not even out of its reach.
//!
//! Needs Linux 5.12 (`mount_setattr`, which also makes every copy
//! read-only recursively and private); on an older kernel the template is
//! not built and views copy the node's namespace as before.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use tracing::warn;

use super::calls::examined;
use super::check;

/// Where each view, in a copy of the template's namespace, mounts its own
/// root tmpfs.
pub(super) const AT: &str = "/v";

/// The template namespace, held open by the node process.
#[derive(Debug)]
pub struct Template {
    ns: OwnedFd,
}

impl Template {
    /// The node process's template, built on first use; `None` where this
    /// kernel or this process cannot build one (said once in the log).
    pub fn shared() -> Option<&'static Template> {
        static SHARED: OnceLock<Option<Template>> = OnceLock::new();
        SHARED
            .get_or_init(|| match Template::build() {
                Ok(template) => Some(template),
                Err(e) => {
                    warn!(
                        "MPS daemons' mount views copy the node's mount table ({e}); each start \
                         waits for the kernel to detach it again"
                    );
                    None
                }
            })
            .as_ref()
    }

    /// Builds a template on a thread of its own: the thread's mount
    /// namespace becomes the template, the node process's stays as it is.
    pub fn build() -> io::Result<Template> {
        std::thread::spawn(build_here)
            .join()
            .map_err(|_| io::Error::other("the thread building the template panicked"))?
    }

    /// The namespace, for `setns` in a forked child.
    pub(super) fn ns(&self) -> RawFd {
        self.ns.as_raw_fd()
    }

    /// In the forked child: into a copy of the template's namespace.
    pub(super) fn enter_copy(&self) -> io::Result<()> {
        // SAFETY: setns(2) on the namespace descriptor this template holds,
        // then unshare(2): this single-threaded child's own namespace and
        // fs context.
        unsafe {
            check(libc::setns(self.ns(), libc::CLONE_NEWNS))?;
            check(libc::unshare(libc::CLONE_NEWNS))
        }
    }
}

/// On a thread that leaves its namespace behind when it ends: a namespace
/// of its own whose root is a read-only tmpfs holding [`AT`].
fn build_here() -> io::Result<Template> {
    // SAFETY: unshare(2) of this thread's own mount namespace and fs
    // context; the node process's other threads keep theirs.
    check(unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
    let ns = File::open("/proc/thread-self/ns/mnt")?.into();
    let null = std::ptr::null();
    // SAFETY: mount(2), mkdir(2), chdir(2), pivot_root(2), umount2(2) on
    // NUL-terminated strings that outlive each call, in this thread's new
    // namespace only. `/dev` is shadowed there only, and only until the
    // old root is detached.
    unsafe {
        check(libc::mount(
            null,
            c"/".as_ptr(),
            null,
            libc::MS_REC | libc::MS_PRIVATE,
            null.cast(),
        ))?;
        check(libc::mount(
            c"tessera-mps-template".as_ptr(),
            c"/dev".as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"size=4k,nr_inodes=8,mode=755".as_ptr().cast(),
        ))?;
        check(libc::chdir(c"/dev".as_ptr()))?;
        check(libc::mkdir(c"v".as_ptr(), 0o755))?;
        check(libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as i32)?;
        check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
        check(libc::chdir(c"/".as_ptr()))?;
    }
    let read_only = libc::MOUNT_ATTR_RDONLY
        | libc::MOUNT_ATTR_NOSUID
        | libc::MOUNT_ATTR_NODEV
        | libc::MOUNT_ATTR_NOEXEC;
    set_attributes(libc::AT_FDCWD, c"/", 0, read_only)?;
    have_attach_calls()?;
    Ok(Template { ns })
}

/// Whether this kernel, and the seccomp profile this process runs under,
/// allow the calls a view is made with (`mount_setattr` was just used):
/// a copy of a tree, dropped again, and a move of nothing, which only a
/// present call answers with EBADF.
fn have_attach_calls() -> io::Result<()> {
    drop(open_tree(c"/", 0)?);
    match attach(-1, c"/") {
        Err(e) if e.raw_os_error() != Some(libc::EBADF) => Err(e),
        _ => Ok(()),
    }
}

/// `attributes` and private propagation on the mount tree at `dirfd` and
/// `path` (`flags`: `AT_EMPTY_PATH` for the tree of `dirfd` itself).
fn set_attributes(dirfd: RawFd, path: &CStr, flags: u32, attributes: u64) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: attributes,
        attr_clr: 0,
        propagation: libc::MS_PRIVATE,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr(2) with a NUL-terminated path and an attribute
    // struct we own, of the size passed.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            flags | libc::AT_RECURSIVE as u32,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    check(rc as i32)
}

/// A detached copy of the mount tree at `from` (followed), private, and
/// read-only (`nosuid`, `nodev`) all through if asked, for a view to attach.
pub(super) fn open_source(from: &CStr, read_only: bool) -> io::Result<OwnedFd> {
    let tree = open_tree(from, 0)?;
    let attributes = if read_only {
        libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV
    } else {
        0
    };
    set_attributes(
        tree.as_raw_fd(),
        c"",
        libc::AT_EMPTY_PATH as u32,
        attributes,
    )?;
    Ok(tree)
}

/// A detached copy of the control endpoint at `path`, not followed, if it
/// is still the inode (device, inode) the driver examined: a link or
/// another file swapped in since fails the client instead of being reached.
pub(super) fn open_endpoint(path: &CStr, inode: (u64, u64)) -> io::Result<OwnedFd> {
    let tree = open_tree(path, libc::AT_SYMLINK_NOFOLLOW as u32)?;
    // SAFETY: `stat` is plain data, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) of a descriptor we own into a `stat` we own.
    check(unsafe { libc::fstat(tree.as_raw_fd(), &mut st) })?;
    examined(&st, inode)?;
    set_attributes(tree.as_raw_fd(), c"", libc::AT_EMPTY_PATH as u32, 0)?;
    Ok(tree)
}

fn open_tree(path: &CStr, flags: u32) -> io::Result<OwnedFd> {
    let flags = flags
        | libc::OPEN_TREE_CLONE
        | libc::OPEN_TREE_CLOEXEC
        | libc::AT_RECURSIVE as libc::c_uint;
    // SAFETY: open_tree(2) with a NUL-terminated path; it returns a new
    // descriptor, ours alone.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor open_tree(2) just returned.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The detached tree `source` attached at `to` (in the forked child).
pub(super) fn attach(source: RawFd, to: &CStr) -> io::Result<()> {
    // SAFETY: move_mount(2) of a descriptor the parent keeps open until
    // this process executes, onto a NUL-terminated path.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            source,
            c"".as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    check(rc as i32)
}
