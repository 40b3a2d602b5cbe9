//! Where a pod's start goes: each component's own account of its part
//! (the scheduler's extension points, the kubelet's runtime operations and
//! DRA calls) and the CPU each process of the cluster spent, over one run
//! of pods. Two drivers started on the same kubelet differ in what they
//! publish (the scheduler's Filter walks every device of the node), what
//! their specs inject (the runtime's container creation) and what they
//! write (the API server's CPU): this says which.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use kube::Client;
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::cluster::{component_client, component_metrics, kubelet_client};
use super::scale::{component_pid, cpu_time};
use super::stats::{round2, sum_counter};
use crate::cluster::TestCluster;

/// A stage: the metric whose `_sum` and `_count` time it, and the labels
/// that pick the series.
struct Stage {
    name: &'static str,
    metric: &'static str,
    labels: &'static [(&'static str, &'static str)],
}

const SCHEDULER_POINT: &str = "scheduler_framework_extension_point_duration_seconds";
const RUNTIME_OPERATION: &str = "kubelet_runtime_operations_duration_seconds";

/// The scheduler's stages, each once per pod when nothing is retried.
const SCHEDULER: &[Stage] = &[
    Stage {
        name: "scheduling, queue to bound",
        metric: "scheduler_pod_scheduling_sli_duration_seconds",
        labels: &[],
    },
    Stage {
        name: "scheduler Filter",
        metric: SCHEDULER_POINT,
        labels: &[("extension_point", "Filter"), ("status", "Success")],
    },
    Stage {
        name: "scheduler PreBind",
        metric: SCHEDULER_POINT,
        labels: &[("extension_point", "PreBind"), ("status", "Success")],
    },
    Stage {
        name: "scheduler Bind",
        metric: SCHEDULER_POINT,
        labels: &[("extension_point", "Bind"), ("status", "Success")],
    },
];

/// The kubelet's stages, in the order a pod goes through them.
const KUBELET: &[Stage] = &[
    Stage {
        name: "kubelet DRA prepare",
        metric: "dra_operations_duration_seconds",
        labels: &[
            ("operation_name", "PrepareResources"),
            ("is_error", "false"),
        ],
    },
    Stage {
        name: "runtime pod sandbox",
        metric: RUNTIME_OPERATION,
        labels: &[("operation_type", "run_podsandbox")],
    },
    Stage {
        name: "runtime create container",
        metric: RUNTIME_OPERATION,
        labels: &[("operation_type", "create_container")],
    },
    Stage {
        name: "runtime start container",
        metric: RUNTIME_OPERATION,
        labels: &[("operation_type", "start_container")],
    },
];

/// The processes `cluster.sh` records, whose CPU is counted.
const PROCESSES: &[&str] = &[
    "etcd",
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubelet",
    "containerd",
    "tessera-node",
];

/// Reads the stages and the CPU of one cluster.
#[derive(Clone)]
pub struct PodStart {
    scheduler: Client,
    kubelet: Client,
    pids: Vec<(&'static str, u32)>,
}

/// Where the stages stood at one moment: per stage, seconds in it and
/// times it ran, so far.
pub struct Reading(BTreeMap<&'static str, (f64, f64)>);

/// CPU seconds so far, per process.
pub type Cpu = BTreeMap<&'static str, f64>;

/// How often the CPU is sampled while pods start.
const CPU_EVERY: Duration = Duration::from_millis(250);

/// The CPU, sampled every [`CPU_EVERY`] from a start until stopped.
pub struct CpuSamples {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Vec<(Instant, Cpu)>>,
}

/// Between two readings: the mean of each stage and the CPU per pod.
#[derive(Debug, Clone, Serialize)]
pub struct Stages {
    /// Mean milliseconds per run of each stage.
    pub mean_ms: BTreeMap<&'static str, f64>,
    /// CPU milliseconds per pod that ran, per process, from the first
    /// create until the last pod the node authorizer did not hold back
    /// runs (the containerd shims and the pods' own processes are not
    /// among them).
    pub cpu_ms_per_pod: BTreeMap<&'static str, f64>,
}

impl PodStart {
    pub async fn new(cluster: &TestCluster) -> Result<Self> {
        let pids = PROCESSES
            .iter()
            .filter_map(|&name| Some((name, component_pid(cluster, name).ok()?)))
            .collect();
        Ok(PodStart {
            scheduler: component_client(cluster, "SCHEDULER_PORT").await?,
            kubelet: kubelet_client(cluster).await?,
            pids,
        })
    }

    pub fn kubelet(&self) -> &Client {
        &self.kubelet
    }

    /// The stages now: the scheduler's read here, the kubelet's from
    /// `kubelet`, the text of its metrics the caller just read.
    pub async fn read(&self, kubelet: &str) -> Result<Reading> {
        let scheduler = component_metrics(&self.scheduler).await?;
        let stages = (SCHEDULER.iter().map(|s| (s, scheduler.as_str())))
            .chain(KUBELET.iter().map(|s| (s, kubelet)))
            .map(|(s, text)| (s.name, (series(text, s, "_sum"), series(text, s, "_count"))))
            .collect();
        Ok(Reading(stages))
    }

    pub fn cpu(&self) -> Cpu {
        (self.pids.iter())
            .filter_map(|&(name, pid)| Some((name, cpu_time(pid).ok()?.as_secs_f64())))
            .collect()
    }

    /// Samples the CPU from now on: /proc only, nothing the API server or
    /// the components serve, so sampling costs them nothing.
    pub fn sample_cpu(&self) -> CpuSamples {
        let (stop, mut stopped) = oneshot::channel();
        let this = self.clone();
        let task = tokio::spawn(async move {
            let mut samples = vec![(Instant::now(), this.cpu())];
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tokio::time::sleep(CPU_EVERY) => samples.push((Instant::now(), this.cpu())),
                }
            }
            samples.push((Instant::now(), this.cpu()));
            samples
        });
        CpuSamples { stop, task }
    }
}

impl CpuSamples {
    pub async fn stop(self) -> Result<Vec<(Instant, Cpu)>> {
        let _ = self.stop.send(());
        Ok(self.task.await?)
    }
}

fn series(text: &str, stage: &Stage, suffix: &str) -> f64 {
    sum_counter(text, &format!("{}{suffix}", stage.metric), stage.labels)
}

impl Stages {
    /// The stages between two readings, and the CPU from the first sample
    /// to the first taken once `until`.
    pub fn between(
        before: &Reading,
        after: &Reading,
        cpu: &[(Instant, Cpu)],
        until: Instant,
        pods: usize,
    ) -> Self {
        let mean_ms = (after.0.iter())
            .filter_map(|(&name, &(sum, count))| {
                let (sum0, count0) = before.0.get(name).copied().unwrap_or_default();
                let runs = count - count0;
                (runs > 0.0).then(|| (name, round2((sum - sum0) * 1000.0 / runs)))
            })
            .collect();
        let first = cpu.first().map(|(_, c)| c);
        let last = (cpu.iter().find(|(at, _)| *at >= until))
            .or(cpu.last())
            .map(|(_, c)| c);
        let cpu_ms_per_pod = match (first, last) {
            (Some(first), Some(last)) => (last.iter())
                .map(|(&name, &s)| {
                    let s0 = first.get(name).copied().unwrap_or(s);
                    (name, round2((s - s0) * 1000.0 / pods.max(1) as f64))
                })
                .collect(),
            _ => BTreeMap::new(),
        };
        Stages {
            mean_ms,
            cpu_ms_per_pod,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_is_the_mean_of_its_runs_between_readings() {
        let reading =
            |sum: f64, count: f64| Reading(BTreeMap::from([("scheduler Filter", (sum, count))]));
        let t0 = Instant::now();
        let cpu = |after_ms: u64, s: f64| {
            (
                t0 + Duration::from_millis(after_ms),
                Cpu::from([("kubelet", s)]),
            )
        };
        // The pods ran 600 ms in: the sample at 750 ms closes the CPU, not
        // the last one (a refused pod's retry, a minute later).
        let samples = [cpu(0, 5.0), cpu(250, 6.0), cpu(750, 7.4), cpu(60_000, 30.0)];
        let until = t0 + Duration::from_millis(600);
        let stages = Stages::between(
            &reading(1.0, 10.0),
            &reading(1.5, 20.0),
            &samples,
            until,
            24,
        );
        assert_eq!(stages.mean_ms["scheduler Filter"], 50.0);
        assert_eq!(stages.cpu_ms_per_pod["kubelet"], 100.0);
    }

    #[test]
    fn a_stage_picks_its_series_by_label() {
        let text = "\
kubelet_runtime_operations_duration_seconds_sum{operation_type=\"create_container\"} 2.5
kubelet_runtime_operations_duration_seconds_sum{operation_type=\"start_container\"} 9
kubelet_runtime_operations_duration_seconds_count{operation_type=\"create_container\"} 10
";
        let create = &KUBELET[2];
        assert_eq!(series(text, create, "_sum"), 2.5);
        assert_eq!(series(text, create, "_count"), 10.0);
    }
}
