//! `tessera health`: the kubelet's exec probes (the image has no shell).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tessera_driver::node::readiness;

/// `tessera health`: asks a running node process over its probe socket.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// The node process's `--health-socket`.
    #[arg(long, env = "TESSERA_HEALTH_SOCKET")]
    pub socket: PathBuf,

    /// What to ask: `readiness` (ready to serve, or in standby ready to
    /// take over), `liveness` (the process answers) or `status`
    /// (registered with the kubelet and slices published).
    #[arg(long, value_enum, default_value_t = Probe::Readiness)]
    pub probe: Probe,

    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 5)]
    pub timeout_seconds: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Probe {
    Readiness,
    Liveness,
    /// Where the process stands, as JSON (phase, readiness, registered with
    /// the kubelet, slices published); passes once it serves.
    Status,
}

impl Probe {
    fn path(self) -> &'static str {
        match self {
            Probe::Readiness => "/readyz",
            Probe::Liveness => "/livez",
            Probe::Status => "/status",
        }
    }
}

/// Prints the answer; exit 0 when the probe passes, 1 when not (or no
/// process answers).
pub fn main(args: &HealthArgs) -> anyhow::Result<ExitCode> {
    let timeout = Duration::from_secs(args.timeout_seconds.max(1));
    let (status, body) = readiness::ask(&args.socket, args.probe.path(), timeout)?;
    print!("{body}");
    Ok(if status == 200 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
