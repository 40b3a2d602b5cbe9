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
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::ValueEnum;

use tessera_api::inventory::Inventory;
use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::discovery;
use tessera_driver::host::mps::generation;
use tessera_driver::state::checkpoint::{self, KERNEL_BOOT_ID};
use tessera_driver::state::records::ClaimEntry;

use crate::flags::{DriverFlags, KubeFlags};
use crate::inventory::{CGROUP_FS, write_stdout};

mod api;
mod report;
mod text;

use report::build;

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
        api::read_api(args, &entries)
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
        Output::Text => text::text(&report),
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

#[cfg(test)]
mod tests;
