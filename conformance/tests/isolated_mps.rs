//! Isolated shares against a hostile tenant, through the real kube-scheduler,
//! kubelet and containers, measured by `tessera probe` (what a CUDA process
//! really gets, answered by the simulated libcuda from the machine state and
//! the MPS rules).
//!
//! Two Pods hold Isolated shares of one simulated H100 (132 SMs): `small`
//! 4Gi / 25 %, `large` 8Gi / 50 %. Each claim gets its own MPS control
//! daemon and pipe directory. Each Pod's probe reports its own SMs (32, 66)
//! and memory; raising its environment gains `small` nothing (the limits
//! are the daemon's); no container has the MPS control tool or another
//! claim's pipe directory. When `small`'s daemon is made to quit (what any
//! process holding its pipe directory can do), `large`'s daemon and limits
//! are untouched. Deleting the Pods stops both daemons.
//!
//! Needs the cluster's containerd and a node process with the default
//! policy (MPS): one already running is used unless its policy names
//! hami-core (then the test is skipped); else it is started over
//! `h100x8.yaml`, and stopped and removed after.

mod plugin_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::{Value, json};
use tessera_conformance::{
    ClusterEnv, TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};
use tessera_driver::probe::ProbeReport;

use plugin_support::cluster::{
    PROBE, cluster_env_vars, cluster_sh, container_runtime, delete_pods, isolated_class_on,
    log_with, mps_gpu, node_running, probe_pod, probe_report,
};
use plugin_support::repo_root;
use tessera_test_kit::cluster::ClusterState;

const TOPOLOGY: &str = "h100x8.yaml";
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);
/// More than `small` may pin (4Gi), less than `large` (8Gi).
const ALLOC: &str = "6Gi";

#[tokio::test(flavor = "multi_thread")]
async fn two_isolated_pods_get_their_own_daemons_and_a_hostile_one_gains_nothing() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    if env.kubelet.is_none() || container_runtime(&env) != "containerd" {
        eprintln!("SKIP: pods do not execute on this cluster (no kubelet, or not containerd)");
        return Ok(());
    }
    let node_dir = env.state_dir.join("node");
    let started_node = !node_running(&env);
    if started_node {
        if node_dir.join("node.env").exists() {
            cluster_sh(&env, &["node-start"])?;
        } else {
            let topology = repo_root()
                .join("driver/fake-nvml/topologies")
                .join(TOPOLOGY);
            let topology = topology.to_str().context("topology path")?;
            cluster_sh(&env, &["node-start", "--topology", topology])?;
        }
    }
    if std::fs::read_to_string(node_dir.join("policy.yaml"))
        .unwrap_or_default()
        .contains("hami-core")
    {
        eprintln!("SKIP: the running node process's policy names hami-core, not MPS");
        return Ok(());
    }
    let driver = ClusterState::new(&env.state_dir).node_driver();
    let cluster = TestCluster::shared().await?;
    let id = unique_name("mps");
    let ns = cluster.create_namespace("isolated-mps").await?;
    let trigger = tempfile::tempdir()?;

    let result = run(&env, &cluster, &ns, &driver, &id, trigger.path()).await;

    // Unprepared before the node process may stop.
    delete_pods(&ns).await;
    let _ = ns.delete().await;
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    let _ = delete_ignore_missing(&classes, &format!("{id}-isolated")).await;
    if started_node {
        let _ = cluster_sh(&env, &["node-stop"]);
        let _ = std::fs::remove_dir_all(&node_dir);
    }
    result
}

/// A Pod of `claim` that probes what CUDA gives it, then again with its
/// limits raised in its environment, then waits for `go` in the trigger
/// directory and probes once more.
fn pod(name: &str, trigger: &Path) -> Result<Pod> {
    let probe = |tag: &str, env: &str| {
        format!("echo \"{tag} $({env} {PROBE} probe --alloc {ALLOC} | tr -d '\\n')\"")
    };
    let script = [
        probe("PROBE", ""),
        probe(
            "RAISED",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80G",
        ),
        "command -v nvidia-cuda-mps-control >/dev/null && echo has-mps-control || echo no-mps-control"
            .to_owned(),
        "echo \"pipe=$CUDA_MPS_PIPE_DIRECTORY\"".to_owned(),
        "echo ready".to_owned(),
        "while [ ! -e /trigger/go ]; do sleep 0.2; done".to_owned(),
        probe("AFTER", ""),
        "echo checked".to_owned(),
        "exec sleep 3600".to_owned(),
    ]
    .join("; ");
    probe_pod(name, &script, trigger)
}

/// SMs, whether the allocation of [`ALLOC`] worked, on the one device seen.
fn seen(report: &ProbeReport) -> Result<(i32, bool)> {
    ensure!(
        report.devices.len() == 1,
        "the probe sees {} devices: {report:?}",
        report.devices.len()
    );
    let d = &report.devices[0];
    let allocated = d.allocation.as_ref().map(|a| a.ok);
    Ok((
        d.multiprocessors,
        allocated.context("no allocation result")?,
    ))
}

/// `claim uid -> daemon records` below the node's MPS directory.
fn daemons(mps_dir: &Path, uid: &str) -> Vec<Value> {
    let dir = mps_dir.join(uid);
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("daemon.json")).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect()
}

async fn run(
    env: &ClusterEnv,
    cluster: &TestCluster,
    ns: &TestNamespace,
    driver: &str,
    id: &str,
    trigger: &Path,
) -> Result<()> {
    let vars = cluster_env_vars(env)?;
    let node = vars
        .get("TESSERA_NODE_NAME")
        .context("cluster.sh env has no TESSERA_NODE_NAME")?;
    let mps_dir = PathBuf::from(
        vars.get("TESSERA_NODE_MPS_DIR")
            .context("cluster.sh env has no TESSERA_NODE_MPS_DIR")?,
    );
    let gpu = wait_for("an Isolated share published", TIMEOUT, || async {
        Ok(mps_gpu(cluster, node, driver).await.ok())
    })
    .await?;

    let pp = PostParams::default();
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    // Both claims on one GPU: the class selects its Isolated share.
    let class = isolated_class_on(id, driver, &gpu)?;
    classes.create(&pp, &class).await?;
    let claims: Api<ResourceClaim> = ns.api();
    let pods: Api<Pod> = ns.api();
    for (name, memory, cores) in [("small", "4Gi", "25"), ("large", "8Gi", "50")] {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": {
                "deviceClassName": format!("{id}-isolated"),
                "capacity": { "requests": { "memory": memory, "cores": cores } },
            } }] } },
        }))?;
        claims.create(&pp, &claim).await?;
        pods.create(&pp, &pod(name, trigger)?).await?;
    }
    let small_log = log_with(&pods, "small", "ready").await?;
    let large_log = log_with(&pods, "large", "ready").await?;
    eprintln!("small printed:\n{small_log}\nlarge printed:\n{large_log}");

    // Each claim: its own daemon, pipe directory and limits.
    let uid = |name: &'static str| {
        let claims = claims.clone();
        async move {
            claims
                .get(name)
                .await?
                .metadata
                .uid
                .context("claim without uid")
        }
    };
    let (small_uid, large_uid) = (uid("small").await?, uid("large").await?);
    let (small_daemons, large_daemons) =
        (daemons(&mps_dir, &small_uid), daemons(&mps_dir, &large_uid));
    ensure!(
        small_daemons.len() == 1 && large_daemons.len() == 1,
        "want one daemon per claim: small {small_daemons:?}, large {large_daemons:?}"
    );
    let pid = |d: &Value| d["daemon"]["pid"].as_i64();
    ensure!(
        pid(&small_daemons[0]).is_some() && pid(&small_daemons[0]) != pid(&large_daemons[0]),
        "the claims share a daemon: {small_daemons:?} {large_daemons:?}"
    );
    for (log, uid) in [(&small_log, &small_uid), (&large_log, &large_uid)] {
        ensure!(
            log.contains(&format!("pipe={}/{uid}/", mps_dir.display())),
            "the pod's pipe directory is not its own claim's:\n{log}"
        );
        ensure!(
            log.contains("no-mps-control"),
            "a workload container got the MPS control tool:\n{log}"
        );
    }

    // What CUDA gives each: 25 % of 132 SMs is 32 (whole TPCs), 50 % is 66;
    // 6Gi fits in large's 8Gi and not in small's 4Gi.
    ensure!(
        seen(&probe_report(&small_log, "PROBE")?)? == (32, false),
        "small: {:?}",
        probe_report(&small_log, "PROBE")?
    );
    ensure!(
        seen(&probe_report(&large_log, "PROBE")?)? == (66, true),
        "large: {:?}",
        probe_report(&large_log, "PROBE")?
    );
    // Raising the environment gains nothing: the limits are the daemon's.
    ensure!(
        seen(&probe_report(&small_log, "RAISED")?)? == (32, false),
        "small with its limits raised in its environment: {:?}",
        probe_report(&small_log, "RAISED")?
    );

    // small's daemon is made to quit through its pipe directory, as any
    // process holding it can; large's daemon and limits stay.
    let control = tessera_test_kit::artifacts::fake_mps_control();
    let small_pipe = std::fs::read_dir(mps_dir.join(&small_uid))?
        .flatten()
        .map(|e| e.path().join("pipe"))
        .find(|p| p.is_dir())
        .context("small's pipe directory")?;
    let mut quit = Command::new(control)
        .env("CUDA_MPS_PIPE_DIRECTORY", &small_pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    std::io::Write::write_all(&mut quit.stdin.take().context("stdin")?, b"quit\n")?;
    ensure!(quit.wait()?.success(), "quit was not taken");
    let small_pid = pid(&small_daemons[0]).context("small's daemon")? as i32;
    wait_for("small's daemon to quit", TIMEOUT, || async move {
        Ok(std::fs::metadata(format!("/proc/{small_pid}"))
            .is_err()
            .then_some(()))
    })
    .await?;
    std::fs::write(trigger.join("go"), "")?;
    let large_log = log_with(&pods, "large", "checked").await?;
    ensure!(
        seen(&probe_report(&large_log, "AFTER")?)? == (66, true),
        "large after small's daemon quit: {:?}",
        probe_report(&large_log, "AFTER")?
    );
    ensure!(
        pid(&daemons(&mps_dir, &large_uid)[0]) == pid(&large_daemons[0]),
        "large's daemon changed when small's quit"
    );

    // Deleting the Pods unprepares the claims: both daemons stop.
    for name in ["small", "large"] {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await?;
    }
    let large_pid = pid(&large_daemons[0]).context("large's daemon")? as i32;
    let mps = mps_dir.clone();
    wait_for("both claims' daemons to stop", TIMEOUT, || {
        let mps = mps.clone();
        let (s, l) = (small_uid.clone(), large_uid.clone());
        async move {
            let gone = !mps.join(&s).exists()
                && !mps.join(&l).exists()
                && std::fs::metadata(format!("/proc/{large_pid}")).is_err();
            Ok(gone.then_some(()))
        }
    })
    .await?;
    Ok(())
}
