//! Finding a CDI device's edits in the spec directory, which the probe
//! trusts only if root (or its own user) alone can write it and its specs.

use std::ffi::OsStr;
use std::fs::{File, Metadata};
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::{ContainerError, Edits, MAX_SPEC_BYTES, Result, fd_path, kind_of, open_at};
use crate::cdi::{ContainerEdits, Spec};

/// The edits of CDI devices `qualified`, applied in order as a runtime
/// applies them: a later device node or mount of a path replaces the
/// earlier one (a device listed twice is applied once).
pub fn find_all(dir: &Path, qualified: &[String]) -> Result<Edits> {
    let mut all = Edits {
        device: qualified.join(","),
        edits: ContainerEdits::default(),
    };
    for device in qualified {
        let edits = find(dir, device)?.edits;
        let into = &mut all.edits;
        into.env.extend(edits.env);
        for node in edits.device_nodes {
            into.device_nodes.retain(|n| n.path != node.path);
            into.device_nodes.push(node);
        }
        for mount in edits.mounts {
            into.mounts
                .retain(|m| m.container_path != mount.container_path);
            into.mounts.push(mount);
        }
    }
    Ok(all)
}

/// The edits of CDI device `qualified` (`vendor/class=name`) from the specs
/// in `dir`: the spec's common edits, then the device's own.
pub fn find(dir: &Path, qualified: &str) -> Result<Edits> {
    let Some((kind, name)) = qualified.split_once('=') else {
        return Err(ContainerError::DeviceName {
            qualified: qualified.to_owned(),
        });
    };
    let dir_fd = open_spec_dir(dir)?;
    let read_dir = |source| ContainerError::ReadDir {
        dir: dir.to_owned(),
        source,
    };
    // Listed through the checked descriptor, not the path again.
    let entries = std::fs::read_dir(fd_path(&dir_fd)).map_err(read_dir)?;
    let mut names = entries
        .map(|e| Ok(e?.file_name()))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(read_dir)?;
    names.sort();
    let mut found = Vec::new();
    for file in names {
        if Path::new(&file).extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let path = dir.join(&file);
        let bytes = read_spec(&dir_fd, &file, &path)?;
        // Other drivers' specs may use fields this driver never writes.
        let Ok(spec) = serde_json::from_slice::<Spec>(&bytes) else {
            continue;
        };
        if spec.kind != kind {
            continue;
        }
        for device in spec.devices.iter().filter(|d| d.name == name) {
            let mut edits = spec.container_edits.clone();
            edits.env.extend(device.container_edits.env.iter().cloned());
            edits
                .device_nodes
                .extend(device.container_edits.device_nodes.iter().cloned());
            edits
                .mounts
                .extend(device.container_edits.mounts.iter().cloned());
            found.push((path.clone(), edits));
        }
    }
    match found.len() {
        1 => Ok(Edits {
            device: qualified.to_owned(),
            edits: found.remove(0).1,
        }),
        0 => Err(ContainerError::NoSpec {
            qualified: qualified.to_owned(),
            dir: dir.to_owned(),
        }),
        _ => Err(ContainerError::Ambiguous {
            qualified: qualified.to_owned(),
            dir: dir.to_owned(),
            specs: found.into_iter().map(|(p, _)| p).collect(),
        }),
    }
}

/// The CDI directory, once it is known that only root (or this user) can
/// have put files there.
fn open_spec_dir(dir: &Path) -> Result<OwnedFd> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|source| ContainerError::OpenDir {
            dir: dir.to_owned(),
            source,
        })?;
    let meta = file.metadata()?;
    if let Some(why) = untrusted(&meta) {
        return Err(ContainerError::UntrustedDir {
            dir: dir.to_owned(),
            why,
        });
    }
    Ok(file.into())
}

/// Reads spec `file` of the directory `dir` (at `path`): a regular file
/// only root (or this user) can write, of at most [`MAX_SPEC_BYTES`].
fn read_spec(dir: &OwnedFd, file: &OsStr, path: &Path) -> Result<Vec<u8>> {
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let fd = open_at(dir, file, flags).map_err(|source| ContainerError::OpenSpec {
        path: path.to_owned(),
        source,
    })?;
    let file = File::from(fd);
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(ContainerError::NotRegular {
            path: path.to_owned(),
            kind: kind_of(&meta),
        });
    }
    if let Some(why) = untrusted(&meta) {
        return Err(ContainerError::UntrustedSpec {
            path: path.to_owned(),
            why,
        });
    }
    let too_big = || ContainerError::SpecTooBig {
        path: path.to_owned(),
    };
    if meta.len() > MAX_SPEC_BYTES {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    file.take(MAX_SPEC_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| ContainerError::ReadSpec {
            path: path.to_owned(),
            source,
        })?;
    if bytes.len() as u64 > MAX_SPEC_BYTES {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Why a file (or directory) the probe acts on as root might hold what
/// someone else wrote: not owned by root or this process's user, or
/// writable by its group or others. `None` when neither.
fn untrusted(meta: &Metadata) -> Option<String> {
    // SAFETY: a plain syscall.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != me {
        return Some(format!("owned by uid {}, not root", meta.uid()));
    }
    let mode = meta.mode() & 0o7777;
    (mode & 0o022 != 0).then(|| format!("writable by its group or others (mode {mode:o})"))
}
