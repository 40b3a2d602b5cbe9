//! `fake-mps-control`: a simulated `nvidia-cuda-mps-control` for tests.
//!
//! It behaves like NVIDIA's tool as far as a supervisor can observe it:
//!
//! - `-d` starts the control daemon in the background: the command returns at
//!   once (exit 0) while the daemon keeps running, detached from the caller's
//!   session and output. `-f` runs the daemon in the foreground.
//! - The daemon works in `CUDA_MPS_PIPE_DIRECTORY` (default
//!   `/tmp/nvidia-mps`): it writes `nvidia-cuda-mps-control.pid` there and
//!   then creates the `control` endpoint clients talk to. It logs to
//!   `control.log` in `CUDA_MPS_LOG_DIRECTORY` (default
//!   `/var/log/nvidia-mps`), including the `CUDA_VISIBLE_DEVICES` it serves.
//! - The daemon shares memory with its clients through `/dev/shm`, as the
//!   real server does: at start it creates a segment there
//!   (`tessera-fake-mps.<pid>.<n>`, removed at `quit`) and names it to
//!   clients, which fail unless their own `/dev/shm` holds it. A daemon
//!   without a writable `/dev/shm` does not start.
//! - A second daemon on a pipe directory whose daemon is alive refuses to
//!   start (exit 1); stale files of a dead one are replaced.
//! - Without `-d`/`-f` it is the client: it reads commands from standard
//!   input, one per line, sends each to the daemon of the pipe directory and
//!   prints the replies (`echo quit | nvidia-cuda-mps-control`). With no
//!   daemon there it fails (exit 1).
//! - Commands: `quit` (the daemon removes its files and exits),
//!   `get_server_list` (empty: there are no CUDA clients here),
//!   `get_default_active_thread_percentage` (`100.0`),
//!   `set_default_active_thread_percentage <p>` (echoes `<p>` as `25.0`),
//!   `get_default_device_pinned_mem_limit <ordinal>` (`8192M`, or an empty
//!   reply when none is set) and
//!   `set_default_device_pinned_mem_limit <ordinal> <amount>` (`8G`, `8GB`,
//!   `512M`, `512MB`; an empty reply). A bad value, an ordinal past the
//!   devices the daemon serves or anything else is answered with an error
//!   line (the client still exits 0).
//! - The daemon's own environment at start sets its defaults, as NVIDIA's
//!   does: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<p>` and
//!   `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<amount>[,...]`, ordinals
//!   counting the devices in its `CUDA_VISIBLE_DEVICES`. A value it cannot
//!   use is logged and ignored. A server keeps the defaults it started with
//!   (later ones reach the next server). Defaults bind clients: a client's own
//!   environment can only lower its limits (that rule is applied by the
//!   simulated CUDA library, `driver/fake-cuda`).
//!
//! - The MPS server: the real daemon starts one at its first client, and
//!   the server's context takes GPU memory on each device it serves until
//!   the daemon quits. So does this one, with load recording on
//!   (`TESSERA_FAKE_NVML_LOAD`, see the library's `load` module): from the
//!   first client's connection the daemon process holds a context of
//!   [`server::SERVER_CONTEXT_MIB`] MiB (or `TESSERA_FAKE_MPS_SERVER_CONTEXT_MIB`)
//!   on every GPU or MIG device its `CUDA_VISIBLE_DEVICES` names by UUID,
//!   listed by NVML as a process with a context of its own and counted in
//!   the device's used memory, where clients find it gone from what they
//!   can allocate. A server opens the driver's control and UVM nodes and
//!   each of its GPUs' `/dev/nvidia<minor>`: a daemon whose `/dev` lacks
//!   one fails every client instead (`devices.rs`).
//!
//! Nothing else happens on the GPU. Test knobs, read when the daemon
//! starts: `TESSERA_FAKE_MPS_READY_DELAY_MS` delays creating `control` (the
//! pid file is already there, so a supervisor must wait for the endpoint),
//! `TESSERA_FAKE_MPS_IGNORE_QUIT=1` makes the daemon acknowledge `quit` and
//! keep running (a hung daemon), `TESSERA_FAKE_MPS_LISTEN_DELAY_MS` widens
//! the moment between binding `control` (the endpoint exists) and listening
//! on it (a connection is refused until then), which every daemon has.
//!
//! The wire protocol between this client and this daemon (a Unix stream
//! socket, one connection per command: the client writes one command line
//! and shuts down its side, the daemon writes the reply and closes) is
//! private to the fake. So is one more command, for the simulated
//! `libcuda.so.1` only: `tessera_fake_get_client_config`
//! ([`protocol::CLIENT_CONFIG_COMMAND`]), answered with one JSON line,
//! `{"devices":["GPU-..."],"activeThreadPercentage":25.0,"pinnedMemLimits":{"0":8589934592},"sharedMemory":"tessera-fake-mps.7.1"}`:
//! the entries of the daemon's `CUDA_VISIBLE_DEVICES` (`null` when it has
//! none), its current default thread percentage, its default pinned
//! limits in bytes by ordinal and its segment. `protocol.rs` holds that reply's type and the
//! limit syntax; the CUDA library compiles the same file.

#[path = "fake_mps_control/devices.rs"]
mod devices;
#[path = "fake_mps_control/protocol.rs"]
mod protocol;
#[path = "fake_mps_control/server.rs"]
mod server;

use std::fs::{self, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
const CONTROL: &str = "control";
const READY_DELAY_ENV: &str = "TESSERA_FAKE_MPS_READY_DELAY_MS";
const IGNORE_QUIT_ENV: &str = "TESSERA_FAKE_MPS_IGNORE_QUIT";
const LISTEN_DELAY_ENV: &str = "TESSERA_FAKE_MPS_LISTEN_DELAY_MS";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let pipe_dir = env_dir("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps");
    let log_dir = env_dir("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps");
    match args.first().map(String::as_str) {
        None => client(&pipe_dir),
        Some("-d") => start(&pipe_dir, &log_dir, true),
        Some("-f") => start(&pipe_dir, &log_dir, false),
        Some("-h" | "--help") => {
            println!("usage: fake-mps-control [-d | -f]");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("fake-mps-control: unknown option {other}");
            ExitCode::from(2)
        }
    }
}

fn env_dir(name: &str, default: &str) -> PathBuf {
    env_path(name).unwrap_or_else(|| PathBuf::from(default))
}

/// A path the environment names; unset or empty: `None`.
fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

// ---------------------------------------------------------------------------
// client

fn client(pipe_dir: &Path) -> ExitCode {
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        match send(pipe_dir, command) {
            Ok(reply) => print!("{reply}"),
            Err(e) => {
                eprintln!(
                    "Cannot find MPS control daemon process ({}: {e})",
                    pipe_dir.join(CONTROL).display()
                );
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

fn send(pipe_dir: &Path, command: &str) -> std::io::Result<String> {
    let mut stream = UnixStream::connect(pipe_dir.join(CONTROL))?;
    stream.write_all(command.as_bytes())?;
    stream.write_all(b"\n")?;
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    Ok(reply)
}

// ---------------------------------------------------------------------------
// daemon

fn start(pipe_dir: &Path, log_dir: &Path, background: bool) -> ExitCode {
    for dir in [pipe_dir, log_dir] {
        if let Err(e) = fs::create_dir_all(dir) {
            eprintln!("fake-mps-control: cannot create {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    if let Some(pid) = running_daemon(pipe_dir) {
        eprintln!("An instance of this daemon is already running (pid {pid})");
        return ExitCode::FAILURE;
    }
    if background {
        // SAFETY: the process is single-threaded here, so the child may run
        // arbitrary code after fork.
        match unsafe { libc::fork() } {
            -1 => {
                eprintln!(
                    "fake-mps-control: fork failed: {}",
                    std::io::Error::last_os_error()
                );
                return ExitCode::FAILURE;
            }
            0 => detach(),
            _ => return ExitCode::SUCCESS,
        }
    }
    match serve(pipe_dir, log_dir) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log(log_dir, &format!("fatal: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// The daemon leaves the caller's session and output behind, so whoever
/// started `-d` sees it exit and is not tied to the daemon's lifetime.
fn detach() {
    // SAFETY: plain syscalls on this process's own descriptors.
    unsafe {
        libc::setsid();
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..=2 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
    }
}

/// The pid in the pid file, if that process is alive.
fn running_daemon(pipe_dir: &Path) -> Option<i32> {
    let pid: i32 = fs::read_to_string(pipe_dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    alive(pid).then_some(pid)
}

fn alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // A zombie has exited; only its parent has not reaped it yet.
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn serve(pipe_dir: &Path, log_dir: &Path) -> std::io::Result<()> {
    let pid = std::process::id();
    let control = pipe_dir.join(CONTROL);
    let pid_file = pipe_dir.join(PID_FILE);
    // Stale files of a daemon that died.
    let _ = fs::remove_file(&control);
    fs::write(&pid_file, format!("{pid}\n"))?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    log(
        log_dir,
        &format!(
            "Startup pid={pid} CUDA_VISIBLE_DEVICES={}",
            visible.as_deref().unwrap_or("<unset>")
        ),
    );
    let (mut defaults, problems) = Defaults::from_env(
        visible.as_deref(),
        std::env::var(protocol::THREAD_PERCENTAGE_ENV)
            .ok()
            .as_deref(),
        std::env::var(protocol::PINNED_MEM_LIMIT_ENV)
            .ok()
            .as_deref(),
    );
    for p in problems {
        log(log_dir, &format!("Ignoring environment: {p}"));
    }
    let delay = millis_from_env(READY_DELAY_ENV);
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    let ignore_quit = std::env::var(IGNORE_QUIT_ENV).is_ok_and(|v| v == "1");
    let segment = shared_memory(pid)?;
    defaults.config.shared_memory = segment.name.clone();
    let mut server = server::Server::new(defaults.config.devices.as_deref());
    let listener = bind_then_listen(&control, millis_from_env(LISTEN_DELAY_ENV))?;
    log(log_dir, "Control daemon ready");
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let command = line.trim();
        log(log_dir, &format!("Command: {command}"));
        if command == protocol::CLIENT_CONFIG_COMMAND {
            match server.start() {
                Ok(Some(started)) => log(log_dir, &started),
                Ok(None) => {}
                // The client reads no configuration and fails to connect.
                Err(why) => {
                    log(log_dir, &format!("Server failed to start: {why}"));
                    let _ = writeln!(stream, "Server failed to start: {why}");
                    continue;
                }
            }
        }
        let reply = match defaults.handle(command) {
            Reply::Quit if ignore_quit => {
                log(log_dir, "quit ignored (test knob)");
                String::new()
            }
            Reply::Quit => {
                // Files first: when the client sees the reply end, the
                // pipe directory no longer advertises a daemon.
                let _ = fs::remove_file(&control);
                let _ = fs::remove_file(&pid_file);
                drop(segment);
                log(log_dir, "Exit");
                drop(stream);
                return Ok(());
            }
            Reply::Text(text) => text,
        };
        let _ = stream.write_all(reply.as_bytes());
    }
    Ok(())
}

/// A test knob in milliseconds; zero when unset or not a number.
fn millis_from_env(name: &str) -> Duration {
    Duration::from_millis(
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    )
}

/// A Unix stream socket at `path`: bound (the file appears), then after
/// `delay` listening. Two calls, as in any daemon: a client that connects
/// in between is refused.
fn bind_then_listen(path: &Path, delay: Duration) -> std::io::Result<UnixListener> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::FromRawFd;
    // SAFETY: socket(2) with constant arguments; the descriptor is owned by
    // the listener at once, which closes it on every path.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nothing else owns.
    let listener = unsafe { UnixListener::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_un is a valid (empty) address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("socket path too long: {}", path.display()),
        ));
    }
    for (to, from) in addr.sun_path.iter_mut().zip(bytes) {
        *to = *from as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    let bound = unsafe {
        libc::bind(
            fd,
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if bound != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    // SAFETY: listen(2) on the socket `listener` owns.
    if unsafe { libc::listen(fd, 128) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(listener)
}

/// The daemon's segment in its `/dev/shm`, removed when the daemon quits.
struct Segment {
    name: String,
    path: PathBuf,
}

impl Drop for Segment {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Creates the segment clients must find in their own `/dev/shm`. No
/// `/dev/shm` (or none writable) and the daemon cannot serve, like the real
/// server.
fn shared_memory(pid: u32) -> std::io::Result<Segment> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!("{}{pid}.{nanos}", protocol::SHM_PREFIX);
    let path = Path::new(protocol::SHM_DIR).join(&name);
    fs::write(&path, &name)
        .map_err(|e| std::io::Error::new(e.kind(), format!("creating {}: {e}", path.display())))?;
    Ok(Segment { name, path })
}

/// What the daemon imposes on its clients, and the devices it serves.
#[derive(Debug, Clone, PartialEq)]
struct Defaults {
    config: protocol::ClientConfig,
    /// What the running server started with, at its first client.
    server: Option<protocol::ClientConfig>,
}

#[derive(Debug, PartialEq)]
enum Reply {
    Quit,
    Text(String),
}

impl Defaults {
    /// The defaults a daemon starts with, from its `CUDA_VISIBLE_DEVICES`
    /// and the two limit variables; values it cannot use are returned as
    /// problems (and not applied).
    fn from_env(
        visible: Option<&str>,
        percentage: Option<&str>,
        pinned: Option<&str>,
    ) -> (Defaults, Vec<String>) {
        let devices = visible.map(|v| {
            if v.trim().is_empty() {
                Vec::new()
            } else {
                v.split(',').map(|e| e.trim().to_owned()).collect()
            }
        });
        let mut defaults = Defaults {
            config: protocol::ClientConfig {
                devices,
                active_thread_percentage: 100.0,
                pinned_mem_limits: Default::default(),
                shared_memory: String::new(),
            },
            server: None,
        };
        let mut problems = Vec::new();
        if let Some(p) = percentage.filter(|p| !p.is_empty()) {
            match protocol::parse_percentage(p) {
                Ok(p) => defaults.config.active_thread_percentage = p,
                Err(e) => problems.push(format!("{}: {e}", protocol::THREAD_PERCENTAGE_ENV)),
            }
        }
        if let Some(l) = pinned.filter(|l| !l.is_empty()) {
            let limits = protocol::parse_pinned_limits(l).and_then(|limits| {
                match limits.keys().find(|o| !defaults.serves(**o)) {
                    Some(o) => Err(format!("no device of ordinal {o}")),
                    None => Ok(limits),
                }
            });
            match limits {
                Ok(limits) => defaults.config.pinned_mem_limits = limits,
                Err(e) => problems.push(format!("{}: {e}", protocol::PINNED_MEM_LIMIT_ENV)),
            }
        }
        (defaults, problems)
    }

    /// Whether `ordinal` names one of the daemon's devices (any ordinal
    /// when it was given no `CUDA_VISIBLE_DEVICES`: it cannot count them).
    fn serves(&self, ordinal: u32) -> bool {
        self.config
            .devices
            .as_ref()
            .is_none_or(|d| (ordinal as usize) < d.len())
    }

    fn ordinal(&self, word: &str) -> Result<u32, String> {
        match word.parse::<u32>() {
            Ok(o) if self.serves(o) => Ok(o),
            _ => Err(format!("Invalid device {word}\n")),
        }
    }

    /// The reply to one control command.
    fn handle(&mut self, command: &str) -> Reply {
        let words: Vec<&str> = command.split_whitespace().collect();
        let text = match words.as_slice() {
            ["quit", ..] => return Reply::Quit,
            ["get_server_list"] => String::new(),
            ["get_default_active_thread_percentage"] => {
                format!("{:.1}\n", self.config.active_thread_percentage)
            }
            ["set_default_active_thread_percentage", value] => {
                match protocol::parse_percentage(value) {
                    Ok(p) => {
                        self.config.active_thread_percentage = p;
                        format!("{p:.1}\n")
                    }
                    Err(_) => format!("Invalid percentage {value}\n"),
                }
            }
            ["get_default_device_pinned_mem_limit", ordinal] => match self.ordinal(ordinal) {
                Ok(o) => self
                    .config
                    .pinned_mem_limits
                    .get(&o)
                    .map_or_else(String::new, |b| {
                        format!("{}\n", protocol::format_amount(*b))
                    }),
                Err(e) => e,
            },
            ["set_default_device_pinned_mem_limit", ordinal, amount] => {
                match (self.ordinal(ordinal), protocol::parse_amount(amount)) {
                    (Ok(o), Ok(bytes)) => {
                        self.config.pinned_mem_limits.insert(o, bytes);
                        String::new()
                    }
                    (Err(e), _) => e,
                    (_, Err(_)) => format!("Invalid memory limit {amount}\n"),
                }
            }
            [protocol::CLIENT_CONFIG_COMMAND] => {
                let served = self.server.get_or_insert_with(|| self.config.clone());
                serde_json::to_string(served).unwrap_or_default() + "\n"
            }
            _ => format!("Unrecognized command: {command}\n"),
        };
        Reply::Text(text)
    }
}

fn log(log_dir: &Path, message: &str) {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if let Ok(mut f) = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_dir.join("control.log"))
    {
        let _ = writeln!(f, "[{secs}] {message}");
    }
}

#[cfg(test)]
#[path = "fake_mps_control/tests.rs"]
mod tests;
