//! `tessera-conformance`: the KAR-0003 GPU-sharing checks, run against any
//! cluster reachable through a kubeconfig (see docs/conformance.md).
//!
//! The run creates its own namespace `tessera-conformance-<random>`, runs
//! the checks one after the other (each cleans up its pods and claims so the
//! next one finds the GPUs free), and deletes the namespace at the end, also
//! when a check fails or the run is interrupted with Ctrl-C.

pub mod admin;
pub mod checks;
pub mod facts;
pub mod isolation;
pub mod metrics;
pub mod metrics_service;
pub mod ops;
pub mod probe;
pub mod report;
pub mod versions;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::json;

use self::facts::SliceDevice;
use self::ops::Kube;
use self::report::{CheckResult, Report, Status};

/// Check ids, in the order they run.
pub const CHECKS: &[(&str, &str)] = &[
    (
        "logical-gpus",
        "one physical GPU is exposed as several allocatable logical devices",
    ),
    (
        "template-shared-gpu",
        "pods from a ResourceClaimTemplate share one physical GPU",
    ),
    (
        "shared-claim",
        "pods sharing one ResourceClaim see the same GPU",
    ),
    (
        "over-allocation-blocked",
        "allocating more than a GPU's logical devices is refused by the scheduler",
    ),
    (
        "mig-distinct",
        "MIG devices are distinct schedulable devices",
    ),
    (
        "secure-one-device",
        "a pod with a one-device claim sees exactly one accelerator",
    ),
    (
        "driver-versions",
        "a pod's nvidia-smi reports the driver and CUDA versions its device publishes",
    ),
    (
        "secure-no-claim",
        "a pod without a claim sees no accelerator",
    ),
    (
        "secure-two-containers",
        "only the container that references the claim sees the accelerator",
    ),
    (
        "extended-resource",
        "a pod asking resources.limits for the GPU class's extended resource sees exactly one accelerator",
    ),
    (
        "accelerator-metrics",
        "the node's metrics endpoint serves GPU utilization and claim memory that follow a pod's load",
    ),
    (
        "health-script",
        "every pod's accelerator health script reports no error",
    ),
    (
        "isolated-limits",
        "an Isolated share gets its SMs and memory, also with its environment raised",
    ),
    (
        "admin-access-class",
        "claims with adminAccess ask the monitoring class, not a work class",
    ),
];

#[derive(Parser, Debug, Clone)]
#[command(
    name = "tessera-conformance",
    version,
    about = "KAR-0003 GPU-sharing conformance checks for a DRA GPU driver, against any cluster"
)]
pub struct Args {
    /// Kubeconfig file (default: KUBECONFIG, ~/.kube/config, or in-cluster).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// DRA driver name whose devices are checked.
    #[arg(long, default_value = "gpu.tessera.dev")]
    pub driver: String,
    /// DeviceClass of whole GPUs (default gpu.<domain of --driver>).
    #[arg(long)]
    pub gpu_class: Option<String>,
    /// DeviceClass of MIG devices (default mig.<domain>).
    #[arg(long)]
    pub mig_class: Option<String>,
    /// DeviceClass whose devices several claims can get on one physical GPU
    /// (default gpu-shared.<domain>).
    #[arg(long)]
    pub shared_class: Option<String>,
    /// DeviceClass of Isolated shares (default gpu-isolated.<domain>).
    #[arg(long)]
    pub isolated_class: Option<String>,
    /// Node to run on (default: the first node with ResourceSlices of the driver).
    #[arg(long)]
    pub node: Option<String>,
    /// Probe image; needs /bin/sh (nvidia-smi comes from the driver's CDI spec).
    #[arg(long, default_value = "tessera.local/probe:1")]
    pub image: String,
    /// Image with the CUDA probe, for `isolated-limits` (Tessera's own
    /// image has it); without it that check is skipped.
    #[arg(long)]
    pub cuda_probe_image: Option<String>,
    /// The node process's metrics endpoint on the checked node (plain
    /// HTTP, e.g. http://127.0.0.1:9400/metrics through `kubectl
    /// port-forward`), for `accelerator-metrics`; without it that check is
    /// skipped.
    #[arg(long, conflicts_with = "metrics_service")]
    pub metrics_url: Option<String>,
    /// The chart's authenticated metrics Service (`metrics.service`), as
    /// NAMESPACE/NAME, for `accelerator-metrics`: its endpoint on the
    /// checked node is read with a ServiceAccount token of the run, after
    /// checking that requests without a token or access are refused.
    #[arg(long)]
    pub metrics_service: Option<String>,
    /// The probe's command in that image.
    #[arg(long, default_value = "/bin/tessera probe", value_delimiter = ' ')]
    pub cuda_probe_command: Vec<String>,
    /// Deadline for each wait of a check, e.g. 180s, 5m.
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Run only these checks (comma-separated ids).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Write a JUnit XML report here.
    #[arg(long)]
    pub junit: Option<PathBuf>,
    /// Write a Markdown report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Leave the namespace (and its pods) in place for debugging.
    #[arg(long)]
    pub keep_namespace: bool,
}

/// `90`, `90s`, `5m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('s') => (&s[..s.len() - 1], 1),
        Some('m') => (&s[..s.len() - 1], 60),
        Some('h') => (&s[..s.len() - 1], 3600),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 90s, 5m"))?;
    if n == 0 {
        return Err("the timeout must be positive".into());
    }
    Ok(Duration::from_secs(n * mul))
}

/// The DeviceClasses the checks use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classes {
    pub gpu: String,
    pub mig: String,
    pub shared: String,
    pub isolated: String,
}

impl Classes {
    pub fn resolve(args: &Args) -> Self {
        let domain = facts::class_domain(&args.driver);
        Self {
            gpu: args
                .gpu_class
                .clone()
                .unwrap_or_else(|| format!("gpu.{domain}")),
            mig: args
                .mig_class
                .clone()
                .unwrap_or_else(|| format!("mig.{domain}")),
            shared: args
                .shared_class
                .clone()
                .unwrap_or_else(|| format!("gpu-shared.{domain}")),
            isolated: args
                .isolated_class
                .clone()
                .unwrap_or_else(|| format!("gpu-isolated.{domain}")),
        }
    }
}

/// The ids to run, in order; unknown ids in `--only` are an error.
pub fn selected_checks(only: &[String]) -> Result<Vec<&'static str>> {
    let only: Vec<&str> = only
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    for id in &only {
        if !CHECKS.iter().any(|(c, _)| c == id) {
            let known: Vec<&str> = CHECKS.iter().map(|(c, _)| *c).collect();
            bail!("unknown check {id:?}; known: {}", known.join(", "));
        }
    }
    Ok(CHECKS
        .iter()
        .map(|(c, _)| *c)
        .filter(|c| only.is_empty() || only.contains(c))
        .collect())
}

pub fn title(id: &str) -> &'static str {
    CHECKS.iter().find(|(c, _)| *c == id).map_or("", |(_, t)| t)
}

/// A short random suffix for the namespace (no RNG dependency: the clock
/// and the process id, mixed).
fn random_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    let mut x = nanos ^ (u64::from(std::process::id()) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let alphabet = b"bcdfghjklmnpqrstvwxz2456789";
    (0..6)
        .map(|i| alphabet[((x >> (i * 8)) % alphabet.len() as u64) as usize] as char)
        .collect()
}

async fn client(args: &Args) -> Result<(Client, String)> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .context("loading kubeconfig")?
        }
        None => Config::infer()
            .await
            .context("finding a kubeconfig (KUBECONFIG, ~/.kube/config, in-cluster)")?,
    };
    config.read_timeout = Some(Duration::from_secs(60));
    let url = config.cluster_url.to_string();
    Ok((
        Client::try_from(config).context("building the Kubernetes client")?,
        url,
    ))
}

/// What every check sees of the cluster.
pub struct Ctx {
    pub kube: Kube,
    pub driver: String,
    pub node: String,
    pub image: String,
    pub classes: Classes,
    /// The driver's devices on the node.
    pub devices: Vec<SliceDevice>,
    /// Attribute equalities of each class's selectors (gpu, mig, shared).
    pub class_match: [Vec<(String, String)>; 3],
    /// Every probe container's output so far (for `health-script`).
    pub probes: std::sync::Mutex<Vec<checks::ProbeRecord>>,
    /// Where the CUDA probe is, if given.
    pub cuda_probe: Option<CudaProbe>,
    /// Where the node's metrics are read, if given.
    pub metrics: Option<MetricsSource>,
}

/// Where `accelerator-metrics` reads the node's metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsSource {
    /// The node process's plain endpoint.
    Url(String),
    /// The chart's authenticated Service, `namespace/name`.
    Service(String),
}

/// An image with the CUDA probe and its command there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaProbe {
    pub image: String,
    pub command: Vec<String>,
}

impl Ctx {
    pub fn devices_of_class(&self, which: usize) -> Vec<&SliceDevice> {
        self.devices
            .iter()
            .filter(|d| facts::matches_class(d, &self.class_match[which]))
            .collect()
    }
}

async fn class_equalities(client: &Client, name: &str) -> Result<Vec<(String, String)>> {
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class = classes
        .get_opt(name)
        .await
        .with_context(|| format!("reading DeviceClass {name}"))?;
    let Some(class) = class else {
        return Ok(vec![("__missing__".into(), name.into())]);
    };
    Ok(class
        .spec
        .iter()
        .flat_map(|s| s.selectors.iter().flatten())
        .filter_map(|s| s.cel.as_ref())
        .flat_map(|c| facts::selector_equalities(&c.expression))
        .collect())
}

fn log(line: &str) {
    eprintln!("[conformance] {line}");
}

/// Runs the suite; `Ok(true)` iff every check passed or was skipped.
pub async fn run(args: Args) -> Result<bool> {
    let ids = selected_checks(&args.only)?;
    let classes = Classes::resolve(&args);
    let (client, url) = client(&args).await?;
    let slices: Vec<ResourceSlice> = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing ResourceSlices")?
        .items;
    let node = match &args.node {
        Some(n) => n.clone(),
        None => facts::nodes_with_devices(&slices, &args.driver)
            .into_iter()
            .next()
            .with_context(|| {
                format!(
                    "no node has ResourceSlices with devices of driver {}",
                    args.driver
                )
            })?,
    };
    let devices = facts::devices_of(&slices, &args.driver, Some(&node));
    let class_match = [
        class_equalities(&client, &classes.gpu).await?,
        class_equalities(&client, &classes.mig).await?,
        class_equalities(&client, &classes.shared).await?,
    ];
    let ns = format!("tessera-conformance-{}", random_suffix());
    log(&format!(
        "cluster {url}, driver {}, node {node} ({} devices), namespace {ns}",
        args.driver,
        devices.len()
    ));
    log(&format!(
        "classes: gpu {}, mig {}, shared {}, isolated {}; image {}; timeout {:?}",
        classes.gpu, classes.mig, classes.shared, classes.isolated, args.image, args.timeout
    ));
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns_obj: Namespace = serde_json::from_value(json!({
        "metadata": { "name": ns, "labels": { probe::MANAGED_BY.0: probe::MANAGED_BY.1 } }
    }))?;
    namespaces
        .create(&PostParams::default(), &ns_obj)
        .await
        .with_context(|| format!("creating namespace {ns}"))?;

    let (claim_log, claim_watch) = match ops::watch_claims(client.clone(), &ns).await {
        Ok(watch) => watch,
        Err(e) => {
            delete_namespace(&namespaces, &ns, args.timeout).await;
            return Err(e);
        }
    };
    let ctx = Ctx {
        kube: Kube {
            client: client.clone(),
            ns: ns.clone(),
            timeout: args.timeout,
            claim_log,
        },
        driver: args.driver.clone(),
        node: node.clone(),
        image: args.image.clone(),
        classes: classes.clone(),
        devices,
        class_match,
        probes: std::sync::Mutex::new(Vec::new()),
        cuda_probe: args.cuda_probe_image.clone().map(|image| CudaProbe {
            image,
            command: args
                .cuda_probe_command
                .iter()
                .filter(|w| !w.is_empty())
                .cloned()
                .collect(),
        }),
        metrics: match (&args.metrics_service, &args.metrics_url) {
            (Some(service), _) => Some(MetricsSource::Service(service.clone())),
            (None, Some(url)) => Some(MetricsSource::Url(url.clone())),
            (None, None) => None,
        },
    };
    let mut report = Report {
        started: report::utc_timestamp(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
        ),
        cluster: url,
        driver: args.driver.clone(),
        node,
        namespace: ns.clone(),
        classes: vec![
            ("gpu".into(), classes.gpu.clone()),
            ("mig".into(), classes.mig.clone()),
            ("shared".into(), classes.shared.clone()),
            ("isolated".into(), classes.isolated.clone()),
        ],
        results: Vec::new(),
    };

    let interrupted = tokio::select! {
        () = run_checks(&ctx, &ids, &mut report.results) => false,
        () = interrupted() => true,
    };
    if interrupted {
        log("interrupted (SIGINT/SIGTERM): cleaning up");
        let missing: Vec<&str> = ids
            .iter()
            .copied()
            .filter(|id| !report.results.iter().any(|r| r.id == *id))
            .collect();
        for id in missing {
            report.results.push(CheckResult {
                id: (*id).to_owned(),
                title: title(id).to_owned(),
                status: Status::Fail,
                message: "interrupted (SIGINT/SIGTERM) before it finished".into(),
                details: Vec::new(),
                duration: Duration::ZERO,
            });
        }
    }

    claim_watch.abort();
    if args.keep_namespace {
        log(&format!("keeping namespace {ns} (--keep-namespace)"));
    } else {
        delete_namespace(&namespaces, &ns, args.timeout).await;
    }

    println!("\n{}", report.summary_table());
    if let Some(path) = &args.junit {
        std::fs::write(path, report.junit())
            .with_context(|| format!("writing {}", path.display()))?;
        log(&format!("JUnit XML: {}", path.display()));
    }
    if let Some(path) = &args.report {
        std::fs::write(path, report.markdown())
            .with_context(|| format!("writing {}", path.display()))?;
        log(&format!("Markdown report: {}", path.display()));
    }
    Ok(report.passed() && !interrupted)
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM.
async fn interrupted() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn run_checks(ctx: &Ctx, ids: &[&'static str], results: &mut Vec<CheckResult>) {
    for (i, id) in ids.iter().enumerate() {
        log(&format!("[{}/{}] {id}: {}", i + 1, ids.len(), title(id)));
        let started = Instant::now();
        let outcome = checks::run(ctx, id).await;
        let cleanup = ctx.kube.cleanup().await;
        let (status, message, details) = match outcome {
            Ok(o) => (o.status, o.message, o.details),
            Err(e) => (Status::Fail, format!("{e:#}"), Vec::new()),
        };
        let (status, message) = match cleanup {
            Err(e) if status != Status::Fail => (
                Status::Fail,
                format!("{message}; but cleanup failed: {e:#}"),
            ),
            _ => (status, message),
        };
        let r = CheckResult {
            id: (*id).to_owned(),
            title: title(id).to_owned(),
            status,
            message,
            details,
            duration: started.elapsed(),
        };
        log(&format!(
            "[{}/{}] {id}: {} - {}",
            i + 1,
            ids.len(),
            r.status.as_str(),
            r.message
        ));
        results.push(r);
    }
}

async fn delete_namespace(namespaces: &Api<Namespace>, ns: &str, timeout: Duration) {
    if let Err(e) = namespaces.delete(ns, &DeleteParams::default()).await {
        log(&format!("could not delete namespace {ns}: {e}"));
        return;
    }
    let deadline = Instant::now() + timeout;
    loop {
        match namespaces.get_opt(ns).await {
            Ok(None) => {
                log(&format!("deleted namespace {ns}"));
                return;
            }
            Ok(Some(_)) | Err(_) if Instant::now() >= deadline => {
                log(&format!(
                    "namespace {ns} still terminating after {timeout:?}"
                ));
                return;
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derives_class_names_from_the_driver() {
        let args = Args::parse_from(["t", "--driver", "gpu.nvidia.com"]);
        let c = Classes::resolve(&args);
        assert_eq!(c.gpu, "gpu.nvidia.com");
        assert_eq!(c.mig, "mig.nvidia.com");
        assert_eq!(c.shared, "gpu-shared.nvidia.com");
        let args = Args::parse_from(["t", "--mig-class", "m", "--timeout", "2m", "--only", "a,b"]);
        assert_eq!(Classes::resolve(&args).mig, "m");
        assert_eq!(Classes::resolve(&args).gpu, "gpu.tessera.dev");
        assert_eq!(args.timeout, Duration::from_secs(120));
        assert_eq!(args.only, vec!["a", "b"]);
    }

    #[test]
    fn selects_checks_in_order() {
        assert_eq!(selected_checks(&[]).unwrap().len(), CHECKS.len());
        let only = vec!["health-script".to_owned(), "logical-gpus".to_owned()];
        assert_eq!(
            selected_checks(&only).unwrap(),
            vec!["logical-gpus", "health-script"]
        );
        let err = selected_checks(&["nope".to_owned()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown check \"nope\""), "{err}");
    }

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn namespace_suffixes_are_dns_labels() {
        let s = random_suffix();
        assert_eq!(s.len(), 6);
        assert!(
            s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
    }
}
