//! The C ABI exercised in-process, the way a C caller would use it.
//!
//! The library state is process-global, so tests take a lock and start from
//! a fresh machine.

use std::io::Write;
use std::mem::zeroed;
use std::sync::MutexGuard;

use super::*;

const T4: &str = include_str!("../topologies/t4.yaml");
const L4X2: &str = include_str!("../topologies/l4x2.yaml");
const A100: &str = include_str!("../topologies/a100-40gb-x2-mig.yaml");
const H100X8: &str = include_str!("../topologies/h100x8.yaml");
const H100X8_MIG: &str = include_str!("../topologies/h100x8-mig.yaml");

static SERIAL: Mutex<()> = Mutex::new(());

/// Fresh library state on `topology`; released when the guard drops.
fn machine(topology: &str, events: Option<PathBuf>) -> MutexGuard<'static, ()> {
    let guard = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    *TEST_CONFIG.lock().unwrap() = Some((topology.to_string(), events));
    let mut lib = lock();
    lib.init_count = 0;
    lib.machine = None;
    guard
}

fn init_ok() {
    assert_eq!(nvmlInit_v2(), SUCCESS);
}

fn device(index: u32) -> nvmlDevice_t {
    let mut d: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(index, &mut d) },
        SUCCESS
    );
    d
}

fn name_of(d: nvmlDevice_t) -> String {
    let mut buf = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetName(d, buf.as_mut_ptr(), 96) },
        SUCCESS
    );
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn shipped_topologies_are_valid() {
    for (name, text) in [
        ("t4", T4),
        ("l4x2", L4X2),
        ("a100", A100),
        ("h100x8", H100X8),
        ("h100x8-mig", H100X8_MIG),
    ] {
        let t = Topology::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!t.gpus.is_empty(), "{name}");
    }
}

#[test]
fn calls_before_init_are_uninitialized_and_init_is_reference_counted() {
    let _m = machine(T4, None);
    let mut n: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, UNINITIALIZED);
    assert_eq!(nvmlShutdown(), UNINITIALIZED);
    init_ok();
    assert_eq!(nvmlInitWithFlags(0), SUCCESS);
    assert_eq!(nvmlShutdown(), SUCCESS);
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, SUCCESS);
    assert_eq!(n, 1);
    assert_eq!(nvmlShutdown(), SUCCESS);
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, UNINITIALIZED);
}

#[test]
fn string_buffers_are_checked() {
    let _m = machine(T4, None);
    init_ok();
    let mut buf = [0 as c_char; 80];
    let exact = "535.183.01".len() as c_uint + 1;
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(buf.as_mut_ptr(), exact - 1) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(ptr::null_mut(), 80) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(buf.as_mut_ptr(), exact) },
        SUCCESS
    );
    assert_eq!(
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(),
        "535.183.01"
    );
    let mut cuda: c_int = 0;
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion_v2(&mut cuda) },
        SUCCESS
    );
    assert_eq!(cuda, 12020);
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion_v2(ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    let d = device(0);
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(d, buf.as_mut_ptr(), 10) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(name_of(d), "Tesla T4");
    nvmlShutdown();
}

#[test]
fn handles_are_validated_and_found_by_uuid_and_bus_id() {
    let _m = machine(L4X2, None);
    init_ok();
    let mut d: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(2, &mut d) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(0, ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    let uuid = c"GPU-f8f334ff-21f0-4f18-a6d7-5d98736b420c";
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut d) },
        SUCCESS
    );
    assert_eq!(d, device(1));
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(c"GPU-nope".as_ptr(), &mut d) },
        NOT_FOUND
    );
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(c"0000:00:03.0".as_ptr(), &mut d) },
        SUCCESS
    );
    assert_eq!(d, device(0));
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(c"00000000:00:04.0".as_ptr(), &mut d) },
        SUCCESS
    );
    assert_eq!(d, device(1));
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(c"0000:00:05.0".as_ptr(), &mut d) },
        NOT_FOUND
    );
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(c"junk".as_ptr(), &mut d) },
        INVALID_ARGUMENT
    );
    let forged: nvmlDevice_t = ptr::without_provenance_mut(0x1000);
    let mut brand: nvmlBrandType_t = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetBrand(forged, &mut brand) },
        INVALID_ARGUMENT
    );
    let mut pci: nvmlPciInfo_t = unsafe { zeroed() };
    assert_eq!(
        unsafe { nvmlDeviceGetPciInfo_v3(device(1), &mut pci) },
        SUCCESS
    );
    assert_eq!(
        unsafe { CStr::from_ptr(pci.busId.as_ptr()) }
            .to_str()
            .unwrap(),
        "00000000:00:04.0"
    );
    assert_eq!(
        unsafe { CStr::from_ptr(pci.busIdLegacy.as_ptr()) }
            .to_str()
            .unwrap(),
        "0000:00:04.0"
    );
    assert_eq!(pci.pciDeviceId, 0x27B8_10DE);
    nvmlShutdown();
}

#[test]
fn memory_info_v2_checks_the_struct_version() {
    let _m = machine(T4, None);
    init_ok();
    let mut mem: nvmlMemory_v2_t = unsafe { zeroed() };
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(device(0), &mut mem) },
        ARGUMENT_VERSION_MISMATCH
    );
    mem.version = struct_version::<nvmlMemory_v2_t>(2);
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(device(0), &mut mem) },
        SUCCESS
    );
    assert_eq!(mem.total, 15360 * MIB);
    nvmlShutdown();
}

#[test]
fn mig_calls_on_a_gpu_without_mig_are_not_supported() {
    let _m = machine(T4, None);
    init_ok();
    let d = device(0);
    let (mut cur, mut pending, mut n) = (0, 0, 0);
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(d, &mut cur, &mut pending) },
        NOT_SUPPORTED
    );
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { zeroed() };
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceProfileInfo(d, 0, &mut info) },
        NOT_SUPPORTED
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMaxMigDeviceCount(d, &mut n) },
        NOT_SUPPORTED
    );
    let mut attrs: nvmlDeviceAttributes_t = unsafe { zeroed() };
    assert_eq!(
        unsafe { nvmlDeviceGetAttributes_v2(d, &mut attrs) },
        NOT_SUPPORTED
    );
    nvmlShutdown();
}

#[test]
fn profiles_and_placements_follow_the_nvml_protocols() {
    let _m = machine(A100, None);
    init_ok();
    let d = device(1); // MIG off: profiles and placements still answer
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { zeroed() };
    assert_eq!(
        unsafe {
            nvmlDeviceGetGpuInstanceProfileInfo(d, NVML_GPU_INSTANCE_PROFILE_3_SLICE, &mut info)
        },
        SUCCESS
    );
    assert_eq!((info.id, info.sliceCount, info.memorySizeMB), (9, 3, 19968));
    assert_eq!(
        unsafe {
            nvmlDeviceGetGpuInstanceProfileInfo(d, NVML_GPU_INSTANCE_PROFILE_6_SLICE, &mut info)
        },
        NOT_SUPPORTED
    );
    assert_eq!(
        unsafe {
            nvmlDeviceGetGpuInstanceProfileInfo(d, NVML_GPU_INSTANCE_PROFILE_COUNT, &mut info)
        },
        INVALID_ARGUMENT
    );

    let mut v3: nvmlGpuInstanceProfileInfo_v3_t = unsafe { zeroed() };
    let v3_ptr = (&mut v3 as *mut nvmlGpuInstanceProfileInfo_v3_t).cast();
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceProfileInfoV(d, 7, v3_ptr) },
        ARGUMENT_VERSION_MISMATCH
    );
    v3.version = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceProfileInfoV(d, 7, v3_ptr) },
        SUCCESS
    );
    assert_eq!(
        unsafe { CStr::from_ptr(v3.name.as_ptr()) }
            .to_str()
            .unwrap(),
        "MIG 1g.5gb+me"
    );
    assert_eq!((v3.id, v3.ofaCount), (20, 1));

    let mut count: c_uint = 0;
    assert_eq!(
        unsafe {
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(d, 15, ptr::null_mut(), &mut count)
        },
        SUCCESS
    );
    assert_eq!(count, 4);
    let mut out = [nvmlGpuInstancePlacement_t {
        start: 99,
        size: 99,
    }; 8];
    count = 3;
    assert_eq!(
        unsafe {
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(d, 15, out.as_mut_ptr(), &mut count)
        },
        INSUFFICIENT_SIZE
    );
    assert_eq!(count, 4);
    assert_eq!(out[0].start, 99, "nothing written on INSUFFICIENT_SIZE");
    count = 8;
    assert_eq!(
        unsafe {
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(d, 15, out.as_mut_ptr(), &mut count)
        },
        SUCCESS
    );
    let got: Vec<(u32, u32)> = out[..count as usize]
        .iter()
        .map(|p| (p.start, p.size))
        .collect();
    assert_eq!(got, vec![(0, 2), (2, 2), (4, 2), (6, 2)]);
    assert_eq!(
        unsafe {
            nvmlDeviceGetGpuInstancePossiblePlacements_v2(d, 42, ptr::null_mut(), &mut count)
        },
        INVALID_ARGUMENT
    );
    nvmlShutdown();
}

#[test]
fn mig_devices_enumerate_with_ids_attributes_and_parents() {
    let _m = machine(A100, None);
    init_ok();
    let d = device(0);
    let mut max = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetMaxMigDeviceCount(d, &mut max) },
        SUCCESS
    );
    assert_eq!(max, 7);
    let mut found = Vec::new();
    for i in 0..max {
        let mut mig: nvmlDevice_t = ptr::null_mut();
        match unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d, i, &mut mig) } {
            SUCCESS => {}
            NOT_FOUND => continue,
            other => panic!("index {i}: {other}"),
        }
        let (mut is_mig, mut gi, mut ci) = (0, 0, 0);
        assert_eq!(
            unsafe { nvmlDeviceIsMigDeviceHandle(mig, &mut is_mig) },
            SUCCESS
        );
        assert_eq!(is_mig, 1);
        assert_eq!(unsafe { nvmlDeviceGetGpuInstanceId(mig, &mut gi) }, SUCCESS);
        assert_eq!(
            unsafe { nvmlDeviceGetComputeInstanceId(mig, &mut ci) },
            SUCCESS
        );
        let mut attrs: nvmlDeviceAttributes_t = unsafe { zeroed() };
        assert_eq!(
            unsafe { nvmlDeviceGetAttributes_v2(mig, &mut attrs) },
            SUCCESS
        );
        let mut parent: nvmlDevice_t = ptr::null_mut();
        assert_eq!(
            unsafe { nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, &mut parent) },
            SUCCESS
        );
        assert_eq!(parent, d);
        let mut gih: nvmlGpuInstance_t = ptr::null_mut();
        assert_eq!(
            unsafe { nvmlDeviceGetGpuInstanceById(d, gi, &mut gih) },
            SUCCESS
        );
        let mut info: nvmlGpuInstanceInfo_t = unsafe { zeroed() };
        assert_eq!(unsafe { nvmlGpuInstanceGetInfo(gih, &mut info) }, SUCCESS);
        found.push((
            gi,
            ci,
            info.profileId,
            info.placement.start,
            attrs.multiprocessorCount,
            name_of(mig),
        ));
    }
    assert_eq!(
        found,
        vec![
            (
                1,
                0,
                9,
                4,
                42,
                "NVIDIA A100-SXM4-40GB MIG 3g.20gb".to_string()
            ),
            (
                5,
                0,
                14,
                0,
                28,
                "NVIDIA A100-SXM4-40GB MIG 2g.10gb".to_string()
            ),
            (
                13,
                0,
                19,
                2,
                14,
                "NVIDIA A100-SXM4-40GB MIG 1g.5gb".to_string()
            ),
        ]
    );
    let mut mig: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d, 7, &mut mig) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(device(1), 0, &mut mig) },
        NOT_SUPPORTED
    );
    let mut gi = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceId(d, &mut gi) },
        NOT_SUPPORTED
    );
    nvmlShutdown();
}

#[test]
fn gpu_and_compute_instances_can_be_created_and_destroyed() {
    let _m = machine(A100, None);
    init_ok();
    let d = device(0);
    let mut room = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceRemainingCapacity(d, 19, &mut room) },
        SUCCESS
    );
    assert_eq!(
        room, 1,
        "only memory slice 3 and one compute slice are free"
    );
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceRemainingCapacity(d, 14, &mut room) },
        SUCCESS
    );
    assert_eq!(room, 0);
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceCreateGpuInstance(d, 14, &mut gi) },
        INSUFFICIENT_RESOURCES
    );
    let taken = nvmlGpuInstancePlacement_t { start: 2, size: 1 };
    assert_eq!(
        unsafe { nvmlDeviceCreateGpuInstanceWithPlacement(d, 19, &taken, &mut gi) },
        INSUFFICIENT_RESOURCES
    );
    assert_eq!(
        unsafe { nvmlDeviceCreateGpuInstance(d, 19, &mut gi) },
        SUCCESS
    );
    let mut info: nvmlGpuInstanceInfo_t = unsafe { zeroed() };
    assert_eq!(unsafe { nvmlGpuInstanceGetInfo(gi, &mut info) }, SUCCESS);
    assert_eq!(
        (info.id, info.placement.start, info.placement.size),
        (14, 3, 1)
    );

    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlGpuInstanceCreateComputeInstance(gi, 1, &mut ci) },
        NOT_SUPPORTED
    );
    assert_eq!(
        unsafe { nvmlGpuInstanceCreateComputeInstance(gi, 0, &mut ci) },
        SUCCESS
    );
    let mut cinfo: nvmlComputeInstanceInfo_t = unsafe { zeroed() };
    assert_eq!(
        unsafe { nvmlComputeInstanceGetInfo_v2(ci, &mut cinfo) },
        SUCCESS
    );
    assert_eq!((cinfo.id, cinfo.profileId, cinfo.gpuInstance), (0, 0, gi));

    let mut mig: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d, 3, &mut mig) },
        SUCCESS
    );
    let mut uuid = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(mig, uuid.as_mut_ptr(), 96) },
        SUCCESS
    );
    let uuid = unsafe { CStr::from_ptr(uuid.as_ptr()) }.to_owned();
    assert!(uuid.to_str().unwrap().starts_with("MIG-"));
    let mut by_uuid: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut by_uuid) },
        SUCCESS
    );
    assert_eq!(by_uuid, mig);

    assert_eq!(nvmlGpuInstanceDestroy(gi), IN_USE);
    assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
    assert_eq!(
        nvmlComputeInstanceDestroy(ci),
        INVALID_ARGUMENT,
        "stale handle"
    );
    assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d, 3, &mut mig) },
        NOT_FOUND
    );
    let mut name = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetName(by_uuid, name.as_mut_ptr(), 96) },
        INVALID_ARGUMENT
    );
    nvmlShutdown();
}

#[test]
fn a_lost_gpu_answers_gpu_is_lost_but_keeps_its_handle() {
    let topology = L4X2.replace(
        "    pciBusId: \"00000000:00:04.0\"",
        "    pciBusId: \"00000000:00:04.0\"\n    lost: true",
    );
    let _m = machine(&topology, None);
    init_ok();
    let d = device(1);
    let mut buf = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetName(d, buf.as_mut_ptr(), 96) },
        GPU_IS_LOST
    );
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(d, buf.as_mut_ptr(), 96) },
        GPU_IS_LOST
    );
    assert_eq!(name_of(device(0)), "NVIDIA L4");
    nvmlShutdown();
}

#[test]
fn init_faults_and_bad_topologies_fail_init() {
    let topology = format!("faults:\n  init: DRIVER_NOT_LOADED\n{T4}");
    let _m = machine(&topology, None);
    assert_eq!(nvmlInit_v2(), nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED);
    let mut n = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, UNINITIALIZED);
    drop(_m);
    let _m = machine("gpus: [", None);
    assert_eq!(nvmlInit_v2(), UNKNOWN);
}

#[test]
fn injected_xids_are_delivered_to_registered_event_sets() {
    let dir = std::env::temp_dir().join(format!("tessera-fake-nvml-xid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let events = dir.join("events");
    std::fs::write(&events, "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10 13\n").unwrap();
    let _m = machine(A100, Some(events.clone()));
    init_ok();
    let mut set: nvmlEventSet_t = ptr::null_mut();
    assert_eq!(unsafe { nvmlEventSetCreate(&mut set) }, SUCCESS);
    let mut supported = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetSupportedEventTypes(device(0), &mut supported) },
        SUCCESS
    );
    assert_ne!(supported & u64::from(nvmlEventTypeXidCriticalError), 0);
    let xid = u64::from(nvmlEventTypeXidCriticalError);
    assert_eq!(nvmlDeviceRegisterEvents(device(0), xid, set), SUCCESS);
    assert_eq!(
        nvmlDeviceRegisterEvents(device(0), 1 << 40, set),
        NOT_SUPPORTED
    );

    let mut data: nvmlEventData_t = unsafe { zeroed() };
    let started = Instant::now();
    assert_eq!(
        unsafe { nvmlEventSetWait_v2(set, &mut data, 50) },
        TIMEOUT,
        "lines from before the set are not its events"
    );
    assert!(started.elapsed() >= Duration::from_millis(50));

    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&events)
        .unwrap();
    // GPU 1 is not registered; the MIG device is on GPU 0 (GI 1, CI 0).
    writeln!(f, "GPU-11209e8f-5cb2-4ddf-a3a7-b221364044ee 31").unwrap();
    writeln!(f, "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f 94").unwrap();
    writeln!(f, "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10 79").unwrap();
    drop(f);
    assert_eq!(
        unsafe { nvmlEventSetWait_v2(set, &mut data, 5000) },
        SUCCESS
    );
    assert_eq!(
        (data.device, data.eventType, data.eventData),
        (device(0), xid, 94)
    );
    assert_eq!((data.gpuInstanceId, data.computeInstanceId), (1, 0));
    assert_eq!(
        unsafe { nvmlEventSetWait_v2(set, &mut data, 5000) },
        SUCCESS
    );
    assert_eq!(data.eventData, 79);
    assert_eq!(data.gpuInstanceId, NO_INSTANCE);
    assert_eq!(unsafe { nvmlEventSetWait_v2(set, &mut data, 0) }, TIMEOUT);

    // A writer appending while the wait blocks wakes it.
    let writer = std::thread::spawn({
        let events = events.clone();
        move || {
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&events)
                .unwrap();
            writeln!(f, "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10 48").unwrap();
        }
    });
    assert_eq!(
        unsafe { nvmlEventSetWait_v2(set, &mut data, 10_000) },
        SUCCESS
    );
    assert_eq!(data.eventData, 48);
    writer.join().unwrap();

    assert_eq!(nvmlEventSetFree(set), SUCCESS);
    assert_eq!(nvmlEventSetFree(set), INVALID_ARGUMENT);
    nvmlShutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}
