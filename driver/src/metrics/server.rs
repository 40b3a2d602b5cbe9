//! A minimal HTTP/1 server for the metrics (hyper, already in the build
//! through tonic and kube):
//!
//! * `GET /metrics`: every metric, OpenMetrics text;
//! * `GET /healthz`: 200 once the node's first slice model is built
//!   (prepare can resolve device names), 503 before;
//! * anything else: 404.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tracing::{debug, info, warn};

use super::Metrics;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long one connection may take (slow or idle scrapers are dropped).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Parses `--metrics-address`: `off` or empty disables the endpoint.
pub fn parse_address(flag: &str) -> anyhow::Result<Option<SocketAddr>> {
    let flag = flag.trim();
    if flag.is_empty() || flag.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    flag.parse().map(Some).with_context(|| {
        format!("--metrics-address {flag:?}: expected host:port (e.g. 0.0.0.0:9400), or off")
    })
}

/// Binds `address` and serves in the background until the runtime ends;
/// returns the bound address (port 0 picks a free port).
pub async fn serve(address: SocketAddr, metrics: Arc<Metrics>) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| {
            format!("binding the metrics endpoint to {address} (--metrics-address)")
        })?;
    let bound = listener.local_addr()?;
    info!("serving metrics on http://{bound}/metrics (readiness: /healthz)");
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
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let metrics = metrics.clone();
                    async move { Ok::<_, Infallible>(answer(request, metrics).await) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!(%peer, "metrics connection: {e}"),
                    Err(_) => debug!(%peer, "metrics connection timed out"),
                }
            });
        }
    });
    Ok(bound)
}

async fn answer(request: Request<Incoming>, metrics: Arc<Metrics>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    match request.uri().path() {
        "/metrics" => {
            // Sampling reads NVML and the checkpoint: not on the runtime.
            match tokio::task::spawn_blocking(move || metrics.render()).await {
                Ok(text) => Response::builder()
                    .header(hyper::header::CONTENT_TYPE, OPENMETRICS)
                    .body(Full::new(Bytes::from(text)))
                    .unwrap_or_else(|_| plain(StatusCode::INTERNAL_SERVER_ERROR, "")),
                Err(e) => plain(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("sampling failed: {e}\n"),
                ),
            }
        }
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
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn off_and_empty_disable_the_endpoint() {
        assert_eq!(parse_address("off").unwrap(), None);
        assert_eq!(parse_address("").unwrap(), None);
        assert_eq!(
            parse_address("127.0.0.1:9400").unwrap(),
            Some("127.0.0.1:9400".parse().unwrap())
        );
        assert!(parse_address("localhost").is_err());
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
}
