use super::*;
use crate::tls::{TlsError, load_tls, with_causes};
use std::io;
use std::path::Path;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
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

#[test]
fn a_pair_that_does_not_load_says_which_file_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("missing.crt"), dir.path().join("k.key"));
    let e = load_tls(&cert, &key).unwrap_err();
    assert!(matches!(e, TlsError::ReadCertificate { .. }), "{e:?}");
    let text = format!("reading the serving certificate {}", cert.display());
    assert_eq!(e.to_string(), text);
    // The log line (and `tessera webhook`'s error) carries the cause too.
    let whole = with_causes(&e);
    assert!(whole.starts_with(&format!("{text}: ")), "{whole}");

    std::fs::write(&cert, "no PEM here\n").unwrap();
    let e = load_tls(&cert, &key).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{}: no PEM certificate in it", cert.display())
    );
}
