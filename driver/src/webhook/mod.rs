//! `tessera webhook`: a validating admission webhook that refuses
//! ResourceClaims and ResourceClaimTemplates whose opaque config for this
//! driver prepare would refuse, or that ask a work class for admin access,
//! at `kubectl apply` time instead of at Pod start (or never).
//!
//! For every entry of `spec.devices.config` (claims) or
//! `spec.spec.devices.config` (templates) whose `opaque.driver` is this
//! driver, the parameters are decoded with prepare's decoder and the
//! requests the entry is scoped to are looked up in the claim
//! ([`tessera_api::config::check_claim_spec`]); a problem denies the request
//! with prepare's words and the field as a path in the object. Configs of
//! other drivers are not looked at; a claim without a config for this
//! driver is allowed without decoding anything.
//!
//! A request with `adminAccess: true` on one of the driver's work classes
//! (`gpu.<domain>`, `mig.<domain>`, ...) is denied with the monitoring class
//! as the fix: such a claim is never what a monitoring agent needs, and why
//! it is refused rather than warned about is in [`tessera_api::classes`].
//!
//! The webhook only validates: it never patches, so nothing a user wrote
//! can be lost. It works on the object's JSON as sent, so fields newer than
//! this build's Kubernetes types pass through untouched, and the same code
//! reads every `resource.k8s.io` version (config and request names have the
//! same shape in v1beta1, v1beta2 and v1).
//!
//! An UPDATE is checked only when the spec changed (both kinds' specs are
//! immutable today): a claim admitted before the webhook was installed can
//! still get its finalizers and metadata updated, and so be deleted.

pub mod server;

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tessera_api::classes::work_class_admin_access;
use tessera_api::config::{ConfigSource, Origin, check_claim_spec};

/// `admission.k8s.io/v1`, the only AdmissionReview version served.
pub const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";

/// The API group of ResourceClaims.
pub const RESOURCE_GROUP: &str = "resource.k8s.io";

#[derive(Debug, Clone, clap::Args)]
pub struct WebhookArgs {
    /// DRA driver name: configs whose `opaque.driver` is this are checked.
    #[arg(long, env = "TESSERA_DRIVER_NAME", default_value = tessera_api::names::DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

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
    use anyhow::Context as _;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    tessera_controller::model::DriverName::new(&args.driver_name)
        .map_err(|e| anyhow::anyhow!("--driver-name: {e}"))?;
    let tls = server::load_tls(&args.tls_cert_file, &args.tls_private_key_file)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let listener = server::bind(args.listen).await?;
        server::serve(
            listener,
            tls,
            args.driver_name.clone(),
            usize::from(args.max_connections),
            crate::plugin::cli::termination(),
        )
        .await
    })
}

/// The part of an AdmissionReview request the webhook reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewRequest {
    uid: String,
    #[serde(default)]
    resource: GroupVersionResource,
    #[serde(default)]
    sub_resource: String,
    #[serde(default)]
    operation: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    object: Value,
    #[serde(default)]
    old_object: Value,
}

#[derive(Debug, Default, Deserialize)]
struct GroupVersionResource {
    #[serde(default)]
    group: String,
    #[serde(default)]
    resource: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<ReviewRequest>,
}

/// The webhook's verdict on one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Verdict {
    /// Admit.
    Allow,
    /// Refuse, with the message the user sees.
    Deny(String),
}

/// The kinds the webhook checks, with where their configs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// `resourceclaims`: `spec.devices`.
    Claim,
    /// `resourceclaimtemplates`: `spec.spec.devices`.
    Template,
}

impl Checked {
    fn from_resource(group: &str, resource: &str) -> Option<Self> {
        match (group, resource) {
            (RESOURCE_GROUP, "resourceclaims") => Some(Checked::Claim),
            (RESOURCE_GROUP, "resourceclaimtemplates") => Some(Checked::Template),
            _ => None,
        }
    }

    fn spec(self, object: &Value) -> &Value {
        match self {
            Checked::Claim => &object["spec"],
            Checked::Template => &object["spec"]["spec"],
        }
    }

    /// Path of the config list in the object.
    pub fn configs_path(self) -> &'static str {
        match self {
            Checked::Claim => "spec.devices.config",
            Checked::Template => "spec.spec.devices.config",
        }
    }

    /// Path of the claim spec's `devices` in the object.
    pub fn devices_path(self) -> &'static str {
        match self {
            Checked::Claim => "spec.devices",
            Checked::Template => "spec.spec.devices",
        }
    }
}

/// Answers one AdmissionReview (the request body): the AdmissionReview to
/// send back, or why the body is not one (a 400).
pub fn review(driver: &str, body: &[u8]) -> Result<Value, String> {
    let review: Review =
        serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}"))?;
    if review.kind != "AdmissionReview" || review.api_version != REVIEW_API_VERSION {
        return Err(format!(
            "expected kind AdmissionReview of {REVIEW_API_VERSION}, got {} of {} (set \
             admissionReviewVersions: [v1] in the webhook configuration)",
            review.kind, review.api_version
        ));
    }
    let request = review
        .request
        .ok_or_else(|| "the AdmissionReview has no request".to_owned())?;
    let verdict = decide(driver, &request);
    let response = match &verdict {
        Verdict::Allow => json!({ "uid": request.uid, "allowed": true }),
        Verdict::Deny(message) => {
            tracing::info!(
                operation = %request.operation,
                resource = %request.resource.resource,
                namespace = %request.namespace,
                "denied: {message}"
            );
            json!({
                "uid": request.uid,
                "allowed": false,
                "status": { "code": 422, "reason": "Invalid", "message": message },
            })
        }
    };
    Ok(json!({
        "apiVersion": REVIEW_API_VERSION,
        "kind": "AdmissionReview",
        "response": response,
    }))
}

fn decide(driver: &str, request: &ReviewRequest) -> Verdict {
    let Some(checked) = Checked::from_resource(&request.resource.group, &request.resource.resource)
    else {
        // Not something this webhook is configured for: never block it.
        return Verdict::Allow;
    };
    if !request.sub_resource.is_empty() {
        return Verdict::Allow;
    }
    match request.operation.as_str() {
        "CREATE" => {}
        "UPDATE" if checked.spec(&request.object) != checked.spec(&request.old_object) => {}
        _ => return Verdict::Allow,
    }
    let namespace = match request.object["metadata"]["namespace"].as_str() {
        Some(ns) if !ns.is_empty() => ns,
        _ => &request.namespace,
    };
    let name = match request.object["metadata"]["name"].as_str() {
        Some(n) if !n.is_empty() => n.to_owned(),
        _ if !request.name.is_empty() => request.name.clone(),
        _ => format!(
            "{}<generated>",
            request.object["metadata"]["generateName"]
                .as_str()
                .unwrap_or_default()
        ),
    };
    let label = match checked {
        Checked::Claim => format!("{namespace}/{name}"),
        Checked::Template => format!("template {namespace}/{name}"),
    };
    check(driver, checked, &label, &request.object)
}

/// Checks one claim or template object (its JSON as the API server sends
/// it). `label` names it in messages.
pub fn check(driver: &str, checked: Checked, label: &str, object: &Value) -> Verdict {
    let devices = &checked.spec(object)["devices"];
    let mut problems = config_problems(driver, checked, label, devices);
    problems.extend(
        work_class_admin_access(
            driver,
            &format!("claim {label}"),
            devices,
            checked.devices_path(),
        )
        .iter()
        .map(ToString::to_string),
    );
    if problems.is_empty() {
        Verdict::Allow
    } else {
        Verdict::Deny(problems.join("\n"))
    }
}

/// What prepare would refuse in the configs for this driver, one message
/// each.
fn config_problems(driver: &str, checked: Checked, label: &str, devices: &Value) -> Vec<String> {
    let sources: Vec<ConfigSource> = devices["config"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .enumerate()
        .filter(|(_, entry)| entry["opaque"]["driver"].as_str() == Some(driver))
        .map(|(index, entry)| ConfigSource {
            origin: Origin::Claim,
            requests: strings(&entry["requests"]),
            index,
            parameters: entry["opaque"]["parameters"].clone(),
        })
        .collect();
    if sources.is_empty() {
        return Vec::new();
    }
    check_claim_spec(label, &request_names(devices), &sources)
        .iter()
        .map(|e| e.admission_message(checked.configs_path()))
        .collect()
}

/// Every request name of a claim spec's `devices`: `name`, and
/// `name/subrequest` for each `firstAvailable` alternative.
fn request_names(devices: &Value) -> Vec<String> {
    let mut names = Vec::new();
    for request in devices["requests"].as_array().into_iter().flatten() {
        let Some(name) = request["name"].as_str() else {
            continue;
        };
        names.push(name.to_owned());
        for sub in request["firstAvailable"].as_array().into_iter().flatten() {
            if let Some(sub) = sub["name"].as_str() {
                names.push(format!("{name}/{sub}"));
            }
        }
    }
    names
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

#[cfg(test)]
mod tests;
