//! `tessera`: the Tessera node daemon and its tools.
//!
//! Subcommands live in [`Command`]; each gets its own arguments struct and a
//! function that returns the process exit code, so adding one is adding a
//! variant and a match arm.

mod discovery;

use std::ffi::{OsStr, OsString};
use std::io::{self, Write};
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the GPUs, MIG profiles and MIG devices NVML reports on this node.
    ///
    /// Exits non-zero when NVML is missing or fails, or when any GPU could not
    /// be read; the GPUs that could be read are still printed, the failures
    /// are reported on stderr.
    Inventory(InventoryArgs),
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
    };
    result.unwrap_or_else(|e| {
        eprintln!("tessera: error: {e:#}");
        ExitCode::FAILURE
    })
}

fn inventory(library: &OsStr, args: &InventoryArgs) -> anyhow::Result<ExitCode> {
    let nvml = discovery::init(Some(library))?;
    let found = discovery::discover(&nvml)?;
    let text = match args.output {
        Format::Yaml => {
            serde_yaml::to_string(&found.inventory).context("encoding the inventory as YAML")?
        }
        Format::Json => {
            serde_json::to_string_pretty(&found.inventory)
                .context("encoding the inventory as JSON")?
                + "\n"
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

/// Writes to stdout; a closed pipe (`tessera inventory | head`) is not an error.
fn write_stdout(text: &str) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}
