//! The hostile steps the node's claim guard answers (docs/isolation.md):
//! a process of a claim that leaves MPS, and several processes of one claim
//! that together hold more than its memory. Each process is a probe of the
//! claim's container, bound to its Pod as the kubelet binds a container (so
//! the node maps it to the Pod), holding what it allocated for a while;
//! what counts is how it ended, the node's log naming it, and the guard's
//! Event on the Pod (the first of each rule there: the API's event
//! recorder folds repeats of one rule on one Pod into a series that keeps
//! the first note).
//!
//! And, on real GPUs only, a question for the driver whose answer could
//! close the gap without a guard: does an MPS client run without its GPU's
//! own device node (`/dev/nvidia<N>`) while a process outside MPS there
//! fails? If so, a container of an Isolated claim given only
//! `/dev/nvidiactl` and `/dev/nvidia-uvm` could not leave MPS at all.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::ListParams;
use tessera_api::probe::{MPS_PIPE_DIRECTORY, ProbeReport};

use super::node::Node;
use super::table::{Table, Verdict};
use super::{Ctx, Tenant};
use crate::cluster::wait_for;
use crate::suite::isolation::{self, Limits};

/// How long a process the guard must kill holds its memory: many of the
/// guard's periods (1 s by default).
const HOLD: Duration = Duration::from_secs(30);
/// How long the processes of one claim hold their memory together.
const TOGETHER: Duration = Duration::from_secs(10);
/// Processes of one claim in the many-processes step.
const MANY: usize = 3;
/// Each of them holds this share of the claim's memory: any two fit, all
/// three do not.
const EACH_PERCENT: u64 = 45;
/// The Event reason of the guard's findings (`tessera_driver::guard`).
const REASON: &str = "IsolatedClaimViolated";
/// How often a running probe is looked at.
const POLL: Duration = Duration::from_millis(20);

/// How a probe process ended.
#[derive(Debug)]
enum Ended {
    /// It ran to its end and printed its report.
    Reported(Box<ProbeReport>),
    /// Killed (SIGKILL), this long after it started.
    Killed { pid: u32, after: Duration },
}

/// A probe process of a tenant's container, running.
struct Running {
    child: Child,
    started: Instant,
}

impl Running {
    /// A probe of `t`'s container holding `alloc` bytes, with `env` and
    /// `extra` flags (see [`Ctx::probe_command`]); `hold`: it keeps the
    /// GPU busy and its memory held that long.
    fn start(
        ctx: &Ctx<'_>,
        node: &Node,
        t: &Tenant,
        alloc: u64,
        env: &[String],
        hold: Option<Duration>,
        extra: &[&str],
    ) -> Result<Running> {
        let mut flags: Vec<String> = extra.iter().map(|f| (*f).to_owned()).collect();
        if let Some(hold) = hold {
            flags.extend(["--busy".to_owned(), hold.as_secs().to_string()]);
        }
        let child = ctx
            .probe_command(node, t, alloc, env, &flags)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting a probe of claim {}", t.name))?;
        Ok(Running {
            child,
            started: Instant::now(),
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until it ends, at most `within` (then kills it: the step has
    /// failed). Its report is small, so its pipes never fill meanwhile.
    async fn end(mut self, within: Duration) -> Result<Ended> {
        let pid = self.pid();
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if self.started.elapsed() > within {
                self.child.kill()?;
                self.child.wait()?;
                bail!("probe {pid} still ran {within:?} after it started (killed now)");
            }
            tokio::time::sleep(POLL).await;
        };
        if status.signal() == Some(libc::SIGKILL) {
            return Ok(Ended::Killed {
                pid,
                after: self.started.elapsed(),
            });
        }
        let (mut out, mut err) = (Vec::new(), String::new());
        if let Some(mut s) = self.child.stdout.take() {
            s.read_to_end(&mut out)?;
        }
        if let Some(mut s) = self.child.stderr.take() {
            s.read_to_string(&mut err)?;
        }
        serde_json::from_slice(&out)
            .map(|r| Ended::Reported(Box::new(r)))
            .with_context(|| format!("probe {pid} printed no report ({status}): {err}"))
    }
}

/// The pipe directory of no daemon: set there, a process leaves MPS.
fn elsewhere(ctx: &Ctx<'_>) -> Result<Vec<String>> {
    let dir = ctx.args.work_dir.join("no-daemon");
    std::fs::create_dir_all(&dir)?;
    Ok(vec![format!("{MPS_PIPE_DIRECTORY}={}", dir.display())])
}

/// A process of `a` that leaves MPS and holds half again its claim's
/// memory: the guard must kill it.
pub(super) async fn leave_mps(
    ctx: &Ctx<'_>,
    node: &Node,
    a: &Tenant,
    table: &mut Table,
) -> Result<()> {
    let over = a.limits.memory_bytes + a.limits.memory_bytes / 2;
    let running = Running::start(ctx, node, a, over, &elsewhere(ctx)?, Some(HOLD), &[])?;
    let ended = running.end(HOLD + ctx.args.timeout).await?;
    let (got, problems) = must_be_stopped(ctx, node, a, ended, Said::LogAndEvent).await;
    table.push(
        "leaves MPS holding 1.5x its memory: the guard kills it",
        a.name,
        got,
        Verdict::of(problems),
    );
    Ok(())
}

/// A process of `a` after its daemon quit: outside MPS (no daemon answers
/// its pipe directory) it must be killed; a client of a daemon the node
/// started again gets `a`'s limits.
pub(super) async fn after_quit(
    ctx: &Ctx<'_>,
    node: &Node,
    a: &Tenant,
    table: &mut Table,
) -> Result<()> {
    let over = a.limits.memory_bytes + a.limits.memory_bytes / 2;
    let running = Running::start(ctx, node, a, over, &[], Some(HOLD), &[])?;
    let ended = running.end(HOLD + ctx.args.timeout).await?;
    // Its Event is the leave-MPS step's, repeated.
    let (got, problems) = must_be_stopped(ctx, node, a, ended, Said::Log).await;
    table.push(
        "after its daemon quit, holding 1.5x its memory",
        a.name,
        got,
        Verdict::of(problems),
    );
    Ok(())
}

/// Where the guard must have said that it killed a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    /// The node's log.
    Log,
    /// The node's log and an Event on the Pod naming the process.
    LogAndEvent,
}

/// A process that may not keep more than `t`'s share: killed by the guard
/// (and said), limited by MPS, or given no GPU at all.
async fn must_be_stopped(
    ctx: &Ctx<'_>,
    node: &Node,
    t: &Tenant,
    ended: Ended,
    said: Said,
) -> (String, Vec<String>) {
    match ended {
        Ended::Killed { pid, after } => {
            let got = format!("process {pid} killed {:.1}s after it started", secs(after));
            let (note, problems) = guard_said(ctx, node, t, "left-mps", pid, said).await;
            (format!("{got}{note}"), problems)
        }
        Ended::Reported(report) => {
            let got = isolation::describe(&report);
            (got, over_share(&ctx.gpu, &t.limits, &report))
        }
    }
}

/// Where a process that ran to its end got more than `limits`: a GPU beyond
/// its share, for all the time it held it, unstopped.
fn over_share(gpu: &str, limits: &Limits, report: &ProbeReport) -> Vec<String> {
    if report.devices.is_empty() {
        // No GPU at all: nothing of a neighbour's was reached.
        return Vec::new();
    }
    let problems = isolation::check_report(gpu, limits, false, report);
    if problems.is_empty() {
        return problems;
    }
    vec![format!(
        "{}: it ran outside its share for {}s and the claim guard did not stop it",
        problems.join("; "),
        HOLD.as_secs()
    )]
}

/// `MANY` MPS clients of `a`, each holding `EACH_PERCENT` % of its memory
/// at once: over the claim together, so the guard kills until they fit
/// (one), and the rest finish with their memory.
pub(super) async fn many_processes(
    ctx: &Ctx<'_>,
    node: &Node,
    a: &Tenant,
    table: &mut Table,
) -> Result<()> {
    let each = each_holds(a.limits.memory_bytes);
    let mut running = Vec::new();
    for _ in 0..MANY {
        running.push(Running::start(
            ctx,
            node,
            a,
            each,
            &[],
            Some(TOGETHER),
            &[],
        )?);
    }
    // Waited for together: each one's end is seen when it comes.
    let within = TOGETHER + ctx.args.timeout;
    let ends: Vec<Ended> = futures::future::join_all(running.into_iter().map(|r| r.end(within)))
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let (mut got, mut problems) = too_many(&ends, each);
    let killed = ends.iter().filter_map(|e| match e {
        Ended::Killed { pid, .. } => Some(*pid),
        Ended::Reported(_) => None,
    });
    for (i, pid) in killed.enumerate() {
        // One Event per rule and Pod (see the module's note).
        let said = if i == 0 { Said::LogAndEvent } else { Said::Log };
        let (note, more) = guard_said(ctx, node, a, "claim-memory", pid, said).await;
        got.push_str(&note);
        problems.extend(more);
    }
    table.push(
        format!(
            "{MANY} processes hold {}% of its memory together: the guard kills until they fit",
            EACH_PERCENT * MANY as u64
        ),
        a.name,
        got,
        Verdict::of(problems),
    );
    Ok(())
}

/// What each of the many processes allocates: its share of the claim,
/// in whole 2 MiB pages (what CUDA allocates in).
fn each_holds(claim_bytes: u64) -> u64 {
    const PAGE: u64 = 2 << 20;
    (claim_bytes / 100 * EACH_PERCENT) / PAGE * PAGE
}

/// How the many processes ended against what the guard must do: exactly
/// one killed, the others ran to their end holding `each` bytes.
fn too_many(ends: &[Ended], each: u64) -> (String, Vec<String>) {
    let killed: Vec<String> = ends
        .iter()
        .filter_map(|e| match e {
            Ended::Killed { pid, after } => Some(format!("{pid} after {:.1}s", secs(*after))),
            Ended::Reported(_) => None,
        })
        .collect();
    let held = ends
        .iter()
        .filter(|e| match e {
            Ended::Reported(r) => r
                .devices
                .first()
                .and_then(|d| d.allocation.as_ref())
                .is_some_and(|a| a.ok && a.bytes == each),
            Ended::Killed { .. } => false,
        })
        .count();
    let got = format!(
        "{} of {} killed ({}), {held} held {} to their end",
        killed.len(),
        ends.len(),
        killed.join(", "),
        crate::suite::facts::format_quantity(each.into())
    );
    let mut problems = Vec::new();
    if killed.len() != 1 {
        problems.push(format!(
            "want exactly one process killed (any {} fit the claim), got {}",
            ends.len() - 1,
            killed.len()
        ));
    }
    if held + killed.len() != ends.len() {
        problems.push(format!(
            "{} of the processes the guard left did not hold their memory to the end",
            ends.len() - killed.len() - held
        ));
    }
    (got, problems)
}

/// Whether the guard said it killed process `pid` of `t` for `rule`: what
/// to add to the row (the Event's note) and the problems.
async fn guard_said(
    ctx: &Ctx<'_>,
    node: &Node,
    t: &Tenant,
    rule: &str,
    pid: u32,
    said: Said,
) -> (String, Vec<String>) {
    let mut problems = Vec::new();
    if let Err(e) = guard_logged(ctx, node, rule, pid).await {
        problems.push(format!("{e:#}: killed, but not by the claim guard?"));
    }
    if said == Said::Log {
        return (String::new(), problems);
    }
    match guard_event(ctx, t, rule, pid).await {
        Ok(note) => (format!("; Event: {note}"), problems),
        Err(e) => {
            problems.push(format!("{e:#}"));
            (String::new(), problems)
        }
    }
}

/// Waits until the node's log has the guard's line for `rule` naming
/// process `pid`.
async fn guard_logged(ctx: &Ctx<'_>, node: &Node, rule: &str, pid: u32) -> Result<()> {
    let log = node.dir.join("plugin.log");
    let (rule_field, pid_field) = (format!("rule=\"{rule}\""), format!("pid={pid}"));
    wait_for(
        &format!("the node's log to name process {pid} ({rule})"),
        ctx.args.timeout,
        || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let found = text.lines().any(|l| {
                l.contains("tessera_driver::guard")
                    && l.contains(&rule_field)
                    && l.split_whitespace().any(|w| w == pid_field)
            });
            async move { Ok(found.then_some(())) }
        },
    )
    .await
}

/// The note of the guard's Event on `t`'s Pod for `rule` naming process
/// `pid`, once it is there.
async fn guard_event(ctx: &Ctx<'_>, t: &Tenant, rule: &str, pid: u32) -> Result<String> {
    let events: Api<Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let process = format!("process {pid} ");
    wait_for(
        &format!(
            "the claim guard's {rule} Event on pod {} naming process {pid}",
            t.name
        ),
        ctx.args.timeout,
        || {
            let events = events.clone();
            let process = process.clone();
            async move {
                let list = events.list(&ListParams::default()).await?;
                Ok(list.items.into_iter().find_map(|e| {
                    let about = e.regarding.as_ref().and_then(|r| r.name.as_deref());
                    let note = e.note.filter(|n| n.contains(&process))?;
                    (e.reason.as_deref() == Some(REASON)
                        && about == Some(t.name)
                        && e.action.as_deref().is_some_and(|a| a.starts_with(rule)))
                    .then_some(note)
                }))
            }
        },
    )
    .await
}

/// On real GPUs: does an MPS client of `b` run without `/dev/nvidia<N>`
/// while a process outside MPS there fails? Simulated GPUs have no answer
/// to give (the simulated driver reads only `/dev`).
pub(super) async fn gpu_node_question(
    ctx: &Ctx<'_>,
    node: &Node,
    b: &Tenant,
    table: &mut Table,
) -> Result<()> {
    const STEP: &str = "MPS client without /dev/nvidia<N>, outside MPS fails";
    if node.simulated() {
        table.push(
            STEP,
            b.name,
            "not measured (simulated)".into(),
            Verdict::Answer(None),
        );
        return Ok(());
    }
    let within = b.limits.memory_bytes / 2;
    let withhold = ["--withhold-gpu-nodes"];
    let client = Running::start(ctx, node, b, within, &[], None, &withhold)?
        .end(ctx.args.timeout)
        .await?;
    let outside = Running::start(ctx, node, b, within, &elsewhere(ctx)?, None, &withhold)?
        .end(ctx.args.timeout)
        .await?;
    let (client_runs, outside_runs) = (runs(&client), runs(&outside));
    table.push(
        STEP,
        b.name,
        format!(
            "MPS client: {}; outside MPS: {}",
            describe(&client),
            describe(&outside)
        ),
        Verdict::Answer(Some(client_runs && !outside_runs)),
    );
    Ok(())
}

/// Whether a process got a GPU and its memory (killed: it had a context of
/// its own for the guard to see).
fn runs(ended: &Ended) -> bool {
    match ended {
        Ended::Killed { .. } => true,
        Ended::Reported(r) => {
            r.error.is_none()
                && r.devices
                    .first()
                    .and_then(|d| d.allocation.as_ref())
                    .is_some_and(|a| a.ok)
        }
    }
}

fn describe(ended: &Ended) -> String {
    match ended {
        Ended::Killed { pid, after } => format!(
            "ran (process {pid} killed by the guard after {:.1}s)",
            secs(*after)
        ),
        Ended::Reported(r) => isolation::describe(r),
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::probe::{ProbeAllocation, ProbeDevice, ProbeEnvironment};

    const GIB: u64 = 1 << 30;

    fn report(alloc: Option<(u64, bool)>, sms: i32) -> ProbeReport {
        ProbeReport {
            library: "libcuda.so.1".into(),
            cuda_driver_version: Some(12080),
            environment: ProbeEnvironment::default(),
            container: None,
            devices: vec![ProbeDevice {
                ordinal: 0,
                uuid: "GPU-1".into(),
                gpu_uuid: "GPU-1".into(),
                name: "H100".into(),
                multiprocessors: sms,
                memory_total_bytes: 80 * GIB,
                memory_free_bytes: None,
                allocation: alloc.map(|(bytes, ok)| ProbeAllocation {
                    bytes,
                    ok,
                    error: None,
                }),
                kernels: None,
                error: None,
            }],
            error: None,
        }
    }

    fn killed(pid: u32) -> Ended {
        Ended::Killed {
            pid,
            after: Duration::from_millis(1500),
        }
    }

    #[test]
    fn each_of_the_many_fits_twice_but_not_three_times() {
        let claim = 4 * GIB;
        let each = each_holds(claim);
        assert_eq!(each % (2 << 20), 0);
        assert!(2 * each <= claim && 3 * each > claim, "{each}");
    }

    #[test]
    fn the_guard_must_kill_exactly_one_of_the_many_and_leave_the_rest() {
        let each = each_holds(4 * GIB);
        let held = || Ended::Reported(Box::new(report(Some((each, true)), 32)));
        let (got, problems) = too_many(&[held(), killed(7), held()], each);
        assert!(problems.is_empty(), "{problems:?}");
        assert!(
            got.starts_with("1 of 3 killed (7 after 1.5s), 2 held"),
            "{got}"
        );

        let (_, problems) = too_many(&[held(), held(), held()], each);
        assert!(problems[0].contains("got 0"), "{problems:?}");
        let (_, problems) = too_many(&[killed(7), killed(8), held()], each);
        assert!(problems[0].contains("got 2"), "{problems:?}");
        let refused = Ended::Reported(Box::new(report(Some((each, false)), 32)));
        let (_, problems) = too_many(&[held(), killed(7), refused], each);
        assert!(problems[0].contains("did not hold"), "{problems:?}");
    }

    #[test]
    fn a_process_outside_its_share_fails_unless_it_got_no_gpu() {
        let limits = Limits {
            gpu_sms: 132,
            cores_percent: 25,
            memory_bytes: 4 * GIB,
        };
        let whole = report(Some((6 * GIB, true)), 132);
        let problems = over_share("GPU-1", &limits, &whole);
        assert!(
            problems[0].contains("the claim guard did not stop it"),
            "{problems:?}"
        );
        let limited = report(Some((6 * GIB, false)), 32);
        assert!(over_share("GPU-1", &limits, &limited).is_empty());
        let mut none = report(None, 0);
        none.devices.clear();
        none.error = Some("cuInit: CUDA_ERROR_NO_DEVICE".into());
        assert!(over_share("GPU-1", &limits, &none).is_empty());
    }

    #[test]
    fn a_process_runs_when_it_gets_its_memory_or_is_killed() {
        assert!(runs(&Ended::Reported(Box::new(report(
            Some((GIB, true)),
            66
        )))));
        assert!(runs(&killed(9)));
        assert!(!runs(&Ended::Reported(Box::new(report(
            Some((GIB, false)),
            66
        )))));
        let mut failed = report(None, 0);
        failed.devices.clear();
        failed.error = Some("cuInit: CUDA_ERROR_NO_DEVICE".into());
        assert!(!runs(&Ended::Reported(Box::new(failed))));
    }
}
