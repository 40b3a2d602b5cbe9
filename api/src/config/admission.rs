//! What can be checked of a claim's own configs before it is allocated:
//! the checks of the admission webhook (`tessera webhook`), with the same
//! [`Problem`]s prepare reports, so a config is refused at `kubectl apply`
//! with the text the Pod would otherwise show at start.
//!
//! Only what needs no allocation is checked: every entry for this driver
//! decodes ([`decode_value`]: apiVersion, kind, strict fields, values), and
//! the requests an entry is scoped to exist in the claim. Whether a kind
//! fits the device a request gets, and limits against what the claim holds,
//! are decided by the allocation and stay with prepare
//! ([`super::resolve_claim`]).

use super::decode::decode_value;
use super::error::{ConfigError, Problem, ProblemKind, SourceRef};
use super::resolve::{ConfigSource, Origin};

/// Checks the configs for this driver of one claim (or claim template)
/// spec, before allocation.
///
/// `claim` names the object in messages (`namespace/name`, or `template
/// namespace/name`). `requests` are the claim's request names: every
/// `spec.devices.requests[].name`, and `name/subrequest` for each
/// `firstAvailable` alternative. `sources` are the entries of
/// `spec.devices.config` whose `opaque.driver` is this driver, with
/// `index` their position in that list (entries of other drivers are left
/// out but keep their positions counted).
///
/// Returns every problem found, in entry order (empty: admissible); one
/// per entry at most, the first the entry has.
pub fn check_claim_spec(
    claim: &str,
    requests: &[String],
    sources: &[ConfigSource],
) -> Vec<ConfigError> {
    sources
        .iter()
        .filter_map(|source| {
            let at = SourceRef {
                origin: source.origin,
                index: source.index,
                requests: source.requests.clone(),
            };
            let problem = match decode_value(&source.parameters) {
                Err(problem) => problem,
                Ok(_) => unknown_request(&source.requests, requests)?,
            };
            Some(ConfigError::new(claim, Some(at), problem))
        })
        .collect()
}

fn unknown_request(scoped: &[String], requests: &[String]) -> Option<Problem> {
    let missing = scoped
        .iter()
        .find(|name| !requests.iter().any(|r| r == *name))?;
    let mut known: Vec<&str> = requests.iter().map(String::as_str).collect();
    known.sort_unstable();
    Some(Problem::new(
        ProblemKind::UnknownRequest,
        "requests",
        format!(
            "`{missing}` is not a request of this claim (its requests: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        ),
        "name one of the claim's requests (`request/subrequest` for a firstAvailable \
         alternative), or leave `requests` out to apply the config to every request",
    ))
}

impl ConfigError {
    /// The offending field as a path in the object the config list is in,
    /// given that list's path (`spec.devices.config` in a claim,
    /// `spec.spec.devices.config` in a template):
    /// `spec.devices.config[1].opaque.parameters.sharing.strategy`,
    /// `spec.devices.config[0].requests`. Without an entry, the list itself.
    pub fn field_path(&self, configs: &str) -> String {
        let Some(at) = self.at() else {
            return configs.to_owned();
        };
        let entry = format!("{configs}[{}]", at.index);
        match self.problem().field.as_str() {
            // The entry's own `requests`, beside `opaque`.
            "requests" => format!("{entry}.requests"),
            "parameters" => format!("{entry}.opaque.parameters"),
            field => format!("{entry}.opaque.parameters.{field}"),
        }
    }

    /// The message as an admission webhook gives it: the object, the field
    /// as a path in it ([`Self::field_path`]), what is wrong and the fix,
    /// e.g. `claim ns/c: spec.devices.config[1].opaque.parameters.kind:
    /// unknown kind `GPUConfig`; fix: use one of GpuConfig, MigConfig,
    /// ShareConfig`. The problem and fix are prepare's words.
    pub fn admission_message(&self, configs: &str) -> String {
        let p = self.problem();
        let origin = match self.at().map(|a| a.origin) {
            Some(Origin::Class) => "DeviceClass ",
            _ => "claim ",
        };
        format!(
            "{origin}{}: {}: {}; fix: {}",
            self.claim(),
            self.field_path(configs),
            p.message,
            p.fix
        )
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::config::API_VERSION;

    fn entry(index: usize, requests: &[&str], parameters: Value) -> ConfigSource {
        ConfigSource {
            origin: Origin::Claim,
            requests: requests.iter().map(|r| r.to_string()).collect(),
            index,
            parameters,
        }
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|r| r.to_string()).collect()
    }

    #[test]
    fn good_configs_and_known_requests_pass() {
        let sources = [
            entry(
                0,
                &[],
                json!({"apiVersion": API_VERSION, "kind": "GpuConfig",
                       "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}),
            ),
            entry(
                2,
                &["gpu/big", "share"],
                json!({"apiVersion": API_VERSION, "kind": "ShareConfig",
                       "processLimits": {"memory": "4Gi", "computePercent": 50}}),
            ),
        ];
        let requests = names(&["gpu", "gpu/big", "gpu/small", "share"]);
        assert_eq!(check_claim_spec("ns/c", &requests, &sources), vec![]);
    }

    #[test]
    fn each_bad_entry_is_reported_with_its_path_and_prepares_words() {
        let bad_strategy = json!({"apiVersion": API_VERSION, "kind": "GpuConfig",
                                  "sharing": {"strategy": "Bogus"}});
        let sources = [
            entry(1, &["gpu"], bad_strategy.clone()),
            entry(
                3,
                &[],
                json!({"apiVersion": API_VERSION, "kind": "GPUConfig"}),
            ),
            entry(
                4,
                &["nope"],
                json!({"apiVersion": API_VERSION, "kind": "MigConfig"}),
            ),
            entry(5, &[], json!("not an object")),
        ];
        let errors = check_claim_spec("ns/c", &names(&["gpu"]), &sources);
        assert_eq!(errors.len(), 4, "{errors:?}");
        let text: Vec<String> = errors
            .iter()
            .map(|e| e.admission_message("spec.devices.config"))
            .collect();
        assert!(
            text[0].starts_with(
                "claim ns/c: spec.devices.config[1].opaque.parameters.sharing.strategy: \
                 unknown variant `Bogus`"
            ),
            "{}",
            text[0]
        );
        // The same problem prepare reports for the same parameters.
        let prepare = crate::config::decode_value(&bad_strategy).unwrap_err();
        assert_eq!(errors[0].problem(), &prepare);
        assert!(
            text[0].ends_with(&format!("; fix: {}", prepare.fix)),
            "{}",
            text[0]
        );
        assert!(
            text[1].starts_with("claim ns/c: spec.devices.config[3].opaque.parameters.kind: "),
            "{}",
            text[1]
        );
        assert_eq!(errors[2].problem().kind, ProblemKind::UnknownRequest);
        assert_eq!(
            errors[2].field_path("spec.spec.devices.config"),
            "spec.spec.devices.config[4].requests"
        );
        assert!(
            text[2].contains("`nope` is not a request of this claim (its requests: gpu)"),
            "{}",
            text[2]
        );
        assert_eq!(
            errors[3].field_path("spec.devices.config"),
            "spec.devices.config[5].opaque.parameters"
        );
    }

    #[test]
    fn a_request_name_does_not_cover_unknown_subrequests() {
        let sources = [entry(
            0,
            &["gpu/huge"],
            json!({"apiVersion": API_VERSION, "kind": "GpuConfig"}),
        )];
        let errors = check_claim_spec("ns/c", &names(&["gpu", "gpu/big"]), &sources);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0]
                .admission_message("spec.devices.config")
                .contains("(its requests: gpu, gpu/big)")
        );
    }
}
