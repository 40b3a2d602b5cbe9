//! `accelerator-metrics` through a Service (`--metrics-service`), as a
//! scraper inside the cluster reads them: the Service's endpoint on the
//! checked node, over TLS, with a ServiceAccount token.
//!
//! Before it reads anything, the check holds the endpoint to what the chart
//! promises: a request without a token is refused (401), and so is one
//! from an account not allowed to `get` the path (403). The reading account
//! is bound to a ClusterRole of this run (non-resource URLs can only be
//! granted cluster-wide), deleted again when the check ends.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

/// The port the chart names on its metrics Service.
pub const PORT_NAME: &str = "https-metrics";
/// How long the check's tokens last (the API server's minimum).
const TOKEN_SECONDS: i64 = 600;

/// Where and how the check scrapes: `GET url` with the token, if any.
#[derive(Clone)]
pub struct Scraper {
    pub url: String,
    token: Option<String>,
}

impl Scraper {
    pub fn plain(url: &str) -> Scraper {
        Scraper {
            url: url.to_owned(),
            token: None,
        }
    }

    /// The body of a 200 answer.
    pub async fn scrape(&self) -> Result<String> {
        match &self.token {
            None => {
                let url = self.url.clone();
                tokio::task::spawn_blocking(move || super::metrics::scrape(&url)).await?
            }
            Some(token) => match get(&self.url, Some(token)).await? {
                (200, body) => Ok(body),
                (code, body) => bail!("{} answered {code}: {}", self.url, body.trim()),
            },
        }
    }
}

/// `GET` of an `https://` URL, the certificate not verified (the chart's
/// default is self-signed; the token is what guards the data); (status,
/// body).
pub async fn get(url: &str, token: Option<&str>) -> Result<(u16, String)> {
    let (base, path) = split_url(url)?;
    let mut config = kube::Config::new(base.parse().with_context(|| format!("URL {url}"))?);
    config.accept_invalid_certs = true;
    config.read_timeout = Some(Duration::from_secs(10));
    config.auth_info.token = token.map(|t| t.to_owned().into());
    let client = Client::try_from(config).context("an HTTPS client")?;
    let request = http::Request::get(path).body(Vec::new())?;
    let answer = client
        .send(request.map(kube::client::Body::from))
        .await
        .with_context(|| format!("GET {url}"))?;
    let code = answer.status().as_u16();
    let body = http_body_util::BodyExt::collect(answer.into_body())
        .await
        .with_context(|| format!("reading the answer of {url}"))?
        .to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// `https://host:port/path` into the base URL and the path.
fn split_url(url: &str) -> Result<(&str, &str)> {
    let rest = url
        .strip_prefix("https://")
        .with_context(|| format!("{url}: not an https:// URL"))?;
    let at = rest.find('/').unwrap_or(rest.len());
    let path = &rest[at..];
    Ok((
        &url[..url.len() - path.len()],
        if path.is_empty() { "/" } else { path },
    ))
}

/// The Service's endpoint on `node`: `https://<address>:<port>/metrics`.
pub async fn endpoint_on(client: &Client, service: &str, node: &str) -> Result<String> {
    let (ns, name) = service
        .split_once('/')
        .with_context(|| format!("--metrics-service {service:?}: expected NAMESPACE/NAME"))?;
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .with_context(|| format!("reading Service {service}"))?;
    let ports = svc.spec.and_then(|s| s.ports).unwrap_or_default();
    ensure!(
        ports.iter().any(|p| p.name.as_deref() == Some(PORT_NAME)),
        "Service {service} has no port named {PORT_NAME}"
    );
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={name}")))
        .await
        .with_context(|| format!("listing the EndpointSlices of Service {service}"))?;
    for slice in slices.items {
        let port = slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(PORT_NAME))
            .and_then(|p| p.port);
        let ready = slice.endpoints.iter().flatten().find(|e| {
            e.node_name.as_deref() == Some(node)
                && e.conditions.as_ref().and_then(|c| c.ready) != Some(false)
        });
        if let (Some(port), Some(endpoint)) = (port, ready) {
            let address = endpoint
                .addresses
                .first()
                .context("an endpoint without address")?;
            let host = match address.contains(':') {
                true => format!("[{address}]"),
                false => address.clone(),
            };
            return Ok(format!("https://{host}:{port}/metrics"));
        }
    }
    bail!("Service {service} has no ready endpoint on node {node}")
}

/// The accounts of a run: one allowed to read the metrics, one not.
pub struct Readers {
    client: Client,
    role: String,
    pub allowed: String,
    pub stranger: String,
}

impl Readers {
    /// Both accounts in `ns`, a ClusterRole and binding for the reader,
    /// and a token of each.
    pub async fn make(client: &Client, ns: &str, path: &str) -> Result<Readers> {
        let client = client.clone();
        let role = format!("tessera-conformance-metrics-{ns}");
        let pp = PostParams::default();
        let role_object: ClusterRole = serde_json::from_value(json!({
            "metadata": { "name": role },
            "rules": [{ "nonResourceURLs": [path], "verbs": ["get"] }],
        }))?;
        Api::<ClusterRole>::all(client.clone())
            .create(&pp, &role_object)
            .await
            .with_context(|| format!("creating ClusterRole {role}"))?;
        let readers = Readers {
            client: client.clone(),
            role: role.clone(),
            allowed: token_of(&client, ns, "metrics-reader").await?,
            stranger: token_of(&client, ns, "metrics-stranger").await?,
        };
        let binding: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": { "name": role },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role },
            "subjects": [{ "kind": "ServiceAccount", "name": "metrics-reader", "namespace": ns }],
        }))?;
        if let Err(e) = Api::<ClusterRoleBinding>::all(client)
            .create(&pp, &binding)
            .await
        {
            readers.remove().await;
            bail!("creating ClusterRoleBinding {role}: {e}");
        }
        Ok(readers)
    }

    /// Deletes the run's ClusterRole and binding (the accounts go with the
    /// namespace).
    pub async fn remove(&self) {
        let dp = DeleteParams::default();
        let _ = Api::<ClusterRoleBinding>::all(self.client.clone())
            .delete(&self.role, &dp)
            .await;
        let _ = Api::<ClusterRole>::all(self.client.clone())
            .delete(&self.role, &dp)
            .await;
    }
}

/// A new ServiceAccount `name` and a token of it.
async fn token_of(client: &Client, ns: &str, name: &str) -> Result<String> {
    let accounts = Api::<ServiceAccount>::namespaced(client.clone(), ns);
    let account: ServiceAccount = serde_json::from_value(json!({ "metadata": { "name": name } }))?;
    accounts
        .create(&PostParams::default(), &account)
        .await
        .with_context(|| format!("creating ServiceAccount {ns}/{name}"))?;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(TOKEN_SECONDS),
            ..Default::default()
        }),
        ..Default::default()
    };
    let made = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("a token of ServiceAccount {ns}/{name}"))?;
    made.status
        .and_then(|s| s.token)
        .with_context(|| format!("no token in the TokenRequest of {ns}/{name}"))
}

/// What the endpoint answers without a token, to the stranger and to the
/// reader: 401, 403 and 200 are what it must; the reader's scraper then.
pub async fn guarded_scraper(
    url: &str,
    readers: &Readers,
    details: &mut Vec<String>,
) -> Result<std::result::Result<Scraper, String>> {
    let (anonymous, _) = get(url, None).await?;
    let (stranger, _) = get(url, Some(&readers.stranger)).await?;
    let (reader, _) = get(url, Some(&readers.allowed)).await?;
    details.push(format!(
        "{url}: without a token {anonymous}, account without access {stranger}, reader {reader}"
    ));
    if (anonymous, stranger, reader) != (401, 403, 200) {
        return Ok(Err(format!(
            "{url} must answer 401 without a token, 403 to an account without `get` on its \
             path and 200 to one with it; it answered {anonymous}, {stranger} and {reader}"
        )));
    }
    Ok(Ok(Scraper {
        url: url.to_owned(),
        token: Some(readers.allowed.clone()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_base_and_path() {
        assert_eq!(
            split_url("https://10.0.0.1:9401/metrics").unwrap(),
            ("https://10.0.0.1:9401", "/metrics")
        );
        assert_eq!(
            split_url("https://[fd00::1]:9401").unwrap(),
            ("https://[fd00::1]:9401", "/")
        );
        assert!(split_url("http://10.0.0.1/metrics").is_err());
    }
}
