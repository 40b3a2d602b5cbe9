//! `tessera-conformance --only admin-access-class` against the real API
//! server (no kubelet needed: the check reads claims, runs no pods). A
//! monitoring claim written the way other drivers document it (admin access
//! on the whole-GPU class) fails the check, which names the claim, the field
//! and the monitoring class as the fix; with only the monitoring class asked
//! for admin access it passes; without the monitoring class it is skipped.
//!
//! The driver name is the test's own, so the claims other tests leave on
//! the shared API server never match its classes.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use tessera_api::classes::ADMIN_ACCESS_LABEL;
use tessera_conformance::{TestCluster, delete_ignore_missing, unique_name};

/// What the run printed, and its exit code.
struct SuiteRun {
    code: Option<i32>,
    output: String,
}

async fn run_check(kubeconfig: &Path, driver: &str) -> Result<SuiteRun> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tessera-conformance"));
    command
        .arg("--kubeconfig")
        .arg(kubeconfig)
        // No pod runs: any node name does.
        .args(["--driver", driver, "--node", "no-node"])
        .args(["--only", "admin-access-class", "--timeout", "60s"]);
    let out = tokio::task::spawn_blocking(move || command.output())
        .await?
        .context("running tessera-conformance")?;
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{output}");
    Ok(SuiteRun {
        code: out.status.code(),
        output,
    })
}

fn admin_claim(name: &str, class: &str) -> Result<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": class, "allocationMode": "All",
                                         "adminAccess": true}},
        ]}},
    }))?)
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_access_on_a_work_class_fails_the_check_naming_the_fix() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let ns = cluster.create_namespace("admin-class").await?;
    let id = unique_name("adm");
    let driver = format!("gpu.{id}.tessera.dev");
    let whole = format!("gpu.{id}.tessera.dev");
    let monitor = format!("gpu-monitor.{id}.tessera.dev");
    let classes: Api<DeviceClass> = Api::all(cluster.client());

    let result = async {
        let kubeconfig = cluster.kubeconfig();
        Api::<Namespace>::all(cluster.client())
            .patch(
                ns.name(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {ADMIN_ACCESS_LABEL: "true"}}})),
            )
            .await?;
        let claims: Api<ResourceClaim> = ns.api();
        claims
            .create(&PostParams::default(), &admin_claim("dcgm", &whole)?)
            .await
            .context("admin access on the whole-GPU class")?;
        claims
            .create(&PostParams::default(), &admin_claim("agent", &monitor)?)
            .await
            .context("admin access on the monitoring class")?;

        // No monitoring class: nothing to point the claim at.
        let skipped = run_check(kubeconfig, &driver).await?;
        ensure!(skipped.code == Some(0), "without {monitor}: exit {:?}", skipped.code);
        ensure!(
            skipped.output.contains(&format!("DeviceClass {monitor} does not exist")),
            "without {monitor} the check must say it is skipped"
        );

        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": monitor},
            "spec": {"selectors": [{"cel": {"expression": format!(
                "device.driver == \"{driver}\" && device.attributes[\"{driver}\"].type == \"monitor\""
            )}}]},
        }))?;
        classes.create(&PostParams::default(), &class).await?;

        let failed = run_check(kubeconfig, &driver).await?;
        ensure!(failed.code == Some(1), "with claim dcgm: exit {:?}", failed.code);
        for part in [
            format!(
                "claim {}/dcgm: spec.devices.requests[0].exactly.adminAccess: request `gpus` asks \
                 work class {whole} for admin access",
                ns.name()
            ),
            format!(
                "fix: set spec.devices.requests[0].exactly.deviceClassName to {monitor} and keep \
                 adminAccess: true"
            ),
        ] {
            ensure!(failed.output.contains(&part), "the run does not say {part:?}");
        }
        ensure!(
            !failed.output.contains(&format!("{}/agent", ns.name())),
            "the monitoring claim is named as wrong"
        );

        delete_ignore_missing(&claims, "dcgm").await?;
        let passed = run_check(kubeconfig, &driver).await?;
        ensure!(passed.code == Some(0), "with claim agent only: exit {:?}", passed.code);
        ensure!(
            passed.output.contains(&format!(
                "asks a work class of {driver} for admin access; 1 request(s) ask {monitor} for it"
            )),
            "the pass must count the monitoring claim"
        );
        Ok(())
    }
    .await;

    delete_ignore_missing(&classes, &monitor).await?;
    ns.delete().await?;
    result
}
