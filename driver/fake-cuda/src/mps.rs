//! The MPS client side: whether a control daemon serves this process, and
//! the limits it gets.
//!
//! At `cuInit` the library connects to `<CUDA_MPS_PIPE_DIRECTORY>/control`
//! (default `/tmp/nvidia-mps`). No socket there, or nobody accepting on it
//! (a daemon that quit or died), and the process runs outside MPS: the whole
//! device, as CUDA does in the default compute mode. A daemon that accepts
//! is asked for its devices and defaults with the private command of
//! `fake-mps-control` ([`protocol::CLIENT_CONFIG_COMMAND`]); a daemon that
//! accepts but does not answer that properly fails `cuInit` with
//! `CUDA_ERROR_MPS_CONNECTION_FAILED`. So does a client whose `/dev/shm` is
//! not the daemon's (the daemon's segment is not there): the MPS server and
//! its clients share memory through `/dev/shm`, so a container needs the
//! daemon's mounted there.
//!
//! A client's limits are its daemon's defaults, lowered (never raised) by
//! its own valid `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (ordinals counting the devices the
//! client enumerates); an environment value that does not parse is
//! ignored as a whole.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::codes::*;
use crate::visible;

#[allow(dead_code)]
#[path = "../../fake-nvml/src/bin/fake_mps_control/protocol.rs"]
pub mod protocol;

pub use protocol::ClientConfig;

/// `CUDA_MPS_PIPE_DIRECTORY`'s default.
pub const DEFAULT_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";
/// Environment variable naming the daemon's pipe directory.
pub const PIPE_DIRECTORY_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";

/// How long a daemon that accepted the connection may take to answer.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// The pipe directory `value` (the variable's value) names.
pub fn pipe_directory(value: Option<&str>) -> PathBuf {
    PathBuf::from(
        value
            .filter(|v| !v.is_empty())
            .unwrap_or(DEFAULT_PIPE_DIRECTORY),
    )
}

/// The daemon serving `pipe_dir`'s clients, if one answers.
pub fn ask_daemon(pipe_dir: &Path) -> Result<Option<ClientConfig>, CUresult> {
    let mut stream = match UnixStream::connect(pipe_dir.join("control")) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::NotFound | ErrorKind::ConnectionRefused | ErrorKind::NotADirectory
            ) =>
        {
            return Ok(None);
        }
        Err(_) => return Err(MPS_CONNECTION_FAILED),
    };
    let mut reply = String::new();
    let asked = stream
        .set_read_timeout(Some(REPLY_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(REPLY_TIMEOUT)))
        .and_then(|()| writeln!(stream, "{}", protocol::CLIENT_CONFIG_COMMAND))
        .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
        .and_then(|()| stream.read_to_string(&mut reply));
    if asked.is_err() {
        return Err(MPS_CONNECTION_FAILED);
    }
    let line = reply.lines().next().unwrap_or_default();
    let config: ClientConfig = serde_json::from_str(line).map_err(|_| MPS_CONNECTION_FAILED)?;
    if !shares_memory_with(&config, Path::new(protocol::SHM_DIR)) {
        return Err(MPS_CONNECTION_FAILED);
    }
    Ok(Some(config))
}

/// Whether `shm` (the client's `/dev/shm`) holds the daemon's segment: a
/// client whose `/dev/shm` is not the server's cannot work with it.
fn shares_memory_with(daemon: &ClientConfig, shm: &Path) -> bool {
    let name = &daemon.shared_memory;
    let plain = name.starts_with(protocol::SHM_PREFIX) && !name.contains('/');
    plain && std::fs::read_to_string(shm.join(name)).is_ok_and(|content| content == *name)
}

/// A client's own limit variables, as given.
#[derive(Debug, Clone, Default)]
pub struct ClientEnv {
    pub thread_percentage: Option<String>,
    pub pinned_mem_limit: Option<String>,
}

/// What one device of an MPS client gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceLimits {
    pub thread_percentage: f64,
    /// Bytes the client may allocate on it, if limited.
    pub pinned_bytes: Option<u64>,
}

/// The devices an MPS client enumerates: indices into `uuids` (what the
/// client could see, in the default order), each with the ordinal the
/// device has among the daemon's devices. The daemon's entries are read
/// each on its own in the client's view: one the client cannot see (or
/// that names nothing) is left out. A daemon without `CUDA_VISIBLE_DEVICES`
/// serves every device the client sees, its ordinals counting those.
pub fn daemon_devices(daemon: &ClientConfig, uuids: &[&str]) -> Vec<(usize, u32)> {
    match &daemon.devices {
        None => (0..uuids.len()).map(|i| (i, i as u32)).collect(),
        Some(entries) => {
            let mut out: Vec<(usize, u32)> = Vec::new();
            for (ordinal, entry) in entries.iter().enumerate() {
                if let Some(i) = visible::resolve(entry, uuids)
                    && out.iter().all(|(seen, _)| *seen != i)
                {
                    out.push((i, ordinal as u32));
                }
            }
            out
        }
    }
}

/// The limits of the client's device `client_ordinal`, which is the
/// daemon's device `daemon_ordinal`: the lower of the daemon's default and
/// the client's valid own value.
pub fn limits(
    daemon: &ClientConfig,
    env: &ClientEnv,
    daemon_ordinal: u32,
    client_ordinal: u32,
) -> DeviceLimits {
    let own_pct = env
        .thread_percentage
        .as_deref()
        .and_then(|v| protocol::parse_percentage(v).ok());
    let own_pinned: BTreeMap<u32, u64> = env
        .pinned_mem_limit
        .as_deref()
        .and_then(|v| protocol::parse_pinned_limits(v).ok())
        .unwrap_or_default();
    let pinned = [
        daemon.pinned_mem_limits.get(&daemon_ordinal),
        own_pinned.get(&client_ordinal),
    ]
    .into_iter()
    .flatten()
    .copied()
    .min();
    DeviceLimits {
        thread_percentage: own_pct.map_or(daemon.active_thread_percentage, |p| {
            p.min(daemon.active_thread_percentage)
        }),
        pinned_bytes: pinned,
    }
}

/// SMs a client with `percentage` of a device's threads gets: the share
/// rounded down to an even count, at least 2 (H100, driver 580: 25% of 132
/// is 32, 30% is 38, 50% is 66); the whole device at 100%.
pub fn multiprocessors(total: u32, percentage: f64) -> u32 {
    if percentage >= 100.0 {
        return total;
    }
    let share = (f64::from(total) * percentage / 100.0).floor() as u32;
    (share & !1).max(2).min(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn daemon(devices: Option<&[&str]>, pct: f64, pinned: &[(u32, u64)]) -> ClientConfig {
        ClientConfig {
            devices: devices.map(|d| d.iter().map(|s| s.to_string()).collect()),
            active_thread_percentage: pct,
            pinned_mem_limits: pinned.iter().copied().collect(),
            shared_memory: String::new(),
        }
    }

    fn env(pct: Option<&str>, pinned: Option<&str>) -> ClientEnv {
        ClientEnv {
            thread_percentage: pct.map(String::from),
            pinned_mem_limit: pinned.map(String::from),
        }
    }

    #[test]
    fn sms_follow_what_an_h100_gives() {
        assert_eq!(multiprocessors(132, 25.0), 32);
        assert_eq!(multiprocessors(132, 30.0), 38);
        assert_eq!(multiprocessors(132, 50.0), 66);
        assert_eq!(multiprocessors(132, 100.0), 132);
        assert_eq!(multiprocessors(132, 1.0), 2);
        assert_eq!(multiprocessors(16, 12.5), 2);
        assert_eq!(multiprocessors(1, 50.0), 1);
    }

    #[test]
    fn the_client_environment_only_lowers() {
        let d = daemon(None, 25.0, &[(0, 8 * GIB)]);
        let own = limits(&d, &env(Some("100"), Some("0=16G")), 0, 0);
        assert_eq!(own.thread_percentage, 25.0);
        assert_eq!(own.pinned_bytes, Some(8 * GIB));
        let own = limits(&d, &env(Some("10"), Some("0=2G")), 0, 0);
        assert_eq!(own.thread_percentage, 10.0);
        assert_eq!(own.pinned_bytes, Some(2 * GIB));
        // Invalid values are ignored, not errors.
        let own = limits(&d, &env(Some("0"), Some("0=2")), 0, 0);
        assert_eq!(own.thread_percentage, 25.0);
        assert_eq!(own.pinned_bytes, Some(8 * GIB));
    }

    #[test]
    fn ordinals_are_the_daemons_and_the_clients_own() {
        let d = daemon(Some(&["GPU-a", "GPU-b"]), 100.0, &[(1, 4 * GIB)]);
        // The client's device 0 is the daemon's device 1.
        assert_eq!(
            limits(&d, &env(None, None), 1, 0).pinned_bytes,
            Some(4 * GIB)
        );
        assert_eq!(limits(&d, &env(None, None), 0, 0).pinned_bytes, None);
        assert_eq!(
            limits(&d, &env(None, Some("0=1G,1=2G")), 1, 0).pinned_bytes,
            Some(GIB)
        );
        assert_eq!(
            limits(&d, &env(None, Some("1=1G")), 0, 0).pinned_bytes,
            None
        );
    }

    #[test]
    fn the_daemons_devices_in_the_clients_view() {
        let uuids = ["GPU-a1", "GPU-b2", "GPU-c3"];
        let d = daemon(Some(&["GPU-c3", "GPU-zz", "GPU-a1"]), 100.0, &[]);
        assert_eq!(daemon_devices(&d, &uuids), vec![(2, 0), (0, 2)]);
        let d = daemon(None, 100.0, &[]);
        assert_eq!(daemon_devices(&d, &uuids), vec![(0, 0), (1, 1), (2, 2)]);
        let d = daemon(Some(&[]), 100.0, &[]);
        assert!(daemon_devices(&d, &uuids).is_empty());
    }

    #[test]
    fn no_daemon_is_no_mps() {
        let dir = std::env::temp_dir().join(format!("fake-cuda-no-mps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(ask_daemon(&dir), Ok(None));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(ask_daemon(&dir), Ok(None));
        // A socket nobody accepts on: a daemon that died.
        let listener = std::os::unix::net::UnixListener::bind(dir.join("control")).unwrap();
        drop(listener);
        assert_eq!(ask_daemon(&dir), Ok(None));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(pipe_directory(None), Path::new("/tmp/nvidia-mps"));
        assert_eq!(pipe_directory(Some("")), Path::new("/tmp/nvidia-mps"));
        assert_eq!(pipe_directory(Some("/p")), Path::new("/p"));
    }

    #[test]
    fn a_daemon_that_answers_garbage_fails_the_client() {
        let dir = std::env::temp_dir().join(format!("fake-cuda-bad-mps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(dir.join("control")).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut command = String::new();
            s.read_to_string(&mut command).unwrap();
            s.write_all(b"Unrecognized command\n").unwrap();
            command
        });
        assert_eq!(ask_daemon(&dir), Err(MPS_CONNECTION_FAILED));
        assert_eq!(server.join().unwrap(), "tessera_fake_get_client_config\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_client_needs_the_daemons_shared_memory() {
        let shm = std::env::temp_dir().join(format!("fake-cuda-shm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&shm);
        std::fs::create_dir_all(&shm).unwrap();
        let mut config = daemon(None, 100.0, &[]);
        config.shared_memory = "tessera-fake-mps.1.2".into();
        // Another /dev/shm than the daemon's: the segment is not there.
        assert!(!shares_memory_with(&config, &shm));
        std::fs::write(shm.join("tessera-fake-mps.1.2"), "tessera-fake-mps.9.9").unwrap();
        assert!(
            !shares_memory_with(&config, &shm),
            "another daemon's content"
        );
        std::fs::write(shm.join("tessera-fake-mps.1.2"), "tessera-fake-mps.1.2").unwrap();
        assert!(shares_memory_with(&config, &shm));
        // Names that would leave the directory are refused.
        config.shared_memory = "../tessera-fake-mps.1.2".into();
        assert!(!shares_memory_with(&config, &shm));
        config.shared_memory = String::new();
        assert!(!shares_memory_with(&config, &shm));
        std::fs::remove_dir_all(&shm).unwrap();
    }
}
