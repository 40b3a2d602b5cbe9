//! GPU discovery: NVML -> [`Inventory`].
//!
//! Everything goes through nvml-wrapper, so the same code runs against NVIDIA's
//! `libnvidia-ml.so.1` and the simulated one in `driver/fake-nvml`. The raw
//! bindings are used only where the wrapper lacks a call (see [`raw`]).
//!
//! Failure model: NVML missing or failing to initialize, or a machine-wide
//! query failing, is an [`Error`] (nothing can be discovered). A GPU whose own
//! queries fail is reported as a [`GpuError`] naming it, and the other GPUs
//! are still discovered. A GPU without MIG support is not a failure: it is
//! [`Mig::NotSupported`].

mod nvml_names;
mod raw;

use std::ffi::OsStr;
use std::fmt;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings as sys;
use tessera_api::inventory::{Gpu, Inventory, Mig, MigEngines, MigInstance, MigProfile};

/// The library nvml-wrapper loads by default.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

const MIB: u64 = 1024 * 1024;

/// Nothing could be discovered.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "cannot load the NVML library {library}: {reason}. Is the NVIDIA driver installed, and is \
         its library on the loader path (ld.so.conf, LD_LIBRARY_PATH) or given with --nvml-library?"
    )]
    LibraryNotFound { library: String, reason: String },
    // The NVML error is part of the message, not a `source`, so that
    // printing the chain (`{:#}`) does not repeat it.
    #[error("NVML ({library}) failed to initialize: {error}{}", init_hint(.error))]
    Init { library: String, error: NvmlError },
    #[error("NVML: {what} failed: {error}")]
    System {
        what: &'static str,
        error: NvmlError,
    },
}

fn init_hint(e: &NvmlError) -> &'static str {
    match e {
        NvmlError::DriverNotLoaded => " (is the nvidia kernel module loaded?)",
        NvmlError::NoPermission => " (the process may not open /dev/nvidia*)",
        NvmlError::LibRmVersionMismatch => {
            " (the library and the kernel module come from different driver versions)"
        }
        _ => "",
    }
}

/// One GPU could not be discovered.
#[derive(Debug, thiserror::Error)]
pub struct GpuError {
    /// NVML index of the GPU.
    pub index: u32,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
    /// What was being done, e.g. `reading its memory info`.
    pub what: String,
    /// Part of the message (not a `source`, which would print it twice).
    pub error: NvmlError,
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU {}", self.index)?;
        match (&self.uuid, &self.pci_bus_id) {
            (Some(u), Some(p)) => write!(f, " ({u}, {p})")?,
            (Some(u), None) => write!(f, " ({u})")?,
            (None, Some(p)) => write!(f, " ({p})")?,
            (None, None) => {}
        }
        write!(f, ": {} failed: {}", self.what, self.error)
    }
}

/// What discovery found.
#[derive(Debug)]
pub struct Discovery {
    /// The GPUs that could be discovered, in NVML order.
    pub inventory: Inventory,
    /// The GPUs that could not.
    pub failed: Vec<GpuError>,
}

/// Loads and initializes NVML: from `library` (a path or a soname) or, by
/// default, `libnvidia-ml.so.1` through the dynamic loader.
pub fn init(library: Option<&OsStr>) -> Result<Nvml, Error> {
    let name = library.unwrap_or(OsStr::new(DEFAULT_LIBRARY));
    let mut builder = Nvml::builder();
    builder.lib_path(name);
    let shown = name.to_string_lossy().into_owned();
    builder.init().map_err(|e| match e {
        NvmlError::LibloadingError(e) => Error::LibraryNotFound {
            library: shown,
            reason: e.to_string(),
        },
        NvmlError::FailedToLoadSymbol(e) => Error::LibraryNotFound {
            library: shown,
            reason: format!("it is not an NVML library ({e})"),
        },
        error => Error::Init {
            library: shown,
            error,
        },
    })
}

/// Discovers every GPU NVML reports.
pub fn discover(nvml: &Nvml) -> Result<Discovery, Error> {
    let system = |what| move |error| Error::System { what, error };
    let driver_version = nvml
        .sys_driver_version()
        .map_err(system("reading the driver version"))?;
    let cuda = nvml
        .sys_cuda_driver_version()
        .map_err(system("reading the CUDA driver version"))?;
    let count = nvml.device_count().map_err(system("counting GPUs"))?;
    let mut gpus = Vec::new();
    let mut failed = Vec::new();
    for index in 0..count {
        match discover_gpu(nvml, index) {
            Ok(gpu) => gpus.push(gpu),
            Err(e) => failed.push(e),
        }
    }
    Ok(Discovery {
        inventory: Inventory {
            driver_version,
            cuda_driver_version: nvml_names::cuda_version(cuda),
            gpus,
        },
        failed,
    })
}

/// Names the GPU in errors with whatever is known of it so far.
struct Context {
    index: u32,
    uuid: Option<String>,
    pci_bus_id: Option<String>,
}

impl Context {
    fn fail(&self, what: impl Into<String>) -> impl FnOnce(NvmlError) -> GpuError + '_ {
        let what = what.into();
        move |error| GpuError {
            index: self.index,
            uuid: self.uuid.clone(),
            pci_bus_id: self.pci_bus_id.clone(),
            what,
            error,
        }
    }
}

fn discover_gpu(nvml: &Nvml, index: u32) -> Result<Gpu, GpuError> {
    let mut cx = Context {
        index,
        uuid: None,
        pci_bus_id: None,
    };
    let device = nvml
        .device_by_index(index)
        .map_err(cx.fail("getting its handle"))?;
    let uuid = device.uuid().map_err(cx.fail("reading its UUID"))?;
    cx.uuid = Some(uuid.clone());
    let pci = device.pci_info().map_err(cx.fail("reading its PCI info"))?;
    let pci_bus_id = nvml_names::pci_bus_id(pci.domain, pci.bus, pci.device);
    cx.pci_bus_id = Some(pci_bus_id.clone());

    let product_name = device.name().map_err(cx.fail("reading its name"))?;
    let brand = match device.brand() {
        Ok(b) => nvml_names::brand(b),
        Err(NvmlError::UnexpectedVariant(_)) => "unknown",
        Err(e) => return Err(cx.fail("reading its brand")(e)),
    };
    let architecture = match device.architecture() {
        Ok(a) => nvml_names::architecture(a),
        Err(NvmlError::UnexpectedVariant(_)) => "unknown",
        Err(e) => return Err(cx.fail("reading its architecture")(e)),
    };
    let cc = device
        .cuda_compute_capability()
        .map_err(cx.fail("reading its CUDA compute capability"))?;
    let memory_bytes = device
        .memory_info()
        .map_err(cx.fail("reading its memory info"))?
        .total;
    let minor = device
        .minor_number()
        .map_err(cx.fail("reading its minor number"))?;
    let multiprocessors = multiprocessors(&device, cc.major, cc.minor, &cx)?;
    let mig = discover_mig(nvml, &device, memory_bytes / MIB, &cx)?;

    Ok(Gpu {
        uuid,
        product_name,
        brand: brand.to_string(),
        architecture: architecture.to_string(),
        cuda_compute_capability: format!("{}.{}", cc.major, cc.minor),
        pci_bus_id,
        memory_bytes,
        multiprocessors,
        minor,
        mig,
    })
}

/// SM count of a whole GPU. NVML reports CUDA cores for a physical GPU
/// (device attributes, which carry the SM count, are answered for MIG
/// devices only), so divide by the cores per SM of its compute capability;
/// fall back to the attributes where that is unknown.
fn multiprocessors(device: &Device, major: i32, minor: i32, cx: &Context) -> Result<u32, GpuError> {
    match (
        device.num_cores(),
        nvml_names::cores_per_multiprocessor(major, minor),
    ) {
        (Ok(cores), Some(per_sm)) if cores > 0 => return Ok(cores / per_sm),
        (Ok(_) | Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)), _) => {}
        (Err(e), _) => return Err(cx.fail("reading its CUDA core count")(e)),
    }
    device
        .attributes()
        .map(|a| a.multiprocessor_count)
        .map_err(cx.fail(format!(
            "determining its multiprocessor count (no core count or cores-per-SM for compute capability {major}.{minor})"
        )))
}

fn discover_mig(
    nvml: &Nvml,
    device: &Device,
    memory_mib: u64,
    cx: &Context,
) -> Result<Mig, GpuError> {
    let mode = match device.mig_mode() {
        Ok(mode) => mode,
        // No MIG on this GPU (T4, L4, ...), or a driver too old to know MIG.
        Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
            return Ok(Mig::NotSupported);
        }
        Err(e) => return Err(cx.fail("reading its MIG mode")(e)),
    };
    let profiles = discover_profiles(nvml, device, memory_mib, cx)?;
    if mode.current != sys::NVML_DEVICE_MIG_ENABLE {
        return Ok(Mig::Disabled { profiles });
    }
    let instances = discover_instances(nvml, device, &profiles, memory_mib, cx)?;
    Ok(Mig::Enabled {
        profiles,
        instances,
    })
}

fn discover_profiles(
    nvml: &Nvml,
    device: &Device,
    memory_mib: u64,
    cx: &Context,
) -> Result<Vec<MigProfile>, GpuError> {
    let mut profiles: Vec<MigProfile> = Vec::new();
    for index in 0..sys::NVML_GPU_INSTANCE_PROFILE_COUNT {
        let info = match device.profile_info(index) {
            Ok(info) => info,
            // Not offered by this GPU, or an index newer than its driver.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
            Err(e) => return Err(cx.fail(format!("reading MIG profile {index}"))(e)),
        };
        if profiles.iter().any(|p| p.id == info.id) {
            continue;
        }
        let name = raw::profile_name(nvml, device, index)
            .map_err(cx.fail(format!("reading the name of MIG profile {}", info.id)))?
            .unwrap_or_else(|| {
                nvml_names::derive_profile_name(
                    Some(index),
                    info.slice_count,
                    info.memory_size_mb,
                    memory_mib,
                )
            });
        let placements = raw::possible_placements(nvml, device, info.id)
            .map_err(cx.fail(format!("reading the placements of MIG profile {name}")))?;
        profiles.push(MigProfile {
            id: info.id,
            name,
            slices: info.slice_count,
            memory_bytes: info.memory_size_mb * MIB,
            multiprocessors: info.multiprocessor_count,
            engines: MigEngines {
                copy_engines: info.copy_engine_count,
                decoders: info.decoder_count,
                encoders: info.encoder_count,
                jpeg_engines: info.jpeg_count,
                ofa_engines: info.ofa_count,
            },
            max_instances: info.instance_count,
            placements,
        });
    }
    Ok(profiles)
}

fn discover_instances(
    nvml: &Nvml,
    device: &Device,
    profiles: &[MigProfile],
    memory_mib: u64,
    cx: &Context,
) -> Result<Vec<MigInstance>, GpuError> {
    let max = device
        .mig_device_count()
        .map_err(cx.fail("reading its maximum MIG device count"))?;
    let mut instances = Vec::new();
    for index in 0..max {
        let mig = match device.mig_device_by_index(index) {
            Ok(mig) => mig,
            Err(NvmlError::NotFound) => continue,
            Err(e) => return Err(cx.fail(format!("getting MIG device {index}"))(e)),
        };
        let uuid = mig
            .uuid()
            .map_err(cx.fail(format!("reading the UUID of MIG device {index}")))?;
        let of = |what: &str| format!("{what} of MIG device {index} ({uuid})");
        let attrs = mig
            .attributes()
            .map_err(cx.fail(of("reading the attributes")))?;
        let (gpu_instance_id, compute_instance_id) = raw::instance_ids(nvml, &mig)
            .map_err(cx.fail(of("reading the GPU/compute instance ids")))?;
        let (profile_id, placement) = raw::gpu_instance(nvml, device, gpu_instance_id)
            .map_err(cx.fail(of(&format!("reading GPU instance {gpu_instance_id}"))))?;
        let gpu_instance_profile = profiles
            .iter()
            .find(|p| p.id == profile_id)
            .map(|p| p.name.clone())
            .unwrap_or_else(|| {
                nvml_names::derive_profile_name(
                    None,
                    attrs.gpu_instance_slice_count,
                    attrs.memory_size_mb,
                    memory_mib,
                )
            });
        instances.push(MigInstance {
            uuid,
            profile: nvml_names::compute_instance_name(
                attrs.compute_instance_slice_count,
                attrs.gpu_instance_slice_count,
                &gpu_instance_profile,
            ),
            profile_id,
            gpu_instance_id,
            compute_instance_id,
            placement,
            memory_bytes: attrs.memory_size_mb * MIB,
            multiprocessors: attrs.multiprocessor_count,
            engines: MigEngines {
                copy_engines: attrs.shared_copy_engine_count,
                decoders: attrs.shared_decoder_count,
                encoders: attrs.shared_encoder_count,
                jpeg_engines: attrs.shared_jpeg_count,
                ofa_engines: attrs.shared_ofa_count,
            },
        });
    }
    // Stable, readable order: by where they sit on the GPU.
    instances.sort_by_key(|i| (i.placement.start, i.gpu_instance_id, i.compute_instance_id));
    Ok(instances)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_errors_name_the_gpu_with_what_is_known() {
        let e = |uuid: Option<&str>, pci: Option<&str>| GpuError {
            index: 3,
            uuid: uuid.map(Into::into),
            pci_bus_id: pci.map(Into::into),
            what: "reading its name".into(),
            error: NvmlError::GpuLost,
        };
        assert_eq!(
            e(Some("GPU-1"), Some("0000:1b:00.0")).to_string(),
            "GPU 3 (GPU-1, 0000:1b:00.0): reading its name failed: \
             device fell off the bus or has otherwise become inacessible"
        );
        assert!(
            e(None, None)
                .to_string()
                .starts_with("GPU 3: reading its name failed")
        );
    }
}
