//! Names for what NVML reports as numbers: MIG profiles, brands,
//! architectures, PCI addresses, versions.

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper_sys::bindings as sys;

/// A MIG profile name as NVML gives it (`MIG 1g.10gb+me`), without the
/// `MIG ` prefix. `None` for an empty name.
pub fn from_nvml(name: &str) -> Option<String> {
    let name = name.trim();
    let name = name
        .strip_prefix("MIG")
        .filter(|rest| rest.is_empty() || rest.starts_with(char::is_whitespace))
        .unwrap_or(name)
        .trim();
    (!name.is_empty()).then(|| name.to_string())
}

/// The standard name of a GPU instance profile when NVML does not give one
/// (drivers before the versioned profile-info call): `<slices>g.<GB>gb` plus
/// the variant suffix of its `NVML_GPU_INSTANCE_PROFILE_*` index. The memory
/// is rounded up to the nearest eighth of the GPU's memory (instances get
/// whole memory slices minus some overhead), then up to whole GB (GiB).
pub fn derive_profile_name(
    index: Option<u32>,
    slices: u32,
    memory_mib: u64,
    gpu_memory_mib: u64,
) -> String {
    let suffix = index.map_or("", variant_suffix);
    format!(
        "{slices}g.{}gb{suffix}",
        nominal_gb(memory_mib, gpu_memory_mib)
    )
}

/// A partial compute instance inside a GPU instance: `1c.3g.20gb`.
pub fn compute_instance_name(
    compute_slices: u32,
    gpu_instance_slices: u32,
    profile: &str,
) -> String {
    if compute_slices > 0 && compute_slices < gpu_instance_slices {
        format!("{compute_slices}c.{profile}")
    } else {
        profile.to_string()
    }
}

fn variant_suffix(index: u32) -> &'static str {
    match index {
        sys::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
        | sys::NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 => "+me",
        sys::NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX
        | sys::NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX
        | sys::NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX => "+gfx",
        sys::NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME
        | sys::NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME => "-me",
        sys::NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME
        | sys::NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME => "+me.all",
        _ => "",
    }
}

fn nominal_gb(memory_mib: u64, gpu_memory_mib: u64) -> u64 {
    let rounded_mib = if gpu_memory_mib == 0 {
        memory_mib
    } else {
        let eighths = (memory_mib * 8).div_ceil(gpu_memory_mib).clamp(1, 8);
        (eighths * gpu_memory_mib).div_ceil(8)
    };
    rounded_mib.div_ceil(1024)
}

/// Lower-case brand, as Tessera publishes it.
pub fn brand(brand: Brand) -> &'static str {
    match brand {
        Brand::Unknown => "unknown",
        Brand::Quadro => "quadro",
        Brand::Tesla => "tesla",
        Brand::NVS => "nvs",
        Brand::GRID => "grid",
        Brand::GeForce => "geforce",
        Brand::Titan => "titan",
        Brand::VApps => "nvidia-vapps",
        Brand::VPC => "nvidia-vpc",
        Brand::VCS => "nvidia-vcs",
        Brand::VWS => "nvidia-vws",
        Brand::CloudGaming | Brand::VGaming => "nvidia-cloud-gaming",
        Brand::QuadroRTX => "quadro-rtx",
        Brand::NvidiaRTX => "nvidia-rtx",
        Brand::Nvidia => "nvidia",
        Brand::GeForceRTX => "geforce-rtx",
        Brand::TitanRTX => "titan-rtx",
    }
}

/// Lower-case architecture, as Tessera publishes it.
pub fn architecture(arch: DeviceArchitecture) -> &'static str {
    match arch {
        DeviceArchitecture::Kepler => "kepler",
        DeviceArchitecture::Maxwell => "maxwell",
        DeviceArchitecture::Pascal => "pascal",
        DeviceArchitecture::Volta => "volta",
        DeviceArchitecture::Turing => "turing",
        DeviceArchitecture::Ampere => "ampere",
        DeviceArchitecture::Ada => "ada",
        DeviceArchitecture::Hopper => "hopper",
        DeviceArchitecture::Blackwell => "blackwell",
        DeviceArchitecture::Unknown => "unknown",
    }
}

/// The kernel's (sysfs) form of a PCI address, which is what the
/// `resource.kubernetes.io/pciBusID` attribute takes: lower case, 4-digit
/// domain (wider only if the domain needs it), e.g. `0000:1b:00.0`. NVML
/// reports an 8-digit upper-case domain; its fields are used, not its string.
pub fn pci_bus_id(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.0")
}

/// `12040` -> `12.4`.
pub fn cuda_version(version: i32) -> String {
    format!(
        "{}.{}",
        nvml_wrapper::cuda_driver_version_major(version),
        nvml_wrapper::cuda_driver_version_minor(version)
    )
}

/// CUDA cores per streaming multiprocessor for a compute capability. NVML
/// reports a whole GPU's CUDA cores, not its SMs; MIG devices report SMs
/// directly.
pub fn cores_per_multiprocessor(major: i32, minor: i32) -> Option<u32> {
    Some(match (major, minor) {
        (3, _) => 192,
        (5, _) => 128,
        (6, 0) => 64,
        (6, _) => 128,
        (7, _) => 64,
        (8, 0) => 64,
        (8, _) => 128,
        (9, 0) => 128,
        (10, _) | (11, _) | (12, _) => 128,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_names_lose_their_prefix() {
        assert_eq!(from_nvml("MIG 1g.10gb+me").as_deref(), Some("1g.10gb+me"));
        assert_eq!(from_nvml("3g.40gb").as_deref(), Some("3g.40gb"));
        assert_eq!(from_nvml("MIG "), None);
    }

    #[test]
    fn derived_names_match_nvidias_for_a100_and_h100() {
        let a100 = 40960;
        let h100 = 81559;
        let cases = [
            (Some(0), 1, 4864, a100, "1g.5gb"),
            (Some(7), 1, 4864, a100, "1g.5gb+me"),
            (Some(9), 1, 9856, a100, "1g.10gb"),
            (Some(1), 2, 9856, a100, "2g.10gb"),
            (Some(2), 3, 19968, a100, "3g.20gb"),
            (Some(3), 4, 19968, a100, "4g.20gb"),
            (Some(4), 7, 40192, a100, "7g.40gb"),
            (Some(0), 1, 9984, h100, "1g.10gb"),
            (Some(9), 1, 20096, h100, "1g.20gb"),
            (Some(2), 3, 40448, h100, "3g.40gb"),
            (Some(4), 7, 81152, h100, "7g.80gb"),
            (Some(8), 2, 12032, 24576, "2g.12gb+me"),
            (None, 2, 20096, h100, "2g.20gb"),
        ];
        for (index, slices, mib, gpu, want) in cases {
            assert_eq!(
                derive_profile_name(index, slices, mib, gpu),
                want,
                "{slices} slices, {mib} MiB"
            );
        }
    }

    #[test]
    fn partial_compute_instances_are_prefixed() {
        assert_eq!(compute_instance_name(1, 3, "3g.20gb"), "1c.3g.20gb");
        assert_eq!(compute_instance_name(3, 3, "3g.20gb"), "3g.20gb");
    }

    #[test]
    fn pci_ids_take_the_kernel_form() {
        assert_eq!(pci_bus_id(0, 0x1b, 0), "0000:1b:00.0");
        assert_eq!(pci_bus_id(0x10000, 0x3, 0x1f), "10000:03:1f.0");
    }

    #[test]
    fn cuda_versions_are_major_minor() {
        assert_eq!(cuda_version(12040), "12.4");
        assert_eq!(cuda_version(11080), "11.8");
        assert_eq!(cuda_version(13000), "13.0");
    }

    #[test]
    fn sm_counts_follow_from_core_counts() {
        for (cores, (major, minor), sms) in [
            (2560, (7, 5), 40),
            (7424, (8, 9), 58),
            (6912, (8, 0), 108),
            (16896, (9, 0), 132),
        ] {
            assert_eq!(cores / cores_per_multiprocessor(major, minor).unwrap(), sms);
        }
        assert_eq!(cores_per_multiprocessor(42, 0), None);
    }
}
