//! Devices held by claims across changes of the API server's capabilities,
//! the node policy and the inventory: a held device stays published under
//! its name (or, where the server cannot represent it, its GPU publishes
//! nothing else and a note says why), and nothing that could double-book a
//! GPU is published beside it.

use std::collections::BTreeSet;

use tessera_api::inventory::{Gpu, Inventory, Mig};

use super::fixtures::*;
use super::sim::Sim;
use super::*;

fn consumable_only() -> Capabilities {
    Capabilities {
        partitionable_devices: false,
        consumable_capacity: true,
        ..Capabilities::full()
    }
}

fn partitionable_only() -> Capabilities {
    Capabilities {
        partitionable_devices: true,
        consumable_capacity: false,
        ..Capabilities::full()
    }
}

fn with_held(
    inv: &Inventory,
    pol: &NodePolicy,
    caps: Capabilities,
    held: &[&str],
    owned: &[&str],
) -> Model {
    SliceModel::new(inv, pol, caps, "node-a")
        .held_devices(held.iter().map(ToString::to_string))
        .owned_mig_instances(owned.iter().map(ToString::to_string))
        .build()
        .expect("model builds")
}

/// The GPU number in a device name `gpu-<n>[-...]` (tests only: the model
/// itself resolves names through what it generates).
fn gpu_of(name: &str) -> u32 {
    let rest = name.strip_prefix("gpu-").expect("gpu-<n>");
    rest.split('-').next().unwrap().parse().expect("gpu-<n>")
}

/// Names of the devices published for GPU `n`.
/// The work devices of GPU `n` (its monitoring device, which only
/// adminAccess claims get and which consumes nothing, is always there).
fn on_gpu(model: &Model, n: u32) -> BTreeSet<String> {
    assert!(
        model.devices.values().all(|r| r.gpu_index != n)
            || model.devices.contains_key(&naming::monitor_device(n)),
        "GPU {n} has no monitoring device"
    );
    model
        .devices
        .iter()
        .filter(|(_, r)| r.gpu_index == n && r.kind != DeviceKind::Monitor)
        .map(|(name, _)| name.clone())
        .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(ToString::to_string).collect()
}

fn noted(model: &Model, all: &[&str]) -> bool {
    model
        .notes
        .iter()
        .any(|n| all.iter().all(|w| n.message.contains(w)))
}

fn assert_noted(model: &Model, all: &[&str]) {
    assert!(
        noted(model, all),
        "no note with {all:?}; notes: {:#?}",
        model.notes
    );
}

/// What a device is used as: modes of one GPU must never mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    Whole,
    Mig,
    Level(IsolationLevel),
}

fn class(kind: &DeviceKind) -> Class {
    match kind {
        DeviceKind::Whole => Class::Whole,
        DeviceKind::Mig { .. } => Class::Mig,
        DeviceKind::Share { level, .. } | DeviceKind::Replica { level, .. } => Class::Level(*level),
        DeviceKind::Monitor => unreachable!("monitoring devices are not work devices"),
    }
}

/// The invariant, for every GPU with held devices:
///
/// * each held device is published under its name, or it is not and then
///   its GPU publishes nothing but held devices and a note names it;
/// * with the held devices allocated (their counters charged as published
///   now, as the scheduler does), no device of another mode of that GPU can
///   be allocated: it is either not published or refused by the counters.
fn assert_never_double_booked(model: &Model, held: &[&str]) {
    let held_set = set(held);
    let mut sim = Sim::new(&model.slices);
    for h in held {
        sim.hold(h);
    }
    let gpus: BTreeSet<u32> = held.iter().map(|h| gpu_of(h)).collect();
    for n in gpus {
        let published = on_gpu(model, n);
        let held_here: Vec<&str> = held.iter().copied().filter(|h| gpu_of(h) == n).collect();
        for h in &held_here {
            if !published.contains(*h) {
                assert!(
                    published.is_subset(&held_set),
                    "held {h} is not published, yet GPU {n} offers {published:?}"
                );
                assert_noted(model, &[h]);
            }
        }
        let held_classes: BTreeSet<Class> = held_here
            .iter()
            .filter_map(|h| model.devices.get(*h))
            .map(|r| class(&r.kind))
            .collect();
        for name in &published {
            if held_set.contains(name) || held_classes.contains(&class(&model.devices[name].kind)) {
                continue;
            }
            assert!(
                sim.allocate(name, &[]).is_err(),
                "GPU {n}: {name} can be allocated beside held {held_here:?}"
            );
        }
    }
}

fn h100_owned(i: u8, uuid: &str, profile: &str, start: u32) -> Gpu {
    h100(
        i,
        Mig::Enabled {
            profiles: h100_profiles(),
            instances: vec![h100_instance(uuid, profile, start)],
        },
    )
}

/// Six H100s, as a full-model node might hold them: a whole GPU, an
/// Isolated share, a Shared share, a dynamic MIG device not created yet, a
/// dynamic MIG device whose instance exists (ours), and one GPU nothing holds.
fn full_model_node() -> (Inventory, Vec<&'static str>, Vec<&'static str>) {
    let inv = inventory(vec![
        h100_mig_disabled(0),
        h100_mig_disabled(1),
        h100_mig_disabled(2),
        h100_mig_disabled(3),
        h100_owned(4, "MIG-owned-4", "1g.10gb", 2),
        h100_mig_disabled(5),
    ]);
    let held = vec![
        "gpu-0",
        "gpu-1-isolated",
        "gpu-2-shared",
        "gpu-3-mig-3g-40gb-4",
        "gpu-4-mig-1g-10gb-2",
    ];
    (inv, held, vec!["MIG-owned-4"])
}

fn assert_dynamic_mig(model: &Model, name: &str, instance: Option<&str>) {
    match &model.devices[name].kind {
        DeviceKind::Mig {
            existing, dynamic, ..
        } => {
            assert!(*dynamic, "{name} is not dynamic");
            assert_eq!(existing.as_deref(), instance, "{name}");
        }
        other => panic!("{name}: {other:?}"),
    }
}

// ----------------------------------------------- full model -> static mode

#[test]
fn full_to_static_without_consumable_capacity_keeps_held_devices_or_blocks_the_gpu() {
    let (inv, held, owned) = full_model_node();
    // The policy asks for Isolated replicas; held devices decide instead.
    let pol = policy("gpus: [{select: {all: true}, static: {mode: isolated}}]");
    for caps in [Capabilities::legacy(), partitionable_only()] {
        let model = with_held(&inv, &pol, caps, &held, &owned);
        assert!(!model.full);

        assert_eq!(on_gpu(&model, 0), set(&["gpu-0"]));
        assert_noted(&model, &["gpu-0", "overrid"]);

        // A consumable share device cannot be represented without
        // consumable capacity: its GPU offers nothing at all.
        for (n, name) in [(1, "gpu-1-isolated"), (2, "gpu-2-shared")] {
            assert_eq!(on_gpu(&model, n), set(&[]), "{name}");
            assert_noted(&model, &[name, "consumable capacity"]);
        }

        // Dynamic MIG devices stay, without counters.
        assert_eq!(on_gpu(&model, 3), set(&["gpu-3-mig-3g-40gb-4"]));
        assert_dynamic_mig(&model, "gpu-3-mig-3g-40gb-4", None);
        assert!(
            device(&model, "gpu-3-mig-3g-40gb-4")
                .consumes_counters
                .is_none()
        );
        assert_eq!(on_gpu(&model, 4), set(&["gpu-4-mig-1g-10gb-2"]));
        assert_dynamic_mig(&model, "gpu-4-mig-1g-10gb-2", Some("MIG-owned-4"));

        // Nothing held: the policy's static mode.
        assert_eq!(
            on_gpu(&model, 5),
            (0..4).map(|i| format!("gpu-5-isolated-{i}")).collect()
        );
        assert!(counter_sets(&model).is_empty());
        assert_never_double_booked(&model, &held);
    }
}

#[test]
fn full_to_consumable_only_keeps_held_share_devices_multi_allocatable() {
    let (inv, held, owned) = full_model_node();
    let pol = policy("gpus: [{select: {all: true}, static: {mode: whole}}]");
    let model = with_held(&inv, &pol, consumable_only(), &held, &owned);
    assert!(!model.full);
    assert_eq!(on_gpu(&model, 0), set(&["gpu-0"]));
    for (n, name) in [(1, "gpu-1-isolated"), (2, "gpu-2-shared")] {
        assert_eq!(on_gpu(&model, n), set(&[name]));
        let d = device(&model, name);
        assert_eq!(d.allow_multiple_allocations, Some(true), "{name}");
        assert!(d.consumes_counters.is_none());
        assert!(matches!(model.devices[name].kind, DeviceKind::Share { .. }));
        assert_noted(&model, &[name, "overrid"]);
    }
    assert_eq!(on_gpu(&model, 3), set(&["gpu-3-mig-3g-40gb-4"]));
    assert_dynamic_mig(&model, "gpu-3-mig-3g-40gb-4", None);
    assert_eq!(on_gpu(&model, 4), set(&["gpu-4-mig-1g-10gb-2"]));
    assert_dynamic_mig(&model, "gpu-4-mig-1g-10gb-2", Some("MIG-owned-4"));
    assert_eq!(on_gpu(&model, 5), set(&["gpu-5"]));
    assert_never_double_booked(&model, &held);
}

#[test]
fn owned_mig_instance_keeps_its_gpu_in_mig_mode_when_policy_drops_mig() {
    // Static mode, policy without mig: the instance a claim uses stays.
    let inv = inventory(vec![h100_owned(0, "MIG-owned-0", "3g.40gb", 4)]);
    let pol = policy("gpus: [{select: {all: true}, modes: [whole, isolated]}]");
    for caps in [Capabilities::legacy(), consumable_only()] {
        let model = with_held(&inv, &pol, caps, &[], &["MIG-owned-0"]);
        assert_eq!(on_gpu(&model, 0), set(&["gpu-0-mig-3g-40gb-4"]));
        assert_dynamic_mig(&model, "gpu-0-mig-3g-40gb-4", Some("MIG-owned-0"));
    }
}

// ----------------------------------------------- static mode -> full model

#[test]
fn static_to_full_keeps_held_static_devices_and_nothing_conflicts() {
    let inv = inventory(vec![
        h100_mig_disabled(0),
        h100_mig_disabled(1),
        h100_mig_disabled(2),
        h100_mig_disabled(3),
        h100(
            4,
            Mig::Enabled {
                profiles: h100_profiles(),
                instances: vec![h100_instance("MIG-operator-4", "3g.40gb", 0)],
            },
        ),
    ]);
    let held = [
        // legacy server: a whole GPU, Isolated and Shared replicas, an
        // instance an operator made
        "gpu-0",
        "gpu-1-isolated-0",
        "gpu-1-isolated-2",
        "gpu-2-shared-1",
        "gpu-4-mig-3g-40gb-0",
        // consumable capacity only: a static share device
        "gpu-3-isolated",
    ];
    let model = with_held(
        &inv,
        &NodePolicy::default(),
        Capabilities::full(),
        &held,
        &[],
    );
    assert!(model.full);

    // Replicas have no place in the full model: the GPU keeps exactly the
    // held replicas, without counters, until they are released.
    assert_eq!(
        on_gpu(&model, 1),
        set(&["gpu-1-isolated-0", "gpu-1-isolated-2"])
    );
    assert_eq!(on_gpu(&model, 2), set(&["gpu-2-shared-1"]));
    for name in ["gpu-1-isolated-2", "gpu-2-shared-1"] {
        assert!(matches!(
            model.devices[name].kind,
            DeviceKind::Replica { .. }
        ));
        assert!(device(&model, name).consumes_counters.is_none());
    }
    let sets = counter_sets(&model);
    assert!(!sets.contains_key("gpu-1") && !sets.contains_key("gpu-2"));
    assert_noted(&model, &["gpu-1-isolated-0", "replica"]);

    // Whole GPU, share device and operator instance exist in the full model
    // too; the counters keep everything else of their GPU out.
    for name in ["gpu-0", "gpu-3-isolated", "gpu-4-mig-3g-40gb-0"] {
        assert!(model.devices.contains_key(name), "{name}");
    }
    assert!(device(&model, "gpu-3-isolated").consumes_counters.is_some());
    assert_never_double_booked(&model, &held);
}

// ---------------------------------------------------------- policy changes

#[test]
fn static_policy_change_keeps_the_held_mode() {
    let inv = inventory((0..4).map(h100_mig_disabled).collect());
    // Shares and MIG removed, replicas halved.
    let pol =
        policy("gpus: [{select: {all: true}, modes: [whole], static: {mode: whole, replicas: 2}}]");
    let held = ["gpu-0-isolated-3", "gpu-1-shared-1", "gpu-2-mig-3g-40gb-0"];
    let model = with_held(&inv, &pol, Capabilities::legacy(), &held, &[]);
    // Replica 3 of 4 is beyond the new count: only it stays.
    assert_eq!(on_gpu(&model, 0), set(&["gpu-0-isolated-3"]));
    assert_noted(&model, &["gpu-0-isolated-3"]);
    // Replica 1 of 2: the Shared replica layout stays.
    assert_eq!(
        on_gpu(&model, 1),
        set(&["gpu-1-shared-0", "gpu-1-shared-1"])
    );
    assert_eq!(on_gpu(&model, 2), set(&["gpu-2-mig-3g-40gb-0"]));
    assert_eq!(on_gpu(&model, 3), set(&["gpu-3"]));
    assert_never_double_booked(&model, &held);

    // Consumable capacity only: the held share device stays, alone.
    let held = ["gpu-0-isolated", "gpu-1-shared"];
    let model = with_held(&inv, &pol, consumable_only(), &held, &[]);
    assert_eq!(on_gpu(&model, 0), set(&["gpu-0-isolated"]));
    assert_eq!(on_gpu(&model, 1), set(&["gpu-1-shared"]));
    assert_eq!(on_gpu(&model, 2), set(&["gpu-2"]));
    assert_never_double_booked(&model, &held);
}

#[test]
fn full_policy_change_keeps_held_mig_devices() {
    // MIG off on an H100 and the policy stops switching MIG mode (and
    // offering MIG): the held placement stays, with its counters.
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let pol = policy(
        "gpus: [{select: {all: true}, modes: [whole, isolated, shared], migModeSwitch: false}]",
    );
    let held = ["gpu-0-mig-3g-40gb-4"];
    let model = with_held(&inv, &pol, Capabilities::full(), &held, &[]);
    assert!(model.devices.contains_key("gpu-0-mig-3g-40gb-4"));
    assert!(
        device(&model, "gpu-0-mig-3g-40gb-4")
            .consumes_counters
            .is_some()
    );
    assert!(model.devices.contains_key("gpu-0"));
    assert_never_double_booked(&model, &held);
}

// ------------------------------------------------------- inventory changes

#[test]
fn held_devices_of_a_vanished_gpu_are_noted() {
    let both = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(1)]);
    let first = full(&both);
    let one = inventory(vec![h100_mig_disabled(0)]);
    let model = SliceModel::new(&one, &NodePolicy::default(), Capabilities::full(), "node-a")
        .previous_indices(first.gpu_indices.clone())
        .held_devices(["gpu-1-isolated".to_string(), "gpu-0".to_string()])
        .build()
        .unwrap();
    assert!(on_gpu(&model, 1).is_empty());
    assert!(model.devices.contains_key("gpu-0"));
    assert_noted(&model, &["gpu-1-isolated", "not in the inventory"]);
}

#[test]
fn a_new_gpu_does_not_take_the_number_of_a_vanished_gpu_with_held_devices() {
    let both = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(1)]);
    let first = full(&both);
    let replaced = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(2)]);
    let model = SliceModel::new(
        &replaced,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
    )
    .previous_indices(first.gpu_indices.clone())
    .held_devices(["gpu-1-shared".to_string()])
    .build()
    .unwrap();
    // gpu-1-shared named the vanished card; a new card under that name
    // would hand its claim someone else's GPU.
    assert_eq!(model.gpu_indices[&h100_mig_disabled(2).uuid], 2);
    assert!(!model.devices.contains_key("gpu-1-shared"));
    assert_noted(&model, &["gpu-1-shared", "not in the inventory"]);
}

#[test]
fn held_dynamic_mig_stays_when_a_foreign_instance_appears_over_it() {
    // Held 1g.10gb at slice 3 (not created yet); an operator then made a
    // 3g.40gb over slices 0-3.
    let inv = inventory(vec![h100(
        0,
        Mig::Enabled {
            profiles: h100_profiles(),
            instances: vec![h100_instance("MIG-operator-0", "3g.40gb", 0)],
        },
    )]);
    let held = ["gpu-0-mig-1g-10gb-3"];
    for caps in [Capabilities::full(), Capabilities::legacy()] {
        let model = with_held(&inv, &NodePolicy::default(), caps, &held, &[]);
        let names = on_gpu(&model, 0);
        assert!(names.contains("gpu-0-mig-1g-10gb-3"), "{names:?}");
        assert_dynamic_mig(&model, "gpu-0-mig-1g-10gb-3", None);
        // The operator's instance overlaps it: not offered while held.
        assert!(!names.contains("gpu-0-mig-3g-40gb-0"), "{names:?}");
        assert_noted(&model, &["MIG-operator-0", "gpu-0-mig-1g-10gb-3"]);
        assert_never_double_booked(&model, &held);
    }
}

/// The A100 layout with a second compute instance in the 3g.20gb GPU
/// instance at slices 4-7.
fn a100_two_compute_instances(keep_second: bool) -> Gpu {
    let mut gpu = a100_with_instances();
    if let Mig::Enabled { instances, .. } = &mut gpu.mig {
        let first = instances.iter().find(|i| i.profile == "3g.20gb").unwrap();
        let mut second = first.clone();
        second.uuid = "MIG-00000000-aaaa-4aaa-8aaa-000000000004".into();
        second.compute_instance_id = 1;
        if keep_second {
            instances.push(second);
        }
    }
    gpu
}

#[test]
fn held_static_mig_instances_keep_their_names_or_are_noted_when_gone() {
    let before = inventory(vec![a100_two_compute_instances(true)]);
    let model = full(&before);
    assert!(model.devices.contains_key("gpu-0-mig-3g-20gb-4-ci0"));
    assert!(model.devices.contains_key("gpu-0-mig-3g-20gb-4-ci1"));

    // The second compute instance is gone: the first keeps the name its
    // claim holds, the second cannot be published.
    let after = inventory(vec![a100_two_compute_instances(false)]);
    let held = [
        "gpu-0-mig-3g-20gb-4-ci0",
        "gpu-0-mig-3g-20gb-4-ci1",
        "gpu-0-mig-9g-99gb-0",
    ];
    for caps in [Capabilities::full(), Capabilities::legacy()] {
        let model = with_held(&after, &NodePolicy::default(), caps, &held, &[]);
        let names = on_gpu(&model, 0);
        assert!(names.contains("gpu-0-mig-3g-20gb-4-ci0"), "{names:?}");
        assert!(!names.contains("gpu-0-mig-3g-20gb-4"), "{names:?}");
        assert!(!names.contains("gpu-0-mig-3g-20gb-4-ci1"), "{names:?}");
        assert_noted(&model, &["gpu-0-mig-3g-20gb-4-ci1", "not published"]);
        assert_noted(&model, &["gpu-0-mig-9g-99gb-0", "not published"]);
    }
}

#[test]
fn static_mode_creating_a_held_mig_device_rewrites_nothing() {
    // Two dynamic devices held across a flip to a legacy server; prepare
    // then creates the second one. The slices stay byte-identical.
    let before = inventory(vec![h100_mig_disabled(0)]);
    let after = inventory(vec![h100_owned(0, "MIG-owned-0", "3g.40gb", 4)]);
    let held = ["gpu-0-mig-1g-10gb-0", "gpu-0-mig-3g-40gb-4"];
    let pol = NodePolicy::default();
    let m1 = with_held(&before, &pol, Capabilities::legacy(), &held, &[]);
    let m2 = with_held(
        &after,
        &pol,
        Capabilities::legacy(),
        &held,
        &["MIG-owned-0"],
    );
    assert_eq!(on_gpu(&m1, 0), set(&held));
    assert_eq!(m1.slices, m2.slices);
    assert_dynamic_mig(&m2, "gpu-0-mig-3g-40gb-4", Some("MIG-owned-0"));
    assert_dynamic_mig(&m2, "gpu-0-mig-1g-10gb-0", None);
}
