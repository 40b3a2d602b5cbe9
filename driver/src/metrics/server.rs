//! A minimal HTTP/1 server for the metrics (hyper, already in the build
//! through tonic and kube):
//!
//! * `GET /metrics`: every metric, OpenMetrics text (renders shared by
//!   concurrent scrapes, see [`super::renders`]);
//! * `GET /healthz`: 200 once the node's first slice model is built
//!   (prepare can resolve device names), 503 before;
//! * anything else: 404.
//!
//! Two endpoints serve the same: `--metrics-address` in plain HTTP to
//! anyone who reaches it (the chart keeps it on the node's loopback), and
//! `--metrics-secure-address` over TLS to those the API server says may
//! `get` the path ([`super::access`]), for a Service in front of the pods.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tracing::{debug, info, warn};

use super::Metrics;
use super::access::{Access, Verdict};
use crate::tls::{ConnectionError, handshake};

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long one connection may take (slow or idle scrapers are dropped).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections served at once (scrapers and probes need a few); one more is
/// answered 503 and closed, so idle connections cannot pile up tasks and
/// sockets until each times out.
const MAX_CONNECTIONS: usize = 32;

/// How long a scrape waits for its render (NVML can hang on a failing GPU).
const RENDER_WAIT: Duration = Duration::from_secs(10);

/// A metrics address flag is neither `host:port` nor `off`.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {value:?}: expected host:port (e.g. 0.0.0.0:9400), or off: {source}")]
pub struct AddressError {
    pub flag: &'static str,
    pub value: String,
    pub source: std::net::AddrParseError,
}

/// A metrics endpoint's address could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("binding the metrics endpoint to {address} ({flag}): {source}")]
pub struct BindError {
    pub flag: &'static str,
    pub address: SocketAddr,
    pub source: std::io::Error,
}

/// Parses a metrics address flag: `off` or empty disables the endpoint.
pub fn parse_address(flag: &'static str, value: &str) -> Result<Option<SocketAddr>, AddressError> {
    let value = value.trim();
    if value.is_empty() || value.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    value.parse().map(Some).map_err(|source| AddressError {
        flag,
        value: value.to_owned(),
        source,
    })
}

/// The authenticated endpoint's TLS and its reviewer.
pub struct Guard {
    pub tls: Arc<ServerConfig>,
    pub access: Arc<Access>,
}

/// Binds `address` and serves in plain HTTP in the background until the
/// runtime ends; returns the bound address (port 0 picks a free port).
pub async fn serve(address: SocketAddr, metrics: Arc<Metrics>) -> Result<SocketAddr, BindError> {
    serve_at_most(address, metrics, None, MAX_CONNECTIONS).await
}

/// [`serve`] over TLS, each request reviewed by `guard.access`.
pub async fn serve_guarded(
    address: SocketAddr,
    metrics: Arc<Metrics>,
    guard: Guard,
) -> Result<SocketAddr, BindError> {
    serve_at_most(address, metrics, Some(Arc::new(guard)), MAX_CONNECTIONS).await
}

async fn serve_at_most(
    address: SocketAddr,
    metrics: Arc<Metrics>,
    guard: Option<Arc<Guard>>,
    connections: usize,
) -> Result<SocketAddr, BindError> {
    let slots = Arc::new(tokio::sync::Semaphore::new(connections));
    let flag = match guard {
        Some(_) => "--metrics-secure-address",
        None => "--metrics-address",
    };
    let bind_error = |source| BindError {
        flag,
        address,
        source,
    };
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    let scheme = if guard.is_some() { "https" } else { "http" };
    info!("serving metrics on {scheme}://{bound}/metrics (readiness: /healthz)");
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn!("metrics endpoint: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                debug!(%peer, "metrics endpoint: {connections} connections open; refused");
                tokio::spawn(refuse(stream));
                continue;
            };
            let (metrics, guard) = (metrics.clone(), guard.clone());
            tokio::spawn(async move {
                let _slot = slot;
                let served = tokio::time::timeout(CONNECTION_TIMEOUT, async {
                    match guard {
                        None => serve_connection(stream, metrics, None).await,
                        Some(guard) => {
                            let acceptor = TlsAcceptor::from(guard.tls.clone());
                            let stream = handshake(&acceptor, stream).await?;
                            serve_connection(stream, metrics, Some(guard.access.clone())).await
                        }
                    }
                })
                .await;
                match served {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!(%peer, "metrics connection: {e}"),
                    Err(_) => debug!(%peer, "metrics connection timed out"),
                }
            });
        }
    });
    Ok(bound)
}

/// Serves one connection's requests, each reviewed when `access` is set.
async fn serve_connection(
    stream: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
    metrics: Arc<Metrics>,
    access: Option<Arc<Access>>,
) -> Result<(), ConnectionError> {
    let service = hyper::service::service_fn(move |request| {
        let (metrics, access) = (metrics.clone(), access.clone());
        async move {
            if let Some(refused) = review(&request, access.as_deref()).await {
                return Ok::<_, Infallible>(refused);
            }
            Ok(answer(request, metrics).await)
        }
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await
        .map_err(ConnectionError::Http)
}

/// The answer to a request the reviewer refuses; `None` when it may pass.
async fn review(
    request: &Request<Incoming>,
    access: Option<&Access>,
) -> Option<Response<Full<Bytes>>> {
    let access = access?;
    let authorization = request
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok());
    match access.check(authorization, request.uri().path()).await {
        Ok(Verdict::Allowed) => None,
        Ok(Verdict::Unauthenticated(why)) => {
            let mut refused = plain(StatusCode::UNAUTHORIZED, &format!("{why}\n"));
            refused.headers_mut().insert(
                hyper::header::WWW_AUTHENTICATE,
                hyper::header::HeaderValue::from_static("Bearer"),
            );
            Some(refused)
        }
        Ok(Verdict::Forbidden(why)) => Some(plain(StatusCode::FORBIDDEN, &format!("{why}\n"))),
        Err(e) => {
            warn!("metrics endpoint: {e}");
            Some(plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{e}\n")))
        }
    }
}

/// Answers a connection over the limit with a 503 (briefly: a peer that
/// does not read is dropped) and closes it.
async fn refuse(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = "too many connections to the metrics endpoint; retry\n";
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the peer sent until it closes: closing with its request
        // unread would reset the connection before it reads the answer.
        let mut sink = [0u8; 4096];
        while tokio::io::AsyncReadExt::read(&mut stream, &mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

async fn answer(request: Request<Incoming>, metrics: Arc<Metrics>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    match request.uri().path() {
        "/metrics" => match metrics.scrape(RENDER_WAIT).await {
            Some(Ok(text)) => Response::builder()
                .header(hyper::header::CONTENT_TYPE, OPENMETRICS)
                .body(Full::new(text))
                .unwrap_or_else(|_| plain(StatusCode::INTERNAL_SERVER_ERROR, "")),
            Some(Err(e)) => plain(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e}\n")),
            None => plain(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("sampling the metrics took longer than {RENDER_WAIT:?}\n"),
            ),
        },
        "/healthz" if metrics.ready() => plain(StatusCode::OK, "ok\n"),
        "/healthz" => plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "the node's devices are not known yet (no slice model built)\n",
        ),
        _ => plain(
            StatusCode::NOT_FOUND,
            "not found: try /metrics or /healthz\n",
        ),
    }
}

pub(crate) fn plain(status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text.to_owned())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn off_and_empty_disable_the_endpoint() {
        let flag = "--metrics-address";
        assert_eq!(parse_address(flag, "off").unwrap(), None);
        assert_eq!(parse_address(flag, "").unwrap(), None);
        assert_eq!(
            parse_address(flag, "127.0.0.1:9400").unwrap(),
            Some("127.0.0.1:9400".parse().unwrap())
        );
        let e = parse_address(flag, "localhost").unwrap_err();
        assert!(
            e.to_string().starts_with("--metrics-address \"localhost\""),
            "{e}"
        );
    }

    async fn get(address: SocketAddr, path: &str) -> String {
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        tokio::task::spawn_blocking(move || {
            let mut stream = std::net::TcpStream::connect(address).unwrap();
            stream.write_all(request.as_bytes()).unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).unwrap();
            answer
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn serves_metrics_and_readiness() {
        let metrics = Arc::new(Metrics::new());
        let address = serve("127.0.0.1:0".parse().unwrap(), metrics.clone())
            .await
            .unwrap();
        assert!(get(address, "/healthz").await.starts_with("HTTP/1.1 503"));
        metrics.model_built(&tessera_controller::model::Model {
            slices: Vec::new(),
            devices: Default::default(),
            gpu_indices: Default::default(),
            full: true,
            mig_managed: Default::default(),
            notes: Vec::new(),
        });
        assert!(get(address, "/healthz").await.starts_with("HTTP/1.1 200"));
        crate::prepare::PrepareObserver::prepared(&*metrics, Duration::from_millis(5), true);
        let scrape = get(address, "/metrics").await;
        assert!(scrape.starts_with("HTTP/1.1 200"), "{scrape}");
        assert!(scrape.contains("tessera_prepare_duration_seconds_count 1"));
        assert!(scrape.contains("tessera_published_devices{kind=\"gpu\"} 0"));
        assert!(get(address, "/nope").await.starts_with("HTTP/1.1 404"));
    }

    /// A sampler that blocks until its gate opens, counting samples.
    #[derive(Default)]
    struct Gate {
        open: std::sync::Mutex<bool>,
        opened: std::sync::Condvar,
        in_flight: std::sync::atomic::AtomicUsize,
        most_in_flight: std::sync::atomic::AtomicUsize,
        samples: std::sync::atomic::AtomicUsize,
        /// Samples begun, for the test to wait on.
        entered: tokio::sync::watch::Sender<usize>,
    }

    impl Gate {
        fn open(&self) {
            *self.open.lock().unwrap() = true;
            self.opened.notify_all();
        }
    }

    struct Blocking(Arc<Gate>);

    impl super::super::Sample for Blocking {
        fn sample(&self, _: &Metrics) {
            use std::sync::atomic::Ordering::SeqCst;
            let g = &self.0;
            let now = g.in_flight.fetch_add(1, SeqCst) + 1;
            g.most_in_flight.fetch_max(now, SeqCst);
            g.samples.fetch_add(1, SeqCst);
            g.entered.send_modify(|n| *n += 1);
            let open = g.open.lock().unwrap();
            drop(g.opened.wait_while(open, |open| !*open).unwrap());
            g.in_flight.fetch_sub(1, SeqCst);
        }
    }

    /// `GET path` without the blocking pool; the status line.
    async fn get_async(address: SocketAddr, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer.lines().next().unwrap_or_default().to_owned()
    }

    /// Scrapes during a prepare burst: however many scrapes wait on a slow
    /// sample (NVML on a busy GPU), one sample runs at a time and the
    /// blocking pool stays free for prepare's work.
    #[test]
    fn a_scrape_flood_samples_once_at_a_time_and_leaves_the_blocking_pool_to_prepare() {
        const BLOCKING_THREADS: usize = 4;
        const SCRAPES: usize = 3 * BLOCKING_THREADS;
        const DEADLINE: Duration = Duration::from_secs(10);
        use std::sync::atomic::Ordering::SeqCst;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(BLOCKING_THREADS)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let gate = Arc::new(Gate::default());
            let metrics = Arc::new(Metrics::new());
            metrics.set_sampler(Blocking(gate.clone()));
            let address = serve("127.0.0.1:0".parse().unwrap(), metrics.clone())
                .await
                .unwrap();
            let scrapes: Vec<_> = (0..SCRAPES)
                .map(|_| tokio::spawn(get_async(address, "/metrics")))
                .collect();
            let mut entered = gate.entered.subscribe();
            tokio::time::timeout(DEADLINE, entered.wait_for(|n| *n >= 1))
                .await
                .expect("a scrape started a sample")
                .unwrap();
            tokio::time::timeout(DEADLINE, async {
                while metrics.scrapes_waiting() < SCRAPES {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("every scrape waits for the blocked sample");

            // Prepare's blocking work (files, NVML, MIG, MPS) while every
            // scrape waits.
            let prepare = tokio::time::timeout(
                DEADLINE,
                tokio::task::spawn_blocking(|| std::thread::current().id()),
            )
            .await;
            gate.open();
            for scrape in scrapes {
                let status = scrape.await.unwrap();
                assert!(status.starts_with("HTTP/1.1 200"), "{status}");
            }
            assert!(
                prepare.is_ok(),
                "prepare's blocking work waited behind {SCRAPES} scrapes"
            );
            assert_eq!(gate.most_in_flight.load(SeqCst), 1, "samples at once");
            // The first scrape's, and one shared by those that came during it.
            let samples = gate.samples.load(SeqCst);
            assert!(samples <= 2, "{SCRAPES} scrapes took {samples} samples");
        });
    }

    /// Idle connections hold at most the limit; one more is refused at
    /// once, and a slot freed serves again.
    #[tokio::test]
    async fn connections_over_the_limit_are_refused() {
        let metrics = Arc::new(Metrics::new());
        let address = serve_at_most("127.0.0.1:0".parse().unwrap(), metrics, None, 2)
            .await
            .unwrap();
        let idle_one = tokio::net::TcpStream::connect(address).await.unwrap();
        let _idle_two = tokio::net::TcpStream::connect(address).await.unwrap();
        // Accepted in order: both idle ones hold their slots by now.
        let refused = get_async(address, "/healthz").await;
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        drop(idle_one);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let status = get_async(address, "/nope").await;
            if status.starts_with("HTTP/1.1 404") {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "never served: {status}"
            );
            tokio::task::yield_now().await;
        }
    }

    /// A gauge the test sets, sampled into `tessera_prepared_claims`.
    struct Counting(Arc<std::sync::atomic::AtomicI64>);

    impl super::super::Sample for Counting {
        fn sample(&self, m: &Metrics) {
            m.prepared_claims
                .set(self.0.load(std::sync::atomic::Ordering::SeqCst));
        }
    }

    #[tokio::test]
    async fn a_scrape_never_answers_with_a_sample_older_than_itself() {
        let value = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let metrics = Arc::new(Metrics::new());
        metrics.set_sampler(Counting(value.clone()));
        for n in 1..=3 {
            value.store(n, std::sync::atomic::Ordering::SeqCst);
            let text = metrics.scrape(RENDER_WAIT).await.unwrap().unwrap();
            let text = String::from_utf8_lossy(&text).into_owned();
            let line = format!("tessera_prepared_claims {n}");
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }
}
