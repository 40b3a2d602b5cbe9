//! `tessera status`: an operator's view of one node, per GPU: its MIG
//! mode, the mode its claims use it in (whole, MIG, Isolated shares and
//! their provider, Shared shares), its health, the claims prepared on it
//! (device, kind, limits) with the Pods they are reserved for, the
//! memory allocated to them next to the memory NVML reports used, and why
//! a GPU gets no Isolated shares where it predates Volta.
//!
//! Read-only and lock-free: it reads the claim records in
//! `<state dir>/prepared-claims/` (the node process replaces each by
//! rename, so a read sees one whole version)
//! and NVML, and never takes `<state dir>/lock`, so it works while the node
//! process runs. Pods (each claim's `status.reservedFor`) and health (the
//! node process's device taints in the ResourceSlices) come from the API
//! server when a kubeconfig is found; without one the report still prints,
//! saying both are unknown.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::ValueEnum;

use serde::Serialize;
use tessera_api::inventory::{Inventory, Mig};
use tessera_controller::model::plan;
use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::discovery;
use tessera_driver::host::mps::generation::{self, IsolationSupport};
use tessera_driver::metrics::memory;
use tessera_driver::state::checkpoint::{self, KERNEL_BOOT_ID};
use tessera_driver::state::records::{ClaimEntry, EntryState, LimitsData};

use crate::flags::{DriverFlags, KubeFlags};
use crate::inventory::{CGROUP_FS, write_stdout};

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The node process's state directory (its checkpoint).
    #[arg(long, env = "TESSERA_STATE_DIR", default_value = "/var/lib/tessera")]
    pub state_dir: PathBuf,

    /// File holding the kernel's boot id (a checkpoint of another boot
    /// describes nothing that still exists).
    #[arg(long, env = "TESSERA_BOOT_ID_FILE", default_value = KERNEL_BOOT_ID)]
    pub boot_id_file: PathBuf,

    /// Output format.
    #[arg(long, short, value_enum, default_value_t = Output::Text)]
    pub output: Output,

    /// kubeconfig is found (or `--no-api`), both are reported unknown.
    #[command(flatten)]
    pub kube: KubeFlags,

    /// Read nothing from the API server.
    #[arg(long)]
    pub no_api: bool,

    // The driver the node process publishes under (its health taints are
    // `<driver>/unhealthy`).
    #[command(flatten)]
    pub driver: DriverFlags,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// What `tessera status -o json` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// The checkpoint read.
    pub checkpoint: PathBuf,
    pub gpus: Vec<GpuStatus>,
    /// Why Pods and health are unknown (no API server read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_unavailable: Option<String>,
    /// What could not be read (the rest is still reported).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// How the node enforces Isolated shares, and whether it has the next
    /// generation's pieces (MPS v3 driver, cgroup dmem controller).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation: Option<IsolationSupport>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    pub uuid: String,
    /// Absent for a GPU only the checkpoint knows (NVML does not list it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product_name: Option<String>,
    /// `enabled`, `disabled`, `notSupported`, or `unknown`.
    pub mig_mode: String,
    /// What its prepared claims use it as: `idle`, `whole`, `mig`,
    /// `isolated/<provider>`, `shared` (`+`-joined if several).
    pub mode: String,
    /// `healthy`, or `unhealthy (<cause>)` from the node's device taints;
    /// absent when unknown (no API server read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_total_bytes: Option<u64>,
    /// Memory allocated to prepared claims (see `metrics::memory`).
    pub memory_allocated_bytes: u64,
    /// Memory NVML reports used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
    /// Why the node offers no Isolated shares served by MPS on this GPU
    /// (it predates Volta); absent where it offers them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolated_shares: Option<String>,
    pub claims: Vec<ClaimOnGpu>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimOnGpu {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// `Completed`, or `Started`/`Unpreparing` while a call is under way.
    pub state: String,
    /// The published device name.
    pub device: String,
    /// `gpu`, `mig` or `share`.
    pub kind: String,
    #[serde(rename = "migUUID", skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation_level: Option<String>,
    pub memory_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsData>,
    /// For Isolated shares: `mps` or `hami-core`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isolation_provider: Option<String>,
    /// The Pods the claim is reserved for (`status.reservedFor`); absent
    /// when unknown (no API server read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pods: Option<Vec<String>>,
}

/// What the API server says about the node's claims and GPUs.
#[derive(Debug, Clone, Default)]
pub struct ApiView {
    /// Pods per claim UID (claims the API server has under that UID).
    pub pods: BTreeMap<String, Vec<String>>,
    /// Unhealthy GPUs by UUID, with the taint's cause.
    pub unhealthy: BTreeMap<String, String>,
}

pub fn status(library: &OsStr, args: &StatusArgs) -> anyhow::Result<ExitCode> {
    let mut problems = Vec::new();
    let entries = read_entries(&args.state_dir, &args.boot_id_file, &mut problems);
    let mut inventory = Inventory::default();
    let mut used = BTreeMap::new();
    match discovery::init(Some(library)).and_then(|nvml| {
        let found = discovery::discover(&nvml)?;
        Ok((nvml, found))
    }) {
        Ok((nvml, found)) => {
            problems.extend(found.failed.iter().map(|e| e.to_string()));
            for gpu in &found.inventory.gpus {
                match nvml
                    .device_by_uuid(gpu.uuid.as_str())
                    .and_then(|d| d.memory_info())
                {
                    Ok(info) => {
                        used.insert(gpu.uuid.clone(), info.used);
                    }
                    Err(e) => problems.push(format!("{}: reading its memory info: {e}", gpu.uuid)),
                }
            }
            inventory = found.inventory;
        }
        Err(e) => problems.push(format!("NVML: {e}")),
    }
    let api = if args.no_api {
        Err("--no-api".to_owned())
    } else {
        read_api(args, &entries)
    };
    let mut report = build(
        args.state_dir.join(checkpoint::RECORDS_DIR),
        &entries,
        &inventory,
        &used,
        problems,
    );
    match api {
        Ok(view) => report.apply(&view),
        Err(why) => report.api_unavailable = Some(why),
    }
    report.isolation = Some(generation::detect(
        Path::new(CGROUP_FS),
        &inventory.driver_version,
    ));
    let text = match args.output {
        Output::Json => serde_json::to_string_pretty(&report)? + "\n",
        Output::Text => text(&report),
    };
    write_stdout(&text)?;
    for p in &report.problems {
        eprintln!("tessera: error: {p}");
    }
    Ok(if report.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn read_entries(
    state_dir: &Path,
    boot_id_file: &Path,
    problems: &mut Vec<String>,
) -> Vec<(ClaimUid, ClaimEntry)> {
    // Records of an earlier boot list nothing that exists.
    let boot = match std::fs::read_to_string(boot_id_file) {
        Ok(boot) => Some(boot.trim().to_owned()),
        Err(e) => {
            problems.push(format!(
                "cannot read the boot id from {}: {e} (showing the records of every boot)",
                boot_id_file.display()
            ));
            None
        }
    };
    match checkpoint::read_snapshot::<ClaimEntry>(state_dir, boot.as_deref()) {
        Ok(snapshot) => {
            problems
                .extend((snapshot.unreadable.into_iter()).map(|why| format!("checkpoint: {why}")));
            snapshot.claims.into_iter().collect()
        }
        Err(why) => {
            problems.push(format!("checkpoint: {why}"));
            Vec::new()
        }
    }
}

/// Reads each claim's Pods and the GPUs' health taints, within a few
/// seconds; an error says why nothing could be read.
fn read_api(args: &StatusArgs, entries: &[(ClaimUid, ClaimEntry)]) -> Result<ApiView, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting a runtime: {e}"))?;
    let limit = Duration::from_secs(10);
    runtime.block_on(async {
        tokio::time::timeout(limit, api_view(args, entries))
            .await
            .unwrap_or_else(|_| Err(format!("the API server did not answer within {limit:?}")))
    })
}

async fn api_view(
    args: &StatusArgs,
    entries: &[(ClaimUid, ClaimEntry)],
) -> Result<ApiView, String> {
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    use kube::api::{Api, ListParams};

    let client = (args.kube)
        .client(Duration::from_secs(5))
        .await
        .map_err(|e| format!("{e:#}"))?;
    let lookups = entries.iter().map(|(uid, entry)| {
        let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &entry.namespace);
        async move {
            let claim = api
                .get_opt(&entry.name)
                .await
                .map_err(|e| format!("reading claim {}/{}: {e}", entry.namespace, entry.name))?;
            // A claim of that name with another UID is not the one prepared.
            let pods = claim
                .filter(|c| c.metadata.uid.as_deref() == Some(uid.as_str()))
                .and_then(|c| c.status?.reserved_for)
                .unwrap_or_default()
                .into_iter()
                .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
                .map(|r| format!("{}/{}", entry.namespace, r.name))
                .collect::<Vec<_>>();
            Ok::<_, String>((uid.as_str().to_owned(), pods))
        }
    });
    let pods = futures::future::try_join_all(lookups)
        .await?
        .into_iter()
        .collect();
    let slices: Api<ResourceSlice> = Api::all(client);
    let key = format!(
        "{}/{}",
        args.driver.driver_name,
        tessera_controller::model::taints::UNHEALTHY
    );
    let list = slices
        .list(&ListParams::default().fields(&format!("spec.driver={}", args.driver.driver_name)))
        .await
        .map_err(|e| format!("listing ResourceSlices of {}: {e}", args.driver.driver_name))?;
    let mut unhealthy = BTreeMap::new();
    for device in list
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
    {
        let uuid = device
            .attributes
            .as_ref()
            .and_then(|a| a.get(tessera_api::names::attr::UUID))
            .and_then(|v| v.string.clone());
        let taint = device.taints.iter().flatten().find(|t| t.key == key);
        if let (Some(uuid), Some(taint)) = (uuid, taint) {
            unhealthy.insert(uuid, taint.value.clone().unwrap_or_default());
        }
    }
    Ok(ApiView { pods, unhealthy })
}

impl Report {
    /// Adds what the API server said: Pods per claim, health per GPU.
    pub fn apply(&mut self, view: &ApiView) {
        for gpu in &mut self.gpus {
            gpu.health = Some(match view.unhealthy.get(&gpu.uuid) {
                Some(cause) => format!("unhealthy ({cause})"),
                None => "healthy".to_owned(),
            });
            for claim in &mut gpu.claims {
                claim.pods = Some(view.pods.get(&claim.uid).cloned().unwrap_or_default());
            }
        }
    }
}

/// What a GPU's claims use it as.
fn mode(claims: &[ClaimOnGpu]) -> String {
    let mut modes: Vec<String> = Vec::new();
    for c in claims {
        let m = match (c.kind.as_str(), c.isolation_level.as_deref()) {
            ("gpu", _) => "whole".to_owned(),
            ("mig", _) => "mig".to_owned(),
            ("share", Some("Isolated")) => format!(
                "isolated/{}",
                c.isolation_provider.as_deref().unwrap_or("mps")
            ),
            ("share", _) => "shared".to_owned(),
            // Monitoring devices watch; they do not use the GPU.
            _ => continue,
        };
        if !modes.contains(&m) {
            modes.push(m);
        }
    }
    if modes.is_empty() {
        "idle".to_owned()
    } else {
        modes.join("+")
    }
}

/// The report from the checkpoint entries, the inventory and NVML's used
/// memory per GPU.
pub fn build(
    checkpoint: PathBuf,
    entries: &[(ClaimUid, ClaimEntry)],
    inventory: &Inventory,
    used: &BTreeMap<String, u64>,
    problems: Vec<String>,
) -> Report {
    let allocated = memory::allocated_by_gpu(entries.iter().map(|(_, e)| e), inventory);
    let mut claims: BTreeMap<&str, Vec<ClaimOnGpu>> = BTreeMap::new();
    for (uid, entry) in entries {
        for device in &entry.status {
            let data = &device.data;
            claims
                .entry(data.gpu_uuid.as_str())
                .or_default()
                .push(ClaimOnGpu {
                    namespace: entry.namespace.clone(),
                    name: entry.name.clone(),
                    uid: uid.as_str().to_owned(),
                    state: format!("{:?}", entry.state),
                    device: device.device.clone(),
                    kind: data.device_type.clone(),
                    mig_uuid: data.mig_uuid.clone(),
                    profile: data.profile.clone(),
                    isolation_level: data.isolation_level.clone(),
                    memory_bytes: if entry.state == EntryState::Completed {
                        memory::device_memory(data, inventory)
                    } else {
                        0
                    },
                    limits: data.limits.clone(),
                    isolation_provider: data.isolation_provider.clone(),
                    pods: None,
                });
        }
    }
    let mut gpus: Vec<GpuStatus> = inventory
        .gpus
        .iter()
        .map(|g| GpuStatus {
            uuid: g.uuid.clone(),
            product_name: Some(g.product_name.clone()),
            mig_mode: match g.mig {
                Mig::NotSupported => "notSupported",
                Mig::Disabled { .. } => "disabled",
                Mig::Enabled { .. } => "enabled",
            }
            .to_owned(),
            memory_total_bytes: Some(g.memory_bytes),
            memory_allocated_bytes: allocated.get(&g.uuid).copied().unwrap_or(0),
            memory_used_bytes: used.get(&g.uuid).copied(),
            isolated_shares: plan::mps_isolation_unsupported(g),
            claims: claims.remove(g.uuid.as_str()).unwrap_or_default(),
            mode: String::new(),
            health: None,
        })
        .collect();
    // Claims on GPUs NVML does not list (gone, or NVML unreadable).
    for (uuid, on) in claims {
        gpus.push(GpuStatus {
            uuid: uuid.to_owned(),
            product_name: None,
            mig_mode: "unknown".into(),
            memory_total_bytes: None,
            memory_allocated_bytes: allocated.get(uuid).copied().unwrap_or(0),
            memory_used_bytes: None,
            isolated_shares: None,
            claims: on,
            mode: String::new(),
            health: None,
        });
    }
    for gpu in &mut gpus {
        gpu.mode = mode(&gpu.claims);
    }
    Report {
        checkpoint,
        gpus,
        api_unavailable: None,
        problems,
        isolation: None,
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn text(report: &Report) -> String {
    let mut out = String::new();
    if report.gpus.is_empty() {
        out.push_str("no GPUs found and no claims prepared\n");
    }
    if let Some(why) = &report.api_unavailable {
        let _ = writeln!(out, "pods and health unknown: no API server read ({why})\n");
    }
    if let Some(i) = &report.isolation {
        let _ = writeln!(
            out,
            "isolation: Isolated shares by {}; cgroup {}, dmem controller {}, MPS v3 driver {}\n",
            i.enforced_by,
            i.cgroup,
            if i.dmem_controller { "yes" } else { "no" },
            if i.mps_v3_driver { "yes" } else { "no" },
        );
    }
    for gpu in &report.gpus {
        let _ = writeln!(
            out,
            "{}  {}  MIG {}  mode {}  health {}",
            gpu.uuid,
            gpu.product_name
                .as_deref()
                .unwrap_or("(not listed by NVML)"),
            gpu.mig_mode,
            gpu.mode,
            gpu.health.as_deref().unwrap_or("unknown")
        );
        let opt = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), gib);
        let _ = writeln!(
            out,
            "  memory: allocated {}, used {} (NVML), total {}",
            gib(gpu.memory_allocated_bytes),
            opt(gpu.memory_used_bytes),
            opt(gpu.memory_total_bytes)
        );
        if let Some(why) = &gpu.isolated_shares {
            let _ = writeln!(out, "  {why}");
        }
        if gpu.claims.is_empty() {
            out.push_str("  no claims\n\n");
            continue;
        }
        let rows: Vec<[String; 7]> = gpu
            .claims
            .iter()
            .map(|c| {
                let mut limits = Vec::new();
                if let Some(level) = &c.isolation_level {
                    limits.push(match &c.isolation_provider {
                        Some(p) => format!("{level}/{p}"),
                        None => level.clone(),
                    });
                }
                if let Some(profile) = &c.profile {
                    limits.push(profile.clone());
                }
                if let Some(l) = &c.limits {
                    limits.push(format!(
                        "memory {}, compute {}%",
                        l.memory, l.compute_percent
                    ));
                }
                [
                    format!("{}/{}", c.namespace, c.name),
                    c.device.clone(),
                    c.kind.clone(),
                    c.state.clone(),
                    gib(c.memory_bytes),
                    match &c.pods {
                        None => "?".into(),
                        Some(p) if p.is_empty() => "-".into(),
                        Some(p) => p.join(","),
                    },
                    if limits.is_empty() {
                        "-".into()
                    } else {
                        limits.join(", ")
                    },
                ]
            })
            .collect();
        let header = [
            "CLAIM", "DEVICE", "KIND", "STATE", "MEMORY", "PODS", "LIMITS",
        ]
        .map(String::from);
        let mut widths = header.clone().map(|h| h.len());
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.len());
            }
        }
        for row in std::iter::once(&header).chain(&rows) {
            let mut line = String::from("  ");
            for (i, cell) in row.iter().enumerate() {
                if i + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let _ = write!(line, "{cell:<width$}  ", width = widths[i]);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::inventory::Gpu;
    use tessera_driver::state::records::{ConsumedData, DeviceData, DeviceStatus};

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_gpu_before_volta_says_why_it_has_no_isolated_shares() {
        let gpu = |uuid: &str, architecture: &str, capability: &str| Gpu {
            uuid: uuid.into(),
            product_name: format!("a {architecture} GPU"),
            brand: "Nvidia".into(),
            architecture: architecture.into(),
            cuda_compute_capability: capability.into(),
            pci_bus_id: "0000:07:00.0".into(),
            memory_bytes: 16 * GIB,
            multiprocessors: 56,
            minor: 0,
            mig: Mig::NotSupported,
        };
        let inventory = Inventory {
            driver_version: "535".into(),
            cuda_driver_version: "12.2".into(),
            gpus: vec![gpu("GPU-p", "pascal", "6.1"), gpu("GPU-v", "volta", "7.0")],
        };
        let report = build("cp".into(), &[], &inventory, &BTreeMap::new(), Vec::new());
        let why = report.gpus[0].isolated_shares.as_deref().unwrap();
        assert!(
            why.contains("compute capability 6.1 is before Volta"),
            "{why}"
        );
        assert_eq!(report.gpus[1].isolated_shares, None);
        let shown = text(&report);
        assert!(shown.contains(&format!("  {why}\n")), "{shown}");
        assert_eq!(shown.matches("no Isolated shares").count(), 1, "{shown}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["gpus"][0]["isolatedShares"], why);
        assert!(json["gpus"][1].get("isolatedShares").is_none());
    }

    #[test]
    fn claims_are_listed_under_their_gpu_with_allocated_and_used_memory() {
        let gpu = Gpu {
            uuid: "GPU-0".into(),
            product_name: "NVIDIA L4".into(),
            brand: "Nvidia".into(),
            architecture: "ada".into(),
            cuda_compute_capability: "8.9".into(),
            pci_bus_id: "0000:07:00.0".into(),
            memory_bytes: 24 * GIB,
            multiprocessors: 58,
            minor: 0,
            mig: Mig::NotSupported,
        };
        let inventory = Inventory {
            driver_version: "580".into(),
            cuda_driver_version: "13.0".into(),
            gpus: vec![gpu],
        };
        let share = DeviceStatus {
            pool: "node".into(),
            device: "gpu-0-isolated".into(),
            share_id: Some("s".into()),
            data: DeviceData {
                device_type: "share".into(),
                gpu_uuid: "GPU-0".into(),
                mig_uuid: None,
                profile: None,
                isolation_level: Some("Isolated".into()),
                sharing: None,
                time_slice: None,
                limits: Some(LimitsData {
                    memory: "2Gi".into(),
                    memory_bytes: 2 * GIB,
                    compute_percent: 25,
                }),
                consumed: Some(ConsumedData {
                    memory_bytes: 2 * GIB,
                    cores_percent: 25,
                }),
                isolation_provider: Some("hami-core".into()),
            },
        };
        let uid_text = "0b5c7a62-6b5e-4c3c-9d7e-6c1f6f0d2a11";
        let uid = ClaimUid::parse(uid_text).unwrap();
        let entries = vec![(
            uid,
            ClaimEntry {
                namespace: "team".into(),
                name: "train".into(),
                state: EntryState::Completed,
                actions: Vec::new(),
                devices: Vec::new(),
                spec: None,
                status: vec![share],
            },
        )];
        let used = [("GPU-0".to_owned(), GIB)].into_iter().collect();
        let report = build("cp".into(), &entries, &inventory, &used, Vec::new());
        assert_eq!(report.gpus.len(), 1);
        let g = &report.gpus[0];
        assert_eq!(g.mig_mode, "notSupported");
        assert_eq!(g.memory_allocated_bytes, 2 * GIB);
        assert_eq!(g.memory_used_bytes, Some(GIB));
        assert_eq!(g.claims.len(), 1);
        assert_eq!(g.claims[0].name, "train");
        assert_eq!(g.claims[0].memory_bytes, 2 * GIB);
        assert_eq!(g.mode, "isolated/hami-core");
        let mut unknown = report.clone();
        unknown.api_unavailable = Some("no kubeconfig".into());
        let shown = text(&unknown);
        assert!(shown.contains("pods and health unknown: no API server read (no kubeconfig)"));
        assert!(shown.contains("MIG notSupported  mode isolated/hami-core  health unknown"));
        assert!(shown.contains("allocated 2.0 GiB, used 1.0 GiB (NVML), total 24.0 GiB"));
        assert!(
            shown.contains("team/train  gpu-0-isolated  share  Completed  2.0 GiB  ?     Isolated/hami-core, memory 2Gi, compute 25%"),
            "{shown}"
        );

        let mut known = report;
        known.apply(&ApiView {
            pods: [(uid_text.to_owned(), vec!["team/trainer-0".to_owned()])].into(),
            unhealthy: [("GPU-0".to_owned(), "xid-79".to_owned())].into(),
        });
        let shown = text(&known);
        assert!(shown.contains("health unhealthy (xid-79)"), "{shown}");
        assert!(
            shown.contains("Completed  2.0 GiB  team/trainer-0  Isolated/hami-core"),
            "{shown}"
        );
        let json = serde_json::to_value(&known).unwrap();
        assert_eq!(json["gpus"][0]["claims"][0]["pods"][0], "team/trainer-0");
    }
}
