//! Compatibility groups (KEP-5963) on the cluster that
//! `conformance/test-all.sh` starts with `DRADeviceCompatibilityGroups=true`
//! on its API server and scheduler (Kubernetes 1.37+; its kubeconfig in
//! `TESSERA_GROUPS_KUBECONFIG`). The publisher detects the gate and names
//! each counter consumption's mode, and the real scheduler refuses the same
//! mixes as on the main cluster, where the gate is off and no group is
//! published (`slices_scheduler`'s full-model tests run the same suite
//! there): nothing else is refused. Turned off, none are published.

mod slices;

use anyhow::{Result, ensure};
use slices::suite;
use slices::*;

#[tokio::test]
async fn full_model_with_groups_a100x2_mig() -> Result<()> {
    suite::full_model(&Cluster::groups().await?, suite::A100X2_MIG).await
}

#[tokio::test]
async fn full_model_with_groups_h100x8_mig() -> Result<()> {
    suite::full_model(&Cluster::groups().await?, suite::H100X8_MIG).await
}

#[tokio::test]
async fn groups_turned_off_are_not_published() -> Result<()> {
    let cluster = Cluster::groups().await?;
    let pool = Pool::new(&cluster, "groups-off", suite::T4.file).await?;
    let result = async {
        let published =
            pool.publish_once_with(&pool.topology, &["--compatibility-groups", "off"])?;
        let server = &published.report["server"];
        ensure!(
            server["compatibilityGroups"] == false
                && server["reasons"].as_array().is_some_and(|r| r
                    .iter()
                    .any(|r| r.as_str().is_some_and(|r| r.contains("turned off")))),
            "{server}"
        );
        let slices = pool.slices().await?;
        let grouped = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .flat_map(|d| d.consumes_counters.iter().flatten())
            .filter(|c| c.compatibility_groups.is_some())
            .count();
        ensure!(grouped == 0, "{grouped} consumptions name groups");
        Ok(())
    }
    .await;
    let cleanup = pool.cleanup().await;
    result?;
    cleanup
}
