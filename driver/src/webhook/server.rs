//! The webhook's HTTPS server (rustls with ring, as kube's client already
//! uses; hyper 1, HTTP/1.1):
//!
//! * `POST /validate`: an AdmissionReview in, the verdict out;
//! * `GET /healthz`, `GET /readyz`: 200 while serving (the certificate was
//!   loaded before the port was opened);
//! * anything else: 404.
//!
//! The certificate and key are read at start and again by the first TLS
//! handshake after either file changed ([`crate::tls`]).
//!
//! At most `max_connections` connections are held at once, so a flood
//! cannot grow the tasks and buffers held without bound. Holding one costs
//! the holder nothing, so an idle connection (in its TLS handshake, which
//! must end within [`HANDSHAKE_TIMEOUT`], or between requests) gives its
//! slot to the next connection when all are taken, oldest first: idle or
//! slow-handshake connections cannot keep the API server's review waiting.
//! A connection in a request keeps its slot (a request must be read and
//! answered within [`REQUEST_TIMEOUT`]); only when every slot is in a
//! request does the next connection wait in the listen backlog.
//!
//! A body is read up to [`MAX_BODY_BYTES`]; a longer one (or one whose
//! Content-Length says so, before any of it is read) is answered 413.

use crate::sync::Locked;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicU8, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt as _, Full, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tracing::{debug, info, warn};

/// Largest AdmissionReview read. The API server takes request bodies of at
/// most 3 MiB, so an UPDATE's review holds at most two such objects (new
/// and old) beside a small envelope: 7 MiB is more than any review it
/// sends, and bounds what one connection can make the webhook buffer.
pub const MAX_BODY_BYTES: usize = 7 << 20;

pub use crate::tls::HANDSHAKE_TIMEOUT;
use crate::tls::{ConnectionError, handshake};

/// How long one request may take from its first header byte to the
/// answer (the API server's own webhook timeout is at most 30 s, 10 s by
/// default).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one connection may last at all.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);

/// The listening socket could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("binding {address} (--listen)")]
pub struct BindError {
    pub address: SocketAddr,
    pub source: std::io::Error,
}

/// Binds the listening socket.
pub async fn bind(address: SocketAddr) -> Result<TcpListener, BindError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| BindError { address, source })
}

/// Serves until `shutdown` resolves, at most `max_connections` at once;
/// connections in flight are left to finish on their own tasks (each
/// bounded by a timeout).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    driver: String,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let bound = listener.local_addr()?;
    info!(
        driver = %driver,
        max_connections,
        "serving admission reviews on https://{bound}/validate (health: /healthz, /readyz)"
    );
    let acceptor = TlsAcceptor::from(tls);
    let driver: Arc<str> = driver.into();
    let slots = Slots::new(max_connections);
    tokio::pin!(shutdown);
    loop {
        let Some((stream, peer)) = until(shutdown.as_mut(), accept(&listener)).await else {
            break;
        };
        // A slot for it (an idle connection's, if need be): while every
        // slot is in a request, it waits and the next stay unaccepted.
        let Some(slot) = until(shutdown.as_mut(), slots.take()).await else {
            break;
        };
        let connection = Connection {
            acceptor: acceptor.clone(),
            driver: driver.clone(),
            stream,
            peer,
        };
        tokio::spawn(connection.run(slot));
    }
    info!("stopping");
    Ok(())
}

/// `work`'s output, or `None` if `shutdown` came first.
async fn until<T>(
    shutdown: Pin<&mut impl Future<Output = ()>>,
    work: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        () = shutdown => None,
        done = work => Some(done),
    }
}

/// The next connection; a failed accept (out of file descriptors, say) is
/// logged and retried a moment later.
async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// An accepted connection, served on a task of its own.
struct Connection {
    acceptor: TlsAcceptor,
    driver: Arc<str>,
    stream: TcpStream,
    peer: SocketAddr,
}

impl Connection {
    /// Serves it while it holds `slot`: until it ends, times out or is
    /// evicted for a new one.
    async fn run(self, slot: Slot) {
        let peer = self.peer;
        let state = slot.state.clone();
        tokio::select! {
            done = tokio::time::timeout(CONNECTION_TIMEOUT, self.serve(state)) => match done {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, "connection: {e}"),
                Err(_) => debug!(%peer, "connection timed out"),
            },
            () = slot.state.evicted.notified() => {
                debug!(%peer, "idle connection closed for a new one");
            }
        }
        drop(slot);
    }

    /// The TLS handshake, then HTTP/1.1 requests until the client is done.
    async fn serve(self, state: Arc<ConnectionState>) -> Result<(), ConnectionError> {
        let stream = handshake(&self.acceptor, self.stream).await?;
        let driver = self.driver;
        let service = hyper::service::service_fn(move |request| {
            request_in(state.clone(), driver.clone(), request)
        });
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(REQUEST_TIMEOUT)
            .serve_connection(TokioIo::new(stream), service)
            .await
            .map_err(ConnectionError::Http)
    }
}

/// One request, answered while its connection is marked busy (so that it
/// keeps its slot), within [`REQUEST_TIMEOUT`].
async fn request_in(
    state: Arc<ConnectionState>,
    driver: Arc<str>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let Some(_busy) = state.busy() else {
        return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, "evicted\n"));
    };
    let answer = tokio::time::timeout(REQUEST_TIMEOUT, answer(request, &driver))
        .await
        .unwrap_or_else(|_| plain(StatusCode::REQUEST_TIMEOUT, "request timed out\n"));
    Ok(answer)
}

/// The connection slots, oldest connection first.
struct Slots {
    cap: usize,
    held: Mutex<BTreeMap<u64, Arc<ConnectionState>>>,
    next: AtomicU64,
    /// A slot was given up.
    freed: Notify,
}

/// Whether a connection is in a request; how it is told to close.
#[derive(Default)]
struct ConnectionState {
    /// IDLE, BUSY or EVICTED.
    phase: AtomicU8,
    evicted: Notify,
}

const IDLE: u8 = 0;
const BUSY: u8 = 1;
const EVICTED: u8 = 2;

impl ConnectionState {
    /// Marks the connection in a request until the guard drops; `None`
    /// once it was evicted.
    fn busy(self: &Arc<Self>) -> Option<Busy> {
        (self.phase.compare_exchange(IDLE, BUSY, SeqCst, SeqCst)).ok()?;
        Some(Busy(self.clone()))
    }

    /// Evicts it unless it is in a request.
    fn evict(&self) -> bool {
        let evicted = self
            .phase
            .compare_exchange(IDLE, EVICTED, SeqCst, SeqCst)
            .is_ok();
        if evicted {
            self.evicted.notify_one();
        }
        evicted
    }
}

struct Busy(Arc<ConnectionState>);

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = (self.0.phase).compare_exchange(BUSY, IDLE, SeqCst, SeqCst);
    }
}

/// One connection's hold on a slot, given up when dropped.
struct Slot {
    id: u64,
    state: Arc<ConnectionState>,
    slots: Arc<Slots>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.lock().remove(&self.id);
        self.slots.freed.notify_one();
    }
}

impl Slots {
    fn new(cap: usize) -> Arc<Slots> {
        Arc::new(Slots {
            cap,
            held: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
            freed: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ConnectionState>>> {
        self.held.locked()
    }

    /// A slot: a free one, else the oldest idle connection's, else the
    /// first given up.
    async fn take(self: &Arc<Self>) -> Slot {
        loop {
            let freed = self.freed.notified();
            {
                let mut held = self.lock();
                if held.len() >= self.cap {
                    let idle = held.iter().find(|(_, s)| s.evict()).map(|(id, _)| *id);
                    if let Some(id) = idle {
                        held.remove(&id);
                    }
                }
                if held.len() < self.cap {
                    let id = self.next.fetch_add(1, SeqCst);
                    let state = Arc::new(ConnectionState::default());
                    held.insert(id, state.clone());
                    return Slot {
                        id,
                        state,
                        slots: self.clone(),
                    };
                }
            }
            freed.await;
        }
    }
}

async fn answer(request: Request<Incoming>, driver: &str) -> Response<Full<Bytes>> {
    match (request.method(), request.uri().path()) {
        (&Method::POST, "/validate") => {
            let too_large = || {
                plain(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("an AdmissionReview is at most {MAX_BODY_BYTES} bytes\n"),
                )
            };
            let declared = request.headers().get(hyper::header::CONTENT_LENGTH);
            let declared = declared.and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
                return too_large();
            }
            let body = match Limited::new(request.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
            {
                Ok(body) => body.to_bytes(),
                Err(e) if e.is::<LengthLimitError>() => return too_large(),
                Err(e) => {
                    return plain(
                        StatusCode::BAD_REQUEST,
                        &format!("cannot read the body: {e}\n"),
                    );
                }
            };
            match super::review(driver, &body) {
                Ok(review) => {
                    let mut response = Response::new(Full::new(Bytes::from(review.to_string())));
                    response.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("application/json"),
                    );
                    response
                }
                Err(why) => {
                    warn!("bad admission request: {why}");
                    plain(StatusCode::BAD_REQUEST, &format!("{why}\n"))
                }
            }
        }
        (&Method::GET | &Method::HEAD, "/healthz" | "/readyz") => plain(StatusCode::OK, "ok\n"),
        (_, "/validate") => plain(StatusCode::METHOD_NOT_ALLOWED, "only POST\n"),
        _ => plain(
            StatusCode::NOT_FOUND,
            "not found: POST /validate, GET /healthz or /readyz\n",
        ),
    }
}

fn plain(status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text.to_owned())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests;
