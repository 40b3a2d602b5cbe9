//! The checks. Each returns an [`Outcome`] whose message is one line saying
//! what it proved or exactly what is wrong, naming the objects involved;
//! the evidence (what each pod saw, what each claim got) goes in `details`.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use kube::Api;

use super::Ctx;
use super::facts::{self, SliceDevice};
use super::ops::{self, Allocated};
use super::probe::{self, ClaimSource, Health, ProbeContainer, ProbeOutput, ProbePod};
use super::report::Status;

/// Indices into `Ctx::class_match`.
const GPU: usize = 0;
const MIG: usize = 1;
const SHARED: usize = 2;

/// The most pods the over-allocation check creates to fill one GPU.
const MAX_FILL: u128 = 24;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub status: Status,
    pub message: String,
    pub details: Vec<String>,
}

impl Outcome {
    fn new(status: Status, message: impl Into<String>, details: Vec<String>) -> Self {
        Self {
            status,
            message: message.into(),
            details,
        }
    }
    pub(super) fn pass(message: impl Into<String>, details: Vec<String>) -> Self {
        Self::new(Status::Pass, message, details)
    }
    pub(super) fn fail(message: impl Into<String>, details: Vec<String>) -> Self {
        Self::new(Status::Fail, message, details)
    }
    pub(super) fn skip(message: impl Into<String>) -> Self {
        Self::new(Status::Skip, message, Vec::new())
    }
}

/// One probe container's output, kept for `health-script`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeRecord {
    pub check: String,
    pub pod: String,
    pub container: String,
    pub expect_gpu: bool,
    pub output: ProbeOutput,
}

pub async fn run(ctx: &Ctx, id: &str) -> Result<Outcome> {
    match id {
        "logical-gpus" => Ok(logical_gpus(&ctx.node, &ctx.devices)),
        "template-shared-gpu" => template_shared_gpu(ctx).await,
        "shared-claim" => shared_claim(ctx).await,
        "over-allocation-blocked" => over_allocation_blocked(ctx).await,
        "mig-distinct" => mig_distinct(ctx).await,
        "secure-one-device" => secure_one_device(ctx).await,
        "driver-versions" => super::versions::driver_versions(ctx).await,
        "secure-no-claim" => secure_no_claim(ctx).await,
        "secure-two-containers" => secure_two_containers(ctx).await,
        "extended-resource" => extended_resource(ctx).await,
        "accelerator-metrics" => super::metrics::accelerator_metrics(ctx).await,
        "health-script" => health_script(ctx).await,
        "isolated-limits" => super::isolation::isolated_limits(ctx).await,
        "admin-access-class" => super::admin::admin_access_class(ctx).await,
        other => bail!("unknown check {other}"),
    }
}

fn kind_of(d: &SliceDevice) -> String {
    let mut k = d.attr(facts::TYPE).unwrap_or("device").to_owned();
    if d.multi {
        let n = facts::claims_per_device(d, &BTreeMap::new());
        if n == u128::MAX {
            k.push_str(", multi-allocatable without capacity limits");
        } else {
            k.push_str(&format!(", up to {n} claims"));
        }
    }
    k
}

/// Logical devices a GPU offers: exclusive devices count 1, a
/// multi-allocatable one as many claims as fit with default requests.
fn logical_count(devices: &[&SliceDevice]) -> u128 {
    devices
        .iter()
        .map(|d| facts::claims_per_device(d, &BTreeMap::new()).min(1_000))
        .sum()
}

/// Check 1, from the node's slices alone.
pub fn logical_gpus(node: &str, devices: &[SliceDevice]) -> Outcome {
    if devices.is_empty() {
        return Outcome::fail(
            format!("node {node} has no devices of the driver in its ResourceSlices"),
            vec![],
        );
    }
    let groups = facts::by_physical_gpu(devices);
    if groups.is_empty() {
        return Outcome::fail(
            format!(
                "none of the {} devices on node {node} carries a `uuid` or `parentUUID` attribute: physical GPUs cannot be told apart",
                devices.len()
            ),
            vec![],
        );
    }
    let details: Vec<String> = groups
        .iter()
        .map(|(gpu, ds)| {
            let list: Vec<String> = ds
                .iter()
                .map(|d| format!("{} [{}]", d.name, kind_of(d)))
                .collect();
            format!("{gpu}: {} devices: {}", ds.len(), list.join(", "))
        })
        .collect();
    let several: Vec<(&String, &Vec<&SliceDevice>)> = groups
        .iter()
        .filter(|(_, ds)| logical_count(ds) >= 2)
        .collect();
    match several.iter().max_by_key(|(_, ds)| logical_count(ds)) {
        None => Outcome::fail(
            format!(
                "every physical GPU on node {node} ({}) is published as a single exclusive device",
                groups.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
            details,
        ),
        Some((gpu, ds)) => {
            let names: Vec<&str> = ds.iter().map(|d| d.name.as_str()).collect();
            let slices: BTreeSet<&str> = ds.iter().map(|d| d.slice.as_str()).collect();
            Outcome::pass(
                format!(
                    "{} of {} physical GPUs on node {node} are published as several allocatable devices; e.g. {gpu} as {} devices ({}; {} claims at once with default requests) in ResourceSlice {}",
                    several.len(),
                    groups.len(),
                    ds.len(),
                    names.join(", "),
                    logical_count(ds),
                    slices.into_iter().collect::<Vec<_>>().join(", ")
                ),
                details,
            )
        }
    }
}

/// What one pod showed: where it ran, what its claims got, what it saw.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodEvidence {
    pub pod: String,
    pub node: String,
    /// `(claim, pool/device, physical GPU, device's node)`.
    pub devices: Vec<(String, String, Option<String>, Option<String>)>,
    pub seen: Vec<String>,
}

impl PodEvidence {
    fn line(&self) -> String {
        let devs: Vec<String> = self
            .devices
            .iter()
            .map(|(c, d, g, _)| {
                format!(
                    "claim {c} -> {d} ({})",
                    g.as_deref().unwrap_or("no GPU UUID")
                )
            })
            .collect();
        format!(
            "pod {} on node {}: {}; nvidia-smi in the pod: [{}]",
            self.pod,
            self.node,
            devs.join(", "),
            self.seen.join(", ")
        )
    }
}

/// Checks that every pod got a device of one physical GPU (`target` when
/// given), runs on that device's node, and sees exactly that GPU.
pub fn same_gpu_verdict(target: Option<&str>, pods: &[PodEvidence]) -> Outcome {
    let details: Vec<String> = pods.iter().map(PodEvidence::line).collect();
    let mut gpus = BTreeSet::new();
    for p in pods {
        if p.devices.is_empty() {
            return Outcome::fail(
                format!(
                    "pod {} has no allocated device in its claims' status",
                    p.pod
                ),
                details,
            );
        }
        for (claim, dev, gpu, dnode) in &p.devices {
            let Some(gpu) = gpu else {
                return Outcome::fail(
                    format!(
                        "device {dev} of claim {claim} (pod {}) is not in the node's slices or has no GPU UUID",
                        p.pod
                    ),
                    details,
                );
            };
            if let Some(n) = dnode.as_ref().filter(|n| **n != p.node) {
                return Outcome::fail(
                    format!(
                        "pod {} runs on node {} but its claim {claim} got {dev} of node {n}",
                        p.pod, p.node
                    ),
                    details,
                );
            }
            gpus.insert(gpu.clone());
        }
    }
    if gpus.len() != 1 {
        return Outcome::fail(
            format!(
                "the pods' claims got devices of {} physical GPUs ({}), not one",
                gpus.len(),
                gpus.iter().cloned().collect::<Vec<_>>().join(", ")
            ),
            details,
        );
    }
    let gpu = gpus.into_iter().next().unwrap_or_default();
    if let Some(t) = target.filter(|t| *t != gpu) {
        return Outcome::fail(
            format!("the claims were pinned to {t} but got {gpu}"),
            details,
        );
    }
    for p in pods {
        if p.seen != [gpu.clone()] {
            return Outcome::fail(
                format!(
                    "pod {}'s claim got {gpu} but nvidia-smi in the pod reports [{}]",
                    p.pod,
                    p.seen.join(", ")
                ),
                details,
            );
        }
    }
    let names: Vec<&str> = pods.iter().map(|p| p.pod.as_str()).collect();
    let devs: BTreeSet<&str> = pods
        .iter()
        .flat_map(|p| p.devices.iter().map(|d| d.1.as_str()))
        .collect();
    let claims: BTreeSet<&str> = pods
        .iter()
        .flat_map(|p| p.devices.iter().map(|d| d.0.as_str()))
        .collect();
    Outcome::pass(
        format!(
            "pods {} run on node {} on physical GPU {gpu}: claim status ({} -> {}) and each pod's nvidia-smi agree",
            names.join(", "),
            pods.first().map_or("", |p| p.node.as_str()),
            claims.into_iter().collect::<Vec<_>>().join(", "),
            devs.into_iter().collect::<Vec<_>>().join(", "),
        ),
        details,
    )
}

/// A pod that ran: the Pod object and each container's probe output.
pub(super) struct PodRun {
    pub(super) pod: Pod,
    outputs: Vec<(String, ProbeOutput)>,
}

impl PodRun {
    fn name(&self) -> String {
        self.pod.metadata.name.clone().unwrap_or_default()
    }
    fn node(&self) -> String {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default()
    }
    pub(super) fn output(&self) -> &ProbeOutput {
        &self.outputs[0].1
    }
}

fn record(ctx: &Ctx, check: &str, pod: &ProbePod, outputs: &[(String, ProbeOutput)]) {
    let mut probes = ctx.probes.lock().unwrap_or_else(|e| e.into_inner());
    for (c, out) in outputs {
        let expect_gpu = pod
            .containers
            .iter()
            .any(|pc| &pc.name == c && pc.uses_claim);
        probes.push(ProbeRecord {
            check: check.to_owned(),
            pod: pod.name.clone(),
            container: c.clone(),
            expect_gpu,
            output: out.clone(),
        });
    }
}

/// Creates the pods, waits until they finished, and reads each container's
/// probe output (recorded for `health-script`).
pub(super) async fn run_pods(ctx: &Ctx, check: &str, pods: &[ProbePod]) -> Result<Vec<PodRun>> {
    for p in pods {
        ctx.kube.create::<Pod>(p.to_json()).await?;
    }
    let names: Vec<String> = pods.iter().map(|p| p.name.clone()).collect();
    let finished = ctx.kube.wait_finished(&names).await?;
    let mut runs = Vec::new();
    for (spec, pod) in pods.iter().zip(finished) {
        let mut outputs = Vec::new();
        for c in &spec.containers {
            let log = ctx.kube.logs(&spec.name, &c.name).await?;
            outputs.push((c.name.clone(), ProbeOutput::parse(&log)));
        }
        record(ctx, check, spec, &outputs);
        if ops::phase(&pod) != "Succeeded" || outputs.iter().any(|(_, o)| !o.done) {
            bail!(
                "the probe did not complete: {}; output: {}",
                ctx.kube.describe(&pod).await,
                outputs
                    .iter()
                    .map(|(c, o)| format!("{c}: {}", o.summary()))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        runs.push(PodRun { pod, outputs });
    }
    Ok(runs)
}

pub(super) fn lookup<'a>(ctx: &'a Ctx, a: &Allocated) -> Option<&'a SliceDevice> {
    ctx.devices
        .iter()
        .find(|d| a.driver == ctx.driver && d.pool == a.pool && d.name == a.device)
}

async fn evidence(ctx: &Ctx, run: &PodRun) -> Result<PodEvidence> {
    let allocated = ctx.kube.allocated(&run.pod).await?;
    Ok(PodEvidence {
        pod: run.name(),
        node: run.node(),
        devices: allocated
            .iter()
            .map(|a| {
                let d = lookup(ctx, a);
                (
                    a.claim.clone(),
                    a.id(),
                    d.and_then(|d| d.physical_gpu().map(str::to_owned)),
                    d.and_then(|d| d.node.clone()),
                )
            })
            .collect(),
        seen: run.output().gpu_uuids(),
    })
}

fn class_missing(ctx: &Ctx, which: usize) -> Option<String> {
    let m = &ctx.class_match[which];
    (m.len() == 1 && m[0].0 == "__missing__")
        .then(|| format!("DeviceClass {} does not exist", m[0].1))
}

/// The physical GPU (and the attribute naming it on its devices) of
/// `which` class with the most room, and that room with default requests.
fn roomiest_gpu(
    ctx: &Ctx,
    which: usize,
) -> Option<(String, &'static str, Vec<&SliceDevice>, u128)> {
    let devices: Vec<SliceDevice> = ctx.devices_of_class(which).into_iter().cloned().collect();
    let groups = facts::by_physical_gpu(&devices);
    let (gpu, _) = groups.iter().max_by_key(|(_, ds)| logical_count(ds))?;
    let ds: Vec<&SliceDevice> = ctx
        .devices_of_class(which)
        .into_iter()
        .filter(|d| d.physical_gpu() == Some(gpu.as_str()))
        .collect();
    let attr = ds.first()?.physical_attr()?;
    let room = logical_count(&ds);
    Some((gpu.clone(), attr, ds, room))
}

async fn template_shared_gpu(ctx: &Ctx) -> Result<Outcome> {
    let class = &ctx.classes.shared;
    if let Some(m) = class_missing(ctx, SHARED) {
        return Ok(Outcome::fail(format!("{m}: pass --shared-class"), vec![]));
    }
    let Some((gpu, attr, ds, room)) = roomiest_gpu(ctx, SHARED) else {
        return Ok(Outcome::fail(
            format!("no device of DeviceClass {class} on node {}", ctx.node),
            vec![],
        ));
    };
    if room < 2 {
        let names: Vec<&str> = ds.iter().map(|d| d.name.as_str()).collect();
        return Ok(Outcome::fail(
            format!(
                "no physical GPU on node {} has room for two claims of {class}; best: {gpu} with {}",
                ctx.node,
                names.join(", ")
            ),
            vec![],
        ));
    }
    let pin = facts::pin_expression(&ctx.driver, attr, &gpu);
    let req = probe::device_request("gpu", class, std::slice::from_ref(&pin), &BTreeMap::new());
    ctx.kube
        .create::<ResourceClaimTemplate>(probe::claim_template(
            "shared-gpu",
            "template-shared-gpu",
            req,
        ))
        .await?;
    let pods: Vec<ProbePod> = (0..2)
        .map(|i| {
            ProbePod::single(
                &format!("template-shared-{i}"),
                "template-shared-gpu",
                &ctx.node,
                &ctx.image,
                Some(ClaimSource::Template("shared-gpu".into())),
            )
        })
        .collect();
    let runs = run_pods(ctx, "template-shared-gpu", &pods).await?;
    let mut ev = Vec::new();
    for r in &runs {
        ev.push(evidence(ctx, r).await?);
    }
    let mut out = same_gpu_verdict(Some(&gpu), &ev);
    out.details.insert(
        0,
        format!("ResourceClaimTemplate shared-gpu: class {class}, selector {pin}"),
    );
    Ok(out)
}

async fn shared_claim(ctx: &Ctx) -> Result<Outcome> {
    let class = &ctx.classes.gpu;
    if let Some(m) = class_missing(ctx, GPU) {
        return Ok(Outcome::fail(format!("{m}: pass --gpu-class"), vec![]));
    }
    let req = probe::device_request("gpu", class, &[], &BTreeMap::new());
    ctx.kube
        .create::<ResourceClaim>(probe::claim("whole-gpu", "shared-claim", req))
        .await?;
    let pods: Vec<ProbePod> = (0..2)
        .map(|i| {
            ProbePod::single(
                &format!("shared-claim-{i}"),
                "shared-claim",
                &ctx.node,
                &ctx.image,
                Some(ClaimSource::Claim("whole-gpu".into())),
            )
        })
        .collect();
    let runs = run_pods(ctx, "shared-claim", &pods).await?;
    let mut ev = Vec::new();
    for r in &runs {
        ev.push(evidence(ctx, r).await?);
    }
    let mut out = same_gpu_verdict(None, &ev);
    out.details.insert(
        0,
        format!("ResourceClaim whole-gpu: class {class}, used by both pods"),
    );
    Ok(out)
}

/// Capacity requests that let at most two claims onto each multi-allocatable
/// device (half its memory), and how many claims then fit on the GPU.
pub fn fill_plan(ds: &[&SliceDevice]) -> (BTreeMap<String, u128>, u128) {
    let mut request = BTreeMap::new();
    for d in ds.iter().filter(|d| d.multi) {
        if let Some(h) = facts::half_request(d, "memory") {
            let e = request.entry("memory".to_owned()).or_insert(h);
            *e = (*e).max(h);
        }
    }
    let fit = ds
        .iter()
        .map(|d| facts::claims_per_device(d, &request))
        .fold(0u128, u128::saturating_add);
    (request, fit)
}

async fn over_allocation_blocked(ctx: &Ctx) -> Result<Outcome> {
    let class = &ctx.classes.shared;
    if let Some(m) = class_missing(ctx, SHARED) {
        return Ok(Outcome::fail(format!("{m}: pass --shared-class"), vec![]));
    }
    let Some((gpu, attr, ds, _)) = roomiest_gpu(ctx, SHARED) else {
        return Ok(Outcome::fail(
            format!("no device of DeviceClass {class} on node {}", ctx.node),
            vec![],
        ));
    };
    let (request, fit) = fill_plan(&ds);
    let names: Vec<&str> = ds.iter().map(|d| d.name.as_str()).collect();
    if fit == u128::MAX {
        let unlimited: Vec<&str> = ds
            .iter()
            .filter(|d| facts::claims_per_device(d, &request) == u128::MAX)
            .map(|d| d.name.as_str())
            .collect();
        return Ok(Outcome::fail(
            format!(
                "device {} of {gpu} allows multiple allocations without consumable capacity: nothing limits how many claims share the GPU",
                unlimited.join(", ")
            ),
            vec![],
        ));
    }
    if fit > MAX_FILL {
        return Ok(Outcome::skip(format!(
            "{gpu} has room for {fit} claims of {class} ({}); this check fills at most {MAX_FILL}",
            names.join(", ")
        )));
    }
    let pin = facts::pin_expression(&ctx.driver, attr, &gpu);
    let capacity: BTreeMap<String, String> = request
        .iter()
        .map(|(k, v)| (k.clone(), facts::format_quantity(*v)))
        .collect();
    let req = probe::device_request("gpu", class, std::slice::from_ref(&pin), &capacity);
    ctx.kube
        .create::<ResourceClaimTemplate>(probe::claim_template(
            "fill",
            "over-allocation-blocked",
            req,
        ))
        .await?;
    let hold = ctx.kube.timeout.as_secs().saturating_mul(3).max(60);
    let fillers: Vec<ProbePod> = (0..fit)
        .map(|i| {
            let mut p = ProbePod::single(
                &format!("fill-{i}"),
                "over-allocation-blocked",
                &ctx.node,
                &ctx.image,
                Some(ClaimSource::Template("fill".into())),
            );
            p.hold_seconds = Some(hold);
            p
        })
        .collect();
    for p in &fillers {
        ctx.kube.create::<Pod>(p.to_json()).await?;
    }
    let filler_names: Vec<String> = fillers.iter().map(|p| p.name.clone()).collect();
    let scheduled = ctx.kube.wait_scheduled(&filler_names).await?;
    let mut details = vec![format!(
        "ResourceClaimTemplate fill: class {class}, selector {pin}, capacity {:?}: {fit} claims fit on {} of {gpu}",
        capacity,
        names.join(", ")
    )];
    for pod in &scheduled {
        let allocated = ctx.kube.allocated(pod).await?;
        for a in &allocated {
            let g = lookup(ctx, a).and_then(|d| d.physical_gpu()).unwrap_or("?");
            details.push(format!(
                "pod {} claim {} -> {} ({g})",
                pod.metadata.name.clone().unwrap_or_default(),
                a.claim,
                a.id()
            ));
            if g != gpu {
                return Ok(Outcome::fail(
                    format!(
                        "claim {} was pinned to {gpu} but got {} ({g})",
                        a.claim,
                        a.id()
                    ),
                    details,
                ));
            }
        }
    }
    let extra = ProbePod::single(
        "over-1",
        "over-allocation-blocked",
        &ctx.node,
        &ctx.image,
        Some(ClaimSource::Template("fill".into())),
    );
    ctx.kube.create::<Pod>(extra.to_json()).await?;
    let reason = match ctx.kube.wait_unschedulable("over-1").await {
        Ok(r) => r,
        Err(e) => {
            return Ok(Outcome::fail(
                format!("{fit} claims fill {gpu}, yet one more was not refused: {e:#}"),
                details,
            ));
        }
    };
    // Before the fillers' health evidence: they must still hold their claims.
    let whole_gpu = whole_gpu_beside_shares(ctx, &gpu, fit, &mut details).await?;
    // Health evidence of the fillers (they keep running to hold their claims).
    let printed = ctx.kube.wait_printed(&filler_names, &["probe"]).await;
    for p in &fillers {
        let out = ProbeOutput::parse(&ctx.kube.logs(&p.name, "probe").await.unwrap_or_default());
        record(
            ctx,
            "over-allocation-blocked",
            p,
            &[("probe".to_owned(), out)],
        );
    }
    if let Err(e) = printed {
        details.push(format!("filler probes: {e:#}"));
    }
    details.push(format!("pod over-1: {reason}"));
    if let Some(broken) = whole_gpu {
        return Ok(Outcome::fail(broken, details));
    }
    Ok(Outcome::pass(
        format!(
            "with {fit} pods holding {gpu}'s {class} capacity, pod over-1 stays Pending: \"{reason}\"; \
             the whole GPU is not allocatable beside them"
        ),
        details,
    ))
}

/// While claims hold logical devices of `gpu`, a claim for the whole GPU
/// must not be allocated too: that is what the GPU's shared counters are
/// for. Returns the failure, if any; without a whole-GPU device of `gpu` in
/// the GPU class there is nothing to try.
async fn whole_gpu_beside_shares(
    ctx: &Ctx,
    gpu: &str,
    fit: u128,
    details: &mut Vec<String>,
) -> Result<Option<String>> {
    let gpu_class = &ctx.classes.gpu;
    let Some(whole) = ctx
        .devices_of_class(GPU)
        .into_iter()
        .find(|d| d.physical_gpu() == Some(gpu))
    else {
        details.push(format!(
            "no device of {gpu_class} is {gpu}: whole-GPU over-allocation not tried"
        ));
        return Ok(None);
    };
    let Some(attr) = whole.physical_attr() else {
        return Ok(None);
    };
    let pin = facts::pin_expression(&ctx.driver, attr, gpu);
    let req = probe::device_request(
        "gpu",
        gpu_class,
        std::slice::from_ref(&pin),
        &BTreeMap::new(),
    );
    ctx.kube
        .create::<ResourceClaimTemplate>(probe::claim_template(
            "whole",
            "over-allocation-blocked",
            req,
        ))
        .await?;
    let pod = ProbePod::single(
        "over-whole",
        "over-allocation-blocked",
        &ctx.node,
        &ctx.image,
        Some(ClaimSource::Template("whole".into())),
    );
    ctx.kube.create::<Pod>(pod.to_json()).await?;
    match ctx.kube.wait_unschedulable("over-whole").await {
        Ok(reason) => {
            details.push(format!(
                "pod over-whole ({gpu_class} {}, pinned to {gpu}): {reason}",
                whole.name
            ));
            Ok(None)
        }
        Err(e) => Ok(Some(format!(
            "whole GPU {gpu} ({gpu_class} device {}) was not refused while {fit} claims hold its \
             logical devices ({e:#}): the slices do not make the whole GPU and its partitions \
             exclusive (no shared counters charged)",
            whole.name
        ))),
    }
}

async fn mig_distinct(ctx: &Ctx) -> Result<Outcome> {
    let class = &ctx.classes.mig;
    if let Some(m) = class_missing(ctx, MIG) {
        return Ok(Outcome::skip(format!("{m}: no MIG devices to check")));
    }
    let migs = ctx.devices_of_class(MIG);
    if migs.len() < 2 {
        return Ok(Outcome::skip(format!(
            "node {} publishes {} device(s) of DeviceClass {class}: no MIG devices to check",
            ctx.node,
            migs.len()
        )));
    }
    let req = probe::device_request("gpu", class, &[], &BTreeMap::new());
    ctx.kube
        .create::<ResourceClaimTemplate>(probe::claim_template("mig", "mig-distinct", req))
        .await?;
    let pods: Vec<ProbePod> = (0..2)
        .map(|i| {
            ProbePod::single(
                &format!("mig-{i}"),
                "mig-distinct",
                &ctx.node,
                &ctx.image,
                Some(ClaimSource::Template("mig".into())),
            )
        })
        .collect();
    let runs = run_pods(ctx, "mig-distinct", &pods).await?;
    let mut seen = Vec::new();
    for r in &runs {
        let allocated = ctx.kube.allocated(&r.pod).await?;
        let dev = allocated.first().map(|a| {
            (
                a.id(),
                lookup(ctx, a)
                    .and_then(|d| d.attr(facts::UUID))
                    .map(str::to_owned),
            )
        });
        seen.push(MigEvidence {
            pod: r.name(),
            device: dev.as_ref().map(|d| d.0.clone()).unwrap_or_default(),
            device_uuid: dev.and_then(|d| d.1),
            listed: r.output().listed_migs(),
        });
    }
    Ok(mig_verdict(&seen))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigEvidence {
    pub pod: String,
    pub device: String,
    /// The device's `uuid` attribute (existing MIG instances).
    pub device_uuid: Option<String>,
    /// MIG UUIDs `nvidia-smi -L` lists in the pod.
    pub listed: Vec<String>,
}

pub fn mig_verdict(pods: &[MigEvidence]) -> Outcome {
    let details: Vec<String> = pods
        .iter()
        .map(|p| {
            format!(
                "pod {} -> {} (uuid {}); nvidia-smi -L in the pod: [{}]",
                p.pod,
                p.device,
                p.device_uuid.as_deref().unwrap_or("created at prepare"),
                p.listed.join(", ")
            )
        })
        .collect();
    for p in pods {
        if p.listed.len() != 1 {
            return Outcome::fail(
                format!(
                    "pod {} got {} but nvidia-smi -L in it lists {} MIG devices ([{}]), not exactly one",
                    p.pod,
                    p.device,
                    p.listed.len(),
                    p.listed.join(", ")
                ),
                details,
            );
        }
        if let Some(u) = p.device_uuid.as_ref().filter(|u| **u != p.listed[0]) {
            return Outcome::fail(
                format!(
                    "pod {} got {} ({u}) but sees {}",
                    p.pod, p.device, p.listed[0]
                ),
                details,
            );
        }
    }
    let devices: BTreeSet<&str> = pods.iter().map(|p| p.device.as_str()).collect();
    let uuids: BTreeSet<&str> = pods.iter().map(|p| p.listed[0].as_str()).collect();
    if devices.len() != pods.len() || uuids.len() != pods.len() {
        return Outcome::fail(
            format!(
                "{} claims of MIG devices share devices [{}] / MIG UUIDs [{}]",
                pods.len(),
                devices.into_iter().collect::<Vec<_>>().join(", "),
                uuids.into_iter().collect::<Vec<_>>().join(", ")
            ),
            details,
        );
    }
    let pairs: Vec<String> = pods
        .iter()
        .map(|p| format!("{} -> {} ({})", p.pod, p.device, p.listed[0]))
        .collect();
    Outcome::pass(
        format!(
            "two claims of MIG devices got distinct devices and each pod's nvidia-smi -L lists only its own MIG device: {}",
            pairs.join(", ")
        ),
        details,
    )
}

/// One container's accelerator count against what it should be.
pub fn count_verdict(what: &str, expected: u32, out: &ProbeOutput) -> Result<String, String> {
    match out.accelerator_count {
        Some(n) if n == expected => Ok(format!(
            "{what} sees {n} /dev/nvidia[0-9]* (RESULT: ACCELERATOR_COUNT={n})"
        )),
        Some(n) => Err(format!(
            "{what} sees {n} /dev/nvidia[0-9]* device nodes, expected {expected}"
        )),
        None => Err(format!("{what} printed no RESULT: ACCELERATOR_COUNT line")),
    }
}

pub(super) fn gpu_template(ctx: &Ctx, check: &str, name: &str) -> serde_json::Value {
    let req = probe::device_request("gpu", &ctx.classes.gpu, &[], &BTreeMap::new());
    probe::claim_template(name, check, req)
}

async fn secure_one_device(ctx: &Ctx) -> Result<Outcome> {
    ctx.kube
        .create::<ResourceClaimTemplate>(gpu_template(ctx, "secure-one-device", "one-gpu"))
        .await?;
    let pod = ProbePod::single(
        "secure-one",
        "secure-one-device",
        &ctx.node,
        &ctx.image,
        Some(ClaimSource::Template("one-gpu".into())),
    );
    let runs = run_pods(ctx, "secure-one-device", &[pod]).await?;
    let out = runs[0].output();
    let details = vec![format!(
        "pod secure-one (1-device claim of {}): {}",
        ctx.classes.gpu,
        out.summary()
    )];
    Ok(
        match count_verdict("pod secure-one with a 1-device claim", 1, out) {
            Ok(m) => Outcome::pass(m, details),
            Err(m) => Outcome::fail(m, details),
        },
    )
}

/// A pod written for the device plugin, `resources.limits` only, through
/// the GPU class's `extendedResourceName` (Kubernetes 1.36+): it gets one
/// device of the class, from the node's driver, and sees exactly it.
async fn extended_resource(ctx: &Ctx) -> Result<Outcome> {
    let class = Api::<DeviceClass>::all(ctx.kube.client.clone())
        .get_opt(&ctx.classes.gpu)
        .await
        .with_context(|| format!("reading DeviceClass {}", ctx.classes.gpu))?;
    let Some(class) = class else {
        return Ok(Outcome::skip(format!(
            "DeviceClass {} does not exist",
            ctx.classes.gpu
        )));
    };
    let Some(resource) = class.spec.and_then(|s| s.extended_resource_name) else {
        return Ok(Outcome::skip(format!(
            "DeviceClass {} names no extendedResourceName (the API server is older than 1.36, \
             or the class was installed without one: the chart's \
             deviceClasses.extendedResources.gpu)",
            ctx.classes.gpu
        )));
    };
    let pod = ProbePod::single(
        "limits-gpu",
        "extended-resource",
        &ctx.node,
        &ctx.image,
        Some(ClaimSource::Limits(resource.clone())),
    );
    let runs = run_pods(ctx, "extended-resource", &[pod]).await?;
    let ev = evidence(ctx, &runs[0]).await?;
    let out = runs[0].output();
    let details = vec![format!(
        "pod limits-gpu (resources.limits {resource}: 1): {}; allocated {}",
        out.summary(),
        ev.devices
            .iter()
            .map(|(claim, id, gpu, _)| format!("{claim}: {id} ({})", gpu.as_deref().unwrap_or("?")))
            .collect::<Vec<_>>()
            .join(", ")
    )];
    let gpu = match ev.devices.as_slice() {
        [(_, _, Some(gpu), _)] => gpu.clone(),
        _ => String::new(),
    };
    if gpu.is_empty() {
        return Ok(Outcome::fail(
            format!(
                "pod limits-gpu asked {resource}: 1 and got {} device(s), not one device of {} on {}",
                ev.devices.len(),
                ctx.driver,
                ctx.node
            ),
            details,
        ));
    }
    Ok(
        match count_verdict(&format!("pod limits-gpu asking {resource}: 1"), 1, out) {
            Ok(_) if ev.seen != [gpu.clone()] => Outcome::fail(
                format!("pod limits-gpu got {gpu} but sees {}", ev.seen.join(", ")),
                details,
            ),
            Ok(m) => Outcome::pass(m, details),
            Err(m) => Outcome::fail(m, details),
        },
    )
}

async fn secure_no_claim(ctx: &Ctx) -> Result<Outcome> {
    let pod = ProbePod::single(
        "secure-none",
        "secure-no-claim",
        &ctx.node,
        &ctx.image,
        None,
    );
    let runs = run_pods(ctx, "secure-no-claim", &[pod]).await?;
    let out = runs[0].output();
    let details = vec![format!(
        "pod secure-none (no claim, node {}): {}",
        ctx.node,
        out.summary()
    )];
    Ok(
        match count_verdict(
            &format!("pod secure-none without a claim on node {}", ctx.node),
            0,
            out,
        ) {
            Ok(m) => Outcome::pass(m, details),
            Err(m) => Outcome::fail(m, details),
        },
    )
}

async fn secure_two_containers(ctx: &Ctx) -> Result<Outcome> {
    ctx.kube
        .create::<ResourceClaimTemplate>(gpu_template(ctx, "secure-two-containers", "two-gpu"))
        .await?;
    let mut pod = ProbePod::single(
        "secure-two",
        "secure-two-containers",
        &ctx.node,
        &ctx.image,
        Some(ClaimSource::Template("two-gpu".into())),
    );
    pod.containers = vec![
        ProbeContainer {
            name: "with-claim".into(),
            uses_claim: true,
        },
        ProbeContainer {
            name: "without-claim".into(),
            uses_claim: false,
        },
    ];
    let runs = run_pods(ctx, "secure-two-containers", &[pod]).await?;
    let outs = &runs[0].outputs;
    let details: Vec<String> = outs
        .iter()
        .map(|(c, o)| format!("pod secure-two container {c}: {}", o.summary()))
        .collect();
    let with = count_verdict("container with-claim", 1, &outs[0].1);
    let without = count_verdict("container without-claim", 0, &outs[1].1);
    Ok(match (with, without) {
        (Ok(a), Ok(b)) => Outcome::pass(format!("in pod secure-two, {a}; {b}"), details),
        (Err(e), _) | (_, Err(e)) => Outcome::fail(format!("in pod secure-two, {e}"), details),
    })
}

/// Check 6 over the probe records: every container with a claim reported
/// `HEALTH: OK`.
pub fn health_verdict(records: &[ProbeRecord]) -> Outcome {
    let with_gpu: Vec<&ProbeRecord> = records.iter().filter(|r| r.expect_gpu).collect();
    let details: Vec<String> = records
        .iter()
        .map(|r| {
            format!(
                "{} pod {} container {}: {}",
                r.check,
                r.pod,
                r.container,
                match &r.output.health {
                    Some(Health::Ok) => "OK".to_owned(),
                    Some(Health::Fail(why)) => format!("FAIL {why}"),
                    Some(Health::Skip(why)) => format!("skipped: {why}"),
                    None => "no health output".to_owned(),
                }
            )
        })
        .collect();
    let failed: Vec<String> = with_gpu
        .iter()
        .filter_map(|r| {
            let why = match &r.output.health {
                Some(Health::Ok) => return None,
                Some(Health::Fail(why)) => why.clone(),
                Some(Health::Skip(why)) => format!("skipped ({why})"),
                None => "printed no health result (the probe did not run)".to_owned(),
            };
            Some(format!(
                "pod {} container {} ({}): {why}",
                r.pod, r.container, r.check
            ))
        })
        .collect();
    if with_gpu.is_empty() {
        return Outcome::fail("no probe container with a claim ran", details);
    }
    if !failed.is_empty() {
        return Outcome::fail(
            format!(
                "{} of {} health scripts failed: {}",
                failed.len(),
                with_gpu.len(),
                failed.join("; ")
            ),
            details,
        );
    }
    let pods: BTreeSet<&str> = with_gpu.iter().map(|r| r.pod.as_str()).collect();
    Outcome::pass(
        format!(
            "the health script passed in all {} containers with a claim ({} pods): nvidia-smi exit 0, at least one GPU listed, no ERR!/Unknown Error",
            with_gpu.len(),
            pods.len()
        ),
        details,
    )
}

async fn health_script(ctx: &Ctx) -> Result<Outcome> {
    let have = ctx
        .probes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|r| r.expect_gpu);
    if !have {
        ctx.kube
            .create::<ResourceClaimTemplate>(gpu_template(ctx, "health-script", "health-gpu"))
            .await?;
        let pod = ProbePod::single(
            "health",
            "health-script",
            &ctx.node,
            &ctx.image,
            Some(ClaimSource::Template("health-gpu".into())),
        );
        // A pod that does not complete is reported through its record.
        if let Err(e) = run_pods(ctx, "health-script", &[pod]).await {
            return Ok(Outcome::fail(format!("{e:#}"), vec![]));
        }
    }
    let records = ctx.probes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Ok(health_verdict(&records))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, gpu: &str, ty: &str) -> SliceDevice {
        SliceDevice {
            name: name.into(),
            pool: "n1".into(),
            slice: "n1-0".into(),
            node: Some("n1".into()),
            attrs: BTreeMap::from([
                ("uuid".to_owned(), gpu.to_owned()),
                ("type".to_owned(), ty.to_owned()),
            ]),
            capacity: BTreeMap::new(),
            multi: false,
        }
    }

    fn share(name: &str, gpu: &str, memory: u128, with_policy: bool) -> SliceDevice {
        let mut d = dev(name, gpu, "share");
        d.attrs.insert("parentUUID".into(), gpu.into());
        d.multi = true;
        if with_policy {
            d.capacity.insert(
                "memory".into(),
                facts::Capacity {
                    value: memory,
                    default: Some(1 << 30),
                    min: Some(256 << 20),
                    step: Some(256 << 20),
                    consumable: true,
                },
            );
        }
        d
    }

    #[test]
    fn logical_gpus_needs_a_gpu_with_several_devices() {
        let one_each = vec![dev("gpu-0", "GPU-a", "gpu"), dev("gpu-1", "GPU-b", "gpu")];
        let o = logical_gpus("n1", &one_each);
        assert_eq!(o.status, Status::Fail);
        assert!(o.message.contains("every physical GPU on node n1 (GPU-a, GPU-b) is published as a single exclusive device"), "{}", o.message);
        let mut shared = one_each.clone();
        shared.push(share("gpu-1-shared", "GPU-b", 40 << 30, true));
        let o = logical_gpus("n1", &shared);
        assert_eq!(o.status, Status::Pass, "{}", o.message);
        assert!(
            o.message
                .contains("GPU-b as 2 devices (gpu-1, gpu-1-shared; 41 claims at once"),
            "{}",
            o.message
        );
        assert!(
            o.details[1].contains("gpu-1-shared [share, up to 40 claims]"),
            "{:?}",
            o.details
        );
        assert_eq!(logical_gpus("n1", &[]).status, Status::Fail);
    }

    fn ev(pod: &str, gpu: &str, seen: &[&str]) -> PodEvidence {
        PodEvidence {
            pod: pod.into(),
            node: "n1".into(),
            devices: vec![(
                format!("{pod}-claim"),
                "n1/gpu-0-shared".into(),
                Some(gpu.into()),
                Some("n1".into()),
            )],
            seen: seen.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn same_gpu_verdicts() {
        let ok = same_gpu_verdict(
            Some("GPU-a"),
            &[ev("p0", "GPU-a", &["GPU-a"]), ev("p1", "GPU-a", &["GPU-a"])],
        );
        assert_eq!(ok.status, Status::Pass, "{}", ok.message);
        assert!(
            ok.message
                .starts_with("pods p0, p1 run on node n1 on physical GPU GPU-a"),
            "{}",
            ok.message
        );
        let split = same_gpu_verdict(
            None,
            &[ev("p0", "GPU-a", &["GPU-a"]), ev("p1", "GPU-b", &["GPU-b"])],
        );
        assert_eq!(
            split.message,
            "the pods' claims got devices of 2 physical GPUs (GPU-a, GPU-b), not one"
        );
        let leak = same_gpu_verdict(None, &[ev("p0", "GPU-a", &["GPU-a", "GPU-b"])]);
        assert_eq!(
            leak.message,
            "pod p0's claim got GPU-a but nvidia-smi in the pod reports [GPU-a, GPU-b]"
        );
        let mut far = ev("p0", "GPU-a", &["GPU-a"]);
        far.devices[0].3 = Some("n2".into());
        assert!(
            same_gpu_verdict(None, &[far])
                .message
                .contains("runs on node n1 but its claim p0-claim got n1/gpu-0-shared of node n2")
        );
        let pinned = same_gpu_verdict(Some("GPU-b"), &[ev("p0", "GPU-a", &["GPU-a"])]);
        assert_eq!(
            pinned.message,
            "the claims were pinned to GPU-b but got GPU-a"
        );
    }

    #[test]
    fn fill_plan_counts_what_fits() {
        let s = share("gpu-0-shared", "GPU-a", 40 << 30, true);
        let (req, fit) = fill_plan(&[&s]);
        assert_eq!(req["memory"], 20 << 30);
        assert_eq!(fit, 2);
        // Replicas: exclusive devices, one claim each.
        let r: Vec<SliceDevice> = (0..4)
            .map(|i| dev(&format!("gpu-0-shared-{i}"), "GPU-a", "share"))
            .collect();
        let refs: Vec<&SliceDevice> = r.iter().collect();
        assert_eq!(fill_plan(&refs).1, 4);
        // Multi-allocatable without capacity: unlimited.
        let u = share("gpu-0-shared", "GPU-a", 0, false);
        assert_eq!(fill_plan(&[&u]).1, u128::MAX);
    }

    #[test]
    fn mig_verdicts() {
        let m = |pod: &str, dev: &str, uuid: Option<&str>, listed: &[&str]| MigEvidence {
            pod: pod.into(),
            device: dev.into(),
            device_uuid: uuid.map(Into::into),
            listed: listed.iter().map(|s| s.to_string()).collect(),
        };
        let ok = mig_verdict(&[
            m("mig-0", "n1/gpu-0-mig-1", Some("MIG-a"), &["MIG-a"]),
            m("mig-1", "n1/gpu-0-mig-2", None, &["MIG-b"]),
        ]);
        assert_eq!(ok.status, Status::Pass, "{}", ok.message);
        let all = mig_verdict(&[m("mig-0", "n1/x", None, &["MIG-a", "MIG-b"])]);
        assert!(
            all.message.contains("lists 2 MIG devices"),
            "{}",
            all.message
        );
        let same = mig_verdict(&[
            m("mig-0", "n1/x", None, &["MIG-a"]),
            m("mig-1", "n1/y", None, &["MIG-a"]),
        ]);
        assert_eq!(same.status, Status::Fail);
        let wrong = mig_verdict(&[m("mig-0", "n1/x", Some("MIG-a"), &["MIG-b"])]);
        assert_eq!(wrong.message, "pod mig-0 got n1/x (MIG-a) but sees MIG-b");
    }

    #[test]
    fn count_and_health_verdicts() {
        let out = ProbeOutput::parse("RESULT: ACCELERATOR_COUNT=2\nHEALTH: OK\nPROBE: DONE\n");
        assert_eq!(
            count_verdict("pod p", 1, &out),
            Err("pod p sees 2 /dev/nvidia[0-9]* device nodes, expected 1".into())
        );
        assert!(count_verdict("pod p", 2, &out).is_ok());
        let rec = |pod: &str, expect_gpu: bool, log: &str| ProbeRecord {
            check: "c".into(),
            pod: pod.into(),
            container: "probe".into(),
            expect_gpu,
            output: ProbeOutput::parse(log),
        };
        let good = vec![
            rec("a", true, "HEALTH: OK\n"),
            rec("b", false, "HEALTH: SKIP no claim in this container\n"),
        ];
        assert_eq!(health_verdict(&good).status, Status::Pass);
        let bad = vec![
            rec(
                "a",
                true,
                "HEALTH: FAIL nvidia-smi reports an error: ERR!\n",
            ),
            rec("b", true, ""),
        ];
        let o = health_verdict(&bad);
        assert_eq!(o.status, Status::Fail);
        assert!(o.message.starts_with("2 of 2 health scripts failed: pod a container probe (c): nvidia-smi reports an error: ERR!; pod b"), "{}", o.message);
        assert_eq!(health_verdict(&[]).status, Status::Fail);
    }
}
