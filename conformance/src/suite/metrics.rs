//! `accelerator-metrics`: the node's metrics endpoint serves per-GPU
//! utilization and memory in Prometheus format, and they follow a real
//! load (the CNCF AI conformance's accelerator_metrics). A pod holding a
//! whole GPU runs the CUDA probe with `--alloc` and `--busy`: while it
//! runs, the GPU's utilization must rise above 0 and the claim's memory
//! reach what it allocated; after it ends, both fall back.
//!
//! The endpoint is the node process's `/metrics`: either its plain one
//! (`--metrics-url`: the chart serves it on the node's loopback, reach it
//! with `kubectl port-forward` to the node's Tessera pod), or the chart's
//! authenticated Service (`--metrics-service`, [`super::metrics_service`]),
//! as a scraper in the cluster reads it.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use serde_json::json;

use super::checks::Outcome;
use super::facts;
use super::metrics_service::{self, Scraper};
use super::probe::{self, ClaimSource};
use super::{Ctx, CudaProbe, MetricsSource};

const CHECK: &str = "accelerator-metrics";
/// What the probe allocates: 1 GiB, a multiple of any allocation
/// granularity, so NVML reports exactly this much.
const ALLOC: u64 = 1 << 30;
/// How long the probe keeps its GPU busy: long enough for a few scrapes.
const BUSY_SECONDS: u64 = 20;

pub async fn accelerator_metrics(ctx: &Ctx) -> Result<Outcome> {
    if ctx.cuda_probe.is_none() {
        return Ok(Outcome::skip(
            "needs a CUDA probe to load a GPU: pass --cuda-probe-image (Tessera's own image \
             runs `/bin/tessera probe`)",
        ));
    }
    match &ctx.metrics {
        None => Ok(Outcome::skip(
            "needs the node's metrics: pass --metrics-service NAMESPACE/NAME (the chart's \
             metrics.service), or --metrics-url (e.g. after `kubectl -n <namespace> \
             port-forward pod/<tessera pod on the node> 9400`, http://127.0.0.1:9400/metrics)",
        )),
        Some(MetricsSource::Url(url)) => under_load(ctx, &Scraper::plain(url), Vec::new()).await,
        Some(MetricsSource::Service(service)) => through_service(ctx, service).await,
    }
}

/// Through the Service: its access checked first, then the load, with the
/// run's ClusterRole removed whatever happened.
async fn through_service(ctx: &Ctx, service: &str) -> Result<Outcome> {
    let url = metrics_service::endpoint_on(&ctx.kube.client, service, &ctx.node).await?;
    let readers =
        metrics_service::Readers::make(&ctx.kube.client, &ctx.kube.ns, "/metrics").await?;
    let checked = async {
        let mut details = vec![format!("Service {service}: endpoint on node {}", ctx.node)];
        match metrics_service::guarded_scraper(&url, &readers, &mut details).await? {
            Ok(scraper) => under_load(ctx, &scraper, details).await,
            Err(why) => Ok(Outcome::fail(why, details)),
        }
    }
    .await;
    readers.remove().await;
    checked
}

/// The GPU's utilization and the claim's memory follow a probe's load.
async fn under_load(ctx: &Ctx, scraper: &Scraper, mut details: Vec<String>) -> Result<Outcome> {
    let url = &scraper.url;
    let cuda = ctx.cuda_probe.as_ref().context("no CUDA probe")?;
    let idle = scraper
        .scrape()
        .await
        .with_context(|| format!("scraping {url}"))?;
    let gpus = series(&idle, "tessera_gpu_utilization_ratio");
    if gpus.is_empty() {
        return Ok(Outcome::fail(
            format!("{url} serves no tessera_gpu_utilization_ratio"),
            [details, vec![first_lines(&idle)]].concat(),
        ));
    }

    let template = probe::claim_template(
        "metrics-gpu",
        CHECK,
        probe::device_request("gpu", &ctx.classes.gpu, &[], &Default::default()),
    );
    ctx.kube.create::<ResourceClaimTemplate>(template).await?;
    let claim = ClaimSource::Template("metrics-gpu".into());
    let container = load_container(cuda);
    let pod = probe::pod(CHECK, CHECK, &ctx.node, Some(&claim), vec![container]);
    let pod: Pod = ctx.kube.create(pod).await?;
    let name = pod.metadata.name.clone().unwrap_or_default();
    let scheduled = ctx.kube.wait_scheduled(std::slice::from_ref(&name)).await?;
    let allocated = ctx.kube.allocated(&scheduled[0]).await?;
    let [one] = allocated.as_slice() else {
        bail!(
            "pod {name} got {} devices, not one whole GPU",
            allocated.len()
        );
    };
    let gpu = ctx
        .devices
        .iter()
        .find(|d| d.pool == one.pool && d.name == one.device)
        .and_then(facts::SliceDevice::physical_gpu)
        .with_context(|| format!("device {} is not in the node's slices", one.id()))?
        .to_owned();
    let claim = one.claim.clone();
    details.push(format!("pod {name}: claim {claim} got GPU {gpu}"));

    // Under load: utilization above 0, the claim's memory what it holds.
    let reading = |text: &str| {
        let gpu_label = format!("gpu=\"{gpu}\"");
        let claim_label = format!("claim=\"{claim}\"");
        (
            value(text, "tessera_gpu_utilization_ratio", &[&gpu_label]),
            value(
                text,
                "tessera_claim_memory_used_bytes",
                &[&claim_label, &gpu_label],
            ),
        )
    };
    let loaded = wait_scrape(scraper, ctx.kube.timeout, |text| match reading(text) {
        (Some(util), Some(memory)) if util > 0.0 && memory >= ALLOC as f64 => Some((util, memory)),
        _ => None,
    })
    .await;
    let Some((util, memory)) = loaded else {
        details.push(first_lines(&scraper.scrape().await.unwrap_or_default()));
        return Ok(Outcome::fail(
            format!(
                "while pod {name} loaded GPU {gpu} ({ALLOC} bytes, spin kernels), {url} never \
                 showed its utilization above 0 and claim {claim}'s memory at {ALLOC} bytes"
            ),
            details,
        ));
    };
    details.push(format!(
        "under load: utilization {util}, claim memory {memory} bytes"
    ));

    // After: the pod ends by itself; both fall back.
    ctx.kube.wait_finished(std::slice::from_ref(&name)).await?;
    let settled = wait_scrape(scraper, ctx.kube.timeout, |text| match reading(text) {
        (Some(util), memory) if util == 0.0 && memory.unwrap_or(0.0) == 0.0 => Some(()),
        _ => None,
    })
    .await;
    if settled.is_none() {
        return Ok(Outcome::fail(
            format!(
                "after pod {name} ended, GPU {gpu}'s utilization or claim {claim}'s memory stayed above 0"
            ),
            details,
        ));
    }
    Ok(Outcome::pass(
        format!(
            "{url}: GPU {gpu}'s utilization rose to {util} and claim {claim}'s memory to \
             {memory} bytes under a pod's load, and both fell to 0 after it"
        ),
        details,
    ))
}

/// The probe, allocating [`ALLOC`] and busy for [`BUSY_SECONDS`].
fn load_container(cuda: &CudaProbe) -> serde_json::Value {
    let mut args = cuda.command.clone();
    args.extend([
        "--alloc".to_owned(),
        ALLOC.to_string(),
        "--busy".to_owned(),
        BUSY_SECONDS.to_string(),
    ]);
    json!({
        "name": "load",
        "image": cuda.image,
        "imagePullPolicy": "IfNotPresent",
        "command": args,
        "resources": { "claims": [{ "name": probe::POD_CLAIM }] },
    })
}

/// Scrapes until `done` finds what it waits for, at most `timeout`.
async fn wait_scrape<T>(
    scraper: &Scraper,
    timeout: Duration,
    done: impl Fn(&str) -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = scraper.scrape().await.ok().as_deref().and_then(&done) {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `GET` of an `http://host:port/path` URL; the body.
pub fn scrape(url: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("{url}: only http:// URLs are supported"))?;
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, format!("/{p}")),
        None => (rest, "/metrics".to_owned()),
    };
    let addr = authority
        .to_socket_addrs()?
        .next()
        .with_context(|| format!("{authority} resolves to no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {authority}\r\nAccept: text/plain\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("no HTTP header in the answer")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("{url} answered {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}

/// The label sets of `metric`'s series.
fn series<'a>(text: &'a str, metric: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.strip_prefix(metric)?.strip_prefix('{'))
        .collect()
}

/// The value of the one series of `metric` whose labels include every
/// `labels` entry (`name="value"`).
pub fn value(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(metric)?.strip_prefix('{')?;
        let (set, value) = rest.rsplit_once("} ")?;
        let names: Vec<&str> = set.split(',').collect();
        labels
            .iter()
            .all(|want| names.contains(want))
            .then(|| value.trim().parse().ok())?
    })
}

fn first_lines(text: &str) -> String {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .take(20)
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE tessera_gpu_utilization_ratio gauge
tessera_gpu_utilization_ratio{gpu=\"GPU-a\"} 0.75
tessera_gpu_utilization_ratio{gpu=\"GPU-ab\"} 0.0
tessera_claim_memory_used_bytes{namespace=\"n\",claim=\"c\",gpu=\"GPU-a\"} 1073741824
tessera_claim_memory_used_bytes_total{claim=\"c\",gpu=\"GPU-a\"} 5
";

    #[test]
    fn values_are_read_by_exact_labels() {
        assert_eq!(
            value(TEXT, "tessera_gpu_utilization_ratio", &["gpu=\"GPU-a\""]),
            Some(0.75)
        );
        assert_eq!(
            value(TEXT, "tessera_gpu_utilization_ratio", &["gpu=\"GPU-ab\""]),
            Some(0.0)
        );
        assert_eq!(
            value(
                TEXT,
                "tessera_claim_memory_used_bytes",
                &["claim=\"c\"", "gpu=\"GPU-a\""]
            ),
            Some(1073741824.0)
        );
        assert_eq!(
            value(TEXT, "tessera_gpu_utilization_ratio", &["gpu=\"GPU-b\""]),
            None
        );
        assert_eq!(series(TEXT, "tessera_gpu_utilization_ratio").len(), 2);
    }
}
