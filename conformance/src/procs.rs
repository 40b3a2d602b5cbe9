//! Processes of this machine, as `/proc` shows them (the tests' and the
//! GPU self-test's view of MPS daemons).

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
