//! The webhook's HTTPS server (rustls with ring, as kube's client already
//! uses; hyper 1, HTTP/1.1):
//!
//! * `POST /validate`: an AdmissionReview in, the verdict out;
//! * `GET /healthz`, `GET /readyz`: 200 while serving (the certificate was
//!   loaded before the port was opened);
//! * anything else: 404.
//!
//! The certificate and key are read at start and again by the first TLS
//! handshake after either file changed (a renewed Secret, cert-manager's
//! rotation): a new connection gets the new certificate without a restart.
//! A pair that does not load (half-written, key and certificate not
//! matching) is logged and the last good one kept.
//!
//! At most `max_connections` connections are served at once; the next one
//! waits in the listen backlog until one ends (each is bounded by a
//! timeout), so a flood of idle connections cannot grow the tasks and
//! buffers held without bound.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tracing::{debug, info, warn};

/// Largest AdmissionReview read (the API server's objects are at most a
/// few MiB, old and new object together).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// How long one connection may take, TLS handshake included.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// A TLS config offering HTTP/1.1 with the certificate chain and key of
/// these PEM files, re-read when they change; fails if they do not load now.
pub fn load_tls(cert_file: &Path, key_file: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = Arc::new(ring::default_provider());
    let certificate = ReloadingCertificate::load(cert_file, key_file, provider.clone())?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(certificate));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The serving certificate, re-read by the first handshake after its files
/// changed.
#[derive(Debug)]
struct ReloadingCertificate {
    cert_file: PathBuf,
    key_file: PathBuf,
    provider: Arc<CryptoProvider>,
    current: Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    /// The files as they were when `key` was read from them.
    seen: [Option<FileStamp>; 2],
}

/// What tells a file was replaced or rewritten.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl FileStamp {
    /// Follows symlinks: a Secret volume swaps its `..data` link.
    fn of(path: &Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode: meta.ino(),
        })
    }
}

impl ReloadingCertificate {
    fn load(
        cert_file: &Path,
        key_file: &Path,
        provider: Arc<CryptoProvider>,
    ) -> anyhow::Result<Self> {
        let seen = [FileStamp::of(cert_file), FileStamp::of(key_file)];
        let key = read_pair(cert_file, key_file, &provider)?;
        Ok(ReloadingCertificate {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            provider,
            current: Mutex::new(Loaded { key, seen }),
        })
    }

    /// The pair to serve: re-read if either file changed since it was read.
    fn certificate(&self) -> Arc<CertifiedKey> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let now = [
            FileStamp::of(&self.cert_file),
            FileStamp::of(&self.key_file),
        ];
        if now != current.seen {
            match read_pair(&self.cert_file, &self.key_file, &self.provider) {
                Ok(key) => {
                    info!(cert = %self.cert_file.display(), "serving certificate reloaded");
                    current.key = key;
                }
                // Retried by the next handshake only if the files change again.
                Err(e) => warn!("keeping the serving certificate loaded before: {e:#}"),
            }
            current.seen = now;
        }
        current.key.clone()
    }
}

impl ResolvesServerCert for ReloadingCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.certificate())
    }
}

/// Reads the serving certificate chain and key (PEM) and checks they match.
fn read_pair(
    cert_file: &Path,
    key_file: &Path,
    provider: &CryptoProvider,
) -> anyhow::Result<Arc<CertifiedKey>> {
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
    let pair = CertifiedKey::from_der(certs, key, provider)
        .context("the certificate and the private key do not form a usable pair")?;
    Ok(Arc::new(pair))
}

/// Binds the listening socket.
pub async fn bind(address: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .with_context(|| format!("binding {address} (--listen)"))
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
) -> anyhow::Result<()> {
    let bound = listener.local_addr()?;
    info!(
        driver = %driver,
        max_connections,
        "serving admission reviews on https://{bound}/validate (health: /healthz, /readyz)"
    );
    let acceptor = TlsAcceptor::from(tls);
    let driver: Arc<str> = driver.into();
    let slots = Arc::new(Semaphore::new(max_connections));
    tokio::pin!(shutdown);
    loop {
        // A free slot first: beyond the cap, connections wait unaccepted.
        let slot = tokio::select! {
            () = &mut shutdown => {
                info!("stopping");
                return Ok(());
            }
            slot = slots.clone().acquire_owned() => slot?,
        };
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
            let _slot = slot;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use tokio::net::TcpStream;
    use tokio_rustls::TlsConnector;
    use tokio_rustls::client::TlsStream;
    use tokio_rustls::rustls::pki_types::ServerName;
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};

    const WAIT: Duration = Duration::from_secs(10);

    fn openssl(dir: &Path, args: &[&str]) {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("the openssl CLI");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A CA (`ca.crt`) and, per name in `leaves`, a certificate for
    /// 127.0.0.1 signed by it (`<name>.crt`, `<name>.key`).
    fn certificates(dir: &Path, leaves: &[&str]) {
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        let ca = [
            &[
                "req",
                "-x509",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=test-ca",
            ][..],
            &ec,
            &["-keyout", "ca.key", "-out", "ca.crt"],
            &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ];
        openssl(dir, &ca.concat());
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
        )
        .unwrap();
        for name in leaves {
            let (key, csr, crt) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.crt"),
            );
            let request = [
                &["req", "-new", "-nodes", "-subj", "/CN=127.0.0.1"][..],
                &ec,
                &["-keyout", &key, "-out", &csr],
            ];
            openssl(dir, &request.concat());
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-extfile",
                    "ext.cnf",
                    "-out",
                    &crt,
                ],
            );
        }
    }

    fn der(path: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(path).unwrap()
    }

    /// Puts `name`'s pair where the server reads it, each file replaced by
    /// a rename as a Secret volume or cert-manager does.
    fn install(dir: &Path, name: &str) {
        for ext in ["crt", "key"] {
            let staged = dir.join(format!("staged.{ext}"));
            std::fs::copy(dir.join(format!("{name}.{ext}")), &staged).unwrap();
            std::fs::rename(&staged, dir.join(format!("serving.{ext}"))).unwrap();
        }
    }

    async fn start(dir: &Path, max_connections: usize) -> SocketAddr {
        let tls = load_tls(&dir.join("serving.crt"), &dir.join("serving.key")).unwrap();
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(serve(
            listener,
            tls,
            "gpu.test.dev".into(),
            max_connections,
            std::future::pending(),
        ));
        address
    }

    fn connector(dir: &Path) -> TlsConnector {
        let mut roots = RootCertStore::empty();
        roots.add(der(&dir.join("ca.crt"))).unwrap();
        let config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        TlsConnector::from(Arc::new(config))
    }

    async fn handshake(
        connector: &TlsConnector,
        address: SocketAddr,
    ) -> io::Result<TlsStream<TcpStream>> {
        let tcp = TcpStream::connect(address).await?;
        let name = ServerName::IpAddress(address.ip().into());
        connector.connect(name, tcp).await
    }

    /// The leaf certificate the server presents to a new connection.
    async fn served(connector: &TlsConnector, address: SocketAddr) -> CertificateDer<'static> {
        let tls = tokio::time::timeout(WAIT, handshake(connector, address))
            .await
            .expect("handshake in time")
            .expect("handshake");
        tls.get_ref().1.peer_certificates().unwrap()[0]
            .clone()
            .into_owned()
    }

    #[tokio::test]
    async fn a_renewed_certificate_is_served_to_the_next_connection() {
        let dir = tempfile::tempdir().unwrap();
        certificates(dir.path(), &["first", "second"]);
        install(dir.path(), "first");
        let address = start(dir.path(), 4).await;
        let client = connector(dir.path());
        assert_eq!(
            served(&client, address).await,
            der(&dir.path().join("first.crt"))
        );

        install(dir.path(), "second");
        assert_eq!(
            served(&client, address).await,
            der(&dir.path().join("second.crt"))
        );

        // A broken pair (the key of another certificate) keeps the last good one.
        std::fs::copy(dir.path().join("first.key"), dir.path().join("serving.key")).unwrap();
        assert_eq!(
            served(&client, address).await,
            der(&dir.path().join("second.crt"))
        );
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_wait_until_one_ends() {
        let dir = tempfile::tempdir().unwrap();
        certificates(dir.path(), &["first"]);
        install(dir.path(), "first");
        let address = start(dir.path(), 2).await;
        let client = connector(dir.path());
        // Two connections hold both slots (a TLS session each, kept open).
        let one = served_stream(&client, address).await;
        let _two = served_stream(&client, address).await;

        // A third is not taken on: its handshake gets no answer.
        let mut third = tokio::spawn({
            let client = client.clone();
            async move { handshake(&client, address).await }
        });
        let early = tokio::time::timeout(Duration::from_millis(500), &mut third).await;
        assert!(
            early.is_err(),
            "a third connection was served beyond the cap of 2"
        );

        // One ends: the third is served.
        drop(one);
        let third = tokio::time::timeout(WAIT, third)
            .await
            .expect("the third connection is served once a slot is free");
        assert!(third.unwrap().is_ok());
    }

    async fn served_stream(connector: &TlsConnector, address: SocketAddr) -> TlsStream<TcpStream> {
        tokio::time::timeout(WAIT, handshake(connector, address))
            .await
            .expect("handshake in time")
            .expect("handshake")
    }
}
