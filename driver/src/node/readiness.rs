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
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tracing::{debug, info, warn};

use crate::discovery;
use crate::host::mps::HostCgroupError;
use crate::metrics::server::plain;
use crate::state::catalog::DeviceCatalog;
use crate::state::checkpoint::SnapshotError;
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

/// One pre-flight check: what it found, or why it failed.
pub type Check = Result<String, CheckFailed>;

/// Why a pre-flight check failed. Kept in the probes' answer (so cloned),
/// with its cause.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CheckFailed {
    #[error(transparent)]
    NvmlLoad(Arc<discovery::Error>),
    #[error("NVML: {0}")]
    Nvml(Arc<discovery::Error>),
    #[error("the API server does not answer: {0}")]
    ApiServer(Arc<kube::Error>),
    #[error("the API server did not answer within {0:?}")]
    ApiServerSilent(Duration),
    #[error("cannot read the boot id {}: {source}", path.display())]
    BootId {
        path: PathBuf,
        source: Arc<std::io::Error>,
    },
    #[error("cannot read the prepared-claim records: {0}")]
    Records(Arc<SnapshotError>),
    #[error(
        "{} prepared-claim record(s) do not decode in this version ({}); taking over would set \
         their claims aside as lost. Fix: roll back to the version serving now, or check the \
         records under {}",
        why.len(),
        why.join("; "),
        dir.display()
    )]
    Undecodable { why: Vec<String>, dir: PathBuf },
    #[error("cannot place MPS daemons in the host cgroup {name}: {source}")]
    Placement {
        name: String,
        source: Arc<HostCgroupError>,
    },
    #[error("NVML check failed: {0}")]
    Panicked(Arc<tokio::task::JoinError>),
}

/// The answers of one pre-flight: each check's finding, or why it failed.
#[derive(Clone, Debug)]
pub struct PreFlight {
    pub nvml: Check,
    pub api_server: Check,
    /// Whether this version reads the records it would take over.
    pub records: Check,
    /// Whether it could place MPS daemons where they outlive it.
    pub placement: Check,
}

impl PreFlight {
    pub fn passed(&self) -> bool {
        self.checks().iter().all(|c| c.is_ok())
    }

    fn checks(&self) -> [&Check; 4] {
        [&self.nvml, &self.api_server, &self.records, &self.placement]
    }

    /// One line: the failures if any, else what was found.
    pub fn describe(&self) -> String {
        let checks = self.checks();
        let failed: Vec<String> = checks
            .iter()
            .filter_map(|c| c.as_ref().err())
            .map(ToString::to_string)
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

/// What the probes ask; shared by the socket's server and the node process.
#[derive(Default)]
pub struct Readiness {
    phase: Mutex<Phase>,
    /// The kubelet's last word on the registration.
    registered: AtomicBool,
    /// The pool's generation after the last reconcile that left the
    /// server with the model; 0 before the first.
    published: AtomicI64,
    /// Where metrics are served, once bound.
    metrics_address: Mutex<Option<SocketAddr>>,
    /// Where they are served over TLS, once bound.
    secure_metrics_address: Mutex<Option<SocketAddr>>,
}

/// `GET /status`: where the node process stands, as JSON, for tools and
/// tests that wait for it (never its log).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// `starting`, `standby` or `active`.
    pub phase: String,
    /// What `/readyz` answers.
    pub ready: bool,
    /// The kubelet accepted the plugin's registration.
    pub registered: bool,
    /// The node's slices were written (or found up to date) at least
    /// once; the pool's generation then.
    pub published_generation: Option<i64>,
    /// Where Prometheus metrics are served (the port bound, when asked
    /// for any); `None` when they are not (yet).
    pub metrics_address: Option<SocketAddr>,
    /// Where they are served over TLS to whom the API server allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_metrics_address: Option<SocketAddr>,
}

impl NodeStatus {
    /// Serving: registered with the kubelet, slices published.
    pub fn serving(&self) -> bool {
        self.registered && self.published_generation.is_some()
    }
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

    /// What the kubelet said of the registration.
    pub fn set_registered(&self, registered: bool) {
        self.registered.store(registered, Ordering::SeqCst);
    }

    /// A reconcile left the server with the model, at `generation`.
    pub fn set_published(&self, generation: i64) {
        // A pool's generation starts at 1; keep 0 for "never".
        self.published.store(generation.max(1), Ordering::SeqCst);
    }

    /// Metrics are served at `address`.
    pub fn set_metrics_address(&self, address: SocketAddr) {
        *self.metrics_address.locked() = Some(address);
    }

    /// Authenticated metrics are served at `address`.
    pub fn set_secure_metrics_address(&self, address: SocketAddr) {
        *self.secure_metrics_address.locked() = Some(address);
    }

    pub fn status(&self) -> NodeStatus {
        let phase = match self.phase() {
            Phase::Starting => "starting",
            Phase::Standby(_) => "standby",
            Phase::Active(_) => "active",
        };
        let published = self.published.load(Ordering::SeqCst);
        NodeStatus {
            phase: phase.into(),
            ready: self.ready().ok,
            registered: self.registered.load(Ordering::SeqCst),
            published_generation: (published > 0).then_some(published),
            metrics_address: *self.metrics_address.locked(),
            secure_metrics_address: *self.secure_metrics_address.locked(),
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
pub async fn serve(socket: &Path, readiness: Arc<Readiness>) -> Result<(), ProbeSocketError> {
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

/// Why the probe socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum ProbeSocketError {
    #[error("creating {} (--health-socket): {source}", dir.display())]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "another process answers probes on {} (--health-socket): the socket must be in a \
         directory of this pod alone (an emptyDir), never a host path",
        socket.display()
    )]
    Taken { socket: PathBuf },
    #[error("removing the stale socket {}: {source}", socket.display())]
    Stale {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("binding the probe socket {} (--health-socket): {source}", socket.display())]
    Bind {
        socket: PathBuf,
        source: std::io::Error,
    },
}

/// The socket, bound. A socket file nobody answers on is a previous run's
/// (the container restarted in the same pod) and is replaced; one that
/// answers is another process's.
fn bind(socket: &Path) -> Result<tokio::net::UnixListener, ProbeSocketError> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ProbeSocketError::Dir {
            dir: dir.to_owned(),
            source,
        })?;
    }
    let bind = || {
        tokio::net::UnixListener::bind(socket).map_err(|source| ProbeSocketError::Bind {
            socket: socket.to_owned(),
            source,
        })
    };
    match bind() {
        Err(ProbeSocketError::Bind { source, .. })
            if source.kind() == std::io::ErrorKind::AddrInUse =>
        {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return Err(ProbeSocketError::Taken {
                    socket: socket.to_owned(),
                });
            }
            std::fs::remove_file(socket).map_err(|source| ProbeSocketError::Stale {
                socket: socket.to_owned(),
                source,
            })?;
            bind()
        }
        bound => bound,
    }
}

fn respond(request: &Request<Incoming>, readiness: &Readiness) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    let answer = match request.uri().path() {
        "/readyz" | "/healthz" => readiness.ready(),
        "/livez" => readiness.live(),
        "/status" => {
            let status = readiness.status();
            Answer {
                ok: status.serving(),
                text: serde_json::to_string(&status).unwrap_or_default(),
            }
        }
        _ => {
            return plain(
                StatusCode::NOT_FOUND,
                "not found: try /readyz, /livez or /status\n",
            );
        }
    };
    let status = if answer.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    plain(status, &format!("{}\n", answer.text))
}

/// Why a probe got no answer.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error(
        "no node process answers on {} (is `tessera plugin --health-socket {0}` running?): {source}",
        socket.display()
    )]
    NoAnswer {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("asking on {}: {source}", socket.display())]
    Io {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("not an HTTP answer: {0:?}")]
    NotHttp(String),
}

/// `GET path` over the socket (HTTP/1.0: the server closes the connection
/// after its answer); the status code and body.
pub fn ask(socket: &Path, path: &str, timeout: Duration) -> Result<(u16, String), AskError> {
    let io = |source| AskError::Io {
        socket: socket.to_owned(),
        source,
    };
    let mut stream =
        std::os::unix::net::UnixStream::connect(socket).map_err(|source| AskError::NoAnswer {
            socket: socket.to_owned(),
            source,
        })?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: tessera\r\n\r\n").as_bytes())
        .map_err(io)?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(io)?;
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        return Err(AskError::NotHttp(answer));
    };
    match head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
    {
        Some(status) => Ok((status, body.to_owned())),
        None => Err(AskError::NotHttp(answer.clone())),
    }
}

#[cfg(test)]
mod tests;
