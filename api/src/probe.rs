//! What `tessera probe` reports: what a CUDA process really gets (devices,
//! SMs, memory, whether an allocation fits) and the environment it ran
//! with. The probe writes it; the conformance checks and the GPU self-test
//! read it.

use std::ffi::OsString;

use serde::{Deserialize, Serialize};

/// The environment variables that decide what a CUDA process gets.
pub const VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
pub const MPS_PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";
pub const MPS_ACTIVE_THREAD_PERCENTAGE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
pub const MPS_PINNED_DEVICE_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

/// What the probe found: the JSON it prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeReport {
    /// The library as given (`--library`).
    pub library: String,
    /// `cuDriverGetVersion`: `1000 * major + 10 * minor` (12080 is 12.8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_driver_version: Option<i32>,
    /// The MPS-relevant environment the probe ran with.
    pub environment: ProbeEnvironment,
    /// With `--cdi-device`: the container the probe made for itself from
    /// that device's CDI edits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ProbeContainer>,
    /// The devices it enumerated, in CUDA ordinal order.
    #[serde(default)]
    pub devices: Vec<ProbeDevice>,
    /// Why it could not probe at all: `<call or library>: <reason>`, e.g.
    /// `cuInit: CUDA_ERROR_NO_DEVICE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The environment variables a CUDA process reads for device selection and
/// MPS, by their names; `null` when unset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeEnvironment {
    #[serde(rename = "CUDA_VISIBLE_DEVICES", default)]
    pub cuda_visible_devices: Option<String>,
    #[serde(rename = "CUDA_MPS_PIPE_DIRECTORY", default)]
    pub cuda_mps_pipe_directory: Option<String>,
    #[serde(rename = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", default)]
    pub cuda_mps_active_thread_percentage: Option<String>,
    #[serde(rename = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", default)]
    pub cuda_mps_pinned_device_mem_limit: Option<String>,
}

impl ProbeEnvironment {
    /// This process's.
    pub fn current() -> ProbeEnvironment {
        let var = |name| std::env::var_os(name).map(|v: OsString| v.to_string_lossy().into_owned());
        ProbeEnvironment {
            cuda_visible_devices: var(VISIBLE_DEVICES),
            cuda_mps_pipe_directory: var(MPS_PIPE_DIRECTORY),
            cuda_mps_active_thread_percentage: var(MPS_ACTIVE_THREAD_PERCENTAGE),
            cuda_mps_pinned_device_mem_limit: var(MPS_PINNED_DEVICE_MEM_LIMIT),
        }
    }
}

/// What `--cdi-device` applied: the edits that decide what a CUDA process
/// gets (environment, device nodes, mounts under `/dev`), and the mounts it
/// left to the host's own files (the driver's libraries and tools).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeContainer {
    /// The qualified CDI device name (`vendor/class=name`).
    pub cdi_device: String,
    /// Names of the variables the edits set.
    pub env: Vec<String>,
    /// Device nodes in the probe's own `/dev` (beside null, zero, full,
    /// random, urandom and tty).
    pub device_nodes: Vec<String>,
    /// Mounts made (container paths).
    pub mounts: Vec<String>,
    /// Mounts not made: their container path is not under `/dev`, and the
    /// host's file at that path (or, for `libcuda.so.1`, the one the spec
    /// names) is used instead.
    pub from_host: Vec<String>,
}

/// One device as this process gets it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeDevice {
    /// The CUDA ordinal.
    pub ordinal: i32,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` as `nvidia-smi` prints it
    /// (`cuDeviceGetUuid_v2`); `MIG-...` for a MIG device (when its UUID
    /// differs from its GPU's).
    pub uuid: String,
    /// The physical GPU's UUID (`cuDeviceGetUuid`); the same as `uuid` for
    /// a whole GPU.
    pub gpu_uuid: String,
    pub name: String,
    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`: the SMs this process may
    /// use (an MPS client's share).
    pub multiprocessors: i32,
    /// `cuDeviceTotalMem_v2`.
    pub memory_total_bytes: u64,
    /// `cuMemGetInfo_v2`'s free memory under this process's context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_free_bytes: Option<u64>,
    /// The `--alloc` attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation: Option<ProbeAllocation>,
    /// With `--busy`: the spin kernels run on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<u64>,
    /// A call on this device that failed: `<call>: <CUDA error name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Whether allocating `bytes` on a device succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeAllocation {
    pub bytes: u64,
    pub ok: bool,
    /// The CUDA error name when it did not (`CUDA_ERROR_OUT_OF_MEMORY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ProbeReport {
    /// Whether everything the probe asked worked (a refused allocation is
    /// an answer, not a failure).
    pub fn succeeded(&self) -> bool {
        self.error.is_none() && self.devices.iter().all(|d| d.error.is_none())
    }
}
