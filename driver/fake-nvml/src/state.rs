//! Machine-wide run-time state: the state file and its lock.
//!
//! On a real GPU, MIG mode, GPU and compute instances and the compute mode
//! belong to the hardware: every process sees what any process changed. The
//! simulated machine keeps them in a JSON state file shared by every process
//! that loads the library with the same path (`TESSERA_FAKE_NVML_STATE`, by
//! default `<topology>.state`). Static facts (names, memory, PCI, profiles)
//! come from the topology and are loaded once per process.
//!
//! Every call that reads or changes run-time state goes through
//! [`Store::sync`]: it takes an exclusive `flock` on `<state>.lock` (the state
//! file itself is replaced by renames, so it cannot carry the lock), re-reads
//! the file and parses it only if its bytes differ from what this process saw
//! last, runs the call on the process's [`Machine`], and (for calls that may
//! change state) writes the new state back atomically (temporary file +
//! rename, under the lock) only if it differs. A missing file is seeded from
//! the topology; a file that cannot be parsed, has another version or
//! describes other GPUs is an error naming the file, never silently replaced.
//!
//! A container sees the state file read-only (like the kernel's `/proc`):
//! when the lock file cannot be opened for writing, the lock is taken
//! shared on a read-only descriptor (or not at all if there is no lock file
//! to open; renames keep every read whole), reads work, and a call that
//! would change the state answers NO_PERMISSION with a line on stderr.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

mod stamp;

use crate::caps;
use crate::codes::*;
use crate::machine::placements::compute_profile_slices;
use crate::machine::{ComputeInstance, Gpu, GpuInstance, Machine, MigState};
use crate::topology::{MigMode, Profile};

/// Version of the state file format this library reads and writes.
pub const STATE_VERSION: u32 = 1;

/// The state file's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct State {
    /// [`STATE_VERSION`].
    pub version: u32,
    /// Compute instances created so far on this machine; makes every created
    /// MIG device's UUID unique.
    pub created: u64,
    /// Where the MIG capability files are kept, if anywhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_root: Option<PathBuf>,
    /// One entry per GPU, in NVML index order.
    pub gpus: Vec<GpuState>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuState {
    /// The GPU's UUID, to tell a state file of another machine.
    pub uuid: String,
    pub compute_mode: ComputeMode,
    /// The compute time slice, 0 (default) to 3 (long); absent (0) in files
    /// written before it was kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub time_slice: u32,
    /// Present exactly for MIG-capable GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigRunState>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigRunState {
    pub current: MigMode,
    pub pending: MigMode,
    pub gpu_instances: Vec<GpuInstanceState>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuInstanceState {
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    pub compute_instances: Vec<ComputeInstanceState>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ComputeInstanceState {
    pub id: u32,
    pub profile_id: u32,
    pub slices: u32,
    pub start: u32,
    pub uuid: String,
}

/// `nvmlComputeMode_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ComputeMode {
    #[default]
    Default,
    ExclusiveThread,
    Prohibited,
    ExclusiveProcess,
}

impl ComputeMode {
    pub fn nvml(self) -> u32 {
        match self {
            ComputeMode::Default => 0,
            ComputeMode::ExclusiveThread => 1,
            ComputeMode::Prohibited => 2,
            ComputeMode::ExclusiveProcess => 3,
        }
    }

    pub fn from_nvml(mode: u32) -> Option<ComputeMode> {
        Some(match mode {
            0 => ComputeMode::Default,
            1 => ComputeMode::ExclusiveThread,
            2 => ComputeMode::Prohibited,
            3 => ComputeMode::ExclusiveProcess,
            _ => return None,
        })
    }
}

fn mode(enabled: bool) -> MigMode {
    if enabled {
        MigMode::Enabled
    } else {
        MigMode::Disabled
    }
}

impl Machine {
    /// The run-time state, as the state file holds it.
    pub fn snapshot(&self) -> State {
        let gpus = self
            .gpus
            .iter()
            .map(|g| GpuState {
                uuid: g.card.uuid.clone(),
                compute_mode: g.compute_mode,
                time_slice: g.time_slice,
                mig: g.mig.as_ref().map(|m| MigRunState {
                    current: mode(m.enabled),
                    pending: mode(m.pending),
                    gpu_instances: m
                        .gpu_instances
                        .iter()
                        .map(|(id, gi)| GpuInstanceState {
                            id: *id,
                            profile_id: gi.profile_id,
                            start: gi.start,
                            size: gi.size,
                            compute_instances: gi
                                .compute_instances
                                .iter()
                                .map(|(id, ci)| ComputeInstanceState {
                                    id: *id,
                                    profile_id: ci.profile_id,
                                    slices: ci.slices,
                                    start: ci.start,
                                    uuid: ci.uuid.clone(),
                                })
                                .collect(),
                        })
                        .collect(),
                }),
            })
            .collect();
        State {
            version: STATE_VERSION,
            created: self.created,
            driver_root: self.driver_root.clone(),
            gpus,
        }
    }

    /// Replaces the run-time state with `state`, after checking it fits
    /// this machine's topology; on error nothing is changed.
    pub fn restore(&mut self, state: &State) -> Result<(), String> {
        self.check_fits(state)?;
        let migs = self
            .gpus
            .iter()
            .zip(&state.gpus)
            .enumerate()
            .map(|(index, (g, s))| restored_mig(index, g, s))
            .collect::<Result<Vec<_>, _>>()?;
        self.apply(state, migs);
        Ok(())
    }

    /// Whether `state` is of this library's version and this many GPUs.
    fn check_fits(&self, state: &State) -> Result<(), String> {
        if state.version != STATE_VERSION {
            return Err(format!(
                "it has version {}, this library reads version {STATE_VERSION}",
                state.version
            ));
        }
        if state.gpus.len() != self.gpus.len() {
            return Err(format!(
                "it describes {} GPUs, the topology {}",
                state.gpus.len(),
                self.gpus.len()
            ));
        }
        Ok(())
    }

    /// Takes `state` as it is, once every GPU's part of it was checked.
    fn apply(&mut self, state: &State, migs: Vec<Option<RestoredMig>>) {
        for ((g, s), mig) in self.gpus.iter_mut().zip(&state.gpus).zip(migs) {
            g.compute_mode = s.compute_mode;
            g.time_slice = s.time_slice;
            if let (Some(m), Some(mig)) = (g.mig.as_mut(), mig) {
                m.enabled = mig.enabled;
                m.pending = mig.pending;
                m.gpu_instances = mig.gpu_instances;
            }
        }
        self.created = state.created;
        self.driver_root = state.driver_root.clone();
    }
}

/// One GPU's MIG state as read from the file, checked against the topology.
struct RestoredMig {
    enabled: bool,
    pending: bool,
    gpu_instances: BTreeMap<u32, GpuInstance>,
}

/// GPU `index`'s MIG state in the file, if it is the same GPU and its MIG
/// state fits what the GPU can do.
fn restored_mig(index: usize, g: &Gpu, s: &GpuState) -> Result<Option<RestoredMig>, String> {
    if !g.card.uuid.eq_ignore_ascii_case(&s.uuid) {
        return Err(format!(
            "GPU {index} is {} there, {} in the topology",
            s.uuid, g.card.uuid
        ));
    }
    match (&g.mig, &s.mig) {
        (None, None) => Ok(None),
        (Some(m), Some(sm)) => Ok(Some(RestoredMig {
            enabled: sm.current == MigMode::Enabled,
            pending: sm.pending == MigMode::Enabled,
            gpu_instances: restored_gpu_instances(index, m, sm)?,
        })),
        (None, Some(_)) => Err(format!("GPU {index} cannot do MIG but has MIG state there")),
        (Some(_), None) => Err(format!("GPU {index} can do MIG but has no MIG state there")),
    }
}

/// GPU `index`'s GPU instances in the file: each of a profile the GPU has,
/// each id once.
fn restored_gpu_instances(
    index: usize,
    m: &MigState,
    sm: &MigRunState,
) -> Result<BTreeMap<u32, GpuInstance>, String> {
    let mut gpu_instances = BTreeMap::new();
    for gi in &sm.gpu_instances {
        let Some(p) = m.cap.profiles.iter().find(|p| p.id == gi.profile_id) else {
            return Err(format!(
                "GPU {index}: GPU instance {} has profile {}, which the GPU \
                 does not have",
                gi.id, gi.profile_id
            ));
        };
        let inst = GpuInstance {
            profile_id: gi.profile_id,
            start: gi.start,
            size: gi.size,
            compute_instances: restored_compute_instances(index, gi, p)?,
        };
        if gpu_instances.insert(gi.id, inst).is_some() {
            return Err(format!("GPU {index}: GPU instance {} twice", gi.id));
        }
    }
    Ok(gpu_instances)
}

/// The compute instances of GPU instance `gi` (of profile `p`) in the file:
/// each fits it, each id once.
fn restored_compute_instances(
    index: usize,
    gi: &GpuInstanceState,
    p: &Profile,
) -> Result<BTreeMap<u32, ComputeInstance>, String> {
    let mut compute_instances = BTreeMap::new();
    for ci in &gi.compute_instances {
        if compute_profile_slices(ci.profile_id) != Some(ci.slices)
            || ci.start + ci.slices > p.slices
        {
            return Err(format!(
                "GPU {index}: compute instance {} of GPU instance {} \
                 does not fit it",
                ci.id, gi.id
            ));
        }
        let c = ComputeInstance {
            profile_id: ci.profile_id,
            slices: ci.slices,
            start: ci.start,
            uuid: ci.uuid.clone(),
        };
        if compute_instances.insert(ci.id, c).is_some() {
            return Err(format!(
                "GPU {index}: compute instance {} of GPU instance {} twice",
                ci.id, gi.id
            ));
        }
    }
    Ok(compute_instances)
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Whether a call may change run-time state (and so may need a write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// One process's handle on the state file.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    lock_path: PathBuf,
    /// What the topology describes: written when the file is missing.
    seed: State,
    /// The file's bytes as this process last read or wrote them; `None`
    /// forces a reload.
    seen: Option<Vec<u8>>,
    /// The file behind `seen` when it was read (not after this process's own
    /// writes: the next call reads the file back once).
    read: Option<stamp::Read>,
    /// The last error reported on stderr, so a broken file is reported once,
    /// not on every call.
    pub last_error: Option<String>,
}

impl Store {
    pub fn new(path: PathBuf, seed: State) -> Store {
        let mut lock_path = path.clone().into_os_string();
        lock_path.push(".lock");
        Store {
            path,
            lock_path: PathBuf::from(lock_path),
            seed,
            seen: None,
            read: None,
            last_error: None,
        }
    }

    /// Runs `f` on `machine` with the state file locked and `machine`
    /// holding its current contents; with [`Access::Write`], writes back
    /// whatever `f` changed. A broken state file answers UNKNOWN (and says
    /// why on stderr).
    pub fn sync<R>(
        &mut self,
        machine: &mut Machine,
        access: Access,
        f: impl FnOnce(&mut Machine) -> Result<R, Ret>,
    ) -> Result<R, Ret> {
        let result = self.sync_inner(machine, access, f);
        match result {
            Ok(r) => {
                self.last_error = None;
                r
            }
            Err(msg) => {
                if self.last_error.as_deref() != Some(msg.as_str()) {
                    eprintln!("tessera-fake-nvml: {msg}");
                    self.last_error = Some(msg);
                }
                Err(UNKNOWN)
            }
        }
    }

    /// The outer error is the state file's (a message); the inner one the
    /// call's own result.
    fn sync_inner<R>(
        &mut self,
        machine: &mut Machine,
        access: Access,
        f: impl FnOnce(&mut Machine) -> Result<R, Ret>,
    ) -> Result<Result<R, Ret>, String> {
        let lock = self.lock()?;
        self.load(machine)?;
        let result = f(machine);
        if access == Access::Write {
            let bytes = encode(&machine.snapshot());
            if self.seen.as_deref() != Some(bytes.as_slice()) {
                let written = if lock.exclusive {
                    self.write(&bytes)
                } else {
                    Err(std::io::Error::from_raw_os_error(libc::EROFS))
                };
                if let Err(e) = written {
                    // The process's copy now differs from the file: re-read
                    // it next time.
                    self.seen = None;
                    return self.write_failed(e);
                }
                self.seen = Some(bytes);
                self.read = None;
                caps::reconcile(machine);
            }
        }
        Ok(result)
    }

    /// A change that could not be saved: NO_PERMISSION where the state is
    /// read-only to this process (said on stderr every time: each is a
    /// call refused), any other failure is the state file's.
    fn write_failed<R>(&self, e: std::io::Error) -> Result<Result<R, Ret>, String> {
        let msg = format!("writing the state file {}: {e}", self.path.display());
        if !is_read_only(&e) {
            return Err(msg);
        }
        eprintln!("tessera-fake-nvml: {msg}; this process may read the GPUs' state, not change it");
        Ok(Err(NO_PERMISSION))
    }

    /// Takes the lock, released when the returned file is closed: exclusive
    /// where this process can write the lock file, else shared on a
    /// read-only descriptor (flock needs no write access).
    fn lock(&self) -> Result<Lock, String> {
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.lock_path);
        let fail =
            |e: std::io::Error| format!("opening the state lock {}: {e}", self.lock_path.display());
        let (file, exclusive) = match opened {
            Ok(file) => (file, true),
            Err(e) if is_read_only(&e) => match File::open(&self.lock_path) {
                Ok(file) => (file, false),
                // Nothing to lock: renames still make every read whole.
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    return Ok(Lock {
                        _file: None,
                        exclusive: false,
                    });
                }
                Err(e) => return Err(fail(e)),
            },
            Err(e) => return Err(fail(e)),
        };
        let op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        loop {
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
                return Ok(Lock {
                    _file: Some(file),
                    exclusive,
                });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(format!(
                    "locking the state lock {}: {e}",
                    self.lock_path.display()
                ));
            }
        }
    }

    /// Brings `machine` up to date with the file (seeding a missing one).
    fn load(&mut self, machine: &mut Machine) -> Result<(), String> {
        let unchanged = |read: &stamp::Read| {
            std::fs::metadata(&self.path).is_ok_and(|now| read.unchanged(&now))
        };
        if self.seen.is_some() && self.read.as_ref().is_some_and(unchanged) {
            return Ok(());
        }
        let at = std::time::SystemTime::now();
        let (bytes, meta) = match read_file(&self.path) {
            Ok(read) => read,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let bytes = encode(&self.seed);
                machine
                    .restore(&self.seed)
                    .map_err(|e| format!("seeding {}: {e}", self.path.display()))?;
                self.write(&bytes)
                    .map_err(|e| format!("seeding the state file {}: {e}", self.path.display()))?;
                self.seen = Some(bytes);
                self.read = None;
                caps::reconcile(machine);
                return Ok(());
            }
            Err(e) => {
                return Err(format!(
                    "reading the state file {}: {e}",
                    self.path.display()
                ));
            }
        };
        let read = stamp::Read {
            stamp: stamp::Stamp::of(&meta),
            at,
        };
        if self.seen.as_deref() == Some(bytes.as_slice()) {
            self.read = Some(read);
            return Ok(());
        }
        if self.seen.as_deref() == Some(bytes.as_slice()) {
            return Ok(());
        }
        let state: State = serde_json::from_slice(&bytes).map_err(|e| {
            format!(
                "the state file {} is corrupt ({e}); fix it or delete it to start again from \
                 the topology",
                self.path.display()
            )
        })?;
        machine.restore(&state).map_err(|e| {
            format!(
                "the state file {} does not fit the topology: {e}; it belongs to another \
                 machine (delete it, or set TESSERA_FAKE_NVML_STATE to a path of its own)",
                self.path.display()
            )
        })?;
        self.seen = Some(bytes);
        self.read = Some(read);
        Ok(())
    }

    /// Replaces the file atomically (the caller holds the lock).
    fn write(&self, bytes: &[u8]) -> std::io::Result<()> {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(format!(".tmp.{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(bytes))
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }
}

/// The file's bytes and its metadata, from one open.
fn read_file(path: &std::path::Path) -> std::io::Result<(Vec<u8>, std::fs::Metadata)> {
    use std::io::Read as _;
    let mut file = File::open(path)?;
    let meta = file.metadata()?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.read_to_end(&mut bytes)?;
    Ok((bytes, meta))
}

/// The lock a call holds on `<state>.lock` (released when dropped).
struct Lock {
    /// `None`: no lock file, and no right to create one.
    _file: Option<File>,
    /// Only an exclusive holder may write the state.
    exclusive: bool,
}

/// Whether an error says this process may not write there.
fn is_read_only(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EROFS | libc::EACCES | libc::EPERM)
    )
}

/// The file's bytes for `state`: pretty JSON, for people reading it.
pub fn encode(state: &State) -> Vec<u8> {
    let mut bytes = serde_json::to_vec_pretty(state).expect("state serializes");
    bytes.push(b'\n');
    bytes
}
