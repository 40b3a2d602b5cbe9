//! The GPU self-test (`tessera-selftest`, run by `conformance/gpu-selftest.sh`):
//! whether Isolated shares hold on this node's GPUs against a hostile
//! tenant, measured by what a CUDA process really gets.
//!
//! On one GPU node without a kubelet: `tessera plugin` over the node's
//! NVML (or a simulated machine), two Isolated claims `a` (25 % of a GPU)
//! and `b` (50 %) on one GPU, allocated by the real kube-scheduler for two
//! Pods pinned to a Node object registered for the test, prepared over the
//! plugin's DRA socket as the kubelet would, then probed with
//! `tessera probe --cdi-device` under each claim's CDI edits:
//!
//! 1. each claim has its own MPS control daemon and pipe directory, and its
//!    containers get neither the other's directory nor the control tool;
//! 2. each claim's probe sees its GPU alone, at most its SMs and memory,
//!    cannot allocate more, also with its environment raised, and can
//!    allocate within its memory;
//! 3. against the node's claim guard ([`guard`]), each probe bound to its
//!    claim's Pod as the kubelet binds a container: a process of `a` that
//!    leaves MPS (its pipe directory pointed elsewhere) and holds more than
//!    `a`'s memory is killed; 3 processes of `a` that together hold more
//!    than its memory lose one, the others finish;
//! 4. `a` quits the one daemon it can reach (its own): `b`'s daemon and
//!    limits are untouched; a process of `a` after its quit gets no more
//!    than `a`'s share, or is killed;
//! 5. on real GPUs, a question for the driver: does an MPS client of `b`
//!    run without `/dev/nvidia<N>` (keeping `/dev/nvidiactl` and
//!    `/dev/nvidia-uvm`) while a process outside MPS there fails?
//! 6. unprepare stops both daemons and removes the specs and records; the
//!    node process stops; no GPU's MIG mode changed.
//!
//! Prints a table; exit status 0 iff every step held.

mod guard;
pub mod node;
pub mod table;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::json;
use tessera_api::inventory::Mig;
use tessera_api::kubelet::dra_v1;
use tessera_api::probe::{MPS_PIPE_DIRECTORY, ProbeReport};

use crate::bench::grpc;
use crate::cluster::wait_for;
use crate::procs;
use crate::suite::isolation::{self, Limits};
use crate::suite::{facts, parse_duration, probe};
use node::{Gpus, Node, daemons_of};
use table::{Table, Verdict};

const CHECK: &str = "gpu-selftest";
const GIB: u128 = 1 << 30;

/// `tessera-selftest`'s arguments (see `conformance/gpu-selftest.sh`).
#[derive(Debug, Clone, clap::Parser)]
#[command(about = "Whether Isolated GPU shares hold on this node against a hostile tenant")]
pub struct Args {
    /// The control plane's kubeconfig (the scheduler must be running).
    #[arg(long)]
    pub kubeconfig: PathBuf,
    /// The Node object the claims are allocated on: this machine, without
    /// a kubelet.
    #[arg(long)]
    pub node: String,
    /// The `tessera` binary (node process and probe).
    #[arg(long)]
    pub tessera: PathBuf,
    /// A directory of the self-test's own: the node process's sockets,
    /// specs, records and MPS pipes (keep it short: Unix socket paths are
    /// limited to 107 bytes).
    #[arg(long)]
    pub work_dir: PathBuf,
    #[arg(long, default_value = "gpu.tessera.dev")]
    pub driver_name: String,
    /// DeviceClass of Isolated shares [default: gpu-isolated.<driver domain>].
    #[arg(long)]
    pub isolated_class: Option<String>,
    /// libnvidia-ml.so.1 to use [default: the one the loader finds].
    #[arg(long, conflicts_with = "simulated")]
    pub nvml_library: Option<PathBuf>,
    /// Where the NVIDIA driver's files are (`/`, or e.g. /run/nvidia/driver).
    #[arg(long, default_value = "/", conflicts_with = "simulated")]
    pub driver_root: PathBuf,
    /// Simulate the machine of this topology instead of using real GPUs.
    #[arg(long, requires = "fakes")]
    pub simulated: Option<PathBuf>,
    /// The directory with the built simulated NVML, CUDA and MPS binaries.
    #[arg(long)]
    pub fakes: Option<PathBuf>,
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub timeout: Duration,
}

/// One Isolated claim and what its prepare gave it.
struct Tenant {
    name: &'static str,
    limits: Limits,
    uid: String,
    /// Its Pod's hosts file, bound on each probe's `/etc/hosts` as the
    /// kubelet binds it: the node process maps the probe to the Pod.
    pod_hosts: PathBuf,
    cdi_device: String,
    pipe: PathBuf,
    mounts: Vec<String>,
    daemon: Option<i32>,
}

/// What the self-test found on the node, and where.
struct Ctx<'a> {
    args: &'a Args,
    client: Client,
    namespace: String,
    gpu: String,
    gpu_memory: u64,
}

/// Runs the self-test; `Ok(true)` iff every step held.
pub async fn run(args: &Args) -> Result<bool> {
    let client = client(&args.kubeconfig).await?;
    let gpus = match (&args.simulated, &args.fakes) {
        (Some(topology), Some(fakes)) => Gpus::Simulated {
            topology: topology.clone(),
            fakes: fakes.clone(),
        },
        _ => Gpus::Real {
            nvml_library: args.nvml_library.clone(),
            driver_root: args.driver_root.clone(),
        },
    };
    let mut node = Node::start(
        &args.tessera,
        gpus,
        &args.node,
        &args.driver_name,
        &args.kubeconfig,
        &args.work_dir,
        args.timeout,
    )
    .await?;
    let mig_before = mig_modes(&node)?;
    let mut table = Table::default();
    let mut namespace = None;
    let outcome = steps(args, &client, &mut node, &mut table, &mut namespace).await;
    if let Some(ns) = &namespace {
        clean_api(&client, ns).await;
    }
    let stopped = node.stop(args.timeout).await;
    if outcome.is_ok() {
        let after = mig_modes(&node)?;
        table.push(
            "MIG modes unchanged",
            "node",
            format!("{} GPUs", after.len()),
            Verdict::of(
                (after != mig_before)
                    .then(|| format!("before {mig_before:?}, after {after:?}"))
                    .into_iter()
                    .collect(),
            ),
        );
    }
    println!("{}", table.render());
    outcome?;
    stopped?;
    Ok(table.passed())
}

async fn client(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// Each GPU's MIG mode (by UUID), as `tessera inventory` reports it.
fn mig_modes(node: &Node) -> Result<BTreeMap<String, &'static str>> {
    Ok(node
        .inventory()?
        .gpus
        .into_iter()
        .map(|g| {
            let mode = match g.mig {
                Mig::NotSupported => "not supported",
                Mig::Disabled { .. } => "disabled",
                Mig::Enabled { .. } => "enabled",
            };
            (g.uuid, mode)
        })
        .collect())
}

async fn steps(
    args: &Args,
    client: &Client,
    node: &mut Node,
    table: &mut Table,
    namespace: &mut Option<String>,
) -> Result<()> {
    let (share, whole) = isolated_share(args, client).await?;
    let gpu = share.physical_gpu().unwrap_or_default().to_owned();
    let sms = whole.capacity.get("multiprocessors").map(|c| c.value);
    let memory = whole.capacity.get("memory").map(|c| c.value);
    let (Some(sms), Some(gpu_memory), Some(share_memory), Some(cores)) = (
        sms,
        memory,
        share.capacity.get("memory"),
        share.capacity.get("cores"),
    ) else {
        bail!(
            "GPU {gpu}'s devices publish no multiprocessors, memory or cores capacity: \
             nothing to measure an Isolated share against"
        );
    };
    let limits = |percent: u128, most: u128| Limits {
        gpu_sms: u32::try_from(sms).unwrap_or(u32::MAX),
        cores_percent: u32::try_from(facts::valid_request(cores, percent)).unwrap_or(100),
        memory_bytes: u64::try_from(facts::valid_request(share_memory, most.min(gpu_memory / 4)))
            .unwrap_or(u64::MAX),
    };
    let ns = create_namespace(client).await?;
    *namespace = Some(ns.clone());
    let ctx = Ctx {
        args,
        client: client.clone(),
        namespace: ns,
        gpu: gpu.clone(),
        gpu_memory: u64::try_from(gpu_memory).unwrap_or(u64::MAX),
    };
    let attr = share.physical_attr().unwrap_or(facts::PARENT_UUID);
    let mut tenants = Vec::new();
    for (name, percent, most) in [("a", 25, 4 * GIB), ("b", 50, 8 * GIB)] {
        let limits = limits(percent, most);
        let (uid, pod_hosts) = ctx.claim_for_pod(name, &limits, attr).await?;
        tenants.push(Tenant {
            name,
            limits,
            uid,
            pod_hosts,
            cdi_device: String::new(),
            pipe: PathBuf::new(),
            mounts: Vec::new(),
            daemon: None,
        });
    }
    ctx.wait_allocated(&tenants).await?;

    let channel = grpc::connect(&node.endpoint).await?;
    for t in &mut tenants {
        let cdi = ctx.prepare(&channel, t).await;
        let ok = cdi.is_ok();
        table.push(
            "prepare over the plugin socket",
            t.name,
            match &cdi {
                Ok(cdi) => format!("CDI devices {cdi}"),
                Err(e) => format!("{e:#}"),
            },
            Verdict::of(
                cdi.as_ref()
                    .err()
                    .map(|e| format!("{e:#}"))
                    .into_iter()
                    .collect(),
            ),
        );
        ensure!(ok, "prepare of claim {} failed", t.name);
        t.cdi_device = cdi?;
    }
    // The probes also say what each claim's container gets: the pipe
    // directory CUDA is pointed at and the mounts (as the probe applied
    // the claim's CDI edits).
    let mut probes = Vec::new();
    for t in &mut tenants {
        let mut rows = Vec::new();
        for run in isolation::runs(&t.limits, ctx.gpu_memory) {
            let report = ctx.probe(node, t, run.alloc, &run.env)?;
            rows.push((run, report));
        }
        let plain = rows
            .iter()
            .find(|(run, _)| run.env.is_empty())
            .map(|(_, report)| report)
            .context("no probe ran with the claim's own environment")?;
        t.pipe = plain
            .environment
            .cuda_mps_pipe_directory
            .clone()
            .map(PathBuf::from)
            .with_context(|| {
                format!(
                    "{} sets no {MPS_PIPE_DIRECTORY}: not enforced by MPS",
                    t.cdi_device
                )
            })?;
        t.mounts = (plain.container.iter())
            .flat_map(|c| c.mounts.iter().chain(&c.from_host))
            .cloned()
            .collect();
        t.daemon = daemons_of(&t.pipe).first().copied();
        probes.push(rows);
    }
    own_daemons(&tenants, table);
    for (t, rows) in tenants.iter().zip(probes) {
        for (run, report) in rows {
            table.push(
                format!("probe: {}", run.name),
                t.name,
                isolation::describe(&report),
                Verdict::of(isolation::check_report(&gpu, &t.limits, run.fits, &report)),
            );
        }
    }
    hostile(&ctx, node, &tenants, table).await?;
    unprepare(&ctx, node, &channel, &tenants, table).await
}

/// An Isolated share enforced by MPS on this node, and its GPU's whole device.
async fn isolated_share(
    args: &Args,
    client: &Client,
) -> Result<(facts::SliceDevice, facts::SliceDevice)> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.driver={}", args.driver_name));
    wait_for(
        "an Isolated share enforced by MPS in the node's ResourceSlices",
        args.timeout,
        || {
            let (slices, lp) = (slices.clone(), lp.clone());
            async move {
                let items = slices.list(&lp).await?.items;
                let devices = facts::devices_of(&items, &args.driver_name, Some(&args.node));
                Ok(isolation::isolated_share(&devices).map(|(s, w)| (s.clone(), w.clone())))
            }
        },
    )
    .await
}

async fn create_namespace(client: &Client) -> Result<String> {
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": { "generateName": "tessera-selftest-",
                      "labels": { probe::MANAGED_BY.0: probe::MANAGED_BY.1 } }
    }))?;
    let created = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .context("creating the self-test's namespace")?;
    created.metadata.name.context("the namespace has no name")
}

/// Pods bound to a node without a kubelet stay until deleted at once; the
/// namespace goes with the control plane.
async fn clean_api(client: &Client, ns: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    let _ = pods.delete_collection(&now, &ListParams::default()).await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let _ = claims
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = Api::<Namespace>::all(client.clone())
        .delete(ns, &DeleteParams::default())
        .await;
}

impl Ctx<'_> {
    /// A claim of an Isolated share with `limits` on the GPU and a Pod on
    /// the node using it; returns the claim's UID and the Pod's hosts file
    /// (where the kubelet would keep it: `pods/<pod UID>/etc-hosts`).
    async fn claim_for_pod(
        &self,
        name: &str,
        limits: &Limits,
        attr: &str,
    ) -> Result<(String, PathBuf)> {
        let class = self.args.isolated_class.clone().unwrap_or_else(|| {
            format!(
                "gpu-isolated.{}",
                facts::class_domain(&self.args.driver_name)
            )
        });
        let capacity = BTreeMap::from([
            (
                "memory".to_owned(),
                facts::format_quantity(limits.memory_bytes.into()),
            ),
            ("cores".to_owned(), limits.cores_percent.to_string()),
        ]);
        let request = probe::device_request(
            probe::POD_CLAIM,
            &class,
            &[facts::pin_expression(
                &self.args.driver_name,
                attr,
                &self.gpu,
            )],
            &capacity,
        );
        let claim: ResourceClaim = serde_json::from_value(probe::claim(name, CHECK, request))?;
        let claim = Api::<ResourceClaim>::namespaced(self.client.clone(), &self.namespace)
            .create(&PostParams::default(), &claim)
            .await
            .with_context(|| {
                format!(
                    "creating claim {name} (DeviceClass {class}; --isolated-class names another)"
                )
            })?;
        // The Pod never runs (no kubelet): the scheduler allocates its claim
        // and reserves it for the Pod, as for any Pod.
        let container = json!({
            "name": "tenant", "image": "tessera.local/selftest-none:0", "command": ["/bin/false"],
            "resources": { "claims": [{ "name": probe::POD_CLAIM }] },
        });
        let source = probe::ClaimSource::Claim(name.to_owned());
        let pod: Pod = serde_json::from_value(probe::pod(
            name,
            CHECK,
            &self.args.node,
            Some(&source),
            vec![container],
        ))?;
        let pod = Api::<Pod>::namespaced(self.client.clone(), &self.namespace)
            .create(&PostParams::default(), &pod)
            .await
            .with_context(|| format!("creating pod {name}"))?;
        let pod_uid = pod.metadata.uid.context("the pod has no UID")?;
        let hosts = self
            .args
            .work_dir
            .join("pods")
            .join(pod_uid)
            .join("etc-hosts");
        std::fs::create_dir_all(hosts.parent().context("a hosts file's directory")?)?;
        std::fs::write(&hosts, "127.0.0.1 localhost\n")
            .with_context(|| format!("writing {}", hosts.display()))?;
        let uid = claim.metadata.uid.context("the claim has no UID")?;
        Ok((uid, hosts))
    }

    /// Waits until the scheduler has allocated every tenant's claim and
    /// reserved it for its Pod; on timeout, says why the Pods were not
    /// scheduled.
    async fn wait_allocated(&self, tenants: &[Tenant]) -> Result<()> {
        let claims: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &self.namespace);
        let done = wait_for(
            "the scheduler to allocate both claims",
            self.args.timeout,
            || {
                let claims = claims.clone();
                async move {
                    for t in tenants {
                        let status = claims.get(t.name).await?.status.unwrap_or_default();
                        if status.allocation.is_none()
                            || status.reserved_for.unwrap_or_default().is_empty()
                        {
                            return Ok(None);
                        }
                    }
                    Ok(Some(()))
                }
            },
        )
        .await;
        if let Err(e) = done {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
            let mut why = Vec::new();
            for t in tenants {
                let pod = pods.get(t.name).await?;
                let conditions = pod.status.and_then(|s| s.conditions).unwrap_or_default();
                if let Some(c) = conditions.iter().find(|c| c.type_ == "PodScheduled") {
                    why.push(format!(
                        "pod {}: {}",
                        t.name,
                        c.message.clone().unwrap_or_default()
                    ));
                }
            }
            return Err(e.context(why.join("; ")));
        }
        Ok(())
    }

    /// `NodePrepareResources` for the tenant's claim; its CDI devices (the
    /// claim's and the driver's), comma-separated as the probe takes them.
    async fn prepare(&self, channel: &tonic::transport::Channel, t: &Tenant) -> Result<String> {
        let mut dra = dra_v1::dra_plugin_client::DraPluginClient::new(channel.clone());
        let answer = dra
            .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: vec![self.claim_ref(t)],
            })
            .await?
            .into_inner();
        let got = answer
            .claims
            .get(&t.uid)
            .context("no answer for the claim")?;
        ensure!(got.error.is_empty(), "{}", got.error);
        let mut ids: Vec<&str> = Vec::new();
        for id in got.devices.iter().flat_map(|d| &d.cdi_device_ids) {
            if !ids.contains(&id.as_str()) {
                ids.push(id);
            }
        }
        ensure!(!ids.is_empty(), "the answer names no CDI device");
        Ok(ids.join(","))
    }

    fn claim_ref(&self, t: &Tenant) -> dra_v1::Claim {
        dra_v1::Claim {
            namespace: self.namespace.clone(),
            uid: t.uid.clone(),
            name: t.name.to_owned(),
        }
    }

    /// `tessera probe` as a process of the tenant's container: under its
    /// CDI edits, its Pod's hosts file bound, allocating `alloc` bytes,
    /// `env` set in its own environment first, then `extra` flags.
    fn probe_command(
        &self,
        node: &Node,
        t: &Tenant,
        alloc: u64,
        env: &[String],
        extra: &[String],
    ) -> Command {
        let mut args = vec![
            "--alloc".to_owned(),
            alloc.to_string(),
            "--pod-hosts-file".to_owned(),
            t.pod_hosts.display().to_string(),
        ];
        for e in env {
            args.extend(["--set-env".to_owned(), e.clone()]);
        }
        args.extend_from_slice(extra);
        let mut cmd = node.probe_cmd(&t.cdi_device, &args);
        cmd.stdin(Stdio::null());
        cmd
    }

    /// The report of a probe of the tenant's container (see
    /// [`Ctx::probe_command`]) that runs to its end.
    fn probe(&self, node: &Node, t: &Tenant, alloc: u64, env: &[String]) -> Result<ProbeReport> {
        let out = self
            .probe_command(node, t, alloc, env, &[])
            .output()
            .context("running tessera probe")?;
        serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "tessera probe for claim {} printed no report ({}): {}",
                t.name,
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }
}

/// Step 1: a daemon and pipe directory of each claim's own; neither the
/// other's directory nor the control tool in its containers.
fn own_daemons(tenants: &[Tenant], table: &mut Table) {
    let mut problems = Vec::new();
    let mut got = Vec::new();
    for t in tenants {
        let daemons = daemons_of(&t.pipe);
        got.push(format!(
            "{}: pipe {} daemon {daemons:?}",
            t.name,
            t.pipe.display()
        ));
        if daemons.len() != 1 {
            problems.push(format!(
                "{} has {} daemons on its pipe directory",
                t.name,
                daemons.len()
            ));
        }
        if t.mounts.iter().any(|m| m.ends_with("mps-control")) {
            problems.push(format!("{}'s containers get the MPS control tool", t.name));
        }
        for other in tenants.iter().filter(|o| o.uid != t.uid) {
            let theirs = other.pipe.to_string_lossy();
            if t.pipe == other.pipe || t.mounts.iter().any(|m| *m == theirs) {
                problems.push(format!(
                    "{} reaches {}'s pipe directory",
                    t.name, other.name
                ));
            }
        }
    }
    if tenants
        .windows(2)
        .any(|w| w[0].daemon.is_some() && w[0].daemon == w[1].daemon)
    {
        problems.push("both claims have the same daemon".into());
    }
    table.push(
        "a daemon and pipe directory per claim",
        "a+b",
        got.join(", "),
        Verdict::of(problems),
    );
}

/// Steps 3 to 5: the claim guard against `a`; `a` quits its daemon while
/// `b` keeps its own and its limits; the question of the GPU's node.
async fn hostile(ctx: &Ctx<'_>, node: &Node, tenants: &[Tenant], table: &mut Table) -> Result<()> {
    let [a, b] = tenants else {
        bail!("two tenants expected");
    };
    guard::leave_mps(ctx, node, a, table).await?;
    guard::many_processes(ctx, node, a, table).await?;
    fill_shm(a, table);
    quit_own_daemon(ctx, node, a, b, table).await?;
    guard::after_quit(ctx, node, a, table).await?;
    guard::gpu_node_question(ctx, node, b, table).await
}

/// The most the self-test writes into a claim's `/dev/shm`: the node
/// policy's largest default is far below; a directory that takes this much
/// is not bounded.
const SHM_FILL_CAP: u64 = 1 << 30;

/// `a` fills its `/dev/shm` (while its daemon, whose shared memory it is,
/// runs): a tmpfs of its own, so it ends in ENOSPC at the claim's size and
/// reaches nothing else; the file goes again afterwards. The neighbour's
/// probes after this show `b` unaffected.
fn fill_shm(a: &Tenant, table: &mut Table) {
    use std::os::unix::fs::MetadataExt;
    let shm = a.pipe.with_file_name("shm");
    let file = shm.join("tessera-selftest-fill");
    let own_fs = match (
        std::fs::metadata(&shm),
        a.pipe.parent().map(std::fs::metadata),
    ) {
        (Ok(s), Some(Ok(p))) => Ok(s.dev() != p.dev()),
        _ => Err(format!("cannot look at {}", shm.display())),
    };
    let filled = fill(&file);
    let _ = std::fs::remove_file(&file);
    let mut problems = Vec::new();
    let seen = match (&own_fs, &filled) {
        (Ok(own), Ok((bytes, err))) => {
            if !own {
                problems.push(format!("{} is no file system of its own", shm.display()));
            }
            if err.raw_os_error() != Some(libc::ENOSPC) {
                problems.push(format!("writing ended with {err}, not ENOSPC"));
            }
            format!("{} MiB written, then: {err}", bytes >> 20)
        }
        (Err(e), _) => {
            problems.push(e.clone());
            e.clone()
        }
        (_, Err(e)) => {
            problems.push(e.clone());
            e.clone()
        }
    };
    table.push("a fills its /dev/shm", "a", seen, Verdict::of(problems));
}

/// Writes `file` until the file system refuses; the bytes written and why
/// it stopped (an error past [`SHM_FILL_CAP`] means unbounded).
fn fill(file: &Path) -> std::result::Result<(u64, std::io::Error), String> {
    use std::io::Write;
    let mut out =
        std::fs::File::create(file).map_err(|e| format!("creating {}: {e}", file.display()))?;
    let chunk = vec![0x5au8; 1 << 20];
    let mut written = 0u64;
    while written < SHM_FILL_CAP {
        match out.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(e) => return Ok((written, e)),
        }
    }
    Err(format!(
        "{} took {} MiB without ENOSPC: not bounded",
        file.display(),
        SHM_FILL_CAP >> 20
    ))
}

/// `a` quits the one daemon it can reach; `b` keeps its own and its limits.
async fn quit_own_daemon(
    ctx: &Ctx<'_>,
    node: &Node,
    a: &Tenant,
    b: &Tenant,
    table: &mut Table,
) -> Result<()> {
    let quit = std::process::Command::new(node.mps_control())
        .env_clear()
        .envs(node.process_env())
        .env(MPS_PIPE_DIRECTORY, &a.pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("piped").write_all(b"quit\n")?;
            child.wait()
        })
        .context("sending quit to a's daemon")?;
    let quitted = match a.daemon {
        Some(pid) => wait_for(
            "a's daemon to exit after quit",
            ctx.args.timeout,
            || async move { Ok((!procs::running(pid)).then_some(())) },
        )
        .await
        .map(|()| format!("daemon {pid} exited (quit: {quit})")),
        None => Err(anyhow::anyhow!("a had no daemon to quit")),
    };
    table.push(
        "a quits the daemon it can reach",
        "a",
        quitted
            .as_ref()
            .map_or_else(|e| format!("{e:#}"), Clone::clone),
        Verdict::of(
            quitted
                .as_ref()
                .err()
                .map(|e| format!("{e:#}"))
                .into_iter()
                .collect(),
        ),
    );
    let b_daemons = daemons_of(&b.pipe);
    table.push(
        "its neighbour keeps its daemon",
        "b",
        format!("daemon {b_daemons:?}, was {:?}", b.daemon),
        Verdict::of(
            (b.daemon.is_none() || b_daemons != b.daemon.into_iter().collect::<Vec<_>>())
                .then(|| "b's daemon changed when a quit its own".to_owned())
                .into_iter()
                .collect(),
        ),
    );
    for run in isolation::runs(&b.limits, ctx.gpu_memory) {
        if !run.env.is_empty() {
            continue;
        }
        let report = ctx.probe(node, b, run.alloc, &run.env)?;
        table.push(
            format!("after a's quit, probe: {}", run.name),
            b.name,
            isolation::describe(&report),
            Verdict::of(isolation::check_report(
                &ctx.gpu, &b.limits, run.fits, &report,
            )),
        );
    }
    Ok(())
}

/// Step 6: unprepare stops both daemons and removes specs and records.
async fn unprepare(
    ctx: &Ctx<'_>,
    node: &Node,
    channel: &tonic::transport::Channel,
    tenants: &[Tenant],
    table: &mut Table,
) -> Result<()> {
    let mut dra = dra_v1::dra_plugin_client::DraPluginClient::new(channel.clone());
    for t in tenants {
        let answer = dra
            .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
                claims: vec![ctx.claim_ref(t)],
            })
            .await?
            .into_inner();
        let error = answer
            .claims
            .get(&t.uid)
            .map_or_else(|| "no answer".to_owned(), |c| c.error.clone());
        let gone = wait_for("the claim's daemons to stop", ctx.args.timeout, || async {
            Ok(daemons_of(&t.pipe).is_empty().then_some(()))
        })
        .await;
        let mut problems = Vec::new();
        if !error.is_empty() {
            problems.push(format!("unprepare: {error}"));
        }
        if let Err(e) = gone {
            problems.push(format!("{e:#}: {:?}", daemons_of(&t.pipe)));
        }
        if t.pipe.exists() {
            problems.push(format!(
                "pipe directory {} is still there",
                t.pipe.display()
            ));
        }
        let spec_left = std::fs::read_dir(node.cdi_dir())?
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().contains(&t.uid));
        if spec_left {
            problems.push("its CDI spec is still there".into());
        }
        if node.records_dir().join(format!("{}.json", t.uid)).exists() {
            problems.push("its checkpoint record is still there".into());
        }
        table.push(
            "unprepare leaves nothing",
            t.name,
            if problems.is_empty() {
                "daemon stopped; spec, record and pipe directory removed".into()
            } else {
                "see below".into()
            },
            Verdict::of(problems),
        );
    }
    Ok(())
}
