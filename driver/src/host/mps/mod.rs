//! MPS (Multi-Process Service) enforcement for `Isolated` shares and MPS
//! configs.
//!
//! - [`MpsSupervisor`]: one `nvidia-cuda-mps-control` daemon per request of
//!   a claim on each device it holds, run by the driver itself (no
//!   Deployment per claim), given the claim's limits as its defaults,
//!   adopted after a driver restart and restarted if it died. A client
//!   container gets its own daemon's pipe directory and nothing else; since
//!   containers can write there, nothing found in it is trusted (see the
//!   `daemon` module for what is trusted and why).
//! - [`HostCgroup`]: where daemons run (`launch` module): each in a mount
//!   view of its own (`view` module: only the driver's files, the GPU's
//!   nodes and its claim's directories; few capabilities; no new
//!   privileges) whose `/dev/shm` is its claim's, and, for a node process
//!   in a container, in a cgroup of the host, so that they outlive it.
//! - [`client_limit_env`]: the same limits as the environment variables the
//!   CUDA driver reads in the client (they can only lower the daemon's).
//!
//! Tests run the supervisor against `fake-mps-control` from
//! `driver/fake-nvml`, which behaves like the real tool's daemon and client
//! modes.

mod config;
mod daemon;
pub mod generation;
mod launch;
mod paths;

mod sharing;
mod supervisor;
mod tmpfs;
mod view;

pub use crate::host::process::{Pidfd, ProcessId};
pub use config::{DEFAULT_CONTROL_BINARY, MpsConfig, MpsError};
pub use daemon::{DaemonKey, MpsDaemon};
pub use launch::{HostCgroup, HostCgroupError};
pub use paths::{CONTROL, LAUNCH_ID_ENV, LAUNCHER_LOG, MAX_PIPE_DIR, PID_FILE, RECORD};
pub use supervisor::{MpsSupervisor, SupervisionReport, Watchdog};
pub use tmpfs::{DirBounds, ShmPolicy};
pub use view::{KEPT as KEPT_CAPABILITIES, kept_mask};
