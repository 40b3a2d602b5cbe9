//! The claim guard's cost and reaction time, on the simulated GPUs with
//! real processes: `cargo bench -p tessera-driver --bench claim_guard`.
//!
//! Each Isolated claim is one Pod with one MPS client holding 1 GiB; the
//! processes are real children (`sleep`) whose GPU load the fake NVML
//! finds through the per-process records it reads (a record written here
//! and inherited by the child names the child). Pods are found the way the
//! guard finds them, through `<proc>/<pid>/cgroup`: a directory standing
//! in for `/proc` holds a kubepods cgroup line per child (everything else,
//! pids, start times and the kill through a pidfd, is the real `/proc`).
//!
//! 1. Reaction time: the guard runs [`guard::pass`] every period, as the
//!    node does; a new process of a claim's Pod appears outside MPS holding
//!    2 GiB at a random moment of the period, and the time from its record
//!    being written to the child being reaped (killed by the guard) is
//!    measured, p50 and p99.
//! 2. CPU: passes over 1 and 8 guarded GPUs without violations, the
//!    guard thread's CPU time per pass and GPU, and the part of it spent in
//!    NVML's two process lists ([`guard::sample`]), which on the simulated
//!    GPUs walk every process's descriptors (a real driver answers from the
//!    kernel module).
//!
//! Arguments (after `--`): `--periods-ms 100,1000` and `--violations N`
//! (per period), each run with 1 and with 8 guarded GPUs.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use tessera_controller::model::policy::GuardAction;
use tessera_driver::claim_uid::ClaimUid;
use tessera_driver::guard::judge::Guarded;
use tessera_driver::guard::{self, Memory};
use tessera_test_kit::gpu_load::{holding, loaded_process, simulate_with_load};

const GIB: u64 = 1 << 30;
/// Isolated claims (each one Pod, one MPS client) per guarded GPU.
const CLAIMS_PER_GPU: usize = 4;
/// Passes per CPU measurement.
const CPU_PASSES: u32 = 200;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let periods: Vec<u64> = value("--periods-ms")
        .map_or("100,1000", String::as_str)
        .split(',')
        .map(|p| {
            p.parse()
                .expect("--periods-ms: milliseconds, comma-separated")
        })
        .collect();
    let violations: usize = value("--violations").map_or(100, |v| v.parse().expect("--violations"));

    let machine = Machine::new();
    let gpus = machine.gpus.clone();
    println!(
        "claim guard benchmark: {} simulated GPUs, {CLAIMS_PER_GPU} Isolated claims each, {} CPUs",
        gpus.len(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // Every claim's Pod and its MPS client.
    let mut clients = Vec::new();
    let mut claims = Vec::new();
    for (g, gpu) in gpus.iter().enumerate() {
        for c in 0..CLAIMS_PER_GPU {
            let pod = uuid(0xa000 + (g * CLAIMS_PER_GPU + c) as u32);
            let child = machine.loaded(gpu, GIB, true, &pod);
            clients.push(child);
            claims.push(Guarded {
                uid: ClaimUid::parse(&uuid(0xc000 + (g * CLAIMS_PER_GPU + c) as u32)).unwrap(),
                gpu: gpu.clone(),
                memory_bytes: 8 * GIB,
                pods: Some(vec![pod]),
            });
        }
    }

    println!("\nCPU per pass (guard thread, no violations, {CPU_PASSES} passes):");
    println!("GPUs  pass/GPU  NVML lists/GPU  guard's own/GPU  pass per GPU at 1000 ms");
    for n in [1, gpus.len()] {
        let guarded: Vec<Guarded> = claims
            .iter()
            .filter(|c| gpus[..n].contains(&c.gpu))
            .cloned()
            .collect();
        let mut memory = Memory::default();
        let whole = thread_cpu_per(CPU_PASSES, || {
            let found = guard::pass(
                &machine.nvml,
                GuardAction::Enforce,
                &machine.proc,
                &guarded,
                &mut memory,
            );
            assert!(found.told.is_empty(), "{:?}", found.told);
        });
        let lists = thread_cpu_per(CPU_PASSES, || {
            for gpu in &gpus[..n] {
                assert_eq!(guard::sample(&machine.nvml, gpu).len(), CLAIMS_PER_GPU);
            }
        });
        let per_gpu = whole / n as u32;
        let lists = lists / n as u32;
        println!(
            "{n:>4}  {:>8}  {:>14}  {:>15}  {:.2} % of a CPU",
            micros(per_gpu),
            micros(lists),
            micros(per_gpu.saturating_sub(lists)),
            per_gpu.as_secs_f64() * 100.0
        );
    }

    println!("\nViolation to kill (left-mps, 2 GiB outside MPS):");
    println!("GPUs  period   violations  p50       p99       max       pass p50  pass p99");
    for (n, period) in [1, gpus.len()]
        .into_iter()
        .flat_map(|n| periods.iter().map(move |p| (n, *p)))
    {
        let guarded: Vec<Guarded> = claims
            .iter()
            .filter(|c| gpus[..n].contains(&c.gpu))
            .cloned()
            .collect();
        let period = Duration::from_millis(period);
        let report = reaction(&machine, &guarded, period, violations);
        println!(
            "{n:>4}  {:>5} ms  {violations:>10}  {:>8}  {:>8}  {:>8}  {:>8}  {:>8}",
            period.as_millis(),
            millis(percentile(&report.latencies, 50)),
            millis(percentile(&report.latencies, 99)),
            millis(*report.latencies.iter().max().unwrap()),
            millis(percentile(&report.passes, 50)),
            millis(percentile(&report.passes, 99)),
        );
    }
    for mut c in clients {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The simulated machine: NVML over the fake library with load records
/// read, and the directory standing in for `/proc` for Pod attribution.
struct Machine {
    nvml: Nvml,
    gpus: Vec<String>,
    proc: PathBuf,
    _dir: tempfile::TempDir,
}

impl Machine {
    fn new() -> Machine {
        let dir = tempfile::tempdir().unwrap();
        let topology =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/topologies/h100x8.yaml");
        // SAFETY: set before any other thread runs (the guard's starts later).
        unsafe { simulate_with_load(&topology, &dir.path().join("machine.state")) };
        let nvml = Nvml::builder()
            .lib_path(tessera_test_kit::artifacts::fake_nvml_lib().as_os_str())
            .init()
            .expect("the simulated NVML starts");
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&topology).unwrap()).unwrap();
        let gpus = doc["gpus"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|g| g["uuid"].as_str().unwrap().to_owned())
            .collect();
        let proc = dir.path().join("proc");
        Machine {
            nvml,
            gpus,
            proc,
            _dir: dir,
        }
    }

    /// A running process of Pod `pod` holding `bytes` on `gpu`, as an MPS
    /// client or with a context of its own.
    fn loaded(&self, gpu: &str, bytes: u64, mps_client: bool, pod: &str) -> Child {
        let in_pod = |pid: u32| {
            let cgroup = self.proc.join(pid.to_string());
            std::fs::create_dir_all(&cgroup)?;
            std::fs::write(
                cgroup.join("cgroup"),
                format!(
                    "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{pid}.scope\n",
                    pod.replace('-', "_")
                ),
            )
        };
        loaded_process(holding(gpu, bytes, mps_client), in_pod).unwrap()
    }
}

/// Latencies from a violation to the offender reaped, and pass durations.
struct Reaction {
    latencies: Vec<Duration>,
    passes: Vec<Duration>,
}

/// The guard every `period` on another thread; `count` violations, one at
/// a time, each at a pseudo-random moment of the period.
fn reaction(machine: &Machine, claims: &[Guarded], period: Duration, count: usize) -> Reaction {
    let stop = Arc::new(AtomicBool::new(false));
    let passes = Arc::new(Mutex::new(Vec::new()));
    let latencies = std::thread::scope(|scope| {
        let (stop2, passes2) = (stop.clone(), passes.clone());
        scope.spawn(move || {
            let mut memory = Memory::default();
            while !stop2.load(Ordering::Relaxed) {
                std::thread::sleep(period);
                let started = Instant::now();
                guard::pass(
                    &machine.nvml,
                    GuardAction::Enforce,
                    &machine.proc,
                    claims,
                    &mut memory,
                );
                passes2.lock().unwrap().push(started.elapsed());
            }
        });
        let mut jitter = Lcg(0x5eed);
        let mut latencies = Vec::with_capacity(count);
        for i in 0..count {
            std::thread::sleep(period.mul_f64(jitter.next_unit()));
            let claim = &claims[i % claims.len()];
            let pod = &claim.pods.as_ref().unwrap()[0];
            let mut offender = machine.loaded(&claim.gpu, 2 * GIB, false, pod);
            let written = Instant::now();
            let status = offender.wait().unwrap();
            latencies.push(written.elapsed());
            assert_eq!(
                std::os::unix::process::ExitStatusExt::signal(&status),
                Some(libc::SIGKILL),
                "the guard kills the offender"
            );
            let _ = std::fs::remove_dir_all(machine.proc.join(offender.id().to_string()));
        }
        stop.store(true, Ordering::Relaxed);
        latencies
    });
    let passes = passes.lock().unwrap().clone();
    Reaction { latencies, passes }
}

/// This thread's CPU time per call of `f`, over `n` calls.
fn thread_cpu_per(n: u32, mut f: impl FnMut()) -> Duration {
    let before = thread_cpu();
    for _ in 0..n {
        f();
    }
    (thread_cpu() - before) / n
}

fn thread_cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn percentile(values: &[Duration], p: usize) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank = (sorted.len() * p).div_ceil(100).max(1);
    sorted[rank - 1]
}

fn micros(d: Duration) -> String {
    format!("{} us", d.as_micros())
}

fn millis(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// A UUID-shaped id ending in `n`.
fn uuid(n: u32) -> String {
    format!("00000000-0000-4000-8000-{n:012x}")
}

/// Pseudo-random numbers enough for spreading violations over a period.
struct Lcg(u64);

impl Lcg {
    fn next_unit(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}
