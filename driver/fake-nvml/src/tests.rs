//! The C ABI exercised in-process, the way a C caller would use it.
//!
//! The library state is process-global, so tests take a lock and start from
//! a fresh machine: the topology given and a state file of its own in a
//! fresh directory (removed when the test's [`TestMachine`] drops), so no two
//! tests ever share run-time state.

use std::ffi::c_int;
use std::io::Write;
use std::mem::zeroed;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::*;

const T4: &str = include_str!("../topologies/t4.yaml");
const L4X2: &str = include_str!("../topologies/l4x2.yaml");
const A100: &str = include_str!("../topologies/a100-40gb-x2-mig.yaml");
const H100X8: &str = include_str!("../topologies/h100x8.yaml");
const H100X8_MIG: &str = include_str!("../topologies/h100x8-mig.yaml");

pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

/// One test's simulated machine; holds the library for the test.
struct TestMachine {
    dir: PathBuf,
    _serial: MutexGuard<'static, ()>,
}

impl TestMachine {
    /// The machine's state file.
    fn state(&self) -> PathBuf {
        self.dir.join("nvml.state")
    }

    /// The driver root of a machine made by [`machine_with_root`].
    fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
}

impl Drop for TestMachine {
    fn drop(&mut self) {
        let mut lib = lock();
        lib.init_count = 0;
        lib.sim = None;
        drop(lib);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh, empty directory of this test process.
fn scratch_dir(what: &str) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tessera-fake-nvml-{what}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn configure(topology: &str, events: Option<PathBuf>, with_root: bool) -> TestMachine {
    let serial = SERIAL.locked();
    let dir = scratch_dir("machine");
    *TEST_CONFIG.lock().unwrap() = Some(TestConfig {
        topology: topology.to_string(),
        events,
        state: dir.join("nvml.state"),
        driver_root: with_root.then(|| dir.join("root")),
        dev_root: None,
        load: true,
    });
    let mut lib = lock();
    lib.init_count = 0;
    lib.sim = None;
    drop(lib);
    TestMachine {
        dir,
        _serial: serial,
    }
}

/// Fresh library state on `topology`; released when the guard drops.
fn machine(topology: &str, events: Option<PathBuf>) -> TestMachine {
    configure(topology, events, false)
}

/// Like [`machine`], keeping MIG capability files below [`TestMachine::root`].
fn machine_with_root(topology: &str) -> TestMachine {
    configure(topology, None, true)
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

// ---------------------------------------------------------------------------
// Machine-wide state

fn state_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
}

fn mig_mode(d: nvmlDevice_t) -> (c_uint, c_uint) {
    let (mut current, mut pending) = (9, 9);
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(d, &mut current, &mut pending) },
        SUCCESS
    );
    (current, pending)
}

fn compute_mode(d: nvmlDevice_t) -> nvmlComputeMode_t {
    let mut mode = 99;
    assert_eq!(unsafe { nvmlDeviceGetComputeMode(d, &mut mode) }, SUCCESS);
    mode
}

/// The error the library last reported on stderr.
fn last_error() -> Option<String> {
    lock().sim.as_ref()?.store.last_error.clone()
}

fn create_gi(d: nvmlDevice_t, profile: c_uint) -> nvmlGpuInstance_t {
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceCreateGpuInstance(d, profile, &mut gi) },
        SUCCESS
    );
    gi
}

fn create_ci(gi: nvmlGpuInstance_t) -> nvmlComputeInstance_t {
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlGpuInstanceCreateComputeInstance(gi, 0, &mut ci) },
        SUCCESS
    );
    ci
}

#[test]
fn the_state_file_is_seeded_from_the_topology() {
    let m = machine(A100, None);
    assert!(!m.state().exists());
    init_ok();
    let state = state_json(&m.state());
    assert_eq!(state["version"], 1);
    assert_eq!(state["created"], 0);
    let gpu0 = &state["gpus"][0];
    assert_eq!(gpu0["uuid"], "GPU-389bff59-b356-48b2-9dcf-ef5d4de38e10");
    assert_eq!(gpu0["computeMode"], "default");
    assert_eq!(gpu0["mig"]["current"], "enabled");
    assert_eq!(gpu0["mig"]["pending"], "enabled");
    let gis: Vec<(u64, u64, u64, &str)> = gpu0["mig"]["gpuInstances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|gi| {
            let ci = &gi["computeInstances"][0];
            assert_eq!(ci["id"], 0);
            (
                gi["id"].as_u64().unwrap(),
                gi["profileId"].as_u64().unwrap(),
                gi["start"].as_u64().unwrap(),
                ci["uuid"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        gis,
        [
            (1, 9, 4, "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f"),
            (5, 14, 0, "MIG-004e26da-86c5-4f0b-984c-56d97a00b1b4"),
            (13, 19, 2, "MIG-cc04a385-500f-4314-8218-133a4f8051b2"),
        ]
    );
    assert_eq!(state["gpus"][1]["mig"]["current"], "disabled");
    assert_eq!(
        state["gpus"][1]["mig"]["gpuInstances"],
        serde_json::json!([])
    );
    nvmlShutdown();

    // A GPU that cannot do MIG has no MIG state.
    drop(m);
    let m = machine(T4, None);
    init_ok();
    assert!(state_json(&m.state())["gpus"][0].get("mig").is_none());
    nvmlShutdown();
}

#[test]
fn changes_written_by_another_process_are_seen_without_init() {
    let m = machine(A100, None);
    init_ok();
    let (d0, d1) = (device(0), device(1));
    assert_eq!(mig_mode(d1), (0, 0));
    let mut gone: nvmlDevice_t = ptr::null_mut();
    let uuid = c"MIG-cc04a385-500f-4314-8218-133a4f8051b2";
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut gone) },
        SUCCESS
    );

    // What another process's calls would have written.
    let mut state = state_json(&m.state());
    state["gpus"][1]["mig"]["current"] = "enabled".into();
    state["gpus"][1]["mig"]["pending"] = "enabled".into();
    state["gpus"][0]["computeMode"] = "prohibited".into();
    state["gpus"][0]["mig"]["gpuInstances"]
        .as_array_mut()
        .unwrap()
        .retain(|gi| gi["id"] != 13);
    write_json(&m.state(), &state);

    assert_eq!(mig_mode(d1), (1, 1));
    assert_eq!(
        compute_mode(d0),
        nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED
    );
    let mut h: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut h) },
        NOT_FOUND
    );
    let mut name = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetName(gone, name.as_mut_ptr(), 96) },
        INVALID_ARGUMENT,
        "a handle to a MIG device destroyed elsewhere is stale"
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d0, 2, &mut h) },
        NOT_FOUND
    );
    nvmlShutdown();
}

#[test]
fn the_file_is_written_when_and_only_when_state_changes() {
    let m = machine(A100, None);
    init_ok();
    let d0 = device(0);
    let before = std::fs::metadata(m.state()).unwrap().ino();
    // Queries, a MIG mode already set, a compute mode already set and a
    // failed creation change nothing.
    assert_eq!(name_of(d0), "NVIDIA A100-SXM4-40GB");
    let mut status = SUCCESS;
    assert_eq!(unsafe { nvmlDeviceSetMigMode(d0, 1, &mut status) }, SUCCESS);
    assert_eq!(nvmlDeviceSetComputeMode(d0, 0), SUCCESS);
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceCreateGpuInstance(d0, 14, &mut gi) },
        INSUFFICIENT_RESOURCES
    );
    assert_eq!(std::fs::metadata(m.state()).unwrap().ino(), before);

    let gi = create_gi(d0, 19);
    let after = std::fs::metadata(m.state()).unwrap().ino();
    assert_ne!(after, before, "replaced by a rename");
    let ids: Vec<u64> = state_json(&m.state())["gpus"][0]["mig"]["gpuInstances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [1, 5, 13, 14]);
    let _ci = create_ci(gi);
    let state = state_json(&m.state());
    assert_eq!(state["created"], 1);
    let ci = &state["gpus"][0]["mig"]["gpuInstances"][3]["computeInstances"][0];
    assert!(ci["uuid"].as_str().unwrap().starts_with("MIG-"));
    assert_eq!(
        (ci["slices"].as_u64(), ci["start"].as_u64()),
        (Some(1), Some(0))
    );
    let leftovers: Vec<_> = std::fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    nvmlShutdown();
}

#[test]
fn compute_mode_follows_nvml() {
    let m = machine(A100, None);
    init_ok();
    let d0 = device(0);
    assert_eq!(
        compute_mode(d0),
        nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT
    );
    assert_eq!(
        nvmlDeviceSetComputeMode(d0, nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
        SUCCESS
    );
    assert_eq!(
        compute_mode(d0),
        nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    );
    assert_eq!(
        compute_mode(device(1)),
        nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT
    );
    assert_eq!(
        state_json(&m.state())["gpus"][0]["computeMode"],
        "exclusive-process"
    );
    assert_eq!(
        nvmlDeviceSetComputeMode(d0, nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_THREAD),
        NOT_SUPPORTED
    );
    assert_eq!(nvmlDeviceSetComputeMode(d0, 4), INVALID_ARGUMENT);
    assert_eq!(
        unsafe { nvmlDeviceGetComputeMode(d0, ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    let mut mig: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d0, 0, &mut mig) },
        SUCCESS
    );
    let mut mode = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeMode(mig, &mut mode) },
        NOT_SUPPORTED
    );
    assert_eq!(nvmlDeviceSetComputeMode(mig, 0), NOT_SUPPORTED);
    nvmlShutdown();
    assert_eq!(nvmlDeviceSetComputeMode(d0, 0), UNINITIALIZED);
}

#[test]
fn a_broken_state_file_is_an_error_naming_it_and_is_not_replaced() {
    let m = machine(A100, None);
    std::fs::write(m.state(), "{ not json").unwrap();
    assert_eq!(nvmlInit_v2(), UNKNOWN);
    let err = last_error().unwrap();
    assert!(err.contains(&m.state().display().to_string()), "{err}");
    assert!(err.contains("corrupt"), "{err}");
    assert_eq!(std::fs::read_to_string(m.state()).unwrap(), "{ not json");

    // Broken while in use: calls fail until the file is good again.
    std::fs::remove_file(m.state()).unwrap();
    init_ok();
    let good = std::fs::read(m.state()).unwrap();
    let mut n = 0;
    std::fs::write(m.state(), "").unwrap();
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, UNKNOWN);
    let mut state: serde_json::Value = serde_json::from_slice(&good).unwrap();
    state["version"] = 2.into();
    write_json(&m.state(), &state);
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, UNKNOWN);
    assert!(last_error().unwrap().contains("version 2"));
    std::fs::write(m.state(), &good).unwrap();
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, SUCCESS);
    assert_eq!(last_error(), None);
    nvmlShutdown();

    // Another machine's state (an L4 node's) does not fit this topology.
    drop(m);
    let l4 = machine(L4X2, None);
    init_ok();
    nvmlShutdown();
    let other = std::fs::read(l4.state()).unwrap();
    drop(l4);
    let m = machine(A100, None);
    std::fs::write(m.state(), &other).unwrap();
    assert_eq!(nvmlInit_v2(), UNKNOWN);
    let err = last_error().unwrap();
    assert!(err.contains("does not fit the topology"), "{err}");
    assert!(err.contains(&m.state().display().to_string()), "{err}");
}

/// `<root>/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access`.
fn cap_file(root: &Path, gpu: u32, gi: u32, ci: Option<u32>) -> PathBuf {
    let dir = root.join(format!(
        "proc/driver/nvidia/capabilities/gpu{gpu}/mig/gi{gi}"
    ));
    match ci {
        Some(ci) => dir.join(format!("ci{ci}/access")),
        None => dir.join("access"),
    }
}

fn cap_minor(path: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(path).ok()?;
    assert!(
        text.ends_with("DeviceFileMode: 292\nDeviceFileModify: 1\n"),
        "{text}"
    );
    text.strip_prefix("DeviceFileMinor: ")?
        .lines()
        .next()?
        .parse()
        .ok()
}

/// GPU instance ids with capability files on GPU `gpu`.
fn cap_gpu_instances(root: &Path, gpu: u32) -> Vec<String> {
    let dir = root.join(format!("proc/driver/nvidia/capabilities/gpu{gpu}/mig"));
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Every GPU of the topology has its `information` file, and a reader
/// finds its minor by UUID, as from the kernel module's files.
#[test]
fn each_gpu_has_its_information_file() {
    let m = machine_with_root(A100);
    let root = m.root();
    assert_eq!(crate::gpu_info::minors(&root), None, "nothing before init");
    init_ok();
    let mut want = std::collections::BTreeMap::new();
    for index in 0..count() {
        let mut minor = 0;
        assert_eq!(
            unsafe { nvmlDeviceGetMinorNumber(device(index), &mut minor) },
            SUCCESS
        );
        want.insert(uuid_of(device(index)), minor);
    }
    assert_eq!(want.len(), 2);
    assert_eq!(crate::gpu_info::minors(&root), Some(want));
    let bus = crate::gpu_info::gpus_dir(&root).join("0000:07:00.0/information");
    assert!(
        std::fs::read_to_string(&bus)
            .unwrap()
            .contains("Device Minor: \t 0\n"),
        "{}",
        bus.display()
    );
}

#[test]
fn capability_files_follow_the_instances() {
    let m = machine_with_root(A100);
    let root = m.root();
    init_ok();
    assert_eq!(
        state_json(&m.state())["driverRoot"],
        root.display().to_string()
    );
    // Seeded: GPU 0's three MIG devices (GI 1, 5, 13, CI 0 each).
    assert_eq!(cap_gpu_instances(&root, 0), ["gi1", "gi13", "gi5"]);
    assert_eq!(cap_minor(&cap_file(&root, 0, 1, None)), Some(3 + 9));
    assert_eq!(cap_minor(&cap_file(&root, 0, 1, Some(0))), Some(3 + 9 + 1));
    assert_eq!(
        cap_minor(&cap_file(&root, 0, 13, Some(0))),
        Some(3 + 13 * 9 + 1)
    );
    assert!(cap_gpu_instances(&root, 1).is_empty(), "GPU 1 has MIG off");
    let config = root.join("proc/driver/nvidia/capabilities/mig/config");
    assert!(
        std::fs::read_to_string(config)
            .unwrap()
            .starts_with("DeviceFileMinor: 1\n")
    );

    // Created and destroyed with the instances.
    let d0 = device(0);
    let gi = create_gi(d0, 19);
    assert_eq!(cap_minor(&cap_file(&root, 0, 14, None)), Some(3 + 14 * 9));
    assert!(!cap_file(&root, 0, 14, Some(0)).exists());
    let ci = create_ci(gi);
    assert_eq!(
        cap_minor(&cap_file(&root, 0, 14, Some(0))),
        Some(3 + 14 * 9 + 1)
    );
    assert_eq!(nvmlComputeInstanceDestroy(ci), SUCCESS);
    assert!(!cap_file(&root, 0, 14, Some(0)).exists());
    assert!(cap_file(&root, 0, 14, None).exists());
    assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
    assert_eq!(cap_gpu_instances(&root, 0), ["gi1", "gi13", "gi5"]);

    // GPU 1 (an A100, MIG off): MIG on only after a GPU reset, so the
    // mode stays pending and no files appear; asking for off again clears it.
    let d1 = device(1);
    let mut status = UNKNOWN;
    assert_eq!(unsafe { nvmlDeviceSetMigMode(d1, 1, &mut status) }, SUCCESS);
    assert_eq!(status, nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED);
    assert_eq!(mig_mode(d1), (0, 1));
    assert!(cap_gpu_instances(&root, 1).is_empty());
    assert_eq!(unsafe { nvmlDeviceSetMigMode(d1, 0, &mut status) }, SUCCESS);
    assert_eq!((status, mig_mode(d1)), (SUCCESS, (0, 0)));

    // A state whose GPU has MIG off keeps no files for it.
    let mut state = state_json(&m.state());
    state["gpus"][0]["mig"]["current"] = "disabled".into();
    write_json(&m.state(), &state);
    assert_eq!(nvmlDeviceSetComputeMode(d0, 2), SUCCESS);
    assert!(cap_gpu_instances(&root, 0).is_empty());
    nvmlShutdown();
}

/// Set in the children of `two_processes_filling_a_machine_lose_no_update`.
const CHILD_ENV: &str = "TESSERA_FAKE_NVML_TEST_CHILD";
const CHILD_TAG: &str = "fill-child:";

#[test]
fn two_processes_filling_a_machine_lose_no_update() {
    let _serial = SERIAL.locked();
    let dir = scratch_dir("fill");
    let topology = dir.join("h100x8.yaml");
    std::fs::write(&topology, H100X8).unwrap();
    let state = dir.join("nvml.state");
    let children: Vec<_> = (0..2)
        .map(|n| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "tests::child_fill_every_gpu",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_ENV, format!("{n}"))
                .env(TOPOLOGY_ENV, &topology)
                .env(STATE_ENV, &state)
                .env("FILL_DIR", &dir)
                .env_remove(EVENTS_ENV)
                .env_remove(DRIVER_ROOT_ENV)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut reported = Vec::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("test result: ok. 1 passed"),
            "child failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mine: Vec<String> = text
            .lines()
            .filter_map(|l| Some(l[l.find(CHILD_TAG)? + CHILD_TAG.len()..].trim().to_owned()))
            .collect();
        assert!(!mine.is_empty(), "each child created some:\n{text}");
        reported.extend(mine);
    }
    // Every creation either child saw succeed is on the machine, and nothing else.
    reported.sort();
    let mut on_machine: Vec<String> = state_json(&state)["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["mig"]["gpuInstances"].as_array().unwrap().clone())
        .flat_map(|gi| gi["computeInstances"].as_array().unwrap().clone())
        .map(|ci| ci["uuid"].as_str().unwrap().to_owned())
        .collect();
    on_machine.sort();
    assert_eq!(reported.len(), 8 * 7, "seven 1g.10gb per H100");
    assert_eq!(on_machine, reported);
    on_machine.dedup();
    assert_eq!(on_machine.len(), 8 * 7, "UUIDs are unique machine-wide");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "run in a child process by two_processes_filling_a_machine_lose_no_update"]
fn child_fill_every_gpu() {
    let Some(me) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(std::env::var_os("FILL_DIR").unwrap());
    init_ok();
    // Start together, so the two really interleave.
    std::fs::write(dir.join(format!("ready-{}", me.to_str().unwrap())), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(dir.join("ready-0").exists() && dir.join("ready-1").exists()) {
        assert!(Instant::now() < deadline, "the other child never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut full = [false; 8];
    while full.contains(&false) {
        for (g, full) in full.iter_mut().enumerate() {
            if *full {
                continue;
            }
            let d = device(g as u32);
            let mut status = UNKNOWN;
            assert_eq!(unsafe { nvmlDeviceSetMigMode(d, 1, &mut status) }, SUCCESS);
            let mut gi: nvmlGpuInstance_t = ptr::null_mut();
            match unsafe { nvmlDeviceCreateGpuInstance(d, 19, &mut gi) } {
                SUCCESS => {}
                INSUFFICIENT_RESOURCES => {
                    *full = true;
                    continue;
                }
                other => panic!("creating a GPU instance: {other}"),
            }
            let ci = create_ci(gi);
            let mut info: nvmlComputeInstanceInfo_t = unsafe { zeroed() };
            assert_eq!(
                unsafe { nvmlComputeInstanceGetInfo_v2(ci, &mut info) },
                SUCCESS
            );
            let mut gi_info: nvmlGpuInstanceInfo_t = unsafe { zeroed() };
            assert_eq!(unsafe { nvmlGpuInstanceGetInfo(gi, &mut gi_info) }, SUCCESS);
            // The MIG device of the new compute instance, by its ids.
            let mut found = None;
            for i in 0..7 {
                let mut mig: nvmlDevice_t = ptr::null_mut();
                if unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d, i, &mut mig) } != SUCCESS {
                    break;
                }
                let (mut gid, mut cid) = (0, 0);
                assert_eq!(
                    unsafe { nvmlDeviceGetGpuInstanceId(mig, &mut gid) },
                    SUCCESS
                );
                assert_eq!(
                    unsafe { nvmlDeviceGetComputeInstanceId(mig, &mut cid) },
                    SUCCESS
                );
                if (gid, cid) == (gi_info.id, info.id) {
                    let mut uuid = [0 as c_char; 96];
                    assert_eq!(
                        unsafe { nvmlDeviceGetUUID(mig, uuid.as_mut_ptr(), 96) },
                        SUCCESS
                    );
                    found = Some(
                        unsafe { CStr::from_ptr(uuid.as_ptr()) }
                            .to_str()
                            .unwrap()
                            .to_owned(),
                    );
                }
            }
            println!(
                "{CHILD_TAG} {}",
                found.expect("the new MIG device is listed")
            );
        }
    }
    nvmlShutdown();
}

// ---------------------------------------------------------------------------
// Device visibility (TESSERA_FAKE_NVML_DEV_ROOT) and read-only state

/// A new "process" on the same machine: the library reloaded with `dev_root`.
fn reload(dev_root: Option<PathBuf>) {
    if let Some(c) = TEST_CONFIG.lock().unwrap().as_mut() {
        c.dev_root = dev_root;
    }
    let mut lib = lock();
    lib.init_count = 0;
    lib.sim = None;
}

/// Makes a character device node; false (with the reason printed, for the
/// caller to skip) where this process may not.
fn mknod(path: &Path, major: u32, minor: u32) -> bool {
    crate::caps::mknod_char(path, major, minor)
        .map_err(|e| println!("skipped: mknod {}: {e}", path.display()))
        .is_ok()
}

fn uuid_of(d: nvmlDevice_t) -> String {
    let mut buf = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(d, buf.as_mut_ptr(), 96) },
        SUCCESS
    );
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_string()
}

fn count() -> u32 {
    let mut n = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut n) }, SUCCESS);
    n
}

fn by_uuid(uuid: &str) -> Result<nvmlDevice_t, Ret> {
    let c = std::ffi::CString::new(uuid).unwrap();
    let mut d: nvmlDevice_t = ptr::null_mut();
    match unsafe { nvmlDeviceGetHandleByUUID(c.as_ptr(), &mut d) } {
        SUCCESS => Ok(d),
        other => Err(other),
    }
}

/// (GPU instance id, compute instance id, UUID) of each MIG device of `d`.
fn mig_devices_of(d: nvmlDevice_t) -> Vec<(u32, u32, String)> {
    let mut found = Vec::new();
    for i in 0..7 {
        let mut mig: nvmlDevice_t = ptr::null_mut();
        if unsafe { nvmlDeviceGetMigDeviceHandleByIndex(d, i, &mut mig) } != SUCCESS {
            break;
        }
        let (mut gi, mut ci) = (0, 0);
        assert_eq!(unsafe { nvmlDeviceGetGpuInstanceId(mig, &mut gi) }, SUCCESS);
        assert_eq!(
            unsafe { nvmlDeviceGetComputeInstanceId(mig, &mut ci) },
            SUCCESS
        );
        found.push((gi, ci, uuid_of(mig)));
    }
    found
}

#[test]
fn a_dev_root_shows_only_the_gpus_whose_nodes_are_there_renumbered() {
    let m = machine(H100X8, None);
    let uuids: Vec<String> = Topology::parse(H100X8)
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.uuid.clone())
        .collect();
    let dev = m.dir.join("dev");
    let made = mknod(&dev.join("nvidia5"), 195, 5)
        && mknod(&dev.join("nvidia3"), 195, 3)
        // Not the GPU's: another major, another minor, a plain file.
        && mknod(&dev.join("nvidia6"), 1, 6)
        && mknod(&dev.join("nvidia7"), 195, 1)
        && mknod(&dev.join("nvidiactl"), 195, 255);
    if !made {
        return;
    }
    std::fs::write(dev.join("nvidia4"), "").unwrap();
    reload(Some(dev));
    init_ok();
    assert_eq!(count(), 2);
    assert_eq!(uuid_of(device(0)), uuids[3]);
    assert_eq!(uuid_of(device(1)), uuids[5]);
    let mut d: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(2, &mut d) },
        INVALID_ARGUMENT
    );
    let (mut index, mut minor) = (9, 9);
    assert_eq!(
        unsafe { nvmlDeviceGetIndex(device(1), &mut index) },
        SUCCESS
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMinorNumber(device(1), &mut minor) },
        SUCCESS
    );
    assert_eq!((index, minor), (1, 5));
    assert_eq!(by_uuid(&uuids[5]), Ok(device(1)));
    for hidden in [0, 4, 6, 7] {
        assert_eq!(by_uuid(&uuids[hidden]), Err(NOT_FOUND), "GPU {hidden}");
    }
    // By bus id: the visible one is found, a hidden one is not.
    let mut pci: nvmlPciInfo_t = unsafe { zeroed() };
    assert_eq!(
        unsafe { nvmlDeviceGetPciInfo_v3(device(0), &mut pci) },
        SUCCESS
    );
    let mut by_bus: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(pci.busId.as_ptr(), &mut by_bus) },
        SUCCESS
    );
    assert_eq!(by_bus, device(0));
    let hidden_bus = c"00000000:18:00.0";
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(hidden_bus.as_ptr(), &mut by_bus) },
        NOT_FOUND
    );
    // A container cannot change the GPU.
    assert_eq!(
        nvmlDeviceSetComputeMode(device(0), nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED),
        NO_PERMISSION
    );
    let mut status = 0;
    assert_eq!(
        unsafe { nvmlDeviceSetMigMode(device(0), 1, &mut status) },
        NO_PERMISSION
    );
    // Without a device root: every GPU again, in topology order.
    reload(None);
    init_ok();
    assert_eq!(count(), 8);
    assert_eq!(uuid_of(device(3)), uuids[3]);
}

#[test]
fn a_mig_device_is_visible_only_with_both_capability_nodes() {
    let m = machine(A100, None);
    init_ok();
    let all = mig_devices_of(device(0));
    assert_eq!(all.len(), 3, "{all:?}");
    let parent_uuid = uuid_of(device(0));
    let minor = 0;
    let node = |gi, ci: Option<u32>| {
        let n = match ci {
            None => caps::gi_minor(minor, gi),
            Some(ci) => caps::ci_minor(minor, gi, ci),
        };
        m.dir
            .join(format!("dev/nvidia-caps/nvidia-cap{}", n.unwrap()))
    };
    let (gi0, ci0, _) = all[0].clone();
    let (gi1, ci1, _) = all[1].clone();
    let made = mknod(&m.dir.join("dev/nvidia0"), 195, 0)
        && mknod(&node(gi1, None), 241, caps::gi_minor(minor, gi1).unwrap())
        && mknod(&node(gi1, Some(ci1)), 241, caps::ci_minor(minor, gi1, ci1).unwrap())
        // Only half of the first one's nodes.
        && mknod(&node(gi0, None), 241, caps::gi_minor(minor, gi0).unwrap());
    if !made {
        return;
    }
    let _ = ci0;
    reload(Some(m.dir.join("dev")));
    init_ok();
    assert_eq!(count(), 1);
    assert_eq!(uuid_of(device(0)), parent_uuid);
    assert_eq!(mig_devices_of(device(0)), vec![all[1].clone()]);
    assert!(by_uuid(&all[1].2).is_ok());
    assert_eq!(by_uuid(&all[0].2), Err(NOT_FOUND));
    assert_eq!(by_uuid(&all[2].2), Err(NOT_FOUND));
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceById(device(0), all[2].0, &mut gi) },
        NOT_FOUND
    );
    // The whole GPU without capability nodes: no MIG devices at all.
    std::fs::remove_dir_all(m.dir.join("dev/nvidia-caps")).unwrap();
    reload(Some(m.dir.join("dev")));
    init_ok();
    assert_eq!(count(), 1);
    assert!(mig_devices_of(device(0)).is_empty());
    let (mut current, mut pending) = (0, 0);
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(device(0), &mut current, &mut pending) },
        SUCCESS
    );
    assert_eq!(current, 1, "MIG mode itself is no secret");
}

/// Bind-mounts `dir` read-only over itself until dropped.
struct ReadOnly(std::ffi::CString);

impl ReadOnly {
    fn mount(dir: &Path) -> Option<ReadOnly> {
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
        // SAFETY: valid NUL-terminated paths; null fstype and data are allowed for binds.
        let ok = unsafe {
            libc::mount(
                c.as_ptr(),
                c.as_ptr(),
                ptr::null(),
                libc::MS_BIND,
                ptr::null(),
            ) == 0
                && libc::mount(ptr::null(), c.as_ptr(), ptr::null(), flags, ptr::null()) == 0
        };
        if !ok {
            println!(
                "skipped: read-only bind mount of {}: {}",
                dir.display(),
                std::io::Error::last_os_error()
            );
            // SAFETY: as above; undoes a bind that did succeed.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            return None;
        }
        Some(ReadOnly(c))
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        // SAFETY: a valid NUL-terminated path.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

#[test]
fn a_read_only_state_file_can_be_read_but_not_changed() {
    let m = machine(A100, None);
    init_ok();
    let migs = mig_devices_of(device(0));
    assert!(m.state().with_extension("state.lock").exists());
    for with_lock_file in [true, false] {
        if !with_lock_file {
            std::fs::remove_file(m.state().with_extension("state.lock")).unwrap();
        }
        let Some(ro) = ReadOnly::mount(&m.dir) else {
            return;
        };
        reload(None);
        init_ok();
        assert_eq!(count(), 2);
        assert_eq!(mig_devices_of(device(0)), migs);
        assert_eq!(
            nvmlDeviceSetComputeMode(device(1), nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED),
            NO_PERMISSION
        );
        assert_eq!(
            compute_mode(device(1)),
            nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT
        );
        // A call that changes nothing needs no write.
        assert_eq!(
            nvmlDeviceSetComputeMode(device(1), nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT),
            SUCCESS
        );
        drop(ro);
    }
    // Writable again: changes work.
    reload(None);
    init_ok();
    assert_eq!(
        nvmlDeviceSetComputeMode(device(1), nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED),
        SUCCESS
    );
}

// ---------------------------------------------------------------------------
// Load: what the processes on the GPUs do

const T4_UUID: &str = "GPU-f53e3398-fd10-4ca7-aa75-e3657fc8c200";
const A100_MIG_3G: &str = "MIG-ee2514c2-b7ff-4379-bd44-c8452290c55f";
const A100_MIG_1G: &str = "MIG-cc04a385-500f-4314-8218-133a4f8051b2";

/// A record of process `pid` (this test process, or a child it started),
/// as the simulated libcuda would write it.
fn record_of(pid: u32, devices: Vec<load::DeviceLoad>) -> load::Record {
    load::Record {
        devices,
        ..load::Record::of_process(&PathBuf::from(format!("/proc/{pid}"))).unwrap()
    }
}

/// This process holding `devices` as its load, until the channel drops.
fn hold(devices: Vec<load::DeviceLoad>) -> load::Channel {
    let channel = load::Channel::open().unwrap();
    channel
        .publish(&record_of(std::process::id(), devices))
        .unwrap();
    channel
}

/// Another process on the machine holding `devices` as its load (a child
/// that inherited its load file).
fn other_process(devices: Vec<load::DeviceLoad>) -> std::process::Child {
    let channel = load::Channel::inheritable().unwrap();
    let child = Command::new("sleep").arg("30").spawn().unwrap();
    channel.publish(&record_of(child.id(), devices)).unwrap();
    child
}

fn device_load(
    uuid: &str,
    memory_bytes: u64,
    busy_for_ms: u64,
    sm_percent: u32,
) -> load::DeviceLoad {
    load::DeviceLoad {
        uuid: uuid.into(),
        memory_bytes,
        busy_until_ms: if busy_for_ms > 0 {
            load::now_ms() + busy_for_ms
        } else {
            0
        },
        sm_percent,
        mps_client: false,
    }
}

fn processes(d: nvmlDevice_t) -> Vec<(u32, u64, u32, u32)> {
    let mut n: c_uint = 0;
    let first = unsafe { nvmlDeviceGetComputeRunningProcesses_v3(d, &mut n, ptr::null_mut()) };
    if n == 0 {
        assert_eq!(first, SUCCESS);
        return Vec::new();
    }
    assert_eq!(first, INSUFFICIENT_SIZE);
    let mut short = n - 1;
    let mut infos: Vec<nvmlProcessInfo_t> = vec![unsafe { zeroed() }; n as usize];
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(d, &mut short, infos.as_mut_ptr()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(short, n);
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(d, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );
    let mut out: Vec<_> = infos
        .iter()
        .map(|i| (i.pid, i.usedGpuMemory, i.gpuInstanceId, i.computeInstanceId))
        .collect();
    out.sort();
    out
}

fn utilization(d: nvmlDevice_t) -> Result<u32, Ret> {
    let mut u: nvmlUtilization_t = unsafe { zeroed() };
    match unsafe { nvmlDeviceGetUtilizationRates(d, &mut u) } {
        SUCCESS => Ok(u.gpu),
        e => Err(e),
    }
}

fn samples(d: nvmlDevice_t, since: u64) -> Result<Vec<(u32, u32)>, Ret> {
    let mut n: c_uint = 0;
    match unsafe { nvmlDeviceGetProcessUtilization(d, ptr::null_mut(), &mut n, since) } {
        INSUFFICIENT_SIZE => {}
        e => return Err(e),
    }
    let mut buf: Vec<nvmlProcessUtilizationSample_t> = vec![unsafe { zeroed() }; n as usize];
    assert_eq!(
        unsafe { nvmlDeviceGetProcessUtilization(d, buf.as_mut_ptr(), &mut n, since) },
        SUCCESS
    );
    Ok(buf.iter().map(|s| (s.pid, s.smUtil)).collect())
}

fn used_v2(d: nvmlDevice_t) -> (u64, u64, u64, u64) {
    let mut m: nvmlMemory_v2_t = unsafe { zeroed() };
    m.version = struct_version::<nvmlMemory_v2_t>(2);
    assert_eq!(unsafe { nvmlDeviceGetMemoryInfo_v2(d, &mut m) }, SUCCESS);
    (m.total, m.reserved, m.used, m.free)
}

fn sensors(d: nvmlDevice_t) -> (Result<u32, Ret>, Result<u32, Ret>) {
    let (mut t, mut p) = (0, 0);
    let t = match unsafe {
        nvmlDeviceGetTemperature(d, nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU, &mut t)
    } {
        SUCCESS => Ok(t),
        e => Err(e),
    };
    let p = match unsafe { nvmlDeviceGetPowerUsage(d, &mut p) } {
        SUCCESS => Ok(p),
        e => Err(e),
    };
    (t, p)
}

#[test]
fn an_idle_gpu_runs_no_process() {
    let _m = machine(T4, None);
    init_ok();
    let d = device(0);
    assert!(processes(d).is_empty());
    assert_eq!(utilization(d), Ok(0));
    assert_eq!(samples(d, 0), Err(NOT_FOUND));
    let (total, reserved, used, free) = used_v2(d);
    assert_eq!((used, free), (0, total - reserved));
    assert_eq!(sensors(d), (Ok(32), Ok(70_000)));
    let mut t = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetTemperature(d, 7, &mut t) },
        INVALID_ARGUMENT
    );
    nvmlShutdown();
}

#[test]
fn another_process_load_shows_in_utilization_memory_and_its_processes() {
    let _m = machine(T4, None);
    init_ok();
    let d = device(0);
    // Another process on the machine, busy with 1 GiB; this one holds
    // 256 MiB and runs no kernel.
    let mut other = other_process(vec![device_load(T4_UUID, 1 << 30, 60_000, 100)]);
    let other_pid = other.id();
    let me = std::process::id();
    let _mine = hold(vec![device_load(T4_UUID, 256 << 20, 0, 100)]);
    let none = 0xFFFF_FFFF;
    let mut want = vec![
        (other_pid, 1 << 30, none, none),
        (me, 256 << 20, none, none),
    ];
    want.sort();
    assert_eq!(processes(d), want);
    assert_eq!(utilization(d), Ok(100));
    assert_eq!(samples(d, 0), Ok(vec![(other_pid, 100)]));
    // Nothing newer than now + 2 minutes.
    let later = (load::now_ms() + 120_000) * 1000;
    assert_eq!(samples(d, later), Err(NOT_FOUND));
    let (total, reserved, used, free) = used_v2(d);
    assert_eq!(used, (1 << 30) + (256 << 20));
    assert_eq!(free, total - reserved - used);
    let mut v1: nvmlMemory_t = unsafe { zeroed() };
    assert_eq!(unsafe { nvmlDeviceGetMemoryInfo(d, &mut v1) }, SUCCESS);
    assert_eq!(v1.used, reserved + used);
    assert_eq!(sensors(d), (Ok(72), Ok(400_000)));

    // The process ends: what it held goes with it.
    other.kill().unwrap();
    other.wait().unwrap();
    assert_eq!(processes(d), vec![(me, 256 << 20, none, none)]);
    assert_eq!(utilization(d), Ok(0));
    assert_eq!(samples(d, 0), Err(NOT_FOUND));
    assert!(mps_processes(d).is_empty());
    nvmlShutdown();
}

fn mps_processes(d: nvmlDevice_t) -> Vec<(u32, u64)> {
    let mut n: c_uint = 0;
    let first = unsafe { nvmlDeviceGetMPSComputeRunningProcesses_v3(d, &mut n, ptr::null_mut()) };
    if n == 0 {
        assert_eq!(first, SUCCESS);
        return Vec::new();
    }
    assert_eq!(first, INSUFFICIENT_SIZE);
    let mut infos: Vec<nvmlProcessInfo_t> = vec![unsafe { zeroed() }; n as usize];
    assert_eq!(
        unsafe { nvmlDeviceGetMPSComputeRunningProcesses_v3(d, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );
    let mut out: Vec<_> = infos.iter().map(|i| (i.pid, i.usedGpuMemory)).collect();
    out.sort();
    out
}

#[test]
fn mps_clients_are_listed_apart_from_processes_with_their_own_context() {
    let _m = machine(T4, None);
    init_ok();
    let d = device(0);
    let client = load::DeviceLoad {
        mps_client: true,
        ..device_load(T4_UUID, 3 << 30, 0, 25)
    };
    let mut a = other_process(vec![client.clone()]);
    let mut b = other_process(vec![client]);
    let mut outside = other_process(vec![device_load(T4_UUID, 5 << 30, 0, 100)]);
    let none = 0xFFFF_FFFF;
    assert_eq!(processes(d), vec![(outside.id(), 5 << 30, none, none)]);
    let mut clients = vec![(a.id(), 3 << 30), (b.id(), 3 << 30)];
    clients.sort();
    assert_eq!(mps_processes(d), clients);
    // Both lists count towards the memory used.
    assert_eq!(used_v2(d).2, 11 << 30);
    for c in [&mut a, &mut b, &mut outside] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    assert!(mps_processes(d).is_empty());
    assert_eq!(used_v2(d).2, 0);
    nvmlShutdown();
}

#[test]
fn mig_devices_list_their_own_processes_and_have_no_utilization() {
    let _m = machine(A100, None);
    init_ok();
    let gpu = device(0);
    let me = std::process::id();
    let _mine = hold(vec![device_load(A100_MIG_3G, 2 << 30, 60_000, 100)]);
    let mut other = other_process(vec![device_load(A100_MIG_1G, 1 << 30, 0, 100)]);
    let migs = mig_devices_of(gpu);
    let ids = |uuid: &str| {
        let (gi, ci, _) = migs.iter().find(|(_, _, u)| u == uuid).unwrap();
        (*gi, *ci)
    };
    let (gi3, ci3) = ids(A100_MIG_3G);
    let (gi1, ci1) = ids(A100_MIG_1G);
    let mut want = vec![(me, 2 << 30, gi3, ci3), (other.id(), 1 << 30, gi1, ci1)];
    want.sort();
    assert_eq!(processes(gpu), want);
    let mig3 = by_uuid(A100_MIG_3G).unwrap();
    assert_eq!(processes(mig3), vec![(me, 2 << 30, gi3, ci3)]);
    assert_eq!(used_v2(mig3).2, 2 << 30);
    assert_eq!(used_v2(gpu).2, 3 << 30);
    // No utilization counters in MIG mode; the GPU's sensors still see it.
    assert_eq!(utilization(mig3), Err(NOT_SUPPORTED));
    assert_eq!(utilization(gpu), Err(NOT_SUPPORTED));
    assert_eq!(samples(gpu, 0), Err(NOT_SUPPORTED));
    assert_eq!(sensors(mig3), (Err(NOT_SUPPORTED), Err(NOT_SUPPORTED)));
    assert_eq!(sensors(gpu), (Ok(72), Ok(400_000)));
    other.kill().unwrap();
    other.wait().unwrap();
    nvmlShutdown();
}
