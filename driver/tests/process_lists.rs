//! NVML's process lists as the claim guard and the metrics read them: every
//! process on the device, in both lists, also when more run than the first
//! call has room for, against the simulated NVML with real processes.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Child;

use nvml_wrapper::Nvml;
use tessera_driver::metrics::processes::{ProcessList, running};
use tessera_test_kit::gpu_load::{holding, loaded_process, simulate_with_load};

/// A process holding `bytes` on `gpu`.
fn loaded(gpu: &str, bytes: u64, mps_client: bool) -> Child {
    loaded_process(holding(gpu, bytes, mps_client), |_| Ok(())).expect("a process holding load")
}

/// Processes that end with the test, whatever its outcome: a record left
/// behind would show on these GPUs to every later reader on the machine.
struct Held(Vec<Child>);

impl Held {
    fn pids(&self) -> BTreeSet<u32> {
        self.0.iter().map(Child::id).collect()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn every_process_is_listed_however_many_run() {
    let dir = tempfile::tempdir().unwrap();
    // GPUs no test on a cluster simulates: the records below are seen by
    // every reader of these UUIDs on the machine while they live.
    let topology = Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/topologies/l4x2.yaml");
    // SAFETY: the only test of this binary; set before NVML starts.
    unsafe { simulate_with_load(&topology, &dir.path().join("machine.state")) };
    let nvml = Nvml::builder()
        .lib_path(tessera_test_kit::artifacts::fake_nvml_lib().as_os_str())
        .init()
        .expect("the simulated NVML starts");
    let gpu = nvml.device_by_index(0).unwrap();
    let other = nvml.device_by_index(1).unwrap();
    let uuid = gpu.uuid().unwrap();

    // More processes with a context of their own than the first call's
    // room, a few MPS clients, and one process on another GPU.
    let own = Held((0..40).map(|_| loaded(&uuid, 1 << 20, false)).collect());
    let clients = Held((0..3).map(|_| loaded(&uuid, 2 << 20, true)).collect());
    let elsewhere = Held(vec![loaded(&other.uuid().unwrap(), 1 << 20, false)]);

    let listed = |device, list| -> BTreeSet<u32> {
        running(&nvml, device, list)
            .unwrap()
            .into_iter()
            .map(|p| p.pid)
            .collect()
    };
    assert_eq!(listed(&gpu, ProcessList::Compute), own.pids());
    assert_eq!(listed(&gpu, ProcessList::MpsClients), clients.pids());
    assert_eq!(listed(&other, ProcessList::MpsClients), BTreeSet::new());
    // The same lists nvml-wrapper reads in two calls each.
    let wrapper = |list: Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>| {
        list.into_iter().map(|p| p.pid).collect::<BTreeSet<_>>()
    };
    assert_eq!(
        wrapper(gpu.running_compute_processes().unwrap()),
        own.pids()
    );
    let memory: Vec<_> = running(&nvml, &gpu, ProcessList::MpsClients)
        .unwrap()
        .into_iter()
        .map(|p| p.used_gpu_memory)
        .collect();
    assert_eq!(
        memory,
        vec![nvml_wrapper::enums::device::UsedGpuMemory::Used(2 << 20); 3]
    );

    assert_eq!(listed(&other, ProcessList::Compute), elsewhere.pids());
    drop((own, clients, elsewhere));
    assert_eq!(listed(&gpu, ProcessList::Compute), BTreeSet::new());
}
