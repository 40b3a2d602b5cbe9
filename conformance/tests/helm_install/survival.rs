//! An Isolated workload on the chart's install keeps its MPS daemon, and so
//! its limits, while the node process is SIGKILLed (the container restarts)
//! and while `helm upgrade` rolls the node pod; deleting the workload
//! afterwards stops the daemon. The workload probes what CUDA gives it
//! (`tessera probe`, answered by the simulated libcuda from the daemon it
//! reaches) once a second, in one container that must never restart.
//!
//! What would fail: a daemon that ends with the node container (the probe
//! then runs outside MPS and gets the whole GPU), a new node process that
//! restarts the daemon instead of adopting it (a new PID, and a fresh pipe
//! directory the running container does not have), a daemon that never
//! left the container's cgroup, and an adopted daemon that unprepare does
//! not stop.

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::{Value, json};
use tessera_conformance::artifacts::binaries;
use tessera_conformance::{TestNamespace, wait_for};
use tessera_driver::host::mps::ProcessId;
use tessera_driver::probe::ProbeReport;

use super::plugin_support::cluster::probe_image;
use super::{Helm, TIMEOUT, daemon_pods, logs, name, registered_daemon};

/// The workload, its claim and what it may use: 25 % of an H100's 132 SMs
/// (32, whole TPCs) and 4Gi, so 6Gi does not fit.
const POD: &str = "isolated-worker";
const SMS: i32 = 32;
const ALLOC: &str = "6Gi";
const PROBE: &str = "/probe/tessera";

/// One install of the chart, as `chart_case` made it.
pub struct Install<'a> {
    pub helm: &'a Helm,
    pub ns: &'a TestNamespace,
    pub release: &'a str,
    pub driver: &'a str,
    pub domain: &'a str,
    pub chart: &'a Path,
    pub values: &'a Path,
    /// The image tags of the install and of the upgrade.
    pub tags: (&'a str, &'a str),
    /// The chart's mpsDir on the host.
    pub mps_dir: &'a Path,
    /// The chart's mpsHostCgroup.
    pub cgroup: &'a str,
}

pub async fn run(install: &Install<'_>) -> Result<()> {
    let chart = install.chart.to_str().context("chart path")?;
    let values = install.values.to_str().context("values path")?;
    let (tag1, tag2) = install.tags;
    let pods: Api<Pod> = install.ns.api();
    install
        .helm
        .run(&[
            "install",
            install.release,
            chart,
            "-n",
            install.ns.name(),
            "-f",
            values,
        ])
        .await?;
    let first = registered_daemon(&pods, install.release, tag1).await?;

    // The workload, and what it gets before anything happens.
    let claims: Api<ResourceClaim> = install.ns.api();
    let pp = PostParams::default();
    claims.create(&pp, &claim(install.domain)?).await?;
    pods.create(&pp, &worker()?).await?;
    let (mut seen, report) = probe_after(&pods, 0).await?;
    check_limits(&report, "before")?;
    let uid = claims
        .get(POD)
        .await?
        .metadata
        .uid
        .context("claim without uid")?;
    let daemon = daemon_pid(install.mps_dir, &uid)?;
    check_cgroup(daemon, install.cgroup)?;
    let started = container_started(&pods).await?;
    eprintln!("isolated workload runs with daemon {daemon} ({SMS} SMs, {ALLOC} refused)");

    // SIGKILL of the node process: its container restarts, the workload and
    // its daemon do not.
    let plugin = node_process(install.driver)?;
    // SAFETY: the chart's node process of this test's own driver.
    ensure!(
        unsafe { libc::kill(plugin, libc::SIGKILL) } == 0,
        "killing node process {plugin}: {}",
        std::io::Error::last_os_error()
    );
    let first_name = name(&first);
    wait_for("the node container restarted", TIMEOUT, || async {
        let pod = pods.get(&first_name).await?;
        Ok((restarts(&pod) >= 1).then_some(()))
    })
    .await?;
    registered_daemon(&pods, install.release, tag1).await?;
    (seen, _) = still_isolated(&pods, install, &uid, daemon, &started, seen, "SIGKILL").await?;

    // helm upgrade: a new node pod replaces the old one.
    let tag_arg = format!("image.tag={tag2}");
    install
        .helm
        .run(&[
            "upgrade",
            install.release,
            chart,
            "-n",
            install.ns.name(),
            "-f",
            values,
            "--set",
            &tag_arg,
        ])
        .await?;
    registered_daemon(&pods, install.release, tag2).await?;
    wait_for("the old node pod gone", TIMEOUT, || async {
        let now = daemon_pods(&pods, install.release).await?;
        Ok((!now.iter().any(|(p, _)| name(p) == first_name)).then_some(()))
    })
    .await?;
    still_isolated(&pods, install, &uid, daemon, &started, seen, "helm upgrade").await?;

    // The new node process unprepares the claim: the adopted daemon stops.
    pods.delete(POD, &DeleteParams::default().grace_period(0))
        .await?;
    let claim_dir = install.mps_dir.join(&uid);
    wait_for("the workload's daemon stopped", TIMEOUT, || async {
        let gone = !claim_dir.exists() && !alive(daemon);
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}

/// After an event: the same daemon runs, the workload's container never
/// restarted, and a probe it ran afterwards still gets the claim's limits.
async fn still_isolated(
    pods: &Api<Pod>,
    install: &Install<'_>,
    uid: &str,
    daemon: i32,
    started: &str,
    seen: u64,
    event: &str,
) -> Result<(u64, ProbeReport)> {
    // A probe that started after the event: past every one printed so far.
    let printed = last_probe(&logs(pods, POD).await).max(seen);
    let (n, report) = probe_after(pods, printed).await?;
    check_limits(&report, event)?;
    ensure!(
        daemon_pid(install.mps_dir, uid)? == daemon && alive(daemon),
        "after {event} the claim's daemon is no longer {daemon}"
    );
    check_cgroup(daemon, install.cgroup)?;
    ensure!(
        container_started(pods).await? == started,
        "the workload's container restarted through {event}"
    );
    eprintln!("after {event}: daemon {daemon} kept, probe #{n} still gets {SMS} SMs");
    Ok((n, report))
}

fn claim(domain: &str) -> Result<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": POD },
        "spec": { "devices": { "requests": [{ "name": "share", "exactly": {
            "deviceClassName": format!("gpu-isolated.{domain}"),
            "capacity": { "requests": { "memory": "4Gi", "cores": "25" } },
        } }] } },
    }))?)
}

/// A workload that probes once a second, numbering its reports.
fn worker() -> Result<Pod> {
    let script = format!(
        "n=0; while true; do n=$((n+1)); echo \"PROBE $n $({PROBE} probe --alloc {ALLOC} | tr -d \
         '\\n')\"; sleep 1; done"
    );
    Ok(serde_json::from_value(json!({
        "metadata": { "name": POD },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "restartPolicy": "Never",
            "resourceClaims": [{ "name": "share", "resourceClaimName": POD }],
            "containers": [{
                "name": "main",
                "image": probe_image(),
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", script],
                "resources": { "claims": [{ "name": "share" }] },
                "volumeMounts": [{ "name": "probe", "mountPath": PROBE, "readOnly": true }],
            }],
            "volumes": [{ "name": "probe", "hostPath": {
                "path": binaries().tessera, "type": "File" } }],
        },
    }))?)
}

/// The number of the last probe line in `log` (0 without one).
fn last_probe(log: &str) -> u64 {
    log.lines()
        .filter_map(|l| l.strip_prefix("PROBE ")?.split(' ').next()?.parse().ok())
        .max()
        .unwrap_or(0)
}

/// The first probe report numbered above `after` (and its number).
async fn probe_after(pods: &Api<Pod>, after: u64) -> Result<(u64, ProbeReport)> {
    wait_for(&format!("a probe after #{after}"), TIMEOUT, || async {
        let pod = pods.get(POD).await?;
        if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed") {
            bail!("{POD} failed: {:?}", pod.status);
        }
        let log = logs(pods, POD).await;
        for line in log.lines() {
            let Some(rest) = line.strip_prefix("PROBE ") else {
                continue;
            };
            let (n, json) = rest.split_once(' ').unwrap_or((rest, ""));
            let n: u64 = n.parse().with_context(|| format!("probe line {line}"))?;
            if n > after {
                let report = serde_json::from_str(json)
                    .with_context(|| format!("probe #{n} printed no report: {line}"))?;
                return Ok(Some((n, report)));
            }
        }
        Ok(None)
    })
    .await
}

/// The claim's SMs, and an allocation over its memory refused.
fn check_limits(report: &ProbeReport, when: &str) -> Result<()> {
    let device = match report.devices.as_slice() {
        [d] => d,
        _ => bail!(
            "{when}: the probe sees {} devices: {report:?}",
            report.devices.len()
        ),
    };
    let refused = device.allocation.as_ref().is_some_and(|a| !a.ok);
    ensure!(
        device.multiprocessors == SMS && refused,
        "{when}: the workload got {} SMs and {ALLOC} {} (want {SMS} and refused): {report:?}",
        device.multiprocessors,
        if refused { "refused" } else { "allocated" },
    );
    Ok(())
}

/// The daemon records (`daemon.json`) of one claim's directory.
fn records(claim_dir: &Path) -> std::io::Result<Vec<Value>> {
    Ok(std::fs::read_dir(claim_dir)?
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("daemon.json")).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect())
}

/// The PID a record names.
fn recorded_pid(record: &Value) -> Option<i32> {
    record["daemon"]["pid"].as_i64().map(|p| p as i32)
}

/// The PID recorded for the claim's one daemon.
fn daemon_pid(mps_dir: &Path, uid: &str) -> Result<i32> {
    let records = records(&mps_dir.join(uid))
        .with_context(|| format!("no MPS daemon directory for claim {uid}"))?;
    match records.as_slice() {
        [r] => recorded_pid(r).with_context(|| format!("the record names no process: {r}")),
        _ => bail!("want one daemon for claim {uid}, found {records:?}"),
    }
}

fn alive(pid: i32) -> bool {
    ProcessId::of(pid).is_some()
}

/// The daemon is in the chart's host cgroup in every hierarchy, out of the
/// node pod's.
fn check_cgroup(pid: i32, cgroup: &str) -> Result<()> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let want = format!("/{cgroup}");
    let outside: Vec<&str> = text
        .lines()
        .filter(|l| l.splitn(3, ':').nth(2) != Some(want.as_str()))
        .collect();
    ensure!(
        outside.is_empty(),
        "daemon {pid} is not in {want} everywhere: {outside:?}"
    );
    Ok(())
}

/// The host PID of the chart's node process for `driver` (the pod runs in
/// the host's PID namespace).
fn node_process(driver: &str) -> Result<i32> {
    let flag = format!("--driver-name={driver}");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.contains(&b"plugin".as_slice()) && args.contains(&flag.as_bytes()) {
            found.push(pid);
        }
    }
    match found.as_slice() {
        [pid] => Ok(*pid),
        _ => bail!("want one node process with {flag}, found {found:?}"),
    }
}

fn restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or(0, |c| c.restart_count)
}

/// When the workload's container started (changes if it restarts).
async fn container_started(pods: &Api<Pod>) -> Result<String> {
    let pod = pods.get(POD).await?;
    ensure!(restarts(&pod) == 0, "{POD}'s container restarted");
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref()?.running.as_ref()?.started_at.as_ref())
        .map(|t| t.0.to_string())
        .context("the workload's container is not running")
}

/// The PIDs of the daemons recorded below `mps_dir` that still run.
pub fn daemons_left(mps_dir: &Path) -> Vec<i32> {
    std::fs::read_dir(mps_dir)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|claim| records(&claim.path()).unwrap_or_default())
        .filter_map(|r| recorded_pid(&r))
        .filter(|pid| alive(*pid))
        .collect()
}

/// Kills what the chart's node process left running (a daemon outlives
/// it by design) when the test could not wait for its unprepare.
pub fn kill_daemons_left(mps_dir: &Path) -> Vec<i32> {
    let left = daemons_left(mps_dir);
    for pid in &left {
        // SAFETY: a daemon this test's node process recorded.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    left
}

/// Removes the test's host cgroup (in every hierarchy) once no daemon is in
/// it; one still in use stays.
pub fn remove_cgroup(cgroup: &str) {
    let root = Path::new("/sys/fs/cgroup");
    let _ = std::fs::remove_dir(root.join(cgroup));
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let _ = std::fs::remove_dir(entry.path().join(cgroup));
    }
}
