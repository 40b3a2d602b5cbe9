//! The claim guard against a hostile tenant, with real pods on the real
//! kube-scheduler, kubelet and containerd, the GPU simulated.
//!
//! Two Isolated claims share one simulated H100: `neighbour` (8Gi / 50 %)
//! and `hostile` (4Gi / 25 %). The hostile Pod, once both are running:
//! 1. leaves MPS (its probe points `CUDA_MPS_PIPE_DIRECTORY` nowhere) and
//!    holds 70Gi with every SM: the node's guard must kill it (exit 137)
//!    and say so in a Warning Event on the Pod;
//! 2. runs three MPS clients that each hold 1800Mi, each within the
//!    daemon's per-process limit but 5.3Gi together against the claim's
//!    4Gi: exactly one must be killed, the two that fit must finish;
//! 3. fills its `/dev/shm`, which its claim's ShareConfig sets to 16Mi: it
//!    must get ENOSPC there, and a claim made afterwards must still
//!    prepare and run on the node.
//!
//! The neighbour's probe reports its own 66 SMs and an allocation of 6Gi
//! working before and after. The time from the trigger to the hostile
//! process's end is printed (an upper bound of the guard's reaction: it
//! includes the container's log path).
//!
//! Needs the cluster's containerd and a node process with the default
//! policy (MPS, guard enforcing): one already running is used unless its
//! policy names hami-core or report (then the test is skipped); else it is
//! started over `h100x8.yaml`, and stopped and removed after.

mod plugin_support;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::json;
use tessera_conformance::{
    ClusterEnv, TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};

use plugin_support::cluster::{
    PROBE, PodNode, cluster_env_vars, delete_pods, isolated_class_on, log_with, mps_gpu, probe_pod,
    probe_report,
};

const TOPOLOGY: &str = "h100x8.yaml";
const TIMEOUT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_that_leaves_mps_or_overfills_its_claim_loses_the_process() -> Result<()> {
    let env = ClusterEnv::from_env()?;
    let Some(node) = PodNode::start(&env, "what the guard does to its pods", TOPOLOGY, &[])? else {
        return Ok(());
    };
    let policy =
        std::fs::read_to_string(env.state_dir.join("node/policy.yaml")).unwrap_or_default();
    if policy.contains("hami-core") || policy.contains("action: report") {
        eprintln!("SKIP: the running node process's policy does not enforce Isolated with MPS");
        node.stop(&env);
        return Ok(());
    }
    let cluster = TestCluster::shared().await?;
    let id = unique_name("guard");
    let ns = cluster.create_namespace("claim-guard").await?;
    let trigger = tempfile::tempdir()?;

    let result = run(&env, &cluster, &ns, &node.driver, &id, trigger.path()).await;

    delete_pods(&ns).await;
    let _ = ns.delete().await;
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    let _ = delete_ignore_missing(&classes, &format!("{id}-isolated")).await;
    node.stop(&env);
    result
}

/// A shell line printing `tag` and the probe's report.
fn probe(tag: &str, args: &str) -> String {
    format!("echo \"{tag} $({PROBE} probe {args} | tr -d '\\n')\"")
}

/// The neighbour: probes, waits for `done`, probes again.
fn neighbour_script() -> String {
    [
        probe("PROBE", "--alloc 6Gi"),
        "echo ready".to_owned(),
        "while [ ! -e /trigger/done ]; do sleep 0.2; done".to_owned(),
        probe("AFTER", "--alloc 6Gi"),
        "echo checked".to_owned(),
        "exec sleep 3600".to_owned(),
    ]
    .join("; ")
}

/// The hostile tenant: waits for `go`, leaves MPS holding 70Gi, then runs
/// three clients that overfill its claim together.
fn hostile_script() -> String {
    let hold =
        |alloc: &str, seconds: u32| format!("{PROBE} probe --alloc {alloc} --busy {seconds}");
    [
        "echo ready".to_owned(),
        "while [ ! -e /trigger/go ]; do sleep 0.2; done".to_owned(),
        format!(
            "CUDA_MPS_PIPE_DIRECTORY=/nowhere {} >/dev/null 2>&1; echo \"LEFT rc=$?\"",
            hold("70Gi", 300)
        ),
        format!(
            "for i in 1 2 3; do ({} >/dev/null 2>&1; echo \"MEM$i rc=$?\") & done; wait",
            hold("1800Mi", 20)
        ),
        "echo MEMDONE".to_owned(),
        "dd if=/dev/zero of=/dev/shm/fill bs=1M count=64 2>&1; echo \"SHM rc=$?\"".to_owned(),
        "echo SHMDONE".to_owned(),
        "exec sleep 3600".to_owned(),
    ]
    .join("; ")
}

/// The MPS control daemons below `mps_dir` (their environment names a
/// pipe directory there and carries a launch id).
fn daemons_below(mps_dir: &str) -> Vec<i32> {
    let pipe = format!("CUDA_MPS_PIPE_DIRECTORY={mps_dir}/");
    let launch = format!("{}=", tessera_driver::host::mps::LAUNCH_ID_ENV);
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
            vars.iter().any(|v| v.starts_with(pipe.as_bytes()))
                && vars.iter().any(|v| v.starts_with(launch.as_bytes()))
        })
        .collect()
}

/// A daemon keeps only the capabilities MPS needs, for good, and sees
/// none of the node's own directories.
fn confined(pid: i32, node_dirs: &[String]) -> Result<()> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(str::trim)
            .with_context(|| format!("no {name} for daemon {pid}"))
    };
    let kept = tessera_driver::host::mps::kept_mask();
    for caps in ["CapEff", "CapBnd"] {
        let value = u64::from_str_radix(field(caps)?, 16)?;
        ensure!(
            value == kept,
            "daemon {pid}: {caps} {value:x}, want {kept:x}"
        );
    }
    ensure!(
        field("NoNewPrivs")? == "1",
        "daemon {pid} may gain privileges"
    );
    let root = format!("/proc/{pid}/root");
    let there: Vec<&String> = node_dirs.iter().filter(|d| Path::new(d).exists()).collect();
    ensure!(!there.is_empty(), "none of {node_dirs:?} is on the node");
    for dir in there {
        ensure!(
            !Path::new(&format!("{root}{dir}")).exists(),
            "daemon {pid} sees {dir}"
        );
    }
    Ok(())
}

/// SMs, and whether the allocation worked, on the one device the probe
/// printed after `tag` saw.
fn seen(log: &str, tag: &str) -> Result<(i32, bool)> {
    let report = probe_report(log, tag)?;
    ensure!(report.devices.len() == 1, "{tag} sees {report:?}");
    let d = &report.devices[0];
    let ok = d
        .allocation
        .as_ref()
        .map(|a| a.ok)
        .context("no allocation")?;
    Ok((d.multiprocessors, ok))
}

/// The exit status a line `<tag> rc=<n>` reports.
fn status(log: &str, tag: &str) -> Result<i32> {
    log.lines()
        .find_map(|l| l.strip_prefix(&format!("{tag} rc=")))
        .with_context(|| format!("no {tag} line in:\n{log}"))?
        .trim()
        .parse()
        .with_context(|| format!("{tag}: not a status"))
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
    let gpu = wait_for("an Isolated share published", TIMEOUT, || async {
        Ok(mps_gpu(cluster, node, driver).await.ok())
    })
    .await?;
    let pp = PostParams::default();
    let classes: Api<DeviceClass> = Api::all(cluster.client());
    let class = isolated_class_on(id, driver, &gpu)?;
    classes.create(&pp, &class).await?;
    let claims: Api<ResourceClaim> = ns.api();
    let pods: Api<Pod> = ns.api();
    let claim = |name: &str, memory: &str, cores: &str, shm: Option<&str>| {
        let config = shm.map(|size| {
            json!([{ "opaque": { "driver": driver, "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1",
                "kind": "ShareConfig",
                "sharedMemory": size,
            } } }])
        });
        serde_json::from_value::<ResourceClaim>(json!({
            "metadata": { "name": name },
            "spec": { "devices": {
                "requests": [{ "name": "gpu", "exactly": {
                    "deviceClassName": format!("{id}-isolated"),
                    "capacity": { "requests": { "memory": memory, "cores": cores } },
                } }],
                "config": config.unwrap_or_else(|| json!([])),
            } },
        }))
    };
    // Every claim before any pod, so that each is in the scheduler's cache
    // well before the pod that names it arrives.
    for (name, memory, cores, shm) in [
        ("neighbour", "8Gi", "50", None),
        ("hostile", "4Gi", "25", Some("16Mi")),
    ] {
        claims
            .create(&pp, &claim(name, memory, cores, shm)?)
            .await?;
    }
    for (name, script) in [
        ("neighbour", neighbour_script()),
        ("hostile", hostile_script()),
    ] {
        pods.create(&pp, &probe_pod(name, &script, trigger)?)
            .await?;
    }
    let before = log_with(&pods, "neighbour", "ready").await?;
    log_with(&pods, "hostile", "ready").await?;
    ensure!(
        seen(&before, "PROBE")? == (66, true),
        "the neighbour before: {before}"
    );

    // The claims' daemons are confined: few capabilities, no node state.
    let mps_dir = vars
        .get("TESSERA_NODE_MPS_DIR")
        .context("cluster.sh env has no TESSERA_NODE_MPS_DIR")?;
    let daemons = daemons_below(mps_dir);
    ensure!(
        daemons.len() >= 2,
        "want the daemons of both claims below {mps_dir}: {daemons:?}"
    );
    // The simulated driver root lies below the cluster's state directory,
    // so its parents are in the view (empty): what must not be is what the
    // node keeps there.
    let node_dirs = [
        env.state_dir.join("kubeconfig"),
        env.state_dir.join("node/state"),
        env.state_dir.join("node/cdi"),
        "/var/lib/kubelet".into(),
    ]
    .map(|p| p.display().to_string());
    for pid in daemons {
        confined(pid, &node_dirs)?;
    }

    // 1. Leaving MPS: killed.
    let go = Instant::now();
    std::fs::write(trigger.join("go"), "")?;
    let log = log_with(&pods, "hostile", "LEFT rc=").await?;
    let reaction = go.elapsed();
    eprintln!("the process that left MPS ended {reaction:?} after the trigger");
    ensure!(
        status(&log, "LEFT")? == 137,
        "the process that left MPS was not killed:\n{log}"
    );

    // 2. Three clients over the claim's memory together: one goes.
    let log = log_with(&pods, "hostile", "MEMDONE").await?;
    let statuses: Vec<i32> = (1..=3)
        .map(|i| status(&log, &format!("MEM{i}")))
        .collect::<Result<_>>()?;
    let killed = statuses.iter().filter(|s| **s == 137).count();
    let finished = statuses.iter().filter(|s| **s == 0).count();
    ensure!(
        killed == 1 && finished == 2,
        "want one of three clients killed and two finished: {statuses:?}\n{log}"
    );

    // 3. Its /dev/shm is its own 16Mi: full there, and the node still
    // prepares a claim made afterwards.
    let log = log_with(&pods, "hostile", "SHMDONE").await?;
    ensure!(
        status(&log, "SHM")? != 0 && log.contains("No space left on device"),
        "filling /dev/shm did not end in ENOSPC:\n{log}"
    );
    claims
        .create(&pp, &claim("late", "4Gi", "10", None)?)
        .await?;
    let late = format!(
        "{}; echo done; exec sleep 3600",
        probe("LATE", "--alloc 1Gi")
    );
    pods.create(&pp, &probe_pod("late", &late, trigger)?)
        .await?;
    let log = log_with(&pods, "late", "done").await?;
    ensure!(seen(&log, "LATE")?.1, "the late claim's probe: {log}");

    // The neighbour kept what it was given.
    std::fs::write(trigger.join("done"), "")?;
    let after = log_with(&pods, "neighbour", "checked").await?;
    ensure!(
        seen(&after, "AFTER")? == (66, true),
        "the neighbour after: {after}"
    );

    // Said on the Pod: both rules, naming the claim.
    let events: Api<Event> = ns.api();
    let said = wait_for("the guard's Events on the hostile Pod", TIMEOUT, || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await?;
            let mine: Vec<Event> = list
                .items
                .into_iter()
                .filter(|e| {
                    e.reason.as_deref() == Some("IsolatedClaimViolated")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("hostile")
                })
                .collect();
            let rules = |rule: &str| {
                mine.iter().any(|e| {
                    e.action.as_deref().is_some_and(|a| a.starts_with(rule))
                        && e.note.as_deref().is_some_and(|n| n.contains("hostile"))
                })
            };
            Ok((rules("left-mps") && rules("claim-memory")).then_some(mine))
        }
    })
    .await?;
    eprintln!(
        "Events: {:?}",
        said.iter().map(|e| e.note.clone()).collect::<Vec<_>>()
    );
    Ok(())
}
