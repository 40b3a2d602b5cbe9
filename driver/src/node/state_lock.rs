//! One writer of the node's state at a time.
//!
//! The checkpoint, the CDI specs, the MPS records and the MIG layout are
//! changed by one process only. During a rolling update the new DaemonSet
//! pod starts while the old one still serves; the new one waits here, on an
//! exclusive lock of `<state dir>/lock` ([`File::try_lock`], `flock` on
//! Linux), before it reads the checkpoint,
//! sweeps orphaned specs or touches a GPU. The kernel drops the lock when
//! the holder exits, however it exits, so a killed process never leaves the
//! node locked.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The lock file's name in the state directory.
pub const LOCK_FILE: &str = "lock";

/// Holds the node's state lock until dropped (or the process ends).
#[derive(Debug)]
pub struct StateLock {
    _file: File,
    path: PathBuf,
}

impl StateLock {
    /// Takes the lock if it is free.
    pub fn try_acquire(state_dir: &Path) -> io::Result<Option<StateLock>> {
        std::fs::create_dir_all(state_dir)?;
        let path = state_dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        match file.try_lock() {
            Ok(()) => Ok(Some(StateLock { _file: file, path })),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(e)) => Err(e),
        }
    }

    /// Takes the lock, waiting for another process to let go of it;
    /// `waiting` is called once if it has to wait.
    pub fn acquire(state_dir: &Path, mut waiting: impl FnMut(&Path)) -> io::Result<StateLock> {
        let mut told = false;
        loop {
            if let Some(lock) = Self::try_acquire(state_dir)? {
                return Ok(lock);
            }
            if !told {
                waiting(&state_dir.join(LOCK_FILE));
                told = true;
            }
            // A blocking lock has no timeout and cannot be interrupted by
            // the runtime's shutdown; poll instead.
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = StateLock::try_acquire(dir.path()).unwrap().expect("free");
        // The lock belongs to the open file description (flock): a second
        // open in the same process conflicts like another process would.
        assert!(StateLock::try_acquire(dir.path()).unwrap().is_none());
        drop(first);
        assert!(StateLock::try_acquire(dir.path()).unwrap().is_some());
    }

    #[test]
    fn acquire_waits_for_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = StateLock::try_acquire(dir.path()).unwrap().expect("free");
        let (tx, rx) = std::sync::mpsc::channel();
        let path = dir.path().to_path_buf();
        let waiter = std::thread::spawn(move || {
            StateLock::acquire(&path, |_| tx.send(()).unwrap()).unwrap()
        });
        // The waiter reports that it waits; only then is the lock released.
        rx.recv_timeout(Duration::from_secs(10))
            .expect("waiter waits");
        drop(first);
        let second = waiter.join().unwrap();
        assert_eq!(second.path(), dir.path().join(LOCK_FILE));
    }
}
