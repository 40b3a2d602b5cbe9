//! A daemon's `/dev/shm` and pipe directory, each a tmpfs of its own.
//!
//! Both are writable by the claim's containers. As plain directories under
//! the MPS state directory (on the host's `/run`, beside `/var/run/cdi`)
//! one claim could fill the node's `/run`: every other claim's CDI spec and
//! MPS record would fail to write. As their own tmpfs, bounded in bytes and
//! files, a tenant that fills them gets ENOSPC there and nothing else.
//!
//! The mounts are made in the node process's mount namespace below the MPS
//! state directory; the chart mounts that directory with bidirectional
//! propagation, so the container runtime on the host sees them when it
//! bind-mounts them into a claim's containers.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tessera_api::config::Quantity;
use tessera_controller::model::policy::MpsPolicy;

/// The bounds of one daemon's two directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DirBounds {
    /// Bytes of its `/dev/shm`.
    pub shm_bytes: u64,
    /// Files in its `/dev/shm`; the pipe directory gets an eighth (at least
    /// [`MIN_PIPE_INODES`]).
    pub inodes: u64,
}

/// The node policy's bounds for every daemon (`mps` in the node policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmPolicy {
    /// A daemon's `/dev/shm` when its claim asks for no size.
    pub default_bytes: u64,
    /// The most a claim may ask for.
    pub max_bytes: u64,
    /// Files in a daemon's `/dev/shm`.
    pub inodes: u64,
}

impl Default for ShmPolicy {
    fn default() -> Self {
        ShmPolicy::from(&MpsPolicy::default())
    }
}

impl From<&MpsPolicy> for ShmPolicy {
    fn from(p: &MpsPolicy) -> Self {
        ShmPolicy {
            default_bytes: p.shared_memory.bytes(),
            max_bytes: p.max_shared_memory.bytes(),
            inodes: p.inodes,
        }
    }
}

impl ShmPolicy {
    /// The size of a claim's `/dev/shm`: what it asked for, if within the
    /// node's maximum, else the default.
    pub fn size_for(&self, asked: Option<u64>) -> Result<u64, ShmTooLarge> {
        match asked {
            None => Ok(self.default_bytes),
            Some(bytes) if bytes <= self.max_bytes => Ok(bytes),
            Some(bytes) => Err(ShmTooLarge {
                asked: Quantity::from_bytes(bytes),
                max: Quantity::from_bytes(self.max_bytes),
            }),
        }
    }

    /// The bounds of a daemon whose claim has `shm_bytes` (`None`: a record
    /// of a version without them gets the default).
    pub fn bounds(&self, shm_bytes: Option<u64>) -> DirBounds {
        DirBounds {
            shm_bytes: shm_bytes.unwrap_or(self.default_bytes),
            inodes: self.inodes,
        }
    }
}

/// A claim asked for more `/dev/shm` than the node allows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "sharedMemory {asked} is more than this node allows ({max}, node policy mps.maxSharedMemory); \
     fix: ask for at most {max} in the claim's ShareConfig (or GpuConfig/MigConfig sharing.mps), \
     or have the node's maximum raised"
)]
pub struct ShmTooLarge {
    pub asked: Quantity,
    pub max: Quantity,
}

/// The pipe directory holds a control socket, a few fifos per client and
/// the daemon's lock and pid files: small, whatever the claim's shm.
pub const PIPE_BYTES: u64 = 1 << 20;
/// The fewest files a pipe directory gets.
pub const MIN_PIPE_INODES: u64 = 64;

impl DirBounds {
    fn pipe_inodes(self) -> u64 {
        (self.inodes / 8).max(MIN_PIPE_INODES)
    }
}

/// Which of a daemon's directories: they differ in size and in whether
/// anything there may be executed (shared memory may be mapped executable,
/// as `/dev/shm` allows; the pipe directory holds sockets and fifos only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientDir {
    Pipe,
    Shm,
}

/// Mounts a fresh tmpfs on `dir` (an empty directory), bounded for `which`.
/// World-writable and sticky like `/dev/shm`: the MPS server runs with its
/// first client's uid, and a claim's containers may run as any uid.
pub fn mount(dir: &Path, which: ClientDir, bounds: DirBounds) -> io::Result<()> {
    let (bytes, inodes, noexec) = match which {
        ClientDir::Pipe => (PIPE_BYTES, bounds.pipe_inodes(), libc::MS_NOEXEC),
        ClientDir::Shm => (bounds.shm_bytes, bounds.inodes, 0),
    };
    let target = c_path(dir)?;
    let data = CString::new(format!("size={bytes},nr_inodes={inodes},mode=1777"))
        .expect("no NUL in numbers");
    // SAFETY: mount(2) with NUL-terminated strings we own.
    let rc = unsafe {
        libc::mount(
            c"tessera-mps".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | noexec,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Detaches whatever is mounted on `dir` (lazily: containers that hold a
/// bind mount of it keep theirs); nothing mounted, or no `dir`, is fine.
pub fn detach(dir: &Path) -> io::Result<()> {
    let target = c_path(dir)?;
    // SAFETY: umount2(2) on a NUL-terminated path; UMOUNT_NOFOLLOW: a
    // symlink a container left in place of the directory is not followed.
    let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        // Not a mount point, or not there.
        Some(libc::EINVAL | libc::ENOENT) => Ok(()),
        _ => Err(err),
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn bounds() -> DirBounds {
        DirBounds {
            shm_bytes: 1 << 20,
            inodes: 64,
        }
    }

    /// Mounting needs CAP_SYS_ADMIN (as the node process has); elsewhere
    /// there is nothing to test.
    fn mounted(dir: &Path, which: ClientDir) -> bool {
        match mount(dir, which, bounds()) {
            Ok(()) => true,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => false,
            Err(e) => panic!("mounting {}: {e}", dir.display()),
        }
    }

    #[test]
    fn a_claim_asks_within_the_nodes_maximum() {
        let policy = ShmPolicy::default();
        assert_eq!(policy.size_for(None), Ok(256 << 20));
        assert_eq!(policy.size_for(Some(1 << 30)), Ok(1 << 30));
        let err = policy.size_for(Some(8 << 30)).unwrap_err().to_string();
        assert!(
            err.contains("8Gi") && err.contains("mps.maxSharedMemory") && err.contains("4Gi"),
            "{err}"
        );
        assert_eq!(policy.bounds(None).shm_bytes, 256 << 20);
        assert_eq!(policy.bounds(Some(1 << 20)).shm_bytes, 1 << 20);
    }

    #[test]
    fn a_full_shm_is_enospc_and_detaching_leaves_an_empty_directory() {
        let dir = tempfile::tempdir().unwrap();
        let shm = dir.path().join("shm");
        std::fs::create_dir(&shm).unwrap();
        if !mounted(&shm, ClientDir::Shm) {
            return;
        }
        let mut file = std::fs::File::create(shm.join("fill")).unwrap();
        let chunk = vec![7u8; 64 << 10];
        let err = (0..64)
            .find_map(|_| file.write_all(&chunk).err())
            .expect("1 MiB of tmpfs fills before 4 MiB are written");
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        drop(file);
        // Files count too.
        let err = (0..128)
            .find_map(|i| std::fs::File::create(shm.join(format!("f{i}"))).err())
            .expect("64 inodes run out");
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        detach(&shm).unwrap();
        assert_eq!(std::fs::read_dir(&shm).unwrap().count(), 0);
        // Detaching what is not mounted, or not there, is fine.
        detach(&shm).unwrap();
        detach(&dir.path().join("missing")).unwrap();
    }

    #[test]
    fn the_pipe_directory_is_small_and_executes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let pipe = dir.path().join("pipe");
        std::fs::create_dir(&pipe).unwrap();
        if !mounted(&pipe, ClientDir::Pipe) {
            return;
        }
        let options = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(pipe.to_str().unwrap()))
            .map(str::to_owned);
        detach(&pipe).unwrap();
        let options = options.expect("the pipe tmpfs is in mountinfo");
        for want in ["nosuid", "nodev", "noexec", "size=1024k"] {
            assert!(options.contains(want), "{want} missing: {options}");
        }
        assert!(options.contains("nr_inodes=64"), "{options}");
    }
}
