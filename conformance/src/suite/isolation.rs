//! `isolated-limits`: an Isolated share gets its SMs and memory, and cannot
//! take more by changing its environment, as a CUDA process measures it.
//!
//! One claim of an Isolated share enforced by MPS (a quarter of a GPU's
//! compute, at most 4Gi) and one Pod whose three containers share it, each
//! running the CUDA probe (`tessera probe`, from `--cuda-probe-image`):
//!
//! * `limits` tries to allocate 1.5x the claim's memory: refused;
//! * `raised` sets `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100` and a pinned
//!   memory limit of the whole GPU in its own environment first, then does
//!   the same: still refused, and no more SMs;
//! * `within` allocates half the claim's memory: it fits (so the refusals
//!   above are the limit, not a probe that cannot allocate at all).
//!
//! Every container must see at most `ceil(SMs x cores / 100)` of the GPU's
//! SMs (MPS rounds down to whole TPCs) and at most the claim's memory free.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use serde_json::{Value, json};
use tessera_api::probe::ProbeReport;

use super::checks::Outcome;
use super::facts::{self, SliceDevice};
use super::probe;
use super::{Ctx, CudaProbe};

const CHECK: &str = "isolated-limits";
const GIB: u128 = 1 << 30;
/// The share of the GPU's compute the claim asks for, percent.
const CORES: u128 = 25;

/// What the claim got and what each container may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The GPU's SMs, as its whole-GPU device publishes them.
    pub gpu_sms: u32,
    pub cores_percent: u32,
    pub memory_bytes: u64,
}

impl Limits {
    /// The most SMs a client may see.
    pub fn max_sms(&self) -> u32 {
        (self.gpu_sms * self.cores_percent).div_ceil(100)
    }
}

/// One probe of a claim (a container of the check's pod, a step of the
/// GPU self-test).
pub struct Run {
    pub name: &'static str,
    /// Bytes it tries to allocate.
    pub alloc: u64,
    /// What it sets in its own environment first (`NAME=VALUE`).
    pub env: Vec<String>,
    /// Whether that allocation must fit.
    pub fits: bool,
}

/// The probes of a claim, what each asks and whether its allocation must
/// fit: over the limit, over it with the environment raised, within it.
pub fn runs(limits: &Limits, gpu_memory: u64) -> [Run; 3] {
    let run = |name, alloc, env, fits| Run {
        name,
        alloc,
        env,
        fits,
    };
    let over = limits.memory_bytes + limits.memory_bytes / 2;
    let raise = vec![
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100".to_owned(),
        format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M",
            gpu_memory.div_ceil(1 << 20)
        ),
    ];
    [
        run("limits", over, Vec::new(), false),
        run("raised", over, raise, false),
        run("within", limits.memory_bytes / 2, Vec::new(), true),
    ]
}

pub async fn isolated_limits(ctx: &Ctx) -> Result<Outcome> {
    let Some(cuda) = &ctx.cuda_probe else {
        return Ok(Outcome::skip(
            "needs a CUDA probe: pass --cuda-probe-image (Tessera's own image runs \
             `/bin/tessera probe`)",
        ));
    };
    let Some((share, whole)) = isolated_share(&ctx.devices) else {
        return Ok(Outcome::skip(format!(
            "node {} publishes no Isolated share enforced by MPS beside its whole GPU",
            ctx.node
        )));
    };
    let classes: kube::Api<DeviceClass> = kube::Api::all(ctx.kube.client.clone());
    if classes.get_opt(&ctx.classes.isolated).await?.is_none() {
        return Ok(Outcome::fail(
            format!(
                "DeviceClass {} does not exist: install the driver's classes \
                 (deploy/deviceclasses.yaml) or name yours with --isolated-class",
                ctx.classes.isolated
            ),
            Vec::new(),
        ));
    }
    let gpu = share.physical_gpu().unwrap_or_default().to_owned();
    let (Some(sms), Some(gpu_memory)) = (
        whole.capacity.get("multiprocessors"),
        whole.capacity.get("memory"),
    ) else {
        return Ok(Outcome::skip(format!(
            "GPU {gpu}'s whole device {} publishes no multiprocessors or memory capacity",
            whole.name
        )));
    };
    let (memory, cores) = match (share.capacity.get("memory"), share.capacity.get("cores")) {
        (Some(m), Some(c)) => (
            facts::valid_request(m, (4 * GIB).min(m.value / 4)),
            facts::valid_request(c, CORES),
        ),
        _ => {
            return Ok(Outcome::skip(format!(
                "share device {} has no memory and cores capacity",
                share.name
            )));
        }
    };
    let limits = Limits {
        gpu_sms: u32::try_from(sms.value).unwrap_or(u32::MAX),
        cores_percent: u32::try_from(cores).unwrap_or(100),
        memory_bytes: u64::try_from(memory).unwrap_or(u64::MAX),
    };
    let gpu_memory = u64::try_from(gpu_memory.value).unwrap_or(u64::MAX);

    let attr = share.physical_attr().unwrap_or(facts::PARENT_UUID);
    let capacity = BTreeMap::from([
        ("memory".to_owned(), facts::format_quantity(memory)),
        ("cores".to_owned(), cores.to_string()),
    ]);
    let request = probe::device_request(
        probe::POD_CLAIM,
        &ctx.classes.isolated,
        &[facts::pin_expression(&ctx.driver, attr, &gpu)],
        &capacity,
    );
    ctx.kube
        .create::<ResourceClaim>(probe::claim(CHECK, CHECK, request))
        .await?;
    let runs = runs(&limits, gpu_memory);
    let containers = runs.iter().map(|r| container(cuda, r)).collect();
    let claim = probe::ClaimSource::Claim(CHECK.to_owned());
    ctx.kube
        .create::<Pod>(probe::pod(
            CHECK,
            CHECK,
            &ctx.node,
            Some(&claim),
            containers,
        ))
        .await?;
    ctx.kube.wait_finished(&[CHECK.to_owned()]).await?;

    let mut reports = Vec::new();
    for Run { name, .. } in &runs {
        let log = ctx.kube.logs(CHECK, name).await?;
        let report: ProbeReport = serde_json::from_str(&log)
            .with_context(|| format!("container {name} printed no probe report:\n{log}"))?;
        reports.push(report);
    }
    let expected: Vec<(&str, bool)> = runs.iter().map(|r| (r.name, r.fits)).collect();
    Ok(verdict(&gpu, &limits, &expected, &reports))
}

/// An Isolated share enforced by MPS and its GPU's whole device.
pub fn isolated_share(devices: &[SliceDevice]) -> Option<(&SliceDevice, &SliceDevice)> {
    devices
        .iter()
        .filter(|d| {
            d.attr("isolationLevel") == Some("Isolated")
                && matches!(d.attr("isolationProvider"), None | Some("mps"))
                && d.capacity.get("memory").is_some_and(|c| c.consumable)
        })
        .find_map(|share| {
            let gpu = share.physical_gpu()?;
            let whole = devices
                .iter()
                .find(|d| d.attr(facts::TYPE) == Some("gpu") && d.attr(facts::UUID) == Some(gpu))?;
            Some((share, whole))
        })
}

/// A container running the probe on the pod's claim.
fn container(cuda: &CudaProbe, run: &Run) -> Value {
    let mut args = cuda.command.clone();
    args.extend(["--alloc".to_owned(), run.alloc.to_string()]);
    for e in &run.env {
        args.extend(["--set-env".to_owned(), e.clone()]);
    }
    json!({
        "name": run.name,
        "image": cuda.image,
        "imagePullPolicy": "IfNotPresent",
        "command": args,
        "resources": { "claims": [{ "name": probe::POD_CLAIM }] },
    })
}

/// Pass iff every container saw the claim's GPU only, no more SMs or free
/// memory than the claim's, and each allocation fitted exactly when it
/// should (`expected`: container name, whether its allocation must fit).
pub fn verdict(
    gpu: &str,
    limits: &Limits,
    expected: &[(&str, bool)],
    reports: &[ProbeReport],
) -> Outcome {
    let mut problems = Vec::new();
    let mut details = Vec::new();
    for ((name, fits), report) in expected.iter().zip(reports) {
        details.push(format!("{name}: {}", describe(report)));
        problems.extend(
            check_report(gpu, limits, *fits, report)
                .into_iter()
                .map(|p| format!("{name}: {p}")),
        );
    }
    if reports.len() != expected.len() {
        problems.push(format!(
            "{} probe reports for {} containers",
            reports.len(),
            expected.len()
        ));
    }
    if problems.is_empty() {
        Outcome::pass(
            format!(
                "an Isolated share of GPU {gpu} ({}% / {} bytes) held at most {} SMs and its \
                 memory in every container, also with its environment raised",
                limits.cores_percent,
                limits.memory_bytes,
                limits.max_sms()
            ),
            details,
        )
    } else {
        Outcome::fail(problems.join("; "), details)
    }
}

/// What one probe saw, in a line: SMs, free and total memory, the
/// allocation and the MPS environment it ran with.
pub fn describe(report: &ProbeReport) -> String {
    let Some(device) = report.devices.first() else {
        return format!(
            "no CUDA device ({})",
            report.error.as_deref().unwrap_or("none enumerated")
        );
    };
    let allocation = device.allocation.as_ref();
    format!(
        "{} SMs, {} free of {}, allocating {} {}; environment {:?} / {:?}",
        device.multiprocessors,
        device
            .memory_free_bytes
            .map_or("?".into(), |b| facts::format_quantity(b.into())),
        facts::format_quantity(device.memory_total_bytes.into()),
        allocation.map_or("?".into(), |a| facts::format_quantity(a.bytes.into())),
        match allocation {
            Some(a) if a.ok => "fitted".to_owned(),
            Some(a) => format!("was refused ({})", a.error.as_deref().unwrap_or("?")),
            None => "was not tried".to_owned(),
        },
        report.environment.cuda_mps_active_thread_percentage,
        report.environment.cuda_mps_pinned_device_mem_limit,
    )
}

/// Where one probe got more than `limits` allow on GPU `gpu` (or could
/// not allocate what fits: `fits`, whether its allocation must fit).
pub fn check_report(gpu: &str, limits: &Limits, fits: bool, report: &ProbeReport) -> Vec<String> {
    let Some(device) = report.devices.first() else {
        return vec![format!(
            "no CUDA device ({})",
            report.error.as_deref().unwrap_or("none enumerated")
        )];
    };
    let mut problems = Vec::new();
    if report.devices.len() != 1 || device.gpu_uuid != gpu {
        problems.push(format!(
            "sees {:?}, not GPU {gpu} alone",
            report.devices.iter().map(|d| &d.uuid).collect::<Vec<_>>()
        ));
    }
    if device.multiprocessors <= 0 || device.multiprocessors as u32 > limits.max_sms() {
        problems.push(format!(
            "{} SMs, want 1..={} ({}% of {})",
            device.multiprocessors,
            limits.max_sms(),
            limits.cores_percent,
            limits.gpu_sms
        ));
    }
    if let Some(free) = device
        .memory_free_bytes
        .filter(|free| *free > limits.memory_bytes)
    {
        problems.push(format!(
            "{free} bytes free, more than the claim's {}",
            limits.memory_bytes
        ));
    }
    match device.allocation.as_ref() {
        Some(a) if a.ok != fits => problems.push(format!(
            "allocating {} bytes {}",
            a.bytes,
            if a.ok {
                "fitted, beyond the claim's memory"
            } else {
                "was refused within the claim's memory"
            }
        )),
        None => problems.push("no allocation was tried".to_owned()),
        _ => {}
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::probe::{ProbeAllocation, ProbeDevice, ProbeEnvironment};

    const GPU: &str = "GPU-1";
    const LIMITS: Limits = Limits {
        gpu_sms: 132,
        cores_percent: 25,
        memory_bytes: 4 << 30,
    };
    const EXPECTED: [(&str, bool); 3] = [("limits", false), ("raised", false), ("within", true)];

    fn report(sms: i32, free: u64, bytes: u64, ok: bool) -> ProbeReport {
        ProbeReport {
            library: "libcuda.so.1".into(),
            cuda_driver_version: Some(13000),
            environment: ProbeEnvironment::default(),
            container: None,
            devices: vec![ProbeDevice {
                ordinal: 0,
                uuid: GPU.into(),
                gpu_uuid: GPU.into(),
                name: "H100".into(),
                multiprocessors: sms,
                memory_total_bytes: 80 << 30,
                memory_free_bytes: Some(free),
                allocation: Some(ProbeAllocation {
                    bytes,
                    ok,
                    error: (!ok).then(|| "CUDA_ERROR_OUT_OF_MEMORY".into()),
                }),
                kernels: None,
                error: None,
            }],
            error: None,
        }
    }

    #[test]
    fn a_share_held_to_its_limits_passes() {
        let reports = [
            report(32, 4 << 30, 6 << 30, false),
            report(32, 4 << 30, 6 << 30, false),
            report(32, 4 << 30, 2 << 30, true),
        ];
        let o = verdict(GPU, &LIMITS, &EXPECTED, &reports);
        assert_eq!(o.status, crate::suite::report::Status::Pass, "{o:?}");
        assert_eq!(LIMITS.max_sms(), 33);
    }

    #[test]
    fn a_raised_environment_that_gains_anything_fails() {
        // The raised container got the whole GPU and its allocation fitted.
        let reports = [
            report(32, 4 << 30, 6 << 30, false),
            report(132, 80 << 30, 6 << 30, true),
            report(32, 4 << 30, 2 << 30, true),
        ];
        let o = verdict(GPU, &LIMITS, &EXPECTED, &reports);
        assert_eq!(o.status, crate::suite::report::Status::Fail);
        assert!(o.message.contains("raised: 132 SMs"), "{}", o.message);
        assert!(o.message.contains("raised: allocating"), "{}", o.message);
        assert!(o.message.contains("more than the claim's"), "{}", o.message);
    }

    #[test]
    fn a_probe_that_cannot_allocate_at_all_fails() {
        let reports = [
            report(32, 4 << 30, 6 << 30, false),
            report(32, 4 << 30, 6 << 30, false),
            report(32, 4 << 30, 2 << 30, false),
        ];
        let o = verdict(GPU, &LIMITS, &EXPECTED, &reports);
        assert_eq!(o.status, crate::suite::report::Status::Fail);
        assert!(o.message.contains("within: allocating"), "{}", o.message);
    }
}
