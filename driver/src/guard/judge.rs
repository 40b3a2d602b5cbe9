//! The claim guard's rules, as a pure function of one look at the GPUs:
//! what NVML listed, which Pod each process runs in, and the Isolated
//! claims each GPU holds.
//!
//! - **left-mps**: every process of a Pod that holds an Isolated claim on a
//!   GPU must reach that GPU as an MPS client. One with a context of its
//!   own (it dropped or changed `CUDA_MPS_PIPE_DIRECTORY`, or runs after its
//!   daemon quit) has every SM and all memory beside its neighbours.
//! - **claim-memory**: the memory all processes of a claim hold on a GPU,
//!   together, stays within what the claim consumed there. MPS limits each
//!   client; k clients could pin k times the claim. Over the line, the
//!   processes that grew most since the last look go first (the one that
//!   crossed it), then the largest, until the rest fit.
//! - **no-claim** (reported, never enforced): a process on a GPU that holds
//!   Isolated claims, from a Pod that holds none of them (a privileged Pod,
//!   a `hostPath` `/dev`, or a runtime that honours `NVIDIA_VISIBLE_DEVICES`
//!   from an image).
//!
//! A Pod whose claim's consumers are not known yet (read after a restart)
//! is neither judged nor excused: its claims are named for a read, and the
//! next look judges it.

use std::collections::{BTreeMap, BTreeSet};

use crate::claim_uid::ClaimUid;

/// A rule a process broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    LeftMps,
    ClaimMemory,
    NoClaim,
}

impl Rule {
    /// The metric label and the word in Events and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::LeftMps => "left-mps",
            Rule::ClaimMemory => "claim-memory",
            Rule::NoClaim => "no-claim",
        }
    }

    /// Whether the guard may kill for it (only for a claim's own
    /// processes: a process of no claim is not the guard's to end).
    pub fn enforceable(self) -> bool {
        !matches!(self, Rule::NoClaim)
    }
}

/// One process on one GPU, as the guard saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// Host pid, as NVML lists it.
    pub pid: u32,
    /// The physical GPU.
    pub gpu: String,
    pub memory_bytes: u64,
    /// Listed among the MPS clients.
    pub mps_client: bool,
    /// The Pod it runs in (UID), if any.
    pub pod: Option<String>,
    /// One of this driver's MPS daemons or the servers they started.
    pub ours: bool,
}

/// An Isolated (MPS) claim on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guarded {
    pub uid: ClaimUid,
    pub gpu: String,
    /// What the claim consumed on the GPU.
    pub memory_bytes: u64,
    /// Its Pods (UIDs); `None` until known.
    pub pods: Option<Vec<String>>,
}

/// A broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rule: Rule,
    pub pid: u32,
    pub gpu: String,
    pub pod: String,
    /// The process's memory on the GPU.
    pub memory_bytes: u64,
    /// The claims whose promise it breaks (none for no-claim).
    pub claims: Vec<ClaimUid>,
    /// For claim-memory: (the claims' processes together, their memory).
    pub over: Option<(u64, u64)>,
}

/// What one look found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Judgement {
    pub violations: Vec<Violation>,
    /// Claims whose Pods must be read before their GPU can be judged.
    pub unknown: BTreeSet<ClaimUid>,
}

/// Judges one look. `grown`: each pid's memory at the last look (a pid not
/// there grew by all it holds).
pub fn judge(claims: &[Guarded], processes: &[Observed], before: &BTreeMap<u32, u64>) -> Judgement {
    let mut judgement = Judgement::default();
    // Per group of claims a Pod holds on a GPU: the MPS clients charged.
    let mut groups: BTreeMap<(String, Vec<ClaimUid>), Vec<&Observed>> = BTreeMap::new();
    for p in processes.iter().filter(|p| !p.ours) {
        let Some(pod) = &p.pod else { continue };
        let on_gpu: Vec<&Guarded> = claims.iter().filter(|c| c.gpu == p.gpu).collect();
        if on_gpu.is_empty() {
            continue;
        }
        let holds: Vec<ClaimUid> = on_gpu
            .iter()
            .filter(|c| c.pods.as_ref().is_some_and(|pods| pods.contains(pod)))
            .map(|c| c.uid.clone())
            .collect();
        let unknown: Vec<ClaimUid> = on_gpu
            .iter()
            .filter(|c| c.pods.is_none())
            .map(|c| c.uid.clone())
            .collect();
        if holds.is_empty() {
            if unknown.is_empty() {
                judgement
                    .violations
                    .push(violation(Rule::NoClaim, p, pod, vec![]));
            } else {
                judgement.unknown.extend(unknown);
            }
            continue;
        }
        if p.mps_client {
            groups.entry((p.gpu.clone(), holds)).or_default().push(p);
        } else {
            judgement
                .violations
                .push(violation(Rule::LeftMps, p, pod, holds));
        }
    }
    for ((gpu, uids), members) in groups {
        let limit: u64 = claims
            .iter()
            .filter(|c| c.gpu == gpu && uids.contains(&c.uid))
            .map(|c| c.memory_bytes)
            .sum();
        judgement
            .violations
            .extend(over_memory(&members, limit, before, &uids));
    }
    judgement
}

/// The processes to end so that the rest of a claim's fit its memory.
fn over_memory(
    members: &[&Observed],
    limit: u64,
    before: &BTreeMap<u32, u64>,
    claims: &[ClaimUid],
) -> Vec<Violation> {
    let total: u64 = members.iter().map(|p| p.memory_bytes).sum();
    if total <= limit {
        return Vec::new();
    }
    let growth = |p: &Observed| {
        p.memory_bytes
            .saturating_sub(before.get(&p.pid).copied().unwrap_or(0))
    };
    let mut order: Vec<&Observed> = members.to_vec();
    order.sort_by(|a, b| {
        (growth(b), b.memory_bytes, b.pid).cmp(&(growth(a), a.memory_bytes, a.pid))
    });
    let mut left = total;
    let mut out = Vec::new();
    for p in order {
        if left <= limit {
            break;
        }
        left -= p.memory_bytes;
        let pod = p.pod.clone().unwrap_or_default();
        let mut v = violation(Rule::ClaimMemory, p, &pod, claims.to_vec());
        v.over = Some((total, limit));
        out.push(v);
    }
    out
}

fn violation(rule: Rule, p: &Observed, pod: &str, claims: Vec<ClaimUid>) -> Violation {
    Violation {
        rule,
        pid: p.pid,
        gpu: p.gpu.clone(),
        pod: pod.to_owned(),
        memory_bytes: p.memory_bytes,
        claims,
        over: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: &str = "GPU-0";
    const OTHER_GPU: &str = "GPU-1";
    const GIB: u64 = 1 << 30;

    fn uid(n: u8) -> ClaimUid {
        ClaimUid::parse(&format!("00000000-0000-4000-8000-0000000000{n:02}")).unwrap()
    }

    fn claim(n: u8, gib: u64, pods: Option<&[&str]>) -> Guarded {
        Guarded {
            uid: uid(n),
            gpu: GPU.into(),
            memory_bytes: gib * GIB,
            pods: pods.map(|p| p.iter().map(|s| s.to_string()).collect()),
        }
    }

    fn process(pid: u32, pod: &str, gib: u64, mps_client: bool) -> Observed {
        Observed {
            pid,
            gpu: GPU.into(),
            memory_bytes: gib * GIB,
            mps_client,
            pod: Some(pod.into()),
            ours: false,
        }
    }

    fn found(j: &Judgement) -> Vec<(Rule, u32)> {
        j.violations.iter().map(|v| (v.rule, v.pid)).collect()
    }

    #[test]
    fn a_process_of_an_isolated_claim_outside_mps_breaks_the_claim() {
        let claims = [claim(1, 4, Some(&["a"])), claim(2, 8, Some(&["b"]))];
        let processes = [
            process(10, "a", 1, true),
            process(11, "a", 30, false),
            process(20, "b", 2, true),
        ];
        let j = judge(&claims, &processes, &BTreeMap::new());
        assert_eq!(found(&j), vec![(Rule::LeftMps, 11)]);
        assert_eq!(j.violations[0].claims, vec![uid(1)]);
        assert_eq!(j.violations[0].pod, "a");
    }

    #[test]
    fn a_claims_processes_together_stay_within_its_memory_and_the_newest_growth_goes() {
        let claims = [claim(1, 4, Some(&["a"]))];
        let processes = [
            process(10, "a", 2, true),
            process(11, "a", 2, true),
            process(12, "a", 2, true),
        ];
        // 10 and 11 were there with their memory; 12 is new.
        let before = BTreeMap::from([(10, 2 * GIB), (11, 2 * GIB)]);
        let j = judge(&claims, &processes, &before);
        assert_eq!(found(&j), vec![(Rule::ClaimMemory, 12)]);
        assert_eq!(j.violations[0].over, Some((6 * GIB, 4 * GIB)));
        // Within: nothing.
        let j = judge(&claims, &processes[..2], &before);
        assert!(j.violations.is_empty());
    }

    #[test]
    fn pods_sharing_a_claim_share_its_memory() {
        let claims = [claim(1, 4, Some(&["a", "b"]))];
        let processes = [process(10, "a", 3, true), process(20, "b", 3, true)];
        let before = BTreeMap::from([(10, 3 * GIB), (20, GIB)]);
        let j = judge(&claims, &processes, &before);
        assert_eq!(found(&j), vec![(Rule::ClaimMemory, 20)]);
    }

    #[test]
    fn a_pod_of_no_claim_on_the_gpu_is_reported_once_every_claim_is_known() {
        let processes = [process(30, "stranger", 1, false)];
        let known = [claim(1, 4, Some(&["a"]))];
        let j = judge(&known, &processes, &BTreeMap::new());
        assert_eq!(found(&j), vec![(Rule::NoClaim, 30)]);
        assert!(!Rule::NoClaim.enforceable());
        // One claim's Pods not known yet: ask, judge nothing.
        let unknown = [claim(1, 4, Some(&["a"])), claim(2, 4, None)];
        let j = judge(&unknown, &processes, &BTreeMap::new());
        assert!(j.violations.is_empty());
        assert_eq!(j.unknown, BTreeSet::from([uid(2)]));
    }

    #[test]
    fn daemons_host_processes_and_other_gpus_are_not_judged() {
        let claims = [claim(1, 4, Some(&["a"]))];
        let mut daemon = process(5, "node", 1, false);
        daemon.ours = true;
        let mut host = process(6, "", 1, false);
        host.pod = None;
        let mut elsewhere = process(7, "a", 40, false);
        elsewhere.gpu = OTHER_GPU.into();
        let j = judge(&claims, &[daemon, host, elsewhere], &BTreeMap::new());
        assert_eq!(j, Judgement::default());
    }
}
