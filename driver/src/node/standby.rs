//! Standby: while another process holds the node's state lock (a rolling
//! update), this one waits for it, running pre-flight checks that say
//! whether it could take over ([`PreFlight`], answered by its probes).

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kube::Client;
use nvml_wrapper::Nvml;
use tracing::{info, warn};

use super::config::{HostCgroupPlace, NodeConfig};
use super::readiness::{Check, CheckFailed, Phase, PreFlight, Readiness};
use super::state_lock::{LOCK_FILE, StateLock};
use crate::discovery;
use crate::host::mps::HostCgroup;
use crate::state::checkpoint::read_snapshot;
use crate::state::records::ClaimEntry;

/// Where the records a takeover reads are.
#[derive(Clone, Debug)]
pub struct Takeover {
    pub state_dir: PathBuf,
    pub boot_id_file: PathBuf,
    /// The host cgroup MPS daemons move into (`--mps-cgroup-fs`,
    /// `--mps-cgroup`), when the node is configured with one.
    pub mps_cgroup: Option<HostCgroupPlace>,
}

impl Takeover {
    /// Whether a daemon could be placed in the host cgroup, as start-up
    /// will check (a forked child joins it and exits); nothing to check
    /// without one.
    pub fn check_placement(&self) -> Check {
        let Some(HostCgroupPlace { fs, name }) = &self.mps_cgroup else {
            return Ok("MPS daemons stay in this process's cgroup".into());
        };
        let failed = |source| CheckFailed::Placement {
            name: name.clone(),
            source: Arc::new(source),
        };
        let cgroup = HostCgroup::open(fs, name).map_err(failed)?;
        Arc::new(cgroup).check().map_err(failed)?;
        Ok(format!(
            "MPS daemons can be placed in the host cgroup {name}"
        ))
    }

    /// Reads the prepared-claim records of this boot as start-up will,
    /// changing nothing (the active process owns them).
    pub fn check_records(&self) -> Check {
        let boot =
            std::fs::read_to_string(&self.boot_id_file).map_err(|source| CheckFailed::BootId {
                path: self.boot_id_file.clone(),
                source: Arc::new(source),
            })?;
        let snapshot = read_snapshot::<ClaimEntry>(&self.state_dir, Some(boot.trim()))
            .map_err(|e| CheckFailed::Records(Arc::new(e)))?;
        if !snapshot.unreadable.is_empty() {
            return Err(CheckFailed::Undecodable {
                why: snapshot.unreadable,
                dir: self.state_dir.clone(),
            });
        }
        Ok(format!(
            "{} prepared-claim record(s) decode",
            snapshot.claims.len()
        ))
    }
}

/// Runs the pre-flight checks (blocking NVML calls on the blocking pool: nothing
/// is served yet). NVML is loaded once into `nvml`, which the instance
/// keeps when it takes over.
pub async fn preflight(
    nvml_library: &OsStr,
    nvml: &OnceLock<Arc<Nvml>>,
    client: &Client,
    timeout: Duration,
    takeover: &Takeover,
) -> PreFlight {
    let gpus = async {
        let loaded = match nvml.get() {
            Some(loaded) => loaded.clone(),
            None => {
                let library = nvml_library.to_owned();
                let loaded = blocking(move || discovery::init(Some(&library)))
                    .await?
                    .map_err(|e| CheckFailed::NvmlLoad(Arc::new(e)))?;
                nvml.get_or_init(|| Arc::new(loaded)).clone()
            }
        };
        blocking(move || list_gpus(&loaded)).await?
    };
    let api_server = async {
        match tokio::time::timeout(timeout, client.apiserver_version()).await {
            Ok(Ok(v)) => Ok(format!("the API server ({}) answers", v.git_version)),
            Ok(Err(e)) => Err(CheckFailed::ApiServer(Arc::new(e))),
            Err(_) => Err(CheckFailed::ApiServerSilent(timeout)),
        }
    };
    let records = {
        let takeover = takeover.clone();
        async move { blocking(move || takeover.check_records()).await? }
    };
    let placement = {
        let takeover = takeover.clone();
        async move { blocking(move || takeover.check_placement()).await? }
    };
    let (nvml, api_server, records, placement) = tokio::join!(gpus, api_server, records, placement);
    PreFlight {
        nvml,
        api_server,
        records,
        placement,
    }
}

/// Lists the GPUs, as the active instance will.
fn list_gpus(nvml: &Nvml) -> Check {
    let found = discovery::discover(nvml).map_err(|e| CheckFailed::Nvml(Arc::new(e)))?;
    let mut line = format!(
        "NVML {} lists {} GPUs",
        found.inventory.driver_version,
        found.inventory.gpus.len()
    );
    if !found.failed.is_empty() {
        line += &format!(" ({} could not be read)", found.failed.len());
    }
    Ok(line)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, CheckFailed> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CheckFailed::Panicked(Arc::new(e)))
}

/// While another process holds the state lock: runs the pre-flight checks
/// now and every `period`, and says what they found (probes and log).
/// Ends only when aborted (the lock is taken).
pub async fn standby(
    nvml_library: std::ffi::OsString,
    nvml: Arc<OnceLock<Arc<Nvml>>>,
    client: Client,
    timeout: Duration,
    readiness: Arc<Readiness>,
    period: Duration,
    takeover: Takeover,
) {
    readiness.set(Phase::Standby(None));
    let mut passed = None;
    loop {
        let checks = preflight(&nvml_library, &nvml, &client, timeout, &takeover).await;
        if passed != Some(checks.passed()) {
            if checks.passed() {
                info!("standby: ready to take over ({})", checks.describe());
            } else {
                warn!("standby: cannot take over: {}", checks.describe());
            }
            passed = Some(checks.passed());
        }
        readiness.set(Phase::Standby(Some(checks)));
        tokio::time::sleep(period).await;
    }
}

/// The state directory could not be locked (not that another process
/// holds it: that is waited for).
#[derive(Debug, thiserror::Error)]
#[error("locking the state directory {}: {source}", dir.display())]
pub struct LockError {
    pub dir: PathBuf,
    pub source: std::io::Error,
}

/// How often a standby runs its pre-flight checks again, and how often it
/// tries the state lock.
const PREFLIGHT_PERIOD: Duration = Duration::from_secs(10);
const LOCK_POLL: Duration = Duration::from_millis(200);

/// Takes the state lock. While another process holds it (a rolling
/// update), this one is on standby: pre-flight checks say whether it could
/// take over (its probes answer so) while it tries the lock until the other
/// exits. Returns the NVML handle the checks loaded, if they did.
pub async fn take_state_lock(
    nvml_library: &OsStr,
    config: &NodeConfig,
    client: &Client,
    readiness: &Arc<Readiness>,
) -> Result<(StateLock, Option<Arc<Nvml>>), LockError> {
    let dir = &config.state_dir;
    let try_lock = || {
        StateLock::try_acquire(dir).map_err(|source| LockError {
            dir: dir.clone(),
            source,
        })
    };
    if let Some(lock) = try_lock()? {
        return Ok((lock, None));
    }
    info!(
        "another Tessera process holds {}; waiting for it to exit (rolling update); standby until then",
        dir.join(LOCK_FILE).display()
    );
    let nvml = Arc::new(OnceLock::new());
    // Checks run beside the lock polls: a slow check never delays taking over.
    let checking = tokio::spawn(standby(
        nvml_library.to_owned(),
        nvml.clone(),
        client.clone(),
        config.api_timeout,
        readiness.clone(),
        PREFLIGHT_PERIOD,
        Takeover {
            state_dir: config.state_dir.clone(),
            boot_id_file: config.boot_id_file.clone(),
            mps_cgroup: config.mps_cgroup.clone(),
        },
    ));
    let lock = loop {
        match try_lock() {
            Ok(Some(lock)) => break Ok(lock),
            Ok(None) => tokio::time::sleep(LOCK_POLL).await,
            Err(e) => break Err(e),
        }
    };
    checking.abort();
    // Gone for good: it never changes the readiness after this.
    let _ = checking.await;
    let lock = lock?;
    info!("took over the state lock");
    Ok((lock, nvml.get().cloned()))
}
