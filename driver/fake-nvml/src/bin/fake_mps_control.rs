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
//! - A second daemon on a pipe directory whose daemon is alive refuses to
//!   start (exit 1); stale files of a dead one are replaced.
//! - Without `-d`/`-f` it is the client: it reads commands from standard
//!   input, one per line, sends each to the daemon of the pipe directory and
//!   prints the replies (`echo quit | nvidia-cuda-mps-control`). With no
//!   daemon there it fails (exit 1).
//! - Commands: `quit` (the daemon removes its files and exits),
//!   `get_server_list` (empty: there are no CUDA clients here),
//!   `get_default_active_thread_percentage`,
//!   `set_default_active_thread_percentage <p>`; anything else is answered
//!   with an error line.
//!
//! Only the GPU-side effects are absent. Test knobs, read when the daemon
//! starts: `TESSERA_FAKE_MPS_READY_DELAY_MS` delays creating `control` (the
//! pid file is already there, so a supervisor must wait for the endpoint),
//! `TESSERA_FAKE_MPS_IGNORE_QUIT=1` makes the daemon acknowledge `quit` and
//! keep running (a hung daemon).
//!
//! The wire protocol between this client and this daemon (a Unix stream
//! socket, one connection per command) is private to the fake.

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
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(default), PathBuf::from)
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
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into());
    log(
        log_dir,
        &format!("Startup pid={pid} CUDA_VISIBLE_DEVICES={visible}"),
    );
    let delay = std::env::var(READY_DELAY_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    if delay > 0 {
        std::thread::sleep(Duration::from_millis(delay));
    }
    let ignore_quit = std::env::var(IGNORE_QUIT_ENV).is_ok_and(|v| v == "1");
    let listener = UnixListener::bind(&control)?;
    log(log_dir, "Control daemon ready");
    let mut thread_percentage = 100.0_f64;
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let command = line.trim();
        log(log_dir, &format!("Command: {command}"));
        let mut words = command.split_whitespace();
        let reply = match (words.next(), words.next()) {
            (Some("quit"), _) => {
                if ignore_quit {
                    log(log_dir, "quit ignored (test knob)");
                    String::new()
                } else {
                    // Files first: when the client sees the reply end, the
                    // pipe directory no longer advertises a daemon.
                    let _ = fs::remove_file(&control);
                    let _ = fs::remove_file(&pid_file);
                    log(log_dir, "Exit");
                    drop(stream);
                    return Ok(());
                }
            }
            (Some("get_server_list"), _) => String::new(),
            (Some("get_default_active_thread_percentage"), _) => {
                format!("{thread_percentage:.1}\n")
            }
            (Some("set_default_active_thread_percentage"), Some(value)) => {
                match value.parse::<f64>() {
                    Ok(p) if p > 0.0 && p <= 100.0 => {
                        thread_percentage = p;
                        format!("{p:.1}\n")
                    }
                    _ => format!("Invalid percentage {value}\n"),
                }
            }
            _ => format!("Unrecognized command: {command}\n"),
        };
        let _ = stream.write_all(reply.as_bytes());
    }
    Ok(())
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
