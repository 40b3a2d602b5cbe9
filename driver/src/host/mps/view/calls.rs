//! The system calls a forked child makes to build its view, each on
//! prepared NUL-terminated strings (async-signal-safe).

use std::ffi::CStr;
use std::io;

use super::check;

/// A small tmpfs on `at`: the new root, or a client's pipe directory.
pub(super) fn mount_tmpfs(at: &CStr) -> io::Result<()> {
    // SAFETY: mount(2) on NUL-terminated strings that outlive the call.
    check(unsafe {
        libc::mount(
            c"tessera-mps-view".as_ptr(),
            at.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            c"size=64k,nr_inodes=1024,mode=755".as_ptr().cast(),
        )
    })
}

/// A directory at `at`; one already there will do.
pub(super) fn make_dir(at: &CStr) -> io::Result<()> {
    // SAFETY: mkdir(2) on a NUL-terminated string that outlives the call.
    match unsafe { libc::mkdir(at.as_ptr(), 0o755) } {
        0 => Ok(()),
        _ if io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// An empty file at `at` (not through a link) to bind a file on.
pub(super) fn touch(at: &CStr) -> io::Result<()> {
    // SAFETY: open(2) on a NUL-terminated string that outlives the call,
    // and close(2) of the descriptor it returned, owned by nothing else.
    unsafe {
        let fd = libc::open(
            at.as_ptr(),
            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            0o644,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        libc::close(fd);
    }
    Ok(())
}

/// `from` bound on `to`, then made read-only (and `nosuid`, `nodev`) if
/// asked: a bind mount takes those only on a remount.
pub(super) fn bind(from: &CStr, to: &CStr, read_only: bool) -> io::Result<()> {
    let null = std::ptr::null();
    // SAFETY: mount(2) on NUL-terminated strings that outlive the call, or
    // null where mount(2) ignores the argument.
    check(unsafe {
        libc::mount(
            from.as_ptr(),
            to.as_ptr(),
            null,
            libc::MS_BIND | libc::MS_REC,
            null.cast(),
        )
    })?;
    if !read_only {
        return Ok(());
    }
    // SAFETY: as above.
    check(unsafe {
        libc::mount(
            null,
            to.as_ptr(),
            null,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            null.cast(),
        )
    })
}

/// The control endpoint bound from `from` on `to`, then checked to be the
/// inode (device, inode) the driver examined.
pub(super) fn bind_endpoint(from: &CStr, to: &CStr, inode: (u64, u64)) -> io::Result<()> {
    let null = std::ptr::null();
    // SAFETY: mount(2) on NUL-terminated strings that outlive the call, or
    // null where mount(2) ignores the argument.
    check(unsafe { libc::mount(from.as_ptr(), to.as_ptr(), null, libc::MS_BIND, null.cast()) })?;
    // SAFETY: `stat` is plain data, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: lstat(2) on a NUL-terminated string and a `stat` we own.
    check(unsafe { libc::lstat(to.as_ptr(), &mut st) })?;
    examined(&st, inode)
}

/// Whether `st` is the inode (device, inode) the driver examined: ESTALE
/// if a link or another file took its place.
pub(super) fn examined(st: &libc::stat, inode: (u64, u64)) -> io::Result<()> {
    if (st.st_dev, st.st_ino) != inode {
        return Err(io::Error::from_raw_os_error(libc::ESTALE));
    }
    Ok(())
}

/// A fresh procfs on `at`.
pub(super) fn mount_proc(at: &CStr) -> io::Result<()> {
    // SAFETY: mount(2) on NUL-terminated strings that outlive the call, or
    // null where mount(2) ignores the argument.
    check(unsafe {
        libc::mount(
            c"proc".as_ptr(),
            at.as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    })
}
