//! What the cluster itself measures: the kubelet's DRA call histogram for
//! pods, the API server's write counters, and when a driver's first slice
//! appears.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use super::stats::{Histogram, parse_histogram, sum_counter};
use crate::cluster::TestCluster;

const KUBELET_HISTOGRAM: &str = "dra_grpc_operations_duration_seconds";

/// A client for the local kubelet's own HTTPS port, with the admin
/// credentials (the API server will not proxy to a loopback node address).
pub async fn kubelet_client(cluster: &TestCluster) -> Result<Client> {
    component_client(cluster, "KUBELET_PORT").await
}

/// A client for a component's own HTTPS port on loopback (`port_key` in
/// the cluster's `ports.env`), with the admin credentials.
pub async fn component_client(cluster: &TestCluster, port_key: &str) -> Result<Client> {
    let ports = cluster.state_dir().join("ports.env");
    let text =
        std::fs::read_to_string(&ports).with_context(|| format!("reading {}", ports.display()))?;
    let port = text
        .lines()
        .find_map(|l| l.strip_prefix(port_key)?.strip_prefix('='))
        .with_context(|| format!("no {port_key} in {}", ports.display()))?;
    let kubeconfig = Kubeconfig::read_from(cluster.kubeconfig())?;
    let mut config =
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.cluster_url = format!("https://127.0.0.1:{}", port.trim()).parse()?;
    Ok(Client::try_from(config)?)
}

/// A component's metrics (a client from [`component_client`]).
pub async fn component_metrics(component: &Client) -> Result<String> {
    metrics_of(component, "a component").await
}

/// The API server's own metrics.
pub async fn apiserver_metrics(client: &Client) -> Result<String> {
    metrics_of(client, "the API server").await
}

/// `GET /metrics` on whatever `client` points at (`whose` names it in
/// errors).
async fn metrics_of(client: &Client, whose: &str) -> Result<String> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .context("building the request")?;
    client
        .request_text(req)
        .await
        .with_context(|| format!("reading {whose}'s metrics"))
}

/// ResourceClaim events the API server has sent to watchers since it
/// started: one per event and watcher (the fan-out).
pub fn claim_watch_events(apiserver_metrics: &str) -> f64 {
    sum_counter(
        apiserver_metrics,
        "apiserver_watch_events_total",
        &[("resource", "resourceclaims")],
    )
}

/// ResourceClaim watches open now.
pub fn claim_watchers(apiserver_metrics: &str) -> f64 {
    sum_counter(
        apiserver_metrics,
        "apiserver_longrunning_requests",
        &[("resource", "resourceclaims"), ("verb", "WATCH")],
    )
}

/// Writes (create, update, patch, delete) the API server has served on
/// ResourceSlices since it started. Dry runs (a publisher's capability
/// probes) change nothing and are not counted.
pub fn slice_writes(apiserver_metrics: &str) -> f64 {
    [
        "POST",
        "PUT",
        "PATCH",
        "DELETE",
        "DELETECOLLECTION",
        "APPLY",
    ]
    .iter()
    .map(|verb| {
        sum_counter(
            apiserver_metrics,
            "apiserver_request_total",
            &[
                ("resource", "resourceslices"),
                ("verb", verb),
                ("dry_run", ""),
            ],
        )
    })
    .sum()
}

/// The kubelet's view of one DRA method of one driver.
pub fn kubelet_histogram(metrics: &str, driver: &str, method: &str) -> Histogram {
    // The label holds the full gRPC method (`/k8s.io...DRAPlugin/<method>`).
    let mut merged = Histogram::default();
    for line in metrics.lines().filter(|l| {
        l.starts_with(KUBELET_HISTOGRAM) && l.contains(&format!("DRAPlugin/{method}\""))
    }) {
        let Some(label) = line
            .split("method_name=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        let h = parse_histogram(
            line,
            KUBELET_HISTOGRAM,
            &[("driver_name", driver), ("method_name", label)],
        );
        for (le, n) in h.buckets {
            match merged.buckets.iter_mut().find(|(b, _)| *b == le) {
                Some(b) => b.1 += n,
                None => merged.buckets.push((le, n)),
            }
        }
        merged.sum += h.sum;
        merged.count += h.count;
    }
    merged.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    merged
}

/// Whether `driver` has published a slice for `pool`.
pub async fn has_slice(client: &Client, driver: &str, pool: &str) -> Result<bool> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.driver={driver}"));
    Ok(slices
        .list(&lp)
        .await?
        .items
        .iter()
        .any(|s| s.spec.pool.name == pool))
}

/// Waits for the first slice of `driver` for `pool`, then returns how long
/// after the start of the process in `pid_file` (first word: the pid) it
/// was seen. Times are kernel boot-time clock ticks, so the start of a
/// process launched by someone else is measured too.
pub async fn first_slice(
    client: &Client,
    driver: &str,
    pool: &str,
    pid_file: &Path,
    timeout: Duration,
) -> Result<Duration> {
    let deadline = Instant::now() + timeout;
    // Poll tightly: the answer is a latency, and a list is cheap here.
    let seen = loop {
        if has_slice(client, driver, pool).await? {
            break boot_time()?;
        }
        if Instant::now() > deadline {
            bail!("no slice of {driver} for {pool} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let pid: u32 = std::fs::read_to_string(pid_file)
        .with_context(|| format!("reading {}", pid_file.display()))?
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no pid in {}", pid_file.display()))?;
    let started = process_start(pid)?;
    Ok(seen.saturating_sub(started))
}

fn boot_time() -> Result<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        bail!("clock_gettime: {}", std::io::Error::last_os_error());
    }
    Ok(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// When a process started, on the boot-time clock (`/proc/<pid>/stat`
/// field 22, in clock ticks).
fn process_start(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces: field 3 first.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let ticks: u64 = after
        .split_whitespace()
        .nth(19)
        .and_then(|t| t.parse().ok())
        .context("no start time in /proc/<pid>/stat")?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dry_runs_are_not_slice_writes() {
        let metrics = "\
apiserver_request_total{code=\"201\",dry_run=\"\",resource=\"resourceslices\",verb=\"APPLY\"} 9
apiserver_request_total{code=\"201\",dry_run=\"All\",resource=\"resourceslices\",verb=\"POST\"} 4
apiserver_request_total{code=\"200\",dry_run=\"\",resource=\"resourceslices\",verb=\"LIST\"} 3
";
        assert_eq!(slice_writes(metrics), 9.0);
    }

    #[test]
    fn claim_fan_out_counts_only_claim_series() {
        let metrics = "\
# TYPE apiserver_watch_events_total counter
apiserver_watch_events_total{group=\"resource.k8s.io\",resource=\"resourceclaims\",version=\"v1\"} 1200
apiserver_watch_events_total{group=\"resource.k8s.io\",resource=\"resourceslices\",version=\"v1\"} 50
apiserver_watch_events_total_other{resource=\"resourceclaims\"} 7
apiserver_longrunning_requests{component=\"apiserver\",group=\"resource.k8s.io\",resource=\"resourceclaims\",scope=\"cluster\",subresource=\"\",verb=\"WATCH\",version=\"v1\"} 2
apiserver_longrunning_requests{component=\"apiserver\",group=\"resource.k8s.io\",resource=\"resourceclaims\",scope=\"namespace\",subresource=\"\",verb=\"WATCH\",version=\"v1\"} 1
apiserver_longrunning_requests{component=\"apiserver\",group=\"\",resource=\"pods\",scope=\"cluster\",subresource=\"\",verb=\"WATCH\",version=\"v1\"} 9
";
        assert_eq!(claim_watch_events(metrics), 1200.0);
        assert_eq!(claim_watchers(metrics), 3.0);
    }
}
