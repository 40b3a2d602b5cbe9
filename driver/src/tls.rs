//! Serving certificates for the HTTPS endpoints (the admission webhook,
//! the authenticated metrics endpoint): rustls with ring, as kube's client
//! already uses.
//!
//! A pair read from PEM files is re-read by the first TLS handshake after
//! either file changed (a renewed Secret, cert-manager's rotation): a new
//! connection gets the new certificate without a restart. A pair that does
//! not load (half-written, key and certificate not matching) is logged and
//! the last good one kept. Without files, a self-signed pair is made at
//! start (clients then skip verification, or pin it).

use crate::sync::Locked;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::pki_types::pem::{self, PemObject as _};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tracing::{info, warn};

/// How long a TLS handshake may take: a client's takes milliseconds.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How one HTTPS connection ended early (logged, at debug level).
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("TLS handshake timed out")]
    HandshakeTimedOut,
    #[error("TLS handshake: {0}")]
    Handshake(std::io::Error),
    #[error("{0}")]
    Http(hyper::Error),
}

/// The server's side of the TLS handshake, within [`HANDSHAKE_TIMEOUT`].
pub async fn handshake(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
) -> Result<TlsStream<TcpStream>, ConnectionError> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
        .await
        .map_err(|_| ConnectionError::HandshakeTimedOut)?
        .map_err(ConnectionError::Handshake)
}

/// Why the serving certificate and key do not make a TLS config.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS protocol versions")]
    Versions { source: tokio_rustls::rustls::Error },
    #[error("reading the serving certificate {}", .file.display())]
    ReadCertificate { file: PathBuf, source: pem::Error },
    #[error("{}: no PEM certificate in it", .file.display())]
    NoCertificate { file: PathBuf },
    #[error("reading the private key {}", .file.display())]
    ReadKey { file: PathBuf, source: pem::Error },
    #[error("the certificate and the private key do not form a usable pair")]
    Pair { source: tokio_rustls::rustls::Error },
    #[error("making a self-signed certificate")]
    SelfSigned { source: rcgen::Error },
}

/// A TLS config offering HTTP/1.1 with the certificate chain and key of
/// these PEM files, re-read when they change; fails if they do not load now.
pub fn load_tls(cert_file: &Path, key_file: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(ring::default_provider());
    let certificate = ReloadingCertificate::load(cert_file, key_file, provider.clone())?;
    http1_config(provider, Arc::new(certificate))
}

/// A TLS config offering HTTP/1.1 with a self-signed certificate for
/// `names` (DNS names or IP addresses), made now and kept in memory only.
pub fn self_signed_tls(names: Vec<String>) -> Result<Arc<ServerConfig>, TlsError> {
    let made = rcgen::generate_simple_self_signed(names)
        .map_err(|source| TlsError::SelfSigned { source })?;
    let key = PrivatePkcs8KeyDer::from(made.signing_key.serialize_der());
    let provider = Arc::new(ring::default_provider());
    let pair = CertifiedKey::from_der(vec![made.cert.der().clone()], key.into(), &provider)
        .map_err(|source| TlsError::Pair { source })?;
    http1_config(provider, Arc::new(Fixed(Arc::new(pair))))
}

fn http1_config(
    provider: Arc<CryptoProvider>,
    certificate: Arc<dyn ResolvesServerCert>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Versions { source })?
        .with_no_client_auth()
        .with_cert_resolver(certificate);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A pair that never changes.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
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
    ) -> Result<Self, TlsError> {
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
                Err(e) => warn!(
                    "keeping the serving certificate loaded before: {}",
                    with_causes(&e)
                ),
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
) -> Result<Arc<CertifiedKey>, TlsError> {
    let certs = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::ReadCertificate {
            file: cert_file.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            file: cert_file.to_owned(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|source| TlsError::ReadKey {
        file: key_file.to_owned(),
        source,
    })?;
    let pair =
        CertifiedKey::from_der(certs, key, provider).map_err(|source| TlsError::Pair { source })?;
    Ok(Arc::new(pair))
}

/// `error: its cause: ...`: a failure whole, for a log line.
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(&format!(": {e}"));
        cause = e.source();
    }
    text
}
