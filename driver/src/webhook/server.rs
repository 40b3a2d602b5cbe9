//! The webhook's HTTPS server (rustls with ring, as kube's client already
//! uses; hyper 1, HTTP/1.1):
//!
//! * `POST /validate`: an AdmissionReview in, the verdict out;
//! * `GET /healthz`, `GET /readyz`: 200 while serving (the certificate was
//!   loaded before the port was opened);
//! * anything else: 404.
//!
//! The certificate and key are read once, at start.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tracing::{debug, info, warn};

/// Largest AdmissionReview read (the API server's objects are at most a
/// few MiB, old and new object together).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// How long one connection may take, TLS handshake included.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads the serving certificate chain and key (PEM) into a TLS config
/// offering HTTP/1.1.
pub fn load_tls(cert_file: &Path, key_file: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let certs = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "reading the serving certificate {} (--tls-cert-file)",
                cert_file.display()
            )
        })?;
    if certs.is_empty() {
        anyhow::bail!(
            "--tls-cert-file {}: no PEM certificate in it",
            cert_file.display()
        );
    }
    let key = PrivateKeyDer::from_pem_file(key_file).with_context(|| {
        format!(
            "reading the private key {} (--tls-private-key-file)",
            key_file.display()
        )
    })?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the certificate and the private key do not form a usable pair")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Binds the listening socket.
pub async fn bind(address: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .with_context(|| format!("binding {address} (--listen)"))
}

/// Serves until `shutdown` resolves; connections in flight are left to
/// finish on their own tasks (each bounded by a timeout).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    driver: String,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let bound = listener.local_addr()?;
    info!(
        driver = %driver,
        "serving admission reviews on https://{bound}/validate (health: /healthz, /readyz)"
    );
    let acceptor = TlsAcceptor::from(tls);
    let driver: Arc<str> = driver.into();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => {
                info!("stopping");
                return Ok(());
            }
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let driver = driver.clone();
        tokio::spawn(async move {
            let connection = async {
                let stream = acceptor
                    .accept(stream)
                    .await
                    .map_err(|e| format!("TLS handshake: {e}"))?;
                let service = hyper::service::service_fn(move |request| {
                    let driver = driver.clone();
                    async move { Ok::<_, Infallible>(answer(request, &driver).await) }
                });
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                    .map_err(|e| e.to_string())
            };
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, "connection: {e}"),
                Err(_) => debug!(%peer, "connection timed out"),
            }
        });
    }
}

async fn answer(request: Request<Incoming>, driver: &str) -> Response<Full<Bytes>> {
    match (request.method(), request.uri().path()) {
        (&Method::POST, "/validate") => {
            let body = match Limited::new(request.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
            {
                Ok(body) => body.to_bytes(),
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
