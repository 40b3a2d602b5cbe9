//! This instance's readiness and liveness, answered over a unix socket in a
//! directory of its own pod (`--health-socket`, an emptyDir), for the
//! kubelet's exec probes (`tessera health`; the image has no shell).
//!
//! On the host network the metrics port is the node's, not the pod's:
//! during a rolling update the new pod's HTTP probes reached the old
//! process, so a new version that could never serve turned Ready, and the
//! DaemonSet deleted the old pod that still worked. The socket is bound
//! before the state lock is waited for, and only this process answers on it:
//!
//! * standby (another process holds the state lock): ready when the
//!   pre-flight checks pass ([`PreFlight`]: NVML loads and lists the GPUs,
//!   the API server answers, the prepared-claim records of this boot decode
//!   as takeover will read them, read-only), i.e. ready to take over; a
//!   broken new version (or one that would move every record aside) never
//!   turns Ready, so the roll stops with the old pod serving;
//! * active (holds the lock): ready once the first slice model is built
//!   (prepare can resolve device names).
//!
//! Live whenever it answers: a standby waits as long as the old process
//! runs, and must not be killed for it.

use std::convert::Infallible;
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, bail};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kube::Client;
use nvml_wrapper::Nvml;
use tracing::{debug, info, warn};

use crate::discovery;
use crate::metrics::server::plain;
use crate::state::catalog::DeviceCatalog;
use crate::sync::Locked;

/// What this instance is doing, for its probes.
#[derive(Clone, Default)]
pub enum Phase {
    /// Started; finding out whether another instance holds the state.
    #[default]
    Starting,
    /// Another instance holds the state lock; this one waits to take over.
    /// `None` until the first pre-flight is done.
    Standby(Option<PreFlight>),
    /// Holds the state lock: ready once the catalog has a model.
    Active(Arc<DeviceCatalog>),
}

/// The answers of one pre-flight: each check's finding, or why it failed.
#[derive(Clone, Debug)]
pub struct PreFlight {
    pub nvml: Result<String, String>,
    pub api_server: Result<String, String>,
    /// Whether this version reads the records it would take over.
    pub records: Result<String, String>,
    /// Whether it could place MPS daemons where they outlive it.
    pub placement: Result<String, String>,
}

/// Where the records a takeover reads are.
#[derive(Clone, Debug)]
pub struct Takeover {
    pub state_dir: PathBuf,
    pub boot_id_file: PathBuf,
    /// The host cgroup MPS daemons move into (`--mps-cgroup-fs`,
    /// `--mps-cgroup`), when the node is configured with one.
    pub mps_cgroup: Option<(PathBuf, String)>,
}

impl Takeover {
    /// Whether a daemon could be placed in the host cgroup, as start-up
    /// will check (a forked child joins it and exits); nothing to check
    /// without one.
    pub fn check_placement(&self) -> Result<String, String> {
        let Some((fs, name)) = &self.mps_cgroup else {
            return Ok("MPS daemons stay in this process's cgroup".into());
        };
        let cgroup = crate::mps::HostCgroup::open(fs, name)
            .map_err(|e| format!("cannot place MPS daemons in the host cgroup {name}: {e}"))?;
        std::sync::Arc::new(cgroup)
            .check()
            .map_err(|e| format!("cannot place MPS daemons in the host cgroup {name}: {e}"))?;
        Ok(format!(
            "MPS daemons can be placed in the host cgroup {name}"
        ))
    }

    /// Reads the prepared-claim records of this boot as start-up will,
    /// changing nothing (the active process owns them).
    pub fn check_records(&self) -> Result<String, String> {
        let boot = std::fs::read_to_string(&self.boot_id_file).map_err(|e| {
            format!(
                "cannot read the boot id {}: {e}",
                self.boot_id_file.display()
            )
        })?;
        let snapshot = crate::checkpoint::read_snapshot::<crate::state::records::ClaimEntry>(
            &self.state_dir,
            Some(boot.trim()),
        )
        .map_err(|e| format!("cannot read the prepared-claim records: {e}"))?;
        if !snapshot.unreadable.is_empty() {
            return Err(format!(
                "{} prepared-claim record(s) do not decode in this version ({}); taking over \
                 would set their claims aside as lost. Fix: roll back to the version serving \
                 now, or check the records under {}",
                snapshot.unreadable.len(),
                snapshot.unreadable.join("; "),
                self.state_dir.display()
            ));
        }
        Ok(format!(
            "{} prepared-claim record(s) decode",
            snapshot.claims.len()
        ))
    }
}

impl PreFlight {
    /// Runs the checks (blocking NVML calls on the blocking pool: nothing
    /// is served yet). NVML is loaded once into `nvml`, which the instance
    /// keeps when it takes over.
    pub async fn run(
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
                        .map_err(|e| e.to_string())?;
                    nvml.get_or_init(|| Arc::new(loaded)).clone()
                }
            };
            blocking(move || list_gpus(&loaded)).await?
        };
        let api_server = async {
            match tokio::time::timeout(timeout, client.apiserver_version()).await {
                Ok(Ok(v)) => Ok(format!("the API server ({}) answers", v.git_version)),
                Ok(Err(e)) => Err(format!("the API server does not answer: {e}")),
                Err(_) => Err(format!("the API server did not answer within {timeout:?}")),
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
        let (nvml, api_server, records, placement) =
            tokio::join!(gpus, api_server, records, placement);
        PreFlight {
            nvml,
            api_server,
            records,
            placement,
        }
    }

    pub fn passed(&self) -> bool {
        self.checks().iter().all(|c| c.is_ok())
    }

    fn checks(&self) -> [&Result<String, String>; 4] {
        [&self.nvml, &self.api_server, &self.records, &self.placement]
    }

    /// One line: the failures if any, else what was found.
    pub fn describe(&self) -> String {
        let checks = self.checks();
        let failed: Vec<&str> = checks
            .iter()
            .filter_map(|c| c.as_ref().err())
            .map(String::as_str)
            .collect();
        if failed.is_empty() {
            checks
                .iter()
                .filter_map(|c| c.as_ref().ok())
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join("; ")
        } else {
            failed.join("; ")
        }
    }
}

/// Lists the GPUs, as the active instance will.
fn list_gpus(nvml: &Nvml) -> Result<String, String> {
    let found = discovery::discover(nvml).map_err(|e| format!("NVML: {e}"))?;
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

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("NVML check failed: {e}"))
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
        let checks = PreFlight::run(&nvml_library, &nvml, &client, timeout, &takeover).await;
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

/// What the probes ask; shared by the socket's server and the node process.
#[derive(Default)]
pub struct Readiness {
    phase: Mutex<Phase>,
}

/// A probe's answer: whether it passes, and why.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub ok: bool,
    pub text: String,
}

impl Readiness {
    pub fn set(&self, phase: Phase) {
        *self.phase.locked() = phase;
    }

    fn phase(&self) -> Phase {
        self.phase.locked().clone()
    }

    /// Whether this instance is ready: to take over (standby), or to serve.
    pub fn ready(&self) -> Answer {
        let answer = |ok, text: String| Answer { ok, text };
        match self.phase() {
            Phase::Starting => answer(false, "starting: looking for the state lock".into()),
            Phase::Standby(None) => answer(
                false,
                "standby: another process holds the state lock; checking whether this one can take over".into(),
            ),
            Phase::Standby(Some(checks)) if checks.passed() => answer(
                true,
                format!("standby: ready to take over ({})", checks.describe()),
            ),
            Phase::Standby(Some(checks)) => answer(
                false,
                format!("standby: cannot take over: {}", checks.describe()),
            ),
            Phase::Active(catalog) if catalog.subscribe().borrow().is_some() => {
                answer(true, "serving: the node's devices are known".into())
            }
            Phase::Active(_) => answer(
                false,
                "active: the node's devices are not known yet (no slice model built)".into(),
            ),
        }
    }

    /// Whether this instance is alive: it answers. A standby waits as long
    /// as the instance holding the lock runs.
    pub fn live(&self) -> Answer {
        let ready = self.ready();
        Answer {
            ok: true,
            text: format!("alive; {}", ready.text),
        }
    }
}

/// Binds `socket` (its directory is created) and answers probes on it in
/// the background until the runtime ends:
///
/// * `GET /readyz` (and `/healthz`): 200 when [`Readiness::ready`], else 503;
/// * `GET /livez`: 200 while the process answers.
pub async fn serve(socket: &Path, readiness: Arc<Readiness>) -> anyhow::Result<()> {
    let listener = bind(socket)?;
    info!(
        "answering probes on {} (tessera health --socket {0})",
        socket.display()
    );
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!("probe socket: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let readiness = readiness.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let answer = respond(&request, &readiness);
                    async move { Ok::<_, Infallible>(answer) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                match tokio::time::timeout(PROBE_TIMEOUT, connection).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!("probe connection: {e}"),
                    Err(_) => debug!("probe connection timed out"),
                }
            });
        }
    });
    Ok(())
}

/// How long one probe connection may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The socket, bound. A socket file nobody answers on is a previous run's
/// (the container restarted in the same pod) and is replaced; one that
/// answers is another process's.
fn bind(socket: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating {} (--health-socket)", dir.display()))?;
    }
    match tokio::net::UnixListener::bind(socket) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                bail!(
                    "another process answers probes on {} (--health-socket): the socket must \
                     be in a directory of this pod alone (an emptyDir), never a host path",
                    socket.display()
                );
            }
            std::fs::remove_file(socket)
                .with_context(|| format!("removing the stale socket {}", socket.display()))?;
            tokio::net::UnixListener::bind(socket)
        }
        bound => bound,
    }
    .with_context(|| {
        format!(
            "binding the probe socket {} (--health-socket)",
            socket.display()
        )
    })
}

fn respond(request: &Request<Incoming>, readiness: &Readiness) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    let answer = match request.uri().path() {
        "/readyz" | "/healthz" => readiness.ready(),
        "/livez" => readiness.live(),
        _ => {
            return plain(StatusCode::NOT_FOUND, "not found: try /readyz or /livez\n");
        }
    };
    let status = if answer.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    plain(status, &format!("{}\n", answer.text))
}

/// `tessera health`: asks a running node process over its probe socket.
#[derive(Debug, Clone, clap::Args)]
pub struct ProbeArgs {
    /// The node process's `--health-socket`.
    #[arg(long, env = "TESSERA_HEALTH_SOCKET")]
    pub socket: PathBuf,

    /// What to ask: `readiness` (ready to serve, or in standby ready to
    /// take over) or `liveness` (the process answers).
    #[arg(long, value_enum, default_value_t = Probe::Readiness)]
    pub probe: Probe,

    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 5)]
    pub timeout_seconds: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Probe {
    Readiness,
    Liveness,
}

impl Probe {
    fn path(self) -> &'static str {
        match self {
            Probe::Readiness => "/readyz",
            Probe::Liveness => "/livez",
        }
    }
}

/// Prints the answer; exit 0 when the probe passes, 1 when not (or no
/// process answers).
pub fn probe_main(args: &ProbeArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::from_secs(args.timeout_seconds.max(1));
    let (status, body) = ask(&args.socket, args.probe.path(), timeout)?;
    print!("{body}");
    Ok(if status == 200 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `GET path` over the socket (HTTP/1.0: the server closes the connection
/// after its answer); the status code and body.
pub fn ask(socket: &Path, path: &str, timeout: Duration) -> anyhow::Result<(u16, String)> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).with_context(|| {
        format!(
            "no node process answers on {} (is `tessera plugin --health-socket {0}` running?)",
            socket.display()
        )
    })?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: tessera\r\n\r\n").as_bytes())?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .with_context(|| format!("reading the answer on {}", socket.display()))?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .with_context(|| format!("not an HTTP answer: {answer:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status code in {head:?}"))?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::catalog::Catalog;

    fn checks(nvml: Result<&str, &str>) -> PreFlight {
        PreFlight {
            nvml: nvml.map(str::to_owned).map_err(str::to_owned),
            api_server: Ok("the API server (v1.37.2) answers".into()),
            records: Ok("0 prepared-claim record(s) decode".into()),
            placement: Ok("MPS daemons stay in this process's cgroup".into()),
        }
    }

    /// A standby that could not place MPS daemons in the host cgroup is
    /// not Ready: taking over, it would exit at its start.
    #[test]
    fn a_standby_that_cannot_place_daemons_is_not_ready() {
        let dir = tempfile::tempdir().unwrap();
        let takeover = |cgroup: Option<(PathBuf, String)>| Takeover {
            state_dir: dir.path().join("state"),
            boot_id_file: dir.path().join("boot_id"),
            mps_cgroup: cgroup,
        };
        assert!(takeover(None).check_placement().is_ok());
        // A directory that is no cgroup filesystem.
        let r = Readiness::default();
        let mut preflight = checks(Ok("NVML 580 lists 2 GPUs"));
        preflight.placement =
            takeover(Some((dir.path().into(), "tessera-mps".into()))).check_placement();
        r.set(Phase::Standby(Some(preflight)));
        let answer = r.ready();
        assert!(!answer.ok, "{answer:?}");
        assert!(
            answer.text.contains("cannot place MPS daemons"),
            "{answer:?}"
        );
    }

    /// A standby whose version cannot decode the records it would take
    /// over is not Ready: taking over would set their claims aside.
    #[test]
    fn a_standby_that_cannot_decode_the_records_is_not_ready() {
        let dir = tempfile::tempdir().unwrap();
        let boot_id_file = dir.path().join("boot_id");
        std::fs::write(&boot_id_file, "boot-a\n").unwrap();
        let takeover = Takeover {
            state_dir: dir.path().join("state"),
            boot_id_file,
            mps_cgroup: None,
        };
        let records = dir
            .path()
            .join("state")
            .join(crate::checkpoint::RECORDS_DIR);
        std::fs::create_dir_all(&records).unwrap();
        let record = records.join("0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e.json");
        std::fs::write(
            &record,
            r#"{"version":3,"bootId":"boot-a","crc32":0,"entry":"{}"}"#,
        )
        .unwrap();

        let r = Readiness::default();
        let mut preflight = checks(Ok("NVML 580 lists 2 GPUs"));
        preflight.records = takeover.check_records();
        r.set(Phase::Standby(Some(preflight)));
        let answer = r.ready();
        assert!(!answer.ok, "{answer:?}");
        assert!(
            answer.text.contains("version 3 is not supported"),
            "{answer:?}"
        );
        assert!(record.exists(), "read only: nothing moved aside");

        std::fs::remove_file(&record).unwrap();
        assert!(takeover.check_records().is_ok());
    }

    #[test]
    fn a_standby_is_ready_only_when_its_checks_pass() {
        let r = Readiness::default();
        assert!(!r.ready().ok, "starting");
        r.set(Phase::Standby(None));
        assert!(!r.ready().ok, "not checked yet");
        r.set(Phase::Standby(Some(checks(Err(
            "cannot load the NVML library",
        )))));
        let answer = r.ready();
        assert!(!answer.ok);
        assert!(
            answer.text.contains("cannot load the NVML library"),
            "{answer:?}"
        );
        assert!(r.live().ok, "a standby is never killed for waiting");
        r.set(Phase::Standby(Some(checks(Ok("NVML 580 lists 2 GPUs")))));
        let answer = r.ready();
        assert!(answer.ok);
        assert!(
            answer.text.starts_with("standby: ready to take over"),
            "{answer:?}"
        );
    }

    #[test]
    fn an_active_instance_is_ready_once_its_devices_are_known() {
        let r = Readiness::default();
        let catalog = Arc::new(DeviceCatalog::awaiting_model());
        r.set(Phase::Active(catalog.clone()));
        assert!(!r.ready().ok);
        assert!(r.live().ok);
        catalog.set(Catalog::new(Default::default(), Default::default()));
        assert!(r.ready().ok);
    }

    #[tokio::test]
    async fn answers_over_its_socket_and_replaces_only_a_stale_one() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run/health.sock");
        // A previous run's socket, nobody listening.
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        let readiness = Arc::new(Readiness::default());
        serve(&socket, readiness.clone()).await.unwrap();
        let ask = |path: &'static str| {
            let socket = socket.clone();
            tokio::task::spawn_blocking(move || ask(&socket, path, Duration::from_secs(5)))
        };
        assert_eq!(ask("/readyz").await.unwrap().unwrap().0, 503);
        assert_eq!(ask("/livez").await.unwrap().unwrap().0, 200);
        readiness.set(Phase::Standby(Some(checks(Ok("NVML lists 1 GPUs")))));
        let (code, body) = ask("/readyz").await.unwrap().unwrap();
        assert_eq!(code, 200, "{body}");
        assert!(body.starts_with("standby: ready to take over"), "{body}");
        assert_eq!(ask("/nothing").await.unwrap().unwrap().0, 404);

        // A second instance on the same socket is refused, not let in.
        let err = serve(&socket, Arc::new(Readiness::default()))
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("emptyDir"), "{err:#}");
    }
}
