//! Direct calls on a DRA plugin's socket, as the kubelet makes them: one
//! `NodePrepareResources` per claim, `concurrency` calls in flight, claims
//! stored (allocated) in the real API server so the plugin reads them as it
//! would for a pod.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tessera_api::kubelet::{dra_v1, registration};
use tonic::transport::{Channel, Endpoint};

use super::stats::Summary;

/// A gRPC channel over a unix socket (one HTTP/2 connection, as the
/// kubelet keeps one per plugin).
pub async fn connect(socket: &Path) -> Result<Channel> {
    let path = socket.to_path_buf();
    Endpoint::try_from("http://[::1]:1")?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
        .with_context(|| format!("connecting to {}", socket.display()))
}

/// The DRA endpoint a driver registered, found as the kubelet finds it: a
/// registration socket in `registry` named after the driver that answers
/// `GetInfo`.
pub async fn dra_endpoint(registry: &Path, driver: &str) -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(registry)
        .with_context(|| format!("reading {}", registry.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(driver) && n.ends_with(".sock"))
        })
        .collect();
    candidates.sort();
    for socket in candidates {
        let Ok(channel) = connect(&socket).await else {
            continue;
        };
        let mut reg = registration::registration_client::RegistrationClient::new(channel);
        if let Ok(info) = reg.get_info(registration::InfoRequest {}).await {
            let info = info.into_inner();
            if info.name == driver {
                return Ok(PathBuf::from(info.endpoint));
            }
        }
    }
    bail!(
        "no live registration socket of {driver} in {}",
        registry.display()
    )
}

/// Names of the devices `driver` publishes for `pool`, in slice order,
/// keeping those whose attribute `attr` (if given) has the given string
/// value.
pub async fn published_devices(
    client: &Client,
    driver: &str,
    pool: &str,
    attr: Option<(&str, &str)>,
) -> Result<Vec<String>> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.driver={driver}"));
    let mut names = Vec::new();
    for slice in slices.list(&lp).await?.items {
        if slice.spec.pool.name != pool {
            continue;
        }
        for device in slice.spec.devices.unwrap_or_default() {
            let keep = attr.is_none_or(|(key, want)| {
                device
                    .attributes
                    .as_ref()
                    .and_then(|a| a.get(key))
                    .and_then(|v| v.string.as_deref())
                    == Some(want)
            });
            if keep {
                names.push(device.name);
            }
        }
    }
    ensure!(
        !names.is_empty(),
        "{driver} publishes no matching device for pool {pool}"
    );
    Ok(names)
}

/// What a driver asks the API server about a claim, as
/// `apiserver_request_total` names it. In a run only the driver reads
/// single claims (`GET`) and writes their status; the bench creates the
/// claims before it counts and watches them (`LIST`, `WATCH`).
pub const CLAIM_RESOURCES: [(&str, &str); 2] =
    [("resourceclaims", ""), ("resourceclaims", "status")];

/// One run: `claims` claims of `per_claim` devices each.
#[derive(Debug, Clone)]
pub struct Run {
    pub driver: String,
    pub pool: String,
    /// Devices handed out round robin. The plugin trusts the allocation
    /// (the scheduler's job), so claims may share a device here.
    pub devices: Vec<String>,
    pub per_claim: usize,
    pub claims: usize,
    pub concurrency: usize,
    /// Capacity each result consumes (name -> quantity); empty for devices
    /// that are allocated whole.
    pub consumed: std::collections::BTreeMap<String, String>,
}

/// Creates the run's claims with their allocation written in status.
pub async fn create_claims(
    client: &Client,
    namespace: &str,
    run: &Run,
) -> Result<Vec<dra_v1::Claim>> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let run = Arc::new(run.clone());
    futures::stream::iter(0..run.claims)
        .map(|i| {
            let (api, run) = (api.clone(), run.clone());
            async move { create_claim(&api, namespace, &run, i).await }
        })
        .buffered(16)
        .try_collect()
        .await
}

async fn create_claim(
    api: &Api<ResourceClaim>,
    namespace: &str,
    run: &Run,
    i: usize,
) -> Result<dra_v1::Claim> {
    let name = format!("bench-{i:05}");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": {
            "deviceClassName": "bench", "allocationMode": "ExactCount", "count": run.per_claim,
        }}]}},
    }))?;
    let created = api.create(&PostParams::default(), &claim).await?;
    let results: Vec<_> = (0..run.per_claim)
        .map(|k| {
            let device = &run.devices[(i * run.per_claim + k) % run.devices.len()];
            let mut result =
                json!({ "request": "gpu", "driver": run.driver, "pool": run.pool, "device": device });
            if !run.consumed.is_empty() {
                result["consumedCapacity"] = json!(run.consumed);
                result["shareID"] = json!(share_id(i, k));
            }
            result
        })
        .collect();
    let status = json!({ "status": { "allocation": { "devices": { "results": results } } } });
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .with_context(|| format!("writing the allocation of claim {name}"))?;
    Ok(dra_v1::Claim {
        namespace: namespace.to_owned(),
        uid: created.metadata.uid.unwrap_or_default(),
        name,
    })
}

/// A share id (a UUID, as the scheduler writes) unique per result.
fn share_id(claim: usize, k: usize) -> String {
    format!("00000000-0000-4000-8000-{:06x}{:06x}", claim, k)
}

/// Prepares every claim, `concurrency` calls in flight; checks each answer
/// has no error and `per_claim` devices.
pub async fn prepare_all(
    channel: &Channel,
    claims: &[dra_v1::Claim],
    run: &Run,
) -> Result<Summary> {
    timed(claims, run.concurrency, |claim| {
        let mut dra = dra_v1::dra_plugin_client::DraPluginClient::new(channel.clone());
        let per_claim = run.per_claim;
        async move {
            let uid = claim.uid.clone();
            let answer = dra
                .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                    claims: vec![claim],
                })
                .await?
                .into_inner();
            let Some(got) = answer.claims.get(&uid) else {
                bail!("no answer for claim {uid}");
            };
            ensure!(got.error.is_empty(), "prepare of {uid}: {}", got.error);
            ensure!(
                got.devices.len() == per_claim,
                "prepare of {uid} returned {} devices, not {per_claim}",
                got.devices.len()
            );
            Ok(())
        }
    })
    .await
}

/// Waits until each of `claims` has entries of `driver` in
/// `status.devices` (`written`), or has none (not `written`), watching the
/// namespace's claims; how long that took. Run after the prepare phase, so
/// that the unprepares find the entries written (a driver that writes them
/// after prepare returns would otherwise drop writes of claims unprepared
/// first), and after the unprepare phase; the API server's work for the
/// writes and the removals falls inside the run, not into the next one.
pub async fn device_status_settled(
    client: &Client,
    namespace: &str,
    claims: &[dra_v1::Claim],
    driver: &str,
    written: bool,
    timeout: Duration,
) -> Result<Duration> {
    use kube::runtime::{WatchStreamExt, watcher};
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let began = Instant::now();
    let mut pending: std::collections::HashSet<&str> =
        claims.iter().map(|c| c.uid.as_str()).collect();
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    let watched = async {
        while !pending.is_empty() {
            let claim = events.try_next().await?.context("the claim watch ended")?;
            let has_entries = (claim.status.as_ref().and_then(|s| s.devices.as_ref()))
                .is_some_and(|d| d.iter().any(|e| e.driver == driver));
            if has_entries == written
                && let Some(uid) = claim.metadata.uid.as_deref()
            {
                pending.remove(uid);
            }
        }
        anyhow::Ok(())
    };
    let state = if written { "with" } else { "still with" };
    tokio::time::timeout(timeout, watched)
        .await
        .with_context(|| format!("claims {state} device status after {timeout:?}"))??;
    Ok(began.elapsed())
}

/// Unprepares every claim, `concurrency` calls in flight.
pub async fn unprepare_all(
    channel: &Channel,
    claims: &[dra_v1::Claim],
    run: &Run,
) -> Result<Summary> {
    timed(claims, run.concurrency, |claim| {
        let mut dra = dra_v1::dra_plugin_client::DraPluginClient::new(channel.clone());
        async move {
            let uid = claim.uid.clone();
            let answer = dra
                .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
                    claims: vec![claim],
                })
                .await?
                .into_inner();
            let Some(got) = answer.claims.get(&uid) else {
                bail!("no answer for claim {uid}");
            };
            ensure!(got.error.is_empty(), "unprepare of {uid}: {}", got.error);
            Ok(())
        }
    })
    .await
}

async fn timed<F, Fut>(claims: &[dra_v1::Claim], concurrency: usize, call: F) -> Result<Summary>
where
    F: Fn(dra_v1::Claim) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let began = Instant::now();
    let samples: Vec<Duration> = futures::stream::iter(claims.iter().cloned())
        .map(|claim| {
            let fut = call(claim);
            async move {
                let t = Instant::now();
                fut.await?;
                Ok::<_, anyhow::Error>(t.elapsed())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect()
        .await?;
    Ok(Summary::of(&samples, claims.len(), began.elapsed()))
}

/// The machine's CPU time so far, in clock ticks: idle (with I/O wait)
/// and all, from the first line of `/proc/stat`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct CpuTicks {
    idle: u64,
    total: u64,
}

impl CpuTicks {
    fn now() -> Result<CpuTicks> {
        let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        CpuTicks::parse(&stat).context("no cpu line in /proc/stat")
    }

    /// `cpu  user nice system idle iowait irq softirq steal ...`.
    fn parse(stat: &str) -> Option<CpuTicks> {
        let line = stat.lines().next()?.strip_prefix("cpu ")?;
        let ticks: Vec<u64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        Some(CpuTicks {
            idle: ticks.get(3)? + ticks.get(4).copied().unwrap_or(0),
            total: ticks.iter().sum(),
        })
    }

    /// The share of the CPUs' time that was idle since `earlier`.
    fn idle_since(&self, earlier: &CpuTicks) -> f64 {
        let total = self.total.saturating_sub(earlier.total);
        if total == 0 {
            return 0.0;
        }
        self.idle.saturating_sub(earlier.idle) as f64 / total as f64
    }
}

/// Waits until the machine's CPUs were at least `idle` idle over one
/// `window`, or `timeout` passed: a phase starts once the last one's
/// aftermath (claim watchers taking in status writes, a namespace's claims
/// being deleted) is over, for every driver alike, as a kubelet's
/// unprepare comes long after its prepare. How long it waited, and whether
/// the machine got that quiet.
pub async fn quiet_machine(
    idle: f64,
    window: Duration,
    timeout: Duration,
) -> Result<(Duration, bool)> {
    let began = Instant::now();
    loop {
        let before = CpuTicks::now()?;
        tokio::time::sleep(window).await;
        if CpuTicks::now()?.idle_since(&before) >= idle {
            return Ok((began.elapsed(), true));
        }
        if began.elapsed() >= timeout {
            return Ok((began.elapsed(), false));
        }
    }
}

/// Time a process's threads have run on a CPU so far, to the nanosecond
/// (`/proc/<pid>/task/*/schedstat`; `/proc/<pid>/stat` counts in ticks of
/// 10 ms, coarser than a whole phase of 256 unprepares). Threads that ended
/// meanwhile are not counted.
pub fn run_time(pid: u32) -> Result<Duration> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("listing /proc/{pid}/task"))?;
    let mut ns = 0u64;
    for task in tasks.flatten() {
        // A thread that ended between the listing and the read: not counted.
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        ns += (stat.split_whitespace().next())
            .and_then(|t| t.parse::<u64>().ok())
            .with_context(|| format!("no run time in {}/schedstat", task.path().display()))?;
    }
    Ok(Duration::from_nanos(ns))
}

/// Resident memory of a process, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> Result<u64> {
    status_kib(pid, "VmRSS")
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`; `RssAnon`: memory the
/// process allocated; `RssFile`: mapped files, its code among them, which
/// the page cache shares and can reclaim).
pub fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} line"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_share_counts_io_wait_as_idle() {
        let before = CpuTicks::parse("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3").unwrap();
        let after = CpuTicks::parse("cpu  120 0 60 860 60 0 0 0 0 0\n").unwrap();
        assert_eq!(
            before,
            CpuTicks {
                idle: 850,
                total: 1000
            }
        );
        assert!((after.idle_since(&before) - 0.7).abs() < 1e-9);
        assert_eq!(CpuTicks::parse("cpu0 1 2 3 4"), None, "not the sum line");
    }

    /// The calling thread's time on a CPU so far.
    fn thread_cpu_time() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime(2) into a timespec we own.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[test]
    fn run_time_counts_what_every_thread_of_a_process_ran() {
        let pid = std::process::id();
        let before = run_time(pid).unwrap();
        // Work on another thread: a reading of the main thread alone
        // (`/proc/<pid>/schedstat`) would not see it.
        let spin = std::thread::spawn(move || {
            // Until this thread ran 50 ms on a CPU, however long that takes
            // on a busy machine.
            let mut x = 0u64;
            while thread_cpu_time() < Duration::from_millis(50) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            // Still running when read: an ended thread leaves the sum.
            let after = run_time(pid).unwrap();
            (x, after)
        });
        let (_, after) = spin.join().unwrap();
        assert!(
            after >= before + Duration::from_millis(40),
            "{before:?} -> {after:?}"
        );
    }
}
