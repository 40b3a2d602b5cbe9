//! One node process, one truth about the node: `tessera plugin` publishes
//! the node's slices itself, and every device it publishes can be prepared
//! as published.
//!
//! * Every device of the first and last GPU of every simulated topology, in
//!   the full model and in the static model, is allocated (status written
//!   as the scheduler would), prepared and unprepared through the plugin's
//!   socket; the GPU's MIG state read by `tessera inventory` in another
//!   process matches what prepare returned (a MIG device exists with the
//!   UUID the claim got; a whole GPU or share finds MIG off), and after
//!   unprepare the GPU is back (its instances as before; a GPU whose MIG
//!   mode the driver manages rests with MIG off).
//! * With the real scheduler: on 8x H100 with MIG off, a claim that asks for
//!   `firstAvailable: [1g.10gb MIG, Isolated share]` gets the MIG device,
//!   which prepare creates after switching MIG on; the slices the node
//!   publishes meanwhile still say it is the driver's (no static device for
//!   it, the GPU's other devices still there); unprepare destroys it and
//!   switches MIG off again.
//! * On 8x H100 with MIG on, the GPU without instances rests with MIG off
//!   (no claim holds it) and a whole GPU on it is prepared.
//! * A restart that rolls back a MIG device publishes what is left, not the
//!   GPU as it was before the rollback, and the device is prepared again.
//! * One writer: a second node process on the same state directory (a
//!   rolling update) waits until the first exits, and then keeps what the
//!   first prepared.
//! * Each instance answers its own probes (`--health-socket`, `tessera
//!   health`): the waiting one is on standby, ready to take over; one that
//!   could not take over (its NVML library missing) is alive but never
//!   ready, while the node's one metrics port still says 200 (the serving
//!   instance's, which the chart's probes used to ask).

mod plugin_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use tessera_api::inventory::{Gpu, Inventory, Mig};
use tessera_conformance::{delete_ignore_missing, unique_name, wait_for};
use tessera_controller::model::DeviceKind;

use plugin_support::*;

const TOPOLOGIES: [&str; 5] = [
    "t4.yaml",
    "l4x2.yaml",
    "a100-40gb-x2-mig.yaml",
    "h100x8.yaml",
    "h100x8-mig.yaml",
];

fn topology_file(name: &str) -> PathBuf {
    repo_root().join("driver/fake-nvml/topologies").join(name)
}

/// A simulated node: a fake Node object, the node process on a topology,
/// and a kubelet-side connection to it.
struct SimNode {
    world: World,
    plugin: PluginProcess,
    kubelet: Kubelet,
    topology: PathBuf,
}

impl SimNode {
    async fn start(prefix: &str, topology: &str, capabilities: &str) -> Result<SimNode> {
        let world = World::new(prefix).await?;
        world.cluster.register_fake_node(&world.node).await?;
        let topology = topology_file(topology);
        let mut options = world.options();
        options.topology = topology.clone();
        options.args = vec!["--capabilities".into(), capabilities.into()];
        let mut plugin = PluginProcess::start(&world.dirs, &options)?;
        let kubelet = register(&world.dirs, &mut plugin, &world.driver).await?;
        Ok(SimNode {
            world,
            plugin,
            kubelet,
            topology,
        })
    }

    /// The GPUs as another process on this node sees them now.
    fn inventory(&self) -> Result<Inventory> {
        self.world.dirs.inventory_now(&self.topology)
    }

    /// The devices the node process published, once it has.
    async fn published(&self) -> Result<Vec<Value>> {
        let api: Api<ResourceSlice> = Api::all(self.world.cluster.client());
        let fields = format!(
            "spec.nodeName={},spec.driver={}",
            self.world.node, self.world.driver
        );
        wait_for("the node's slices", TIMEOUT, || {
            let (api, fields) = (api.clone(), fields.clone());
            async move {
                let list = api.list(&ListParams::default().fields(&fields)).await?;
                // A whole pool: every slice of one generation, as many as
                // the pool says it has.
                let complete = list.items.first().is_some_and(|first| {
                    let pool = &first.spec.pool;
                    list.items
                        .iter()
                        .all(|s| s.spec.pool.generation == pool.generation)
                        && list.items.len() as i64 == pool.resource_slice_count
                });
                if !complete {
                    return Ok(None);
                }
                let devices: Vec<Value> = list
                    .items
                    .iter()
                    .flat_map(|s| s.spec.devices.iter().flatten())
                    .map(serde_json::to_value)
                    .collect::<Result<_, _>>()?;
                Ok((!devices.is_empty()).then_some(devices))
            }
        })
        .await
    }

    async fn stop(self) -> Result<()> {
        let SimNode { world, plugin, .. } = self;
        plugin.terminate().await?;
        let slices: Api<ResourceSlice> = Api::all(world.cluster.client());
        if let Ok(list) = slices
            .list(&ListParams::default().fields(&format!("spec.nodeName={}", world.node)))
            .await
        {
            for s in list.items {
                delete_ignore_missing(&slices, s.metadata.name.as_deref().unwrap_or_default())
                    .await?;
            }
        }
        world.cluster.delete_node(&world.node).await?;
        world.namespace.delete().await
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.plugin.log).unwrap_or_default()
    }
}

fn attr<'a>(device: &'a Value, name: &str) -> Option<&'a str> {
    device["attributes"][name]["string"].as_str()
}

/// The physical GPU a published device is on.
fn gpu_of(device: &Value) -> Option<&str> {
    attr(device, "parentUUID").or_else(|| attr(device, "uuid"))
}

fn gpu<'a>(inventory: &'a Inventory, uuid: &str) -> Result<&'a Gpu> {
    inventory
        .gpus
        .iter()
        .find(|g| g.uuid == uuid)
        .with_context(|| format!("GPU {uuid} not in the inventory"))
}

fn instance_uuids(gpu: &Gpu) -> BTreeSet<String> {
    gpu.mig.instances().iter().map(|i| i.uuid.clone()).collect()
}

/// An allocation result for `device` as the scheduler writes it.
fn allocation(node: &SimNode, device: &Value, n: usize) -> Value {
    let name = device["name"].as_str().unwrap_or_default();
    let mut r = result("gpu", &node.world.driver, &node.world.node, name);
    if device["allowMultipleAllocations"] == json!(true) {
        r["shareID"] = json!(format!("{n:08x}-0000-4000-8000-{n:012x}"));
        r["consumedCapacity"] = json!({ "memory": "1Gi", "cores": "10" });
    }
    // Monitoring devices are for admin access only.
    if attr(device, "type") == Some("monitor") {
        r["adminAccess"] = json!(true);
    }
    r
}

/// Prepares `device` alone, checks the GPU from another process, unprepares,
/// checks again.
async fn prepare_as_published(node: &mut SimNode, device: &Value, n: usize) -> Result<()> {
    let name = device["name"].as_str().context("device without a name")?;
    let kind = attr(device, "type").context("device without a type")?;
    let uuid = gpu_of(device).context("device without a GPU UUID")?;
    let before = node.inventory()?;
    let gpu_before = gpu(&before, uuid)?.clone();

    if kind == "monitor" {
        // Admin access (which monitoring devices need) only in a namespace
        // labelled for it.
        Api::<k8s_openapi::api::core::v1::Namespace>::all(node.world.cluster.client())
            .patch(
                node.world.ns(),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({ "metadata": { "labels": {
                    "resource.kubernetes.io/admin-access": "true"
                } } })),
            )
            .await?;
    }
    let claim_name = unique_name("dev");
    let claims: Api<ResourceClaim> = node.world.namespace.api();
    let claim = create_allocated(
        &node.world.cluster.client(),
        node.world.ns(),
        &ClaimSpec {
            name: claim_name.clone(),
            requests: vec![("gpu".into(), CLASS.into())],
            results: vec![allocation(node, device, n)],
            config: vec![],
            spec_config: vec![],
        },
    )
    .await?;
    let uid = claim.metadata.uid.clone().context("claim without UID")?;
    let reference = claim_ref(node.world.ns(), &claim);

    let answer = prepare(&mut node.kubelet, vec![reference.clone()]).await?;
    let mine = answer.claims.get(&uid).context("no answer")?;
    ensure!(
        mine.error.is_empty(),
        "{name} ({kind}) was published but prepare failed: {}",
        mine.error
    );
    let prepared = node.inventory()?;
    let gpu_now = gpu(&prepared, uuid)?;
    let status = &node.world.dirs.checkpoint()[&uid]["status"][0]["data"];
    match kind {
        "mig" => {
            let mig_uuid = status["migUUID"]
                .as_str()
                .with_context(|| format!("{name}: no MIG UUID in {status}"))?;
            ensure!(
                instance_uuids(gpu_now).contains(mig_uuid),
                "{name}: prepare returned {mig_uuid}, but another process sees {:?} on {uuid}",
                gpu_now.mig
            );
        }
        // A monitor watches the GPU in whatever mode it is in.
        "monitor" => ensure!(
            matches!(gpu_now.mig, Mig::Enabled { .. })
                == matches!(gpu_before.mig, Mig::Enabled { .. }),
            "{name}: preparing a monitoring device changed the MIG mode of {uuid}"
        ),
        _ => ensure!(
            !matches!(gpu_now.mig, Mig::Enabled { .. }),
            "{name} ({kind}) prepared while {uuid} is in MIG mode"
        ),
    }
    ensure!(status["gpuUUID"] == json!(uuid), "{name}: {status}");

    let un = unprepare(&mut node.kubelet, vec![reference]).await?;
    ensure!(
        un.claims[&uid].error.is_empty(),
        "{name}: unprepare failed: {}",
        un.claims[&uid].error
    );
    let after = node.inventory()?;
    let gpu_after = gpu(&after, uuid)?;
    ensure!(
        instance_uuids(gpu_after) == instance_uuids(&gpu_before),
        "{name}: MIG devices before {:?}, after unprepare {:?}",
        instance_uuids(&gpu_before),
        instance_uuids(gpu_after)
    );
    let mode = |g: &Gpu| matches!(g.mig, Mig::Enabled { .. });
    ensure!(
        mode(gpu_after) == mode(&gpu_before) || !mode(gpu_after),
        "{name}: MIG mode left on after unprepare"
    );
    claims.delete(&claim_name, &DeleteParams::default()).await?;
    Ok(())
}

#[tokio::test]
async fn every_published_device_is_prepared_as_published() -> Result<()> {
    for topology in TOPOLOGIES {
        for capabilities in ["full", "legacy"] {
            let mut node = SimNode::start("every", topology, capabilities).await?;
            let outcome = async {
                let devices = node.published().await?;
                let gpus: Vec<String> = {
                    let mut seen: Vec<String> = Vec::new();
                    for d in &devices {
                        if let Some(g) = gpu_of(d)
                            && !seen.iter().any(|s| s == g)
                        {
                            seen.push(g.to_owned());
                        }
                    }
                    seen.sort();
                    seen
                };
                // The first and last GPU (by UUID) stand for the others: the
                // topologies repeat one card state across the middle GPUs.
                let chosen: BTreeSet<&String> =
                    [gpus.first(), gpus.last()].into_iter().flatten().collect();
                let mut tried = 0;
                for (n, device) in devices.iter().enumerate() {
                    if !gpu_of(device).is_some_and(|g| chosen.contains(&g.to_owned())) {
                        continue;
                    }
                    prepare_as_published(&mut node, device, n)
                        .await
                        .with_context(|| format!("{topology}, {capabilities} model"))?;
                    tried += 1;
                }
                ensure!(tried > 0, "{topology}: no device published");
                eprintln!("{topology} ({capabilities}): {tried} devices prepared as published");
                anyhow::Ok(())
            }
            .await;
            if outcome.is_err() {
                eprintln!("plugin log:\n{}", node.log());
            }
            node.stop().await?;
            outcome?;
        }
    }
    Ok(())
}

/// A DeviceClass of this test's driver selecting devices of `kind`.
async fn device_class(node: &SimNode, name: &str, cel: &str) -> Result<()> {
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "selectors": [{ "cel": { "expression": cel } }] },
    }))?;
    Api::<DeviceClass>::all(node.world.cluster.client())
        .create(&PostParams::default(), &class)
        .await?;
    Ok(())
}

/// A Pod on the simulated node with one claim; the scheduler allocates it.
async fn pod_with_claim(node: &SimNode, name: &str, claim: &str) -> Result<()> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "nodeSelector": { "kubernetes.io/hostname": node.world.node },
            "containers": [{ "name": "c", "image": "registry.k8s.io/pause:3.10", "resources": { "claims": [{ "name": "gpu" }] } }],
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": claim }],
        },
    }))?;
    node.world
        .namespace
        .api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

async fn allocated(node: &SimNode, claim: &str) -> Result<ResourceClaim> {
    let api: Api<ResourceClaim> = node.world.namespace.api();
    wait_for(&format!("claim {claim} allocated"), TIMEOUT, || {
        let api = api.clone();
        let claim = claim.to_owned();
        async move {
            let c = api.get(&claim).await?;
            let done = c
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .is_some();
            Ok(done.then_some(c))
        }
    })
    .await
}

fn allocated_device(claim: &ResourceClaim) -> Result<String> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref()?.first())
        .map(|r| r.device.clone())
        .context("no allocated device")
}

#[tokio::test]
async fn the_scheduler_picks_dynamic_mig_on_a_mig_off_hopper_and_it_is_prepared() -> Result<()> {
    let mut node = SimNode::start("dynmig", "h100x8.yaml", "auto").await?;
    let id = unique_name("dm");
    let driver = node.world.driver.clone();
    let mig_class = format!("{id}-mig");
    let share_class = format!("{id}-isolated");
    let outcome = async {
        let published = node.published().await?;
        device_class(
            &node,
            &mig_class,
            &format!(
                "device.driver == {driver:?} && device.attributes[{driver:?}].type == \"mig\" \
                 && device.attributes[{driver:?}].profile == \"1g.10gb\""
            ),
        )
        .await?;
        device_class(
            &node,
            &share_class,
            &format!(
                "device.driver == {driver:?} && device.attributes[{driver:?}].isolationLevel == \"Isolated\""
            ),
        )
        .await?;
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": "first-available" },
            "spec": { "devices": { "requests": [{ "name": "gpu", "firstAvailable": [
                { "name": "mig", "deviceClassName": mig_class },
                { "name": "share", "deviceClassName": share_class,
                  "capacity": { "requests": { "memory": "4Gi" } } },
            ]}]}},
        }))?;
        let claims: Api<ResourceClaim> = node.world.namespace.api();
        claims.create(&PostParams::default(), &claim).await?;
        pod_with_claim(&node, "dynmig", "first-available").await?;
        let claim = allocated(&node, "first-available").await?;
        let device = allocated_device(&claim)?;
        ensure!(
            device.contains("-mig-1g-10gb-"),
            "the scheduler should take the first alternative, got {device}"
        );
        let gpu_uuid = published
            .iter()
            .find(|d| d["name"] == json!(device))
            .and_then(gpu_of)
            .context("allocated device not published")?
            .to_owned();
        let uid = claim.metadata.uid.clone().context("uid")?;
        let reference = claim_ref(node.world.ns(), &claim);
        let answer = prepare(&mut node.kubelet, vec![reference.clone()]).await?;
        ensure!(
            answer.claims[&uid].error.is_empty(),
            "prepare: {}",
            answer.claims[&uid].error
        );
        let status = &node.world.dirs.checkpoint()[&uid]["status"][0]["data"];
        let mig_uuid = status["migUUID"].as_str().context("no MIG UUID")?.to_owned();
        // Another process sees the MIG device prepare made, MIG mode on.
        let inv = node.inventory()?;
        ensure!(instance_uuids(gpu(&inv, &gpu_uuid)?).contains(&mig_uuid));

        // The node saw the new instance (it rediscovers after prepare) and
        // still publishes it as the allocated placement device: the same
        // device names, none carrying the new MIG UUID as a static device.
        let names = |ds: &[Value]| -> BTreeSet<String> {
            ds.iter()
                .filter_map(|d| d["name"].as_str().map(str::to_owned))
                .collect()
        };
        // The observer logs each changed view, the publisher each reconcile:
        // wait for a reconcile of a view that holds the new instance.
        let log = node.plugin.log.clone();
        wait_for("a reconcile of the node with its new MIG device", TIMEOUT, || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            async move {
                let seen = text.rfind("node changed").filter(|at| {
                    text[*at..].lines().next().is_some_and(|l| l.contains("created_mig=1"))
                });
                Ok(seen
                    .filter(|at| {
                        let rest = &text[*at..];
                        rest.contains("slices up to date") || rest.contains("published ")
                    })
                    .map(|_| ()))
            }
        })
        .await?;
        let now = node.published().await?;
        ensure!(
            names(&now) == names(&published),
            "the slices changed after prepare created an instance: added {:?}, removed {:?}",
            names(&now).difference(&names(&published)).collect::<Vec<_>>(),
            names(&published).difference(&names(&now)).collect::<Vec<_>>()
        );
        ensure!(
            !now.iter().any(|d| attr(d, "uuid") == Some(mig_uuid.as_str())),
            "the driver's own MIG device was published as a foreign static device"
        );

        node.world
            .namespace
            .api::<Pod>()
            .delete("dynmig", &DeleteParams::default().grace_period(0))
            .await?;
        let un = unprepare(&mut node.kubelet, vec![reference]).await?;
        ensure!(un.claims[&uid].error.is_empty(), "{}", un.claims[&uid].error);
        let inv = node.inventory()?;
        let g = gpu(&inv, &gpu_uuid)?;
        ensure!(
            matches!(g.mig, Mig::Disabled { .. }),
            "MIG mode not switched off after the last MIG device: {:?}",
            g.mig
        );
        anyhow::Ok(())
    }
    .await;
    if outcome.is_err() {
        eprintln!("plugin log:\n{}", node.log());
    }
    let client = node.world.cluster.client();
    for class in [&mig_class, &share_class] {
        delete_ignore_missing(&Api::<DeviceClass>::all(client.clone()), class).await?;
    }
    node.stop().await?;
    outcome
}

#[tokio::test]
async fn a_mig_on_hopper_without_instances_rests_with_mig_off_and_serves_a_whole_gpu() -> Result<()>
{
    let mut node = SimNode::start("whole-on-mig", "h100x8-mig.yaml", "auto").await?;
    let outcome = async {
        // The topology leaves one GPU in MIG mode without instances; no
        // claim holds it, so the node switches it off (Hopper needs no reset).
        let text = std::fs::read_to_string(&node.topology)?;
        let seeded: Vec<String> = node
            .inventory()?
            .gpus
            .iter()
            .filter(|g| !g.mig.profiles().is_empty() && g.mig.instances().is_empty())
            .map(|g| g.uuid.clone())
            .collect();
        let [uuid] = seeded.as_slice() else {
            bail!("expected one MIG GPU without instances in h100x8-mig.yaml, found {seeded:?}");
        };
        ensure!(text.contains(uuid.as_str()));
        wait_for("the idle GPU to rest with MIG off", TIMEOUT, || {
            let inv = node.inventory();
            let uuid = uuid.clone();
            async move {
                let inv = inv?;
                let off = matches!(gpu(&inv, &uuid)?.mig, Mig::Disabled { .. });
                Ok(off.then_some(()))
            }
        })
        .await?;
        let devices = node.published().await?;
        let whole = devices
            .iter()
            .find(|d| attr(d, "type") == Some("gpu") && attr(d, "uuid") == Some(uuid.as_str()))
            .context("no whole GPU published for the GPU without instances")?
            .clone();
        prepare_as_published(&mut node, &whole, 1).await
    }
    .await;
    if outcome.is_err() {
        eprintln!("plugin log:\n{}", node.log());
    }
    node.stop().await?;
    outcome
}

#[tokio::test]
async fn a_second_node_process_waits_for_the_first_and_keeps_what_it_prepared() -> Result<()> {
    let w = World::new("one-writer").await?;
    let mut old = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut old, &w.driver).await?;
    let claim = create_allocated(
        &w.cluster.client(),
        w.ns(),
        &ClaimSpec {
            name: "held".into(),
            requests: vec![("gpu".into(), CLASS.into())],
            results: vec![result(
                "gpu",
                &w.driver,
                &w.node,
                &whole_gpu(&w.node, &w.driver),
            )],
            config: vec![],
            spec_config: vec![],
        },
    )
    .await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let answer = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(
        answer.claims[&uid].error.is_empty(),
        "{}",
        answer.claims[&uid].error
    );
    let spec = w.dirs.spec(&uid).context("no CDI spec")?;

    // The new pod of a rolling update starts beside the old one.
    let mut options = w.options();
    options.log = "plugin-new.log".into();
    let mut new = PluginProcess::start(&w.dirs, &options)?;
    let new_log = new.log.clone();
    wait_for(
        "the new process to wait for the state lock (phase standby)",
        TIMEOUT,
        || {
            let status = new.status();
            async move {
                let standby = status?.is_some_and(|s| s["phase"] == "standby");
                Ok(standby.then_some(()))
            }
        },
    )
    .await?;
    new.check_running()?;
    ensure!(
        !std::fs::read_to_string(&new_log)?.contains("start-up recovery done"),
        "the new process recovered while the old one still held the state"
    );
    ensure!(
        w.dirs.spec(&uid).as_ref() == Some(&spec),
        "the spec changed under the old process"
    );

    // The old one exits; the new one takes over what it prepared.
    old.terminate().await?;
    let mut k = register(&w.dirs, &mut new, &w.driver).await?;
    ensure!(
        w.dirs.spec(&uid).as_ref() == Some(&spec),
        "the new process removed the spec"
    );
    ensure!(w.dirs.checkpoint()[&uid]["state"] == "Completed");
    let again = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(
        again.claims[&uid] == answer.claims[&uid],
        "answered differently after the handover"
    );
    let un = unprepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(
        un.claims[&uid].error.is_empty(),
        "{}",
        un.claims[&uid].error
    );
    w.dirs.claim_files_removed(&uid).await?;
    new.terminate().await?;
    w.namespace.delete().await
}

/// `tessera health --probe <probe>` on `socket`: whether it passed, and
/// what it printed.
fn health(socket: &Path, probe: &str) -> Result<(bool, String)> {
    let out = std::process::Command::new(&binaries().tessera)
        .arg("health")
        .arg("--socket")
        .arg(socket)
        .args(["--probe", probe])
        .output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Ok((out.status.success(), text))
}

/// Waits until `probe` on `socket` passes (or not, `want`) with an answer
/// that contains `says`.
async fn probe_says(socket: &Path, probe: &str, want: bool, says: &str) -> Result<String> {
    wait_for(
        &format!("{probe} on {} {want}: {says:?}", socket.display()),
        TIMEOUT,
        || async {
            let (ok, text) = health(socket, probe)?;
            Ok((ok == want && text.contains(says)).then_some(text))
        },
    )
    .await
}

/// `GET path` on a TCP address; the status code.
fn http_status(address: std::net::SocketAddr, path: &str) -> Result<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: tessera\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status in {answer:?}"))
}

#[tokio::test]
async fn each_instance_answers_its_own_probes_during_a_roll() -> Result<()> {
    let w = World::new("standby").await?;
    let socket = |instance: &str| w.dirs.path(instance).join("health.sock");
    let instance = |name: &str, extra: &[&str]| {
        let mut options = w.options();
        options.log = format!("plugin-{name}.log");
        options.args = vec!["--health-socket".into(), socket(name).display().to_string()];
        options.args.extend(extra.iter().map(|a| a.to_string()));
        options
    };
    let mut old = PluginProcess::start(&w.dirs, &instance("old", &[]))?;
    register(&w.dirs, &mut old, &w.driver).await?;
    let old_port = old.metrics_address().await?;
    probe_says(&socket("old"), "readiness", true, "serving").await?;

    // The new pod's instance waits for the state lock, ready to take over.
    let mut new = PluginProcess::start(&w.dirs, &instance("new", &[]))?;
    let text = probe_says(
        &socket("new"),
        "readiness",
        true,
        "standby: ready to take over",
    )
    .await?;
    ensure!(text.contains("lists 2 GPUs"), "{text}");
    ensure!(
        health(&socket("new"), "liveness")?.0,
        "a standby must be live"
    );

    // A new version that could not take over: its NVML library is missing.
    let mut broken = PluginProcess::start(
        &w.dirs,
        &instance(
            "broken",
            &["--nvml-library", "/nonexistent/libnvidia-ml.so.1"],
        ),
    )?;
    let text = probe_says(
        &socket("broken"),
        "readiness",
        false,
        "standby: cannot take over",
    )
    .await?;
    ensure!(text.contains("cannot load the NVML library"), "{text}");
    let (live, text) = health(&socket("broken"), "liveness")?;
    ensure!(
        live,
        "a standby that cannot take over is still live: {text}"
    );
    broken.check_running()?;
    // What the chart's HTTP probes asked: the node's one port, the old
    // instance's, which is Ready.
    ensure!(http_status(old_port, "/healthz")? == 200);
    ensure!(health(&socket("old"), "readiness")?.0);
    broken.terminate().await?;

    // The old instance exits; the new one takes over and serves.
    old.terminate().await?;
    register(&w.dirs, &mut new, &w.driver).await?;
    probe_says(&socket("new"), "readiness", true, "serving").await?;
    new.terminate().await?;
    w.namespace.delete().await
}

#[tokio::test]
async fn a_restart_that_destroys_a_mig_device_publishes_what_is_left() -> Result<()> {
    let w = World::new("rollback-mig").await?;
    // 1g.5gb on the A100's free memory slice: created at prepare.
    let dynamic = device_where(&w.node, &w.driver, |r| {
        matches!(&r.kind, DeviceKind::Mig { dynamic: true, existing: None, profile, placement, .. }
            if profile == "1g.5gb" && placement.start == 3)
    });
    let claim = create_allocated(
        &w.cluster.client(),
        w.ns(),
        &ClaimSpec {
            name: "mig".into(),
            requests: vec![("gpu".into(), CLASS.into())],
            results: vec![result("gpu", &w.driver, &w.node, &dynamic)],
            config: vec![],
            spec_config: vec![],
        },
    )
    .await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let reference = claim_ref(w.ns(), &claim);
    let mig_uuid = |dirs: &PluginDirs| -> Result<String> {
        let data = &dirs.checkpoint()[&uid]["status"][0]["data"];
        Ok(data["migUUID"].as_str().context("no MIG UUID")?.to_owned())
    };

    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let answer = prepare(&mut k, vec![reference.clone()]).await?;
    ensure!(
        answer.claims[&uid].error.is_empty(),
        "{}",
        answer.claims[&uid].error
    );
    let first = mig_uuid(&w.dirs)?;

    // Killed while unpreparing: the next start finishes the unprepare and
    // destroys the device the GPUs still showed when the process started.
    plugin.kill()?;
    let mut entries = w.dirs.checkpoint();
    entries.get_mut(&uid).context("no entry")?["state"] = json!("Unpreparing");
    w.dirs.write_checkpoint(&entries)?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    ensure!(
        !w.dirs.checkpoint().contains_key(&uid),
        "the unprepare was not finished"
    );
    let topology = topology_path();
    let on_gpu = |dirs: &PluginDirs| -> Result<BTreeSet<String>> {
        Ok(dirs
            .inventory_now(&topology)?
            .gpus
            .iter()
            .flat_map(|g| g.mig.instances())
            .map(|i| i.uuid.clone())
            .collect())
    };
    ensure!(
        !on_gpu(&w.dirs)?.contains(&first),
        "{first} was not destroyed"
    );

    // The kubelet prepares the claim again (its Pod restarted): a new device.
    let answer = prepare(&mut k, vec![reference.clone()]).await?;
    let outcome = (|| {
        ensure!(
            answer.claims[&uid].error.is_empty(),
            "prepare after the restart: {}",
            answer.claims[&uid].error
        );
        let second = mig_uuid(&w.dirs)?;
        ensure!(second != first && on_gpu(&w.dirs)?.contains(&second));
        Ok(())
    })();
    if outcome.is_err() {
        eprintln!(
            "plugin log:\n{}",
            std::fs::read_to_string(&plugin.log).unwrap_or_default()
        );
    }
    outcome?;
    let un = unprepare(&mut k, vec![reference]).await?;
    ensure!(
        un.claims[&uid].error.is_empty(),
        "{}",
        un.claims[&uid].error
    );
    plugin.terminate().await?;
    w.namespace.delete().await
}
