//! `tessera-conformance` fails, naming the problem, against broken drivers
//! (see `broken_driver`): a prepare that returns no CDI ids, a CDI spec that
//! exposes every GPU, and slices without shared counters. Each driver gets a
//! name of its own, so the runs never share a pool with other tests.

mod broken_driver;
mod plugin_support;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use tessera_conformance::{ClusterEnv, TestCluster, delete_ignore_missing, unique_name};

use broken_driver::{Fault, FaultyPlugin};
use plugin_support::{PluginDirs, PluginOptions, PluginProcess, binaries, connect, register};

/// What `tessera-conformance --only <checks>` printed, and its exit code.
struct SuiteRun {
    code: Option<i32>,
    output: String,
}

/// `timeout` per check: pods that must run get the kubelet's retry of a
/// prepare that raced the Node authorizer (about 10 s after binding, more
/// under load).
fn run_suite(env: &ClusterEnv, driver: &str, only: &str, timeout: &str) -> Result<SuiteRun> {
    let image =
        std::env::var("TESSERA_PROBE_IMAGE").unwrap_or_else(|_| "tessera.local/probe:1".into());
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-conformance"))
        .arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .args(["--driver", driver, "--node", &env.node_name, "--only", only])
        .args(["--timeout", timeout, "--image", &image])
        .output()
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

/// Tessera's DeviceClasses for `driver`.
async fn create_classes(cluster: &TestCluster, driver: &str) -> Result<Vec<String>> {
    let api: Api<DeviceClass> = Api::all(cluster.client());
    let mut names = Vec::new();
    for (name, expression) in tessera_conformance::suite::facts::tessera_classes(driver) {
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "selectors": [{ "cel": { "expression": expression } }] }
        }))?;
        api.create(&PostParams::default(), &class).await?;
        names.push(name);
    }
    Ok(names)
}

async fn delete_classes(cluster: &TestCluster, names: &[String]) {
    let api: Api<DeviceClass> = Api::all(cluster.client());
    for n in names {
        let _ = delete_ignore_missing(&api, n).await;
    }
}

fn expect_failure(run: &SuiteRun, check: &str, problem: &str) -> Result<()> {
    ensure!(
        run.code == Some(1),
        "tessera-conformance exited {:?} against a broken driver, expected 1:\n{}",
        run.code,
        run.output
    );
    ensure!(
        run.output.contains(check) && run.output.contains(problem),
        "the output does not name check {check} and the problem ({problem}):\n{}",
        run.output
    );
    Ok(())
}

/// Tessera behind a kubelet plugin that spoils prepare's answer.
async fn with_faulty_prepare(
    fault: impl FnOnce(&PluginDirs) -> Fault,
    problem: &str,
) -> Result<()> {
    let env = ClusterEnv::from_env()?;
    let Some(kubelet) = env.kubelet.clone() else {
        eprintln!("SKIP: the cluster runs without a kubelet (TESSERA_KUBELET=0)");
        return Ok(());
    };
    let cluster = TestCluster::shared().await?;
    let driver = format!("gpu.{}.tessera.test", unique_name("bd"));
    let dirs = PluginDirs::for_kubelet(&kubelet)?;
    // Registers nowhere the kubelet looks: the faulty plugin is the driver.
    let mut plugin = PluginProcess::start(
        &dirs,
        &PluginOptions {
            node: env.node_name.clone(),
            driver: driver.clone(),
            kubeconfig: env.kubeconfig.clone(),
            kubelet: None,
            topology: plugin_support::topology_path(),
            args: Vec::new(),
            log: "plugin.log".into(),
            events: None,
        },
    )?;
    let upstream = register(&dirs, &mut plugin, &driver).await?;
    let channel = connect(Path::new(&upstream.info.endpoint)).await?;
    let faulty = FaultyPlugin::start(&kubelet, &driver, channel, fault(&dirs)).await?;
    let classes = create_classes(&cluster, &driver).await?;

    let run = tokio::task::spawn_blocking({
        let env = env.clone();
        let driver = driver.clone();
        move || run_suite(&env, &driver, "secure-one-device", "180s")
    })
    .await?;

    drop(faulty);
    delete_classes(&cluster, &classes).await;
    let _ = plugin.terminate().await;
    expect_failure(&run?, "secure-one-device", problem)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prepare_without_cdi_ids_fails_secure_access() -> Result<()> {
    with_faulty_prepare(
        |_| Fault::NoCdiIds,
        "sees 0 /dev/nvidia[0-9]* device nodes, expected 1",
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cdi_spec_exposing_every_gpu_fails_secure_access() -> Result<()> {
    with_faulty_prepare(
        |dirs| Fault::AllGpus {
            cdi_dir: dirs.cdi(),
            dev_root: dirs.driver_root().join("dev"),
        },
        "sees 8 /dev/nvidia[0-9]* device nodes, expected 1",
    )
    .await
}

/// The node's model as `tessera slices` computes it, for `driver`.
fn offline_slices(node: &str, driver: &str) -> Result<Vec<Value>> {
    let b = binaries();
    let out = Command::new(&b.tessera)
        .arg("--nvml-library")
        .arg(&b.fake_nvml)
        .args([
            "slices",
            "--node-name",
            node,
            "--driver-name",
            driver,
            "-o",
            "json",
        ])
        .env(
            "TESSERA_FAKE_NVML_TOPOLOGY",
            plugin_support::topology_path(),
        )
        .env(
            "TESSERA_FAKE_NVML_STATE",
            tempfile::tempdir()?.path().join("nvml.state"),
        )
        .output()?;
    ensure!(
        out.status.success(),
        "tessera slices: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(match v {
        Value::Array(items) => items,
        other => other["items"].as_array().cloned().unwrap_or_default(),
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn slices_without_shared_counters_fail_over_allocation() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    if env.kubelet.is_none() {
        eprintln!("SKIP: the cluster runs without a kubelet (TESSERA_KUBELET=0)");
        return Ok(());
    }
    let cluster = TestCluster::shared().await?;
    let driver = format!("gpu.{}.tessera.test", unique_name("bc"));
    // Published by a broken publisher; no plugin serves them, the check
    // only needs the scheduler's decisions.
    let api: Api<ResourceSlice> = Api::all(cluster.client());
    for slice in broken_driver::strip_counters(offline_slices(&env.node_name, &driver)?) {
        let slice: ResourceSlice = serde_json::from_value(slice)?;
        api.create(&PostParams::default(), &slice).await?;
    }
    let classes = create_classes(&cluster, &driver).await?;

    let run = tokio::task::spawn_blocking({
        let env = env.clone();
        let driver = driver.clone();
        // The fillers never start (no plugin): only the wait for their output uses it up.
        move || run_suite(&env, &driver, "over-allocation-blocked", "60s")
    })
    .await?;

    delete_classes(&cluster, &classes).await;
    api.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().fields(&format!("spec.driver={driver}")),
    )
    .await?;
    expect_failure(&run?, "over-allocation-blocked", "shared counters")
}
