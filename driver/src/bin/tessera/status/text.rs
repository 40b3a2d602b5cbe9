//! `tessera status`'s text: per GPU a header line, its memory, and its
//! claims as a table.

use std::fmt::Write as _;

use super::report::{ClaimOnGpu, GpuStatus, Report};

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

pub(super) fn text(report: &Report) -> String {
    let mut out = String::new();
    preamble(&mut out, report);
    for gpu in &report.gpus {
        gpu_header(&mut out, gpu);
        memory_line(&mut out, gpu);
        if let Some(why) = &gpu.isolated_shares {
            let _ = writeln!(out, "  {why}");
        }
        if gpu.claims.is_empty() {
            out.push_str("  no claims\n\n");
            continue;
        }
        claim_table(&mut out, &gpu.claims);
        out.push('\n');
    }
    out
}

/// What holds for the whole node: no GPUs, no API server read, how
/// Isolated shares are enforced.
fn preamble(out: &mut String, report: &Report) {
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
}

/// `<uuid>  <product>  MIG <mode>  mode <mode>  health <health>`.
fn gpu_header(out: &mut String, gpu: &GpuStatus) {
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
}

/// Allocated, used and total memory; `?` where unknown.
fn memory_line(out: &mut String, gpu: &GpuStatus) {
    let opt = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), gib);
    let _ = writeln!(
        out,
        "  memory: allocated {}, used {} (NVML), total {}",
        gib(gpu.memory_allocated_bytes),
        opt(gpu.memory_used_bytes),
        opt(gpu.memory_total_bytes)
    );
}

/// The claims as a table under a header, columns as wide as their
/// widest cell.
fn claim_table(out: &mut String, claims: &[ClaimOnGpu]) {
    let rows: Vec<[String; 7]> = claims.iter().map(claim_row).collect();
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
}

/// One claim's cells: claim, device, kind, state, memory, Pods, limits.
fn claim_row(c: &ClaimOnGpu) -> [String; 7] {
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
}
