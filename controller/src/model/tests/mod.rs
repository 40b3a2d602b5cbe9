//! Model-level tests with hand-built inventories.

mod fixtures;
mod health;
mod held;
mod sim;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use tessera_api::inventory::{Inventory, Mig};

use super::counters::memory_slice;
use super::devices::{SHARE_MEMORY_STEP, attr, cap};
use super::plan::mps_isolation_unsupported;
use super::quantity::parse_integer;
use super::slices::check_pool;
use super::*;
use fixtures::*;
use sim::Sim;

const GIB: u64 = 1024 * 1024 * 1024;
const MIB: u64 = 1024 * 1024;

fn build(inventory: &Inventory, policy: &NodePolicy, caps: Capabilities) -> Model {
    SliceModel::new(inventory, policy, caps, "node-a")
        .build()
        .expect("model builds")
}

fn full(inventory: &Inventory) -> Model {
    build(inventory, &NodePolicy::default(), Capabilities::full())
}

fn policy(yaml: &str) -> NodePolicy {
    NodePolicy::from_yaml(yaml).expect("policy decodes")
}

fn all_devices(slices: &[ResourceSlice]) -> Vec<&Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect()
}

/// The published work devices (every GPU's monitoring device left out:
/// `monitoring_devices_*` tests check those).
fn names(model: &Model) -> BTreeSet<String> {
    all_devices(&model.slices)
        .into_iter()
        .map(|d| d.name.clone())
        .filter(|n| !n.ends_with("-monitor"))
        .collect()
}

fn device<'a>(model: &'a Model, name: &str) -> &'a Device {
    all_devices(&model.slices)
        .into_iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("device {name} not published; have {:?}", names(model)))
}

fn string_attr<'a>(d: &'a Device, key: &str) -> Option<&'a str> {
    d.attributes.as_ref()?.get(key)?.string.as_deref()
}

fn version_attr<'a>(d: &'a Device, key: &str) -> Option<&'a str> {
    d.attributes.as_ref()?.get(key)?.version.as_deref()
}

fn capacity(d: &Device, key: &str) -> u64 {
    parse_integer(&d.capacity.as_ref().unwrap()[key].value).unwrap()
}

fn counter_sets(model: &Model) -> BTreeMap<String, BTreeMap<String, u64>> {
    model
        .slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .map(|set| {
            let counters = set
                .counters
                .iter()
                .map(|(k, v)| (k.clone(), parse_integer(&v.value).unwrap()))
                .collect();
            (set.name.clone(), counters)
        })
        .collect()
}

// ---------------------------------------------------------------- devices

#[test]
fn h100_without_mig_publishes_whole_shares_and_every_placement() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let names = names(&model);

    for expected in [
        "gpu-0",
        "gpu-0-isolated",
        "gpu-0-shared",
        "gpu-0-mig-1g-10gb-0",
        "gpu-0-mig-1g-10gb-6",
        "gpu-0-mig-1g-10gb-me-3",
        "gpu-0-mig-1g-20gb-6",
        "gpu-0-mig-2g-20gb-4",
        "gpu-0-mig-3g-40gb-4",
        "gpu-0-mig-4g-40gb-0",
        "gpu-0-mig-7g-80gb-0",
    ] {
        assert!(names.contains(expected), "{expected} missing");
    }
    // 7 + 7 + 4 + 3 + 2 + 1 + 1 placements, whole, two shares.
    assert_eq!(names.len(), 25 + 3);
    assert!(
        !names.contains("gpu-0-mig-1g-10gb-7"),
        "no placement at slice 7"
    );
    assert!(model.full);
    assert_eq!(model.devices["gpu-0"].kind, DeviceKind::Whole);
}

#[test]
fn whole_gpu_attributes_are_nvidia_compatible_and_valid() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let gpu = device(&model, "gpu-0");
    assert_eq!(string_attr(gpu, attr::TYPE), Some("gpu"));
    assert_eq!(
        string_attr(gpu, attr::UUID),
        Some(inv.gpus[0].uuid.as_str())
    );
    assert_eq!(
        string_attr(gpu, attr::PRODUCT_NAME),
        Some("NVIDIA H100 80GB HBM3")
    );
    assert_eq!(string_attr(gpu, attr::BRAND), Some("nvidia"));
    assert_eq!(string_attr(gpu, attr::ARCHITECTURE), Some("hopper"));
    assert_eq!(
        version_attr(gpu, attr::CUDA_COMPUTE_CAPABILITY),
        Some("9.0.0")
    );
    assert_eq!(version_attr(gpu, attr::DRIVER_VERSION), Some("550.90.7"));
    assert_eq!(version_attr(gpu, attr::CUDA_DRIVER_VERSION), Some("12.4.0"));
    assert_eq!(string_attr(gpu, attr::PCI_BUS_ID), Some("0000:18:00.0"));
    assert_eq!(capacity(gpu, cap::MEMORY), 81559 * MIB);
    assert_eq!(
        gpu.capacity.as_ref().unwrap()[cap::MEMORY].value.0,
        "81559Mi"
    );
    assert_eq!(capacity(gpu, cap::MULTIPROCESSORS), 132);
    assert_eq!(gpu.allow_multiple_allocations, None);
    // No unstable identifiers.
    let attrs = gpu.attributes.as_ref().unwrap();
    assert!(!attrs.contains_key("index") && !attrs.contains_key("minor"));
}

#[test]
fn pci_bus_id_only_on_whole_gpus() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    for d in all_devices(&model.slices) {
        let has = string_attr(d, attr::PCI_BUS_ID).is_some();
        assert_eq!(has, d.name == "gpu-0", "{}", d.name);
    }
}

/// NVIDIA's `pcieBusID`: the card's bus id on the whole GPU and on every
/// MIG device of it (as NVIDIA's driver publishes it), on nothing else.
#[test]
fn nvidia_pcie_bus_id_on_whole_gpus_and_mig_devices() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let mut migs = 0;
    for d in all_devices(&model.slices) {
        let kind = string_attr(d, attr::TYPE);
        let want = matches!(kind, Some("gpu") | Some("mig")).then_some("0000:18:00.0");
        assert_eq!(string_attr(d, attr::PCIE_BUS_ID), want, "{}", d.name);
        migs += usize::from(kind == Some("mig"));
    }
    assert!(migs > 0);
}

#[test]
fn mig_device_attributes_and_capacities() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let me = device(&model, "gpu-0-mig-1g-10gb-me-2");
    assert_eq!(string_attr(me, attr::TYPE), Some("mig"));
    assert_eq!(string_attr(me, attr::PROFILE), Some("1g.10gb+me"));
    assert_eq!(
        string_attr(me, attr::PARENT_UUID),
        Some(inv.gpus[0].uuid.as_str())
    );
    assert_eq!(
        string_attr(me, attr::UUID),
        None,
        "dynamic devices have no UUID yet"
    );
    assert_eq!(version_attr(me, attr::DRIVER_VERSION), Some("550.90.7"));
    assert_eq!(capacity(me, cap::MEMORY), 9984 * MIB);
    assert_eq!(capacity(me, cap::MULTIPROCESSORS), 16);
    assert_eq!(capacity(me, cap::OFA_ENGINES), 1);
    assert_eq!(capacity(me, cap::DECODERS), 7);
    assert_eq!(capacity(me, cap::COPY_ENGINES), 1);
    match &model.devices["gpu-0-mig-1g-10gb-me-2"].kind {
        DeviceKind::Mig {
            profile_id,
            placement,
            dynamic,
            existing,
            ..
        } => {
            assert_eq!(*profile_id, 20);
            assert_eq!((placement.start, placement.size), (2, 1));
            assert!(*dynamic);
            assert_eq!(*existing, None);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn share_devices_have_levels_and_consumable_capacity() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let iso = device(&model, "gpu-0-isolated");
    let shr = device(&model, "gpu-0-shared");
    for d in [iso, shr] {
        assert_eq!(d.allow_multiple_allocations, Some(true));
        assert_eq!(string_attr(d, attr::TYPE), Some("share"));
        assert_eq!(
            string_attr(d, attr::PARENT_UUID),
            Some(inv.gpus[0].uuid.as_str())
        );
        assert_eq!(capacity(d, cap::CORES), 100);
        // Only consumable capacities: anything without a policy would be
        // consumed in full by every claim.
        for (name, c) in d.capacity.as_ref().unwrap() {
            assert!(c.request_policy.is_some(), "{name} has no request policy");
        }
    }
    // Shared: the whole card. Isolated: less the default 64 MiB for each of
    // the (at most 100) claims' MPS servers, in whole steps.
    assert_eq!(capacity(shr, cap::MEMORY), 81559 * MIB);
    assert_eq!(capacity(iso, cap::MEMORY), 75008 * MIB);
    assert_eq!(string_attr(iso, attr::ISOLATION_LEVEL), Some("Isolated"));
    assert_eq!(string_attr(iso, attr::ISOLATION_PROVIDER), Some("mps"));
    assert_eq!(string_attr(iso, attr::TIME_SLICE), None);
    assert_eq!(string_attr(shr, attr::ISOLATION_LEVEL), Some("Shared"));
    assert_eq!(string_attr(shr, attr::ISOLATION_PROVIDER), None);
    assert_eq!(string_attr(shr, attr::TIME_SLICE), Some("Default"));
}

#[test]
fn share_request_policies_satisfy_api_validation() {
    for gpu in [h100_mig_disabled(0), t4()] {
        let inv = inventory(vec![gpu]);
        let model = full(&inv);
        for name in ["gpu-0-isolated", "gpu-0-shared"] {
            let d = device(&model, name);
            for (cap_name, c) in d.capacity.as_ref().unwrap() {
                let value = parse_integer(&c.value).unwrap();
                let p = c.request_policy.as_ref().unwrap();
                let range = p.valid_range.as_ref().unwrap();
                let default = parse_integer(p.default.as_ref().unwrap()).unwrap();
                let min = parse_integer(&range.min).unwrap();
                let max = parse_integer(range.max.as_ref().unwrap()).unwrap();
                let step = parse_integer(range.step.as_ref().unwrap()).unwrap();
                let ctx = format!("{name}/{cap_name}");
                assert!(min <= value && max <= value && min <= max, "{ctx}");
                assert!(min <= default && default <= max, "{ctx}");
                assert!(min + step <= value, "{ctx}");
                assert_eq!((default - min) % step, 0, "{ctx}");
                assert_eq!((max - min) % step, 0, "{ctx}");
            }
            let mem = &d.capacity.as_ref().unwrap()[cap::MEMORY];
            let p = mem.request_policy.as_ref().unwrap();
            assert_eq!(
                parse_integer(p.valid_range.as_ref().unwrap().step.as_ref().unwrap()),
                Some(SHARE_MEMORY_STEP)
            );
            // Default 10% of the card, rounded down to the step.
            let default = parse_integer(p.default.as_ref().unwrap()).unwrap();
            let total = inv.gpus[0].memory_bytes;
            assert!(default <= total / 10 && default + SHARE_MEMORY_STEP > total / 10);
        }
    }
}

#[test]
fn t4_is_whole_plus_shares_never_dropped() {
    let inv = inventory(vec![t4()]);
    let model = full(&inv);
    assert_eq!(
        names(&model),
        BTreeSet::from([
            "gpu-0".into(),
            "gpu-0-isolated".into(),
            "gpu-0-shared".into()
        ])
    );
    let sets = counter_sets(&model);
    assert_eq!(
        sets["gpu-0"],
        BTreeMap::from([(memory_slice(0), 1)]),
        "one token standing for the whole framebuffer"
    );
    assert_eq!(
        version_attr(device(&model, "gpu-0"), attr::CUDA_COMPUTE_CAPABILITY),
        Some("7.5.0")
    );
    assert_eq!(
        string_attr(device(&model, "gpu-0"), attr::PCI_BUS_ID),
        Some("0000:3b:00.0")
    );
}

#[test]
fn a100_with_existing_instances_publishes_them_static_and_blocks_overlaps() {
    let inv = inventory(vec![a100_with_instances()]);
    let model = full(&inv);
    let names = names(&model);
    // Existing instances as static devices with their MIG UUIDs.
    let static_3g = device(&model, "gpu-0-mig-3g-20gb-4");
    assert_eq!(
        string_attr(static_3g, attr::UUID),
        Some("MIG-00000000-aaaa-4aaa-8aaa-000000000003")
    );
    assert!(static_3g.consumes_counters.is_none());
    assert!(names.contains("gpu-0-mig-2g-10gb-0"));
    assert!(names.contains("gpu-0-mig-1g-5gb-2"));
    // Whole GPU and shares would double-book the instances.
    for absent in ["gpu-0", "gpu-0-isolated", "gpu-0-shared"] {
        assert!(!names.contains(absent), "{absent} published");
    }
    // Only slice 3 is free: dynamic 1g.5gb(+me) there, nothing overlapping.
    let dynamic: BTreeSet<&str> = model
        .devices
        .iter()
        .filter(|(_, r)| matches!(r.kind, DeviceKind::Mig { dynamic: true, .. }))
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        dynamic,
        BTreeSet::from(["gpu-0-mig-1g-5gb-3", "gpu-0-mig-1g-5gb-me-3"])
    );
    assert!(
        model
            .notes
            .iter()
            .any(|n| n.message.contains("pre-existing"))
    );
}

#[test]
fn ampere_never_needs_a_mig_mode_switch() {
    // MIG off on Ampere: switching on needs a reset, so no MIG devices.
    let off = inventory(vec![a100(Mig::Disabled {
        profiles: a100_profiles(),
    })]);
    let model = full(&off);
    assert_eq!(
        names(&model),
        BTreeSet::from([
            "gpu-0".into(),
            "gpu-0-isolated".into(),
            "gpu-0-shared".into()
        ])
    );
    // MIG on without instances: only MIG devices.
    let on = inventory(vec![a100(Mig::Enabled {
        profiles: a100_profiles(),
        instances: vec![],
    })]);
    let model = full(&on);
    assert!(!names(&model).contains("gpu-0"));
    assert!(names(&model).contains("gpu-0-mig-7g-40gb-0"));
    assert_eq!(names(&model).len(), 25);
    assert!(
        model.mig_managed.is_empty(),
        "the driver never switches an A100"
    );
}

#[test]
fn hopper_mig_mode_switch_follows_policy() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = build(
        &inv,
        &policy("gpus: [{select: {all: true}, migModeSwitch: false}]"),
        Capabilities::full(),
    );
    assert_eq!(names(&model).len(), 3, "{:?}", names(&model));
    let on = inventory(vec![h100(
        0,
        Mig::Enabled {
            profiles: h100_profiles(),
            instances: vec![],
        },
    )]);
    let model = full(&on);
    assert_eq!(names(&model).len(), 28, "switchable: every mode offered");
    // Both modes published: prepare must switch, so the GPU is managed.
    assert_eq!(model.mig_managed, BTreeSet::from([on.gpus[0].uuid.clone()]));
    let pinned = build(
        &on,
        &policy("gpus: [{select: {all: true}, migModeSwitch: false}]"),
        Capabilities::full(),
    );
    assert!(pinned.mig_managed.is_empty());
    assert!(
        !names(&pinned).contains("gpu-0"),
        "no whole GPU under MIG mode"
    );
}

#[test]
fn every_published_device_needs_the_mig_mode_it_has_or_a_managed_switch() {
    // For every simulated-topology shape: a device of the other MIG mode
    // than the GPU's current one is published only on a managed GPU.
    let cases = [
        inventory(vec![h100_mig_disabled(0)]),
        inventory(vec![h100(
            0,
            Mig::Enabled {
                profiles: h100_profiles(),
                instances: vec![],
            },
        )]),
        inventory(vec![a100(Mig::Disabled {
            profiles: a100_profiles(),
        })]),
        inventory(vec![a100(Mig::Enabled {
            profiles: a100_profiles(),
            instances: vec![],
        })]),
    ];
    for inv in &cases {
        for capabilities in [Capabilities::full(), Capabilities::legacy()] {
            for pol in ["{}", "gpus: [{select: {all: true}, migModeSwitch: false}]"] {
                let model = build(inv, &policy(pol), capabilities);
                let gpu = &inv.gpus[0];
                let mig_on = matches!(gpu.mig, Mig::Enabled { .. });
                for (name, reference) in &model.devices {
                    let needs_mig = matches!(reference.kind, DeviceKind::Mig { .. });
                    assert!(
                        needs_mig == mig_on
                            || model.mig_managed.contains(&gpu.uuid)
                            // A monitor watches the GPU in either mode.
                            || reference.kind == DeviceKind::Monitor,
                        "{name} published on {} ({:?}, policy {pol}) needs a MIG mode switch \
                         the driver does not make",
                        gpu.architecture,
                        gpu.mig
                    );
                }
            }
        }
    }
}

// --------------------------------------------------------------- counters

#[test]
fn h100_counter_set() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let sets = counter_sets(&model);
    let mut expected: BTreeMap<String, u64> = (0..8).map(|i| (memory_slice(i), 1)).collect();
    expected.insert("compute-slices".into(), 7);
    expected.insert("ofa-engines".into(), 1);
    expected.insert("mig-1g-10gb-me-instances".into(), 1);
    assert_eq!(sets["gpu-0"], expected);
}

#[test]
fn whole_gpu_never_beside_anything() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let mut sim = Sim::new(&model.slices);
    sim.allocate("gpu-0", &[]).unwrap();
    let others: Vec<String> = sim
        .device_names()
        .filter(|n| *n != "gpu-0" && *n != "gpu-0-monitor")
        .cloned()
        .collect();
    assert_eq!(others.len(), 27);
    for other in others {
        assert!(
            sim.allocate(&other, &[]).is_err(),
            "{other} beside whole GPU"
        );
    }
    assert!(sim.allocate("gpu-0", &[]).is_err(), "exclusive");
    sim.release("gpu-0");
    sim.allocate("gpu-0-shared", &[]).unwrap();
}

#[test]
fn share_levels_never_mix_and_pack_until_capacity() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let mut sim = Sim::new(&model.slices);
    // 30 GiB of 79.6: two fit, the third does not.
    let claim = [(cap::MEMORY, 30 * GIB), (cap::CORES, 30)];
    sim.allocate("gpu-0-isolated", &claim).unwrap();
    assert!(sim.allocate("gpu-0-shared", &[]).is_err(), "levels mixed");
    assert!(sim.allocate("gpu-0", &[]).is_err(), "whole beside share");
    assert!(
        sim.allocate("gpu-0-mig-1g-10gb-0", &[]).is_err(),
        "MIG beside share"
    );
    sim.allocate("gpu-0-isolated", &claim).unwrap();
    assert!(
        sim.allocate("gpu-0-isolated", &claim).is_err(),
        "N+1th share must be refused"
    );
    // Releasing every share frees the GPU for the other level.
    sim.release("gpu-0-isolated");
    assert!(
        sim.allocate("gpu-0-shared", &[]).is_err(),
        "one isolated claim left"
    );
    sim.release("gpu-0-isolated");
    sim.allocate("gpu-0-shared", &[]).unwrap();
}

/// The Isolated claims the scheduler can place on `gpu` (by the allocator
/// stand-in) at their worst for the GPU's memory: as many claims as the
/// device admits, each of one step and one percent of cores, then the
/// memory left as one more claim. Returns (claims, memory they consumed).
fn worst_isolated_claims(model: &Model) -> (u64, u64) {
    let mut sim = Sim::new(&model.slices);
    let published = capacity(device(model, "gpu-0-isolated"), cap::MEMORY);
    let (mut claims, mut used) = (0, 0);
    // Keep one percent of cores for the last claim.
    while claims < 99
        && sim
            .allocate(
                "gpu-0-isolated",
                &[(cap::MEMORY, SHARE_MEMORY_STEP), (cap::CORES, 1)],
            )
            .is_ok()
    {
        claims += 1;
        used += SHARE_MEMORY_STEP;
    }
    let memory_left = published - used;
    if memory_left >= SHARE_MEMORY_STEP {
        sim.allocate(
            "gpu-0-isolated",
            &[(cap::MEMORY, memory_left), (cap::CORES, 1)],
        )
        .expect("the memory left fits one claim");
        claims += 1;
        used += memory_left;
    }
    assert!(
        sim.allocate(
            "gpu-0-isolated",
            &[(cap::MEMORY, SHARE_MEMORY_STEP), (cap::CORES, 1)]
        )
        .is_err(),
        "the device is full"
    );
    (claims, used)
}

#[test]
fn every_set_of_isolated_claims_fits_the_gpu_with_their_mps_servers() {
    for gpu in [h100(0, Mig::NotSupported), a100(Mig::NotSupported), t4()] {
        for reserve_mib in [1, 64, 300, 2048, 8192] {
            let inv = inventory(vec![gpu.clone()]);
            let pol = policy(&format!(
                "gpus: [{{select: {{all: true}}, mpsServerReserveMiB: {reserve_mib}}}]"
            ));
            let model = build(&inv, &pol, Capabilities::full());
            let ctx = format!("{} with {reserve_mib} MiB per server", gpu.product_name);
            if devices::isolated_share_memory(gpu.memory_bytes, reserve_mib * MIB)
                < 2 * SHARE_MEMORY_STEP
            {
                // Not even two steps left: no Isolated share at all.
                assert!(!names(&model).contains("gpu-0-isolated"), "{ctx}");
                continue;
            }
            let published = capacity(device(&model, "gpu-0-isolated"), cap::MEMORY);
            let (claims, used) = worst_isolated_claims(&model);
            // Each claim gets what it consumed, each runs one server.
            let needed = used + claims * reserve_mib * MIB;
            assert!(
                needed <= gpu.memory_bytes,
                "{ctx}: {claims} claims of {used} bytes and their servers need {needed} bytes, \
                 the GPU has {}",
                gpu.memory_bytes
            );
            // And no more than needed is held back: one step more and the
            // claims the scheduler could then place would not fit.
            let more = published + SHARE_MEMORY_STEP;
            let servers = devices::max_share_claims(more);
            assert!(
                more + servers * reserve_mib * MIB > gpu.memory_bytes,
                "{ctx}: {published} bytes published, {more} would still fit"
            );
            // The Shared share keeps the whole card.
            assert_eq!(
                capacity(device(&model, "gpu-0-shared"), cap::MEMORY),
                gpu.memory_bytes
            );
        }
    }
}

#[test]
fn isolated_share_memory_has_no_reserve_without_mps_servers() {
    let inv = inventory(vec![t4()]);
    let hami = build(
        &inv,
        &policy("gpus: [{select: {all: true}, isolationProvider: hami-core}]"),
        Capabilities::full(),
    );
    assert_eq!(
        capacity(device(&hami, "gpu-0-isolated"), cap::MEMORY),
        t4().memory_bytes
    );
    let none = build(
        &inv,
        &policy("gpus: [{select: {all: true}, mpsServerReserveMiB: 0}]"),
        Capabilities::full(),
    );
    assert_eq!(
        capacity(device(&none, "gpu-0-isolated"), cap::MEMORY),
        t4().memory_bytes
    );
    // A reserve that leaves less than two steps publishes no Isolated share.
    let mut small = t4();
    small.memory_bytes = 1024 * MIB;
    let inv = inventory(vec![small]);
    let model = build(
        &inv,
        &policy("gpus: [{select: {all: true}, mpsServerReserveMiB: 8192}]"),
        Capabilities::full(),
    );
    assert!(!names(&model).contains("gpu-0-isolated"));
    assert!(names(&model).contains("gpu-0-shared"));
}

#[test]
fn static_isolated_replicas_leave_room_for_their_servers() {
    let inv = inventory(vec![t4()]);
    let pol = policy(
        "gpus:\n- select: {all: true}\n  static: {mode: isolated, replicas: 4}\n  mpsServerReserveMiB: 100\n",
    );
    let model = build(&inv, &pol, Capabilities::legacy());
    for i in 0..4 {
        let name = format!("gpu-0-isolated-{i}");
        assert_eq!(capacity(device(&model, &name), cap::MEMORY), 3740 * MIB);
        match &model.devices[&name].kind {
            DeviceKind::Replica { memory_bytes, .. } => assert_eq!(*memory_bytes, 3740 * MIB),
            other => panic!("{other:?}"),
        }
    }
    assert!(4 * (3740 + 100) * MIB <= t4().memory_bytes);
}

#[test]
fn pre_volta_gpus_get_no_isolated_shares_and_say_why() {
    let inv = inventory(vec![p100()]);
    let model = full(&inv);
    assert_eq!(
        names(&model),
        BTreeSet::from(["gpu-0".to_string(), "gpu-0-shared".to_string()])
    );
    let why = mps_isolation_unsupported(&p100()).expect("a P100 predates Volta");
    assert!(
        why.contains("compute capability 6.0 is before Volta (7.0)"),
        "{why}"
    );
    assert!(
        model.notes.iter().any(|n| n.message == why),
        "{:?}",
        model.notes
    );
    assert_eq!(mps_isolation_unsupported(&t4()), None);
    assert_eq!(mps_isolation_unsupported(&h100(0, Mig::NotSupported)), None);

    // Static mode: isolated asked for, nothing offered; auto skips it.
    let static_isolated = build(
        &inv,
        &policy("gpus: [{select: {all: true}, static: {mode: isolated}}]"),
        Capabilities::legacy(),
    );
    assert!(names(&static_isolated).is_empty());
    assert!(
        static_isolated.notes.iter().any(|n| n
            .message
            .starts_with("static mode isolated: no Isolated shares")),
        "{:?}",
        static_isolated.notes
    );
    let auto = build(
        &inv,
        &policy("gpus: [{select: {all: true}, modes: [isolated, shared]}]"),
        Capabilities::legacy(),
    );
    assert!(names(&auto).iter().all(|n| n.starts_with("gpu-0-shared")));
    assert!(!names(&auto).is_empty());

    // HAMi-core runs no MPS: its Isolated shares are offered there.
    let hami = build(
        &inv,
        &policy("gpus: [{select: {all: true}, isolationProvider: hami-core}]"),
        Capabilities::full(),
    );
    assert!(names(&hami).contains("gpu-0-isolated"));

    // A share a claim holds stays published until it is released.
    let held = SliceModel::new(&inv, &NodePolicy::default(), Capabilities::full(), "node-a")
        .held_devices(["gpu-0-isolated".to_string()])
        .build()
        .unwrap();
    assert!(names(&held).contains("gpu-0-isolated"));
}

#[test]
fn default_share_claims_pack_ten_per_gpu() {
    let inv = inventory(vec![t4()]);
    let model = full(&inv);
    let mut sim = Sim::new(&model.slices);
    for i in 0..10 {
        sim.allocate("gpu-0-shared", &[])
            .unwrap_or_else(|e| panic!("claim {i}: {e}"));
    }
    assert!(
        sim.allocate("gpu-0-shared", &[]).is_err(),
        "cores exhausted at 10 x 10%"
    );
}

#[test]
fn share_requests_round_up_and_respect_max() {
    let inv = inventory(vec![t4()]);
    let model = full(&inv);
    let mut sim = Sim::new(&model.slices);
    assert!(
        sim.allocate("gpu-0-isolated", &[(cap::MEMORY, 16 * GIB)])
            .is_err(),
        "more memory than the card"
    );
    assert!(
        sim.allocate("gpu-0-isolated", &[(cap::CORES, 101)])
            .is_err()
    );
    // 100 MiB rounds up to one 256 MiB step.
    sim.allocate(
        "gpu-0-isolated",
        &[(cap::MEMORY, 100 * MIB), (cap::CORES, 50)],
    )
    .unwrap();
    sim.allocate(
        "gpu-0-isolated",
        &[(cap::MEMORY, 100 * MIB), (cap::CORES, 50)],
    )
    .unwrap();
    assert!(sim.allocate("gpu-0-isolated", &[(cap::CORES, 1)]).is_err());
}

#[test]
fn mig_excludes_whole_and_shares_and_overlaps() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let mut sim = Sim::new(&model.slices);
    sim.allocate("gpu-0-mig-3g-40gb-0", &[]).unwrap();
    for refused in [
        "gpu-0",
        "gpu-0-isolated",
        "gpu-0-shared",
        "gpu-0-mig-4g-40gb-0",
        "gpu-0-mig-1g-10gb-3",
        "gpu-0-mig-2g-20gb-2",
        "gpu-0-mig-7g-80gb-0",
    ] {
        assert!(sim.allocate(refused, &[]).is_err(), "{refused} beside 3g@0");
    }
    sim.allocate("gpu-0-mig-3g-40gb-4", &[]).unwrap();
}

/// Every pair of dynamic MIG devices may coexist exactly when NVML could
/// create both: disjoint placements and not two owners of the single OFA
/// (`+me`, `7g`).
#[test]
fn mig_pairs_coexist_exactly_when_physically_possible() {
    for gpu in [
        h100_mig_disabled(0),
        a100(Mig::Enabled {
            profiles: a100_profiles(),
            instances: vec![],
        }),
    ] {
        let inv = inventory(vec![gpu]);
        let model = full(&inv);
        let migs: Vec<(&String, &DeviceRef)> = model
            .devices
            .iter()
            .filter(|(_, r)| matches!(r.kind, DeviceKind::Mig { .. }))
            .collect();
        let profiles = inv.gpus[0].mig.profiles();
        let ofa = |id: u32| {
            profiles
                .iter()
                .find(|p| p.id == id)
                .unwrap()
                .engines
                .ofa_engines
        };
        for (a, ra) in &migs {
            for (b, rb) in &migs {
                if a == b {
                    continue;
                }
                let (
                    DeviceKind::Mig {
                        placement: pa,
                        profile_id: ia,
                        ..
                    },
                    DeviceKind::Mig {
                        placement: pb,
                        profile_id: ib,
                        ..
                    },
                ) = (&ra.kind, &rb.kind)
                else {
                    unreachable!()
                };
                let disjoint = pa.start + pa.size <= pb.start || pb.start + pb.size <= pa.start;
                let possible = disjoint && ofa(*ia) + ofa(*ib) <= 1;
                let mut sim = Sim::new(&model.slices);
                sim.allocate(a, &[]).unwrap();
                assert_eq!(sim.allocate(b, &[]).is_ok(), possible, "{a} + {b}");
            }
        }
    }
}

#[test]
fn compute_slices_bound_disjoint_placements() {
    // A made-up profile that packs 4 compute slices into 2 memory slices:
    // two of them are disjoint in memory but need 8 of the 7 compute slices.
    let mut profiles = h100_profiles();
    let mut dense = profiles
        .iter()
        .find(|p| p.name == "2g.20gb")
        .unwrap()
        .clone();
    dense.id = 99;
    dense.name = "4g.dense".into();
    dense.slices = 4;
    dense.max_instances = 4;
    dense.placements = (0..4)
        .map(|i| tessera_api::inventory::MigPlacement {
            start: 2 * i,
            size: 2,
        })
        .collect();
    profiles.push(dense);
    let inv = inventory(vec![h100(0, Mig::Disabled { profiles })]);
    let model = full(&inv);
    let mut sim = Sim::new(&model.slices);
    sim.allocate("gpu-0-mig-4g-dense-0", &[]).unwrap();
    assert!(sim.allocate("gpu-0-mig-4g-dense-2", &[]).is_err());
    sim.allocate("gpu-0-mig-2g-20gb-2", &[]).unwrap();
    sim.allocate("gpu-0-mig-1g-10gb-4", &[]).unwrap();
    assert!(
        sim.allocate("gpu-0-mig-1g-10gb-5", &[]).is_err(),
        "4+2+1 = 7 used"
    );
}

#[test]
fn full_mig_layouts_fit() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let layouts: Vec<Vec<String>> = vec![
        vec!["4g-40gb-0".into(), "3g-40gb-4".into()],
        (0..7).map(|s| format!("1g-10gb-{s}")).collect(),
        vec![
            "2g-20gb-0".into(),
            "2g-20gb-2".into(),
            "2g-20gb-4".into(),
            "1g-10gb-me-6".into(),
        ],
        (0..4).map(|s| format!("1g-20gb-{}", 2 * s)).collect(),
        vec![
            "3g-40gb-0".into(),
            "1g-10gb-me-4".into(),
            "1g-20gb-6".into(),
        ],
    ];
    for layout in layouts {
        let mut sim = Sim::new(&model.slices);
        for d in &layout {
            sim.allocate(&format!("gpu-0-mig-{d}"), &[])
                .unwrap_or_else(|e| panic!("{layout:?}: {e}"));
        }
    }
}

#[test]
fn counters_of_one_gpu_do_not_touch_another() {
    let inv = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(1)]);
    let model = full(&inv);
    let mut sim = Sim::new(&model.slices);
    sim.allocate("gpu-0", &[]).unwrap();
    sim.allocate("gpu-1-isolated", &[]).unwrap();
    sim.allocate("gpu-1-isolated", &[]).unwrap();
    assert!(sim.allocate("gpu-1-shared", &[]).is_err());
}

// ---------------------------------------------------------- owned / held

#[test]
fn owned_instance_keeps_its_device_unchanged() {
    let before = inventory(vec![h100_mig_disabled(0)]);
    let mut gpu = h100(
        0,
        Mig::Enabled {
            profiles: h100_profiles(),
            instances: vec![h100_instance("MIG-owned-0001", "3g.40gb", 0)],
        },
    );
    gpu.uuid = before.gpus[0].uuid.clone();
    let after = inventory(vec![gpu]);

    let pol = NodePolicy::default();
    let m1 = SliceModel::new(&before, &pol, Capabilities::full(), "node-a")
        .build()
        .unwrap();
    let m2 = SliceModel::new(&after, &pol, Capabilities::full(), "node-a")
        .owned_mig_instances(["MIG-owned-0001".to_string()])
        .build()
        .unwrap();
    // Same devices, same slices: creating the instance wrote nothing.
    assert_eq!(m1.slices, m2.slices);
    match &m2.devices["gpu-0-mig-3g-40gb-0"].kind {
        DeviceKind::Mig {
            existing, dynamic, ..
        } => {
            assert_eq!(existing.as_deref(), Some("MIG-owned-0001"));
            assert!(*dynamic);
        }
        other => panic!("{other:?}"),
    }

    // Without knowing it is ours, the instance is foreign: its device stays
    // (same name), everything it could double-book goes.
    let m3 = full(&after);
    let n3 = names(&m3);
    assert!(n3.contains("gpu-0-mig-3g-40gb-0"));
    assert!(!n3.contains("gpu-0") && !n3.contains("gpu-0-mig-1g-10gb-0"));
    assert!(n3.contains("gpu-0-mig-1g-10gb-4"));
}

#[test]
fn held_devices_survive_a_policy_change() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let only_mig = policy("gpus: [{select: {all: true}, modes: [mig], migProfiles: ['7g.*']}]");
    let model = build(&inv, &only_mig, Capabilities::full());
    assert_eq!(
        names(&model),
        BTreeSet::from(["gpu-0-mig-7g-80gb-0".to_string()])
    );

    let model = SliceModel::new(&inv, &only_mig, Capabilities::full(), "node-a")
        .held_devices([
            "gpu-0-shared".to_string(),
            "gpu-0-mig-1g-10gb-3".to_string(),
        ])
        .build()
        .unwrap();
    assert_eq!(
        names(&model),
        BTreeSet::from([
            "gpu-0-mig-7g-80gb-0".to_string(),
            "gpu-0-shared".to_string(),
            "gpu-0-mig-1g-10gb-3".to_string(),
        ])
    );
}

// ------------------------------------------------------ limits & splitting

#[test]
fn eight_h100_split_within_limits() {
    let inv = inventory((0..8).map(h100_mig_disabled).collect());
    let model = full(&inv);
    check_pool(&model.slices, &SliceLimits::V1_36).unwrap();
    // 28 work devices and a monitoring device per GPU.
    assert_eq!(all_devices(&model.slices).len(), 8 * 29);
    // One counter slice with 8 sets, then the 232 devices in slices of 64.
    assert_eq!(model.slices.len(), 5);
    assert_eq!(
        model.slices[0].spec.shared_counters.as_ref().unwrap().len(),
        8
    );
    assert!(model.slices[0].spec.devices.is_none());
    for (k, slice) in model.slices.iter().enumerate() {
        assert_eq!(
            slice.metadata.name.as_deref(),
            Some(format!("node-a-gpu.tessera.dev-00{k}").as_str())
        );
        assert_eq!(slice.spec.pool.name, "node-a");
        assert_eq!(slice.spec.pool.resource_slice_count, 5);
        assert_eq!(slice.spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(slice.spec.driver, "gpu.tessera.dev");
        if k > 0 {
            assert!(slice.spec.devices.as_ref().unwrap().len() <= 64);
        }
    }
    // The scheduler walks devices in this order: whole GPUs first, then
    // shares, MIG devices and monitors, each in GPU order.
    let walk: Vec<&str> = all_devices(&model.slices)
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    let whole: Vec<String> = (0..8).map(|n| format!("gpu-{n}")).collect();
    assert_eq!(walk[..8], whole);
    assert_eq!(walk[8..10], ["gpu-0-isolated", "gpu-0-shared"]);
    assert_eq!(walk[22..24], ["gpu-7-isolated", "gpu-7-shared"]);
    assert!(walk[24..224].iter().all(|d| d.contains("-mig-")));
    assert!(walk[24].starts_with("gpu-0-") && walk[223].starts_with("gpu-7-"));
    let monitors: Vec<String> = (0..8).map(|n| format!("gpu-{n}-monitor")).collect();
    assert_eq!(walk[224..], monitors);
}

#[test]
fn small_limits_force_more_slices() {
    let inv = inventory((0..8).map(h100_mig_disabled).collect());
    let mut caps = Capabilities::full();
    caps.limits.max_counter_sets = 3;
    caps.limits.max_devices_with_counters = 10;
    let model = build(&inv, &NodePolicy::default(), caps);
    check_pool(&model.slices, &caps.limits).unwrap();
    let counter_slices = model
        .slices
        .iter()
        .filter(|s| s.spec.shared_counters.is_some())
        .count();
    assert_eq!(counter_slices, 3, "8 sets in slices of 3");
    // 232 devices in slices of 10 (the last holds the two monitors left).
    assert_eq!(model.slices.len(), 3 + 24);
    let all: Vec<&str> = all_devices(&model.slices)
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    let unique: BTreeSet<&str> = all.iter().copied().collect();
    assert_eq!(all.len(), unique.len());
    assert_eq!(all.len(), 8 * 29);
}

#[test]
fn too_many_counters_is_an_error_not_a_rejected_slice() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let mut caps = Capabilities::full();
    caps.limits.max_counters_per_set = 8;
    let err = SliceModel::new(&inv, &NodePolicy::default(), caps, "node-a")
        .build()
        .unwrap_err();
    assert!(matches!(err, ModelError::Limit(_)), "{err}");
}

#[test]
fn every_device_fits_the_per_device_limits() {
    let inv = inventory(vec![h100_mig_disabled(0), a100_with_instances(), t4()]);
    let model = full(&inv);
    for d in all_devices(&model.slices) {
        let n = d.attributes.as_ref().unwrap().len() + d.capacity.as_ref().map_or(0, |c| c.len());
        assert!(n <= 32, "{}: {n}", d.name);
    }
    check_pool(&model.slices, &SliceLimits::V1_36).unwrap();
}

#[test]
fn check_pool_catches_broken_pools() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let limits = SliceLimits::V1_36;

    let mut mixed = model.slices.clone();
    mixed[1].spec.shared_counters = mixed[0].spec.shared_counters.clone();
    assert!(check_pool(&mixed, &limits).is_err());

    let mut generations = model.slices.clone();
    generations[1].spec.pool.generation = 7;
    assert!(check_pool(&generations, &limits).is_err());

    let mut missing_set = model.slices.clone();
    missing_set.remove(0);
    for s in &mut missing_set {
        s.spec.pool.resource_slice_count -= 1;
    }
    assert!(check_pool(&missing_set, &limits).is_err());
}

// ------------------------------------------------------------ determinism

#[test]
fn same_inventory_same_objects_in_any_gpu_order() {
    let gpus: Vec<_> = (0..4).map(h100_mig_disabled).chain([t4()]).collect();
    let a = full(&inventory(gpus.clone()));
    let mut reversed = gpus;
    reversed.reverse();
    let b = full(&inventory(reversed));
    assert_eq!(a.slices, b.slices);
    assert_eq!(
        serde_json::to_string(&a.slices).unwrap(),
        serde_json::to_string(
            &full(&inventory(
                (0..4).map(h100_mig_disabled).chain([t4()]).collect()
            ))
            .slices
        )
        .unwrap()
    );
    // GPUs are numbered in PCI order: the T4 (bus 0x3b) comes after the
    // H100s at 0x18, 0x28, 0x38 and before the one at 0x48.
    assert_eq!(a.gpu_indices[&t4().uuid], 3);
    assert_eq!(a.gpu_indices[&h100_mig_disabled(3).uuid], 4);
}

#[test]
fn gpu_numbers_survive_a_gpu_vanishing() {
    let all = inventory((0..4).map(h100_mig_disabled).collect());
    let first = full(&all);
    let gone = inventory(vec![
        h100_mig_disabled(0),
        h100_mig_disabled(2),
        h100_mig_disabled(3),
    ]);

    let naive = full(&gone);
    assert_eq!(naive.gpu_indices[&h100_mig_disabled(3).uuid], 2);

    let sticky = SliceModel::new(
        &gone,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
    )
    .previous_indices(first.gpu_indices.clone())
    .build()
    .unwrap();
    assert_eq!(sticky.gpu_indices[&h100_mig_disabled(3).uuid], 3);
    assert!(names(&sticky).contains("gpu-3") && !names(&sticky).contains("gpu-1"));
    // A new GPU takes the free number.
    let replaced = inventory(vec![
        h100_mig_disabled(0),
        h100_mig_disabled(2),
        h100_mig_disabled(3),
        h100_mig_disabled(9),
    ]);
    let model = SliceModel::new(
        &replaced,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
    )
    .previous_indices(sticky.gpu_indices.clone())
    .build()
    .unwrap();
    assert_eq!(model.gpu_indices[&h100_mig_disabled(9).uuid], 1);
}

#[test]
fn generation_and_owner_hooks() {
    let inv = inventory(vec![t4()]);
    let owner = k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: "node-a".into(),
        uid: "0e3c4c1e-64a7-4a56-9d0e-1f0fb2d2b5d7".into(),
        controller: Some(true),
        ..Default::default()
    };
    let model = SliceModel::new(&inv, &NodePolicy::default(), Capabilities::full(), "node-a")
        .owner(owner.clone())
        .generation(4)
        .build()
        .unwrap();
    for s in &model.slices {
        assert_eq!(s.spec.pool.generation, 4);
        assert_eq!(
            s.metadata.owner_references.as_deref(),
            Some(&[owner.clone()][..])
        );
    }
    let bumped = model.clone().with_generation(5);
    assert!(bumped.slices.iter().all(|s| s.spec.pool.generation == 5));

    // What the publisher compares: the generation and server-side metadata
    // do not count, content does.
    use super::slices::same_content;
    let mut stored = bumped.slices.clone();
    stored.reverse();
    for s in &mut stored {
        s.metadata.resource_version = Some("123".into());
        s.metadata.uid = Some("0d7b1f9e-0000-4000-8000-000000000000".into());
    }
    assert!(same_content(&model.slices, &stored));
    let mut changed = stored.clone();
    changed[0].spec.pool.resource_slice_count += 1;
    assert!(!same_content(&model.slices, &changed));
    assert!(!same_content(&model.slices, &stored[1..]));
}

#[test]
fn serialized_slices_use_api_field_names() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let model = full(&inv);
    let json = serde_json::to_value(&model.slices).unwrap();
    let counters = &json[0]["spec"]["sharedCounters"][0];
    assert_eq!(counters["name"], "gpu-0");
    assert_eq!(counters["counters"]["memory-slice-7"]["value"], "1");
    let devices = json[1]["spec"]["devices"].as_array().unwrap();
    let iso = devices
        .iter()
        .find(|d| d["name"] == "gpu-0-isolated")
        .unwrap();
    assert_eq!(iso["allowMultipleAllocations"], true);
    assert_eq!(iso["consumesCounters"][0]["counterSet"], "gpu-0");
    assert_eq!(
        iso["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
        "256Mi"
    );
    assert_eq!(iso["attributes"]["isolationLevel"]["string"], "Isolated");
    assert_eq!(json[1]["spec"]["pool"]["resourceSliceCount"], 2);
}

#[test]
fn empty_inventory_publishes_nothing() {
    let model = full(&inventory(vec![]));
    assert!(model.slices.is_empty());
}

#[test]
fn bad_inventory_values_are_omitted_with_a_note() {
    let mut gpu = t4();
    gpu.pci_bus_id = "garbage".into();
    gpu.cuda_compute_capability = "n/a".into();
    let mut inv = inventory(vec![gpu]);
    inv.driver_version = "550.90.07-custom".into();
    let model = full(&inv);
    let whole = device(&model, "gpu-0");
    assert_eq!(string_attr(whole, attr::PCI_BUS_ID), None);
    assert_eq!(string_attr(whole, attr::PCIE_BUS_ID), None);
    assert_eq!(version_attr(whole, attr::CUDA_COMPUTE_CAPABILITY), None);
    assert_eq!(version_attr(whole, attr::DRIVER_VERSION), None);
    assert!(model.notes.len() >= 3, "{:?}", model.notes);
}

#[test]
fn invalid_inputs_are_errors() {
    let inv = inventory(vec![t4(), t4()]);
    let err = SliceModel::new(&inv, &NodePolicy::default(), Capabilities::full(), "node-a")
        .build()
        .unwrap_err();
    assert!(matches!(err, ModelError::DuplicateGpu(_)));
    let inv = inventory(vec![t4()]);
    let err = SliceModel::new(&inv, &NodePolicy::default(), Capabilities::full(), "Node_A")
        .build()
        .unwrap_err();
    assert!(matches!(err, ModelError::InvalidName { .. }));
}

#[test]
fn desired_slices_uses_the_driver_name() {
    let inv = inventory(vec![t4()]);
    let driver = DriverName::for_domain("example.com").unwrap();
    let slices = desired_slices(
        &inv,
        &NodePolicy::default(),
        Capabilities::full(),
        "n1",
        &driver,
    )
    .unwrap();
    assert!(slices.iter().all(|s| s.spec.driver == "gpu.example.com"));
    assert_eq!(
        slices[0].metadata.name.as_deref(),
        Some("n1-gpu.example.com-000")
    );
}

// ------------------------------------------------------------ static mode

#[test]
fn legacy_server_gets_static_whole_gpus() {
    let inv = inventory(vec![h100_mig_disabled(0), t4()]);
    let model = build(&inv, &NodePolicy::default(), Capabilities::legacy());
    assert!(!model.full);
    assert_eq!(
        names(&model),
        BTreeSet::from(["gpu-0".to_string(), "gpu-1".to_string()])
    );
    for s in &model.slices {
        assert!(s.spec.shared_counters.is_none());
        for d in s.spec.devices.iter().flatten() {
            assert!(d.consumes_counters.is_none() && d.allow_multiple_allocations.is_none());
        }
    }
    check_pool(&model.slices, &SliceLimits::V1_36).unwrap();
}

#[test]
fn legacy_share_replicas() {
    let inv = inventory(vec![t4()]);
    let pol = policy(
        "gpus:\n- select: {product: 'tesla t4'}\n  static: {mode: isolated, replicas: 4}\n  isolationProvider: hami-core\n",
    );
    let model = build(&inv, &pol, Capabilities::legacy());
    assert_eq!(
        names(&model),
        (0..4)
            .map(|i| format!("gpu-0-isolated-{i}"))
            .collect::<BTreeSet<_>>()
    );
    let r = device(&model, "gpu-0-isolated-2");
    assert_eq!(r.allow_multiple_allocations, None);
    assert_eq!(string_attr(r, attr::TYPE), Some("share"));
    assert_eq!(string_attr(r, attr::ISOLATION_LEVEL), Some("Isolated"));
    assert_eq!(string_attr(r, attr::ISOLATION_PROVIDER), Some("hami-core"));
    assert_eq!(capacity(r, cap::MEMORY), 3840 * MIB);
    assert_eq!(capacity(r, cap::CORES), 25);
    assert!(
        r.capacity
            .as_ref()
            .unwrap()
            .values()
            .all(|c| c.request_policy.is_none())
    );
    assert!(matches!(
        model.devices["gpu-0-isolated-2"].kind,
        DeviceKind::Replica {
            index: 2,
            replicas: 4,
            ..
        }
    ));
}

#[test]
fn consumable_capacity_without_counters_gets_one_share_device() {
    let inv = inventory(vec![t4()]);
    let pol = policy("gpus: [{select: {index: 0}, static: {mode: shared}}]");
    let caps = Capabilities {
        partitionable_devices: false,
        consumable_capacity: true,
        ..Capabilities::full()
    };
    let model = build(&inv, &pol, caps);
    assert_eq!(names(&model), BTreeSet::from(["gpu-0-shared".to_string()]));
    let d = device(&model, "gpu-0-shared");
    assert_eq!(d.allow_multiple_allocations, Some(true));
    assert!(d.consumes_counters.is_none());
    assert!(
        model
            .slices
            .iter()
            .all(|s| s.spec.shared_counters.is_none())
    );
}

#[test]
fn partitionable_without_consumable_capacity_is_static() {
    let inv = inventory(vec![h100_mig_disabled(0)]);
    let caps = Capabilities {
        partitionable_devices: true,
        consumable_capacity: false,
        ..Capabilities::full()
    };
    let model = build(&inv, &NodePolicy::default(), caps);
    assert!(!model.full);
    assert_eq!(names(&model), BTreeSet::from(["gpu-0".to_string()]));
}

#[test]
fn static_mode_respects_existing_mig_instances() {
    let inv = inventory(vec![a100_with_instances()]);
    let auto = build(&inv, &NodePolicy::default(), Capabilities::legacy());
    assert_eq!(
        names(&auto),
        BTreeSet::from([
            "gpu-0-mig-1g-5gb-2".to_string(),
            "gpu-0-mig-2g-10gb-0".to_string(),
            "gpu-0-mig-3g-20gb-4".to_string(),
        ])
    );
    let whole = build(
        &inv,
        &policy("gpus: [{select: {all: true}, static: {mode: whole}}]"),
        Capabilities::legacy(),
    );
    assert_eq!(
        names(&whole),
        names(&auto),
        "whole would double-book the instances"
    );
    assert!(
        whole
            .notes
            .iter()
            .any(|n| n.message.contains("overridden to mig"))
    );

    // Asking for MIG on a GPU without instances offers the whole GPU instead.
    let t4_inv = inventory(vec![t4()]);
    let mig = build(
        &t4_inv,
        &policy("gpus: [{select: {all: true}, static: {mode: mig}}]"),
        Capabilities::legacy(),
    );
    assert_eq!(names(&mig), BTreeSet::from(["gpu-0".to_string()]));
}

// ----------------------------------------------------------------- policy

#[test]
fn policy_rules_apply_in_order_field_by_field() {
    let inv = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(1), t4()]);
    let pol = policy(
        r#"
apiVersion: tessera.dev/v1alpha1
kind: NodePolicy
gpus:
  - select: {all: true}
    modes: [whole, isolated]
    isolationProvider: hami-core
  - select: {product: "NVIDIA H100*"}
    modes: [mig]
    migProfiles: ["3g.*"]
  - select: {index: 1}
    modes: [mig, shared]
    timeSlice: long
"#,
    );
    let model = build(&inv, &pol, Capabilities::full());
    let n = names(&model);
    // GPU 0 (H100): only 3g MIG.
    assert!(n.contains("gpu-0-mig-3g-40gb-0") && n.contains("gpu-0-mig-3g-40gb-4"));
    assert!(!n.contains("gpu-0") && !n.contains("gpu-0-isolated"));
    assert!(!n.contains("gpu-0-mig-1g-10gb-0"));
    // GPU 1 (H100, index 1): 3g MIG (profiles inherited) + Shared, long slices.
    assert!(n.contains("gpu-1-mig-3g-40gb-0") && n.contains("gpu-1-shared"));
    assert_eq!(
        string_attr(device(&model, "gpu-1-shared"), attr::TIME_SLICE),
        Some("Long")
    );
    // T4 (index 2): first rule only.
    assert!(n.contains("gpu-2") && n.contains("gpu-2-isolated") && !n.contains("gpu-2-shared"));
    assert_eq!(
        string_attr(device(&model, "gpu-2-isolated"), attr::ISOLATION_PROVIDER),
        Some("hami-core")
    );
}

#[test]
fn policy_selects_by_uuid_and_can_switch_a_gpu_off() {
    let inv = inventory(vec![h100_mig_disabled(0), t4()]);
    let pol = policy(&format!(
        "gpus: [{{select: {{uuid: '{}'}}, modes: []}}]",
        h100_mig_disabled(0).uuid
    ));
    let model = build(&inv, &pol, Capabilities::full());
    assert!(names(&model).iter().all(|n| n.starts_with("gpu-1")));
    // The GPU without devices needs no counter set either.
    assert_eq!(
        counter_sets(&model).keys().collect::<Vec<_>>(),
        vec!["gpu-1"]
    );
}

#[test]
fn default_share_percent_from_policy() {
    let inv = inventory(vec![t4()]);
    let pol = policy("gpus: [{select: {all: true}, defaultSharePercent: 25}]");
    let model = build(&inv, &pol, Capabilities::full());
    let d = device(&model, "gpu-0-shared");
    let p = d.capacity.as_ref().unwrap()[cap::CORES]
        .request_policy
        .as_ref()
        .unwrap();
    assert_eq!(p.default.as_ref().unwrap().0, "25");
    let mut sim = Sim::new(&model.slices);
    for _ in 0..4 {
        sim.allocate("gpu-0-shared", &[]).unwrap();
    }
    assert!(sim.allocate("gpu-0-shared", &[]).is_err());
}

#[test]
fn policy_decoding_is_strict_and_names_fields() {
    let cases = [
        (
            "gpus: [{select: {all: true}, mode: [whole]}]",
            "gpus[0]: unknown field `mode`",
        ),
        (
            "gpus: [{select: {all: true}, modes: [vgpu]}]",
            "gpus[0].modes[0]: unknown variant `vgpu`",
        ),
        (
            "gpus: [{select: {all: true}, isolationProvider: mig}]",
            "gpus[0].isolationProvider: unknown variant `mig`",
        ),
        (
            "gpus: [{select: {al: true}}]",
            "gpus[0].select: unknown field `al`",
        ),
        (
            "gpus: [{select: {all: true}, static: {replicas: 2, mode: whole, x: 1}}]",
            "gpus[0].static: unknown field `x`",
        ),
        ("gpu: []", "unknown field `gpu`"),
        (
            "gpus: [{select: {all: true}, static: {replicas: -1}}]",
            "gpus[0].static.replicas",
        ),
    ];
    for (yaml, needle) in cases {
        let err = NodePolicy::from_yaml(yaml).unwrap_err();
        assert!(matches!(err, PolicyError::Decode(_)), "{yaml}: {err}");
        assert!(err.to_string().contains(needle), "{yaml}: {err}");
    }
}

#[test]
fn policy_validation_names_the_field() {
    let cases = [
        (
            "gpus: [{select: {all: true}}, {select: {all: true}, static: {replicas: 0}}]",
            "gpus[1].static.replicas",
        ),
        ("gpus: [{select: {all: true, index: 0}}]", "gpus[0].select"),
        ("gpus: [{select: {}}]", "gpus[0].select"),
        ("gpus: [{select: {all: false}}]", "gpus[0].select.all"),
        ("gpus: [{select: {uuid: abc}}]", "gpus[0].select.uuid"),
        ("gpus: [{select: {product: ''}}]", "gpus[0].select.product"),
        (
            "gpus: [{select: {all: true}, defaultSharePercent: 0}]",
            "gpus[0].defaultSharePercent",
        ),
        (
            "gpus: [{select: {all: true}, migProfiles: ['1g.*', ' ']}]",
            "gpus[0].migProfiles[1]",
        ),
        ("apiVersion: v1\ngpus: []", "apiVersion"),
        ("kind: ConfigMap", "kind"),
        ("claimGuard: {periodMillis: 10}", "claimGuard.periodMillis"),
    ];
    for (yaml, field) in cases {
        match NodePolicy::from_yaml(yaml) {
            Err(PolicyError::Invalid { field: f, .. }) => assert_eq!(f, field, "{yaml}"),
            other => panic!("{yaml}: {other:?}"),
        }
    }
}

#[test]
fn the_claim_guard_enforces_every_second_unless_told_otherwise() {
    let default = NodePolicy::default().claim_guard;
    assert_eq!(default.action, policy::GuardAction::Enforce);
    assert_eq!(default.period_millis, 1000);
    let set = NodePolicy::from_yaml("claimGuard: {action: report, periodMillis: 250}")
        .unwrap()
        .claim_guard;
    assert_eq!(set.action, policy::GuardAction::Report);
    assert_eq!(set.period_millis, 250);
    assert!(matches!(
        NodePolicy::from_yaml("claimGuard: {action: kill}"),
        Err(PolicyError::Decode(_))
    ));
}

#[test]
fn empty_policy_means_everything_on() {
    assert_eq!(NodePolicy::from_yaml("").unwrap(), NodePolicy::default());
    assert_eq!(
        NodePolicy::from_yaml("gpus: []").unwrap(),
        NodePolicy::default()
    );
    let p = NodePolicy::default().for_gpu(&t4(), 0);
    assert_eq!(p, policy::GpuPolicy::default());
    assert!(p.allows_profile("1g.10gb+me"));
}

#[test]
fn invalid_policy_built_in_code_is_refused_by_the_model() {
    let inv = inventory(vec![t4()]);
    let pol = NodePolicy {
        gpus: vec![policy::GpuRule {
            select: policy::GpuSelector::default(),
            modes: None,
            mig_profiles: None,
            mig_mode_switch: None,
            time_slice: None,
            isolation_provider: None,
            default_share_percent: None,
            static_mode: None,
            mps_server_reserve_mib: None,
        }],
        ..NodePolicy::default()
    };
    let err = SliceModel::new(&inv, &pol, Capabilities::full(), "node-a")
        .build()
        .unwrap_err();
    assert!(matches!(err, ModelError::Policy(_)));
}

// ---------------------------------------------------------- device classes

/// Evaluates the conjunctions of equality tests our DeviceClasses use
/// (`device.driver == "…"`, `device.attributes["dom"].name == "…"`). Anything
/// else panics, so a class growing a construct this cannot read fails here
/// instead of passing silently.
fn selects(expression: &str, driver: &str, d: &Device) -> bool {
    expression.split("&&").all(|clause| {
        let (lhs, rhs) = clause.split_once("==").expect("equality test");
        let want = rhs.trim().trim_matches('"');
        let lhs = lhs.trim();
        if lhs == "device.driver" {
            return driver == want;
        }
        let rest = lhs
            .strip_prefix("device.attributes[\"")
            .expect("attribute lookup");
        let (domain, name) = rest.split_once("\"].").expect("attribute name");
        assert_eq!(domain, driver, "attributes of our own domain");
        string_attr(d, name) == Some(want)
    })
}

#[test]
fn device_classes_select_exactly_their_devices() {
    use k8s_openapi::api::resource::v1::DeviceClass;
    use serde::Deserialize;

    let text = include_str!("../../../../deploy/deviceclasses.yaml");
    let classes: Vec<DeviceClass> = serde_yaml::Deserializer::from_str(text)
        .map(|doc| DeviceClass::deserialize(doc).expect("DeviceClass"))
        .collect();
    let by_name: BTreeMap<&str, &DeviceClass> = classes
        .iter()
        .map(|c| (c.metadata.name.as_deref().unwrap(), c))
        .collect();
    assert_eq!(
        by_name.keys().copied().collect::<Vec<_>>(),
        vec![
            "gpu-isolated.tessera.dev",
            "gpu-monitor.tessera.dev",
            "gpu-shared.tessera.dev",
            "gpu.tessera.dev",
            "mig.tessera.dev",
        ]
    );

    let inv = inventory(vec![h100_mig_disabled(0), a100_with_instances(), t4()]);
    let model = full(&inv);
    let driver = "gpu.tessera.dev";
    let matching = |class: &str| -> BTreeSet<String> {
        let selectors = by_name[class]
            .spec
            .as_ref()
            .unwrap()
            .selectors
            .as_ref()
            .unwrap();
        all_devices(&model.slices)
            .into_iter()
            .filter(|d| {
                selectors
                    .iter()
                    .all(|s| selects(&s.cel.as_ref().unwrap().expression, driver, d))
            })
            .map(|d| d.name.clone())
            .collect()
    };
    let of_kind = |pred: &dyn Fn(&DeviceKind) -> bool| -> BTreeSet<String> {
        model
            .devices
            .iter()
            .filter(|(_, r)| pred(&r.kind))
            .map(|(n, _)| n.clone())
            .collect()
    };
    assert_eq!(
        matching("gpu.tessera.dev"),
        of_kind(&|k| matches!(k, DeviceKind::Whole))
    );
    assert_eq!(
        matching("mig.tessera.dev"),
        of_kind(&|k| matches!(k, DeviceKind::Mig { .. }))
    );
    assert_eq!(
        matching("gpu-isolated.tessera.dev"),
        of_kind(&|k| matches!(
            k,
            DeviceKind::Share {
                level: IsolationLevel::Isolated,
                ..
            }
        ))
    );
    assert_eq!(
        matching("gpu-shared.tessera.dev"),
        of_kind(&|k| matches!(
            k,
            DeviceKind::Share {
                level: IsolationLevel::Shared,
                ..
            }
        ))
    );
    assert_eq!(
        matching("gpu-monitor.tessera.dev"),
        of_kind(&|k| matches!(k, DeviceKind::Monitor))
    );
    assert_eq!(matching("gpu.tessera.dev").len(), 2, "H100 and T4");
    assert!(!matching("mig.tessera.dev").is_empty());
    // Another driver's devices never match (gpu-1 is the H100; the A100
    // at PCI bus 07 is gpu-0).
    let d = device(&model, "gpu-1");
    assert!(!selects(
        &by_name["gpu.tessera.dev"]
            .spec
            .as_ref()
            .unwrap()
            .selectors
            .as_ref()
            .unwrap()[0]
            .cel
            .as_ref()
            .unwrap()
            .expression,
        "gpu.nvidia.com",
        d
    ));
}

#[test]
fn mps_directories_are_bounded_by_default_and_checked() {
    let default = NodePolicy::default().mps;
    assert_eq!(default.shared_memory.bytes(), 256 << 20);
    assert_eq!(default.max_shared_memory.bytes(), 4 << 30);
    assert_eq!(default.inodes, 4096);
    let set = NodePolicy::from_yaml("mps: {sharedMemory: 1Gi, maxSharedMemory: 8Gi, inodes: 512}")
        .unwrap()
        .mps;
    assert_eq!(
        (
            set.shared_memory.bytes(),
            set.max_shared_memory.bytes(),
            set.inodes
        ),
        (1 << 30, 8 << 30, 512)
    );
    for (yaml, field) in [
        ("mps: {sharedMemory: 4Ki}", "mps.sharedMemory"),
        ("mps: {sharedMemory: 8Gi}", "mps.maxSharedMemory"),
        ("mps: {inodes: 3}", "mps.inodes"),
    ] {
        let err = NodePolicy::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(field), "{yaml}: {err}");
    }
    assert!(NodePolicy::from_yaml("mps: {size: 1Gi}").is_err());
}

/// A device's counter set and compatibility groups, if it consumes any.
fn consumption_of(d: &Device) -> Option<(String, Vec<String>)> {
    let c = d.consumes_counters.as_ref()?.first()?;
    Some((
        c.counter_set.clone(),
        c.compatibility_groups.clone().unwrap_or_default(),
    ))
}

/// Allocates `a`, then `b`, each for one claim; whether both fit.
fn both_fit(mut sim: Sim, a: &str, b: &str) -> bool {
    sim.allocate(a, &[]).is_ok() && sim.allocate(b, &[]).is_ok()
}

/// With compatibility groups every counter consumption names its device's
/// mode, and for any two devices the second fits beside the first exactly
/// as it does by the counters alone: the groups refuse no mix the counters
/// allow. Alone (no counters), they refuse every mix of two modes on one
/// GPU and nothing across GPUs.
#[test]
fn compatibility_groups_refuse_what_the_counters_refuse_and_nothing_more() {
    let inv = inventory(vec![h100_mig_disabled(0), h100_mig_disabled(1)]);
    let plain = full(&inv);
    let caps = Capabilities {
        compatibility_groups: true,
        ..Capabilities::full()
    };
    let grouped = build(&inv, &NodePolicy::default(), caps);
    assert!(
        all_devices(&plain.slices)
            .iter()
            .filter_map(|d| consumption_of(d))
            .all(|(_, groups)| groups.is_empty()),
        "groups published without the capability"
    );
    let mut modes = BTreeMap::new();
    for d in all_devices(&grouped.slices) {
        if let Some((set, groups)) = consumption_of(d) {
            assert_eq!(groups.len(), 1, "{}: {groups:?}", d.name);
            modes.insert(d.name.clone(), (set, groups[0].clone()));
        }
    }
    let seen: BTreeSet<&str> = modes.values().map(|(_, g)| g.as_str()).collect();
    assert_eq!(seen, BTreeSet::from(["isolated", "mig", "shared", "whole"]));
    for (a, (set_a, mode_a)) in &modes {
        for (b, (set_b, mode_b)) in &modes {
            assert_eq!(
                both_fit(Sim::new(&plain.slices), a, b),
                both_fit(Sim::new(&grouped.slices), a, b),
                "{a} then {b}: groups and counters disagree"
            );
            if a != b {
                assert_eq!(
                    both_fit(Sim::groups_only(&grouped.slices), a, b),
                    set_a != set_b || mode_a == mode_b,
                    "{a} ({mode_a}) then {b} ({mode_b}) by the groups alone"
                );
            }
        }
    }
}

/// Binding conditions go exactly on the MIG placements still to be made;
/// without the capability nothing carries them.
#[test]
fn binding_conditions_only_on_mig_devices_still_to_be_made() {
    let inv = inventory(vec![h100_mig_disabled(0), a100_with_instances()]);
    let caps = Capabilities {
        binding_conditions: true,
        ..Capabilities::full()
    };
    let model = build(&inv, &NodePolicy::default(), caps);
    let mut with = 0;
    for d in all_devices(&model.slices) {
        let dynamic_mig = matches!(
            model.devices[&d.name].kind,
            DeviceKind::Mig {
                existing: None,
                dynamic: true,
                ..
            }
        );
        let conditions = (
            d.binding_conditions.as_deref(),
            d.binding_failure_conditions.as_deref(),
        );
        if dynamic_mig {
            with += 1;
            assert_eq!(
                conditions,
                (
                    Some(&["DeviceMade".to_owned()][..]),
                    Some(&["DeviceNotMade".to_owned()][..])
                ),
                "{}",
                d.name
            );
        } else {
            assert_eq!(conditions, (None, None), "{}", d.name);
        }
    }
    assert!(with > 0, "no dynamic MIG device published");
    assert!(
        model.devices.values().any(|r| matches!(
            r.kind,
            DeviceKind::Mig {
                existing: Some(_),
                ..
            }
        )),
        "no existing instance published: the fixture should have some"
    );
    assert!(
        all_devices(&full(&inv).slices)
            .iter()
            .all(|d| d.binding_conditions.is_none()),
        "binding conditions without the capability"
    );
}
