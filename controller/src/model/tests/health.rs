//! Monitoring devices (every GPU, every model, whatever claims hold) and
//! the taints an unhealthy GPU's devices carry.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::Device;
use tessera_api::names::device_type;

use super::fixtures::*;
use super::sim::Sim;
use super::*;

fn with(
    inv: &Inventory,
    pol: &NodePolicy,
    caps: Capabilities,
    held: &[&str],
    unhealthy: &[(&str, &str)],
) -> Model {
    SliceModel::new(inv, pol, caps, "node-a")
        .held_devices(held.iter().map(ToString::to_string))
        .unhealthy_gpus(
            unhealthy
                .iter()
                .map(|(gpu, reason)| {
                    (
                        gpu.to_string(),
                        Unhealthy {
                            reason: reason.to_string(),
                            since: 1_700_000_000,
                        },
                    )
                })
                .collect(),
        )
        .build()
        .expect("model builds")
}

fn devices_of(model: &Model) -> BTreeMap<String, Device> {
    model
        .slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| (d.name.clone(), d.clone()))
        .collect()
}

fn consumable_only() -> Capabilities {
    Capabilities {
        partitionable_devices: false,
        ..Capabilities::full()
    }
}

#[test]
fn monitoring_devices_exist_for_every_gpu_in_every_model() {
    let inv = inventory(vec![h100_mig_disabled(0), a100_with_instances(), t4()]);
    for caps in [
        Capabilities::full(),
        Capabilities::legacy(),
        consumable_only(),
    ] {
        let model = with(&inv, &NodePolicy::default(), caps, &[], &[]);
        let devices = devices_of(&model);
        for (n, gpu) in inv.gpus.iter().enumerate() {
            let name = naming::monitor_device(model.gpu_indices[&gpu.uuid]);
            let d = devices
                .get(&name)
                .unwrap_or_else(|| panic!("GPU {n}: no {name} ({caps:?})"));
            let attrs = d.attributes.as_ref().unwrap();
            assert_eq!(attrs["type"].string.as_deref(), Some(device_type::MONITOR));
            assert_eq!(attrs["uuid"].string.as_deref(), Some(gpu.uuid.as_str()));
            assert!(d.consumes_counters.is_none(), "{name} consumes counters");
            assert!(d.capacity.is_none(), "{name} has capacity");
            assert_eq!(d.allow_multiple_allocations, None);
            assert_eq!(model.devices[&name].kind, DeviceKind::Monitor);
            assert_eq!(model.devices[&name].gpu_uuid, gpu.uuid);
        }
    }
}

#[test]
fn a_monitoring_device_is_free_whatever_holds_its_gpu() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = with(&inv, &NodePolicy::default(), Capabilities::full(), &[], &[]);
    // Whatever mode a workload holds the GPU in (its counters charged),
    // the monitoring device still fits: admin access only checks counters.
    for held in ["gpu-0", "gpu-0-isolated", "gpu-0-mig-7g-80gb-0"] {
        let mut sim = Sim::new(&model.slices);
        sim.allocate(held, &[]).unwrap();
        sim.allocate("gpu-0-monitor", &[])
            .unwrap_or_else(|e| panic!("monitor beside {held}: {e}"));
    }
}

#[test]
fn holding_a_monitoring_device_decides_nothing() {
    let inv = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(1)]);
    for caps in [
        Capabilities::full(),
        Capabilities::legacy(),
        consumable_only(),
    ] {
        let free = with(&inv, &NodePolicy::default(), caps, &[], &[]);
        let held = with(
            &inv,
            &NodePolicy::default(),
            caps,
            &["gpu-0-monitor", "gpu-1-monitor"],
            &[],
        );
        assert_eq!(free.slices, held.slices, "{caps:?}");
        assert_eq!(held.notes, free.notes);
    }
    // A held monitor of a GPU that is gone keeps its number reserved.
    let gone = inventory(vec![h100_mig_disabled(1)]);
    let previous = with(&inv, &NodePolicy::default(), Capabilities::full(), &[], &[])
        .gpu_indices
        .clone();
    let model = SliceModel::new(
        &gone,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
    )
    .previous_indices(previous)
    .held_devices(["gpu-0-monitor".to_string()])
    .build()
    .unwrap();
    assert!(model.devices.contains_key("gpu-1-monitor"));
    assert!(!model.devices.contains_key("gpu-0-monitor"));
    assert!(
        model
            .notes
            .iter()
            .any(|n| n.message.contains("gpu-0-monitor")),
        "{:?}",
        model.notes
    );
}

#[test]
fn an_unhealthy_gpus_devices_are_tainted_and_untainted_when_it_recovers() {
    let inv = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(1)]);
    let sick = inv.gpus[1].uuid.clone();
    let healthy = with(&inv, &NodePolicy::default(), Capabilities::full(), &[], &[]);
    let model = with(
        &inv,
        &NodePolicy::default(),
        Capabilities::full(),
        &[],
        &[(&sick, "xid-79")],
    );
    check_pool(&model.slices, &Capabilities::full().limits).unwrap();
    let mut tainted = BTreeSet::new();
    for (name, d) in devices_of(&model) {
        let on_sick = model.devices[&name].gpu_uuid == sick;
        match d.taints.as_deref() {
            None => assert!(!on_sick, "{name} of the unhealthy GPU is not tainted"),
            Some([t]) => {
                assert!(on_sick, "{name} of a healthy GPU is tainted");
                assert_eq!(t.key, "gpu.tessera.dev/unhealthy");
                assert_eq!(t.value.as_deref(), Some("xid-79"));
                let want = if name == "gpu-1-monitor" {
                    "None"
                } else {
                    "NoSchedule"
                };
                assert_eq!(t.effect, want, "{name}");
                assert!(t.time_added.is_some());
                tainted.insert(name);
            }
            Some(other) => panic!("{name}: {other:?}"),
        }
    }
    assert_eq!(tainted.len(), 29);
    // The names, counters and everything else are those of the healthy model.
    assert_eq!(model.devices, healthy.devices);
    // Recovered: exactly the healthy slices again.
    let recovered = with(&inv, &NodePolicy::default(), Capabilities::full(), &[], &[]);
    assert_eq!(recovered.slices, healthy.slices);
}

#[test]
fn no_taints_where_the_server_drops_them() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let sick = inv.gpus[0].uuid.clone();
    let caps = Capabilities {
        device_taints: false,
        ..Capabilities::full()
    };
    let healthy = with(&inv, &NodePolicy::default(), caps, &[], &[]);
    let model = with(
        &inv,
        &NodePolicy::default(),
        caps,
        &[],
        &[(&sick, "xid-79")],
    );
    assert_eq!(model.slices, healthy.slices);
}

#[test]
fn tainted_devices_fit_the_lower_per_slice_limit() {
    // Static replicas consume no counters: up to 128 devices per slice,
    // but only 64 once any of them carries a taint.
    let inv = inventory(vec![t4()]);
    let pol = policy("gpus: [{select: {all: true}, static: {mode: isolated, replicas: 64}}]");
    let caps = Capabilities {
        device_taints: true,
        ..Capabilities::legacy()
    };
    let healthy = with(&inv, &pol, caps, &[], &[]);
    assert_eq!(healthy.devices.len(), 65);
    assert_eq!(healthy.slices.len(), 1);
    let sick = with(&inv, &pol, caps, &[], &[(&inv.gpus[0].uuid, "xid-48")]);
    check_pool(&sick.slices, &caps.limits).unwrap();
    assert_eq!(sick.slices.len(), 2);
    assert!(
        sick.slices
            .iter()
            .all(|s| s.spec.devices.as_ref().is_some_and(|d| d.len() <= 64))
    );
}

#[test]
fn check_pool_refuses_invalid_taints() {
    let inv = inventory(vec![t4()]);
    let mut model = with(
        &inv,
        &NodePolicy::default(),
        Capabilities::full(),
        &[],
        &[(&inv.gpus[0].uuid, "xid-79")],
    );
    let limits = Capabilities::full().limits;
    check_pool(&model.slices, &limits).unwrap();
    let slice = model
        .slices
        .iter_mut()
        .find(|s| s.spec.devices.is_some())
        .unwrap();
    let device = &mut slice.spec.devices.as_mut().unwrap()[0];
    device.taints.as_mut().unwrap()[0].effect = "PreferNoSchedule".into();
    assert!(check_pool(&model.slices, &limits).is_err());
}
