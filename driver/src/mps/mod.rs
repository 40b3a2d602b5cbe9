//! MPS (Multi-Process Service) enforcement for `Isolated` shares.
//!
//! - [`MpsSupervisor`]: one `nvidia-cuda-mps-control` daemon per device,
//!   run by the driver itself (no Deployment per claim), reference-counted
//!   by claim, adopted after a driver restart and restarted if it died.
//!   A client container gets the daemon's pipe directory and nothing else;
//!   since containers can write there, the supervisor trusts nothing found
//!   in it (see the `supervisor` module for what is trusted and why).
//! - [`client_limit_env`]: the per-claim limits as the environment
//!   variables the CUDA driver reads in the client container.
//!
//! Tests run the supervisor against `fake-mps-control` from
//! `driver/fake-nvml`, which behaves like the real tool's daemon and client
//! modes.

mod limits;
mod process;
mod sharing;
mod supervisor;

pub use limits::{
    ACTIVE_THREAD_PERCENTAGE, ClientLimits, LOG_DIRECTORY, LimitError, PINNED_DEVICE_MEM_LIMIT,
    PIPE_DIRECTORY, client_limit_env, is_device_uuid,
};
pub use process::ProcessId;
pub use sharing::MpsSharing;
pub use supervisor::{
    CONTROL, DEFAULT_CONTROL_BINARY, LAUNCH_ID_ENV, LAUNCHER_LOG, MpsConfig, MpsDaemon, MpsError,
    MpsSupervisor, PID_FILE, PIPE_MOUNT_OPTIONS, SupervisionReport, Watchdog,
};
