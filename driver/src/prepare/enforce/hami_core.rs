//! HAMi-core as the isolation provider of Isolated shares: what a container
//! gets so that the interception library limits its CUDA processes.
//!
//! HAMi-core is a user-space library (`libvgpu.so`) that sits between a CUDA
//! program and the driver's `libcuda.so` and refuses allocations beyond a
//! memory limit and throttles kernel launches to an SM share. It reads, per
//! CUDA device index `i` as the process enumerates devices:
//!
//! * `CUDA_DEVICE_MEMORY_LIMIT_<i>`: a byte count, optionally with a binary
//!   suffix `k`, `m` or `g` (`10240m`); `0` or an unparsable value means no
//!   limit, so Tessera never writes one;
//! * `CUDA_DEVICE_SM_LIMIT_<i>`: percent of the device's SMs (`0`: none);
//! * `CUDA_DEVICE_MEMORY_SHARED_CACHE`: the file its processes share to add
//!   up their usage against the limit.
//!
//! The library is loaded into every dynamically linked process through
//! `/etc/ld.so.preload` (a file listing it), mounted read-only over the
//! image's own, rather than through `LD_PRELOAD`, which a process can clear
//! for its children.
//!
//! On the host, the node's HAMi-core directory (`--hami-core-dir`) holds
//! `libvgpu.so` and `ld.so.preload`; the preload file must list the library
//! at the path containers see it under ([`CONTAINER_LIBRARY`]). Prepare
//! checks both before it hands a claim out and refuses the claim, naming the
//! file and the fix, when they are not there: a share published as
//! `hami-core` is never prepared with weaker isolation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_api::config::{EffectiveConfig, IsolationLevel, Limits};
use tessera_controller::model::policy::IsolationProvider;

use super::{Device, EnforceError, Enforcer, Request};
use crate::cdi::{ContainerEdits, Mount};
use crate::prepare::resolve::Kind;
use crate::state::records::{DeviceData, LimitsData};

/// The limits HAMi-core enforces for a device: an Isolated share on a GPU
/// whose node policy names `isolationProvider: hami-core`.
pub fn limits(device: &Device) -> Option<Limits> {
    match (&device.resolved.kind, &device.config) {
        (
            Kind::Share {
                provider: Some(IsolationProvider::HamiCore),
                ..
            },
            EffectiveConfig::Share { limits },
        ) => *limits,
        _ => None,
    }
}

/// HAMi-core as an enforcer: nothing on the host (the library enforces
/// inside the container), everything in the container's edits.
pub struct HamiCore;

impl Enforcer for HamiCore {
    /// The library and the preload file, both read-only, and per device
    /// the limits at the CUDA index the container sees it under (its
    /// position in `CUDA_VISIBLE_DEVICES`). Two shares of one GPU in a
    /// request add up at that index.
    fn edits(&self, request: &Request<'_>, edits: &mut ContainerEdits) -> Result<(), EnforceError> {
        let mut at_index: BTreeMap<usize, Limits> = BTreeMap::new();
        for device in &request.devices {
            let Some(l) = limits(device) else {
                continue;
            };
            let index = request
                .visible
                .iter()
                .position(|u| *u == device.resolved.gpu.uuid)
                .expect("every member's GPU is visible");
            if l.shared_memory_bytes.is_some() {
                // HAMi-core runs no daemon with a /dev/shm of its own: the
                // size asked for would be silently ignored.
                return Err(EnforceError::Request {
                    request: request.name.to_owned(),
                    problem: format!(
                        "request {}: sharedMemory is set, but device {} is an Isolated share \
                         enforced by hami-core, which runs no MPS daemon and gives the \
                         containers no /dev/shm of the claim's",
                        request.name, device.resolved.selected.device
                    ),
                    fix: Some("remove sharedMemory from the claim's ShareConfig".into()),
                });
            }
            let at = at_index.entry(index).or_insert(Limits {
                memory_bytes: 0,
                compute_percent: 0,
                shared_memory_bytes: None,
            });
            at.memory_bytes += l.memory_bytes;
            at.compute_percent = (at.compute_percent + l.compute_percent).min(100);
        }
        if at_index.is_empty() {
            return Ok(());
        }
        let refused = |problem: String, fix: String| EnforceError::Request {
            request: request.name.to_owned(),
            problem,
            fix: Some(fix),
        };
        let files = check(&request.layout.hami_core_dir).map_err(|e| refused(e.what, e.fix))?;
        for (index, l) in &at_index {
            let vars = limit_env(*index, l).map_err(|e| {
                refused(
                    format!("request {}: {e}", request.name),
                    "ask for at least 1Mi of memory and 1% of cores".into(),
                )
            })?;
            edits.env.extend(vars);
        }
        edits.env.push(cache_env(request.cdi_name));
        edits.mounts.extend(mounts(&files));
        Ok(())
    }

    fn describe(&self, device: &Device, data: &mut DeviceData) {
        if let Some(l) = limits(device) {
            data.limits = Some(LimitsData::from(&l));
        }
        if let Kind::Share {
            level: IsolationLevel::Isolated,
            provider: Some(IsolationProvider::HamiCore),
            ..
        } = device.resolved.kind
        {
            data.isolation_provider = Some(IsolationProvider::HamiCore.as_str().to_owned());
        }
    }
}

/// The plugin's default `--hami-core-dir` (where HAMi installs the library).
pub const DEFAULT_DIR: &str = "/usr/local/vgpu";
/// The library's file name in the HAMi-core directory.
pub const LIBRARY: &str = "libvgpu.so";
/// The preload file's name in the HAMi-core directory.
pub const PRELOAD: &str = "ld.so.preload";
/// Where containers see the library.
pub const CONTAINER_LIBRARY: &str = "/usr/local/vgpu/libvgpu.so";
/// Where containers see the preload file: the dynamic loader's own list.
pub const CONTAINER_PRELOAD: &str = "/etc/ld.so.preload";

/// The HAMi-core files of this host, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Files {
    pub library: PathBuf,
    pub preload: PathBuf,
}

/// Why the node cannot serve a `hami-core` share, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    pub what: String,
    pub fix: String,
}

const INSTEAD: &str = "or set `isolationProvider: mps` in the node policy for this GPU; \
     Tessera does not prepare a hami-core share with weaker isolation";

/// Checks that `dir` holds the library and a preload file that lists it
/// where containers see it.
pub fn check(dir: &Path) -> Result<Files, Missing> {
    let library = dir.join(LIBRARY);
    let preload = dir.join(PRELOAD);
    match std::fs::metadata(&library) {
        Ok(m) if m.is_file() => {}
        Ok(_) => {
            return Err(Missing {
                what: format!(
                    "the HAMi-core library {} is not a regular file",
                    library.display()
                ),
                fix: format!(
                    "install HAMi-core's {LIBRARY} there (or point the plugin's --hami-core-dir \
                     at the directory that has it), {INSTEAD}"
                ),
            });
        }
        Err(e) => {
            return Err(Missing {
                what: format!(
                    "the HAMi-core library {} cannot be used: {e}",
                    library.display()
                ),
                fix: format!(
                    "install HAMi-core's {LIBRARY} there (or point the plugin's --hami-core-dir \
                     at the directory that has it), {INSTEAD}"
                ),
            });
        }
    }
    let fix_preload = format!(
        "write {} with the single line {CONTAINER_LIBRARY} (the library's path inside \
         containers), {INSTEAD}",
        preload.display()
    );
    let listed = match std::fs::read_to_string(&preload) {
        Ok(text) => text
            .split(|c: char| c.is_whitespace() || c == ':')
            .any(|entry| entry == CONTAINER_LIBRARY),
        Err(e) => {
            return Err(Missing {
                what: format!(
                    "the HAMi-core preload file {} cannot be read: {e}",
                    preload.display()
                ),
                fix: fix_preload,
            });
        }
    };
    if !listed {
        return Err(Missing {
            what: format!(
                "the HAMi-core preload file {} does not list {CONTAINER_LIBRARY}, so the \
                 library would not be loaded",
                preload.display()
            ),
            fix: fix_preload,
        });
    }
    Ok(Files { library, preload })
}

/// The read-only mounts of the library and the preload file.
pub fn mounts(files: &Files) -> Vec<Mount> {
    let ro = |host: &Path, container: &str| Mount {
        host_path: host.to_string_lossy().into_owned(),
        container_path: container.to_owned(),
        options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
        mount_type: None,
    };
    vec![
        ro(&files.library, CONTAINER_LIBRARY),
        ro(&files.preload, CONTAINER_PRELOAD),
    ]
}

/// A limit HAMi-core would read as none.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoLimitError {
    #[error("a memory limit of {bytes} bytes is below 1 MiB, which HAMi-core reads as no limit")]
    Memory { bytes: u64 },
    #[error("a compute limit of 0 % is what HAMi-core reads as no limit")]
    Compute,
}

/// `CUDA_DEVICE_MEMORY_LIMIT_<index>` (whole MiB, rounded down, as `<n>m`)
/// and `CUDA_DEVICE_SM_LIMIT_<index>`. A limit the library would read as
/// "none" (under 1 MiB, 0 %) is an error.
pub fn limit_env(index: usize, limits: &Limits) -> Result<Vec<String>, NoLimitError> {
    let mib = limits.memory_bytes >> 20;
    if mib == 0 {
        return Err(NoLimitError::Memory {
            bytes: limits.memory_bytes,
        });
    }
    if limits.compute_percent == 0 {
        return Err(NoLimitError::Compute);
    }
    Ok(vec![
        format!("CUDA_DEVICE_MEMORY_LIMIT_{index}={mib}m"),
        format!(
            "CUDA_DEVICE_SM_LIMIT_{index}={}",
            limits.compute_percent.min(100)
        ),
    ])
}

/// `CUDA_DEVICE_MEMORY_SHARED_CACHE`: a file in the container's own `/tmp`,
/// named after the CDI device (request and claim), that the container's
/// processes share.
pub fn cache_env(cdi_device: &str) -> String {
    format!("CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/tessera-vgpu-{cdi_device}.cache")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(library: Option<&str>, preload: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        if let Some(l) = library {
            std::fs::write(dir.path().join(LIBRARY), l).unwrap();
        }
        if let Some(p) = preload {
            std::fs::write(dir.path().join(PRELOAD), p).unwrap();
        }
        dir
    }

    #[test]
    fn a_complete_directory_is_mounted_read_only_at_the_loader_paths() {
        let dir = dir_with(Some("elf"), Some("/usr/local/vgpu/libvgpu.so\n"));
        let files = check(dir.path()).unwrap();
        let got: Vec<(String, String)> = mounts(&files)
            .into_iter()
            .map(|m| {
                assert_eq!(m.options, ["ro", "nosuid", "nodev", "bind"]);
                (m.host_path, m.container_path)
            })
            .collect();
        let host = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
        assert_eq!(
            got,
            vec![
                (host(LIBRARY), "/usr/local/vgpu/libvgpu.so".to_owned()),
                (host(PRELOAD), "/etc/ld.so.preload".to_owned()),
            ]
        );
    }

    #[test]
    fn what_is_missing_is_named_with_the_fix() {
        let none = dir_with(None, Some("/usr/local/vgpu/libvgpu.so"));
        let e = check(none.path()).unwrap_err();
        assert!(e.what.contains("libvgpu.so"), "{e:?}");
        assert!(
            e.fix.contains("--hami-core-dir") && e.fix.contains("weaker"),
            "{e:?}"
        );

        let no_preload = dir_with(Some(""), None);
        let e = check(no_preload.path()).unwrap_err();
        assert!(e.what.contains("ld.so.preload"), "{e:?}");
        assert!(e.fix.contains("/usr/local/vgpu/libvgpu.so"), "{e:?}");

        let elsewhere = dir_with(Some(""), Some("/opt/vgpu/libvgpu.so\n"));
        let e = check(elsewhere.path()).unwrap_err();
        assert!(e.what.contains("does not list"), "{e:?}");
    }

    #[test]
    fn limits_are_whole_mebibytes_and_percent_at_the_index() {
        let l = Limits {
            memory_bytes: (10 << 30) + 12345,
            compute_percent: 25,
            shared_memory_bytes: None,
        };
        assert_eq!(
            limit_env(1, &l).unwrap(),
            [
                "CUDA_DEVICE_MEMORY_LIMIT_1=10240m",
                "CUDA_DEVICE_SM_LIMIT_1=25"
            ]
        );
        let tiny = Limits {
            memory_bytes: 1000,
            compute_percent: 10,
            shared_memory_bytes: None,
        };
        let e = limit_env(0, &tiny).unwrap_err();
        assert!(matches!(e, NoLimitError::Memory { .. }), "{e:?}");
        assert!(e.to_string().contains("no limit"), "{e}");
    }
}
