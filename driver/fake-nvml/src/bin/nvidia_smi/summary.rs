//! `nvidia-smi` without arguments: the summary table. Its first row names
//! the driver version and the highest CUDA version the driver supports,
//! which is what scripts (and conformance checks) read from it; one row per
//! GPU follows with its index, name, bus id, memory use and MIG mode. What
//! the simulated GPU has no figure for (fan, temperature, power, ECC) is
//! left out rather than made up.

use nvml_wrapper::enum_wrappers::device::ComputeMode;
use nvml_wrapper::{Device, Nvml};

/// Cells between the table's borders, as the real tool lays them out.
const COLUMNS: [usize; 3] = [41, 24, 22];

pub fn render(nvml: &Nvml, gpus: &[Device]) -> String {
    let driver = nvml.sys_driver_version().unwrap_or_else(|_| "N/A".into());
    let cuda = nvml
        .sys_cuda_driver_version()
        .map_or_else(|_| "N/A".into(), cuda_version);
    let inner = COLUMNS.iter().sum::<usize>() + COLUMNS.len() - 1;
    let mut out = format!("+{}+\n", "-".repeat(inner));
    let header = format!("NVIDIA-SMI {driver:<22}Driver Version: {driver:<15}CUDA Version: {cuda}");
    out += &format!("| {header:<width$} |\n", width = inner - 2);
    out += &rule('|', '-', '+');
    out += &row(["GPU  Name", "Bus-Id", "Memory-Usage"]);
    out += &row(["", "", "Compute M. / MIG M."]);
    out += &rule('|', '=', '+');
    for gpu in gpus {
        out += &gpu_rows(gpu);
        out += &rule('+', '-', '+');
    }
    out
}

/// `12080` -> `12.8`: NVML's `1000 * major + 10 * minor`.
fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn gpu_rows(gpu: &Device) -> String {
    let memory = gpu.memory_info().map_or_else(
        |_| "N/A".into(),
        |m| format!("{}MiB / {}MiB", m.used >> 20, m.total >> 20),
    );
    let compute = match gpu.compute_mode() {
        Ok(ComputeMode::Default) => "Default",
        Ok(ComputeMode::ExclusiveProcess) => "E. Process",
        Ok(ComputeMode::Prohibited) => "Prohibited",
        _ => "N/A",
    };
    let mig = match gpu.mig_mode() {
        Ok(m) if m.current == 1 => "Enabled",
        Ok(_) => "Disabled",
        Err(_) => "N/A",
    };
    let first = [
        format!(
            "{:>3}  {}",
            gpu.index().unwrap_or(0),
            gpu.name().unwrap_or_default()
        ),
        gpu.pci_info().map(|p| p.bus_id).unwrap_or_default(),
        memory,
    ];
    row(first) + &row([String::new(), String::new(), format!("{compute} / {mig}")])
}

fn row<S: AsRef<str>>(cells: [S; 3]) -> String {
    let mut out = String::from("|");
    for (cell, width) in cells.iter().zip(COLUMNS) {
        out += &format!(" {:<w$} |", cell.as_ref(), w = width - 2);
    }
    out + "\n"
}

fn rule(edge: char, fill: char, cross: char) -> String {
    let cells: Vec<String> = COLUMNS
        .iter()
        .map(|w| fill.to_string().repeat(*w))
        .collect();
    format!("{edge}{}{cross}\n", cells.join(&cross.to_string()))
}
