//! The node's one connection to the API server: a kube client over a
//! single multiplexed HTTP/2 connection.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::Client;

/// Why no client could be built; each says where the configuration came
/// from, so the fix is the flag or file named.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("reading kubeconfig {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("loading kubeconfig {}: {source}", path.display())]
    Load {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("no kubeconfig given and none found (KUBECONFIG, ~/.kube/config, in-cluster): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("building the Kubernetes client: tls-server-name {name:?}: {source}")]
    ServerName {
        name: String,
        source: tokio_rustls::rustls::pki_types::InvalidDnsNameError,
    },
    #[error("building the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
}

/// Builds a client from `kubeconfig` or the usual places (see
/// [`http2_client`]). Callers bound each request's wait themselves.
pub async fn client(
    kubeconfig: Option<&Path>,
    connect_timeout: Duration,
) -> Result<Client, ClientError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc =
                kube::config::Kubeconfig::read_from(path).map_err(|source| ClientError::Read {
                    path: path.to_owned(),
                    source,
                })?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|source| ClientError::Load {
                    path: path.to_owned(),
                    source,
                })?
        }
        None => kube::Config::infer().await?,
    };
    config.connect_timeout = Some(connect_timeout);
    http2_client(config)
}

/// How often an idle HTTP/2 connection is pinged, and how long the answer
/// may take before the connection (and every request on it) fails.
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);

/// A client that multiplexes every request and watch over one HTTP/2
/// connection, as Go clients do. Over HTTP/1.1 (kube's own client) each
/// request in flight needs a connection of its own, and idle ones are
/// closed by the API server after 90 s: a burst of prepares after a quiet
/// spell paid a TLS handshake each. Here the watches keep the connection
/// in use, and pings find a dead one (instead of per-read timeouts, which
/// would cut long watches).
fn http2_client(config: kube::Config) -> Result<Client, ClientError> {
    use kube::client::ConfigExt;

    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    // HTTP/2 writes a request as several small frames: without NODELAY the
    // kernel holds the last one until the server's delayed ACK (40 ms).
    http.set_nodelay(true);
    http.set_connect_timeout(config.connect_timeout);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    let https = match &config.tls_server_name {
        Some(name) => {
            let server_name =
                name.clone()
                    .try_into()
                    .map_err(|source| ClientError::ServerName {
                        name: name.clone(),
                        source,
                    })?;
            https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(server_name))
        }
        None => https,
    };
    let https = https.enable_http1().enable_http2().wrap_connector(http);
    let connections =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .http2_keep_alive_interval(PING_INTERVAL)
            .http2_keep_alive_timeout(PING_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .build(https);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(connections);
    Ok(Client::new(service, config.default_namespace))
}
