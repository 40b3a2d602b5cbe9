//! Dynamic MIG and MIG mode (`tessera_driver::host::mig`) against the simulated
//! NVML: create, destroy what was recorded, list, adopt nothing, leave what
//! is not ours alone, switch MIG mode where no reset is needed.
//!
//! NVML state is process-global and the simulated GPU's instances are
//! machine-wide, so every scenario runs in its own child process on a
//! machine of its own (a fresh state file): this test binary re-run on one
//! ignored `child_*` test with the fake library on its library path.
//! Expected ids and UUIDs are written here from the topology files and
//! NVML's documented numbering, not read back.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod common;

use std::process::Command;

use common::*;
use nvml_wrapper::Nvml;
use tessera_driver::host::mig::{
    self, CreatedMig, Destroyed, MigError, MigPlacement, Recorded, raw,
};

const CHILD_ENV: &str = "TESSERA_TEST_MIG_CHILD";

/// h100x8-mig.yaml, GPU 7: MIG on, no instances.
const H100_EMPTY: &str = "GPU-8f3b2a6c-5e1d-4c7a-9f08-4d6b1e3a7c95";
/// a100-40gb-x2-mig.yaml, GPU 0: 3g.20gb at 4:4 (GI 1), 2g.10gb at 0:2
/// (GI 5), 1g.5gb at 2:1 (GI 13); memory slice 3 and one compute slice free.
const A100_MIXED: &str = "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10";
/// a100-40gb-x2-mig.yaml, GPU 1: MIG off.
const A100_OFF: &str = "GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee";
/// h100x8.yaml, GPU 0: MIG off.
const H100_OFF: &str = "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f";

// Profile ids (`nvidia-smi mig -lgip`), the same on A100 and H100.
const P_1G: u32 = 19;
const P_2G: u32 = 14;
const P_3G: u32 = 9;
const P_7G: u32 = 0;

fn at(start: u32, size: u32) -> MigPlacement {
    MigPlacement { start, size }
}

/// Runs `child_<name>` in a fresh process on `topology` and requires it to
/// pass.
fn run_child(name: &str, topology_file: &str) {
    let out = clean(Command::new(std::env::current_exe().unwrap()))
        .args([
            "--exact",
            &format!("child_{name}"),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("LD_LIBRARY_PATH", fake_nvml_dir())
        .env(TOPOLOGY_ENV, topology(topology_file))
        .env(STATE_ENV, fresh_state(name))
        .output()
        .expect("starting the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child_{name} failed:\n{text}");
    // The child must actually have run its scenario (not been filtered out).
    assert!(
        text.contains(&format!("test child_{name} ... ok")),
        "child_{name} did not run:\n{text}"
    );
}

/// In a child: NVML on the simulated library; outside one: `None`.
fn child_nvml() -> Option<Nvml> {
    std::env::var_os(CHILD_ENV)?;
    Some(Nvml::init().expect("NVML (simulated) init"))
}

/// What prepare records for a created device.
fn recorded(m: &CreatedMig) -> Recorded<'_> {
    Recorded {
        gpu_instance_id: m.gpu_instance_id,
        mig_uuid: &m.mig_uuid,
    }
}

/// A record of a device that is not on the GPU (any more).
const GONE: Recorded<'static> = Recorded {
    gpu_instance_id: 7,
    mig_uuid: "MIG-00000000-0000-4000-8000-0000000000aa",
};

fn is_mig_uuid(s: &str) -> bool {
    s.len() == 40 && s.starts_with("MIG-") && tessera_driver::host::mps_client::is_device_uuid(s)
}

/// The MIG device is visible to NVML by its UUID, on the right parent, with
/// the right instance ids.
fn assert_device(nvml: &Nvml, m: &CreatedMig) {
    let dev = nvml
        .device_by_uuid(m.mig_uuid.as_str())
        .unwrap_or_else(|e| panic!("{} not found: {e}", m.mig_uuid));
    assert!(dev.mig_is_mig_device_handle().unwrap());
    assert_eq!(
        raw::mig_device_ids(nvml, &dev).unwrap(),
        (m.gpu_instance_id, m.compute_instance_id)
    );
    let parent = dev.mig_parent_device().unwrap();
    assert_eq!(parent.uuid().unwrap(), m.gpu_uuid);
}

#[test]
fn create_repeat_destroy_on_an_empty_h100() {
    run_child("create_repeat_destroy", "h100x8-mig.yaml");
}

#[test]
#[ignore = "run in a child process by create_repeat_destroy_on_an_empty_h100"]
fn child_create_repeat_destroy() {
    let Some(nvml) = child_nvml() else { return };
    assert!(mig::list(&nvml, H100_EMPTY).unwrap().is_empty());

    let one = mig::create(&nvml, H100_EMPTY, P_1G, at(0, 1)).unwrap();
    // NVML numbers single-slice instances at 4,5,6,7,0,1,2,3 as 7..14.
    assert_eq!((one.gpu_instance_id, one.compute_instance_id), (11, 0));
    assert_eq!((one.profile_id, one.placement), (P_1G, at(0, 1)));
    // The 1-slice compute profile (NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE).
    assert_eq!(one.compute_profile_id, 0);
    assert_eq!(one.multiprocessors, 16);
    assert!(is_mig_uuid(&one.mig_uuid), "{}", one.mig_uuid);
    assert_device(&nvml, &one);

    // A second create at the placement adopts nothing, not even an
    // instance of the same profile: NVML cannot say who made it.
    let err = mig::create(&nvml, H100_EMPTY, P_1G, at(0, 1)).unwrap_err();
    assert!(matches!(err, MigError::Occupied { .. }), "{err}");
    assert!(mig::check_free(&nvml, H100_EMPTY, P_1G, at(0, 1)).is_err());
    assert!(mig::check_free(&nvml, H100_EMPTY, P_1G, at(1, 1)).is_ok());

    // A second, larger one beside it: 3g.40gb at 4:4 is GPU instance 1.
    let three = mig::create(&nvml, H100_EMPTY, P_3G, at(4, 4)).unwrap();
    assert_eq!(three.gpu_instance_id, 1);
    // The spanning compute instance: 3 slices (NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE).
    assert_eq!(three.compute_profile_id, 2);
    assert_eq!(three.multiprocessors, 60);
    assert_ne!(three.mig_uuid, one.mig_uuid);
    assert_device(&nvml, &three);

    let listed = mig::list(&nvml, H100_EMPTY).unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|g| (
                g.gpu_instance_id,
                g.profile_id,
                g.placement,
                g.compute_instances.len()
            ))
            .collect::<Vec<_>>(),
        [(1, P_3G, at(4, 4), 1), (11, P_1G, at(0, 1), 1)]
    );
    assert_eq!(
        listed[1].compute_instances[0].mig_uuid.as_deref(),
        Some(one.mig_uuid.as_str())
    );
    assert_eq!(listed[0].compute_instances[0].slices, 3);

    // The whole GPU no longer fits.
    let err = mig::create(&nvml, H100_EMPTY, P_7G, at(0, 8)).unwrap_err();
    assert!(matches!(err, MigError::Occupied { .. }), "{err}");
    assert!(err.to_string().contains("GPU instance 1"), "{err}");

    // A record that names another device is not this instance's: left alone.
    let other = Recorded {
        gpu_instance_id: one.gpu_instance_id,
        mig_uuid: "MIG-00000000-0000-4000-8000-000000000000",
    };
    assert_eq!(
        mig::destroy(&nvml, H100_EMPTY, P_1G, at(0, 1), other).unwrap(),
        Destroyed::AlreadyGone
    );
    assert_device(&nvml, &one);
    // Destroy: compute instance, then GPU instance; twice is fine.
    assert_eq!(
        mig::destroy(&nvml, H100_EMPTY, P_1G, at(0, 1), recorded(&one)).unwrap(),
        Destroyed::Destroyed
    );
    assert_eq!(
        mig::destroy(&nvml, H100_EMPTY, P_1G, at(0, 1), recorded(&one)).unwrap(),
        Destroyed::AlreadyGone
    );
    assert!(nvml.device_by_uuid(one.mig_uuid.as_str()).is_err());
    let listed = mig::list(&nvml, H100_EMPTY).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].gpu_instance_id, 1);

    assert_eq!(
        mig::destroy(&nvml, H100_EMPTY, P_3G, at(4, 4), recorded(&three)).unwrap(),
        Destroyed::Destroyed
    );
    assert!(mig::list(&nvml, H100_EMPTY).unwrap().is_empty());
    // And the whole GPU fits again.
    let whole = mig::create(&nvml, H100_EMPTY, P_7G, at(0, 8)).unwrap();
    assert_eq!((whole.gpu_instance_id, whole.multiprocessors), (0, 132));
    mig::destroy(&nvml, H100_EMPTY, P_7G, at(0, 8), recorded(&whole)).unwrap();
}

#[test]
fn a_half_made_instance_is_neither_adopted_nor_destroyed() {
    run_child("half_made", "a100-40gb-x2-mig.yaml");
}

#[test]
#[ignore = "run in a child process by a_half_made_instance_is_neither_adopted_nor_destroyed"]
fn child_half_made() {
    let Some(nvml) = child_nvml() else { return };
    // What a crash between NVML's two creations leaves: the GPU instance
    // without its compute instance (memory slice 3 is the A100's free one).
    let gpu = nvml.device_by_uuid(A100_MIXED).unwrap();
    let gi = raw::create_gpu_instance(&nvml, &gpu, P_1G, 3, 1).unwrap();
    let gi_id = raw::gpu_instance_info(&nvml, gi).unwrap().id;
    // 1g at 3:1 is the single-slice node for slice 3: id 14.
    assert_eq!(gi_id, 14);
    let before = mig::list(&nvml, A100_MIXED).unwrap();
    let half = before.iter().find(|g| g.gpu_instance_id == 14).unwrap();
    assert!(half.compute_instances.is_empty());

    // Not adopted: prepare's retry happens after a rollback, never over it.
    // The failure made nothing, so prepare drops its intent.
    let err = mig::create(&nvml, A100_MIXED, P_1G, at(3, 1)).unwrap_err();
    assert!(matches!(err, MigError::Occupied { .. }), "{err}");
    assert!(err.made_nothing(), "{err}");
    assert!(err.to_string().contains("GPU instance 14"), "{err}");
    assert_eq!(mig::list(&nvml, A100_MIXED).unwrap(), before);

    // Nothing recorded names it, so no destroy of the driver's takes it,
    // whoever made it: a record of another device at the placement leaves
    // it alone.
    assert_eq!(
        mig::destroy(&nvml, A100_MIXED, P_1G, at(3, 1), GONE).unwrap(),
        Destroyed::AlreadyGone
    );
    assert_eq!(mig::list(&nvml, A100_MIXED).unwrap(), before);
    // The operator removes it (nvidia-smi mig -dgi).
    raw::destroy_gpu_instance(&nvml, gi).unwrap();
    let summary: Vec<_> = mig::list(&nvml, A100_MIXED)
        .unwrap()
        .iter()
        .map(|g| {
            (
                g.gpu_instance_id,
                g.placement,
                g.compute_instances[0].mig_uuid.clone().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                1,
                at(4, 4),
                "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f".to_string()
            ),
            (
                5,
                at(0, 2),
                "MIG-004e26da-86c5-4f0b-984c-56d97a00b1b4".to_string()
            ),
            (
                13,
                at(2, 1),
                "MIG-cc04a385-500f-4314-8218-133a4f8051b2".to_string()
            ),
        ]
    );
    // Now the placement is free and a create succeeds.
    let m = mig::create(&nvml, A100_MIXED, P_1G, at(3, 1)).unwrap();
    assert_eq!((m.gpu_instance_id, m.compute_instance_id), (14, 0));
    assert_device(&nvml, &m);
}

#[test]
fn what_is_not_ours_is_refused_and_left_alone() {
    run_child("not_ours", "a100-40gb-x2-mig.yaml");
}

#[test]
#[ignore = "run in a child process by what_is_not_ours_is_refused_and_left_alone"]
fn child_not_ours() {
    let Some(nvml) = child_nvml() else { return };
    let listed = || mig::list(&nvml, A100_MIXED).unwrap();
    let before = listed();

    // 3g.20gb at 0:4 overlaps the static 2g.10gb at 0:2.
    let err = mig::create(&nvml, A100_MIXED, P_3G, at(0, 4)).unwrap_err();
    assert!(matches!(err, MigError::Occupied { .. }), "{err}");
    assert!(err.to_string().contains("GPU instance 5"), "{err}");
    // Destroying "our" 1g at 4:4 where a 3g.20gb sits: ours is gone, the
    // 3g.20gb is left alone.
    assert_eq!(
        mig::destroy(&nvml, A100_MIXED, P_1G, at(4, 4), GONE).unwrap(),
        Destroyed::AlreadyGone
    );
    // A record of the static 3g.20gb's GPU instance id with another UUID
    // (a device of ours that was replaced by someone else's) is not it.
    let stale = Recorded {
        gpu_instance_id: 1,
        mig_uuid: "MIG-00000000-0000-4000-8000-000000000001",
    };
    assert_eq!(
        mig::destroy(&nvml, A100_MIXED, P_3G, at(4, 4), stale).unwrap(),
        Destroyed::AlreadyGone
    );
    assert_eq!(listed(), before);

    // Wrong inputs, each with its own error.
    let err = mig::create(&nvml, A100_MIXED, 99, at(3, 1)).unwrap_err();
    assert!(
        matches!(err, MigError::UnknownProfile { profile_id: 99, .. }),
        "{err}"
    );
    // 2g.10gb takes two memory slices, and slice 3 is free.
    let err = mig::create(&nvml, A100_MIXED, P_2G, at(3, 1)).unwrap_err();
    assert!(matches!(err, MigError::BadPlacement { .. }), "{err}");
    let err = mig::create(&nvml, A100_OFF, P_1G, at(0, 1)).unwrap_err();
    assert!(matches!(err, MigError::MigDisabled { .. }), "{err}");
    assert!(err.to_string().contains("fix:"), "{err}");
    let missing = "GPU-00000000-0000-4000-8000-000000000000";
    let err = mig::create(&nvml, missing, P_1G, at(0, 1)).unwrap_err();
    assert!(matches!(err, MigError::GpuNotFound { .. }), "{err}");
    // Unprepare after the GPU (or MIG mode) went away has nothing to undo.
    assert_eq!(
        mig::destroy(&nvml, missing, P_1G, at(0, 1), GONE).unwrap(),
        Destroyed::AlreadyGone
    );
    assert_eq!(
        mig::destroy(&nvml, A100_OFF, P_1G, at(0, 1), GONE).unwrap(),
        Destroyed::AlreadyGone
    );
    assert!(mig::list(&nvml, A100_OFF).unwrap().is_empty());
    assert_eq!(listed(), before);
}

#[test]
fn a_gpu_instance_split_by_someone_else_is_left_alone() {
    run_child("split", "h100x8-mig.yaml");
}

#[test]
#[ignore = "run in a child process by a_gpu_instance_split_by_someone_else_is_left_alone"]
fn child_split() {
    let Some(nvml) = child_nvml() else { return };
    let gpu = nvml.device_by_uuid(H100_EMPTY).unwrap();
    // `nvidia-smi mig -cgi 2g.20gb` then two `-cci 1c.2g.20gb` by hand.
    let gi = raw::create_gpu_instance(&nvml, &gpu, P_2G, 0, 2).unwrap();
    raw::create_compute_instance(&nvml, gi, 0).unwrap();
    raw::create_compute_instance(&nvml, gi, 0).unwrap();
    let before = mig::list(&nvml, H100_EMPTY).unwrap();

    let err = mig::create(&nvml, H100_EMPTY, P_2G, at(0, 2)).unwrap_err();
    assert!(matches!(err, MigError::Occupied { .. }), "{err}");
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].compute_instances.len(), 2);
    assert!(
        before[0]
            .compute_instances
            .iter()
            .all(|c| c.slices == 1 && c.mig_uuid.as_deref().is_some_and(is_mig_uuid))
    );
    // A record of a device of ours at that placement does not match it.
    let ours = Recorded {
        gpu_instance_id: before[0].gpu_instance_id,
        mig_uuid: "MIG-00000000-0000-4000-8000-000000000002",
    };
    assert_eq!(
        mig::destroy(&nvml, H100_EMPTY, P_2G, at(0, 2), ours).unwrap(),
        Destroyed::AlreadyGone
    );
    assert_eq!(mig::list(&nvml, H100_EMPTY).unwrap(), before);
}

#[test]
fn a_destroy_interrupted_between_the_two_instances_is_finished_by_the_record() {
    run_child("interrupted_destroy", "h100x8-mig.yaml");
}

#[test]
#[ignore = "run in a child process by a_destroy_interrupted_between_the_two_instances_is_finished_by_the_record"]
fn child_interrupted_destroy() {
    let Some(nvml) = child_nvml() else { return };
    let gpu = nvml.device_by_uuid(H100_EMPTY).unwrap();
    let m = mig::create(&nvml, H100_EMPTY, P_1G, at(0, 1)).unwrap();
    // A kill after the compute instance went and before the GPU instance:
    // the MIG device (and its UUID) is gone, the GPU instance is left.
    let gi = raw::gpu_instance_by_id(&nvml, &gpu, m.gpu_instance_id).unwrap();
    for ci in raw::compute_instances(&nvml, gi, m.compute_profile_id, 8).unwrap() {
        raw::destroy_compute_instance(&nvml, ci).unwrap();
    }
    assert!(nvml.device_by_uuid(m.mig_uuid.as_str()).is_err());
    // Someone else's bare GPU instance elsewhere is not it.
    let other = raw::create_gpu_instance(&nvml, &gpu, P_1G, 1, 1).unwrap();
    let other_id = raw::gpu_instance_info(&nvml, other).unwrap().id;
    assert_eq!(
        mig::destroy(&nvml, H100_EMPTY, P_1G, at(1, 1), recorded(&m)).unwrap(),
        Destroyed::AlreadyGone
    );
    // The retried undo finishes ours.
    assert_eq!(
        mig::destroy(&nvml, H100_EMPTY, P_1G, at(0, 1), recorded(&m)).unwrap(),
        Destroyed::Destroyed
    );
    let left: Vec<u32> = mig::list(&nvml, H100_EMPTY)
        .unwrap()
        .iter()
        .map(|g| g.gpu_instance_id)
        .collect();
    assert_eq!(left, [other_id]);
    // And the placement can be used again.
    mig::create(&nvml, H100_EMPTY, P_1G, at(0, 1)).unwrap();
}

#[test]
fn concurrent_creates_on_one_gpu_all_land() {
    run_child("concurrent", "h100x8-mig.yaml");
}

#[test]
#[ignore = "run in a child process by concurrent_creates_on_one_gpu_all_land"]
fn child_concurrent() {
    let Some(nvml) = child_nvml() else { return };
    let nvml = &nvml;
    let made: Vec<CreatedMig> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..7)
            .map(|start| s.spawn(move || mig::create(nvml, H100_EMPTY, P_1G, at(start, 1))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    });
    let mut ids: Vec<u32> = made.iter().map(|m| m.gpu_instance_id).collect();
    ids.sort();
    // Single slices 0..6: ids 11, 12, 13, 14 (slices 0-3) and 7, 8, 9 (4-6).
    assert_eq!(ids, [7, 8, 9, 11, 12, 13, 14]);
    let uuids: std::collections::BTreeSet<_> = made.iter().map(|m| &m.mig_uuid).collect();
    assert_eq!(uuids.len(), 7);
    assert_eq!(mig::list(nvml, H100_EMPTY).unwrap().len(), 7);
    std::thread::scope(|s| {
        for m in &made {
            s.spawn(move || {
                assert_eq!(
                    mig::destroy(nvml, H100_EMPTY, P_1G, m.placement, recorded(m)).unwrap(),
                    Destroyed::Destroyed
                )
            });
        }
    });
    assert!(mig::list(nvml, H100_EMPTY).unwrap().is_empty());
}

#[test]
fn the_prepare_trait_creates_and_destroys_through_nvml() {
    run_child("prepare_trait", "h100x8-mig.yaml");
}

#[test]
#[ignore = "run in a child process by the_prepare_trait_creates_and_destroys_through_nvml"]
fn child_prepare_trait() {
    use std::sync::Arc;
    use tessera_driver::host::mig::NvmlMig;
    use tessera_driver::host::port::CreateError;
    use tessera_driver::host::port::MigManager;
    use tessera_driver::state::records::MigRecord;

    let Some(nvml) = child_nvml() else { return };
    let nvml = Arc::new(nvml);
    let inventory = tessera_driver::discovery::discover(&nvml)
        .unwrap()
        .inventory;
    let manager = NvmlMig::new(nvml.clone(), &inventory);

    manager.check_free(H100_EMPTY, P_2G, at(2, 2)).unwrap();
    let made = manager.create(H100_EMPTY, P_2G, at(2, 2)).unwrap();
    assert_eq!(made.profile, "2g.20gb");
    assert_eq!(made.profile_id, P_2G);
    // 2g at 2:2 is the quarter node at 2: id 6.
    assert_eq!((made.gpu_instance_id, made.compute_instance_id), (6, 0));
    assert_eq!(made.placement, at(2, 2));
    assert_eq!(made.memory_bytes, 20096 << 20);
    assert_eq!(made.multiprocessors, 32);
    assert!(is_mig_uuid(&made.uuid));
    assert!(manager.has_instances(H100_EMPTY).unwrap());
    // Repeated: refused, nothing adopted, and nothing made (so prepare
    // drops its intent and no rollback touches what is there).
    let err = manager.check_free(H100_EMPTY, P_2G, at(2, 2)).unwrap_err();
    assert!(err.to_string().contains("GPU instance 6"), "{err}");
    let err = manager.create(H100_EMPTY, P_2G, at(2, 2)).unwrap_err();
    assert!(matches!(err, CreateError::NothingMade(_)), "{err}");
    // Unknown profile: a clear error, nothing created.
    let err = manager.create(H100_EMPTY, 77, at(0, 1)).unwrap_err();
    assert!(
        matches!(&err, CreateError::NothingMade(e) if e.to_string().contains("77")),
        "{err}"
    );
    // MIG mode cannot go off under an instance.
    assert!(manager.set_mig_mode(H100_EMPTY, false).is_err());
    assert!(manager.mig_enabled(H100_EMPTY).unwrap());

    let record = MigRecord {
        gpu_instance_id: made.gpu_instance_id,
        compute_instance_id: made.compute_instance_id,
        mig_uuid: made.uuid.clone(),
    };
    manager
        .destroy(H100_EMPTY, P_2G, at(2, 2), &record)
        .unwrap();
    manager
        .destroy(H100_EMPTY, P_2G, at(2, 2), &record)
        .unwrap();
    manager
        .destroy(
            "GPU-00000000-0000-4000-8000-000000000000",
            P_2G,
            at(2, 2),
            &record,
        )
        .unwrap();
    assert!(mig::list(&nvml, H100_EMPTY).unwrap().is_empty());
    assert!(!manager.has_instances(H100_EMPTY).unwrap());
    manager.set_mig_mode(H100_EMPTY, false).unwrap();
    assert!(!manager.mig_enabled(H100_EMPTY).unwrap());
}

#[test]
fn mig_mode_switches_without_reset_on_hopper_only() {
    run_child("mig_mode", "h100x8.yaml");
    run_child("mig_mode_ampere", "a100-40gb-x2-mig.yaml");
}

#[test]
#[ignore = "run in a child process by mig_mode_switches_without_reset_on_hopper_only"]
fn child_mig_mode() {
    let Some(nvml) = child_nvml() else { return };
    assert!(!mig::mig_enabled(&nvml, H100_OFF).unwrap());
    mig::set_mig_mode(&nvml, H100_OFF, true).unwrap();
    assert!(mig::mig_enabled(&nvml, H100_OFF).unwrap());
    let m = mig::create(&nvml, H100_OFF, P_1G, at(0, 1)).unwrap();
    assert_device(&nvml, &m);
    mig::destroy(&nvml, H100_OFF, P_1G, at(0, 1), recorded(&m)).unwrap();
    mig::set_mig_mode(&nvml, H100_OFF, false).unwrap();
    assert!(!mig::mig_enabled(&nvml, H100_OFF).unwrap());
}

#[test]
#[ignore = "run in a child process by mig_mode_switches_without_reset_on_hopper_only"]
fn child_mig_mode_ampere() {
    let Some(nvml) = child_nvml() else { return };
    // An A100 takes a new MIG mode only at the next GPU reset: the switch
    // is refused and the GPU left as it was (no pending mode either).
    let err = mig::set_mig_mode(&nvml, A100_OFF, true).unwrap_err();
    assert!(matches!(err, MigError::NeedsReset { .. }), "{err}");
    assert!(err.to_string().contains("migModeSwitch"), "{err}");
    let mode = nvml.device_by_uuid(A100_OFF).unwrap().mig_mode().unwrap();
    assert_eq!((mode.current, mode.pending), (0, 0));
}
