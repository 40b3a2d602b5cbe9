//! The scheduler scenarios, run per simulated topology in the full model
//! (all DRA gates on) and in the static mode of an older API server.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::ResourceSlice;

use super::*;

/// A simulated machine and what the tests expect of it.
#[derive(Debug, Clone, Copy)]
pub struct Topology {
    pub file: &'static str,
    /// A MIG profile a claim can get in the full model (dynamic placement or
    /// existing instance), if any.
    pub mig_full: Option<&'static str>,
    /// A MIG profile that exists as an instance (static mode), if any.
    pub mig_static: Option<&'static str>,
}

pub const T4: Topology = Topology {
    file: "t4.yaml",
    mig_full: None,
    mig_static: None,
};
pub const L4X2: Topology = Topology {
    file: "l4x2.yaml",
    mig_full: None,
    mig_static: None,
};
/// GPU 0 has MIG instances 3g.20gb + 2g.10gb + 1g.5gb; GPU 1 (Ampere, MIG
/// off) cannot switch without a reset.
pub const A100X2_MIG: Topology = Topology {
    file: "a100-40gb-x2-mig.yaml",
    mig_full: Some("3g.20gb"),
    mig_static: Some("3g.20gb"),
};
/// Hopper with MIG off: every placement is offered dynamically.
pub const H100X8: Topology = Topology {
    file: "h100x8.yaml",
    mig_full: Some("3g.40gb"),
    mig_static: None,
};
/// Instances on GPUs 0-6, GPU 7 in MIG mode without instances.
pub const H100X8_MIG: Topology = Topology {
    file: "h100x8-mig.yaml",
    mig_full: Some("3g.40gb"),
    mig_static: Some("3g.40gb"),
};

/// Devices of one kind on the published slices: (name, gpu uuid).
fn devices_where(
    slices: &[ResourceSlice],
    pred: impl Fn(&str, &str) -> bool,
) -> Vec<(String, String)> {
    let gpus = device_gpus(slices, "");
    let mut out: Vec<(String, String)> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| {
            let ty = d
                .attributes
                .as_ref()
                .and_then(|a| a.get("type"))
                .and_then(|v| v.string.clone())
                .unwrap_or_default();
            pred(&d.name, &ty).then(|| {
                (
                    d.name.clone(),
                    gpus.get(&d.name).cloned().unwrap_or_default(),
                )
            })
        })
        .collect();
    out.sort();
    out
}

/// The server's slices must be exactly what the model computes offline
/// (`tessera slices`), up to the pool generation: nothing dropped or
/// rewritten by validation or defaulting.
pub fn check_stored_as_computed(
    server: &[ResourceSlice],
    offline: &[ResourceSlice],
    generation: i64,
) -> Result<()> {
    let names = |v: &[ResourceSlice]| {
        v.iter()
            .map(|s| s.metadata.name.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    ensure!(
        names(server) == names(offline),
        "published slices {:?} differ from the computed {:?}",
        names(server),
        names(offline)
    );
    for (s, o) in server.iter().zip(offline) {
        let name = s.metadata.name.as_deref().unwrap_or_default();
        ensure!(
            s.spec.pool.generation == generation,
            "{name}: generation {} instead of {generation}",
            s.spec.pool.generation
        );
        ensure!(
            usize::try_from(s.spec.pool.resource_slice_count) == Ok(server.len()),
            "{name}: resourceSliceCount {} for {} slices",
            s.spec.pool.resource_slice_count,
            server.len()
        );
        let owners = s.metadata.owner_references.as_deref().unwrap_or_default();
        ensure!(
            owners.len() == 1
                && owners[0].kind == "Node"
                && Some(&owners[0].name) == s.spec.node_name.as_ref(),
            "{name}: not owned by its Node: {owners:?}"
        );
        let mut a = s.spec.clone();
        let mut b = o.spec.clone();
        a.pool.generation = 0;
        b.pool.generation = 0;
        if a != b {
            let da: BTreeMap<_, _> = a
                .devices
                .iter()
                .flatten()
                .map(|d| (d.name.clone(), d))
                .collect();
            let db: BTreeMap<_, _> = b
                .devices
                .iter()
                .flatten()
                .map(|d| (d.name.clone(), d))
                .collect();
            let first = db
                .iter()
                .find(|(n, d)| da.get(*n) != Some(*d))
                .map(|(n, _)| n.clone());
            anyhow::bail!(
                "{name}: the server stored something else than was computed (fields dropped?); \
                 first differing device {first:?}:\nstored:   {}\ncomputed: {}",
                serde_json::to_string(&first.as_ref().and_then(|n| da.get(n)))?,
                serde_json::to_string(&first.as_ref().and_then(|n| db.get(n)))?,
            );
        }
    }
    Ok(())
}

/// Publishes and checks the result against the offline model.
async fn publish_and_check(pool: &Pool, full: bool) -> Result<Published> {
    let published = pool.publish_once()?;
    ensure!(
        published.full_model() == full,
        "expected the {} model, publish reported {}",
        if full { "full" } else { "static" },
        published.report
    );
    ensure!(
        published.report["rejected"] == 0,
        "writes rejected: {}",
        published.report
    );
    let server = pool.slices().await?;
    let offline = pool.offline_slices(if full { "full" } else { "legacy" })?;
    check_stored_as_computed(&server, &offline, published.generation())?;
    Ok(published)
}

/// Max memory of any GPU of the pool, from its devices' capacity.
fn max_gpu_memory(slices: &[ResourceSlice]) -> u64 {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| device_capacity(slices, &d.name, "memory"))
        .max()
        .unwrap_or(0)
}

/// Compatibility groups are published exactly where the cluster has the
/// gate, on every counter consumption then (the mixes below are the same
/// either way).
fn check_groups(pool: &Pool, published: &Published, slices: &[ResourceSlice]) -> Result<()> {
    let gate = pool.cluster.groups;
    ensure!(
        published.report["server"]["compatibilityGroups"] == gate,
        "compatibility groups should be detected {}: {}",
        if gate { "on" } else { "off" },
        published.report["server"]
    );
    let consumptions: Vec<_> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .flat_map(|d| d.consumes_counters.iter().flatten().map(move |c| (d, c)))
        .collect();
    ensure!(!consumptions.is_empty(), "no device consumes counters");
    for (device, c) in consumptions {
        let named = c
            .compatibility_groups
            .as_ref()
            .is_some_and(|g| g.len() == 1);
        ensure!(
            named == gate,
            "{}: compatibilityGroups {:?} on a cluster with the gate {}",
            device.name,
            c.compatibility_groups,
            if gate { "on" } else { "off" }
        );
    }
    Ok(())
}

/// Full model (partitionable devices + consumable capacity).
pub async fn full_model(cluster: &Cluster, topo: Topology) -> Result<()> {
    let pool = Pool::new(cluster, "full", topo.file).await?;
    let result = full_model_on(&pool, topo).await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("full model on {} (node {})", topo.file, pool.node))?;
    cleanup
}

async fn full_model_on(pool: &Pool, topo: Topology) -> Result<()> {
    let published = publish_and_check(pool, true).await?;
    let (creates, updates, deletes) = published.writes();
    ensure!(
        creates == published.slices() && updates == 0 && deletes == 0,
        "first publish wrote {:?} for {} slices",
        published.writes(),
        published.slices()
    );
    ensure!(
        published.report["server"]["partitionableDevices"] == true
            && published.report["server"]["consumableCapacity"] == true,
        "capabilities not detected on the full cluster: {}",
        published.report["server"]
    );
    let slices = pool.slices().await?;
    check_groups(pool, &published, &slices)?;

    // A whole GPU. While it is allocated, no share of that GPU can be.
    let whole = pool.request("whole", &pool.class("gpu"), &[], &[]).await?;
    let w = pool.allocated(&whole).await?;
    ensure!(
        device_attr(&slices, &w.device, "type").as_deref() == Some("gpu"),
        "{w:?} is not a whole GPU"
    );
    let pin = |attr: &str, gpu: &str| format!("{} == {gpu:?}", pool.attr(attr));
    let beside = pool
        .request(
            "iso-beside-whole",
            &pool.class("gpu-isolated"),
            &[pin("uuid", &w.gpu)],
            &[("memory", "1Gi")],
        )
        .await?;
    pool.refused(&beside).await?;
    pool.release(&[whole, beside]).await?;

    // A MIG profile; the whole GPU it is on is then off limits.
    if let Some(profile) = topo.mig_full {
        let mig = pool
            .request(
                "mig",
                &pool.class("mig"),
                &[format!("{} == {profile:?}", pool.attr("profile"))],
                &[],
            )
            .await?;
        let m = pool.allocated(&mig).await?;
        ensure!(
            device_attr(&slices, &m.device, "profile").as_deref() == Some(profile),
            "{m:?}"
        );
        let whole_there = pool
            .request(
                "whole-beside-mig",
                &pool.class("gpu"),
                &[pin("uuid", &m.gpu)],
                &[],
            )
            .await?;
        pool.refused(&whole_there).await?;
        pool.release(&[mig, whole_there]).await?;
    }

    // Isolated shares pack onto one GPU until its memory is used up.
    let isolated = devices_where(&slices, |n, ty| ty == "share" && n.ends_with("-isolated"));
    let (iso_device, g) = isolated
        .first()
        .cloned()
        .context("no Isolated share device published")?;
    let memory =
        device_capacity(&slices, &iso_device, "memory").context("share device without memory")?;
    let share = round_gib(memory / 4);
    let rest = memory - 3 * share;
    // Whole GiB: a GiB more than what is left is refused, what is left fits.
    let fits = floor_gib(rest);
    let too_big = fits + GIB_BYTES;
    ensure!(
        too_big > rest && too_big <= memory && fits >= GIB_BYTES,
        "sizes for {memory} bytes"
    );
    let mut held = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..3 {
        let c = pool
            .request(
                "iso",
                &pool.class("gpu-isolated"),
                &[pin("uuid", &g)],
                &[("memory", &gib(share))],
            )
            .await?;
        held.push(c);
    }
    for c in &held {
        let a = pool.allocated(c).await?;
        ensure!(
            a.device == iso_device,
            "{c} landed on {a:?}, not {iso_device}"
        );
    }
    refused.push(
        pool.request_refused(
            "iso-too-big",
            &pool.class("gpu-isolated"),
            &[pin("uuid", &g)],
            &[("memory", &gib(too_big))],
        )
        .await?,
    );
    let small = pool
        .request(
            "iso-fits",
            &pool.class("gpu-isolated"),
            &[pin("uuid", &g)],
            &[("memory", &gib(fits))],
        )
        .await?;
    ensure!(
        pool.allocated(&small).await?.device == iso_device,
        "the remaining memory was not offered"
    );
    held.push(small);

    // Nothing of another mode on that GPU: not Shared, not whole, not MIG.
    refused.push(
        pool.request_refused(
            "shared-on-isolated",
            &pool.class("gpu-shared"),
            &[pin("uuid", &g)],
            &[],
        )
        .await?,
    );
    refused.push(
        pool.request_refused(
            "whole-on-shares",
            &pool.class("gpu"),
            &[pin("uuid", &g)],
            &[],
        )
        .await?,
    );
    if !devices_where(&slices, |_, ty| ty == "mig")
        .iter()
        .filter(|(_, gpu)| *gpu == g)
        .collect::<Vec<_>>()
        .is_empty()
    {
        refused.push(
            pool.request_refused(
                "mig-on-shares",
                &pool.class("mig"),
                &[pin("parentUUID", &g)],
                &[],
            )
            .await?,
        );
    }

    // A Shared claim goes elsewhere (or nowhere), and then that GPU takes
    // no Isolated claim and no whole-GPU claim.
    let shared_elsewhere: BTreeSet<String> =
        devices_where(&slices, |n, ty| ty == "share" && n.ends_with("-shared"))
            .into_iter()
            .map(|(_, gpu)| gpu)
            .filter(|gpu| *gpu != g)
            .collect();
    let shared = pool
        .request("shared", &pool.class("gpu-shared"), &[], &[])
        .await?;
    if shared_elsewhere.is_empty() {
        pool.refused(&shared).await?;
        refused.push(shared);
    } else {
        let h = pool.allocated(&shared).await?;
        ensure!(
            h.gpu != g,
            "Shared claim {shared} landed on the GPU with Isolated claims"
        );
        held.push(shared);
        refused.push(
            pool.request_refused(
                "iso-on-shared",
                &pool.class("gpu-isolated"),
                &[pin("uuid", &h.gpu)],
                &[("memory", "1Gi")],
            )
            .await?,
        );
        refused.push(
            pool.request_refused(
                "whole-on-shared",
                &pool.class("gpu"),
                &[pin("uuid", &h.gpu)],
                &[],
            )
            .await?,
        );
    }
    for r in &refused {
        pool.still_refused(r).await?;
    }
    pool.release(&held).await?;
    pool.release(&refused).await?;

    // More than any GPU has: unschedulable, and the pod says why.
    let beyond = floor_gib(max_gpu_memory(&slices)) + 2 * GIB_BYTES;
    let huge_share = pool
        .request(
            "iso-huge",
            &pool.class("gpu-isolated"),
            &[],
            &[("memory", &gib(beyond))],
        )
        .await?;
    pool.refused(&huge_share).await?;
    let huge_whole = pool
        .request(
            "whole-huge",
            &pool.class("gpu"),
            &[format!(
                "{}.compareTo(quantity({:?})) >= 0",
                pool.cap("memory"),
                gib(beyond)
            )],
            &[],
        )
        .await?;
    pool.refused(&huge_whole).await?;
    Ok(())
}

/// Static mode on a server without partitionable devices and consumable
/// capacity: phase A every GPU whole (MIG GPUs keep their instances), phase
/// B one GPU Isolated with 3 replicas, one Shared, the rest whole.
pub async fn static_mode(cluster: &Cluster, topo: Topology) -> Result<()> {
    let mut pool = Pool::new(cluster, "static", topo.file).await?;
    let all_whole = "gpus:\n  - select: {all: true}\n    static: {mode: whole}\n";
    pool.policy = Some(scratch_file(&format!("{}-a.yaml", pool.id), all_whole));
    let result = static_phases(&mut pool, topo).await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("static mode on {} (node {})", topo.file, pool.node))?;
    cleanup
}

async fn static_phases(pool: &mut Pool, topo: Topology) -> Result<()> {
    let published = publish_and_check(pool, false).await?;
    ensure!(
        published.report["server"]["partitionableDevices"] == false
            && published.report["server"]["consumableCapacity"] == false,
        "the degraded server's capabilities were not detected: {}",
        published.report["server"]
    );
    let slices = pool.slices().await?;
    let pin = |pool: &Pool, attr: &str, gpu: &str| format!("{} == {gpu:?}", pool.attr(attr));

    // Phase A: whole GPUs and existing MIG instances.
    let whole = pool.request("whole", &pool.class("gpu"), &[], &[]).await?;
    let w = pool.allocated(&whole).await?;
    ensure!(
        device_attr(&slices, &w.device, "type").as_deref() == Some("gpu"),
        "{w:?}"
    );
    let mut names = vec![whole];
    if let Some(profile) = topo.mig_static {
        let mig = pool
            .request(
                "mig",
                &pool.class("mig"),
                &[format!("{} == {profile:?}", pool.attr("profile"))],
                &[],
            )
            .await?;
        let m = pool.allocated(&mig).await?;
        ensure!(
            device_attr(&slices, &m.device, "type").as_deref() == Some("mig"),
            "{m:?}"
        );
        ensure!(
            device_attr(&slices, &m.device, "uuid").is_some_and(|u| u.starts_with("MIG-")),
            "{m:?}"
        );
        names.push(mig);
    }
    let beyond = floor_gib(max_gpu_memory(&slices)) + 2 * GIB_BYTES;
    names.push(
        pool.request_refused(
            "whole-huge",
            &pool.class("gpu"),
            &[format!(
                "{}.compareTo(quantity({:?})) >= 0",
                pool.cap("memory"),
                gib(beyond)
            )],
            &[],
        )
        .await?,
    );
    pool.release(&names).await?;

    // Phase B: GPUs that phase A published whole get a share mode.
    let phase_a = slices;
    let wholes = devices_where(&phase_a, |_, ty| ty == "gpu");
    let index = |name: &str| name.trim_start_matches("gpu-").parse::<u32>().ok();
    let iso_index = wholes
        .first()
        .and_then(|(n, _)| index(n))
        .context("no whole GPU in phase A")?;
    let shared_index = wholes.get(1).and_then(|(n, _)| index(n));
    let mut policy = format!(
        "gpus:\n  - select: {{all: true}}\n    static: {{mode: whole}}\n  - select: {{index: {iso_index}}}\n    static: {{mode: isolated, replicas: 3}}\n"
    );
    if let Some(s) = shared_index {
        policy.push_str(&format!(
            "  - select: {{index: {s}}}\n    static: {{mode: shared, replicas: 4}}\n"
        ));
    }
    pool.policy = Some(scratch_file(&format!("{}-b.yaml", pool.id), &policy));
    let republished = publish_and_check(pool, false).await?;
    ensure!(
        republished.generation() == published.generation() + 1 && republished.total_writes() > 0,
        "the policy change was not published: {}",
        republished.report
    );
    let slices = pool.slices().await?;
    let replicas = devices_where(&slices, |n, _| {
        n.starts_with(&format!("gpu-{iso_index}-isolated-"))
    });
    ensure!(
        replicas.len() == 3,
        "expected 3 Isolated replicas, got {replicas:?}"
    );
    let g = replicas[0].1.clone();
    let replica_memory =
        device_capacity(&slices, &replicas[0].0, "memory").context("replica memory")?;
    let gpu_memory =
        device_capacity(&phase_a, &format!("gpu-{iso_index}"), "memory").context("GPU memory")?;
    let share = floor_gib(replica_memory).min(round_gib(gpu_memory / 4));
    let too_big = share * 3 / 2;
    ensure!(
        too_big > replica_memory,
        "sizes: replica {replica_memory}, share {share}"
    );
    let at_least = |pool: &Pool, bytes: u64| {
        format!(
            "{}.compareTo(quantity({:?})) >= 0",
            pool.cap("memory"),
            gib(bytes)
        )
    };

    let mut held = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..3 {
        let c = pool
            .request(
                "iso",
                &pool.class("gpu-isolated"),
                &[pin(pool, "uuid", &g), at_least(pool, share)],
                &[],
            )
            .await?;
        held.push(c);
    }
    let mut got = BTreeSet::new();
    for c in &held {
        let a = pool.allocated(c).await?;
        ensure!(a.gpu == g, "{c} landed on {a:?}");
        got.insert(a.device);
    }
    ensure!(got.len() == 3, "3 claims share a replica: {got:?}");
    refused.push(
        pool.request_refused(
            "iso-too-big",
            &pool.class("gpu-isolated"),
            &[pin(pool, "uuid", &g), at_least(pool, too_big)],
            &[],
        )
        .await?,
    );
    refused.push(
        pool.request_refused(
            "iso-fourth",
            &pool.class("gpu-isolated"),
            &[pin(pool, "uuid", &g), at_least(pool, share)],
            &[],
        )
        .await?,
    );
    refused.push(
        pool.request_refused(
            "shared-on-isolated",
            &pool.class("gpu-shared"),
            &[pin(pool, "uuid", &g)],
            &[],
        )
        .await?,
    );
    refused.push(
        pool.request_refused(
            "whole-on-shares",
            &pool.class("gpu"),
            &[pin(pool, "uuid", &g)],
            &[],
        )
        .await?,
    );

    let shared = pool
        .request("shared", &pool.class("gpu-shared"), &[], &[])
        .await?;
    let mut share_gpus = BTreeSet::from([g.clone()]);
    if shared_index.is_some() {
        let h = pool.allocated(&shared).await?;
        ensure!(h.gpu != g, "Shared claim landed on the Isolated GPU");
        share_gpus.insert(h.gpu);
        held.push(shared);
    } else {
        pool.refused(&shared).await?;
        refused.push(shared);
    }
    let whole = pool.request("whole", &pool.class("gpu"), &[], &[]).await?;
    let whole_left = devices_where(&slices, |_, ty| ty == "gpu");
    if whole_left.is_empty() {
        pool.refused(&whole).await?;
        refused.push(whole);
    } else {
        let a = pool.allocated(&whole).await?;
        ensure!(
            !share_gpus.contains(&a.gpu),
            "whole GPU claim landed on a GPU with shares: {a:?}"
        );
        held.push(whole);
    }
    for r in &refused {
        pool.still_refused(r).await?;
    }
    pool.release(&held).await?;
    pool.release(&refused).await?;
    Ok(())
}

/// Restart with an unchanged inventory writes nothing: by the publisher's
/// own counters and by the slices' resourceVersions.
pub async fn restart_writes_nothing(pool: &Pool) -> Result<Published> {
    let before = pool.slices().await?;
    ensure!(!before.is_empty(), "nothing published before the restart");
    let again = pool.publish_once()?;
    ensure!(
        again.total_writes() == 0 && again.report["result"]["unchanged"] == true,
        "a restart with the same inventory wrote: {}",
        again.report
    );
    let after = pool.slices().await?;
    let versions = |v: &[ResourceSlice]| {
        v.iter()
            .map(|s| (s.metadata.name.clone(), s.metadata.resource_version.clone()))
            .collect::<Vec<_>>()
    };
    ensure!(
        versions(&before) == versions(&after),
        "resourceVersions changed across a restart: {:?} -> {:?}",
        versions(&before),
        versions(&after)
    );
    Ok(again)
}
