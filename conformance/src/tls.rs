//! Serving certificates for the webhooks tests run, made with the openssl
//! CLI: a CA of the test's own and a certificate it signed for one name.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

/// A CA and a serving certificate signed by it, as PEM files.
pub struct Certificates {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("running openssl (the CLI must be installed)")?;
    ensure!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Writes `ca.crt`, `tls.crt` and `tls.key` into `dir`: a certificate valid
/// for two days for `alt_name` (`IP:127.0.0.1`, `DNS:<service>.<ns>.svc`).
pub fn serving_certificate(dir: &Path, alt_name: &str) -> Result<Certificates> {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    openssl(
        dir,
        &[
            &[
                "req",
                "-x509",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=tessera-webhook-test-ca",
            ][..],
            &ec,
            &["-keyout", "ca.key", "-out", "ca.crt"],
            &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ]
        .concat(),
    )?;
    let (_, name) = alt_name
        .split_once(':')
        .with_context(|| format!("{alt_name:?} is not a subjectAltName such as DNS:name"))?;
    let subject = format!("/CN={name}");
    openssl(
        dir,
        &[
            &["req", "-new", "-nodes", "-subj", &subject][..],
            &ec,
            &["-keyout", "tls.key", "-out", "tls.csr"],
        ]
        .concat(),
    )?;
    std::fs::write(
        dir.join("ext.cnf"),
        format!(
            "subjectAltName={alt_name}\nextendedKeyUsage=serverAuth\n\
             keyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\n"
        ),
    )?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "tls.csr",
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
            "tls.crt",
        ],
    )?;
    Ok(Certificates {
        ca: dir.join("ca.crt"),
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
    })
}
