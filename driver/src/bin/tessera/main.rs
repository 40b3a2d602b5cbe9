//! `tessera`: the Tessera node daemon and its tools.
//!
//! Subcommands live in [`Command`]; each gets its own arguments struct and a
//! function that returns the process exit code, so adding one is adding a
//! variant and a match arm.

mod binder;
mod flags;
mod health;
mod inventory;
mod plugin;
mod probe;
mod publish;
mod signals;
mod status;
mod webhook;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tessera_driver::discovery;

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
    Inventory(inventory::InventoryArgs),

    /// Publish this node's GPUs as ResourceSlices and keep them up to date
    /// (GPU discovery, node policy and what the API server serves decide
    /// what is published; nothing is written when nothing changed).
    Publish(publish::PublishArgs),

    /// Print the ResourceSlices this node would publish, without an API
    /// server.
    Slices(publish::SlicesArgs),

    /// Run the kubelet plugin: register with the kubelet and serve
    /// NodePrepareResources / NodeUnprepareResources until SIGTERM.
    Plugin(plugin::PluginArgs),

    /// Print per GPU its MIG mode, the claims prepared on it and the memory
    /// allocated to them vs what NVML reports used. Reads the node process's
    /// state directory without locking it: safe while the node process runs.
    Status(status::StatusArgs),

    /// Serve the validating admission webhook: refuse ResourceClaims and
    /// ResourceClaimTemplates whose opaque config for this driver does not
    /// decode, with the message prepare would give (HTTPS, POST /validate).
    Webhook(webhook::WebhookArgs),

    /// List each claim whose device the scheduler waits on (binding
    /// conditions: dynamic MIG) in its node's ConfigMap, so the node makes
    /// it before the pod binds. One per cluster.
    Binder(binder::BinderArgs),

    /// Print as JSON what a CUDA process gets here: the devices libcuda
    /// enumerates with their SMs and free memory (under MPS: the client's
    /// limits), optionally whether an allocation fits. Exits non-zero when
    /// the library is missing or a CUDA call fails.
    Probe(probe::ProbeArgs),

    /// Ask a running node process over its `--health-socket` whether it is
    /// ready (serving, or on standby ready to take over) or alive; prints
    /// its answer and exits 0 if so, 1 if not. For the kubelet's exec
    /// probes: the image has no shell.
    Health(health::HealthArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Inventory(args) => inventory::inventory(&cli.nvml_library, args),
        Command::Publish(args) => publish::publish(&cli.nvml_library, args),
        Command::Slices(args) => publish::slices(&cli.nvml_library, args),
        Command::Plugin(args) => plugin::main(&cli.nvml_library, args).map(|()| ExitCode::SUCCESS),
        Command::Status(args) => status::status(&cli.nvml_library, args),
        Command::Webhook(args) => webhook::main(args).map(|()| ExitCode::SUCCESS),
        Command::Binder(args) => binder::main(args).map(|()| ExitCode::SUCCESS),
        Command::Probe(args) => probe::main(args),
        Command::Health(args) => health::main(args),
    };
    result.unwrap_or_else(|e| {
        eprintln!("tessera: error: {e:#}");
        ExitCode::FAILURE
    })
}
