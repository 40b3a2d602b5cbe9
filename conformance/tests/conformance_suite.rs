//! `tessera-conformance` against the local cluster: the binary runs every
//! KAR-0003 check on the kubelet's node, where Tessera's node process serves
//! simulated GPUs (an A100 with MIG instances beside one without MIG), and
//! exits 0; its JUnit and Markdown reports name every check.
//!
//! Pods must really run for the checks that read what a pod saw, so the
//! test needs the cluster's real container runtime (`cluster.sh env`
//! exports `TESSERA_CONTAINER_RUNTIME=containerd`); with the fake CRI it is
//! skipped with a message.
//!
//! The node: a node process already running on the cluster (started by
//! `cluster.sh node-start`) is used with its driver name; otherwise the test
//! starts one over `a100-40gb-x2-mig.yaml` and stops and removes it after.
//! The DeviceClasses of the driver's domain are created when missing (and
//! removed after if the test created them).

mod plugin_support;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use tessera_conformance::suite::CHECKS;
use tessera_conformance::{ClusterEnv, TestCluster, delete_ignore_missing};

use plugin_support::cluster::{cluster_sh, container_runtime, node_running};
use plugin_support::repo_root;
use tessera_test_kit::cluster::ClusterState;

const TOPOLOGY: &str = "a100-40gb-x2-mig.yaml";
const CHECK_TIMEOUT: &str = "180s";

async fn ensure_classes(api: &Api<DeviceClass>, driver: &str) -> Result<Vec<String>> {
    let mut created = Vec::new();
    for (name, expr) in tessera_conformance::suite::facts::tessera_classes(driver) {
        if api.get_opt(&name).await?.is_some() {
            continue;
        }
        let class: DeviceClass = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": { "name": name },
            "spec": { "selectors": [{ "cel": { "expression": expr } }] }
        }))?;
        api.create(&PostParams::default(), &class).await?;
        created.push(name);
    }
    Ok(created)
}

fn run_suite(env: &ClusterEnv, driver: &str, out_dir: &Path) -> Result<(String, String)> {
    let junit = out_dir.join("junit.xml");
    let report = out_dir.join("report.md");
    let output = Command::new(env!("CARGO_BIN_EXE_tessera-conformance"))
        .arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .args([
            "--driver",
            driver,
            "--node",
            &env.node_name,
            "--timeout",
            CHECK_TIMEOUT,
        ])
        .arg("--junit")
        .arg(&junit)
        .arg("--report")
        .arg(&report)
        // The probe image the cluster imported (busybox + glibc), if it says.
        .args(
            std::env::var("TESSERA_PROBE_IMAGE")
                .ok()
                .filter(|i| !i.is_empty())
                .map(|i| vec!["--image".to_owned(), i])
                .unwrap_or_default(),
        )
        .output()
        .context("running tessera-conformance")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stderr}\n{stdout}");
    ensure!(
        output.status.code() == Some(0),
        "tessera-conformance exited with {}:\n{stdout}",
        output.status
    );
    Ok((
        std::fs::read_to_string(&junit).context("reading the JUnit report")?,
        std::fs::read_to_string(&report).context("reading the Markdown report")?,
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn conformance_suite_passes_on_the_local_cluster() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    if env.kubelet.is_none() {
        eprintln!("SKIP: the cluster runs without a kubelet (TESSERA_KUBELET=0)");
        return Ok(());
    }
    let runtime = container_runtime(&env);
    if runtime != "containerd" {
        eprintln!(
            "SKIP: the cluster's kubelet runs the {runtime} CRI, where pods never execute; \
             tessera-conformance reads what each pod saw, so it needs \
             TESSERA_CONTAINER_RUNTIME=containerd (real containers)"
        );
        return Ok(());
    }
    let cluster = TestCluster::shared().await?;
    let started_node = !node_running(&env);
    if started_node {
        let topology = repo_root()
            .join("driver/fake-nvml/topologies")
            .join(TOPOLOGY);
        let topology = topology.to_str().context("topology path")?;
        if env.state_dir.join("node/node.env").exists() {
            cluster_sh(&env, &["node-start"])?;
        } else {
            cluster_sh(&env, &["node-start", "--topology", topology])?;
        }
    }
    let driver = ClusterState::new(&env.state_dir).node_driver();
    let api: Api<DeviceClass> = Api::all(cluster.client());
    let created = ensure_classes(&api, &driver).await?;
    let out_dir = tempfile::tempdir()?;

    let result = tokio::task::spawn_blocking({
        let env = env.clone();
        let driver = driver.clone();
        let dir = out_dir.path().to_owned();
        move || run_suite(&env, &driver, &dir)
    })
    .await?;

    for name in &created {
        let _ = delete_ignore_missing(&api, name).await;
    }
    if started_node {
        let _ = cluster_sh(&env, &["node-stop"]);
        let _ = std::fs::remove_dir_all(env.state_dir.join("node"));
    }
    let (junit, markdown) = result?;
    for (id, _) in CHECKS {
        ensure!(
            junit.contains(&format!("name=\"{id}\"")),
            "the JUnit report does not name check {id}:\n{junit}"
        );
        ensure!(
            markdown.contains(&format!("| `{id}` |")),
            "the Markdown report does not name check {id}:\n{markdown}"
        );
    }
    ensure!(
        junit.contains("failures=\"0\""),
        "JUnit reports failures:\n{junit}"
    );
    Ok(())
}
