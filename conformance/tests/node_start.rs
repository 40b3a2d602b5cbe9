//! `conformance/cluster.sh node-start` / `node-stop` / `env`: the script that
//! runs Tessera's node process on the cluster's kubelet node over simulated
//! GPUs (what `conformance/demo.sh` builds on).
//!
//! * `node-start` returns once the plugin registered with the kubelet and the
//!   node's slices are published; a second `node-start` leaves the running
//!   process alone.
//! * `cluster.sh env` gives another process the same simulated machine:
//!   `tessera inventory` run with its variables reports the GPUs the node
//!   published, and the MIG capability files are in the node's driver root.
//! * `node-stop` ends exactly the recorded process (its kubelet sockets go);
//!   `node-start` without arguments restarts the same machine and driver,
//!   and the restart writes no slice (nothing changed).
//!
//! Parallel-safe on the shared cluster: the node process runs under a driver
//! name of its own (its own pool, no DeviceClass selects it), with its own
//! NVML state, driver root and MPS directory below `<state dir>/node`. That
//! directory holds one simulated node per cluster, so the test refuses to
//! run where someone already started one there, and removes it afterwards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::ListParams;
use serde_json::Value;
use tessera_conformance::{TestCluster, delete_ignore_missing, unique_name, wait_for};
use tessera_test_kit::cluster::{ClusterState, parse_exports};
use tessera_test_kit::repo_root;

const TOPOLOGY: &str = "a100-40gb-x2-mig.yaml";
const TIMEOUT: Duration = Duration::from_secs(60);

/// Builds what node-start needs (a no-op after `cargo build --workspace`)
/// and returns cargo's target directory, where node-start looks for it.
fn build() -> Result<PathBuf> {
    let profile = tessera_test_kit::artifacts::node_start_profile_dir();
    Ok(profile
        .parent()
        .context("a profile directory is inside the target directory")?
        .to_path_buf())
}

struct Script {
    state_dir: PathBuf,
    target_dir: PathBuf,
}

impl Script {
    /// Runs `cluster.sh <args>`; its stderr (the script's log) is returned
    /// with stdout in the error when it fails.
    fn run(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(repo_root().join("conformance/cluster.sh"))
            .args(args)
            .env("TESSERA_CLUSTER_DIR", &self.state_dir)
            .env("CARGO_TARGET_DIR", &self.target_dir)
            .output()
            .context("running cluster.sh")?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            bail!("cluster.sh {args:?} failed ({}):\n{stderr}", out.status);
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The variables `cluster.sh env` exports (`export K='v'` lines; the
    /// `PATH`/`LD_LIBRARY_PATH` lines' shell suffixes are dropped).
    fn env(&self) -> Result<BTreeMap<String, String>> {
        Ok(parse_exports(&self.run(&["env"])?))
    }

    /// PID recorded for the node process, if any.
    fn node_pid(&self) -> Option<u32> {
        let pid = ClusterState::new(&self.state_dir).recorded_pid("tessera-node")?;
        u32::try_from(pid).ok()
    }
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

/// Name -> resourceVersion of the node's slices of `driver`.
async fn slices(
    api: &Api<ResourceSlice>,
    node: &str,
    driver: &str,
) -> Result<BTreeMap<String, String>> {
    let list = api
        .list(&ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={driver}")))
        .await?;
    Ok(list
        .items
        .into_iter()
        .map(|s| {
            (
                s.metadata.name.unwrap_or_default(),
                s.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect())
}

/// GPU UUIDs published in the slices of `driver` on `node`.
async fn published_gpus(api: &Api<ResourceSlice>, node: &str, driver: &str) -> Result<Vec<String>> {
    let list = api
        .list(&ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={driver}")))
        .await?;
    let mut uuids: Vec<String> = list
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| {
            let attrs = d.attributes.as_ref()?;
            let parent = attrs.get("parentUUID").or_else(|| attrs.get("uuid"))?;
            let uuid = parent.string.clone()?;
            uuid.starts_with("GPU-").then_some(uuid)
        })
        .collect();
    uuids.sort();
    uuids.dedup();
    Ok(uuids)
}

#[tokio::test]
async fn node_start_runs_the_node_process_on_the_kubelet_node() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let Some(kubelet) = cluster.kubelet().cloned() else {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to check");
        return Ok(());
    };
    let node_dir = cluster.state_dir().join("node");
    // A node was started when it has its settings (the directory itself
    // exists from `start`: the container runtime reads its CDI specs).
    ensure!(
        !node_dir.join("node.env").exists(),
        "{} exists: a simulated node was started on this cluster already (cluster.sh \
         node-start); this test needs the cluster's node slot: `conformance/cluster.sh node-stop \
         && rm -rf {}`, or run it on a cluster of its own",
        node_dir.display(),
        node_dir.display()
    );
    let script = Script {
        state_dir: cluster.state_dir().to_path_buf(),
        target_dir: tokio::task::spawn_blocking(build).await??,
    };
    let driver = format!("{}.tessera.dev", unique_name("ns"));
    let node = cluster.node_name().to_owned();
    let api: Api<ResourceSlice> = Api::all(cluster.client());

    let result = run(&script, &api, &kubelet.registry, &node, &driver).await;

    // Cleanup whatever happened: the process, its slices, its node dir.
    let mps = script
        .env()
        .ok()
        .and_then(|e| e.get("TESSERA_NODE_MPS_DIR").cloned());
    let stopped = script.run(&["node-stop"]);
    if let Ok(names) = slices(&api, &node, &driver).await {
        for name in names.keys() {
            let _ = delete_ignore_missing(&api, name).await;
        }
    }
    if result.is_err() {
        eprintln!(
            "node log:\n{}",
            std::fs::read_to_string(node_dir.join("tessera.log")).unwrap_or_default()
        );
    }
    let _ = std::fs::remove_dir_all(&node_dir);
    if let Some(mps) = mps {
        let _ = std::fs::remove_dir_all(mps);
    }
    result?;
    stopped.map(|_| ())
}

async fn run(
    script: &Script,
    api: &Api<ResourceSlice>,
    registry: &Path,
    node: &str,
    driver: &str,
) -> Result<()> {
    let topology = repo_root()
        .join("driver/fake-nvml/topologies")
        .join(TOPOLOGY);
    let topology = topology.to_str().context("topology path")?;

    // Start: registered and published when it returns.
    script.run(&[
        "node-start",
        "--topology",
        topology,
        "--driver-name",
        driver,
    ])?;
    let pid = script.node_pid().context("node-start recorded no PID")?;
    ensure!(alive(pid), "the node process {pid} is not running");
    let first = slices(api, node, driver).await?;
    ensure!(
        !first.is_empty(),
        "node-start returned before slices were published"
    );
    let reg_socket = |registry: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(registry)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(&format!("{driver}-")))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    ensure!(
        !reg_socket(registry).is_empty(),
        "no registration socket of {driver} in the kubelet's registry"
    );

    // Idempotent: the running process is left alone.
    script.run(&[
        "node-start",
        "--topology",
        topology,
        "--driver-name",
        driver,
    ])?;
    ensure!(
        script.node_pid() == Some(pid),
        "a second node-start replaced the process"
    );

    // Another process with `cluster.sh env` sees the same machine.
    let env = script.env()?;
    for k in [
        "TESSERA_NODE_CDI_DIR",
        "TESSERA_NODE_STATE_DIR",
        "TESSERA_NODE_DRIVER_ROOT",
        "TESSERA_NODE_LOG",
        "TESSERA_FAKE_NVML_TOPOLOGY",
        "TESSERA_FAKE_NVML_STATE",
        "TESSERA_FAKE_NVML_DRIVER_ROOT",
        "LD_LIBRARY_PATH",
    ] {
        ensure!(env.contains_key(k), "cluster.sh env does not export {k}");
    }
    let tessera = script.target_dir.join("debug/tessera");
    let out = Command::new(&tessera)
        .args(["inventory", "--output", "json"])
        .env_remove("TESSERA_NVML_LIBRARY")
        .env_remove("TESSERA_FAKE_NVML_EVENTS")
        .envs(
            env.iter()
                .filter(|(k, _)| k.starts_with("TESSERA_FAKE_NVML_") || *k == "LD_LIBRARY_PATH"),
        )
        .output()
        .context("running tessera inventory")?;
    ensure!(
        out.status.success(),
        "tessera inventory with cluster.sh env: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inventory: Value = serde_json::from_slice(&out.stdout)?;
    let mut seen: Vec<String> = inventory["gpus"]
        .as_array()
        .context("inventory has no gpus")?
        .iter()
        .filter_map(|g| g["uuid"].as_str().map(str::to_owned))
        .collect();
    seen.sort();
    ensure!(
        seen == published_gpus(api, node, driver).await?,
        "tessera inventory ({seen:?}) and the published slices disagree"
    );
    let caps = Path::new(&env["TESSERA_NODE_DRIVER_ROOT"])
        .join("proc/driver/nvidia/capabilities/gpu0/mig");
    ensure!(
        caps.is_dir(),
        "no MIG capability files in {}",
        caps.display()
    );

    // Stop: exactly that process, its sockets gone; a second stop is a no-op.
    script.run(&["node-stop"])?;
    ensure!(!alive(pid), "node-stop left {pid} running");
    ensure!(
        reg_socket(registry).is_empty(),
        "node-stop left the registration socket"
    );
    script.run(&["node-stop"])?;

    // Restart without arguments: same machine and driver, nothing to write.
    script.run(&["node-start"])?;
    let restarted = script.node_pid().context("no PID after restart")?;
    ensure!(
        restarted != pid && alive(restarted),
        "node-start did not restart the process"
    );
    let after = wait_for("the restarted node's slices", TIMEOUT, || async {
        let s = slices(api, node, driver).await?;
        Ok((!s.is_empty()).then_some(s))
    })
    .await?;
    ensure!(
        after == first,
        "a restart on the same machine rewrote slices: {first:?} -> {after:?}"
    );
    Ok(())
}
