//! `tessera publish` against the real API server and kube-scheduler of the
//! main local cluster (all DRA feature gates on): for every simulated
//! topology the published slices are stored exactly as computed and the
//! scheduler allocates from them as the device model says (whole GPU, MIG,
//! Isolated shares packing up to the GPU's memory, modes never mixed on one
//! GPU, oversized claims unschedulable with the scheduler's reason). Then
//! the publisher's life: restarts write nothing, held devices stay, a lost
//! GPU is reflected, deleted slices come back, refused writes back off.

mod slices;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use slices::suite::{self, H100X8, T4};
use slices::*;
use tessera_conformance::{delete_ignore_missing, wait_for};

#[tokio::test]
async fn full_model_t4() -> Result<()> {
    suite::full_model(&Cluster::full().await?, suite::T4).await
}

#[tokio::test]
async fn full_model_l4x2() -> Result<()> {
    suite::full_model(&Cluster::full().await?, suite::L4X2).await
}

#[tokio::test]
async fn full_model_a100x2_mig() -> Result<()> {
    suite::full_model(&Cluster::full().await?, suite::A100X2_MIG).await
}

#[tokio::test]
async fn full_model_h100x8() -> Result<()> {
    suite::full_model(&Cluster::full().await?, suite::H100X8).await
}

#[tokio::test]
async fn full_model_h100x8_mig() -> Result<()> {
    suite::full_model(&Cluster::full().await?, suite::H100X8_MIG).await
}

/// h100x8.yaml with its fourth GPU (`gpu-3`) fallen off the bus.
fn h100x8_gpu3_lost() -> Result<PathBuf> {
    let text = std::fs::read_to_string(topology(H100X8.file))?;
    let lost_uuid = "GPU-3da2dd85-937c-4b64-b132-90c221b248d8";
    let mut changed = 0;
    let text: String = text
        .lines()
        .map(|l| {
            if l.contains(lost_uuid) && l.trim_end().ends_with('}') {
                changed += 1;
                format!(
                    "{}, lost: true }}\n",
                    l.trim_end().trim_end_matches('}').trim_end()
                )
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    ensure!(
        changed == 1,
        "did not find GPU {lost_uuid} in {}",
        H100X8.file
    );
    Ok(scratch_file("h100x8-gpu3-lost.yaml", &text))
}

/// Restart with the same inventory: zero writes. A policy that stops
/// offering an allocated device keeps it published. A lost GPU disappears,
/// the others keep their numbers.
#[tokio::test]
async fn restart_held_devices_and_lost_gpu() -> Result<()> {
    let cluster = Cluster::full().await?;
    let mut pool = Pool::new(&cluster, "life", H100X8.file).await?;
    let result = lifecycle(&mut pool).await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("node {}", pool.node))?;
    cleanup
}

async fn lifecycle(pool: &mut Pool) -> Result<()> {
    let first = pool.publish_once()?;
    ensure!(
        first.writes() == (5, 0, 0),
        "first publish: {}",
        first.report
    );
    suite::restart_writes_nothing(pool).await?;

    // A claim holds gpu-5; the policy then stops offering whole GPUs.
    let gpus = pool.device_gpus().await?;
    let gpu5 = gpus.get("gpu-5").context("gpu-5 not published")?.clone();
    let pin = format!("{} == {gpu5:?}", pool.attr("uuid"));
    let claim = pool
        .request("held", &pool.class("gpu"), &[pin], &[])
        .await?;
    ensure!(
        pool.allocated(&claim).await?.device == "gpu-5",
        "claim did not get gpu-5"
    );
    pool.policy = Some(scratch_file(
        &format!("{}-no-whole.yaml", pool.id),
        "gpus:\n  - select: {all: true}\n    modes: [mig, isolated, shared]\n",
    ));
    let republished = pool.publish_once()?;
    ensure!(
        republished.report["result"]["heldDevices"] == 1 && republished.generation() == 2,
        "policy change: {}",
        republished.report
    );
    let devices = pool.device_gpus().await?;
    ensure!(
        devices.contains_key("gpu-5"),
        "the held whole GPU was dropped from the slices"
    );
    ensure!(
        !devices.contains_key("gpu-0") && devices.contains_key("gpu-0-isolated"),
        "the policy change was not applied"
    );
    suite::restart_writes_nothing(pool).await?;
    pool.release(std::slice::from_ref(&claim)).await?;
    let released = pool.publish_once()?;
    ensure!(
        released.report["result"]["heldDevices"] == 0
            && !pool.device_gpus().await?.contains_key("gpu-5"),
        "gpu-5 still published after its claim went: {}",
        released.report
    );

    // GPU 3 is lost: its devices and counter set go, every other GPU keeps
    // its number (gpu-4 stays gpu-4). 7 x 29 devices still need four
    // device slices of 64 besides the counter slice: none is deleted.
    pool.policy = None;
    let before = pool.device_gpus().await?;
    let lost = h100x8_gpu3_lost()?;
    let changed = pool.publish_once_on(&lost)?;
    let (_, _, deletes) = changed.writes();
    ensure!(
        changed.slices() == 5 && deletes == 0 && changed.generation() == released.generation() + 1,
        "lost GPU: {}",
        changed.report
    );
    let slices = pool.slices().await?;
    ensure!(
        slices.len() == 5,
        "{} slices after losing a GPU",
        slices.len()
    );
    ensure!(
        slices
            .iter()
            .all(|s| s.spec.pool.generation == changed.generation()
                && s.spec.pool.resource_slice_count == 5),
        "pool generation/count inconsistent after the change"
    );
    let after = device_gpus(&slices, &pool.driver);
    ensure!(
        !after
            .keys()
            .any(|d| d == "gpu-3" || d.starts_with("gpu-3-")),
        "gpu-3 devices still published"
    );
    let counter_sets: Vec<&str> = slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .map(|c| c.name.as_str())
        .collect();
    ensure!(
        !counter_sets.contains(&"gpu-3") && counter_sets.len() == 7,
        "counter sets {counter_sets:?}"
    );
    // (`before` was published without whole GPUs: compare by share device.)
    for n in [0, 1, 2, 4, 5, 6, 7] {
        let card = before
            .get(&format!("gpu-{n}-isolated"))
            .context("share device missing before")?;
        for name in [format!("gpu-{n}"), format!("gpu-{n}-isolated")] {
            ensure!(
                after.get(&name) == Some(card),
                "{name} changed GPU: {card} -> {:?}",
                after.get(&name)
            );
        }
    }
    // And restarting on the changed machine writes nothing again.
    suite::restart_writes_nothing(&pool.with_topology(lost)).await?;
    Ok(())
}

/// The daemon notices when someone deletes one of its slices and restores
/// the pool (new generation everywhere) within seconds; it does not write
/// otherwise.
#[tokio::test]
async fn daemon_restores_deleted_slice() -> Result<()> {
    let cluster = Cluster::full().await?;
    let pool = Pool::new(&cluster, "daemon", T4.file).await?;
    let result = daemon_run(&pool).await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("node {}", pool.node))?;
    cleanup
}

async fn daemon_run(pool: &Pool) -> Result<()> {
    let mut daemon = Daemon::start(pool, &[])?;
    let published = wait_for(
        "the daemon's first slices",
        Duration::from_secs(60),
        || async {
            let s = pool.slices().await?;
            Ok((s.len() == 2 && s.iter().all(|s| s.spec.pool.generation == 1)).then_some(s))
        },
    )
    .await
    .with_context(|| daemon.log())?;
    daemon.check_running()?;
    let victim = published[1]
        .metadata
        .name
        .clone()
        .context("unnamed slice")?;
    delete_ignore_missing(
        &Api::<ResourceSlice>::all(pool.cluster.client.clone()),
        &victim,
    )
    .await?;
    wait_for(
        "the deleted slice restored",
        Duration::from_secs(30),
        || async {
            let s = pool.slices().await?;
            Ok((s.len() == 2
                && s.iter()
                    .any(|s| s.metadata.name.as_deref() == Some(victim.as_str()))
                && s.iter().all(|s| s.spec.pool.generation == 2))
            .then_some(()))
        },
    )
    .await
    .with_context(|| daemon.log())?;
    daemon.check_running()?;
    daemon.stop().await?;
    let log = daemon.log();
    let writes = log.matches("published 2 slices").count();
    ensure!(
        writes == 2,
        "expected exactly 2 publishing passes (start, repair), saw {writes}:\n{log}"
    );
    Ok(())
}

/// The API server refuses our slices (a ValidatingAdmissionPolicy): the
/// one-shot run fails with the server's reason; the daemon logs it and
/// retries with growing delays, and publishes once the refusal is lifted.
#[tokio::test]
async fn refused_writes_back_off() -> Result<()> {
    let cluster = Cluster::full().await?;
    let pool = Pool::new(&cluster, "refused", T4.file).await?;
    let name = pool.id.clone();
    let result = refused_run(&pool, &name).await;
    let client = cluster.client.clone();
    let _ = delete_ignore_missing(
        &Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()),
        &name,
    )
    .await;
    let _ = delete_ignore_missing(&Api::<ValidatingAdmissionPolicy>::all(client), &name).await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("node {}", pool.node))?;
    cleanup
}

const REFUSAL: &str = "tessera test refuses these slices";

async fn refused_run(pool: &Pool, name: &str) -> Result<()> {
    let client = pool.cluster.client.clone();
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": { "resourceRules": [{
                "apiGroups": ["resource.k8s.io"], "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"], "resources": ["resourceslices"],
            }]},
            "validations": [{
                "expression": format!("object.spec.driver != {:?}", pool.driver),
                "message": REFUSAL,
            }],
        },
    }))?;
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await?;
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "policyName": name, "validationActions": ["Deny"] },
    }))?;
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    // The policy takes effect once the API server has loaded it.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let probe: ResourceSlice = serde_json::from_value(json!({
        "metadata": { "name": format!("{name}-vap-probe") },
        "spec": { "driver": pool.driver, "nodeName": pool.node,
                  "pool": { "name": pool.node, "generation": 0, "resourceSliceCount": 1 }, "devices": [] },
    }))?;
    let dry = PostParams {
        dry_run: true,
        field_manager: None,
    };
    wait_for(
        "the admission policy in force",
        Duration::from_secs(60),
        || async {
            match slices.create(&dry, &probe).await {
                Ok(_) => Ok(None),
                Err(kube::Error::Api(s)) if s.message.contains(REFUSAL) => Ok(Some(())),
                Err(e) => Err(e.into()),
            }
        },
    )
    .await?;

    // One shot (capabilities given, so only the real write meets the policy).
    let out = tessera_command(
        &pool.topology,
        &[
            "publish",
            "--once",
            "--capabilities",
            "full",
            "--node-name",
            &pool.node,
            "--driver-name",
            &pool.driver,
            "--kubeconfig",
            &pool.cluster.kubeconfig.display().to_string(),
        ],
    )
    .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "publish --once succeeded against a refusing server"
    );
    ensure!(
        stderr.contains("rejected slice") && stderr.contains(REFUSAL),
        "the server's reason is not reported:\n{stderr}"
    );

    // The daemon: at least four attempts, each after a longer delay.
    let mut daemon = Daemon::start(pool, &["--capabilities", "full"])?;
    let delays = wait_for("four refused attempts", Duration::from_secs(60), || async {
        let log = daemon.log();
        let delays: Vec<Duration> = log
            .lines()
            .filter(|l| l.contains(REFUSAL))
            .filter_map(|l| {
                l.rsplit("retrying in ")
                    .next()
                    .and_then(parse_debug_duration)
            })
            .collect();
        Ok((delays.len() >= 4).then_some(delays))
    })
    .await
    .with_context(|| daemon.log())?;
    daemon.check_running()?;
    ensure!(
        delays.windows(2).take(3).all(|w| w[1] > w[0]) && delays[3] >= delays[0] * 4,
        "retries do not back off: {delays:?}"
    );
    ensure!(pool.slices().await?.is_empty(), "refused slices exist");

    // Lift the refusal: the next retry publishes.
    delete_ignore_missing(&Api::<ValidatingAdmissionPolicyBinding>::all(client), name).await?;
    wait_for(
        "slices after the refusal is lifted",
        Duration::from_secs(90),
        || async { Ok((pool.slices().await?.len() == 2).then_some(())) },
    )
    .await
    .with_context(|| daemon.log())?;
    daemon.stop().await
}

/// `1.5s`, `512.3ms`, `20µs` (Rust's `Debug` for `Duration`).
fn parse_debug_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !(c.is_ascii_digit() || c == '.'))?);
    let n: f64 = num.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "ms" => n / 1e3,
        "µs" | "us" => n / 1e6,
        "ns" => n / 1e9,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

#[test]
fn debug_durations_parse() {
    assert_eq!(
        parse_debug_duration("1.5s"),
        Some(Duration::from_millis(1500))
    );
    assert_eq!(
        parse_debug_duration("512ms"),
        Some(Duration::from_millis(512))
    );
    assert_eq!(parse_debug_duration("later"), None);
}

/// The server's capabilities change under running claims (the publisher is
/// told what the server serves with `--capabilities`): a held device stays
/// published and the real scheduler never gets a whole GPU or another mode
/// beside it. Isolated share on GPU 0: full -> consumable capacity only
/// (the share device stays, alone) -> full again (the share, allocated
/// while it had no counters, now has them and the scheduler charges them)
/// -> legacy (the share cannot be represented: GPU 0 offers nothing). A
/// replica on GPU 1: legacy -> full (only the held replica stays).
#[tokio::test]
async fn capability_flips_under_held_devices() -> Result<()> {
    let cluster = Cluster::full().await?;
    let mut pool = Pool::new(&cluster, "flip", suite::L4X2.file).await?;
    pool.policy = Some(scratch_file(
        &format!("{}-static-isolated.yaml", pool.id),
        "gpus:\n  - select: {all: true}\n    static: {mode: isolated, replicas: 2}\n",
    ));
    let result = capability_flips(&pool).await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("node {}", pool.node))?;
    cleanup
}

async fn capability_flips(pool: &Pool) -> Result<()> {
    let publish = |caps: &str| pool.publish_once_with(&pool.topology, &["--capabilities", caps]);
    let pin = |gpu: &str| format!("{} == {gpu:?}", pool.attr("uuid"));
    // Work devices: every GPU also has its monitoring device, which
    // consumes nothing and only adminAccess claims get.
    let on_gpu = |devices: &BTreeMap<String, String>, gpu: &str| {
        devices
            .iter()
            .filter(|(d, g)| g.as_str() == gpu && !d.ends_with("-monitor"))
            .map(|(d, _)| d.clone())
            .collect::<BTreeSet<String>>()
    };

    publish("full")?;
    let devices = pool.device_gpus().await?;
    let gpu0 = devices.get("gpu-0").context("gpu-0 not published")?.clone();
    let gpu1 = devices.get("gpu-1").context("gpu-1 not published")?.clone();

    // An Isolated share on GPU 0, in the full model.
    let share = pool
        .request(
            "iso",
            &pool.class("gpu-isolated"),
            &[pin(&gpu0)],
            &[("memory", "1Gi")],
        )
        .await?;
    ensure!(pool.allocated(&share).await?.device == "gpu-0-isolated");

    // Consumable capacity only: the share device stays, nothing else on GPU 0.
    publish("consumable-only")?;
    let devices = pool.device_gpus().await?;
    ensure!(
        on_gpu(&devices, &gpu0) == BTreeSet::from(["gpu-0-isolated".to_string()]),
        "consumable-only: GPU 0 publishes {:?}",
        on_gpu(&devices, &gpu0)
    );
    let whole0 = pool
        .request_refused("whole-0", &pool.class("gpu"), &[pin(&gpu0)], &[])
        .await?;
    let second = pool
        .request(
            "iso-2",
            &pool.class("gpu-isolated"),
            &[pin(&gpu0)],
            &[("memory", "1Gi")],
        )
        .await?;
    ensure!(pool.allocated(&second).await?.device == "gpu-0-isolated");

    // Full again: `second` was allocated while the device had no counters;
    // the scheduler charges them now, so neither a whole GPU nor a Shared
    // share fits on GPU 0.
    publish("full")?;
    let devices = pool.device_gpus().await?;
    ensure!(
        devices.contains_key("gpu-0") && devices.contains_key("gpu-0-isolated"),
        "full: {devices:?}"
    );
    let mut pending = vec![whole0.clone()];
    pending.push(
        pool.request_refused("whole-0-full", &pool.class("gpu"), &[pin(&gpu0)], &[])
            .await?,
    );
    pending.push(
        pool.request_refused(
            "shared-0-full",
            &pool.class("gpu-shared"),
            &[pin(&gpu0)],
            &[],
        )
        .await?,
    );
    pool.still_refused(&whole0).await?;

    // Legacy: the share device cannot be represented, GPU 0 offers nothing;
    // GPU 1 gets its static replicas.
    publish("legacy")?;
    let devices = pool.device_gpus().await?;
    ensure!(
        on_gpu(&devices, &gpu0).is_empty(),
        "legacy: GPU 0 publishes {:?}",
        on_gpu(&devices, &gpu0)
    );
    ensure!(
        on_gpu(&devices, &gpu1)
            == BTreeSet::from([
                "gpu-1-isolated-0".to_string(),
                "gpu-1-isolated-1".to_string()
            ]),
        "legacy: GPU 1 publishes {:?}",
        on_gpu(&devices, &gpu1)
    );
    pending.push(
        pool.request_refused("whole-0-legacy", &pool.class("gpu"), &[pin(&gpu0)], &[])
            .await?,
    );
    let replica = pool
        .request("replica", &pool.class("gpu-isolated"), &[pin(&gpu1)], &[])
        .await?;
    let replica_device = pool.allocated(&replica).await?.device;
    ensure!(replica_device.starts_with("gpu-1-isolated-"));

    // Full with a held replica: GPU 1 keeps exactly it.
    publish("full")?;
    let devices = pool.device_gpus().await?;
    ensure!(
        on_gpu(&devices, &gpu1) == BTreeSet::from([replica_device.clone()]),
        "full: GPU 1 publishes {:?}",
        on_gpu(&devices, &gpu1)
    );
    pending.push(
        pool.request_refused("whole-1", &pool.class("gpu"), &[pin(&gpu1)], &[])
            .await?,
    );
    pending.push(
        pool.request_refused(
            "iso-1",
            &pool.class("gpu-isolated"),
            &[pin(&gpu1)],
            &[("memory", "1Gi")],
        )
        .await?,
    );
    for name in &pending {
        pool.still_refused(name).await?;
    }

    // Everything released (the refused claims first, or they would take
    // the freed devices): both GPUs get the full model back.
    pool.release(&pending).await?;
    pool.release(&[share, second, replica]).await?;
    publish("full")?;
    let devices = pool.device_gpus().await?;
    for name in ["gpu-0", "gpu-0-shared", "gpu-1", "gpu-1-isolated"] {
        ensure!(devices.contains_key(name), "{name} not back: {devices:?}");
    }
    Ok(())
}
