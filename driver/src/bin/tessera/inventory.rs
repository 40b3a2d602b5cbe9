//! `tessera inventory`: what NVML reports on this node, and how it can
//! enforce Isolated shares.

use std::ffi::OsStr;
use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::ValueEnum;
use tessera_driver::discovery;
use tessera_driver::host::mps::generation::{self, IsolationSupport};

#[derive(Debug, clap::Args)]
pub struct InventoryArgs {
    /// Output format.
    #[arg(long, short, value_enum, default_value_t = Format::Yaml)]
    output: Format,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Yaml,
    Json,
}

/// The host's cgroup filesystem, where the dmem controller would be.
pub const CGROUP_FS: &str = "/sys/fs/cgroup";

pub fn inventory(library: &OsStr, args: &InventoryArgs) -> anyhow::Result<ExitCode> {
    let nvml = discovery::init(Some(library))?;
    let found = discovery::discover(&nvml)?;
    // The GPUs, and how this node can enforce Isolated shares.
    #[derive(serde::Serialize)]
    struct Report<'a> {
        #[serde(flatten)]
        inventory: &'a tessera_api::inventory::Inventory,
        isolation: IsolationSupport,
    }
    let report = Report {
        inventory: &found.inventory,
        isolation: generation::detect(Path::new(CGROUP_FS), &found.inventory.driver_version),
    };
    let text = match args.output {
        Format::Yaml => quote_base60_lookalikes(
            &serde_yaml::to_string(&report).context("encoding the inventory as YAML")?,
        ),
        Format::Json => {
            serde_json::to_string_pretty(&report).context("encoding the inventory as JSON")? + "\n"
        }
    };
    write_stdout(&text)?;
    for e in &found.failed {
        eprintln!("tessera: error: {e}");
    }
    Ok(if found.failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Quotes plain scalars such as `0000:07:00.0` (a PCI bus id), which YAML 1.1
/// readers (PyYAML, yq v3, ...) read as base-60 numbers (`420.0`); serde_yaml
/// emits YAML 1.2, where they are strings, and leaves them unquoted.
pub fn quote_base60_lookalikes(yaml: &str) -> String {
    let looks_base60 = |v: &str| {
        v.starts_with(|c: char| c.is_ascii_digit())
            && v.contains(':')
            && v.chars()
                .all(|c| c.is_ascii_hexdigit() || matches!(c, ':' | '.' | '_'))
    };
    let mut out = String::with_capacity(yaml.len() + 64);
    for line in yaml.lines() {
        match line.split_once(": ") {
            Some((key, value)) if looks_base60(value) => {
                out.push_str(key);
                out.push_str(": '");
                out.push_str(value);
                out.push('\'');
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Writes to stdout; a closed pipe (`tessera inventory | head`) is not an error.
pub fn write_stdout(text: &str) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base60_lookalikes_are_quoted_and_nothing_else_changes() {
        let yaml = "pciBusId: 0000:07:00.0\n- pciBusId: 0000:1b:00.0\nname: NVIDIA L4\nv: '12.4'\nminor: 0\n";
        assert_eq!(
            quote_base60_lookalikes(yaml),
            "pciBusId: '0000:07:00.0'\n- pciBusId: '0000:1b:00.0'\nname: NVIDIA L4\nv: '12.4'\nminor: 0\n"
        );
    }
}
