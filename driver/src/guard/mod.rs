//! The claim guard: Isolated held per claim, against a tenant who tries.
//!
//! MPS limits what each client process may use, but the GPU stays in the
//! Default compute mode (one daemon per claim needs it), so a process that
//! leaves MPS gets the whole GPU, and k clients of one claim may pin k
//! times its memory. Nothing in the driver can stop either before it
//! happens; the node watches and acts within a bounded time instead.
//!
//! Every `periodMillis` (node policy `claimGuard`), for each GPU that holds
//! an Isolated claim served by MPS, the guard lists NVML's compute and MPS
//! client processes, maps each to its Pod through the host's
//! `/proc/<pid>/cgroup` (as the metrics do) and the Pod to the claims it
//! holds, and applies the rules of [`judge`]. With `action: enforce` (the
//! default) an offending process of a claim is killed through a pidfd
//! opened on the process seen (its start time checked after the open, so
//! a pid reused meanwhile is never signalled); `report` only reports.
//! Either way: a Warning Event on the Pod naming the claim, the process,
//! the rule and the fix, a log line, and `tessera_claim_guard_violations`
//! by rule and action. GPUs without Isolated claims cost nothing: NVML is
//! not asked about them.
//!
//! The guard needs the host's pids (`hostPID: true` in the chart), as the
//! metrics' attribution does: a process it cannot map to a Pod is not
//! judged. Processes in the node process's own Pod (its MPS daemons and
//! their servers when they are not moved to a host cgroup) are its own.

pub mod judge;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use tessera_controller::model::policy::{ClaimGuardPolicy, GuardAction};
use tracing::{debug, info, warn};

use self::judge::{Guarded, Judgement, Observed, Rule, Violation};
use crate::claim_uid::ClaimUid;
use crate::host::process::{Pidfd, ProcessId};
use crate::metrics::Metrics;
use crate::metrics::claims::{Consumers, pod_of};
use crate::metrics::processes::{ProcessList, running};
use crate::prepare::{PodRef, Preparer};
use crate::state::events::NodeEvents;
use crate::state::records::{ClaimEntry, EntryState};

/// The Event reason on a Pod whose process broke a rule.
pub const REASON: &str = "IsolatedClaimViolated";

/// What the guard reads and whom it tells.
pub struct ClaimGuard {
    pub policy: ClaimGuardPolicy,
    pub nvml: Arc<Nvml>,
    pub preparer: Arc<Preparer>,
    /// Claims' Pods read from the API server (after a restart).
    pub consumers: Arc<Consumers>,
    pub events: Option<NodeEvents>,
    pub metrics: Option<Arc<Metrics>>,
}

/// A violation, with what the guard knows to tell about it.
#[derive(Debug, Clone)]
pub struct Finding {
    pub violation: Violation,
    /// The process's name (`/proc/<pid>/comm`), for people.
    pub command: String,
    /// Claims broken, as `namespace/name`.
    pub claims: Vec<String>,
    /// The Pod, when its name is known (namespace, name, UID).
    pub pod: Option<(String, String, String)>,
    /// `killed` or `reported`.
    pub outcome: &'static str,
}

/// Memory each pid held at the last look, and what was already said.
#[derive(Default)]
pub struct Memory {
    before: BTreeMap<u32, u64>,
    reported: BTreeSet<(u32, u64, Rule)>,
}

/// What one pass found and did: the violations to tell (each with
/// `killed` or `reported`), and the claims whose Pods must be read.
#[derive(Debug, Default)]
pub struct Pass {
    pub told: Vec<(Violation, &'static str)>,
    pub unknown: BTreeSet<ClaimUid>,
}

/// One look at the GPUs that hold the `guarded` claims: NVML's processes
/// sampled, each attributed to its Pod through `proc` (the host's
/// `/proc`), judged, and killed where `action` and the rule say so. What
/// [`ClaimGuard`] runs every period; public for the benchmark
/// (`driver/benches/claim_guard.rs`).
pub fn pass(
    nvml: &Nvml,
    action: GuardAction,
    proc: &Path,
    guarded: &[Guarded],
    memory: &mut Memory,
) -> Pass {
    if guarded.is_empty() {
        memory.before.clear();
        return Pass::default();
    }
    let own_pod = own_pod(proc);
    let gpus: BTreeSet<&str> = guarded.iter().map(|g| g.gpu.as_str()).collect();
    let mut ids: BTreeMap<u32, ProcessId> = BTreeMap::new();
    let mut observed = Vec::new();
    for gpu in gpus {
        for mut p in sample(nvml, gpu) {
            p.pod = pod_of(proc, p.pid);
            p.ours = p.pod.is_some() && p.pod == own_pod;
            if let Some(id) = ProcessId::of(p.pid as i32) {
                ids.insert(p.pid, id);
            }
            observed.push(p);
        }
    }
    let Judgement {
        violations,
        unknown,
    } = judge::judge(guarded, &observed, &memory.before);
    memory.before = observed.iter().map(|p| (p.pid, p.memory_bytes)).collect();
    let told = violations
        .into_iter()
        .filter_map(|v| {
            let id = ids.get(&v.pid)?;
            let first = memory.reported.insert((v.pid, id.start_time, v.rule));
            let outcome = act(action, &v, id);
            // Reported once per process and rule unless killed again.
            (first || outcome == "killed").then_some((v, outcome))
        })
        .collect();
    memory
        .reported
        .retain(|(pid, _, _)| observed.iter().any(|p| p.pid == *pid));
    Pass { told, unknown }
}

/// Kills the process when the policy and the rule say so.
fn act(action: GuardAction, v: &Violation, id: &ProcessId) -> &'static str {
    if action != GuardAction::Enforce || !v.rule.enforceable() {
        return "reported";
    }
    match Pidfd::open(id).and_then(|fd| fd.map(|fd| fd.kill()).transpose()) {
        Ok(Some(())) => "killed",
        // Gone already: nothing left to end.
        Ok(None) => "killed",
        Err(e) => {
            warn!(pid = v.pid, "claim guard cannot kill the process: {e}");
            "reported"
        }
    }
}

impl ClaimGuard {
    /// Runs the guard until the runtime ends.
    pub fn spawn(self) {
        let guard = Arc::new(self);
        tokio::spawn(async move {
            let period = Duration::from_millis(guard.policy.period_millis);
            let mut memory = Memory::default();
            info!(
                "claim guard: every {} ms, action {}",
                guard.policy.period_millis,
                guard.policy.action.as_str()
            );
            loop {
                tokio::time::sleep(period).await;
                let g = guard.clone();
                let taken = std::mem::take(&mut memory);
                let pass = tokio::task::spawn_blocking(move || {
                    let mut m = taken;
                    let findings = g.look(&mut m);
                    (findings, m)
                })
                .await;
                match pass {
                    Ok((findings, m)) => {
                        memory = m;
                        guard.tell(findings).await;
                    }
                    Err(e) => warn!("claim guard pass failed: {e}"),
                }
            }
        });
    }

    /// One look at the GPUs that hold Isolated claims: judged, and acted on.
    fn look(&self, memory: &mut Memory) -> Vec<Finding> {
        let entries = self.preparer.entries();
        let pods = self.preparer.consumer_pods();
        let read = self.consumers.known(&entries);
        let guarded = guarded(&entries, &pods, &read);
        let started = Instant::now();
        let proc = Path::new("/proc");
        let Pass { told, unknown } = pass(&self.nvml, self.policy.action, proc, &guarded, memory);
        if guarded.is_empty() {
            return Vec::new();
        }
        self.consumers.refresh(unknown, &entries);
        let names = claim_names(&entries);
        debug!(
            took_us = started.elapsed().as_micros() as u64,
            "claim guard pass"
        );
        told.into_iter()
            .map(|(v, outcome)| Finding {
                command: command(proc, v.pid),
                claims: v
                    .claims
                    .iter()
                    .filter_map(|c| names.get(c).cloned())
                    .collect(),
                pod: pod_name(&entries, &pods, &v),
                outcome,
                violation: v,
            })
            .collect()
    }

    /// Logs, counts and records an Event for each finding.
    async fn tell(&self, findings: Vec<Finding>) {
        for f in findings {
            let note = note(&f);
            warn!(
                rule = f.violation.rule.as_str(),
                pid = f.violation.pid,
                "{note}"
            );
            if let Some(m) = &self.metrics {
                m.guard_violation(f.violation.rule.as_str(), f.outcome);
            }
            let Some(events) = &self.events else { continue };
            let action = format!("{}:{}", f.violation.rule.as_str(), f.violation.gpu);
            match &f.pod {
                Some((namespace, name, uid)) => {
                    let pod = ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        namespace: Some(namespace.clone()),
                        name: Some(name.clone()),
                        uid: Some(uid.clone()),
                        ..Default::default()
                    };
                    events.warning_about(&pod, REASON, &action, &note).await;
                }
                None => events.warning(REASON, &action, &note).await,
            }
        }
    }
}

/// The Isolated (MPS) claims prepared here, per GPU, with their Pods where
/// known (from prepare, else as read since).
pub fn guarded(
    entries: &[(ClaimUid, ClaimEntry)],
    pods: &BTreeMap<String, Vec<PodRef>>,
    read: &BTreeMap<String, Vec<String>>,
) -> Vec<Guarded> {
    let mut out: BTreeMap<(ClaimUid, String), Guarded> = BTreeMap::new();
    for (uid, e) in entries
        .iter()
        .filter(|(_, e)| e.state == EntryState::Completed)
    {
        let known = pods
            .get(uid.as_str())
            .map(|p| p.iter().map(|p| p.uid.clone()).collect())
            .or_else(|| read.get(uid.as_str()).cloned());
        for d in &e.status {
            let isolated_mps = d.data.isolation_level.as_deref() == Some("Isolated")
                && d.data.isolation_provider.as_deref().unwrap_or("mps") == "mps";
            if !isolated_mps {
                continue;
            }
            let memory = d
                .data
                .consumed
                .as_ref()
                .map(|c| c.memory_bytes)
                .or(d.data.limits.as_ref().map(|l| l.memory_bytes))
                .unwrap_or(0);
            let g = out
                .entry((uid.clone(), d.data.gpu_uuid.clone()))
                .or_insert_with(|| Guarded {
                    uid: uid.clone(),
                    gpu: d.data.gpu_uuid.clone(),
                    memory_bytes: 0,
                    pods: known.clone(),
                });
            g.memory_bytes += memory;
        }
    }
    out.into_values().collect()
}

/// What NVML lists on one GPU: processes with a context of their own and
/// MPS clients (a pid in both is a client), not attributed yet.
pub fn sample(nvml: &Nvml, gpu: &str) -> Vec<Observed> {
    let Ok(device) = nvml.device_by_uuid(gpu) else {
        debug!(%gpu, "claim guard: NVML does not find the GPU");
        return Vec::new();
    };
    let bytes = |m: UsedGpuMemory| match m {
        UsedGpuMemory::Used(b) => b,
        UsedGpuMemory::Unavailable => 0,
    };
    let mut out: BTreeMap<u32, Observed> = BTreeMap::new();
    let lists = [
        (false, running(nvml, &device, ProcessList::Compute)),
        (true, running(nvml, &device, ProcessList::MpsClients)),
    ];
    for (mps_client, list) in lists {
        let list = list.unwrap_or_else(|e| {
            debug!(%gpu, mps_client, "claim guard: NVML lists no processes: {e}");
            Vec::new()
        });
        for p in list {
            let o = out.entry(p.pid).or_insert_with(|| Observed {
                pid: p.pid,
                gpu: gpu.to_owned(),
                memory_bytes: 0,
                mps_client,
                pod: None,
                ours: false,
            });
            o.mps_client |= mps_client;
            o.memory_bytes = o.memory_bytes.max(bytes(p.used_gpu_memory));
        }
    }
    out.into_values().collect()
}

/// The Pod the node process itself runs in, if any.
fn own_pod(proc: &Path) -> Option<String> {
    pod_of(proc, std::process::id())
}

fn command(proc: &Path, pid: u32) -> String {
    std::fs::read_to_string(proc.join(pid.to_string()).join("comm"))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_else(|_| "?".into())
}

fn claim_names(entries: &[(ClaimUid, ClaimEntry)]) -> BTreeMap<ClaimUid, String> {
    entries
        .iter()
        .map(|(uid, e)| (uid.clone(), format!("{}/{}", e.namespace, e.name)))
        .collect()
}

/// The violating Pod's namespace, name and UID, from the claims it holds.
fn pod_name(
    entries: &[(ClaimUid, ClaimEntry)],
    pods: &BTreeMap<String, Vec<PodRef>>,
    v: &Violation,
) -> Option<(String, String, String)> {
    v.claims.iter().find_map(|c| {
        let entry = &entries.iter().find(|(uid, _)| uid == c)?.1;
        let pod = pods.get(c.as_str())?.iter().find(|p| p.uid == v.pod)?;
        Some((entry.namespace.clone(), pod.name.clone(), pod.uid.clone()))
    })
}

/// What the Event and log say: the claim, the process, the rule, what was
/// done and the fix.
fn note(f: &Finding) -> String {
    let v = &f.violation;
    let claims = if f.claims.is_empty() {
        "no claim".to_owned()
    } else {
        format!("claim {}", f.claims.join(", "))
    };
    let done = if f.outcome == "killed" {
        "killed"
    } else {
        "reported only"
    };
    let process = format!("process {} ({}) of Pod {}", v.pid, f.command, v.pod);
    match v.rule {
        Rule::LeftMps => format!(
            "{claims}: {process} runs on GPU {} outside the claim's MPS daemon, with every SM and \
             all memory beside the other claims ({} held); {done}. Fix: keep \
             CUDA_MPS_PIPE_DIRECTORY as the container got it and do not quit its daemon; a \
             workload that needs the whole GPU asks for a whole GPU.",
            v.gpu,
            gib(v.memory_bytes)
        ),
        Rule::ClaimMemory => {
            let (total, limit) = v.over.unwrap_or_default();
            format!(
                "{claims}: its processes on GPU {} hold {} together, over the claim's {}; \
                 {process} holds {} and grew last; {done}. Fix: request more memory in the \
                 claim, or run fewer processes (MPS limits each process, the claim all of them \
                 together).",
                v.gpu,
                gib(total),
                gib(limit),
                gib(v.memory_bytes)
            )
        }
        Rule::NoClaim => format!(
            "{process} runs on GPU {}, which holds Isolated claims, but its Pod holds no claim \
             on it; {done}. Fix: hand GPUs to Pods only through claims (no privileged Pods, \
             no hostPath /dev, a runtime that ignores NVIDIA_VISIBLE_DEVICES from images).",
            v.gpu
        ),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guard::judge::Rule;

    fn violation(rule: Rule, pid: u32) -> Violation {
        Violation {
            rule,
            pid,
            gpu: "GPU-0".into(),
            pod: "pod".into(),
            memory_bytes: 1 << 30,
            claims: Vec::new(),
            over: None,
        }
    }

    /// `report` leaves the process alone; `enforce` ends it, but never for
    /// a rule that is only reported.
    #[test]
    fn only_enforce_kills_and_only_for_enforceable_rules() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id();
        let id = ProcessId::of(pid as i32).unwrap();
        let alive = |child: &mut std::process::Child| child.try_wait().unwrap().is_none();
        let left = violation(Rule::LeftMps, pid);
        assert_eq!(act(GuardAction::Report, &left, &id), "reported");
        assert!(alive(&mut child), "report killed the process");
        let stray = violation(Rule::NoClaim, pid);
        assert_eq!(act(GuardAction::Enforce, &stray, &id), "reported");
        assert!(alive(&mut child), "a report-only rule killed the process");
        assert_eq!(act(GuardAction::Enforce, &left, &id), "killed");
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
    }
}
