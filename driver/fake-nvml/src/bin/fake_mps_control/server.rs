//! The simulated MPS server a daemon starts for its first client.

use std::path::PathBuf;

use tessera_fake_nvml::load;

use crate::devices;

const SERVER_CONTEXT_ENV: &str = "TESSERA_FAKE_MPS_SERVER_CONTEXT_MIB";

/// GPU memory the simulated MPS server's context takes on each device it
/// serves, in MiB: below the node policy's default reserve per server
/// (`mpsServerReserveMiB`, 64), as a real server's must be for Isolated
/// claims to get what the scheduler promised.
pub const SERVER_CONTEXT_MIB: u64 = 48;

/// The simulated MPS server: its context's memory on the daemon's devices,
/// held in this process's load record from the first client on (the
/// record goes with the process, as a server's context goes with it).
pub struct Server {
    devices: Vec<String>,
    context_bytes: u64,
    channel: Option<load::Channel>,
    /// Where the simulated module's files are, if this is a simulated
    /// machine, and the `/dev` whose nodes the server opens.
    driver_root: Option<PathBuf>,
    dev: PathBuf,
}

impl Server {
    /// The server the daemon would start for `devices` (its
    /// `CUDA_VISIBLE_DEVICES` entries; only UUIDs name a device without
    /// asking NVML).
    pub fn new(devices: Option<&[String]>) -> Server {
        let mib = std::env::var(SERVER_CONTEXT_ENV)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(SERVER_CONTEXT_MIB);
        Server {
            devices: devices
                .unwrap_or_default()
                .iter()
                .filter(|d| d.starts_with("GPU-") || d.starts_with("MIG-"))
                .cloned()
                .collect(),
            context_bytes: mib << 20,
            channel: None,
            driver_root: crate::env_path(tessera_fake_nvml::DRIVER_ROOT_ENV),
            dev: crate::env_dir(tessera_fake_nvml::DEV_ROOT_ENV, "/dev"),
        }
    }

    /// Starts the server at a client: from the first one on, its context
    /// is charged to each device. Returns what to log, the first time
    /// only; an error when the server cannot open its devices here (a view
    /// without their nodes), for every client until it can.
    pub fn start(&mut self) -> Result<Option<String>, String> {
        let driver_root = self.driver_root.as_deref();
        if let Some(why) = devices::unusable(&self.devices, driver_root, &self.dev) {
            return Err(why);
        }
        if self.channel.is_some() || !load::enabled_from_env() || self.devices.is_empty() {
            return Ok(None);
        }
        let Some(base) = load::Record::for_this_process() else {
            return Ok(None);
        };
        let record = load::Record {
            devices: self
                .devices
                .iter()
                .map(|uuid| load::DeviceLoad {
                    uuid: uuid.clone(),
                    memory_bytes: self.context_bytes,
                    busy_until_ms: 0,
                    sm_percent: 0,
                    mps_client: false,
                })
                .collect(),
            ..base
        };
        let Ok(channel) = load::Channel::open() else {
            return Ok(None);
        };
        let logged = match channel.publish(&record) {
            Ok(()) => format!(
                "Server started: context {} MiB on {}",
                self.context_bytes >> 20,
                self.devices.join(",")
            ),
            Err(e) => format!("Server started; recording its context failed: {e}"),
        };
        self.channel = Some(channel);
        Ok(Some(logged))
    }
}
