use super::*;

fn uid() -> ClaimUid {
    ClaimUid::parse("0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e").unwrap()
}

fn gpu_device(name: &str) -> Device {
    Device {
        name: name.into(),
        container_edits: ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=GPU-1".into()],
            device_nodes: vec![DeviceNode {
                path: "/dev/nvidia0".into(),
                host_path: None,
                permissions: None,
            }],
            mounts: vec![],
        },
    }
}

#[test]
fn plain_spec_needs_only_0_3() {
    let spec = Spec::for_claim(vec![gpu_device("gpu-0")]);
    assert_eq!(spec.cdi_version, "0.3.0");
    assert_eq!(spec.kind, "gpu.tessera.dev/claim");
}

#[test]
fn host_path_requires_0_5_and_mount_type_0_4() {
    let mut dev = gpu_device("gpu-0");
    dev.container_edits.mounts.push(Mount {
        host_path: "/run/nvidia/driver/usr/bin/nvidia-smi".into(),
        container_path: "/usr/bin/nvidia-smi".into(),
        options: vec!["ro".into(), "bind".into()],
        mount_type: Some("bind".into()),
    });
    let spec = Spec::for_claim(vec![dev.clone()]);
    assert_eq!(spec.minimum_version(), CdiVersion::V0_4);
    dev.container_edits.device_nodes[0].host_path = Some("/run/nvidia/driver/dev/nvidia0".into());
    let spec = Spec::for_claim(vec![dev]);
    assert_eq!(spec.cdi_version, "0.5.0");
}

#[test]
fn device_name_starting_with_digit_requires_0_5() {
    let spec = Spec::for_claim(vec![gpu_device("0-gpu")]);
    assert_eq!(spec.minimum_version(), CdiVersion::V0_5);
}

#[test]
fn write_is_atomic_and_remove_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let specs = SpecDir::new(dir.path());
    let spec = Spec::for_claim(vec![gpu_device("gpu-0")]);
    let path = specs.write(&uid(), &spec).unwrap();
    let back: Spec = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(back, spec);
    // no temp file left beside it
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names,
        vec![format!("gpu.tessera.dev-claim_{}.json", uid().as_str())]
    );
    assert_eq!(specs.claims().unwrap(), vec![uid()]);
    specs.remove(&uid()).unwrap();
    specs.remove(&uid()).unwrap();
    assert!(specs.claims().unwrap().is_empty());
}

#[test]
fn a_removed_spec_file_is_reused_and_never_taken_for_a_spec() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let specs = SpecDir::new(dir.path());
    let spec = Spec::for_claim(vec![gpu_device("gpu-0")]);
    let first = specs.write(&uid(), &spec).unwrap();
    let inode = fs::metadata(&first).unwrap().ino();
    specs.remove(&uid()).unwrap();
    let names = |d: &Path| -> Vec<String> {
        let mut n: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        n.sort();
        n
    };
    let left = names(dir.path());
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        left[0].starts_with(".gpu.tessera.dev-claim_spare-"),
        "{left:?}"
    );
    assert!(
        !left[0].ends_with(".json"),
        "a runtime's CDI cache skips it"
    );
    // Not a claim, not an orphan, not a stale temp file.
    assert!(specs.claims().unwrap().is_empty());
    assert!(specs.remove_orphans(|_| false).unwrap().is_empty());
    assert!(specs.remove_stale_temp_files().unwrap().is_empty());
    // The next spec goes into it; another process adopts it too.
    let other = ClaimUid::parse("1b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e").unwrap();
    let path = SpecDir::new(dir.path()).write(&other, &spec).unwrap();
    assert_eq!(fs::metadata(&path).unwrap().ino(), inode);
    let back: Spec = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(back, spec);
}

#[test]
fn stale_temp_files_of_dead_writers_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let specs = SpecDir::new(dir.path());
    // pid 0 is never a process; our own pid is alive.
    let dead = dir
        .path()
        .join(format!(".{FILE_PREFIX}{}.json.tmp-0", uid().as_str()));
    let mine = dir.path().join(format!(
        ".{FILE_PREFIX}{}.json.tmp-{}",
        uid().as_str(),
        std::process::id()
    ));
    let foreign = dir.path().join(".other.json.tmp-0");
    for f in [&dead, &mine, &foreign] {
        fs::write(f, b"{").unwrap();
    }
    assert_eq!(specs.remove_stale_temp_files().unwrap(), vec![dead.clone()]);
    assert!(!dead.exists() && mine.exists() && foreign.exists());
}

#[test]
fn orphans_are_removed_and_foreign_files_kept() {
    let dir = tempfile::tempdir().unwrap();
    let specs = SpecDir::new(dir.path());
    let spec = Spec::for_claim(vec![gpu_device("gpu-0")]);
    let keep = ClaimUid::parse("11111111-2222-4333-8444-555555555555").unwrap();
    specs.write(&uid(), &spec).unwrap();
    specs.write(&keep, &spec).unwrap();
    fs::write(dir.path().join("nvidia.com-gpu.json"), b"{}").unwrap();
    assert_eq!(specs.remove_orphans(|c| *c == keep).unwrap(), vec![uid()]);
    assert_eq!(specs.claims().unwrap(), vec![keep]);
    assert!(dir.path().join("nvidia.com-gpu.json").exists());
}
