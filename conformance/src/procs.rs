//! Processes of this machine, as `/proc` shows them (the tests' and the
//! GPU self-test's view of MPS daemons), and commands the tests run.

/// Every process's PID.
pub fn pids() -> Vec<i32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .collect()
}

/// Whether `pid` runs: it exists and is not a zombie.
pub fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit(") ").next().is_some_and(|r| r.starts_with('Z')))
}

/// Its command line's arguments (`None` once it is gone).
pub fn args(pid: i32) -> Option<Vec<Vec<u8>>> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(cmdline.split(|b| *b == 0).map(<[u8]>::to_vec).collect())
}

/// Runs a command to its end and returns its stdout; a failure carries the
/// command, its status and its output.
pub fn run(command: &mut std::process::Command) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let shown = format!("{command:?}");
    let out = command
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running {shown}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{shown} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
