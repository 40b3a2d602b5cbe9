use serde_json::{Value, json};
use tessera_api::config::API_VERSION;

use super::*;

const DRIVER: &str = "gpu.tessera.dev";

fn claim_object(config: Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {
            "requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}},
                {"name": "alt", "firstAvailable": [
                    {"name": "big", "deviceClassName": "gpu.tessera.dev"},
                    {"name": "small", "deviceClassName": "mig.tessera.dev"}
                ]}
            ],
            "config": config,
        }},
    })
}

fn request(resource: &str, operation: &str, object: Value, old: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0f3e",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "X"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": resource},
            "operation": operation,
            "namespace": "ns",
            "object": object,
            "oldObject": old,
        }
    }))
    .unwrap()
}

fn answer(body: &[u8]) -> (bool, String) {
    answer_for(DRIVER, body)
}

fn answer_for(driver: &str, body: &[u8]) -> (bool, String) {
    let review = review(driver, body).unwrap();
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    let response = &review["response"];
    assert_eq!(response["uid"], "0f3e");
    (
        response["allowed"].as_bool().unwrap(),
        response["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

fn ours(parameters: Value) -> Value {
    json!({"opaque": {"driver": DRIVER, "parameters": parameters}})
}

fn bad_strategy() -> Value {
    json!({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "Bogus"}})
}

#[test]
fn a_bad_config_is_denied_with_prepares_words_and_its_path() {
    let object = claim_object(json!([
        {"opaque": {"driver": "net.example.com", "parameters": {"anything": 1}}},
        ours(bad_strategy()),
    ]));
    let (allowed, message) = answer(&request("resourceclaims", "CREATE", object, Value::Null));
    assert!(!allowed);
    let problem = tessera_api::config::decode_value(&bad_strategy()).unwrap_err();
    assert_eq!(
        message,
        format!(
            "claim ns/c: spec.devices.config[1].opaque.parameters.sharing.strategy: {}; fix: {}",
            problem.message, problem.fix
        )
    );
}

#[test]
fn a_template_is_checked_under_spec_spec() {
    let object = json!({
        "metadata": {"name": "t", "namespace": "ns"},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER,
                        "parameters": {"apiVersion": API_VERSION, "kind": "GPUConfig"}}}],
        }}},
    });
    let (allowed, message) = answer(&request(
        "resourceclaimtemplates",
        "CREATE",
        object,
        Value::Null,
    ));
    assert!(!allowed);
    assert!(
        message.starts_with(
            "claim template ns/t: spec.spec.devices.config[0].opaque.parameters.kind: unknown kind"
        ),
        "{message}"
    );
}

#[test]
fn good_configs_other_drivers_and_no_config_are_allowed() {
    let good = ours(json!({"apiVersion": API_VERSION, "kind": "MigConfig",
                           "sharing": {"strategy": "MPS", "mps": {"computePercent": 50}}}));
    let mut scoped = good.clone();
    scoped["requests"] = json!(["alt/small", "gpu"]);
    for config in [
        json!([good]),
        json!([scoped]),
        json!([{"opaque": {"driver": "other.example.com", "parameters": {"kind": "Whatever"}}}]),
        json!([]),
        Value::Null,
    ] {
        let (allowed, message) = answer(&request(
            "resourceclaims",
            "CREATE",
            claim_object(config.clone()),
            Value::Null,
        ));
        assert!(allowed, "{config}: {message}");
    }
}

#[test]
fn every_problem_is_listed_and_unknown_requests_too() {
    let mut unknown = ours(json!({"apiVersion": API_VERSION, "kind": "GpuConfig"}));
    unknown["requests"] = json!(["alt/huge"]);
    let object = claim_object(json!([ours(bad_strategy()), unknown]));
    let (allowed, message) = answer(&request("resourceclaims", "CREATE", object, Value::Null));
    assert!(!allowed);
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(lines.len(), 2, "{message}");
    assert!(
        lines[1].starts_with(
            "claim ns/c: spec.devices.config[1].requests: `alt/huge` is not a request"
        ),
        "{message}"
    );
}

#[test]
fn updates_are_checked_only_when_the_spec_changes() {
    let bad = claim_object(json!([ours(bad_strategy())]));
    let mut relabelled = bad.clone();
    relabelled["metadata"]["finalizers"] = json!([]);
    let (allowed, _) = answer(&request(
        "resourceclaims",
        "UPDATE",
        relabelled,
        bad.clone(),
    ));
    assert!(allowed, "a metadata update of an existing claim");
    let good = claim_object(json!([]));
    let (allowed, _) = answer(&request("resourceclaims", "UPDATE", bad.clone(), good));
    assert!(!allowed, "a spec change to a bad config");
    let (allowed, _) = answer(&request("resourceclaims", "DELETE", Value::Null, bad));
    assert!(allowed);
}

#[test]
fn other_resources_and_subresources_are_never_blocked() {
    let bad = claim_object(json!([ours(bad_strategy())]));
    let (allowed, _) = answer(&request("pods", "CREATE", bad.clone(), Value::Null));
    assert!(allowed);
    let mut body: Value =
        serde_json::from_slice(&request("resourceclaims", "UPDATE", bad, Value::Null)).unwrap();
    body["request"]["subResource"] = json!("status");
    let (allowed, _) = answer(&serde_json::to_vec(&body).unwrap());
    assert!(allowed);
}

#[test]
fn what_is_not_an_admission_review_is_an_error() {
    assert!(review(DRIVER, b"{").is_err());
    assert!(review(DRIVER, br#"{"apiVersion":"v1","kind":"Pod"}"#).is_err());
    let err = review(
        DRIVER,
        br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"x"}}"#,
    )
    .unwrap_err();
    assert!(matches!(err, ReviewError::Version { .. }), "{err:?}");
    assert!(err.to_string().contains("admissionReviewVersions"), "{err}");
    assert!(
        review(
            DRIVER,
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#
        )
        .is_err()
    );
}

#[test]
fn a_generated_name_is_named_as_best_known() {
    let mut object = claim_object(json!([ours(bad_strategy())]));
    object["metadata"] = json!({"generateName": "pod-gpu-", "namespace": "ns"});
    let (_, message) = answer(&request("resourceclaims", "CREATE", object, Value::Null));
    assert!(
        message.starts_with("claim ns/pod-gpu-<generated>: "),
        "{message}"
    );
}

/// A monitoring claim written the way other drivers document it: admin
/// access on the whole-GPU class, every GPU of the node.
fn admin_claim(class: &str) -> Value {
    json!({
        "metadata": {"name": "agent", "namespace": "mon"},
        "spec": {"devices": {"requests": [
            {"name": "work", "exactly": {"deviceClassName": "gpu.tessera.dev"}},
            {"name": "gpus", "exactly": {"deviceClassName": class,
                                         "allocationMode": "All", "adminAccess": true}},
        ]}},
    })
}

#[test]
fn admin_access_on_a_work_class_is_denied_naming_the_monitoring_class() {
    let (allowed, message) = answer(&request(
        "resourceclaims",
        "CREATE",
        admin_claim("gpu.tessera.dev"),
        Value::Null,
    ));
    assert!(!allowed);
    assert_eq!(
        message,
        "claim mon/agent: spec.devices.requests[1].exactly.adminAccess: request `gpus` asks work \
         class gpu.tessera.dev for admin access: its devices consume their GPU's counters, which \
         the scheduler checks even for admin access, so the claim stays Pending (\"cannot \
         allocate all claims\") while a workload holds the GPU, and where it is allocated the \
         device is prepared for work, not for monitoring; fix: set \
         spec.devices.requests[1].exactly.deviceClassName to gpu-monitor.tessera.dev and keep \
         adminAccess: true (the namespace needs the label resource.kubernetes.io/admin-access: \
         \"true\"); monitoring agents get every GPU of a node with allocationMode: All"
    );
    for class in [
        "mig.tessera.dev",
        "gpu-isolated.tessera.dev",
        "gpu-shared.tessera.dev",
    ] {
        let (allowed, message) = answer(&request(
            "resourceclaims",
            "CREATE",
            admin_claim(class),
            Value::Null,
        ));
        assert!(!allowed, "{class}");
        assert!(
            message.contains(&format!("work class {class}")),
            "{message}"
        );
    }
}

#[test]
fn admin_access_on_the_monitoring_class_or_another_drivers_is_allowed() {
    for class in [
        "gpu-monitor.tessera.dev",
        "gpu.example.com",
        "gpu.nvidia.com",
    ] {
        let (allowed, message) = answer(&request(
            "resourceclaims",
            "CREATE",
            admin_claim(class),
            Value::Null,
        ));
        assert!(allowed, "{class}: {message}");
    }
}

#[test]
fn the_fix_names_the_monitoring_class_of_the_installed_domain() {
    let (allowed, message) = answer_for(
        "gpu.nvidia.com",
        &request(
            "resourceclaims",
            "CREATE",
            admin_claim("gpu.nvidia.com"),
            Value::Null,
        ),
    );
    assert!(!allowed);
    assert!(
        message.contains("deviceClassName to gpu-monitor.nvidia.com and keep adminAccess: true"),
        "{message}"
    );
    // The default domain's classes are another driver's there.
    let (allowed, message) = answer_for(
        "gpu.nvidia.com",
        &request(
            "resourceclaims",
            "CREATE",
            admin_claim("gpu.tessera.dev"),
            Value::Null,
        ),
    );
    assert!(allowed, "{message}");
}

#[test]
fn a_template_asking_a_work_class_for_admin_access_is_denied_with_its_path() {
    let claim = admin_claim("mig.tessera.dev");
    let template = json!({
        "metadata": {"name": "agents", "namespace": "mon"},
        "spec": {"spec": claim["spec"].clone()},
    });
    let (allowed, message) = answer(&request(
        "resourceclaimtemplates",
        "CREATE",
        template,
        Value::Null,
    ));
    assert!(!allowed);
    assert!(
        message.starts_with(
            "claim template mon/agents: spec.spec.devices.requests[1].exactly.adminAccess: "
        ),
        "{message}"
    );
    assert!(
        message.contains(
            "set spec.spec.devices.requests[1].exactly.deviceClassName to gpu-monitor.tessera.dev"
        ),
        "{message}"
    );
}

#[test]
fn a_bad_config_and_admin_access_on_a_work_class_are_both_listed() {
    let mut object = admin_claim("gpu.tessera.dev");
    object["spec"]["devices"]["config"] = json!([ours(bad_strategy())]);
    let (allowed, message) = answer(&request("resourceclaims", "CREATE", object, Value::Null));
    assert!(!allowed);
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(lines.len(), 2, "{message}");
    assert!(
        lines[0].starts_with("claim mon/agent: spec.devices.config[0].opaque.parameters"),
        "{message}"
    );
    assert!(
        lines[1].starts_with("claim mon/agent: spec.devices.requests[1].exactly.adminAccess: "),
        "{message}"
    );
}

#[test]
fn parameters_beyond_the_apis_limit_are_denied_without_decoding() {
    let long = "x".repeat(MAX_PARAMETERS_BYTES);
    let object = claim_object(json!([ours(json!({ "note": long }))]));
    let (allowed, message) = answer(&request("resourceclaims", "CREATE", object, Value::Null));
    assert!(!allowed);
    assert!(
        message.contains("spec.devices.config[0].opaque.parameters: ")
            && message.contains("more than the 10240 the API allows"),
        "{message}"
    );
}

#[test]
fn lists_longer_than_any_the_api_server_admits_are_refused_while_read() {
    let requests: Vec<Value> = (0..=MAX_LIST)
        .map(|i| json!({ "name": format!("r{i}") }))
        .collect();
    let mut object = claim_object(json!([]));
    object["spec"]["devices"]["requests"] = json!(requests);
    let err = review(
        DRIVER,
        &request("resourceclaims", "CREATE", object, Value::Null),
    )
    .unwrap_err();
    assert!(err.to_string().contains("more than 256 items"), "{err}");
}
