//! The C ABI exercised in-process, the way a C caller would use it.
//!
//! The fake NVML inside reads its topology once per process, so every test
//! here runs on one simulated machine ([`TOPOLOGY`]: two whole H100s, one
//! H100 in MIG mode with two 3g.40gb devices, one lost H100), set up by the
//! first test through the fake NVML's environment variables. Tests take a
//! lock, substitute their own CUDA environment ([`env_override`]) and start
//! from an uninitialized library, as a new process would.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_uint};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use super::*;
use tessera_test_kit::artifacts::fake_mps_control;
use tessera_test_kit::wait::until as wait_until;

const MODELS: &str = include_str!("../../fake-nvml/topologies/h100x8.yaml");

const GPU0: &str = "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f";
const MIG_GPU: &str = "GPU-afcb4ada-dc9c-47a9-a925-5f30b2522d36";
/// The 3g.40gb at memory slice 4: GPU instance 1, NVML's first.
const MIG_A: &str = "MIG-93d4d5a1-bb19-478d-8cbe-e396daf53f43";
/// The 3g.40gb at memory slice 0: GPU instance 2.
const MIG_B: &str = "MIG-b03f316f-4f7b-4587-84ae-73d312a3b203";
const GPU2: &str = "GPU-56f203d4-e9c0-4708-918f-09c606609017";
const LOST: &str = "GPU-3da2dd85-937c-4b64-b132-90c221b248d8";

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const H100_BYTES: u64 = 81559 * MIB;

/// The models of the shipped H100 topology with this file's cards.
fn topology_text() -> String {
    let models = &MODELS[..MODELS.find("\ngpus:").expect("h100x8.yaml has gpus")];
    format!(
        "{models}\ngpus:\n\
         - {{ model: *h100, uuid: {GPU0}, pciBusId: \"00000000:1B:00.0\" }}\n\
         - model: *h100\n  uuid: {MIG_GPU}\n  pciBusId: \"00000000:43:00.0\"\n  mig:\n    mode: enabled\n    instances:\n\
         \x20     - {{ profile: 3g.40gb, start: 0, uuid: {MIG_B} }}\n\
         \x20     - {{ profile: 3g.40gb, start: 4, uuid: {MIG_A} }}\n\
         - {{ model: *h100, uuid: {LOST}, pciBusId: \"00000000:52:00.0\", lost: true }}\n\
         - {{ model: *h100, uuid: {GPU2}, pciBusId: \"00000000:61:00.0\" }}\n"
    )
}

static SERIAL: Mutex<()> = Mutex::new(());
static ENV: Mutex<Option<BTreeMap<String, String>>> = Mutex::new(None);

/// The CUDA environment a test gives the library, if any.
pub(crate) fn env_override() -> Option<BTreeMap<String, String>> {
    ENV.locked().clone()
}

/// This test process's scratch directory.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tessera-fake-cuda-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

/// The simulated machine, set up once (under [`SERIAL`]).
fn machine() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let topology = scratch().join("topology.yaml");
        std::fs::write(&topology, topology_text()).unwrap();
        // SAFETY: set once, under SERIAL, before any test reads the
        // environment; no C code reads it concurrently.
        unsafe {
            std::env::set_var(tessera_fake_nvml::TOPOLOGY_ENV, &topology);
            std::env::set_var(
                tessera_fake_nvml::STATE_ENV,
                scratch().join("machine.state"),
            );
            std::env::remove_var(tessera_fake_nvml::DEV_ROOT_ENV);
            std::env::set_var(tessera_fake_nvml::load::LOAD_ENV, "1");
        }
    });
}

/// One test: the library uninitialized, as in a new process whose CUDA
/// environment is `env`.
struct Process {
    _serial: MutexGuard<'static, ()>,
}

impl Drop for Process {
    fn drop(&mut self) {
        reset(&[]);
    }
}

fn reset(env: &[(&str, &str)]) {
    *ENV.locked() = Some(
        env.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    lock().init = None;
    CURRENT.with(|c| c.set(0));
}

/// A fresh process with `env`; no MPS daemon unless the test gives a pipe
/// directory.
fn process(env: &[(&str, &str)]) -> Process {
    let serial = SERIAL.locked();
    machine();
    let pipe = scratch().join("no-daemon");
    let mut env = env.to_vec();
    if !env.iter().any(|(k, _)| *k == mps::PIPE_DIRECTORY_ENV) {
        env.push((mps::PIPE_DIRECTORY_ENV, pipe.to_str().unwrap()));
    }
    reset(&env);
    Process { _serial: serial }
}

fn count() -> c_int {
    let mut n = -1;
    assert_eq!(unsafe { cuDeviceGetCount(&mut n) }, SUCCESS);
    n
}

fn uuid(dev: CUdevice, own: bool) -> [u8; 16] {
    let mut u = CUuuid { bytes: [0; 16] };
    let r = if own {
        unsafe { cuDeviceGetUuid_v2(&mut u, dev) }
    } else {
        unsafe { cuDeviceGetUuid(&mut u, dev) }
    };
    assert_eq!(r, SUCCESS);
    u.bytes.map(|b| b as u8)
}

fn uuids() -> Vec<[u8; 16]> {
    (0..count()).map(|d| uuid(d, true)).collect()
}

fn name(dev: CUdevice) -> String {
    let mut buf = [0 as c_char; 96];
    assert_eq!(
        unsafe { cuDeviceGetName(buf.as_mut_ptr(), 96, dev) },
        SUCCESS
    );
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned()
}

fn sms(dev: CUdevice) -> c_int {
    let mut v = 0;
    assert_eq!(
        unsafe { cuDeviceGetAttribute(&mut v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) },
        SUCCESS
    );
    v
}

fn create_context(dev: CUdevice) -> CUcontext {
    let mut ctx: CUcontext = ptr::null_mut();
    assert_eq!(unsafe { cuCtxCreate_v2(&mut ctx, 0, dev) }, SUCCESS);
    assert!(!ctx.is_null());
    ctx
}

fn mem_info() -> (u64, u64) {
    let (mut free, mut total) = (0usize, 0usize);
    assert_eq!(unsafe { cuMemGetInfo_v2(&mut free, &mut total) }, SUCCESS);
    (free as u64, total as u64)
}

fn alloc(bytes: u64) -> Result<CUdeviceptr, CUresult> {
    let mut p: CUdeviceptr = 0;
    match unsafe { cuMemAlloc_v2(&mut p, bytes as usize) } {
        SUCCESS => Ok(p),
        e => Err(e),
    }
}

fn error_name(code: CUresult) -> String {
    let mut s: *const c_char = ptr::null();
    assert_eq!(unsafe { cuGetErrorName(code, &mut s) }, SUCCESS);
    unsafe { CStr::from_ptr(s) }.to_str().unwrap().to_owned()
}

// ---------------------------------------------------------------------------

#[test]
fn uuid_bytes_are_the_hex_digits_or_a_stable_hash() {
    assert_eq!(
        uuid_bytes(GPU0),
        [
            0x3d, 0x2a, 0x07, 0xe5, 0x04, 0xb3, 0x43, 0x12, 0x87, 0xc3, 0xc2, 0x3b, 0xe8, 0xaa,
            0xee, 0x0f
        ]
    );
    assert_eq!(uuid_bytes(MIG_A)[..4], [0x93, 0xd4, 0xd5, 0xa1]);
    assert_eq!(uuid_bytes("GPU-odd"), uuid_bytes("GPU-odd"));
    assert_ne!(uuid_bytes("GPU-odd"), uuid_bytes("GPU-odd2"));
    assert_ne!(uuid_bytes("GPU-odd"), [0; 16]);
}

#[test]
fn nothing_but_versions_and_error_names_before_cu_init() {
    let _p = process(&[]);
    let mut n = 0;
    assert_eq!(unsafe { cuDeviceGetCount(&mut n) }, NOT_INITIALIZED);
    let mut d = 0;
    assert_eq!(unsafe { cuDeviceGet(&mut d, 0) }, NOT_INITIALIZED);
    let mut ctx: CUcontext = ptr::null_mut();
    assert_eq!(
        unsafe { cuDevicePrimaryCtxRetain(&mut ctx, 0) },
        NOT_INITIALIZED
    );
    assert_eq!(cuMemFree_v2(0x7f00_0000_0000), NOT_INITIALIZED);
    let mut v = 0;
    assert_eq!(unsafe { cuDriverGetVersion(&mut v) }, SUCCESS);
    assert_eq!(v, 12080);
    assert_eq!(
        unsafe { cuDriverGetVersion(ptr::null_mut()) },
        INVALID_VALUE
    );
    assert_eq!(error_name(NO_DEVICE), "CUDA_ERROR_NO_DEVICE");
    assert_eq!(
        error_name(DEVICE_UNAVAILABLE),
        "CUDA_ERROR_DEVICE_UNAVAILABLE"
    );
    let mut s: *const c_char = c"x".as_ptr();
    assert_eq!(unsafe { cuGetErrorName(4242, &mut s) }, INVALID_VALUE);
    assert!(s.is_null());
    assert_eq!(unsafe { cuGetErrorName(0, ptr::null_mut()) }, INVALID_VALUE);
    assert_eq!(unsafe { cuGetErrorString(OUT_OF_MEMORY, &mut s) }, SUCCESS);
    assert_eq!(unsafe { CStr::from_ptr(s) }, c"out of memory");
    assert_eq!(cuInit(1), INVALID_VALUE);
    assert_eq!(cuInit(0), SUCCESS);
    assert_eq!(cuInit(0), SUCCESS);
}

#[test]
fn devices_are_whole_gpus_and_mig_devices_in_pci_order_without_lost_ones() {
    let _p = process(&[]);
    assert_eq!(cuInit(0), SUCCESS);
    assert_eq!(
        uuids(),
        [GPU0, MIG_A, MIG_B, GPU2].map(uuid_bytes).to_vec(),
        "a GPU in MIG mode stands for its MIG devices, the lost GPU is gone"
    );
    assert_eq!(name(0), "NVIDIA H100 80GB HBM3");
    assert_eq!(name(1), "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
    assert_eq!((sms(0), sms(1), sms(3)), (132, 60, 132));
    // cuDeviceGetUuid is the physical GPU's, _v2 the device's own.
    assert_eq!(uuid(1, false), uuid_bytes(MIG_GPU));
    assert_eq!(uuid(0, false), uuid_bytes(GPU0));
    let mut total = 0usize;
    assert_eq!(unsafe { cuDeviceTotalMem_v2(&mut total, 0) }, SUCCESS);
    assert_eq!(total as u64, H100_BYTES);
    assert_eq!(unsafe { cuDeviceTotalMem_v2(&mut total, 2) }, SUCCESS);
    assert_eq!(total as u64, 40448 * MIB);
    let attr = |a, d| {
        let mut v = -1;
        (unsafe { cuDeviceGetAttribute(&mut v, a, d) }, v)
    };
    assert_eq!(
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0),
        (SUCCESS, 9)
    );
    assert_eq!(
        attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
        (SUCCESS, 0)
    );
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 3), (SUCCESS, 0x61));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 1), (SUCCESS, 0x43));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, 0), (SUCCESS, 0));
    assert_eq!(attr(9999, 0).0, INVALID_VALUE);
    assert_eq!(
        attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 4).0,
        INVALID_DEVICE
    );
    assert_eq!(
        attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, -1).0,
        INVALID_DEVICE
    );
}

#[test]
fn bad_arguments_are_refused() {
    let _p = process(&[]);
    assert_eq!(cuInit(0), SUCCESS);
    assert_eq!(unsafe { cuDeviceGetCount(ptr::null_mut()) }, INVALID_VALUE);
    let mut d = -1;
    assert_eq!(unsafe { cuDeviceGet(&mut d, 4) }, INVALID_DEVICE);
    assert_eq!(unsafe { cuDeviceGet(&mut d, -1) }, INVALID_DEVICE);
    assert_eq!(unsafe { cuDeviceGet(ptr::null_mut(), 0) }, INVALID_VALUE);
    assert_eq!(unsafe { cuDeviceGet(&mut d, 3) }, SUCCESS);
    assert_eq!(d, 3);
    let mut buf = [0 as c_char; 8];
    assert_eq!(
        unsafe { cuDeviceGetName(buf.as_mut_ptr(), 0, 0) },
        INVALID_VALUE
    );
    assert_eq!(
        unsafe { cuDeviceGetName(ptr::null_mut(), 8, 0) },
        INVALID_VALUE
    );
    assert_eq!(unsafe { cuDeviceGetName(buf.as_mut_ptr(), 8, 0) }, SUCCESS);
    assert_eq!(
        unsafe { CStr::from_ptr(buf.as_ptr()) },
        c"NVIDIA ",
        "truncated"
    );
    assert_eq!(
        unsafe { cuDeviceGetUuid_v2(ptr::null_mut(), 0) },
        INVALID_VALUE
    );
    assert_eq!(
        unsafe { cuDeviceTotalMem_v2(ptr::null_mut(), 0) },
        INVALID_VALUE
    );
    let mut v = 0;
    assert_eq!(
        unsafe { cuDeviceGetAttribute(ptr::null_mut(), 16, 0) },
        INVALID_VALUE
    );
    assert_eq!(
        unsafe { cuDeviceGetAttribute(&mut v, 16, 9) },
        INVALID_DEVICE
    );
    let mut ctx: CUcontext = ptr::null_mut();
    assert_eq!(unsafe { cuCtxCreate_v2(&mut ctx, 0x100, 0) }, INVALID_VALUE);
    assert_eq!(unsafe { cuCtxCreate_v2(&mut ctx, 3, 0) }, INVALID_VALUE);
    assert_eq!(
        unsafe { cuCtxCreate_v2(ptr::null_mut(), 0, 0) },
        INVALID_VALUE
    );
    assert_eq!(unsafe { cuCtxCreate_v2(&mut ctx, 0, 7) }, INVALID_DEVICE);
    assert_eq!(cuCtxDestroy_v2(ptr::null_mut()), INVALID_VALUE);
    let forged: CUcontext = ptr::without_provenance_mut(0x1234);
    assert_eq!(cuCtxDestroy_v2(forged), INVALID_CONTEXT);
    assert_eq!(cuCtxSetCurrent(forged), INVALID_CONTEXT);
    assert_eq!(
        cuDevicePrimaryCtxRelease_v2(0),
        INVALID_CONTEXT,
        "never retained"
    );
    assert_eq!(cuDevicePrimaryCtxRelease_v2(9), INVALID_DEVICE);
}

#[test]
fn cuda_visible_devices_filters_and_orders() {
    {
        let _p = process(&[(VISIBLE_DEVICES_ENV, "3,GPU-3d2a")]);
        assert_eq!(cuInit(0), SUCCESS);
        assert_eq!(uuids(), [GPU2, GPU0].map(uuid_bytes).to_vec());
    }
    {
        let _p = process(&[(VISIBLE_DEVICES_ENV, &format!("{MIG_B},9,0"))]);
        assert_eq!(cuInit(0), SUCCESS);
        assert_eq!(uuids(), vec![uuid_bytes(MIG_B)], "9 ends the list");
    }
    {
        // The GPU in MIG mode and the lost one are no devices of their own.
        let _p = process(&[(VISIBLE_DEVICES_ENV, &format!("{MIG_GPU},0"))]);
        assert_eq!(cuInit(0), NO_DEVICE);
    }
    {
        let _p = process(&[(VISIBLE_DEVICES_ENV, LOST)]);
        assert_eq!(cuInit(0), NO_DEVICE);
    }
    let _p = process(&[(VISIBLE_DEVICES_ENV, "")]);
    assert_eq!(cuInit(0), NO_DEVICE);
    let mut n = 0;
    assert_eq!(unsafe { cuDeviceGetCount(&mut n) }, NOT_INITIALIZED);
    assert_eq!(cuInit(0), NO_DEVICE, "the outcome is kept");
}

#[test]
fn memory_is_counted_per_context_and_device() {
    let _p = process(&[]);
    assert_eq!(cuInit(0), SUCCESS);
    let (mut free, mut total) = (0usize, 0usize);
    assert_eq!(
        unsafe { cuMemGetInfo_v2(&mut free, &mut total) },
        INVALID_CONTEXT
    );
    assert_eq!(alloc(MIB), Err(INVALID_CONTEXT));
    let ctx = create_context(0);
    let mut current: CUcontext = ptr::null_mut();
    assert_eq!(unsafe { cuCtxGetCurrent(&mut current) }, SUCCESS);
    assert_eq!(current, ctx);
    assert_eq!(mem_info(), (H100_BYTES, H100_BYTES));
    assert_eq!(
        unsafe { cuMemGetInfo_v2(ptr::null_mut(), &mut total) },
        INVALID_VALUE
    );
    assert_eq!(alloc(0), Err(INVALID_VALUE));
    assert_eq!(unsafe { cuMemAlloc_v2(ptr::null_mut(), 1) }, INVALID_VALUE);
    let small = alloc(1).unwrap();
    assert_eq!(mem_info().0, H100_BYTES - 2 * MIB, "2 MiB granules");
    let big = alloc(60 * GIB).unwrap();
    assert_ne!(small, big);
    assert_eq!(alloc(20 * GIB), Err(OUT_OF_MEMORY));
    assert_eq!(mem_info().0, H100_BYTES - 2 * MIB - 60 * GIB);
    assert_eq!(cuMemFree_v2(big), SUCCESS);
    assert_eq!(cuMemFree_v2(big), INVALID_VALUE, "freed twice");
    assert_eq!(cuMemFree_v2(0), INVALID_VALUE);
    assert_eq!(mem_info().0, H100_BYTES - 2 * MIB);
    // Another device's context has its own memory; the MIG device has its
    // GPU instance's.
    let other = create_context(2);
    assert_eq!(mem_info(), (40448 * MIB, 40448 * MIB));
    let mut dev = -1;
    assert_eq!(unsafe { cuCtxGetDevice(&mut dev) }, SUCCESS);
    assert_eq!(dev, 2);
    assert_eq!(cuCtxDestroy_v2(other), SUCCESS);
    assert_eq!(cuCtxDestroy_v2(other), INVALID_CONTEXT);
    assert_eq!(
        unsafe { cuMemGetInfo_v2(&mut free, &mut total) },
        INVALID_CONTEXT
    );
    // Destroying a context frees what it allocated.
    assert_eq!(cuCtxSetCurrent(ctx), SUCCESS);
    alloc(10 * GIB).unwrap();
    assert_eq!(cuCtxDestroy_v2(ctx), SUCCESS);
    let again = create_context(0);
    assert_eq!(mem_info().0, H100_BYTES);
    assert_eq!(cuCtxDestroy_v2(again), SUCCESS);
    assert_eq!(cuCtxSetCurrent(ptr::null_mut()), SUCCESS);
}

#[test]
fn the_primary_context_is_reference_counted() {
    let _p = process(&[]);
    assert_eq!(cuInit(0), SUCCESS);
    let (mut a, mut b): (CUcontext, CUcontext) = (ptr::null_mut(), ptr::null_mut());
    assert_eq!(unsafe { cuDevicePrimaryCtxRetain(&mut a, 3) }, SUCCESS);
    assert_eq!(unsafe { cuDevicePrimaryCtxRetain(&mut b, 3) }, SUCCESS);
    assert_eq!(a, b);
    assert_eq!(
        cuCtxDestroy_v2(a),
        INVALID_CONTEXT,
        "not cuCtxDestroy's to end"
    );
    assert_eq!(alloc(GIB), Err(INVALID_CONTEXT), "retained but not current");
    assert_eq!(cuCtxSetCurrent(a), SUCCESS);
    alloc(GIB).unwrap();
    assert_eq!(mem_info().0, H100_BYTES - GIB);
    assert_eq!(cuDevicePrimaryCtxRelease_v2(3), SUCCESS);
    assert_eq!(mem_info().0, H100_BYTES - GIB, "still retained once");
    assert_eq!(cuDevicePrimaryCtxRelease_v2(3), SUCCESS);
    assert_eq!(
        alloc(GIB),
        Err(INVALID_CONTEXT),
        "released: the handle is dead"
    );
    assert_eq!(cuDevicePrimaryCtxRelease_v2(3), INVALID_CONTEXT);
    assert_eq!(unsafe { cuDevicePrimaryCtxRetain(&mut a, 3) }, SUCCESS);
    assert_eq!(cuCtxSetCurrent(a), SUCCESS);
    assert_eq!(mem_info().0, H100_BYTES, "its memory went with it");
    assert_eq!(cuDevicePrimaryCtxRelease_v2(3), SUCCESS);
}

#[test]
fn a_handle_of_an_earlier_process_is_not_a_context() {
    let stale = {
        let _p = process(&[]);
        assert_eq!(cuInit(0), SUCCESS);
        create_context(0)
    };
    let _p = process(&[]);
    assert_eq!(cuInit(0), SUCCESS);
    let fresh = create_context(0);
    assert_eq!(cuCtxSetCurrent(stale), INVALID_CONTEXT);
    assert_eq!(cuCtxDestroy_v2(stale), INVALID_CONTEXT);
    assert_eq!(cuCtxDestroy_v2(fresh), SUCCESS);
}

#[test]
fn a_prohibited_gpu_refuses_contexts() {
    let _p = process(&[]);
    let set_mode = |mode| {
        assert_eq!(tessera_fake_nvml::nvmlInit_v2(), 0);
        let mut gpu = ptr::null_mut();
        // NVML index 3 is the last H100 (the lost one still has an index).
        assert_eq!(
            unsafe { tessera_fake_nvml::nvmlDeviceGetHandleByIndex_v2(3, &mut gpu) },
            0
        );
        assert_eq!(tessera_fake_nvml::nvmlDeviceSetComputeMode(gpu, mode), 0);
        assert_eq!(tessera_fake_nvml::nvmlShutdown(), 0);
    };
    set_mode(COMPUTE_MODE_PROHIBITED);
    let outcome = std::panic::catch_unwind(|| {
        assert_eq!(cuInit(0), SUCCESS);
        let mut ctx: CUcontext = ptr::null_mut();
        assert_eq!(
            unsafe { cuCtxCreate_v2(&mut ctx, 0, 3) },
            DEVICE_UNAVAILABLE
        );
        assert_eq!(
            unsafe { cuDevicePrimaryCtxRetain(&mut ctx, 3) },
            DEVICE_UNAVAILABLE
        );
        let mut v = 0;
        assert_eq!(
            unsafe { cuDeviceGetAttribute(&mut v, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, 3) },
            SUCCESS
        );
        assert_eq!(v, 2);
        let ok = create_context(0);
        assert_eq!(cuCtxDestroy_v2(ok), SUCCESS);
    });
    set_mode(0);
    outcome.unwrap();
}

#[test]
fn a_stale_socket_is_no_daemon() {
    let pipe = scratch().join("stale-pipe");
    std::fs::create_dir_all(&pipe).unwrap();
    let _ = std::fs::remove_file(pipe.join("control"));
    drop(std::os::unix::net::UnixListener::bind(pipe.join("control")).unwrap());
    let _p = process(&[
        (mps::PIPE_DIRECTORY_ENV, pipe.to_str().unwrap()),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
    ]);
    assert_eq!(cuInit(0), SUCCESS);
    assert_eq!(count(), 4);
    assert_eq!(sms(0), 132, "outside MPS the client variables do nothing");
}

// ---------------------------------------------------------------------------
// Against fake-mps-control

/// A control daemon in the foreground; killed if the test ends early.
struct Daemon {
    child: Child,
    pipe: PathBuf,
}

impl Daemon {
    fn start(name: &str, env: &[(&str, &str)]) -> Daemon {
        let dir = scratch().join(name);
        let _ = std::fs::remove_dir_all(&dir);
        let pipe = dir.join("pipe");
        let mut cmd = Command::new(fake_mps_control());
        cmd.arg("-f")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", dir.join("log"))
            .envs(env.iter().copied())
            .stdin(Stdio::null());
        let child = cmd.spawn().expect("starting fake-mps-control -f");
        let daemon = Daemon { child, pipe };
        wait_until("the daemon's control socket is there", || {
            daemon.pipe.join("control").exists()
        });
        daemon
    }

    fn pipe(&self) -> &str {
        self.pipe.to_str().unwrap()
    }

    /// `echo <command> | nvidia-cuda-mps-control`.
    fn control(&self, command: &str) -> String {
        let mut child = Command::new(fake_mps_control())
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        writeln!(child.stdin.take().unwrap(), "{command}").unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{command} failed");
        String::from_utf8(out.stdout).unwrap()
    }

    fn quit(mut self) {
        self.control("quit");
        let child = &mut self.child;
        wait_until("the daemon exits after quit", || {
            child.try_wait().unwrap().is_some()
        });
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client process of `daemon` with `env` besides the pipe directory: its
/// devices' UUIDs, SMs and free memory under a context.
fn client_view(pipe: &str, env: &[(&str, &str)]) -> Result<Vec<(String, c_int, u64)>, CUresult> {
    let mut all = vec![(mps::PIPE_DIRECTORY_ENV, pipe)];
    all.extend_from_slice(env);
    let _p = process(&all);
    match cuInit(0) {
        SUCCESS => {}
        e => return Err(e),
    }
    let by_bytes = |b: [u8; 16]| {
        [GPU0, MIG_A, MIG_B, GPU2]
            .into_iter()
            .find(|u| uuid_bytes(u) == b)
            .unwrap_or("?")
            .to_owned()
    };
    Ok((0..count())
        .map(|d| {
            let ctx = create_context(d);
            let free = mem_info().0;
            assert_eq!(cuCtxDestroy_v2(ctx), SUCCESS);
            (by_bytes(uuid(d, true)), sms(d), free)
        })
        .collect())
}

/// With daemon-level limits, a client that asks for more in its own
/// environment gets the daemon's; one that asks for less gets less; after
/// `quit` a new process runs outside MPS with the whole GPU.
#[test]
fn daemon_limits_bind_clients_and_end_with_the_daemon() {
    let daemon = Daemon::start(
        "limits",
        &[
            ("CUDA_VISIBLE_DEVICES", GPU0),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8G"),
        ],
    );
    assert_eq!(
        daemon.control("get_default_active_thread_percentage"),
        "25.0\n"
    );
    assert_eq!(
        daemon.control("get_default_device_pinned_mem_limit 0"),
        "8192M\n"
    );
    let pipe = daemon.pipe();

    // Only the daemon's device, at its limits.
    assert_eq!(client_view(pipe, &[]), Ok(vec![(GPU0.into(), 32, 8 * GIB)]));
    // Asking for more changes nothing.
    assert_eq!(
        client_view(
            pipe,
            &[
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=64G"),
            ]
        ),
        Ok(vec![(GPU0.into(), 32, 8 * GIB)])
    );
    // Asking for less gets less.
    assert_eq!(
        client_view(
            pipe,
            &[
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2G"),
            ]
        ),
        Ok(vec![(GPU0.into(), 12, 2 * GIB)])
    );
    // Over the limit fails, under it succeeds.
    {
        let _p = process(&[(mps::PIPE_DIRECTORY_ENV, pipe)]);
        assert_eq!(cuInit(0), SUCCESS);
        create_context(0);
        assert_eq!(alloc(9 * GIB), Err(OUT_OF_MEMORY));
        let p = alloc(7 * GIB).unwrap();
        assert_eq!(alloc(2 * GIB), Err(OUT_OF_MEMORY), "7G + 2G is over 8G");
        assert_eq!(cuMemFree_v2(p), SUCCESS);
        alloc(8 * GIB).unwrap();
    }
    // A device the daemon does not serve is no device for its clients.
    assert_eq!(
        client_view(pipe, &[(VISIBLE_DEVICES_ENV, GPU2)]),
        Err(NO_DEVICE)
    );
    // Defaults changed at run time reach only the next server (NVIDIA's
    // command list): the daemon says them, the running server's clients
    // keep what it started with.
    assert_eq!(
        daemon.control("set_default_active_thread_percentage 50"),
        "50.0\n"
    );
    assert_eq!(
        daemon.control("set_default_device_pinned_mem_limit 0 16G"),
        ""
    );
    assert_eq!(
        daemon.control("get_default_active_thread_percentage"),
        "50.0\n"
    );
    assert_eq!(client_view(pipe, &[]), Ok(vec![(GPU0.into(), 32, 8 * GIB)]));

    let pipe = pipe.to_owned();
    daemon.quit();
    assert_eq!(
        client_view(&pipe, &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")]),
        Ok(vec![
            (GPU0.into(), 132, H100_BYTES),
            (MIG_A.into(), 60, 40448 * MIB),
            (MIG_B.into(), 60, 40448 * MIB),
            (GPU2.into(), 132, H100_BYTES),
        ])
    );
}

/// A daemon serving several devices: ordinals in its limits count its
/// devices, ordinals in a client's count the client's.
#[test]
fn pinned_limit_ordinals_follow_each_sides_enumeration() {
    let daemon = Daemon::start(
        "ordinals",
        &[
            ("CUDA_VISIBLE_DEVICES", &format!("{GPU2},{MIG_B}")),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "1=4G"),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30"),
        ],
    );
    let pipe = daemon.pipe();
    assert_eq!(
        client_view(pipe, &[]),
        Ok(vec![
            (GPU2.into(), 38, H100_BYTES),
            (MIG_B.into(), 18, 4 * GIB)
        ])
    );
    // The client picks the daemon's second device: it is the client's 0.
    assert_eq!(
        client_view(
            pipe,
            &[
                (VISIBLE_DEVICES_ENV, "1"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,1=512M"),
            ]
        ),
        Ok(vec![(MIG_B.into(), 18, GIB)])
    );
    daemon.quit();
}

// ---------------------------------------------------------------------------
// Load: memory and kernels, recorded for the fake NVML

/// A kernel that spins for `cycles` clock cycles (what `tessera probe
/// --busy` launches on a real GPU).
const SPIN_PTX: &[u8] = b".version 7.0\n.target sm_50\n.address_size 64\n\
    .visible .entry spin(.param .u64 cycles)\n{\n  ret;\n}\n\0";

fn own_record() -> Option<tessera_fake_nvml::load::Record> {
    let me = std::process::id();
    tessera_fake_nvml::load::live()
        .into_iter()
        .find(|l| l.pid == me)
        .map(|l| l.record)
}

/// Loads [`SPIN_PTX`] into the current context; its `spin` kernel.
fn spin_kernel() -> kernels::CUfunction {
    let mut module: kernels::CUmodule = ptr::null_mut();
    assert_eq!(
        unsafe { kernels::cuModuleLoadData(&mut module, SPIN_PTX.as_ptr().cast()) },
        SUCCESS
    );
    let mut f: kernels::CUfunction = ptr::null_mut();
    assert_eq!(
        unsafe { kernels::cuModuleGetFunction(&mut f, module, c"spin".as_ptr()) },
        SUCCESS
    );
    let mut missing: kernels::CUfunction = ptr::null_mut();
    assert_eq!(
        unsafe { kernels::cuModuleGetFunction(&mut missing, module, c"nope".as_ptr()) },
        NOT_FOUND
    );
    f
}

fn launch(f: kernels::CUfunction, block: c_uint, stream: kernels::CUstream) -> CUresult {
    kernels::cuLaunchKernel(
        f,
        1,
        1,
        1,
        block,
        1,
        1,
        0,
        stream,
        ptr::null_mut(),
        ptr::null_mut(),
    )
}

#[test]
fn memory_and_kernels_are_recorded_as_the_process_load() {
    let _p = process(&[(tessera_fake_nvml::load::LOAD_ENV, "1")]);
    assert_eq!(cuInit(0), SUCCESS);
    let mut module: kernels::CUmodule = ptr::null_mut();
    // No context yet.
    assert_eq!(
        unsafe { kernels::cuModuleLoadData(&mut module, SPIN_PTX.as_ptr().cast()) },
        INVALID_CONTEXT
    );
    let ctx = create_context(0);
    let p = alloc(GIB).unwrap();
    let record = own_record().expect("a record once memory is held");
    assert_eq!(record.devices[0].uuid, GPU0);
    assert_eq!(record.devices[0].memory_bytes, GIB);
    assert_eq!(record.devices[0].busy_until_ms, 0);
    assert_eq!(record.devices[0].sm_percent, 100);

    assert_eq!(
        unsafe { kernels::cuModuleLoadData(&mut module, c"\x7fELF".as_ptr().cast()) },
        INVALID_IMAGE
    );
    let f = spin_kernel();
    assert_eq!(launch(f, 2048, ptr::null_mut()), INVALID_VALUE);
    assert_eq!(launch(f, 0, ptr::null_mut()), INVALID_VALUE);
    assert_eq!(
        launch(f, 128, ptr::without_provenance_mut(0x1234)),
        INVALID_HANDLE
    );
    assert_eq!(
        launch(ptr::without_provenance_mut(0x1234), 128, ptr::null_mut()),
        INVALID_HANDLE
    );
    let before = tessera_fake_nvml::load::now_ms();
    let started = Instant::now();
    assert_eq!(launch(f, 128, ptr::null_mut()), SUCCESS);
    assert_eq!(launch(f, 128, ptr::null_mut()), SUCCESS);
    assert_eq!(kernels::cuCtxSynchronize(), SUCCESS);
    assert!(started.elapsed() >= 2 * kernels::KERNEL_TIME);
    let busy = own_record().unwrap().devices[0].busy_until_ms;
    assert!(
        busy > before,
        "launches keep the device busy: {busy} <= {before}"
    );

    assert_eq!(cuMemFree_v2(p), SUCCESS);
    assert_eq!(own_record().unwrap().devices[0].memory_bytes, 0);
    // Its module goes with the context.
    assert_eq!(cuCtxDestroy_v2(ctx), SUCCESS);
    let second = create_context(0);
    assert_eq!(launch(f, 128, ptr::null_mut()), INVALID_HANDLE);
    assert_eq!(cuCtxDestroy_v2(second), SUCCESS);
}

/// The CUDA side of [`another_process_load_is_seen_through_nvml`]: run by
/// it as a child process of its own (skipped otherwise).
#[test]
#[ignore = "a child process of another_process_load_is_seen_through_nvml"]
fn child_holds_memory_and_runs_kernels() {
    let Ok(load) = std::env::var(tessera_fake_nvml::load::LOAD_ENV) else {
        return;
    };
    let _serial = SERIAL.locked();
    reset(&[(tessera_fake_nvml::load::LOAD_ENV, &load)]);
    assert_eq!(cuInit(0), SUCCESS);
    create_context(0);
    let p = alloc(512 * MIB).unwrap();
    let f = spin_kernel();
    assert_eq!(launch(f, 128, ptr::null_mut()), SUCCESS);
    println!("ready");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(cuMemFree_v2(p), SUCCESS);
    println!("freed");
    // Until killed.
    std::io::stdin().read_line(&mut line).unwrap();
}

fn nvml_processes(gpu: &str) -> Vec<(u32, u64)> {
    use tessera_fake_nvml as nvml;
    let uuid = std::ffi::CString::new(gpu).unwrap();
    let mut d: nvml_wrapper_sys::bindings::nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { nvml::nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut d) },
        0
    );
    let mut infos =
        [unsafe { std::mem::zeroed::<nvml_wrapper_sys::bindings::nvmlProcessInfo_t>() }; 8];
    let mut n = infos.len() as c_uint;
    assert_eq!(
        unsafe { nvml::nvmlDeviceGetComputeRunningProcesses_v3(d, &mut n, infos.as_mut_ptr()) },
        0
    );
    infos[..n as usize]
        .iter()
        .map(|i| (i.pid, i.usedGpuMemory))
        .collect()
}

#[test]
fn another_process_load_is_seen_through_nvml() {
    use std::io::{BufRead, BufReader, Write};
    let _p = process(&[]);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "tests::child_holds_memory_and_runs_kernels",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut wait_for_line = |want: &str| {
        // The test harness may have begun the line with the test's name.
        let mut line = String::new();
        while !line.trim_end().ends_with(want) {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the child ended before printing {want}"
            );
        }
    };
    wait_for_line("ready");
    assert_eq!(tessera_fake_nvml::nvmlInit_v2(), 0);
    // The child's entry: what this test process itself may hold from an
    // earlier test of the binary is not its business.
    let childs = || -> Vec<(u32, u64)> {
        let all = nvml_processes(GPU0);
        all.into_iter().filter(|(p, _)| *p == pid).collect()
    };
    assert_eq!(childs(), vec![(pid, 512 * MIB)]);
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "free").unwrap();
    wait_for_line("freed");
    // Still busy (its lease), no memory.
    assert_eq!(childs(), vec![(pid, 0)]);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(childs(), vec![]);
    tessera_fake_nvml::nvmlShutdown();
}
