//! The claims' MPS daemons kept in line with the prepared-claim records
//! for the life of the node process.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::host::mps::{MpsSupervisor, SupervisionReport};
use crate::metrics::Metrics;
use crate::prepare::Preparer;

/// Bring the MPS daemons in line with the checkpoint (claims that were
/// unprepared while the plugin was down release theirs; daemons of prepared
/// claims that died are restarted), then keep them alive. Only the marking
/// happens here: the stops, adoptions and restarts run in the watchdog's
/// first pass, in parallel and in the background, so hung daemons never
/// delay serving.
pub fn supervise(mps: &Arc<MpsSupervisor>, preparer: &Preparer, metrics: Option<Arc<Metrics>>) {
    let prepared: BTreeSet<_> = preparer.entries().into_iter().map(|(uid, _)| uid).collect();
    // A claim whose record was lost keeps its daemons: its Pod may run.
    let lost = preparer.lost_claims();
    log_supervision(&mps.release_claims_unless(|uid| prepared.contains(uid) || lost.may_hold(uid)));
    let watchdog = mps.spawn_watchdog(MPS_WATCHDOG_PERIOD, move |report| {
        if let Some(metrics) = &metrics {
            metrics.mps_restarted(report.restarted.len());
        }
        log_supervision(report)
    });
    // The watchdog stops when its handle drops: keep it for the life of the
    // runtime.
    tokio::spawn(async move {
        let _watchdog = watchdog;
        std::future::pending::<()>().await
    });
}

const MPS_WATCHDOG_PERIOD: Duration = Duration::from_secs(10);

fn log_supervision(report: &SupervisionReport) {
    for key in &report.adopted {
        info!(daemon = %key, "adopted a running MPS control daemon");
    }
    for key in &report.restarted {
        warn!(daemon = %key, "MPS control daemon was not running; restarted it in a fresh pipe directory (containers started from now on reach it)");
    }
    for key in &report.stopped {
        info!(daemon = %key, "stopped the MPS control daemon of a claim no longer prepared");
    }
    for (daemon, error) in &report.failed {
        warn!(daemon = %daemon, "MPS control daemon needs attention: {error}");
    }
}
