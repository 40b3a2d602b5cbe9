//! `tessera publish` against an API server with the partitionable-devices
//! and consumable-capacity gates off (the second cluster that
//! `conformance/test-all.sh` starts; its kubeconfig in
//! `TESSERA_DEGRADED_KUBECONFIG`). The publisher must detect that, publish
//! the static per-GPU mode from the node policy, and the real scheduler must
//! still keep modes apart and refuse the N+1th share.

mod slices;

use anyhow::{Context, Result, ensure};
use slices::suite;
use slices::*;
use tessera_conformance::wait_for;

#[tokio::test]
async fn static_mode_t4() -> Result<()> {
    suite::static_mode(&Cluster::degraded().await?, suite::T4).await
}

#[tokio::test]
async fn static_mode_l4x2() -> Result<()> {
    suite::static_mode(&Cluster::degraded().await?, suite::L4X2).await
}

#[tokio::test]
async fn static_mode_a100x2_mig() -> Result<()> {
    suite::static_mode(&Cluster::degraded().await?, suite::A100X2_MIG).await
}

#[tokio::test]
async fn static_mode_h100x8() -> Result<()> {
    suite::static_mode(&Cluster::degraded().await?, suite::H100X8).await
}

#[tokio::test]
async fn static_mode_h100x8_mig() -> Result<()> {
    suite::static_mode(&Cluster::degraded().await?, suite::H100X8_MIG).await
}

/// Detection reports why, and a restart writes nothing here either.
#[tokio::test]
async fn degraded_detection_and_restart() -> Result<()> {
    let cluster = Cluster::degraded().await?;
    let pool = Pool::new(&cluster, "degraded-restart", suite::H100X8.file).await?;
    let result = async {
        let first = pool.publish_once()?;
        let server = &first.report["server"];
        ensure!(
            !first.full_model()
                && server["partitionableDevices"] == false
                && server["consumableCapacity"] == false,
            "not detected as degraded: {}",
            first.report
        );
        let reasons = server["reasons"].to_string();
        ensure!(
            reasons.contains("DRAPartitionableDevices")
                && reasons.contains("DRAConsumableCapacity"),
            "detection does not say why: {reasons}"
        );
        ensure!(
            first.writes().0 == first.slices(),
            "first publish: {}",
            first.report
        );
        suite::restart_writes_nothing(&pool).await?;
        Ok(())
    }
    .await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("node {}", pool.node))?;
    cleanup
}

/// Told the server has everything (`--capabilities full`) while it drops
/// the fields: the server stores something else than was written. The
/// daemon must notice that nothing changed since its own write and stop,
/// not rewrite in a loop.
#[tokio::test]
async fn forced_full_model_does_not_loop() -> Result<()> {
    let cluster = Cluster::degraded().await?;
    let pool = Pool::new(&cluster, "degraded-forced", suite::T4.file).await?;
    let result = async {
        let mut daemon = Daemon::start(&pool, &["--capabilities", "full"])?;
        wait_for(
            "the daemon to notice the server rewrites its slices",
            SCHEDULING_TIMEOUT,
            || async {
                Ok(daemon
                    .log()
                    .contains("stores our slices in a form that differs")
                    .then_some(()))
            },
        )
        .await
        .with_context(|| daemon.log())?;
        daemon.check_running()?;
        // What the server kept lacks the counters and the share devices'
        // request policies.
        let slices = pool.slices().await?;
        ensure!(
            slices.iter().all(|s| s.spec.shared_counters.is_none())
                && slices
                    .iter()
                    .flat_map(|s| s.spec.devices.iter().flatten())
                    .all(
                        |d| d.consumes_counters.is_none() && d.allow_multiple_allocations.is_none()
                    ),
            "the degraded server kept partitionable/consumable fields"
        );
        daemon.stop().await?;
        let log = daemon.log();
        let writes = log.matches("published 2 slices").count();
        ensure!(
            writes == 1,
            "expected one publishing pass, saw {writes}:\n{log}"
        );
        Ok(())
    }
    .await;
    let cleanup = pool.cleanup().await;
    result.with_context(|| format!("node {}", pool.node))?;
    cleanup
}
