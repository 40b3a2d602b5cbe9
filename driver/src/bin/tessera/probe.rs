//! `tessera probe`: what a CUDA process gets here (see
//! [`tessera_driver::probe`]).

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use tessera_driver::probe::{DEFAULT_LIBRARY, container};

use crate::inventory::write_stdout;

/// `tessera probe`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ProbeArgs {
    /// CUDA driver library to load: a path, or a file name the dynamic
    /// loader resolves [default: the `libcuda.so.1` a --cdi-device's spec
    /// mounts, else libcuda.so.1].
    #[arg(long)]
    pub library: Option<OsString>,

    /// Also allocate this much device memory on every device (and free it):
    /// bytes or a Kubernetes quantity such as 8Gi or 500M.
    #[arg(long, value_parser = parse_bytes)]
    pub alloc: Option<u64>,

    /// Then keep every device busy this many seconds (a spin kernel after
    /// another), holding the --alloc memory meanwhile; the report counts
    /// the kernels run.
    #[arg(long, value_name = "SECONDS")]
    pub busy: Option<u64>,

    /// Set NAME=VALUE in this process's environment before the library is
    /// loaded, as any process can: how a tenant tries to raise its MPS
    /// limits (repeatable). A container's runtime may put its own value of
    /// a variable after the Pod's, so this is the sure way.
    #[arg(long = "set-env", value_name = "NAME=VALUE", value_parser = parse_env)]
    pub set_env: Vec<(String, String)>,

    /// Probe as a container holding these CDI devices (`VENDOR/CLASS=NAME`,
    /// as prepare answers them: repeated or comma-separated) would: their
    /// environment, device nodes and `/dev` mounts, in a mount namespace of
    /// the probe's own (needs root). --set-env applies after the devices'
    /// environment.
    #[arg(long, value_name = "VENDOR/CLASS=NAME", value_delimiter = ',')]
    pub cdi_device: Vec<String>,

    /// Where --cdi-device's spec is: a directory only root can write, as
    /// its spec files must be.
    #[arg(long, default_value = container::DEFAULT_CDI_DIR)]
    pub cdi_dir: std::path::PathBuf,

    /// Root of the NVIDIA driver installation, as `tessera plugin` has it:
    /// the `libcuda.so.1` a --cdi-device's spec mounts is loaded only if it
    /// is this driver's.
    #[arg(long, env = "TESSERA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: std::path::PathBuf,

    /// Leave the GPUs' own device nodes (`/dev/nvidia<N>`) out of
    /// --cdi-device's container, keeping `/dev/nvidiactl`, `/dev/nvidia-uvm`
    /// and the rest: whether a process gets a GPU without its node.
    #[arg(long, requires = "cdi_device")]
    pub withhold_gpu_nodes: bool,

    /// Bind this file on `/etc/hosts` in --cdi-device's container, as the
    /// kubelet binds a Pod's `<kubelet dir>/pods/<pod UID>/etc-hosts`: the
    /// node process then counts the probe as that Pod's process (metrics,
    /// claim guard).
    #[arg(long, value_name = "FILE", requires = "cdi_device")]
    pub pod_hosts_file: Option<std::path::PathBuf>,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, value))
            if !name.is_empty() && !name.contains('\0') && !value.contains('\0') =>
        {
            Ok((name.to_owned(), value.to_owned()))
        }
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    match tessera_api::config::Quantity::parse(s)
        .map_err(|e| e.to_string())?
        .bytes()
    {
        0 => Err("must be more than 0 bytes".into()),
        n => Ok(n),
    }
}

/// `tessera probe`: prints the report as JSON; exit 1 unless it succeeded.
pub fn main(args: &ProbeArgs) -> anyhow::Result<ExitCode> {
    let mut entered = None;
    if !args.cdi_device.is_empty() {
        let edits = container::find_all(&args.cdi_dir, &args.cdi_device)?;
        let shape = container::Shape {
            withhold_gpu_nodes: args.withhold_gpu_nodes,
            pod_hosts: args.pod_hosts_file.clone(),
            driver_root: args.driver_root.clone(),
        };
        entered = Some(container::enter(&edits, &shape)?);
    }
    for (name, value) in &args.set_env {
        // SAFETY: `tessera probe` runs on the main thread only and has not
        // started any other; nothing reads the environment concurrently.
        unsafe { std::env::set_var(name, value) };
    }
    let (container, spec_library) = entered.unzip();
    let library = (args.library.clone())
        .or(spec_library.flatten().map(Into::into))
        .unwrap_or_else(|| DEFAULT_LIBRARY.into());
    let mut report =
        tessera_driver::probe::probe(&library, args.alloc, args.busy.map(Duration::from_secs));
    report.container = container;
    write_stdout(
        &(serde_json::to_string_pretty(&report).context("encoding the probe report")? + "\n"),
    )?;
    Ok(if report.succeeded() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_takes_bytes_and_quantities() {
        assert_eq!(parse_bytes("8Gi"), Ok(8 << 30));
        assert_eq!(parse_bytes("1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes("500M"), Ok(500_000_000));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("8GB").is_err());
        assert!(parse_bytes("-1").is_err());
    }
}
