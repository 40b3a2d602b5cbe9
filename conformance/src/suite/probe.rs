//! The probe every pod of the run executes, what it prints, and the Pod /
//! ResourceClaim(Template) objects the checks create.
//!
//! The probe is a POSIX shell script (busybox is enough). It counts the
//! accelerator device nodes as the CNCF AI-conformance suite does
//! (`RESULT: ACCELERATOR_COUNT=<n>` for `/dev/nvidia[0-9]*`), prints what
//! `nvidia-smi` says about the GPUs it sees, runs a small health script, and
//! exits 0: results travel through the logs, never through the exit code.
//! With `PROBE_HOLD_SECONDS` set it then stays up (so that its claim stays
//! allocated) until that many seconds pass or the pod is deleted.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Label on every object of a run; value: the check id.
pub const CHECK_LABEL: &str = "conformance.tessera.dev/check";
/// Label on every object of a run.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "tessera-conformance");

pub const SCRIPT: &str = r#"n=0
for d in /dev/nvidia[0-9]*; do [ -e "$d" ] && n=$((n+1)); done
echo "RESULT: ACCELERATOR_COUNT=$n"
health=""
if command -v nvidia-smi >/dev/null 2>&1; then
  q=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>&1); qrc=$?
  echo "$q" | while IFS= read -r l; do [ -n "$l" ] && echo "UUID: $l"; done
  echo "UUID-EXIT: $qrc"
  L=$(nvidia-smi -L 2>&1); lrc=$?
  echo "$L" | while IFS= read -r l; do [ -n "$l" ] && echo "SMI-L: $l"; done
  h=$(nvidia-smi --query-gpu=uuid,name,memory.total --format=csv,noheader 2>&1); hrc=$?
  echo "$h" | while IFS= read -r l; do [ -n "$l" ] && echo "SMI-Q: $l"; done
  v=$(nvidia-smi 2>&1 | grep 'Driver Version' | head -n 1)
  [ -n "$v" ] && echo "SMI-VERSIONS: $v"
  if [ "$hrc" -ne 0 ] || [ "$lrc" -ne 0 ]; then health="nvidia-smi exited with $hrc (query) / $lrc (-L)"
  elif ! echo "$L" | grep -q '^GPU '; then health="nvidia-smi -L lists no GPU"
  elif echo "$h$L" | grep -q -e 'ERR!' -e 'Unknown Error'; then health="nvidia-smi reports an error: $(echo "$h$L" | grep -e 'ERR!' -e 'Unknown Error' | head -n 1)"
  fi
else
  health="nvidia-smi not found in the container"
fi
if [ "${PROBE_EXPECT_GPU:-1}" = 0 ]; then echo "HEALTH: SKIP no claim in this container"
elif [ -z "$health" ]; then echo "HEALTH: OK"
else echo "HEALTH: FAIL $health"
fi
echo "PROBE: DONE"
if [ -n "${PROBE_HOLD_SECONDS:-}" ]; then
  trap 'exit 0' TERM INT
  sleep "$PROBE_HOLD_SECONDS" & wait
fi
exit 0
"#;

/// Outcome of the probe's health script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Ok,
    Fail(String),
    Skip(String),
}

/// What one container's probe printed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProbeOutput {
    pub accelerator_count: Option<u32>,
    /// `nvidia-smi --query-gpu=uuid` lines.
    pub query_uuids: Vec<String>,
    /// `nvidia-smi -L` lines.
    pub list: Vec<String>,
    pub health: Option<Health>,
    /// The row of `nvidia-smi`'s summary that names the driver and CUDA
    /// versions.
    pub versions: Option<String>,
    pub done: bool,
}

impl ProbeOutput {
    pub fn parse(log: &str) -> Self {
        let mut out = Self::default();
        for line in log.lines().map(str::trim_end) {
            if let Some(n) = line.strip_prefix("RESULT: ACCELERATOR_COUNT=") {
                out.accelerator_count = n.trim().parse().ok();
            } else if let Some(u) = line.strip_prefix("UUID: ") {
                out.query_uuids.push(u.trim().to_owned());
            } else if let Some(l) = line.strip_prefix("SMI-L: ") {
                out.list.push(l.to_owned());
            } else if let Some(h) = line.strip_prefix("HEALTH: ") {
                out.health = Some(if h == "OK" {
                    Health::Ok
                } else if let Some(r) = h.strip_prefix("FAIL ") {
                    Health::Fail(r.to_owned())
                } else {
                    Health::Skip(h.strip_prefix("SKIP ").unwrap_or(h).to_owned())
                });
            } else if let Some(v) = line.strip_prefix("SMI-VERSIONS: ") {
                out.versions = Some(v.to_owned());
            } else if line == "PROBE: DONE" {
                out.done = true;
            }
        }
        out
    }

    /// UUIDs in `nvidia-smi -L` output (`... (UUID: X)`): GPUs, then MIG devices.
    fn listed(&self, prefix: &str) -> Vec<String> {
        self.list
            .iter()
            .filter_map(|l| l.split("(UUID: ").nth(1))
            .map(|u| u.trim_end_matches(')').trim().to_owned())
            .filter(|u| u.starts_with(prefix))
            .collect()
    }

    /// The driver version and the CUDA version `nvidia-smi` printed
    /// (`Driver Version: 570.133.20   CUDA Version: 12.8`).
    pub fn driver_versions(&self) -> Option<(String, String)> {
        let row = self.versions.as_deref()?;
        let after = |label: &str| {
            let (_, rest) = row.split_once(label)?;
            rest.split_whitespace().next().map(str::to_owned)
        };
        Some((after("Driver Version:")?, after("CUDA Version:")?))
    }

    pub fn listed_gpus(&self) -> Vec<String> {
        self.listed("GPU-")
    }

    pub fn listed_migs(&self) -> Vec<String> {
        self.listed("MIG-")
    }

    /// The GPU UUIDs the container sees: the query's answer, else `-L`'s.
    pub fn gpu_uuids(&self) -> Vec<String> {
        let q: Vec<String> = self
            .query_uuids
            .iter()
            .filter(|u| u.starts_with("GPU-") || u.starts_with("MIG-"))
            .cloned()
            .collect();
        if q.is_empty() { self.listed_gpus() } else { q }
    }

    /// One line for the report: what the container saw.
    pub fn summary(&self) -> String {
        let count = self
            .accelerator_count
            .map_or("?".to_owned(), |n| n.to_string());
        let gpus = self.gpu_uuids();
        let migs = self.listed_migs();
        let mut s = format!(
            "/dev/nvidia[0-9]*: {count}; nvidia-smi GPUs: [{}]",
            gpus.join(", ")
        );
        if !migs.is_empty() {
            s.push_str(&format!("; MIG: [{}]", migs.join(", ")));
        }
        match &self.health {
            Some(Health::Ok) => s.push_str("; health OK"),
            Some(Health::Fail(r)) => s.push_str(&format!("; health FAIL: {r}")),
            Some(Health::Skip(_)) | None => {}
        }
        s
    }
}

/// A device request of `class`, narrowed by `selectors` (CEL), asking for
/// `capacity` (name → quantity) of a multi-allocatable device.
pub fn device_request(
    name: &str,
    class: &str,
    selectors: &[String],
    capacity: &BTreeMap<String, String>,
) -> Value {
    let mut exactly = json!({ "deviceClassName": class, "count": 1 });
    if !selectors.is_empty() {
        exactly["selectors"] = selectors
            .iter()
            .map(|e| json!({ "cel": { "expression": e } }))
            .collect();
    }
    if !capacity.is_empty() {
        exactly["capacity"] = json!({ "requests": capacity });
    }
    json!({ "name": name, "exactly": exactly })
}

fn labels(check: &str) -> Value {
    json!({ CHECK_LABEL: check, MANAGED_BY.0: MANAGED_BY.1 })
}

/// A ResourceClaim with one request named `gpu`.
pub fn claim(name: &str, check: &str, request: Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": name, "labels": labels(check) },
        "spec": { "devices": { "requests": [request] } }
    })
}

/// A ResourceClaimTemplate with one request named `gpu`.
pub fn claim_template(name: &str, check: &str, request: Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": { "name": name, "labels": labels(check) },
        "spec": {
            "metadata": { "labels": labels(check) },
            "spec": { "devices": { "requests": [request] } }
        }
    })
}

/// Where a pod's claim comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimSource {
    Template(String),
    Claim(String),
    /// No pod claim: the containers that use it ask `resources.limits`
    /// for one of this extended resource (a DeviceClass's
    /// `extendedResourceName`), and the scheduler makes the claim.
    Limits(String),
}

/// One container of a probe pod; `claim`: the pod claim it references.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeContainer {
    pub name: String,
    pub uses_claim: bool,
}

/// The shape of a probe pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePod {
    pub name: String,
    pub check: String,
    pub node: String,
    pub image: String,
    pub claim: Option<ClaimSource>,
    pub containers: Vec<ProbeContainer>,
    /// Keep running this long after printing (holds the claim).
    pub hold_seconds: Option<u64>,
}

/// Name of the pod-level claim entry every probe pod uses.
pub const POD_CLAIM: &str = "gpu";

impl ProbePod {
    /// A one-container pod (`probe`) using `claim`, if any.
    pub fn single(
        name: &str,
        check: &str,
        node: &str,
        image: &str,
        claim: Option<ClaimSource>,
    ) -> Self {
        Self {
            name: name.to_owned(),
            check: check.to_owned(),
            node: node.to_owned(),
            image: image.to_owned(),
            containers: vec![ProbeContainer {
                name: "probe".into(),
                uses_claim: claim.is_some(),
            }],
            claim,
            hold_seconds: None,
        }
    }

    pub fn to_json(&self) -> Value {
        let containers: Vec<Value> = self
            .containers
            .iter()
            .map(|c| {
                let mut env = vec![json!({
                    "name": "PROBE_EXPECT_GPU",
                    "value": if c.uses_claim { "1" } else { "0" }
                })];
                if let Some(s) = self.hold_seconds {
                    env.push(json!({ "name": "PROBE_HOLD_SECONDS", "value": s.to_string() }));
                }
                let mut container = json!({
                    "name": c.name,
                    "image": self.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sh", "-c", SCRIPT],
                    "env": env,
                });
                match &self.claim {
                    _ if !c.uses_claim => {}
                    Some(ClaimSource::Limits(resource)) => {
                        container["resources"] = json!({ "limits": { resource: "1" } });
                    }
                    _ => container["resources"] = json!({ "claims": [{ "name": POD_CLAIM }] }),
                }
                container
            })
            .collect();
        pod(
            &self.name,
            &self.check,
            &self.node,
            self.claim.as_ref(),
            containers,
        )
    }
}

/// A probe pod: never restarted, no service account token, no DNS (the
/// probe needs none and a test cluster may have none), pinned to `node`
/// through the scheduler (which allocates its claim and reserves it for the
/// pod; a pod given a `nodeName` is refused the claim), tolerating every
/// taint, with `claim` as its pod claim [`POD_CLAIM`].
pub fn pod(
    name: &str,
    check: &str,
    node: &str,
    claim: Option<&ClaimSource>,
    containers: Vec<Value>,
) -> Value {
    let mut spec = json!({
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "automountServiceAccountToken": false,
        "dnsPolicy": "Default",
        "affinity": { "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{ "matchFields": [{
                "key": "metadata.name", "operator": "In", "values": [node]
            }] }]
        } } },
        "tolerations": [{ "operator": "Exists" }],
        "containers": containers,
    });
    let entry = match claim {
        Some(ClaimSource::Template(t)) => {
            Some(json!({ "name": POD_CLAIM, "resourceClaimTemplateName": t }))
        }
        Some(ClaimSource::Claim(c)) => Some(json!({ "name": POD_CLAIM, "resourceClaimName": c })),
        Some(ClaimSource::Limits(_)) | None => None,
    };
    if let Some(entry) = entry {
        spec["resourceClaims"] = json!([entry]);
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "labels": labels(check) },
        "spec": spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "RESULT: ACCELERATOR_COUNT=1
UUID: GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee
UUID-EXIT: 0
SMI-L: GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee)
SMI-L:   MIG 1g.5gb      Device  0: (UUID: MIG-cc04a385-500f-4314-8218-133a4f8051b2)
SMI-Q: GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee, NVIDIA A100-SXM4-40GB, 40960 MiB
HEALTH: OK
PROBE: DONE
";

    #[test]
    fn parses_probe_output() {
        let p = ProbeOutput::parse(LOG);
        assert_eq!(p.accelerator_count, Some(1));
        assert_eq!(
            p.gpu_uuids(),
            vec!["GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee"]
        );
        assert_eq!(p.listed_gpus(), p.gpu_uuids());
        assert_eq!(
            p.listed_migs(),
            vec!["MIG-cc04a385-500f-4314-8218-133a4f8051b2"]
        );
        assert_eq!(p.health, Some(Health::Ok));
        assert!(p.done);
        assert!(p.summary().contains("MIG: [MIG-cc04a385"));
    }

    #[test]
    fn parses_failures_and_missing_output() {
        let p = ProbeOutput::parse(
            "RESULT: ACCELERATOR_COUNT=0\nHEALTH: FAIL nvidia-smi not found in the container\n",
        );
        assert_eq!(p.accelerator_count, Some(0));
        assert_eq!(
            p.health,
            Some(Health::Fail("nvidia-smi not found in the container".into()))
        );
        assert!(!p.done);
        assert!(p.gpu_uuids().is_empty());
        let skip = ProbeOutput::parse("HEALTH: SKIP no claim in this container\n");
        assert_eq!(
            skip.health,
            Some(Health::Skip("no claim in this container".into()))
        );
        assert_eq!(ProbeOutput::parse("").accelerator_count, None);
    }

    #[test]
    fn query_errors_fall_back_to_the_list() {
        let p = ProbeOutput::parse(
            "UUID: Failed to initialize NVML: Unknown Error\nSMI-L: GPU 0: X (UUID: GPU-a)\n",
        );
        assert_eq!(p.gpu_uuids(), vec!["GPU-a"]);
    }

    #[test]
    fn builds_pods_with_claims_for_one_container() {
        let mut pod = ProbePod::single(
            "p",
            "c",
            "node-1",
            "img:1",
            Some(ClaimSource::Template("t".into())),
        );
        pod.containers.push(ProbeContainer {
            name: "plain".into(),
            uses_claim: false,
        });
        let v = pod.to_json();
        assert_eq!(
            v["spec"]["resourceClaims"][0]["resourceClaimTemplateName"],
            "t"
        );
        assert_eq!(
            v["spec"]["containers"][0]["resources"]["claims"][0]["name"],
            POD_CLAIM
        );
        assert!(v["spec"]["containers"][1].get("resources").is_none());
        assert_eq!(v["spec"]["containers"][1]["env"][0]["value"], "0");
        assert_eq!(v["spec"]["restartPolicy"], "Never");
        let term = &v["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0];
        assert_eq!(term["matchFields"][0]["values"][0], "node-1");
        // It parses as a Pod.
        let _: k8s_openapi::api::core::v1::Pod = serde_json::from_value(v).unwrap();
    }

    #[test]
    fn builds_claims() {
        let cap = BTreeMap::from([("memory".to_owned(), "20Gi".to_owned())]);
        let req = device_request("gpu", "gpu-shared.tessera.dev", &["x == 1".into()], &cap);
        let t = claim_template("t", "c", req.clone());
        assert_eq!(
            t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"],
            "20Gi"
        );
        let _: k8s_openapi::api::resource::v1::ResourceClaimTemplate =
            serde_json::from_value(t).unwrap();
        let c = claim("c1", "c", req);
        let _: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(c).unwrap();
    }
}
