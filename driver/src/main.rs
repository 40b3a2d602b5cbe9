//! `tessera`: the Tessera node daemon and its tools.
//!
//! Subcommands live in [`Command`]; each gets its own arguments struct and a
//! function that returns the process exit code, so adding one is adding a
//! variant and a match arm.

use tessera_driver::discovery;
use tessera_driver::mps::generation::{self, IsolationSupport};

mod publish_cmd;
mod status_cmd;

use std::ffi::{OsStr, OsString};
use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "tessera",
    version,
    about = "Tessera: a Kubernetes DRA driver for NVIDIA GPUs"
)]
struct Cli {
    /// NVML library to load: a path, or a file name the dynamic loader
    /// resolves (for a containerized driver, e.g.
    /// /run/nvidia/driver/usr/lib64/libnvidia-ml.so.1).
    #[arg(long, global = true, env = "TESSERA_NVML_LIBRARY", default_value = discovery::DEFAULT_LIBRARY)]
    nvml_library: OsString,

    #[command(subcommand)]
    command: Command,
}

// Parsed once per run: the size of the plugin's arguments does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Print the GPUs, MIG profiles and MIG devices NVML reports on this node.
    ///
    /// Exits non-zero when NVML is missing or fails, or when any GPU could not
    /// be read; the GPUs that could be read are still printed, the failures
    /// are reported on stderr.
    Inventory(InventoryArgs),

    /// Publish this node's GPUs as ResourceSlices and keep them up to date
    /// (GPU discovery, node policy and what the API server serves decide
    /// what is published; nothing is written when nothing changed).
    Publish(publish_cmd::PublishArgs),

    /// Print the ResourceSlices this node would publish, without an API
    /// server.
    Slices(publish_cmd::SlicesArgs),

    /// Run the kubelet plugin: register with the kubelet and serve
    /// NodePrepareResources / NodeUnprepareResources until SIGTERM.
    Plugin(tessera_driver::plugin::cli::PluginArgs),

    /// Print per GPU its MIG mode, the claims prepared on it and the memory
    /// allocated to them vs what NVML reports used. Reads the node process's
    /// state directory without locking it: safe while the node process runs.
    Status(status_cmd::StatusArgs),

    /// Serve the validating admission webhook: refuse ResourceClaims and
    /// ResourceClaimTemplates whose opaque config for this driver does not
    /// decode, with the message prepare would give (HTTPS, POST /validate).
    Webhook(tessera_driver::webhook::WebhookArgs),

    /// Print as JSON what a CUDA process gets here: the devices libcuda
    /// enumerates with their SMs and free memory (under MPS: the client's
    /// limits), optionally whether an allocation fits. Exits non-zero when
    /// the library is missing or a CUDA call fails.
    Probe(tessera_driver::probe::ProbeArgs),

    /// Ask a running node process over its `--health-socket` whether it is
    /// ready (serving, or on standby ready to take over) or alive; prints
    /// its answer and exits 0 if so, 1 if not. For the kubelet's exec
    /// probes: the image has no shell.
    Health(tessera_driver::node::readiness::ProbeArgs),
}

#[derive(Debug, clap::Args)]
struct InventoryArgs {
    /// Output format.
    #[arg(long, short, value_enum, default_value_t = Format::Yaml)]
    output: Format,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Yaml,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Inventory(args) => inventory(&cli.nvml_library, args),
        Command::Publish(args) => publish_cmd::publish(&cli.nvml_library, args),
        Command::Slices(args) => publish_cmd::slices(&cli.nvml_library, args),
        Command::Plugin(args) => {
            tessera_driver::plugin::cli::main(&cli.nvml_library, args).map(|()| ExitCode::SUCCESS)
        }
        Command::Status(args) => status_cmd::status(&cli.nvml_library, args),
        Command::Webhook(args) => tessera_driver::webhook::main(args).map(|()| ExitCode::SUCCESS),
        Command::Probe(args) => tessera_driver::probe::main(args),
        Command::Health(args) => tessera_driver::node::readiness::probe_main(args),
    };
    result.unwrap_or_else(|e| {
        eprintln!("tessera: error: {e:#}");
        ExitCode::FAILURE
    })
}

/// The host's cgroup filesystem, where the dmem controller would be.
const CGROUP_FS: &str = "/sys/fs/cgroup";

fn inventory(library: &OsStr, args: &InventoryArgs) -> anyhow::Result<ExitCode> {
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
fn quote_base60_lookalikes(yaml: &str) -> String {
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
fn write_stdout(text: &str) -> anyhow::Result<()> {
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
