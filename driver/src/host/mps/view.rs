//! What an MPS control daemon, and the control client the driver runs
//! against it, can see and do.
//!
//! The daemon runs as root (the MPS server it starts takes its client's
//! uid), beside directories its claim's containers write. So, before it
//! executes, the forked child:
//!
//! - gets a mount view of its own: a fresh root holding, read-only, the
//!   system and driver files a CUDA tool loads (`/usr`, `/lib*`, `/bin`,
//!   `/sbin`, `/etc`, the driver root, the control binary), `/proc`, a
//!   `/dev` with only `null`, `zero`, `urandom`, its own GPU's node
//!   (`nvidia<minor>`, no other GPU's) and the driver's other `nvidia*`
//!   nodes (`nvidiactl`, `nvidia-uvm`, the MIG capabilities), and
//!   read-write only its claim's two directories (pipe and log;
//!   the claim's shared memory at `/dev/shm`). No other claim's directory,
//!   no kubelet or CDI directory, no node state is in it;
//! - keeps only the capabilities MPS needs ([`KEPT`]): starting the server
//!   as the client's user (`SETUID`, `SETGID`), giving it and reaching its
//!   files in the world-writable pipe directory (`CHOWN`, `FOWNER`,
//!   `DAC_OVERRIDE`), and stopping it (`KILL`). The bounding set is cut to
//!   them, so no exec regains the others;
//! - sets `no_new_privs`: no setuid binary or file capability raises it.
//!
//! The control client (`quit`, the limits) gets the same view without
//! `/proc`, with its pipe directory replaced by a tmpfs holding one entry:
//! the daemon's control endpoint, bound from the inode the driver checked
//! (a socket, reached without following a link). A symlink or another file
//! a tenant puts in its place is never followed or seen.
//!
//! The view is a namespace of its own made from the node's [`Template`]:
//! the files above are detached copies of the node's mounts, opened here
//! before the fork and attached in the child below a fresh root tmpfs the
//! child then `chroot`s into (see `template.rs` for why). On a kernel
//! without the calls for that (before 5.12), the child copies the node's
//! namespace instead, binds the files and detaches the rest with
//! `pivot_root`.
//!
//! Everything the child does is a system call on values prepared here
//! before the fork (it must be async-signal-safe).

mod calls;
mod template;

use calls::{bind, bind_endpoint, make_dir, mount_proc, mount_tmpfs, touch};
pub use template::Template;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Capabilities a daemon keeps (see the module documentation), by number.
pub const KEPT: [u32; 6] = [
    CAP_CHOWN,
    CAP_DAC_OVERRIDE,
    CAP_FOWNER,
    CAP_KILL,
    CAP_SETGID,
    CAP_SETUID,
];
const CAP_CHOWN: u32 = 0;
const CAP_DAC_OVERRIDE: u32 = 1;
const CAP_FOWNER: u32 = 3;
const CAP_KILL: u32 = 5;
const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;

/// The system directories a daemon sees read-only, where they exist.
const SYSTEM_DIRS: [&str; 7] = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc"];
/// Device nodes every process expects.
const BASIC_DEVICES: [&str; 3] = ["null", "zero", "urandom"];

/// `KEPT` as a capability mask.
pub fn kept_mask() -> u64 {
    KEPT.iter().fold(0, |m, c| m | 1 << c)
}

/// What the daemon of one claim sees: paths as the node process sees them.
#[derive(Debug, Clone)]
pub struct ViewSpec {
    /// A host-only directory where the new root is built when the view
    /// copies the node's namespace (made then).
    pub root: PathBuf,
    /// The driver root (`/` on a host install).
    pub driver_root: PathBuf,
    /// Where the GPU device nodes are (`<dev_root>/dev/nvidia*`).
    pub dev_root: PathBuf,
    /// The daemon's GPU (`nvidia<minor>`): the one GPU node in the view,
    /// beside the driver's other nodes (`nvidiactl`, `nvidia-uvm`, the MIG
    /// capabilities). `None` (a daemon recorded by an earlier version):
    /// every GPU node.
    pub gpu_minor: Option<u32>,
    /// The control binary, its symlinks resolved.
    pub binary: PathBuf,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    pub shm_dir: PathBuf,
}

/// Which process the view is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Daemon,
    /// A control client, reaching only the control endpoint whose (device,
    /// inode) the caller examined (a socket or fifo, not followed).
    Client {
        endpoint: (u64, u64),
    },
}

/// One system call of building the view.
#[derive(Debug)]
enum Step {
    /// A fresh tmpfs on the path (the new root, or a client's pipe dir).
    Tmpfs(CString),
    Mkdir(CString),
    /// An empty file to bind a file or device node on.
    Touch(CString),
    Bind {
        from: CString,
        to: CString,
        read_only: bool,
    },
    /// A detached copy of a node mount, opened before the fork, attached.
    Attach {
        source: RawFd,
        to: CString,
    },
    /// The endpoint, bound from its path and then checked to be the inode
    /// the driver examined (device, inode): a link or another file swapped
    /// in meanwhile fails the client instead of being reached.
    Endpoint {
        from: CString,
        to: CString,
        inode: (u64, u64),
    },
    /// A fresh procfs.
    Proc(CString),
}

/// How the child gets a namespace of its own.
#[derive(Debug)]
enum Making<'t> {
    /// A copy of `template`'s; the view's files are the detached copies
    /// held here until the child has attached them.
    Template {
        template: &'t Template,
        sources: Vec<OwnedFd>,
    },
    /// A copy of the node's, whose old root is detached after the pivot.
    Copy,
}

/// The prepared steps of one view, run in the forked child; it borrows
/// the template it is made from, whose namespace the child enters.
#[derive(Debug)]
pub struct View<'t> {
    making: Making<'t>,
    steps: Vec<Step>,
    root: CString,
    last_cap: u32,
}

fn c(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// `root` joined with the absolute `path`.
fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

struct Builder<'t> {
    root: PathBuf,
    steps: Vec<Step>,
    made: Vec<PathBuf>,
    /// Directories bound at their own path.
    bound: Vec<PathBuf>,
    making: Making<'t>,
}

impl Builder<'_> {
    /// Directories from the new root down to `path` (inside it).
    fn dirs(&mut self, path: &Path) -> io::Result<()> {
        let mut at = PathBuf::from("/");
        for part in path.strip_prefix("/").unwrap_or(path).components() {
            at.push(part);
            if !self.made.contains(&at) {
                self.made.push(at.clone());
                self.steps.push(Step::Mkdir(c(&inside(&self.root, &at))?));
            }
        }
        Ok(())
    }

    /// `from` (as the node process sees it) at `to` in the view.
    fn bind(&mut self, from: &Path, to: &Path, read_only: bool) -> io::Result<()> {
        if from == to && self.bound.iter().any(|d| to.starts_with(d)) {
            // Already in the view (a binary under /usr).
            return Ok(());
        }
        let meta = std::fs::metadata(from)?;
        if meta.is_dir() && from == to {
            self.bound.push(to.to_owned());
        }
        if meta.is_dir() {
            self.dirs(to)?;
        } else {
            if let Some(parent) = to.parent() {
                self.dirs(parent)?;
            }
            self.steps.push(Step::Touch(c(&inside(&self.root, to))?));
        }
        let from = c(from)?;
        let to = c(&inside(&self.root, to))?;
        self.place(
            to,
            || template::open_source(&from, read_only),
            |to| Step::Bind {
                from: from.clone(),
                to,
                read_only,
            },
        )
    }

    /// The control endpoint at `to`, if it is still the inode the driver
    /// examined.
    fn endpoint(&mut self, from: &Path, to: &Path, inode: (u64, u64)) -> io::Result<()> {
        let from = c(from)?;
        let to = c(&inside(&self.root, to))?;
        self.steps.push(Step::Touch(to.clone()));
        self.place(
            to,
            || template::open_endpoint(&from, inode),
            |to| Step::Endpoint {
                from: from.clone(),
                to,
                inode,
            },
        )
    }

    /// The step that puts a file at `to`: from a template, attaching the
    /// copy `open` makes now; else the `copied` step (a bind in the child).
    fn place(
        &mut self,
        to: CString,
        open: impl FnOnce() -> io::Result<OwnedFd>,
        copied: impl FnOnce(CString) -> Step,
    ) -> io::Result<()> {
        let step = match &mut self.making {
            Making::Template { sources, .. } => {
                let source = open()?;
                let step = Step::Attach {
                    source: source.as_raw_fd(),
                    to,
                };
                sources.push(source);
                step
            }
            Making::Copy => copied(to),
        };
        self.steps.push(step);
        Ok(())
    }
}

impl<'t> View<'t> {
    /// The steps for `spec`'s daemon or client, from the node's template
    /// where it has one; what does not exist on the node (a `/lib32`, a GPU
    /// node) is left out.
    pub fn prepare(spec: &ViewSpec, role: Role) -> io::Result<View<'static>> {
        View::prepare_from(spec, role, Template::shared())
    }

    /// [`View::prepare`] from `template`, or by copying the node's
    /// namespace without one.
    pub fn prepare_from(
        spec: &ViewSpec,
        role: Role,
        template: Option<&'t Template>,
    ) -> io::Result<View<'t>> {
        let (root, making) = match template {
            Some(template) => (
                PathBuf::from(template::AT),
                Making::Template {
                    template,
                    sources: Vec::new(),
                },
            ),
            None => {
                std::fs::create_dir_all(&spec.root)?;
                (spec.root.clone(), Making::Copy)
            }
        };
        let mut b = Builder {
            steps: vec![Step::Tmpfs(c(&root)?)],
            root,
            made: Vec::new(),
            bound: Vec::new(),
            making,
        };
        for dir in SYSTEM_DIRS.map(Path::new) {
            if dir.exists() {
                b.bind(dir, dir, true)?;
            }
        }
        if spec.driver_root != Path::new("/") && spec.driver_root.exists() {
            b.bind(&spec.driver_root, &spec.driver_root, true)?;
        }
        b.bind(&spec.binary, &spec.binary, true)?;
        b.dirs(Path::new("/dev"))?;
        for name in BASIC_DEVICES {
            let node = Path::new("/dev").join(name);
            if node.exists() {
                b.bind(&node, &node, false)?;
            }
        }
        for node in gpu_nodes(&spec.dev_root.join("dev"), spec.gpu_minor) {
            let to = Path::new("/dev").join(node.file_name().expect("a named entry"));
            b.bind(&node, &to, false)?;
        }
        b.bind(&spec.log_dir, &spec.log_dir, false)?;
        match role {
            Role::Daemon => {
                b.bind(&spec.shm_dir, Path::new("/dev/shm"), false)?;
                b.bind(&spec.pipe_dir, &spec.pipe_dir, false)?;
                b.dirs(Path::new("/proc"))?;
                b.steps
                    .push(Step::Proc(c(&inside(&b.root, Path::new("/proc")))?));
            }
            Role::Client { endpoint } => {
                b.dirs(&spec.pipe_dir)?;
                let pipe = inside(&b.root, &spec.pipe_dir);
                b.steps.push(Step::Tmpfs(c(&pipe)?));
                let control = spec.pipe_dir.join(super::paths::CONTROL);
                b.endpoint(&control, &control, endpoint)?;
            }
        }
        let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(63);
        Ok(View {
            root: c(&b.root)?,
            making: b.making,
            steps: b.steps,
            last_cap,
        })
    }

    /// In the forked child: a mount namespace of its own whose root is the
    /// view, then the capabilities cut and `no_new_privs` set.
    /// Async-signal-safe: system calls on prepared values only.
    pub fn enter(&self) -> io::Result<()> {
        match &self.making {
            Making::Template { template, .. } => template.enter_copy()?,
            // SAFETY: unshare(2) and mount(2) of this child's own namespace.
            Making::Copy => unsafe {
                check(libc::unshare(libc::CLONE_NEWNS))?;
                check(libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_SLAVE,
                    std::ptr::null(),
                ))?;
            },
        }
        for step in &self.steps {
            Self::run(step)?;
        }
        // SAFETY: chdir(2), chroot(2), pivot_root(2), umount2(2) on
        // NUL-terminated strings owned by `self` or constants.
        unsafe {
            check(libc::chdir(self.root.as_ptr()))?;
            match self.making {
                // The template's empty root stays below, out of reach.
                Making::Template { .. } => check(libc::chroot(c".".as_ptr()))?,
                // The old root stacks under the new one, then goes.
                Making::Copy => {
                    check(
                        libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as i32,
                    )?;
                    check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
                }
            }
            check(libc::chdir(c"/".as_ptr()))?;
        }
        self.cut_capabilities()?;
        // SAFETY: prctl with integer arguments.
        check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })
    }

    /// One step of the view, in the forked child.
    fn run(step: &Step) -> io::Result<()> {
        match step {
            Step::Tmpfs(at) => mount_tmpfs(at),
            Step::Mkdir(at) => make_dir(at),
            Step::Touch(at) => touch(at),
            Step::Bind {
                from,
                to,
                read_only,
            } => bind(from, to, *read_only),
            Step::Attach { source, to } => template::attach(*source, to),
            Step::Endpoint { from, to, inode } => bind_endpoint(from, to, *inode),
            Step::Proc(at) => mount_proc(at),
        }
    }

    /// The bounding set cut to [`KEPT`] (while `SETPCAP` still allows it),
    /// then the process's own sets.
    fn cut_capabilities(&self) -> io::Result<()> {
        let kept = kept_mask();
        for cap in 0..=self.last_cap {
            if kept & (1 << cap) == 0 {
                // SAFETY: prctl with integer arguments.
                let rc =
                    unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
                // EINVAL: a capability this kernel does not know.
                if rc != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        let header = CapHeader {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let low = kept as u32;
        let high = (kept >> 32) as u32;
        let data = [
            CapData {
                effective: low,
                permitted: low,
                inheritable: low,
            },
            CapData {
                effective: high,
                permitted: high,
                inheritable: high,
            },
        ];
        // SAFETY: capset(2) with a header and two data structs we own.
        check(unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as i32 })
    }
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The GPU's device nodes under `dev`: `nvidia*` entries (character
/// devices, and the `nvidia-caps` directory).
fn gpu_nodes(dev: &Path, gpu_minor: Option<u32>) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dev) else {
        return Vec::new();
    };
    let mut nodes: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| is_seen(e.file_name().as_bytes(), gpu_minor))
        .map(|e| e.path())
        .collect();
    nodes.sort();
    nodes
}

/// Whether the `/dev` entry `name` belongs in the view of a daemon of the
/// GPU `gpu_minor`: the driver's nodes, and of the GPU nodes
/// (`nvidia<minor>`) its own only.
fn is_seen(name: &[u8], gpu_minor: Option<u32>) -> bool {
    let Some(rest) = name.strip_prefix(b"nvidia") else {
        return false;
    };
    let is_gpu_node = !rest.is_empty() && rest.iter().all(u8::is_ascii_digit);
    match gpu_minor {
        Some(minor) if is_gpu_node => rest == minor.to_string().as_bytes(),
        _ => true,
    }
}

#[cfg(test)]
mod tests;
