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

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tessera_api::classes::work_class_admin_access;
use tessera_api::config::{ConfigSource, Origin, check_claim_spec};

/// `admission.k8s.io/v1`, the only AdmissionReview version served.
pub const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";

/// The API group of ResourceClaims.
pub const RESOURCE_GROUP: &str = "resource.k8s.io";

/// The part of an AdmissionReview request the webhook reads. Decoded into
/// these types alone (everything else of the object is skipped, not
/// kept), so a request costs little more memory than its body.
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
    object: Option<Object>,
    #[serde(default)]
    old_object: Option<Object>,
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

/// What is read of a claim or template.
#[derive(Debug, Default, Deserialize)]
struct Object {
    #[serde(default)]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<ObjectSpec>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    generate_name: Option<String>,
}

/// A claim's spec (`devices`), or a template's (`spec`, holding a claim's).
#[derive(Debug, Default, Deserialize, PartialEq)]
struct ObjectSpec {
    #[serde(default)]
    devices: Option<Devices>,
    #[serde(default)]
    spec: Option<Box<ObjectSpec>>,
}

/// A claim spec's `devices`: what the checks read of it.
#[derive(Debug, Default, Deserialize, PartialEq)]
pub struct Devices {
    #[serde(default, deserialize_with = "capped::<_, _, MAX_LIST>")]
    requests: Vec<DeviceRequest>,
    #[serde(default, deserialize_with = "capped::<_, _, MAX_LIST>")]
    config: Vec<ConfigEntry>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct DeviceRequest {
    #[serde(default)]
    name: String,
    #[serde(default, deserialize_with = "capped::<_, _, MAX_LIST>")]
    first_available: Vec<DeviceRequest>,
    #[serde(default)]
    exactly: Option<Box<DeviceRequest>>,
    #[serde(default)]
    device_class_name: Option<String>,
    #[serde(default)]
    admin_access: Option<bool>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
struct ConfigEntry {
    #[serde(default, deserialize_with = "capped::<_, _, MAX_LIST>")]
    requests: Vec<String>,
    #[serde(default)]
    opaque: Option<Opaque>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
struct Opaque {
    #[serde(default)]
    driver: String,
    /// Kept as text: decoded only for this driver's entries.
    #[serde(default)]
    parameters: Option<RawJson>,
}

/// JSON kept as the text it was sent as.
#[derive(Debug, Deserialize)]
#[serde(transparent)]
struct RawJson(Box<serde_json::value::RawValue>);

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.0.get() == other.0.get()
    }
}

/// Longest list read (requests, subrequests, config entries, a config's
/// requests). The API server refuses objects with more than 32 requests
/// or configs before a webhook sees them; a longer list did not come from
/// it, and is refused while it is read, before it takes memory.
const MAX_LIST: usize = 256;

/// Largest `opaque.parameters` decoded: the API server's own limit for
/// the field (10 KiB).
pub const MAX_PARAMETERS_BYTES: usize = 10 * 1024;

/// A list of at most `N` items (`null` reads as none).
fn capped<'de, D, T, const N: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Capped<T, const N: usize>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>, const N: usize> serde::de::Visitor<'de> for Capped<T, N> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a list of at most {N} items")
        }

        fn visit_unit<E>(self) -> Result<Vec<T>, E> {
            Ok(Vec::new())
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element()? {
                if items.len() == N {
                    return Err(serde::de::Error::custom(format!(
                        "a list of more than {N} items, more than the API server admits"
                    )));
                }
                items.push(item);
            }
            Ok(items)
        }
    }
    d.deserialize_any(Capped::<T, N>(std::marker::PhantomData))
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

    /// The claim spec's `devices` of `object`, if it has one.
    fn devices(self, object: Option<&Object>) -> Option<&Devices> {
        let spec = object?.spec.as_ref()?;
        match self {
            Checked::Claim => spec.devices.as_ref(),
            Checked::Template => spec.spec.as_ref()?.devices.as_ref(),
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

/// Why a request body is not an AdmissionReview this webhook answers (a
/// 400, whose body is the Display).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("not an AdmissionReview: {source}")]
    NotAReview { source: serde_json::Error },
    #[error(
        "expected kind AdmissionReview of {}, got {kind} of {api_version} (set \
         admissionReviewVersions: [v1] in the webhook configuration)",
        REVIEW_API_VERSION
    )]
    Version { kind: String, api_version: String },
    #[error("the AdmissionReview has no request")]
    NoRequest,
}

/// Answers one AdmissionReview (the request body): the AdmissionReview to
/// send back, or why the body is not one (a 400).
pub fn review(driver: &str, body: &[u8]) -> Result<Value, ReviewError> {
    let review: Review =
        serde_json::from_slice(body).map_err(|source| ReviewError::NotAReview { source })?;
    if review.kind != "AdmissionReview" || review.api_version != REVIEW_API_VERSION {
        return Err(ReviewError::Version {
            kind: review.kind,
            api_version: review.api_version,
        });
    }
    let request = review.request.ok_or(ReviewError::NoRequest)?;
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
    let object = request.object.as_ref();
    let devices = checked.devices(object);
    match request.operation.as_str() {
        "CREATE" => {}
        "UPDATE" if devices != checked.devices(request.old_object.as_ref()) => {}
        _ => return Verdict::Allow,
    }
    let meta = object.map(|o| &o.metadata);
    let namespace = given(meta.and_then(|m| m.namespace.as_deref())).unwrap_or(&request.namespace);
    let name = match given(meta.and_then(|m| m.name.as_deref())) {
        Some(n) => n.to_owned(),
        None if !request.name.is_empty() => request.name.clone(),
        None => format!(
            "{}<generated>",
            meta.and_then(|m| m.generate_name.as_deref())
                .unwrap_or_default()
        ),
    };
    let label = match checked {
        Checked::Claim => format!("{namespace}/{name}"),
        Checked::Template => format!("template {namespace}/{name}"),
    };
    check(
        driver,
        checked,
        &label,
        devices.unwrap_or(&Devices::default()),
    )
}

/// A name field, unless absent or empty.
fn given(field: Option<&str>) -> Option<&str> {
    field.filter(|s| !s.is_empty())
}

/// Checks the claim spec's `devices` of one claim or template. `label`
/// names it in messages.
pub fn check(driver: &str, checked: Checked, label: &str, devices: &Devices) -> Verdict {
    let mut problems = config_problems(driver, checked, label, devices);
    problems.extend(
        work_class_admin_access(
            driver,
            &format!("claim {label}"),
            &requests_json(&devices.requests),
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

/// The requests as JSON (`{"requests": [...]}`) in the shape the admin
/// access check reads: only the fields it looks at, so small.
fn requests_json(requests: &[DeviceRequest]) -> Value {
    fn one(r: &DeviceRequest) -> Value {
        let mut v = json!({ "name": r.name });
        if let Some(class) = &r.device_class_name {
            v["deviceClassName"] = json!(class);
        }
        if let Some(admin) = r.admin_access {
            v["adminAccess"] = json!(admin);
        }
        if let Some(exact) = &r.exactly {
            v["exactly"] = one(exact);
        }
        v
    }
    json!({ "requests": requests.iter().map(one).collect::<Vec<_>>() })
}

/// What prepare would refuse in the configs for this driver, one message
/// each.
fn config_problems(driver: &str, checked: Checked, label: &str, devices: &Devices) -> Vec<String> {
    let mut problems = Vec::new();
    let mut sources = Vec::new();
    for (index, entry) in devices.config.iter().enumerate() {
        let Some(opaque) = entry.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let text = opaque.parameters.as_ref().map_or("null", |p| p.0.get());
        if text.len() > MAX_PARAMETERS_BYTES {
            problems.push(format!(
                "claim {label}: {}[{index}].opaque.parameters: {} bytes, more than the \
                 {MAX_PARAMETERS_BYTES} the API allows; fix: shorten the parameters",
                checked.configs_path(),
                text.len()
            ));
            continue;
        }
        sources.push(ConfigSource {
            origin: Origin::Claim,
            requests: entry.requests.clone(),
            index,
            parameters: serde_json::from_str(text).unwrap_or(Value::Null),
        });
    }
    if !sources.is_empty() {
        problems.extend(
            check_claim_spec(label, &request_names(&devices.requests), &sources)
                .iter()
                .map(|e| e.admission_message(checked.configs_path())),
        );
    }
    problems
}

/// Every request name of a claim spec's `devices`: `name`, and
/// `name/subrequest` for each `firstAvailable` alternative.
fn request_names(requests: &[DeviceRequest]) -> Vec<String> {
    let mut names = Vec::new();
    for request in requests.iter().filter(|r| !r.name.is_empty()) {
        names.push(request.name.clone());
        for sub in request
            .first_available
            .iter()
            .filter(|s| !s.name.is_empty())
        {
            names.push(format!("{}/{}", request.name, sub.name));
        }
    }
    names
}

#[cfg(test)]
mod tests;
