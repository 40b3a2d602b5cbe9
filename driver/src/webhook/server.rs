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
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicU8, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use http_body_util::{BodyExt as _, Full, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tracing::{debug, info, warn};

/// Largest AdmissionReview read. The API server takes request bodies of at
/// most 3 MiB, so an UPDATE's review holds at most two such objects (new
/// and old) beside a small envelope: 7 MiB is more than any review it
/// sends, and bounds what one connection can make the webhook buffer.
pub const MAX_BODY_BYTES: usize = 7 << 20;

/// How long a TLS handshake may take: the API server's takes milliseconds.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one request may take from its first header byte to the
/// answer (the API server's own webhook timeout is at most 30 s, 10 s by
/// default).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one connection may last at all.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);

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
        let mut current = self.current.locked();
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
    let slots = Slots::new(max_connections);
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
        // A slot for it (an idle connection's, if need be): while every
        // slot is in a request, it waits and the next stay unaccepted.
        let slot = tokio::select! {
            () = &mut shutdown => {
                info!("stopping");
                return Ok(());
            }
            slot = slots.take() => slot,
        };
        let acceptor = acceptor.clone();
        let driver = driver.clone();
        tokio::spawn(async move {
            let state = slot.state.clone();
            let connection = async {
                let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                    .await
                    .map_err(|_| "TLS handshake timed out".to_owned())?
                    .map_err(|e| format!("TLS handshake: {e}"))?;
                let service = hyper::service::service_fn(move |request| {
                    let driver = driver.clone();
                    let state = state.clone();
                    async move {
                        let Some(_busy) = state.busy() else {
                            return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, "evicted\n"));
                        };
                        let answer =
                            tokio::time::timeout(REQUEST_TIMEOUT, answer(request, &driver))
                                .await
                                .unwrap_or_else(|_| {
                                    plain(StatusCode::REQUEST_TIMEOUT, "request timed out\n")
                                });
                        Ok::<_, Infallible>(answer)
                    }
                });
                hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(REQUEST_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                    .map_err(|e| e.to_string())
            };
            tokio::select! {
                done = tokio::time::timeout(CONNECTION_TIMEOUT, connection) => match done {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!(%peer, "connection: {e}"),
                    Err(_) => debug!(%peer, "connection timed out"),
                },
                () = slot.state.evicted.notified() => {
                    debug!(%peer, "idle connection closed for a new one");
                }
            }
            drop(slot);
        });
    }
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

    /// A review the webhook allows (a claim with no config of its driver).
    fn allowed_review() -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
                "operation": "CREATE",
                "object": {"metadata": {"name": "c", "namespace": "ns"}, "spec": {"devices": {}}},
            }
        }))
        .unwrap()
    }

    /// Sends `head` (request line and headers, without the blank line)
    /// and `body`, and reads the answer to the end: its status and text.
    async fn exchange(tls: &mut TlsStream<TcpStream>, head: &str, body: &[u8]) -> (u16, String) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let head = format!("{head}\r\nHost: webhook\r\nConnection: close\r\n\r\n");
        tls.write_all(head.as_bytes()).await.unwrap();
        // The server may answer (and close) before taking all of a body.
        let _ = tls.write_all(body).await;
        let mut answer = Vec::new();
        let _ = tls.read_to_end(&mut answer).await;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP answer: {answer:?}"));
        (status, answer)
    }

    async fn post_review(client: &TlsConnector, address: SocketAddr) -> (u16, String) {
        let mut tls = served_stream(client, address).await;
        let body = allowed_review();
        let head = format!("POST /validate HTTP/1.1\r\nContent-Length: {}", body.len());
        exchange(&mut tls, &head, &body).await
    }

    #[tokio::test]
    async fn idle_and_slow_handshake_connections_do_not_delay_a_review() {
        let dir = tempfile::tempdir().unwrap();
        certificates(dir.path(), &["first"]);
        install(dir.path(), "first");
        let address = start(dir.path(), 2).await;
        let client = connector(dir.path());
        // Every slot taken: one connection that never starts its handshake
        // and one that finished it and sends nothing.
        let _silent = TcpStream::connect(address).await.unwrap();
        let _idle = served_stream(&client, address).await;
        let mut more_silent = Vec::new();
        for _ in 0..4 {
            more_silent.push(TcpStream::connect(address).await.unwrap());
        }

        let started = std::time::Instant::now();
        let (status, answer) = tokio::time::timeout(WAIT, post_review(&client, address))
            .await
            .expect("the review is answered");
        assert_eq!(status, 200, "{answer}");
        assert!(answer.contains(r#""allowed":true"#), "{answer}");
        assert!(
            started.elapsed() < HANDSHAKE_TIMEOUT / 2,
            "the review waited {:?} behind idle connections",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn a_connection_in_a_request_keeps_its_slot() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let dir = tempfile::tempdir().unwrap();
        certificates(dir.path(), &["first"]);
        install(dir.path(), "first");
        let address = start(dir.path(), 1).await;
        let client = connector(dir.path());
        // In a request: its headers sent, its body not yet. The server
        // asks for the body (100 Continue) once the request is being served.
        let mut busy = served_stream(&client, address).await;
        let head = "POST /validate HTTP/1.1\r\nHost: w\r\nContent-Length: 100\r\n\
                    Expect: 100-continue\r\n\r\n";
        busy.write_all(head.as_bytes()).await.unwrap();
        busy.flush().await.unwrap();
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains("100 Continue") {
            let mut byte = [0u8; 1];
            let n = tokio::time::timeout(WAIT, busy.read(&mut byte))
                .await
                .expect("100 Continue in time")
                .unwrap();
            assert_eq!(n, 1, "closed before asking for the body: {seen:?}");
            seen.push(byte[0]);
        }

        let mut next = tokio::spawn({
            let client = client.clone();
            async move { handshake(&client, address).await }
        });
        let early = tokio::time::timeout(Duration::from_millis(500), &mut next).await;
        assert!(early.is_err(), "a request in flight lost its slot");

        drop(busy);
        let next = tokio::time::timeout(WAIT, next)
            .await
            .expect("the next connection is served once the request ends");
        assert!(next.unwrap().is_ok());
    }

    #[tokio::test]
    async fn an_oversized_body_is_refused_without_being_buffered() {
        let dir = tempfile::tempdir().unwrap();
        certificates(dir.path(), &["first"]);
        install(dir.path(), "first");
        let address = start(dir.path(), 4).await;
        let client = connector(dir.path());
        let sixteen_mib = 16 << 20;

        // Declared: refused before a byte of the body is sent.
        let mut tls = served_stream(&client, address).await;
        let head = format!("POST /validate HTTP/1.1\r\nContent-Length: {sixteen_mib}");
        let (status, answer) = tokio::time::timeout(WAIT, exchange(&mut tls, &head, b""))
            .await
            .expect("answered without the body");
        assert_eq!(status, 413, "{answer}");

        // Chunked: read only up to the cap, then refused.
        let mut body = Vec::new();
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..sixteen_mib >> 20 {
            body.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            body.extend_from_slice(&chunk);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(b"0\r\n\r\n");
        let mut tls = served_stream(&client, address).await;
        let head = "POST /validate HTTP/1.1\r\nTransfer-Encoding: chunked";
        let (status, answer) = tokio::time::timeout(WAIT, exchange(&mut tls, head, &body))
            .await
            .expect("answered");
        assert_eq!(status, 413, "{answer}");
        assert!(
            answer.contains(&format!("at most {MAX_BODY_BYTES} bytes")),
            "{answer}"
        );

        // And the server still answers reviews.
        let (status, _) = tokio::time::timeout(WAIT, post_review(&client, address))
            .await
            .expect("answered");
        assert_eq!(status, 200);
    }

    async fn served_stream(connector: &TlsConnector, address: SocketAddr) -> TlsStream<TcpStream> {
        tokio::time::timeout(WAIT, handshake(connector, address))
            .await
            .expect("handshake in time")
            .expect("handshake")
    }
}
