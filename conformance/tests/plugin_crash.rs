//! Crash safety: `tessera plugin` is killed with SIGKILL at random points
//! of prepare and unprepare calls, hundreds of times, and restarted. After
//! every restart:
//!
//! * no checkpoint entry is left half-done (`Started` / `Unpreparing`);
//! * every CDI spec belongs to a completed claim (no orphans) and every
//!   completed claim has exactly its recorded spec;
//! * every completed claim is answered exactly as it was the first time;
//! * no MIG device is left that no completed claim recorded creating (a
//!   dynamic MIG claim is among them), seen from another process, except
//!   what a create cut short left at the dynamic device's placement: NVML
//!   cannot say who made it, so the node leaves it alone and reports it
//!   (`MigDeviceLeftAlone`), and the operator (this test) removes it;
//! * an MPS control daemon runs for the Isolated share exactly while a
//!   completed claim holds it, and no other daemon is left.
//!
//! The random points come from a seeded generator: the seed is printed, and
//! `TESSERA_CRASH_SEED=<n>` repeats a run; `TESSERA_CRASH_CYCLES` changes
//! the number of kill/restart cycles (default 200).

mod plugin_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use tessera_api::kubelet::dra_v1;

use plugin_support::*;
use tessera_conformance::wait_for;
use tessera_controller::model::DeviceKind;
use tessera_driver::host::mig::{self, MigPlacement, Recorded};

/// xorshift64*: small, deterministic, good enough to pick kill points.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn check_files(dirs: &PluginDirs, cycle: usize) -> Result<Vec<String>> {
    let cp = dirs.checkpoint();
    let mut completed = Vec::new();
    for (uid, entry) in &cp {
        ensure!(
            entry["state"] == "Completed",
            "cycle {cycle}: claim {uid} left in state {} after restart",
            entry["state"]
        );
        let spec = dirs
            .spec(uid)
            .with_context(|| format!("cycle {cycle}: completed claim {uid} has no CDI spec"))?;
        ensure!(
            spec == entry["spec"],
            "cycle {cycle}: CDI spec of {uid} differs from the recorded one"
        );
        completed.push(uid.clone());
    }
    // After a restart only spares of removed specs are hidden there: the
    // temp files of writes the kill cut short are gone.
    for file in dirs.cdi_hidden() {
        ensure!(
            file.starts_with(".gpu.tessera.dev-claim_spare-") && !file.ends_with(".json"),
            "cycle {cycle}: unexpected hidden file {file} in the CDI dir"
        );
    }
    for file in dirs.cdi_files() {
        let uid = file
            .strip_prefix("gpu.tessera.dev-claim_")
            .and_then(|f| f.strip_suffix(".json"))
            .with_context(|| format!("cycle {cycle}: unexpected file {file} in the CDI dir"))?;
        ensure!(
            cp.contains_key(uid),
            "cycle {cycle}: orphaned CDI spec {file}"
        );
    }
    Ok(completed)
}

/// The dynamic claim's device: 1g.5gb at memory slice 3 of GPU 0.
const DYNAMIC_AT: MigPlacement = MigPlacement { start: 3, size: 1 };
/// What a prepare says when the node's view still names a MIG device that
/// is gone.
const STALE_MIG: &str = "cannot read MIG capability file";
/// Set in the operator's child process: the GPU to clear, and the MIG
/// devices completed claims recorded (comma-separated), which it spares.
const OPERATOR_GPU_ENV: &str = "TESSERA_CRASH_OPERATOR_GPU";
const OPERATOR_SPARE_ENV: &str = "TESSERA_CRASH_OPERATOR_SPARE";

/// MIG devices completed claims recorded creating.
fn recorded_migs(cp: &BTreeMap<String, Value>) -> BTreeSet<String> {
    cp.values()
        .flat_map(|e| e["actions"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["instance"]["migUuid"].as_str().map(str::to_owned))
        .collect()
}

/// The operator's part: GPU instances at the dynamic device's placement
/// that no completed claim recorded (a create cut short by the kill, whole
/// or half made) must have been reported by the node in this start's log,
/// and are then removed, as the report says to. Runs [`child_operator`] on
/// this node's simulated machine; returns how many it removed.
fn clear_unproven(w: &World, gpu: &str, log_before: usize, cycle: usize) -> Result<usize> {
    let spare: Vec<String> = recorded_migs(&w.dirs.checkpoint()).into_iter().collect();
    let b = binaries();
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", "child_operator", "--ignored", "--nocapture"])
        .env(OPERATOR_GPU_ENV, gpu)
        .env(OPERATOR_SPARE_ENV, spare.join(","))
        .env("TESSERA_FAKE_NVML_LIB", &b.fake_nvml)
        .env("TESSERA_FAKE_NVML_TOPOLOGY", topology_path())
        .env("TESSERA_FAKE_NVML_STATE", w.dirs.nvml_state())
        // The simulated driver keeps the MIG capability files in step.
        .env("TESSERA_FAKE_NVML_DRIVER_ROOT", w.dirs.driver_root())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && text.contains("test child_operator ... ok"),
        "cycle {cycle}: the operator's child failed:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let removed: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("removed unrecorded GPU instances: "))
        .context("the operator's child did not say what it removed")?
        .trim()
        .parse()?;
    if removed > 0 {
        let log = std::fs::read_to_string(w.dirs.path("plugin.log")).unwrap_or_default();
        ensure!(
            log.get(log_before..)
                .is_some_and(|new| new.contains("MigDeviceLeftAlone")),
            "cycle {cycle}: {removed} GPU instance(s) at the dynamic placement that no claim \
             recorded, and the node did not report them"
        );
    }
    Ok(removed)
}

#[test]
#[ignore = "run in a child process by sigkill_at_random_points_of_prepare_and_unprepare"]
fn child_operator() {
    let Some(gpu) = std::env::var_os(OPERATOR_GPU_ENV) else {
        return;
    };
    let gpu = gpu.to_string_lossy().into_owned();
    let spare = std::env::var(OPERATOR_SPARE_ENV).unwrap_or_default();
    let lib = std::env::var_os("TESSERA_FAKE_NVML_LIB").expect("TESSERA_FAKE_NVML_LIB");
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(&lib)
        .init()
        .expect("NVML (simulated) init");
    let mut removed = 0;
    for g in mig::list(&nvml, &gpu).expect("listing MIG devices") {
        let uuid = g.compute_instances.first().and_then(|c| c.mig_uuid.clone());
        let spared = uuid
            .as_deref()
            .is_some_and(|u| spare.split(',').any(|s| s == u));
        if g.placement != DYNAMIC_AT || spared {
            continue;
        }
        // As `nvidia-smi mig -dci` then `-dgi` would, by its ids.
        let named = Recorded {
            gpu_instance_id: g.gpu_instance_id,
            mig_uuid: uuid.as_deref().unwrap_or_default(),
        };
        mig::destroy(&nvml, &gpu, g.profile_id, g.placement, named).expect("destroying it");
        removed += 1;
    }
    println!("removed unrecorded GPU instances: {removed}");
}

fn instance_uuids(inventory: &tessera_api::inventory::Inventory) -> BTreeSet<String> {
    inventory
        .gpus
        .iter()
        .flat_map(|g| g.mig.instances())
        .map(|i| i.uuid.clone())
        .collect()
}

/// The MIG devices on the machine are the topology's and those completed
/// claims recorded creating; an MPS daemon runs exactly while the Isolated
/// claim is completed.
async fn check_hardware(
    dirs: &PluginDirs,
    static_migs: &BTreeSet<String>,
    isolated: &str,
    cycle: usize,
) -> Result<()> {
    let cp = dirs.checkpoint();
    let recorded = recorded_migs(&cp);
    let now = instance_uuids(&dirs.inventory_now(&topology_path())?);
    let expected: BTreeSet<String> = static_migs.union(&recorded).cloned().collect();
    ensure!(
        now == expected,
        "cycle {cycle}: MIG devices {now:?}, expected the topology's plus the recorded {recorded:?}"
    );
    let want = usize::from(cp.contains_key(isolated));
    let daemons = wait_for("the MPS daemons to match the claims", TIMEOUT, || {
        let found = dirs.mps_daemons();
        async move { Ok((found.len() == want).then_some(found)) }
    })
    .await
    .with_context(|| format!("cycle {cycle}: {:?} daemons", dirs.mps_daemons()))?;
    ensure!(daemons.len() == want);
    Ok(())
}

#[tokio::test]
async fn sigkill_at_random_points_of_prepare_and_unprepare() -> Result<()> {
    let seed: u64 = match std::env::var("TESSERA_CRASH_SEED") {
        Ok(s) => s.parse().context("TESSERA_CRASH_SEED must be a number")?,
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos() as u64
                | 1
        }
    };
    let cycles: usize = std::env::var("TESSERA_CRASH_CYCLES")
        .ok()
        .map(|s| s.parse())
        .transpose()
        .context("TESSERA_CRASH_CYCLES must be a number")?
        .unwrap_or(200);
    eprintln!(
        "crash test seed: {seed} (TESSERA_CRASH_SEED={seed} repeats this run), {cycles} cycles"
    );
    let w = World::new("plugin-crash").await?;
    let outcome = crash_cycles(&w, seed, cycles).await;
    if outcome.is_err() {
        let log = std::fs::read_to_string(w.dirs.path("plugin.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(80).collect();
        eprintln!(
            "plugin log (last {} lines):\n{}",
            tail.len(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    outcome?;
    w.namespace.delete().await
}

/// A SIGKILLed plugin's registration socket can still accept connections
/// after `kill` + `wait` returned: a child it was starting (the MPS daemon,
/// the `quit` client) holds a copy of its listeners from fork until exec
/// closes them. A connection made in that moment is queued, never answered,
/// and reset when the listener closes; the kill/restart cycles above once
/// failed so (GetInfo: `ConnectionReset`, before the new process had logged
/// anything). Here a listener held in this process stands for that child:
/// the new process's own socket must be the one registered with.
#[tokio::test]
async fn a_killed_plugins_socket_still_listening_is_not_taken_for_the_new_ones() -> Result<()> {
    let w = World::new("plugin-leftover").await?;
    let leftover = w
        .dirs
        .registry()
        .join(format!("{}-0000000000-reg.sock", w.driver));
    let listener = std::os::unix::net::UnixListener::bind(&leftover)?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let holder = std::thread::spawn(move || {
        // The child execs a little later: the listener goes away.
        std::thread::sleep(Duration::from_millis(500));
        drop(listener);
    });
    let outcome = async {
        let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
        ensure!(
            !k.info.endpoint.is_empty(),
            "registered without a DRA endpoint"
        );
        let _ = holder.join();
        let answer = unprepare(&mut k, Vec::new()).await?;
        ensure!(answer.claims.is_empty(), "{answer:?}");
        Ok(())
    }
    .await;
    if outcome.is_err() {
        eprintln!(
            "plugin log:\n{}",
            std::fs::read_to_string(w.dirs.path("plugin.log")).unwrap_or_default()
        );
    }
    outcome?;
    drop(plugin);
    w.namespace.delete().await
}

async fn crash_cycles(w: &World, seed: u64, cycles: usize) -> Result<()> {
    let mut rng = Rng(seed);
    let client = w.cluster.client();
    let shared = share(&w.node, &w.driver, true);
    let gpu = whole_gpu(&w.node, &w.driver);
    let (mig, _) = existing_mig(&w.node, &w.driver);
    let isolated = share(&w.node, &w.driver, false);
    // 1g.5gb on GPU 0's free memory slice: created at prepare.
    let dynamic = device_where(&w.node, &w.driver, |r| {
        matches!(&r.kind, DeviceKind::Mig { dynamic: true, existing: None, profile, placement, .. }
            if profile == "1g.5gb" && placement.start == 3)
    });
    let dynamic_gpu = devices(&w.node, &w.driver)[&dynamic].gpu_uuid.clone();
    let (mut unproven, mut operator_removed) = (0, false);
    let mut claims = Vec::new();
    let devices = [&shared, &shared, &gpu, &mig, &isolated, &dynamic];
    for (i, device) in devices.into_iter().enumerate() {
        let mut r = result("dev", &w.driver, &w.node, device);
        if device == &shared || device == &isolated {
            r["shareID"] = json!(format!("00000000-0000-4000-8000-{i:012}"));
            r["consumedCapacity"] = json!({"memory": "512Mi", "cores": "5"});
        }
        let claim = create_allocated(
            &client,
            w.ns(),
            &ClaimSpec {
                name: format!("crash-{i}"),
                requests: vec![("dev".into(), CLASS.into())],
                results: vec![r],
                config: vec![],
                spec_config: vec![],
            },
        )
        .await?;
        claims.push(claim_ref(w.ns(), &claim));
    }

    // The first answer each claim ever got; every later one must equal it.
    let mut canonical: BTreeMap<String, Vec<dra_v1::Device>> = BTreeMap::new();
    let mut record = |uid: &str, devices: &[dra_v1::Device], cycle: usize| -> Result<()> {
        match canonical.get(uid) {
            Some(first) => ensure!(
                first.as_slice() == devices,
                "cycle {cycle}: claim {uid} answered differently than before"
            ),
            None => {
                canonical.insert(uid.to_owned(), devices.to_vec());
            }
        }
        Ok(())
    };

    let isolated_uid = claims[4].uid.clone();
    let dynamic_uid = claims[5].uid.clone();
    let static_migs = instance_uuids(&w.dirs.inventory_now(&topology_path())?);

    let started = Instant::now();
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    // Kill points are drawn from [0, window); the window adapts so that
    // about half of the kills land while a call is in flight, whatever the
    // speed of the machine.
    let mut window = Duration::from_millis(20);
    let (mut kills_in_flight, mut prepares_done, mut completed_seen) = (0, 0, 0);
    for cycle in 0..cycles {
        let subset: Vec<dra_v1::Claim> = claims
            .iter()
            .filter(|_| rng.below(2) == 0)
            .cloned()
            .collect();
        let subset = if subset.is_empty() {
            vec![claims[rng.below(claims.len() as u64) as usize].clone()]
        } else {
            subset
        };
        let is_prepare = rng.below(10) < 6;
        let mut dra = k.dra.clone();
        let call = tokio::spawn(async move {
            if is_prepare {
                dra.node_prepare_resources(dra_v1::NodePrepareResourcesRequest { claims: subset })
                    .await
                    .map(|r| Some(r.into_inner()))
            } else {
                dra.node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
                    claims: subset,
                })
                .await
                .map(|_| None)
            }
        });
        // The fault: a kill at a random moment, usually while the call runs.
        let delay = Duration::from_micros(rng.below(window.as_micros() as u64 + 1));
        tokio::time::sleep(delay).await;
        if call.is_finished() {
            window = window.mul_f64(0.9).max(Duration::from_micros(200));
        } else {
            kills_in_flight += 1;
            window = window.mul_f64(1.1).min(Duration::from_secs(2));
        }
        plugin.kill()?;
        if let Ok(Ok(Some(answer))) = call.await {
            for (uid, a) in &answer.claims {
                // The node sees the operator's removal at its next look at
                // the GPUs (--rediscover-seconds): until then its view may
                // still name the removed instance, and the kubelet's retry
                // (a later cycle here) prepares the claim.
                if operator_removed && *uid == dynamic_uid && a.error.contains(STALE_MIG) {
                    continue;
                }
                ensure!(
                    a.error.is_empty(),
                    "cycle {cycle}: prepare of {uid} failed: {}",
                    a.error
                );
                record(uid, &a.devices, cycle)?;
                prepares_done += 1;
            }
        }

        let log_before = std::fs::metadata(w.dirs.path("plugin.log"))
            .map(|m| m.len() as usize)
            .unwrap_or(0);
        plugin = PluginProcess::start(&w.dirs, &w.options())?;
        k = register(&w.dirs, &mut plugin, &w.driver).await?;
        let removed = clear_unproven(w, &dynamic_gpu, log_before, cycle)?;
        operator_removed = removed > 0;
        unproven += removed;
        let completed = check_files(&w.dirs, cycle)?;
        check_hardware(&w.dirs, &static_migs, &isolated_uid, cycle).await?;
        completed_seen += completed.len();
        // Completed claims are answered unchanged (from the checkpoint).
        let again: Vec<dra_v1::Claim> = claims
            .iter()
            .filter(|c| completed.contains(&c.uid))
            .cloned()
            .collect();
        if !again.is_empty() {
            let answer = prepare(&mut k, again).await?;
            for (uid, a) in &answer.claims {
                ensure!(
                    a.error.is_empty(),
                    "cycle {cycle}: re-prepare of {uid} failed: {}",
                    a.error
                );
                record(uid, &a.devices, cycle)?;
            }
        }
    }
    eprintln!(
        "final kill window {window:?}; {unproven} unproven MIG devices left alone and cleared"
    );
    eprintln!(
        "{cycles} kill/restart cycles in {:?}: {kills_in_flight} kills during a call, {prepares_done} prepares answered before a kill, \
         {completed_seen} completed claims checked after restarts",
        started.elapsed()
    );
    // Coverage, not correctness: enough restarts found completed claims to
    // check (one every two or three cycles is typical: prepares that start an
    // MPS daemon or create a MIG device are often killed before they end).
    ensure!(
        completed_seen >= cycles / 6,
        "only {completed_seen} completed claims were checked after {cycles} restarts"
    );
    ensure!(
        kills_in_flight >= cycles / 3,
        "only {kills_in_flight} of {cycles} kills hit a call in flight: the kill points are not spread over the calls"
    );

    // Clean end: everything unprepares, nothing is left.
    let answer = unprepare(&mut k, claims.clone()).await?;
    for (uid, a) in &answer.claims {
        ensure!(a.error.is_empty(), "final unprepare of {uid}: {}", a.error);
    }
    w.dirs.unprepared_files_removed().await?;
    check_hardware(&w.dirs, &static_migs, &isolated_uid, cycles).await?;
    ensure!(w.dirs.checkpoint().is_empty());
    let leftover: Vec<Value> = w.dirs.checkpoint().into_values().collect();
    ensure!(leftover.is_empty());
    drop(plugin);
    Ok(())
}
