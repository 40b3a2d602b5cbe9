//! `tessera-bench`: measures a DRA kubelet plugin on the local cluster
//! (see `conformance/bench.sh`, which runs it for Tessera and the Go test
//! driver, and docs/benchmarks.md). Needs the environment of
//! `conformance/cluster.sh env`. Prints one JSON object per result.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::json;
use tessera_conformance::TestCluster;
use tessera_conformance::bench::pod_start::PodStart;
use tessera_conformance::bench::{binder, cluster, grpc, pods, scale, stats};

#[derive(Parser)]
#[command(about = "Benchmarks a DRA kubelet plugin on the local cluster")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prepare and unprepare latency, calls made directly on the plugin's
    /// socket, for every combination of --per-claim and --concurrency.
    Grpc {
        #[arg(long)]
        driver: String,
        /// Pool (node name) whose devices are allocated; default: the
        /// kubelet's node.
        #[arg(long)]
        pool: Option<String>,
        /// Only devices whose attribute KEY has string value VALUE
        /// (`KEY=VALUE`); default: every device of the pool.
        #[arg(long)]
        device_attr: Option<String>,
        /// Capacity each allocation consumes of a multi-allocatable device
        /// (`NAME=QUANTITY`, e.g. `memory=1Gi`, repeated): written in the
        /// allocation with a share id, as the scheduler does for shares.
        #[arg(long = "consumed")]
        consumed: Vec<String>,
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8])]
        per_claim: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 64])]
        concurrency: Vec<usize>,
        /// Claims per run.
        #[arg(long, default_value_t = 256)]
        claims: usize,
        /// The plugin's pid: its resident memory is reported after each
        /// prepare phase (all claims prepared) and at the start.
        #[arg(long)]
        pid: Option<u32>,
        /// The driver writes the claims' `status.devices`: after each
        /// prepare phase, wait until every claim has its entries (reported
        /// as `device_status_ms`), then unprepare, then wait until none has
        /// any (`device_status_removed_ms`).
        #[arg(long)]
        device_status: bool,
    },
    /// Pods with one claim each, created at once (or on a schedule), run and deleted; the
    /// kubelet's histogram of the plugin's calls over the run.
    Pods {
        #[arg(long)]
        driver: String,
        /// DeviceClass of the claims' one request.
        #[arg(long)]
        class: String,
        #[arg(long, default_value_t = 32)]
        pods: usize,
        #[arg(long, default_value = "tessera.local/probe:1")]
        image: String,
        /// Capacity each claim's request asks for (`NAME=QUANTITY`, e.g.
        /// `memory=1Gi`, repeated): a share of a device.
        #[arg(long = "capacity")]
        capacity: Vec<String>,
        /// Create one pod every this many milliseconds instead of all at
        /// once: how many start together is then the schedule's, not
        /// decided by which pods the node authorizer refuses.
        #[arg(long, default_value_t = 0)]
        every_ms: u64,
    },
    /// Waits for the driver's first slice for the pool and reports how long
    /// after the start of the process in --pid-file it appeared.
    FirstSlice {
        #[arg(long)]
        driver: String,
        #[arg(long)]
        pool: Option<String>,
        #[arg(long)]
        pid_file: PathBuf,
    },
    /// ResourceSlice writes the API server served while COMMAND (a driver
    /// restart that returns once the driver is registered) ran and during
    /// --window seconds after it.
    SliceWrites {
        #[arg(long, default_value_t = 10)]
        window: u64,
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Cluster scale on fake nodes (`cluster.sh add-nodes`; see
    /// `conformance/bench-scale.sh`): one publisher per node, then pods on
    /// Isolated shares vs the same capacity as replica devices.
    Scale(scale::ScaleArgs),
    /// `tessera binder` on a cluster of many claims: its start, memory and
    /// CPU, a burst of allocations that wait on their nodes, their release.
    Binder(binder::BinderArgs),
    /// Medians over rounds of the `grpc` results in RESULTS (JSON lines
    /// carrying a `round`, as `conformance/bench.sh` writes them).
    GrpcMedians { results: PathBuf },
}

/// `NAME=VALUE` arguments of `flag`, as a map.
fn pairs(args: &[String], flag: &str) -> Result<std::collections::BTreeMap<String, String>> {
    args.iter()
        .map(|c| {
            c.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("{flag} takes NAME=QUANTITY, not {c:?}"))
        })
        .collect()
}

/// A gRPC phase starts once the machine's CPUs were this idle over one
/// window ([`grpc::quiet_machine`]), or after the timeout.
const QUIET_IDLE: f64 = 0.9;
const QUIET_WINDOW: Duration = Duration::from_millis(250);
const QUIET_TIMEOUT: Duration = Duration::from_secs(15);

/// One `grpc` run: the run's claims created, prepared and unprepared, each
/// phase on a quiet machine, with what each cost (latency, the driver's
/// CPU and memory, API requests, device status).
async fn grpc_run(
    cluster: &TestCluster,
    channel: &tonic::transport::Channel,
    run: &grpc::Run,
    pid: Option<u32>,
    device_status: bool,
) -> Result<serde_json::Value> {
    let client = cluster.client();
    let ns = cluster.create_namespace("bench").await?;
    let refs = grpc::create_claims(&client, ns.name(), run).await?;
    let requests = || async {
        let metrics = cluster::apiserver_metrics(&client).await?;
        anyhow::Ok(stats::requests_of(&metrics, &grpc::CLAIM_RESOURCES))
    };
    let quiet = || grpc::quiet_machine(QUIET_IDLE, QUIET_WINDOW, QUIET_TIMEOUT);
    let (quiet_prepare, prepare_quieted) = quiet().await?;
    let before = requests().await?;
    let ran = || pid.map(grpc::run_time).transpose();
    let ran_before = ran()?;
    let prepare = grpc::prepare_all(channel, &refs, run).await?;
    let ran_prepared = ran()?;
    let rss = pid.map(grpc::rss_kib).transpose()?;
    let rss_anon = pid.map(|p| grpc::status_kib(p, "RssAnon")).transpose()?;
    let settled = |written| {
        let (client, ns, refs, driver) = (&client, ns.name(), &refs, &run.driver);
        async move {
            if !device_status {
                return Ok(None);
            }
            let timeout = Duration::from_secs(120);
            let took =
                grpc::device_status_settled(client, ns, refs, driver, written, timeout).await?;
            anyhow::Ok(Some(took.as_secs_f64() * 1000.0))
        }
    };
    let status_written = settled(true).await?;
    let (quiet_unprepare, quieted) = quiet().await?;
    let prepared = requests().await?;
    let ran_unpreparing = ran()?;
    let unprepare = grpc::unprepare_all(channel, &refs, run).await?;
    let ran_unprepared = ran()?;
    let status_removed = settled(false).await?;
    let after = requests().await?;
    let per_claim = run.claims as f64;
    let api_requests = json!({
        "prepare": stats::requests_delta(&before, &prepared, per_claim),
        "unprepare": stats::requests_delta(&prepared, &after, per_claim),
    });
    // The driver's CPU while the calls ran (what it defers past its
    // answers, such as status writes, is not in it).
    let per_call =
        |a: Option<Duration>, b: Option<Duration>| Some((b? - a?).as_secs_f64() * 1e6 / per_claim);
    let cpu_us = json!({
        "prepare": per_call(ran_before, ran_prepared),
        "unprepare": per_call(ran_unpreparing, ran_unprepared),
    });
    ns.delete().await?;
    Ok(json!({
        "driver": run.driver, "per_claim": run.per_claim, "concurrency": run.concurrency,
        "claims": run.claims,
        "driver_cpu_us_per_claim": cpu_us,
        "quiet_wait_ms": {
            "prepare": quiet_prepare.as_secs_f64() * 1e3,
            "unprepare": quiet_unprepare.as_secs_f64() * 1e3,
            "reached": prepare_quieted && quieted,
        },
        "prepare": prepare, "unprepare": unprepare, "rss_prepared_kib": rss,
        "rss_anon_prepared_kib": rss_anon, "device_status_ms": status_written,
        "device_status_removed_ms": status_removed,
        "api_requests_per_claim": api_requests,
    }))
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Command::GrpcMedians { results } = &cli.command {
        return print_round_medians(results);
    }
    let cluster = TestCluster::shared().await?;
    let client = cluster.client();
    let node = cluster.node_name().to_owned();
    match cli.command {
        Command::Grpc {
            driver,
            pool,
            device_attr,
            consumed,
            per_claim,
            concurrency,
            claims,
            pid,
            device_status,
        } => {
            let consumed = pairs(&consumed, "--consumed")?;
            let pool = pool.unwrap_or(node);
            let attr = device_attr
                .as_deref()
                .map(|a| a.split_once('=').context("--device-attr takes KEY=VALUE"))
                .transpose()?;
            let devices = grpc::published_devices(&client, &driver, &pool, attr).await?;
            let registry = &cluster
                .kubelet()
                .context("the cluster runs without a kubelet")?
                .registry;
            let endpoint = grpc::dra_endpoint(registry, &driver).await?;
            let channel = grpc::connect(&endpoint).await?;
            if let Some(pid) = pid {
                println!(
                    "{}",
                    json!({
                        "driver": driver,
                        "rss_idle_kib": grpc::rss_kib(pid)?,
                        "rss_anon_idle_kib": grpc::status_kib(pid, "RssAnon")?,
                        "rss_file_idle_kib": grpc::status_kib(pid, "RssFile")?,
                    })
                );
            }
            for &k in &per_claim {
                for &c in &concurrency {
                    let run = grpc::Run {
                        driver: driver.clone(),
                        pool: pool.clone(),
                        devices: devices.clone(),
                        per_claim: k,
                        claims,
                        concurrency: c,
                        consumed: consumed.clone(),
                    };
                    let result = grpc_run(&cluster, &channel, &run, pid, device_status).await?;
                    println!("{result}");
                }
            }
        }
        Command::Pods {
            driver,
            class,
            pods,
            image,
            capacity,
            every_ms,
        } => {
            let capacity = pairs(&capacity, "--capacity")?;
            let ns = cluster.create_namespace("bench-pods").await?;
            let run = pods::PodsRun {
                node,
                driver: driver.clone(),
                class,
                image,
                pods,
                timeout: Duration::from_secs(300),
                capacity,
                every: Duration::from_millis(every_ms),
            };
            let start = PodStart::new(&cluster).await?;
            let result = pods::pods_run(&start, &ns, &run).await;
            ns.delete().await?;
            println!("{}", json!({ "driver": driver, "kubelet": result? }));
        }
        Command::FirstSlice {
            driver,
            pool,
            pid_file,
        } => {
            let pool = pool.unwrap_or(node);
            let took =
                cluster::first_slice(&client, &driver, &pool, &pid_file, Duration::from_secs(120))
                    .await?;
            println!(
                "{}",
                json!({ "driver": driver, "start_to_first_slice_ms": took.as_secs_f64() * 1e3 })
            );
        }
        Command::SliceWrites { window, command } => {
            let before = cluster::slice_writes(&cluster::apiserver_metrics(&client).await?);
            let restart = command.clone();
            let status = tokio::task::spawn_blocking(move || {
                std::process::Command::new(&restart[0])
                    .args(&restart[1..])
                    .status()
            })
            .await?
            .with_context(|| format!("running {command:?}"))?;
            anyhow::ensure!(status.success(), "{command:?} failed: {status}");
            // A measurement window, not a synchronisation: writes a driver
            // makes after it registered count too.
            let end = Instant::now() + Duration::from_secs(window);
            tokio::time::sleep_until(end.into()).await;
            let after = cluster::slice_writes(&cluster::apiserver_metrics(&client).await?);
            println!(
                "{}",
                json!({ "restart": command.join(" "), "slice_writes": after - before, "window_s": window })
            );
        }
        Command::Scale(args) => scale::run(&cluster, args).await?,
        Command::Binder(args) => binder::run(&cluster, args).await?,
        // Needs no cluster: answered above.
        Command::GrpcMedians { .. } => {}
    }
    Ok(())
}

fn print_round_medians(results: &std::path::Path) -> Result<()> {
    let lines = std::fs::read_to_string(results)
        .with_context(|| format!("reading {}", results.display()))?;
    for medians in tessera_conformance::bench::stats::round_medians(&lines) {
        println!("{medians}");
    }
    Ok(())
}
