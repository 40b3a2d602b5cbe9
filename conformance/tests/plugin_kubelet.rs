//! The whole node path with real components: `tessera publish` publishes
//! the simulated GPUs of the kubelet's node, the real scheduler allocates a
//! whole GPU to a Pod's claim (from a ResourceClaimTemplate), the real
//! kubelet finds `tessera plugin` through its plugin registry, calls
//! NodePrepareResources, runs the Pod (fake CRI), and calls
//! NodeUnprepareResources when the Pod is deleted: CDI spec and checkpoint
//! entry appear and go, and the claim's status says which GPU it got.
//!
//! The driver name is unique per run, so this test never shares a pool or
//! slices with other tests on the same node.

mod plugin_support;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;
use tessera_conformance::{TestCluster, delete_ignore_missing, unique_name, wait_for};

use plugin_support::*;

#[tokio::test]
async fn kubelet_prepares_and_unprepares_through_tessera() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let Some(kubelet) = cluster.kubelet().cloned() else {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to check");
        return Ok(());
    };
    let id = unique_name("pk");
    let driver = format!("{id}.tessera.dev");
    let node = cluster.node_name().to_owned();
    let ns = cluster.create_namespace("plugin-kubelet").await?;
    let dirs = PluginDirs::new()?;
    let client = cluster.client();

    // Slices, published by the real publisher.
    let b = binaries();
    let out = std::process::Command::new(&b.tessera)
        .arg("--nvml-library")
        .arg(&b.fake_nvml)
        .args([
            "publish",
            "--once",
            "--node-name",
            &node,
            "--driver-name",
            &driver,
        ])
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .env("TESSERA_FAKE_NVML_TOPOLOGY", topology_path())
        .output()?;
    ensure!(
        out.status.success(),
        "tessera publish --once: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The plugin, in the kubelet's own directories.
    let mut plugin = {
        let log = dirs.path("plugin.log");
        let out = std::fs::File::create(&log)?;
        let child = std::process::Command::new(&b.tessera)
            .arg("--nvml-library")
            .arg(&b.fake_nvml)
            .arg("plugin")
            .args(["--node-name", &node, "--driver-name", &driver])
            .arg("--kubeconfig")
            .arg(cluster.kubeconfig())
            .arg("--kubelet-registry-dir")
            .arg(&kubelet.registry)
            .arg("--kubelet-plugins-dir")
            .arg(&kubelet.plugins)
            .arg("--cdi-dir")
            .arg(dirs.cdi())
            .arg("--state-dir")
            .arg(dirs.state())
            .arg("--driver-root")
            .arg(dirs.driver_root())
            .arg("--boot-id-file")
            .arg(dirs.boot_id())
            .env("TESSERA_FAKE_NVML_TOPOLOGY", topology_path())
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?;
        KillOnDrop(child, log)
    };

    let result = run(&cluster, &ns, &driver, &id, &dirs, &mut plugin).await;
    // Cleanup whatever happened.
    let _ = ns
        .api::<Pod>()
        .delete("gpu-pod", &DeleteParams::default().grace_period(0))
        .await;
    let _ = ns.delete().await;
    let _ = delete_ignore_missing(&Api::<DeviceClass>::all(client.clone()), &id).await;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    if let Ok(list) = slices
        .list(&ListParams::default().fields(&format!("spec.driver={driver}")))
        .await
    {
        for s in list.items {
            let _ = delete_ignore_missing(&slices, s.metadata.name.as_deref().unwrap_or_default())
                .await;
        }
    }
    if result.is_err() {
        eprintln!(
            "plugin log:\n{}",
            std::fs::read_to_string(&plugin.1).unwrap_or_default()
        );
    }
    result
}

struct KillOnDrop(std::process::Child, std::path::PathBuf);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child, not yet reaped; SIGTERM lets it
        // remove its sockets from the kubelet's directories.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + TIMEOUT;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn run(
    cluster: &TestCluster,
    ns: &tessera_conformance::TestNamespace,
    driver: &str,
    id: &str,
    dirs: &PluginDirs,
    plugin: &mut KillOnDrop,
) -> Result<()> {
    let client = cluster.client();
    let pp = PostParams::default();
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": id },
        "spec": { "selectors": [{ "cel": { "expression":
            format!("device.driver == {driver:?} && device.attributes[{driver:?}].type == \"gpu\"") } }] },
    }))?;
    Api::<DeviceClass>::all(client.clone())
        .create(&pp, &class)
        .await?;
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": { "name": "gpu" },
        "spec": { "spec": { "devices": { "requests": [{
            "name": "gpu", "exactly": { "deviceClassName": id },
        }]}}},
    }))?;
    ns.api::<ResourceClaimTemplate>()
        .create(&pp, &template)
        .await?;
    // Like a DaemonSet's readiness: the kubelet has accepted the plugin
    // (NotifyRegistrationStatus) before a Pod needs it.
    let log = plugin.1.clone();
    wait_for("the kubelet to register the plugin", TIMEOUT, || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        async move { Ok(text.contains("registered with the kubelet").then_some(())) }
    })
    .await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "gpu-pod" },
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "resourceClaims": [{ "name": "gpu", "resourceClaimTemplateName": "gpu" }],
            "containers": [{
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": { "claims": [{ "name": "gpu" }] },
            }],
        },
    }))?;
    let pods = ns.api::<Pod>();
    pods.create(&pp, &pod).await?;

    let running = wait_for(
        "pod Running after the kubelet prepared its claim",
        TIMEOUT * 2,
        || {
            let exited = plugin.0.try_wait();
            let pods = pods.clone();
            async move {
                if let Ok(Some(status)) = exited {
                    anyhow::bail!("tessera plugin exited: {status}");
                }
                let p = pods.get("gpu-pod").await?;
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                Ok((phase.as_deref() == Some("Running")).then_some(p))
            }
        },
    )
    .await?;
    let claim_name = running
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|v| v.iter().find(|c| c.name == "gpu"))
        .and_then(|c| c.resource_claim_name.clone())
        .context("pod status names no claim")?;
    let claims: Api<ResourceClaim> = ns.api();
    let claim = claims.get(&claim_name).await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let allocated = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default();
    ensure!(
        allocated.len() == 1 && allocated[0].driver == driver,
        "{allocated:?}"
    );

    // Prepared by Tessera: spec and checkpoint entry, status with the GPU.
    let spec = dirs.spec(&uid).context("no CDI spec for the Pod's claim")?;
    ensure!(spec["devices"][0]["name"] == format!("gpu_{uid}"), "{spec}");
    ensure!(dirs.checkpoint()[&uid]["state"] == "Completed");
    let gpu_uuid = wait_for("status.devices with the GPU UUID", TIMEOUT, || async {
        let c = claims.get(&claim_name).await?;
        Ok(c.status
            .and_then(|s| s.devices)
            .and_then(|d| d.into_iter().next())
            .and_then(|d| d.data)
            .and_then(|d| {
                d.0.get("gpuUUID")
                    .and_then(|v| v.as_str())
                    .map(str::to_owned)
            }))
    })
    .await?;
    ensure!(
        inventory().gpus.iter().any(|g| g.uuid == gpu_uuid),
        "status names {gpu_uuid}, not a GPU of the node"
    );
    let env = spec["devices"][0]["containerEdits"]["env"].to_string();
    ensure!(
        env.contains(&format!("NVIDIA_VISIBLE_DEVICES={gpu_uuid}")),
        "{env}"
    );

    // Deleting the Pod makes the kubelet unprepare.
    pods.delete("gpu-pod", &DeleteParams::default()).await?;
    wait_for(
        "CDI spec and checkpoint entry removed by unprepare",
        TIMEOUT * 2,
        || async {
            Ok((dirs.spec(&uid).is_none() && !dirs.checkpoint().contains_key(&uid)).then_some(()))
        },
    )
    .await?;
    Ok(())
}
