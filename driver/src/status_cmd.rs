//! `tessera status`: an operator's view of one node, per GPU: its MIG
//! mode, the claims prepared on it (device, kind, limits) and the memory
//! allocated to them next to the memory NVML reports used.
//!
//! Read-only and lock-free: it reads `<state dir>/checkpoint.json` (which
//! the node process replaces by rename, so a read sees one whole version)
//! and NVML, and never takes `<state dir>/lock`, so it works while the node
//! process runs.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::ValueEnum;
use serde::Serialize;
use tessera_api::inventory::{Inventory, Mig};
use tessera_driver::checkpoint::{self, KERNEL_BOOT_ID};
use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::discovery;
use tessera_driver::metrics::memory;
use tessera_driver::prepare::state::{ClaimEntry, EntryState, LimitsData};

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
    /// What could not be read (the rest is still reported).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_total_bytes: Option<u64>,
    /// Memory allocated to prepared claims (see `metrics::memory`).
    pub memory_allocated_bytes: u64,
    /// Memory NVML reports used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
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
    let report = build(
        args.state_dir.join("checkpoint.json"),
        &entries,
        &inventory,
        &used,
        problems,
    );
    let text = match args.output {
        Output::Json => serde_json::to_string_pretty(&report)? + "\n",
        Output::Text => text(&report),
    };
    crate::write_stdout(&text)?;
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
    let snapshot = match checkpoint::read_snapshot::<ClaimEntry>(state_dir) {
        Ok(Some(snapshot)) => snapshot,
        Ok(None) => return Vec::new(),
        Err(why) => {
            problems.push(format!("checkpoint: {why}"));
            return Vec::new();
        }
    };
    match std::fs::read_to_string(boot_id_file) {
        Ok(boot) if boot.trim() == snapshot.boot_id => {}
        // Written before the last reboot: nothing it lists exists.
        Ok(_) => return Vec::new(),
        Err(e) => problems.push(format!(
            "cannot read the boot id from {}: {e} (showing the checkpoint as is)",
            boot_id_file.display()
        )),
    }
    snapshot.claims.into_iter().collect()
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
            claims: claims.remove(g.uuid.as_str()).unwrap_or_default(),
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
            claims: on,
        });
    }
    Report {
        checkpoint,
        gpus,
        problems,
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
    for gpu in &report.gpus {
        let _ = writeln!(
            out,
            "{}  {}  MIG {}",
            gpu.uuid,
            gpu.product_name
                .as_deref()
                .unwrap_or("(not listed by NVML)"),
            gpu.mig_mode
        );
        let opt = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), gib);
        let _ = writeln!(
            out,
            "  memory: allocated {}, used {} (NVML), total {}",
            gib(gpu.memory_allocated_bytes),
            opt(gpu.memory_used_bytes),
            opt(gpu.memory_total_bytes)
        );
        if gpu.claims.is_empty() {
            out.push_str("  no claims\n\n");
            continue;
        }
        let rows: Vec<[String; 6]> = gpu
            .claims
            .iter()
            .map(|c| {
                let mut limits = Vec::new();
                if let Some(level) = &c.isolation_level {
                    limits.push(level.clone());
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
                    if limits.is_empty() {
                        "-".into()
                    } else {
                        limits.join(", ")
                    },
                ]
            })
            .collect();
        let header = ["CLAIM", "DEVICE", "KIND", "STATE", "MEMORY", "LIMITS"].map(String::from);
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
    use tessera_driver::prepare::state::{ConsumedData, DeviceData, DeviceStatus};

    const GIB: u64 = 1 << 30;

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
        let uid = ClaimUid::parse("0b5c7a62-6b5e-4c3c-9d7e-6c1f6f0d2a11").unwrap();
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
        let shown = text(&report);
        assert!(shown.contains("allocated 2.0 GiB, used 1.0 GiB (NVML), total 24.0 GiB"));
        assert!(
            shown.contains("team/train  gpu-0-isolated  share  Completed  2.0 GiB  Isolated, memory 2Gi, compute 25%"),
            "{shown}"
        );
    }
}
