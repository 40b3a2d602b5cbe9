//! Binding conditions (KEP-5007) with the real scheduler, kubelet and
//! containerd: `tessera plugin` publishes its dynamic MIG devices with
//! `DeviceMade`/`DeviceNotMade`, `tessera binder` lists each waiting
//! allocation for its node, and the node makes the device before the pod
//! binds.
//!
//! One test, its steps in order, on a simulated machine of two H100s with
//! MIG on and nothing made:
//! 0. a 7g.80gb pod runs without binding conditions (the time from its
//!    creation to Running is printed);
//! 1. the same with binding conditions: its device is made ahead;
//! 2. a create that fails at the first GPU (another actor took a slice of
//!    it while the pod waited): the node says `DeviceNotMade`, the
//!    scheduler frees the allocation and the pod runs on the other GPU;
//! 3. the scheduler killed (SIGKILL) while an allocation waits: the node
//!    makes the device while no scheduler runs, and the scheduler started
//!    again binds the pod to it, nothing made twice;
//! 4. a pod deleted while its device waits (made, not bound: its claim also
//!    asks for a device of the test's own whose binding condition nobody
//!    sets) leaves no MIG device and no record;
//! 5. the same with the node process killed (SIGKILL) before the deletion
//!    and started again after. (The binder is killed in step 2 while an
//!    allocation waits, and started again.)

mod plugin_support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceRequestAllocationResult, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;
use tessera_conformance::{
    TestCluster, TestNamespace, delete_ignore_missing, unique_name, wait_for,
};
use tessera_driver::host::mig::{self, MigPlacement};

use plugin_support::*;

const PROFILE: &str = "7g.80gb";
/// The held pods' profile.
const SMALL: &str = "1g.20gb";
/// What the intruder creates: a 1g.10gb (profile id 19) at slice 0.
const INTRUDER_PROFILE_ID: u32 = 19;
/// Set in the intruder's child process: the GPU to take a slice of.
const INTRUDER_GPU_ENV: &str = "TESSERA_BINDING_INTRUDER_GPU";
const LONG: Duration = Duration::from_secs(180);

/// Two H100s of h100x8-mig.yaml's kind, MIG on, no instance.
fn two_empty_h100s() -> Result<PathBuf> {
    let text =
        std::fs::read_to_string(repo_root().join("driver/fake-nvml/topologies/h100x8-mig.yaml"))?;
    let (models, _) = text
        .split_once("\ngpus:")
        .context("no gpus: in h100x8-mig.yaml")?;
    let gpu = |uuid: &str, bus: &str| {
        format!(
            "  - model: *h100\n    uuid: {uuid}\n    pciBusId: \"{bus}\"\n    mig:\n      mode: enabled\n"
        )
    };
    let yaml = format!(
        "{models}\ngpus:\n{}{}",
        gpu(
            "GPU-6a0c1f3e-2b4d-4e8a-9c17-5d3e2f1a0b01",
            "00000000:1B:00.0"
        ),
        gpu(
            "GPU-6a0c1f3e-2b4d-4e8a-9c17-5d3e2f1a0b02",
            "00000000:43:00.0"
        )
    );
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("binding");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("two-h100-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml)?;
    Ok(path)
}

#[tokio::test]
async fn devices_are_made_before_the_pod_binds() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    let Some(kubelet) = cluster.kubelet().cloned() else {
        eprintln!("cluster runs without a kubelet (TESSERA_KUBELET=0): nothing to check");
        return Ok(());
    };
    let id = unique_name("bc");
    let driver = format!("{id}.tessera.dev");
    let ns = cluster.create_namespace("binding").await?;
    let dirs = PluginDirs::for_kubelet(&kubelet)?;
    let topology = two_empty_h100s()?;
    let options = |binding: &str| PluginOptions {
        node: cluster.node_name().to_owned(),
        driver: driver.clone(),
        kubeconfig: cluster.kubeconfig().to_path_buf(),
        kubelet: Some(kubelet.clone()),
        topology: topology.clone(),
        args: vec![
            "--binding-conditions".into(),
            binding.into(),
            "--binding-namespace".into(),
            ns.name().to_owned(),
        ],
        // Each setting a log and probe socket of its own: the process of
        // the other, ending while this one starts, removes its own.
        log: format!("plugin-binding-{binding}.log"),
        events: None,
    };
    let plugin = PluginProcess::start(&dirs, &options("off"))?;
    let mut t = Test {
        cluster: &cluster,
        ns: &ns,
        driver: &driver,
        id: &id,
        dirs: &dirs,
        topology: &topology,
        plugin,
        binder: None,
    };
    let result = t.run(&options("auto")).await;
    if let Some(mut binder) = t.binder.take() {
        let _ = binder.kill();
        let _ = binder.wait();
    }
    t.unhold().await;
    finish_kubelet_test(&cluster, &ns, &driver, &id, t.plugin, result).await
}

struct Test<'a> {
    cluster: &'a TestCluster,
    ns: &'a TestNamespace,
    driver: &'a str,
    id: &'a str,
    dirs: &'a PluginDirs,
    topology: &'a Path,
    plugin: PluginProcess,
    binder: Option<Child>,
}

impl Test<'_> {
    async fn run(&mut self, with: &PluginOptions) -> Result<()> {
        self.classes().await?;
        // Without binding conditions first: the device made at prepare.
        self.plugin.serving().await?;
        let took = self.runs("plain").await?;
        eprintln!("without binding conditions: pod creation to Running in {took:?}");
        self.delete_and_forget("plain", false).await?;

        let plugin = std::mem::replace(&mut self.plugin, PluginProcess::start(self.dirs, with)?);
        plugin.terminate().await?;
        self.plugin.serving().await?;
        wait_for("slices with binding conditions", LONG, || async {
            Ok(self.all_to_be_made().await?.then_some(()))
        })
        .await?;
        self.start_binder()?;
        let took = self.runs("first").await?;
        eprintln!("with binding conditions: pod creation to Running in {took:?}");
        self.delete_and_forget("first", true).await?;

        self.create_fails_at_the_first_gpu().await?;
        self.scheduler_killed_while_waiting().await?;
        self.deleted_while_waiting("waiting", None).await?;
        self.deleted_while_waiting("orphaned", Some(with)).await
    }

    async fn classes(&self) -> Result<()> {
        let d = self.driver;
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": { "name": self.id },
            "spec": { "selectors": [{ "cel": { "expression": format!(
                "device.driver == {d:?} && device.attributes[{d:?}].type == \"mig\" && \
                 device.attributes[{d:?}].profile == {PROFILE:?}") } }] },
        }))?;
        Api::<DeviceClass>::all(self.cluster.client())
            .create(&PostParams::default(), &class)
            .await?;
        let template: ResourceClaimTemplate = serde_json::from_value(json!({
            "metadata": { "name": "mig" },
            "spec": { "spec": { "devices": { "requests": [{
                "name": "mig", "exactly": { "deviceClassName": self.id },
            }]}}},
        }))?;
        self.ns
            .api::<ResourceClaimTemplate>()
            .create(&PostParams::default(), &template)
            .await?;
        self.hold().await
    }

    /// A device of a driver of the test's own whose binding condition
    /// nobody sets, and a template asking for it beside the MIG device: the
    /// scheduler waits on it, so a pod of that template stays unbound after
    /// its MIG device was made (until its binding timeout).
    async fn hold(&self) -> Result<()> {
        let (pp, hold) = (PostParams::default(), format!("{}-hold", self.id));
        let driver = format!("hold.{}", self.driver);
        let slice: ResourceSlice = serde_json::from_value(json!({
            "metadata": { "name": hold },
            "spec": {
                "driver": driver,
                "nodeName": self.cluster.node_name(),
                "pool": { "name": "hold", "generation": 1, "resourceSliceCount": 1 },
                // One per held pod: the scheduler keeps a device it waited
                // on a few seconds after its pod is gone.
                "devices": (0..2).map(|i| json!({
                    "name": format!("never-{i}"),
                    "bindingConditions": ["NeverSet"],
                    "bindingFailureConditions": ["NeverFailed"],
                })).collect::<Vec<_>>(),
            },
        }))?;
        Api::<ResourceSlice>::all(self.cluster.client())
            .create(&pp, &slice)
            .await?;
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": { "name": hold },
            "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == {driver:?}") } }] },
        }))?;
        Api::<DeviceClass>::all(self.cluster.client())
            .create(&pp, &class)
            .await?;
        // A small profile with many placements, for the same reason.
        let (d, small) = (self.driver, format!("{hold}-small"));
        let expression = format!(
            "device.driver == {d:?} && device.attributes[{d:?}].type == \"mig\" && \
             device.attributes[{d:?}].profile == {SMALL:?}"
        );
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": { "name": small },
            "spec": { "selectors": [{ "cel": { "expression": expression } }] },
        }))?;
        Api::<DeviceClass>::all(self.cluster.client())
            .create(&pp, &class)
            .await?;
        let template: ResourceClaimTemplate = serde_json::from_value(json!({
            "metadata": { "name": "held" },
            "spec": { "spec": { "devices": { "requests": [
                { "name": "mig", "exactly": { "deviceClassName": small } },
                { "name": "hold", "exactly": { "deviceClassName": hold } },
            ]}}},
        }))?;
        self.ns
            .api::<ResourceClaimTemplate>()
            .create(&pp, &template)
            .await?;
        Ok(())
    }

    /// Deletes what [`Self::hold`] made outside the namespace.
    async fn unhold(&self) {
        let hold = format!("{}-hold", self.id);
        let _ =
            delete_ignore_missing(&Api::<ResourceSlice>::all(self.cluster.client()), &hold).await;
        let classes = Api::<DeviceClass>::all(self.cluster.client());
        let _ = delete_ignore_missing(&classes, &hold).await;
        let _ = delete_ignore_missing(&classes, &format!("{hold}-small")).await;
    }

    fn stop_binder(&mut self) -> Result<()> {
        let mut binder = self.binder.take().context("no binder")?;
        binder.kill()?;
        binder.wait()?;
        Ok(())
    }

    fn start_binder(&mut self) -> Result<()> {
        let log = std::fs::File::create(self.dirs.path("binder.log"))?;
        let child = Command::new(&binaries().tessera)
            .args([
                "binder",
                "--driver-name",
                self.driver,
                "--namespace",
                self.ns.name(),
            ])
            .arg("--kubeconfig")
            .arg(self.cluster.kubeconfig())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting tessera binder")?;
        self.binder = Some(child);
        Ok(())
    }

    async fn create_pod(&self, name: &str) -> Result<()> {
        self.create_pod_of(name, "mig").await
    }

    /// Pod `name` with a claim from `template`.
    async fn create_pod_of(&self, name: &str, template: &str) -> Result<()> {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": {
                "terminationGracePeriodSeconds": 0,
                "automountServiceAccountToken": false,
                "resourceClaims": [{ "name": "mig", "resourceClaimTemplateName": template }],
                "containers": [{
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": { "claims": [{ "name": "mig" }] },
                }],
            },
        }))?;
        self.ns
            .api::<Pod>()
            .create(&PostParams::default(), &pod)
            .await?;
        Ok(())
    }

    /// Creates pod `name` and waits until it runs; how long that took.
    async fn runs(&mut self, name: &str) -> Result<Duration> {
        let began = Instant::now();
        self.create_pod(name).await?;
        self.running(name).await?;
        Ok(began.elapsed())
    }

    async fn running(&mut self, name: &str) -> Result<()> {
        let pods = self.ns.api::<Pod>();
        let plugin = &mut self.plugin;
        wait_for(&format!("pod {name} Running"), LONG, || {
            let alive = plugin.check_running();
            let pods = pods.clone();
            async move {
                alive?;
                let p = pods.get(name).await?;
                let phase = p.status.and_then(|s| s.phase);
                Ok((phase.as_deref() == Some("Running")).then_some(()))
            }
        })
        .await
    }

    /// The claim of pod `name`, once the pod's status names it.
    async fn claim_of(&self, name: &str) -> Result<ResourceClaim> {
        let pods = self.ns.api::<Pod>();
        let claim = wait_for(&format!("pod {name}'s claim"), LONG, || async {
            let p = pods.get(name).await?;
            Ok(p.status
                .and_then(|s| s.resource_claim_statuses)
                .and_then(|c| c.into_iter().find_map(|c| c.resource_claim_name)))
        })
        .await?;
        Ok(self.ns.api::<ResourceClaim>().get(&claim).await?)
    }

    /// The device allocated to pod `name`'s claim, once allocated.
    async fn allocated(&self, name: &str) -> Result<(ResourceClaim, String)> {
        let claims = self.ns.api::<ResourceClaim>();
        let claim = self.claim_of(name).await?;
        let claim_name = claim.metadata.name.clone().context("claim name")?;
        wait_for(&format!("pod {name}'s claim allocated"), LONG, || async {
            let c = claims.get(&claim_name).await?;
            let device = c
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref())
                .and_then(|r| r.iter().find(|r| r.driver == self.driver))
                .map(|r| {
                    ensure!(
                        r.binding_conditions.as_deref() == Some(&["DeviceMade".to_owned()][..]),
                        "allocated without binding conditions: {r:?}"
                    );
                    Ok(r.device.clone())
                })
                .transpose()?;
            Ok(device.map(|d| (c, d)))
        })
        .await
    }

    /// The physical GPU of a published device.
    async fn gpu_of(&self, device: &str) -> Result<String> {
        let slices: Api<ResourceSlice> = Api::all(self.cluster.client());
        let list = slices
            .list(&ListParams::default().fields(&format!("spec.driver={}", self.driver)))
            .await?;
        list.items
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .find(|d| d.name == device)
            .and_then(|d| d.attributes.as_ref()?.get("parentUUID")?.string.clone())
            .with_context(|| format!("device {device} has no parentUUID in the slices"))
    }

    /// Another actor takes slice 0 of the GPU the first allocation is on,
    /// while the binder is away: the node cannot make the 7g.80gb there.
    async fn create_fails_at_the_first_gpu(&mut self) -> Result<()> {
        self.stop_binder()?;
        let began = Instant::now();
        self.create_pod("moved").await?;
        let (_, first) = self.allocated("moved").await?;
        let first_gpu = self.gpu_of(&first).await?;
        self.intrude(&first_gpu)?;
        self.start_binder()?;
        self.running("moved").await?;
        let took = began.elapsed();
        let claim = self.claim_of("moved").await?;
        let result = first_result(&claim).context("the running pod's claim is not allocated")?;
        let gpu = self.gpu_of(&result.device).await?;
        ensure!(
            gpu != first_gpu,
            "the pod runs on {gpu}, the GPU whose create failed"
        );
        ensure!(
            device_made(&claim, &result.device),
            "no DeviceMade on the claim: {:?}",
            claim.status
        );
        eprintln!(
            "a create failed on {first_gpu}: the pod ran on {gpu} {took:?} after its creation"
        );
        self.delete_and_forget("moved", true).await
    }

    /// The scheduler killed (SIGKILL) while an allocation waits on its
    /// device: the node makes it while no scheduler runs, and the scheduler
    /// started after binds the pod to that device; nothing is made twice.
    async fn scheduler_killed_while_waiting(&mut self) -> Result<()> {
        self.stop_binder()?;
        let before = instances(self)?;
        self.create_pod("resumed").await?;
        let (claim, device) = self.allocated("resumed").await?;
        self.cluster.kill_component("kube-scheduler").await?;
        let made = self.made_while_no_scheduler(&claim, &device).await;
        // Started again whatever happened: the steps after need it.
        self.cluster.revive_component("kube-scheduler").await?;
        made?;
        let revived = Instant::now();
        self.running("resumed").await?;
        let took = revived.elapsed();
        let claim = self.claim_of("resumed").await?;
        let now = first_result(&claim).map(|r| r.device.clone());
        ensure!(
            now.as_deref() == Some(device.as_str()),
            "the pod runs with {now:?}, not the device made while no scheduler ran ({device})"
        );
        let after = instances(self)?;
        ensure!(
            after.len() == before.len() + 1,
            "{} MIG devices made for one claim: {after:?} (before: {before:?})",
            after.len() - before.len()
        );
        eprintln!(
            "the scheduler was killed while {device} waited: the pod ran on it {took:?} after the scheduler served again (its /healthz)"
        );
        self.delete_and_forget("resumed", true).await
    }

    /// Starts the binder and waits until the claim says its device is made.
    async fn made_while_no_scheduler(&mut self, claim: &ResourceClaim, device: &str) -> Result<()> {
        self.start_binder()?;
        let name = claim.metadata.name.clone().context("claim name")?;
        let claims = self.ns.api::<ResourceClaim>();
        wait_for(&format!("DeviceMade on {name}"), LONG, || async {
            let c = claims.get(&name).await?;
            Ok(device_made(&c, device).then_some(()))
        })
        .await?;
        let pod = self.ns.api::<Pod>().get("resumed").await?;
        ensure!(
            pod.spec.and_then(|s| s.node_name).is_none(),
            "pod resumed was bound while no scheduler ran"
        );
        Ok(())
    }

    /// Runs the intruder's child on this node's simulated machine.
    fn intrude(&self, gpu: &str) -> Result<()> {
        let b = binaries();
        let out = Command::new(std::env::current_exe()?)
            .args(["--exact", "child_intruder", "--ignored", "--nocapture"])
            .env(INTRUDER_GPU_ENV, gpu)
            .env("TESSERA_FAKE_NVML_LIB", &b.fake_nvml)
            .env("TESSERA_FAKE_NVML_TOPOLOGY", self.topology)
            .env("TESSERA_FAKE_NVML_STATE", self.dirs.nvml_state())
            .env("TESSERA_FAKE_NVML_DRIVER_ROOT", self.dirs.driver_root())
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success() && text.contains("test child_intruder ... ok"),
            "the intruder failed:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// A pod deleted after its device was made and before it was bound
    /// (it also waits on the held device): nothing of it stays. With
    /// `restart`, the node process is killed (SIGKILL) before the pod is
    /// deleted and started again after: its record says the claim was made
    /// ahead, and it ends it all the same.
    async fn deleted_while_waiting(
        &mut self,
        name: &str,
        restart: Option<&PluginOptions>,
    ) -> Result<()> {
        let before = instances(self)?;
        self.create_pod_of(name, "held").await?;
        let (claim, _) = self.allocated(name).await?;
        let uid = claim.metadata.uid.clone().context("uid")?;
        self.made_then_deleted(name, &uid, &before, restart).await
    }

    async fn made_then_deleted(
        &mut self,
        name: &str,
        uid: &str,
        before: &[String],
        restart: Option<&PluginOptions>,
    ) -> Result<()> {
        wait_for("the device made ahead", LONG, || async {
            let entry = self.dirs.checkpoint().get(uid).cloned();
            Ok(entry.filter(|e| e["ahead"] == true && e["state"] == "Completed"))
        })
        .await?;
        ensure!(
            instances(self)?.len() == before.len() + 1,
            "no MIG device made"
        );
        let pod = self.ns.api::<Pod>().get(name).await?;
        ensure!(
            pod.spec.and_then(|s| s.node_name).is_none(),
            "pod {name} was bound: it should wait on its held device"
        );
        if restart.is_some() {
            nix_kill(self.plugin.pid(), libc::SIGKILL)?;
            let plugin = &mut self.plugin;
            wait_for("the node process gone", LONG, || {
                let gone = plugin.check_running().is_err();
                async move { Ok(gone.then_some(())) }
            })
            .await?;
        }
        self.ns
            .api::<Pod>()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await?;
        if let Some(options) = restart {
            self.plugin = PluginProcess::start(self.dirs, options)?;
        }
        wait_for("the device made ahead ended", LONG, || async {
            let gone = !self.dirs.checkpoint().contains_key(uid);
            Ok((gone && instances(self)? == before).then_some(()))
        })
        .await
    }

    /// Deletes pod `name`, waits until its claim is unprepared and every
    /// 7g.80gb device is published to be made again (with its binding
    /// conditions: no longer the instance made for the claim).
    async fn delete_and_forget(&self, name: &str, binding: bool) -> Result<()> {
        let claim = self.claim_of(name).await?;
        let uid = claim.metadata.uid.clone().context("uid")?;
        delete_ignore_missing(&self.ns.api::<Pod>(), name).await?;
        wait_for(&format!("pod {name}'s claim unprepared"), LONG, || async {
            Ok((!self.dirs.checkpoint().contains_key(&uid)).then_some(()))
        })
        .await?;
        if !binding {
            return Ok(());
        }
        wait_for("every 7g.80gb device to be made again", LONG, || async {
            Ok(self.all_to_be_made().await?.then_some(()))
        })
        .await
    }

    async fn all_to_be_made(&self) -> Result<bool> {
        let slices: Api<ResourceSlice> = Api::all(self.cluster.client());
        let list = slices
            .list(&ListParams::default().fields(&format!("spec.driver={}", self.driver)))
            .await?;
        let sevens: Vec<_> = list
            .items
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.name.ends_with("-mig-7g-80gb-0"))
            .collect();
        Ok(!sevens.is_empty() && sevens.iter().all(|d| d.binding_conditions.is_some()))
    }
}

/// The first device allocated to `claim`.
fn first_result(claim: &ResourceClaim) -> Option<&DeviceRequestAllocationResult> {
    let allocation = claim.status.as_ref()?.allocation.as_ref()?;
    allocation.devices.as_ref()?.results.as_ref()?.first()
}

/// Whether `claim`'s status says `DeviceMade=True` for `device`.
fn device_made(claim: &ResourceClaim, device: &str) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .and_then(|d| d.iter().find(|d| d.device == device))
        .and_then(|d| d.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.type_ == "DeviceMade" && c.status == "True")
        })
}

/// The MIG devices on the simulated machine now.
fn instances(t: &Test<'_>) -> Result<Vec<String>> {
    let inventory = t.dirs.inventory_now(t.topology)?;
    let mut all: Vec<String> = inventory
        .gpus
        .iter()
        .flat_map(|g| g.mig.instances())
        .map(|i| i.uuid.clone())
        .collect();
    all.sort();
    Ok(all)
}

fn nix_kill(pid: i32, signal: i32) -> Result<()> {
    // SAFETY: kill(2) with a pid this cluster's script recorded.
    if unsafe { libc::kill(pid, signal) } != 0 {
        bail!(
            "signal {signal} to pid {pid}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

#[test]
#[ignore = "run in a child process by devices_are_made_before_the_pod_binds"]
fn child_intruder() {
    let Some(gpu) = std::env::var_os(INTRUDER_GPU_ENV) else {
        return;
    };
    let lib = std::env::var_os("TESSERA_FAKE_NVML_LIB").expect("TESSERA_FAKE_NVML_LIB");
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(&lib)
        .init()
        .expect("NVML (simulated) init");
    let gpu = gpu.to_string_lossy();
    // The node switched MIG off when its last claim there went (Hopper
    // switches without a reset): the intruder switches it on again.
    if !mig::mig_enabled(&nvml, &gpu).expect("reading the MIG mode") {
        mig::set_mig_mode(&nvml, &gpu, true).expect("switching MIG on");
    }
    let placement = MigPlacement { start: 0, size: 1 };
    mig::create(&nvml, &gpu, INTRUDER_PROFILE_ID, placement)
        .expect("creating the intruder's GPU instance");
}
