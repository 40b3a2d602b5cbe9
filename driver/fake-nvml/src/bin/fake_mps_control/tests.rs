use super::*;

const GIB: u64 = 1 << 30;

fn text(d: &mut Defaults, command: &str) -> String {
    match d.handle(command) {
        Reply::Text(t) => t,
        Reply::Quit => panic!("{command} quit"),
    }
}

#[test]
fn the_environment_sets_the_defaults() {
    let (d, problems) = Defaults::from_env(Some("GPU-a, GPU-b"), Some("25"), Some("1=8G"));
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        d.config,
        protocol::ClientConfig {
            devices: Some(vec!["GPU-a".into(), "GPU-b".into()]),
            active_thread_percentage: 25.0,
            pinned_mem_limits: [(1, 8 * GIB)].into(),
            shared_memory: String::new(),
        }
    );
    let (d, problems) = Defaults::from_env(None, None, Some("5=512MB"));
    assert!(problems.is_empty());
    assert_eq!(d.config.devices, None);
    assert_eq!(d.config.active_thread_percentage, 100.0);
    assert_eq!(d.config.pinned_mem_limits, [(5, 512 << 20)].into());
    let (d, _) = Defaults::from_env(Some(""), Some(""), Some(""));
    assert_eq!(d.config.devices, Some(vec![]));
    assert!(d.config.pinned_mem_limits.is_empty());
}

#[test]
fn unusable_environment_values_are_reported_and_ignored() {
    let (d, problems) = Defaults::from_env(Some("GPU-a"), Some("250"), Some("1=8G"));
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert_eq!(d.config.active_thread_percentage, 100.0);
    assert!(d.config.pinned_mem_limits.is_empty());
    let (_, problems) = Defaults::from_env(Some("GPU-a"), Some("x"), Some("0=8"));
    assert_eq!(problems.len(), 2, "{problems:?}");
}

#[test]
fn commands_read_and_change_the_defaults() {
    let (mut d, _) = Defaults::from_env(Some("GPU-a"), None, None);
    assert_eq!(
        text(&mut d, "get_default_active_thread_percentage"),
        "100.0\n"
    );
    assert_eq!(
        text(&mut d, "set_default_active_thread_percentage 30"),
        "30.0\n"
    );
    assert_eq!(
        text(&mut d, "get_default_active_thread_percentage"),
        "30.0\n"
    );
    assert_eq!(text(&mut d, "get_default_device_pinned_mem_limit 0"), "");
    assert_eq!(text(&mut d, "set_default_device_pinned_mem_limit 0 8G"), "");
    assert_eq!(
        text(&mut d, "get_default_device_pinned_mem_limit 0"),
        "8192M\n"
    );
    assert_eq!(
        text(&mut d, "set_default_device_pinned_mem_limit 0 512MB"),
        ""
    );
    assert_eq!(
        text(&mut d, "get_default_device_pinned_mem_limit 0"),
        "512M\n"
    );
    assert_eq!(text(&mut d, "get_server_list"), "");
    assert_eq!(d.handle("quit"), Reply::Quit);
}

#[test]
fn bad_commands_get_an_error_line_and_change_nothing() {
    let (mut d, _) = Defaults::from_env(Some("GPU-a"), Some("50"), Some("0=1G"));
    let before = d.clone();
    for bad in [
        "set_default_active_thread_percentage 0",
        "set_default_active_thread_percentage 101",
        "set_default_active_thread_percentage",
        "set_default_device_pinned_mem_limit 0 8",
        "set_default_device_pinned_mem_limit 0 0G",
        "set_default_device_pinned_mem_limit 1 8G",
        "set_default_device_pinned_mem_limit x 8G",
        "set_default_device_pinned_mem_limit 0",
        "get_default_device_pinned_mem_limit 1",
        "get_default_device_pinned_mem_limit",
        "frobnicate",
    ] {
        let reply = text(&mut d, bad);
        assert!(
            reply.ends_with('\n') && reply.len() > 1,
            "{bad:?} answered {reply:?}"
        );
    }
    assert_eq!(d, before);
}

#[test]
fn the_private_command_answers_one_json_line() {
    let (mut d, _) = Defaults::from_env(Some("GPU-a"), Some("25"), Some("0=8G"));
    let reply = text(&mut d, protocol::CLIENT_CONFIG_COMMAND);
    assert_eq!(reply.lines().count(), 1);
    let config: protocol::ClientConfig = serde_json::from_str(&reply).unwrap();
    assert_eq!(config, d.config);
    let (mut d, _) = Defaults::from_env(None, None, None);
    let reply = text(&mut d, protocol::CLIENT_CONFIG_COMMAND);
    assert_eq!(
        reply,
        "{\"devices\":null,\"activeThreadPercentage\":100.0,\"pinnedMemLimits\":{},\"sharedMemory\":\"\"}\n"
    );
}

#[test]
fn a_running_server_keeps_the_defaults_it_started_with() {
    let (mut d, _) = Defaults::from_env(Some("GPU-a"), Some("25"), Some("0=8G"));
    let first = text(&mut d, protocol::CLIENT_CONFIG_COMMAND);
    assert_eq!(
        text(&mut d, "set_default_active_thread_percentage 90"),
        "90.0\n"
    );
    assert_eq!(
        text(&mut d, "set_default_device_pinned_mem_limit 0 64G"),
        ""
    );
    // The daemon's defaults changed ...
    assert_eq!(
        text(&mut d, "get_default_active_thread_percentage"),
        "90.0\n"
    );
    // ... the running server's clients still get what it started with.
    assert_eq!(text(&mut d, protocol::CLIENT_CONFIG_COMMAND), first);
    let config: protocol::ClientConfig = serde_json::from_str(&first).unwrap();
    assert_eq!(config.active_thread_percentage, 25.0);
}

/// A fresh directory holding a driver root whose module describes GPU
/// `GPU-a` (minor 3), and a `/dev` with the nodes named in `nodes`.
fn machine(name: &str, nodes: &[(&str, u32, u32)]) -> Option<(PathBuf, PathBuf)> {
    use tessera_fake_nvml::gpu_info;
    let dir = std::env::temp_dir().join(format!("tessera-fake-mps-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let (root, dev) = (dir.join("root"), dir.join("dev"));
    let info = gpu_info::gpus_dir(&root).join("0000:18:00.0");
    fs::create_dir_all(&info).unwrap();
    fs::write(
        info.join("information"),
        gpu_info::text("NVIDIA H100", "GPU-a", "00000000:18:00.0", 3),
    )
    .unwrap();
    fs::create_dir_all(&dev).unwrap();
    for (node, major, minor) in nodes {
        if let Err(e) = tessera_fake_nvml::caps::mknod_char(&dev.join(node), *major, *minor) {
            eprintln!("SKIP: cannot make device nodes here ({e})");
            return None;
        }
    }
    Some((root, dev))
}

const CTL: (&str, u32, u32) = ("nvidiactl", 195, 255);
const UVM: (&str, u32, u32) = ("nvidia-uvm", 508, 0);

#[test]
fn a_server_starts_with_its_gpus_node_and_the_drivers() {
    let Some((root, dev)) = machine("usable", &[CTL, UVM, ("nvidia3", 195, 3)]) else {
        return;
    };
    let gpu = vec!["GPU-a".to_owned()];
    assert_eq!(devices::unusable(&gpu, Some(&root), &dev), None);
    // A MIG device is not looked up; the driver's nodes still are.
    let mig = vec!["MIG-b".to_owned()];
    assert_eq!(devices::unusable(&mig, Some(&root), &dev), None);
    let _ = fs::remove_dir_all(root.parent().unwrap());
}

#[test]
fn a_server_without_a_node_it_opens_does_not_start() {
    // Another GPU's node, not GPU-a's (minor 3).
    let Some((root, dev)) = machine("unusable", &[CTL, UVM, ("nvidia30", 195, 30)]) else {
        return;
    };
    let gpu = vec!["GPU-a".to_owned()];
    let why = devices::unusable(&gpu, Some(&root), &dev).expect("started without nvidia3");
    assert!(why.contains("nvidia3 (195:3)"), "{why}");
    // A node of the right name but another device is not it.
    fs::remove_file(dev.join("nvidiactl")).unwrap();
    tessera_fake_nvml::caps::mknod_char(&dev.join("nvidiactl"), 195, 254).unwrap();
    let why = devices::unusable(&[], Some(&root), &dev).expect("started without nvidiactl");
    assert!(why.contains("nvidiactl (195:255)"), "{why}");
    // A GPU the machine does not have.
    let other = vec!["GPU-z".to_owned()];
    let why = devices::unusable(&other, Some(&root), &dev).expect("started on no GPU");
    assert!(why.contains("no GPU GPU-z"), "{why}");
    // Outside a simulated machine nothing is checked.
    assert_eq!(devices::unusable(&gpu, None, &dev), None);
    let none = root.join("nothing");
    assert_eq!(devices::unusable(&gpu, Some(&none), &dev), None);
    let _ = fs::remove_dir_all(root.parent().unwrap());
}
