//! `tessera webhook` against the real API server: a ValidatingWebhookConfiguration
//! points the API server at the webhook (HTTPS on loopback, a CA made with
//! the openssl CLI for this test), and creates of ResourceClaims and
//! ResourceClaimTemplates with a bad opaque config for the driver are
//! refused at create time with prepare's words and the field path, while
//! good configs, other drivers' configs and claims without a config for the
//! driver are admitted unchanged.
//!
//! A second test takes the chart's own ValidatingWebhookConfiguration
//! (`helm template`), pointed at the webhook on loopback: a claim and a
//! template that ask a work class for admin access (a monitoring claim as
//! other drivers document it) are refused with the monitoring class as the
//! fix, the monitoring class itself is admitted, and with the webhook gone
//! the chart's matchConditions still keep claims that are none of its
//! business from waiting on it.
//!
//! Other tests share the API server: the configuration only selects this
//! test's namespace (a label no other namespace has), and the webhook checks
//! a driver name no other test uses.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde::Deserialize;
use serde_json::{Value, json};
use tessera_api::classes::{ADMIN_ACCESS_LABEL, work_class_admin_access};
use tessera_api::config::{API_VERSION, decode_value};
use tessera_conformance::artifacts::binaries;
use tessera_conformance::procs::run;
use tessera_conformance::tls::{Certificates, serving_certificate};
use tessera_conformance::{TestCluster, delete_ignore_missing, unique_name, wait_for};
use tessera_test_kit::repo_root;

const TIMEOUT: Duration = Duration::from_secs(60);
/// The label that scopes the webhook configuration to this test's namespace.
const SCOPE_LABEL: &str = "tessera.dev/webhook-test";

/// The running `tessera webhook`; killed on drop.
struct Webhook {
    child: Child,
    log: PathBuf,
}

impl Webhook {
    fn start(dir: &Path, certs: &Certificates, driver: &str) -> Result<Self> {
        let log = dir.join("webhook.log");
        let out = std::fs::File::create(&log)?;
        let child = Command::new(&binaries().tessera)
            .args([
                "webhook",
                "--driver-name",
                driver,
                "--listen",
                "127.0.0.1:0",
            ])
            .arg("--tls-cert-file")
            .arg(&certs.cert)
            .arg("--tls-private-key-file")
            .arg(&certs.key)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting tessera webhook")?;
        Ok(Webhook { child, log })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The port it bound, from its log line `serving admission reviews on
    /// https://<address>/validate`.
    async fn port(&mut self) -> Result<u16> {
        const MARK: &str = "serving admission reviews on https://";
        wait_for("the webhook's address in its log", TIMEOUT, || {
            let exited = self.child.try_wait();
            let log = self.log();
            async move {
                if let Some(status) = exited? {
                    bail!("tessera webhook exited ({status}); log:\n{log}");
                }
                Ok(log.split_once(MARK).and_then(|(_, rest)| {
                    let address = rest.split_once("/validate")?.0;
                    address
                        .parse::<std::net::SocketAddr>()
                        .ok()
                        .map(|a| a.port())
                }))
            }
        })
        .await
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn claim(name: &str, config: Value) -> Result<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}],
            "config": config,
        }},
    }))?)
}

fn template(name: &str, config: Value) -> Result<ResourceClaimTemplate> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}],
            "config": config,
        }}},
    }))?)
}

fn opaque(driver: &str, parameters: Value) -> Value {
    json!({"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}})
}

/// The message of a refused create, or an error if it was admitted.
fn refusal<T>(what: &str, result: kube::Result<T>) -> Result<String> {
    match result {
        Ok(_) => bail!("{what} was admitted"),
        Err(kube::Error::Api(status)) => Ok(status.message),
        Err(e) => Err(e).context(what.to_owned()),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_configs_are_refused_at_create_time() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let client = cluster.client();
    let ns = cluster.create_namespace("webhook").await?;
    let dir = tempfile::tempdir()?;
    let driver = format!("{}.tessera.dev", unique_name("hook"));
    let configs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let config_name = unique_name("tessera-webhook-test");

    let result = async {
        Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .patch(
                ns.name(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {SCOPE_LABEL: ns.name()}}})),
            )
            .await?;
        let certs = serving_certificate(dir.path(), "IP:127.0.0.1")?;
        let mut webhook = Webhook::start(dir.path(), &certs, &driver)?;
        let port = webhook.port().await?;

        let mut configuration: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": config_name},
            "webhooks": [{
                "name": format!("claims.{driver}"),
                "clientConfig": {"url": format!("https://127.0.0.1:{port}/validate")},
                "rules": [{
                    "operations": ["CREATE", "UPDATE"],
                    "apiGroups": ["resource.k8s.io"],
                    "apiVersions": ["v1"],
                    "resources": ["resourceclaims", "resourceclaimtemplates"],
                    "scope": "Namespaced",
                }],
                "namespaceSelector": {"matchLabels": {SCOPE_LABEL: ns.name()}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            }],
        }))?;
        configuration.webhooks.as_mut().unwrap()[0].client_config.ca_bundle =
            Some(ByteString(std::fs::read(&certs.ca)?));
        configs
            .create(&PostParams::default(), &configuration)
            .await
            .context("creating the ValidatingWebhookConfiguration")?;

        let claims: Api<ResourceClaim> = ns.api();
        let templates: Api<ResourceClaimTemplate> = ns.api();
        let bad_strategy =
            json!({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "Bogus"}});

        // The API server picks up new configurations asynchronously: a dry
        // run of a claim the webhook must deny, until it is denied.
        let last = Mutex::new(String::from("admitted"));
        let probe = claim("probe", json!([opaque(&driver, bad_strategy.clone())]))?;
        let dry_run = PostParams {
            dry_run: true,
            ..Default::default()
        };
        wait_for("the webhook to be called by the API server", TIMEOUT, || async {
            match claims.create(&dry_run, &probe).await {
                Err(kube::Error::Api(s)) if s.message.contains("denied the request") => {
                    Ok(Some(()))
                }
                Ok(_) => Ok(None),
                Err(e) => {
                    *last.lock().unwrap() = e.to_string();
                    Ok(None)
                }
            }
        })
        .await
        .with_context(|| {
            format!(
                "last answer: {}; webhook log:\n{}",
                last.lock().unwrap(),
                webhook.log()
            )
        })?;

        // A claim with a bad config for the driver (after another driver's
        // config, so the path names entry 1).
        let bad = claim(
            "bad",
            json!([opaque("net.example.com", json!({"anything": "goes"})), opaque(&driver, bad_strategy.clone())]),
        )?;
        let message = refusal("the claim with a bad config", claims.create(&PostParams::default(), &bad).await)?;
        println!("refused: {message}");
        let problem = decode_value(&bad_strategy).unwrap_err();
        let want = format!(
            "claim {}/bad: spec.devices.config[1].opaque.parameters.sharing.strategy: {}; fix: {}",
            ns.name(),
            problem.message,
            problem.fix
        );
        ensure!(message.contains(&want), "refusal {message:?} does not contain {want:?}");
        ensure!(claims.get_opt("bad").await?.is_none(), "the refused claim exists");

        // A template likewise, with an unknown kind.
        let unknown_kind = json!({"apiVersion": API_VERSION, "kind": "GPUConfig"});
        let message = refusal(
            "the template with a bad config",
            templates
                .create(&PostParams::default(), &template("bad-template", json!([opaque(&driver, unknown_kind.clone())]))?)
                .await,
        )?;
        let problem = decode_value(&unknown_kind).unwrap_err();
        let want = format!(
            "claim template {}/bad-template: spec.spec.devices.config[0].opaque.parameters.kind: {}; fix: {}",
            ns.name(),
            problem.message,
            problem.fix
        );
        ensure!(message.contains(&want), "refusal {message:?} does not contain {want:?}");

        // Good configs are admitted and stored as written.
        let good = json!({"apiVersion": API_VERSION, "kind": "GpuConfig",
                          "sharing": {"strategy": "MPS", "mps": {"memory": "4Gi", "computePercent": 50}}});
        let created = claims
            .create(&PostParams::default(), &claim("good", json!([opaque(&driver, good.clone())]))?)
            .await
            .context("a claim with a good config")?;
        let stored = serde_json::to_value(&created)?;
        ensure!(
            stored["spec"]["devices"]["config"][0]["opaque"]["parameters"] == good,
            "the stored config differs from the one written: {stored}"
        );
        templates
            .create(&PostParams::default(), &template("good-template", json!([opaque(&driver, good)]))?)
            .await
            .context("a template with a good config")?;

        // Another driver's config is none of the webhook's business, nor is
        // a claim without a config for the driver.
        claims
            .create(
                &PostParams::default(),
                &claim("other", json!([opaque("net.example.com", json!({"kind": "GPUConfig", "x": 1}))]))?,
            )
            .await
            .context("a claim with another driver's config")?;
        claims
            .create(&PostParams::default(), &claim("plain", json!([]))?)
            .await
            .context("a claim without config")?;

        // A metadata update of an admitted claim is admitted.
        claims
            .patch(
                "good",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
            )
            .await
            .context("labelling an admitted claim")?;
        let log = webhook.log();
        ensure!(log.contains("denied: claim"), "the webhook logged no denial:\n{log}");
        Ok(())
    }
    .await;

    delete_ignore_missing(&configs, &config_name).await?;
    ns.delete().await?;
    result
}

/// The chart's ValidatingWebhookConfiguration for `driver`, as `helm
/// template` renders it with the webhook enabled.
fn chart_configuration(state_dir: &Path, driver: &str) -> Result<Value> {
    let helm = run(
        Command::new(repo_root().join("conformance/cluster/image.sh"))
            .arg("helm")
            .env("TESSERA_CLUSTER_DIR", state_dir),
    )?;
    let yaml = run(Command::new(helm.trim())
        .args(["template", "tessera"])
        .arg(repo_root().join("deploy/helm/tessera"))
        .args(["--namespace", "tessera-system"])
        .args(["--set", &format!("driverName={driver}")])
        .args(["--set", "webhook.enabled=true"])
        .args(["--set", "webhook.tls.secretName=unused"])
        // Replaced by the test's CA below.
        .args(["--set", "webhook.tls.caBundle=Cg=="])
        .args(["--show-only", "templates/webhook.yaml"]))?;
    for doc in serde_yaml::Deserializer::from_str(&yaml) {
        let object = Value::deserialize(doc)?;
        if object["kind"] == "ValidatingWebhookConfiguration" {
            return Ok(object);
        }
    }
    bail!("the chart rendered no ValidatingWebhookConfiguration:\n{yaml}")
}

/// A claim spec with one request of `class`, with admin access or without.
fn admin_spec(class: &str, admin: bool) -> Value {
    json!({"devices": {"requests": [
        {"name": "gpus", "exactly": {"deviceClassName": class, "allocationMode": "All",
                                     "adminAccess": admin}},
    ]}})
}

fn admin_claim(name: &str, class: &str, admin: bool) -> Result<ResourceClaim> {
    Ok(serde_json::from_value(
        json!({"metadata": {"name": name}, "spec": admin_spec(class, admin)}),
    )?)
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_access_on_a_work_class_is_refused_by_the_charts_webhook() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let client = cluster.client();
    let ns = cluster.create_namespace("webhook-admin").await?;
    let dir = tempfile::tempdir()?;
    let id = unique_name("hook");
    let driver = format!("gpu.{id}.tessera.dev");
    let domain = format!("{id}.tessera.dev");
    let configs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let config_name = unique_name("tessera-webhook-admin-test");

    let result = async {
        // Admin access needs the namespace's label, or the API server
        // refuses the claims before any webhook sees them.
        Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .patch(
                ns.name(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {
                    SCOPE_LABEL: ns.name(), ADMIN_ACCESS_LABEL: "true"}}})),
            )
            .await?;
        let certs = serving_certificate(dir.path(), "IP:127.0.0.1")?;
        let mut webhook = Webhook::start(dir.path(), &certs, &driver)?;
        let port = webhook.port().await?;

        let rendered = {
            let (state, d) = (cluster.state_dir().to_owned(), driver.clone());
            tokio::task::spawn_blocking(move || chart_configuration(&state, &d)).await??
        };
        let mut configuration = rendered;
        configuration["metadata"] = json!({"name": config_name});
        for hook in configuration["webhooks"].as_array_mut().context("no webhooks")? {
            ensure!(
                hook["matchConditions"].as_array().is_some_and(|c| !c.is_empty()),
                "the chart's webhook has no matchConditions: {hook}"
            );
            hook["clientConfig"] = json!({"url": format!("https://127.0.0.1:{port}/validate")});
            hook["namespaceSelector"] = json!({"matchLabels": {SCOPE_LABEL: ns.name()}});
            hook["failurePolicy"] = json!("Fail");
        }
        let mut configuration: ValidatingWebhookConfiguration =
            serde_json::from_value(configuration)?;
        for hook in configuration.webhooks.iter_mut().flatten() {
            hook.client_config.ca_bundle = Some(ByteString(std::fs::read(&certs.ca)?));
        }
        configs
            .create(&PostParams::default(), &configuration)
            .await
            .context("creating the chart's ValidatingWebhookConfiguration")?;

        let claims: Api<ResourceClaim> = ns.api();
        let templates: Api<ResourceClaimTemplate> = ns.api();
        let whole = format!("gpu.{domain}");
        let monitor = format!("gpu-monitor.{domain}");

        // The API server picks up new configurations asynchronously.
        let last = Mutex::new(String::from("admitted"));
        let probe = admin_claim("probe", &whole, true)?;
        let dry_run = PostParams { dry_run: true, ..Default::default() };
        wait_for("the webhook to be called by the API server", TIMEOUT, || async {
            match claims.create(&dry_run, &probe).await {
                Err(kube::Error::Api(s)) if s.message.contains("denied the request") => Ok(Some(())),
                Ok(_) => Ok(None),
                Err(e) => {
                    *last.lock().unwrap() = e.to_string();
                    Ok(None)
                }
            }
        })
        .await
        .with_context(|| {
            format!("last answer: {}; webhook log:\n{}", last.lock().unwrap(), webhook.log())
        })?;

        // A monitoring claim as other drivers document it.
        let message = refusal(
            "admin access on the whole-GPU class",
            claims.create(&PostParams::default(), &admin_claim("dcgm", &whole, true)?).await,
        )?;
        println!("refused: {message}");
        let label = format!("claim {}/dcgm", ns.name());
        let want = work_class_admin_access(&driver, &label, &admin_spec(&whole, true)["devices"], "spec.devices");
        ensure!(want.len() == 1, "expected one problem, got {want:?}");
        ensure!(message.contains(&want[0].to_string()), "refusal {message:?} does not contain {:?}", want[0].to_string());
        for part in [
            format!("{label}: spec.devices.requests[0].exactly.adminAccess: "),
            format!("work class {whole}"),
            format!("set spec.devices.requests[0].exactly.deviceClassName to {monitor} and keep adminAccess: true"),
            format!("{ADMIN_ACCESS_LABEL}: \"true\""),
        ] {
            ensure!(message.contains(&part), "refusal {message:?} does not say {part:?}");
        }

        // A template on the MIG class likewise, under spec.spec.
        let template: ResourceClaimTemplate = serde_json::from_value(json!({
            "metadata": {"name": "agents"},
            "spec": {"spec": admin_spec(&format!("mig.{domain}"), true)},
        }))?;
        let message = refusal(
            "a template with admin access on the MIG class",
            templates.create(&PostParams::default(), &template).await,
        )?;
        ensure!(
            message.contains(&format!(
                "claim template {}/agents: spec.spec.devices.requests[0].exactly.adminAccess: "
            , ns.name())) && message.contains(&format!("deviceClassName to {monitor}")),
            "refusal {message:?}"
        );

        // The fix is admitted, and so is work on the work class.
        claims
            .create(&PostParams::default(), &admin_claim("monitor", &monitor, true)?)
            .await
            .context("admin access on the monitoring class")?;
        claims
            .create(&PostParams::default(), &admin_claim("work", &whole, false)?)
            .await
            .context("the whole-GPU class without admin access")?;

        // With the webhook gone and failurePolicy Fail, only what the
        // chart's matchConditions send it is refused: the rest never
        // waited on it.
        drop(webhook);
        let unreachable = refusal(
            "admin access on the whole-GPU class without the webhook",
            claims.create(&dry_run, &admin_claim("dcgm", &whole, true)?).await,
        )?;
        ensure!(
            unreachable.contains("failed calling webhook"),
            "with the webhook gone: {unreachable:?}"
        );
        for (name, class, admin) in [
            ("other-driver", "gpu.example.com", true),
            ("monitor-2", monitor.as_str(), true),
            ("work-2", whole.as_str(), false),
        ] {
            claims
                .create(&dry_run, &admin_claim(name, class, admin)?)
                .await
                .with_context(|| format!("{class} (admin access {admin}) with the webhook gone"))?;
        }
        Ok(())
    }
    .await;

    delete_ignore_missing(&configs, &config_name).await?;
    ns.delete().await?;
    result
}
