//! `tessera slices`: the ResourceSlices a node would publish, computed from
//! the simulated GPUs without an API server.

mod common;

use common::*;
use serde_json::Value;

fn slices_json(topology: &str, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["slices", "--node-name", "node-a", "-o", "json"];
    args.extend(extra);
    let out = tessera(&common::topology(topology), &args);
    assert!(
        out.status.success(),
        "tessera slices failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout).expect("JSON list");
    assert_eq!(list["kind"], "List");
    list["items"].as_array().expect("items").clone()
}

fn devices(slices: &[Value]) -> Vec<&Value> {
    slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .collect()
}

#[test]
fn full_model_for_eight_h100s() {
    let slices = slices_json("h100x8.yaml", &[]);
    // One counter slice, then the GPUs' 29 devices each (whole, 2 shares,
    // 25 MIG placements, the monitoring device) in slices of 64: 232 in 4.
    assert_eq!(slices.len(), 5);
    assert_eq!(
        slices[0]["spec"]["sharedCounters"].as_array().map(Vec::len),
        Some(8)
    );
    assert!(slices[0]["spec"]["devices"].is_null());
    assert_eq!(devices(&slices).len(), 8 * 29);
    for s in &slices {
        assert_eq!(s["spec"]["nodeName"], "node-a");
        assert_eq!(s["spec"]["driver"], "gpu.tessera.dev");
        assert_eq!(s["spec"]["pool"]["resourceSliceCount"], 5);
    }
    // Whole GPUs come first, in GPU order, then the shares: the scheduler
    // walks devices in this order.
    let mut want: Vec<String> = (0..8).map(|n| format!("gpu-{n}")).collect();
    want.push("gpu-0-isolated".into());
    let first: Vec<&str> = devices(&slices)
        .into_iter()
        .take(9)
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(first, want);
    let isolated = devices(&slices)
        .into_iter()
        .find(|d| d["name"] == "gpu-0-isolated")
        .expect("gpu-0-isolated");
    assert_eq!(isolated["allowMultipleAllocations"], true);
    assert!(isolated["consumesCounters"].is_array());
    // Monitoring holds nothing: it consumes no counters and is not shared.
    let monitor = devices(&slices)
        .into_iter()
        .find(|d| d["name"] == "gpu-0-monitor")
        .expect("gpu-0-monitor");
    assert!(monitor["consumesCounters"].is_null(), "{monitor}");
}

#[test]
fn legacy_is_static_without_counters_or_multi_allocation() {
    for topology in [
        "t4.yaml",
        "l4x2.yaml",
        "a100-40gb-x2-mig.yaml",
        "h100x8-mig.yaml",
    ] {
        let slices = slices_json(topology, &["--legacy"]);
        assert!(!slices.is_empty(), "{topology}");
        for s in &slices {
            assert!(s["spec"]["sharedCounters"].is_null(), "{topology}");
        }
        for d in devices(&slices) {
            assert!(d["consumesCounters"].is_null(), "{topology}: {d}");
            assert!(d["allowMultipleAllocations"].is_null(), "{topology}: {d}");
        }
    }
}

#[test]
fn policy_and_driver_name_are_applied() {
    let policy = write_topology(
        "slices-policy.yaml",
        "gpus:\n  - select: {all: true}\n    modes: [whole]\n",
    );
    let policy = policy.display().to_string();
    let slices = slices_json(
        "l4x2.yaml",
        &["--policy", &policy, "--driver-name", "gpu.example.com"],
    );
    let names: Vec<&str> = devices(&slices)
        .iter()
        .filter_map(|d| d["name"].as_str())
        .collect();
    // `whole` only, and a monitoring device per GPU in every mode (after
    // every GPU: the scheduler walks devices in that order).
    assert_eq!(names, ["gpu-0", "gpu-1", "gpu-0-monitor", "gpu-1-monitor"]);
    assert!(
        slices
            .iter()
            .all(|s| s["spec"]["driver"] == "gpu.example.com")
    );
}

#[test]
fn bad_policy_is_a_clear_error() {
    let policy = write_topology("slices-bad-policy.yaml", "gpus:\n  - select: {}\n");
    let policy = policy.display().to_string();
    let out = tessera(
        &topology("t4.yaml"),
        &["slices", "--node-name", "n", "--policy", &policy],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gpus[0].select"), "{err}");
}

#[test]
fn yaml_output_is_documents_with_quoted_pci_ids() {
    let out = tessera(&topology("t4.yaml"), &["slices", "--node-name", "node-a"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("---\n").count(), 2, "{text}");
    assert!(text.contains("kind: ResourceSlice"));
    assert!(
        text.lines()
            .any(|l| l.trim().starts_with("string: '0000:") && l.trim().ends_with('\'')),
        "PCI bus id not quoted:\n{text}"
    );
}

/// A GPU from before Volta (a P100): MPS gives its clients neither address
/// spaces of their own nor limits there, so no Isolated share is published,
/// and `tessera status` says why.
#[test]
fn pre_volta_gpu_publishes_no_isolated_share_and_status_says_why() {
    let slices = slices_json("p100.yaml", &[]);
    let names: Vec<&str> = devices(&slices)
        .iter()
        .filter_map(|d| d["name"].as_str())
        .collect();
    assert!(names.contains(&"gpu-0"), "{names:?}");
    assert!(names.contains(&"gpu-0-shared"), "{names:?}");
    assert!(!names.contains(&"gpu-0-isolated"), "{names:?}");

    let state_dir = scratch_dir("status-pre-volta");
    let boot_id = state_dir.join("boot_id");
    std::fs::write(&boot_id, "boot\n").unwrap();
    let out = tessera(
        &topology("p100.yaml"),
        &[
            "status",
            "--no-api",
            "--state-dir",
            state_dir.to_str().unwrap(),
            "--boot-id-file",
            boot_id.to_str().unwrap(),
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "no Isolated shares: compute capability 6.0 is before Volta (7.0), where MPS gives \
             its clients neither address spaces of their own nor limits"
        ),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A Volta-or-newer GPU says nothing of the kind.
    let t4 = tessera(
        &topology("t4.yaml"),
        &[
            "status",
            "--no-api",
            "--state-dir",
            state_dir.to_str().unwrap(),
            "--boot-id-file",
            boot_id.to_str().unwrap(),
        ],
    );
    let text = String::from_utf8_lossy(&t4.stdout);
    assert!(text.contains("Tesla T4"), "{text}");
    assert!(!text.contains("no Isolated shares"), "{text}");
    let _ = std::fs::remove_dir_all(&state_dir);
}
