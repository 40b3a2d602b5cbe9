//! `tessera webhook`: serves the validating admission webhook.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use tessera_driver::webhook::server;

use crate::flags::{DriverFlags, init_logging};
use crate::signals::termination;

#[derive(Debug, Clone, clap::Args)]
pub struct WebhookArgs {
    // Configs whose `opaque.driver` is this driver are checked.
    #[command(flatten)]
    pub driver: DriverFlags,

    /// Address and port to serve HTTPS on (port 0 picks a free one; the
    /// bound address is logged).
    #[arg(long, env = "TESSERA_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,

    /// PEM file with the serving certificate (and any intermediates). Read
    /// at start and again when it (or the key) changes: a renewed
    /// certificate is served from the next connection on.
    #[arg(long, env = "TESSERA_WEBHOOK_TLS_CERT_FILE")]
    pub tls_cert_file: PathBuf,

    /// PEM file with the serving certificate's private key (PKCS#8, PKCS#1
    /// or SEC1). Re-read with the certificate.
    #[arg(long, env = "TESSERA_WEBHOOK_TLS_PRIVATE_KEY_FILE")]
    pub tls_private_key_file: PathBuf,

    /// Connections served at once; more wait until one ends.
    #[arg(long, env = "TESSERA_WEBHOOK_MAX_CONNECTIONS", default_value_t = 64,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub max_connections: u16,
}

/// `tessera webhook`.
pub fn main(args: &WebhookArgs) -> anyhow::Result<()> {
    init_logging();
    args.driver.driver()?;
    let tls = tessera_driver::tls::load_tls(&args.tls_cert_file, &args.tls_private_key_file)
        .context("--tls-cert-file and --tls-private-key-file")?;
    let runtime = crate::flags::runtime()?;
    runtime.block_on(async {
        let listener = server::bind(args.listen).await?;
        server::serve(
            listener,
            tls,
            args.driver.driver_name.clone(),
            usize::from(args.max_connections),
            termination(),
        )
        .await?;
        Ok(())
    })
}
