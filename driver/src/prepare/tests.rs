//! Prepare without an API server: claims from a map, a recording sharing
//! implementation, files in a temp dir. The API-server tests live in
//! `conformance/tests/plugin_*.rs`.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tessera_api::config::IsolationLevel;
use tessera_api::config::{Limits, TimeSliceInterval};
use tessera_api::inventory::{Gpu, Inventory, Mig, MigPlacement};
use tessera_controller::model::{DeviceKind, DeviceRef};

use super::claims::{ClaimRef, ClaimSource, FetchError, FetchFuture};
use super::*;
use crate::host::port::{
    CreateError, HostError, MigManager, MpsClient, MpsControl, MpsTarget, TimeSliceControl,
    Unsupported,
};
use crate::host::time_slice::NvidiaSmiTimeSlice;
use crate::state::catalog::{Catalog, DeviceCatalog};

const NODE: &str = "node-a";
const DRIVER: &str = "gpu.tessera.dev";
const GPU: &str = "GPU-11111111-2222-3333-4444-555555555555";

struct Claims(HashMap<String, ResourceClaim>);

impl ClaimSource for Claims {
    fn get<'a>(&'a self, _namespace: &'a str, name: &'a str) -> FetchFuture<'a> {
        let found = self.0.get(name).cloned();
        Box::pin(async move { found.ok_or(FetchError::NotFound) })
    }
}

#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<String>>,
    fail_mps: bool,
    /// Where time-slice calls go besides the record (the real tool).
    time_slicer: Option<NvidiaSmiTimeSlice>,
}

impl Recorder {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

impl MpsControl for Recorder {
    fn acquire(
        &self,
        claim: &ClaimUid,
        target: &MpsTarget,
        limits: &Limits,
        _gpu_minor: u32,
    ) -> Result<MpsClient, HostError> {
        self.calls.lock().unwrap().push(format!(
            "acquire {claim} {} {}",
            target.gpu_uuid, limits.compute_percent
        ));
        if self.fail_mps {
            return Err(HostError::backend(std::io::Error::other(
                "daemon did not start",
            )));
        }
        Ok(MpsClient {
            pipe_dir: format!("/run/tessera/mps/{}/pipe", target.gpu_uuid).into(),
            shm_dir: format!("/run/tessera/mps/{}/shm", target.gpu_uuid).into(),
            limits: *limits,
        })
    }
    fn release(&self, claim: &ClaimUid, target: &MpsTarget) -> Result<(), HostError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("release {claim} {}", target.gpu_uuid));
        Ok(())
    }
    fn release_claim(&self, claim: &ClaimUid) -> Result<(), HostError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("release every daemon of {claim}"));
        Ok(())
    }
}

impl TimeSliceControl for Recorder {
    fn set(&self, gpu_uuid: &str, interval: TimeSliceInterval) -> Result<(), HostError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("timeslice {gpu_uuid} {interval:?}"));
        match &self.time_slicer {
            Some(t) => t.set(gpu_uuid, interval),
            None => Ok(()),
        }
    }
    fn reset(&self, gpu_uuid: &str) -> Result<(), HostError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("reset timeslice {gpu_uuid}"));
        match &self.time_slicer {
            Some(t) => t.reset(gpu_uuid),
            None => Ok(()),
        }
    }
}

fn inventory() -> Inventory {
    Inventory {
        driver_version: "550.90.07".into(),
        cuda_driver_version: "12.4".into(),
        gpus: vec![Gpu {
            uuid: GPU.into(),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            brand: "nvidia".into(),
            architecture: "hopper".into(),
            cuda_compute_capability: "9.0".into(),
            pci_bus_id: "0000:18:00.0".into(),
            memory_bytes: 80 << 30,
            multiprocessors: 132,
            minor: 3,
            mig: Mig::NotSupported,
        }],
    }
}

fn catalog() -> Catalog {
    catalog_with_share(
        "gpu-0-isolated",
        DeviceKind::Share {
            level: IsolationLevel::Isolated,
            provider: None,
            time_slice: None,
        },
    )
}

/// The fixture GPU published whole and as one share device.
fn catalog_with_share(share: &str, kind: DeviceKind) -> Catalog {
    let reference = |kind| DeviceRef {
        gpu_uuid: GPU.into(),
        gpu_index: 0,
        kind,
    };
    Catalog::new(
        inventory(),
        [
            ("gpu-0".to_owned(), reference(DeviceKind::Whole)),
            (share.to_owned(), reference(kind)),
        ]
        .into(),
    )
}

struct Fixture {
    dir: tempfile::TempDir,
    sharing: Arc<Recorder>,
    /// What the preparer said changed, in order.
    changes: Arc<Mutex<Vec<NodeChange>>>,
}

impl Fixture {
    fn new(fail_mps: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("root/dev")).unwrap();
        for node in ["nvidia3", "nvidiactl"] {
            std::fs::write(dir.path().join("root/dev").join(node), "").unwrap();
        }
        std::fs::write(dir.path().join("boot_id"), "boot\n").unwrap();
        Fixture {
            dir,
            sharing: Arc::new(Recorder {
                fail_mps,
                ..Default::default()
            }),
            changes: Arc::default(),
        }
    }

    fn config(&self) -> PrepareConfig {
        let root = self.dir.path().join("root");
        PrepareConfig {
            driver: DRIVER.into(),
            node: NODE.into(),
            cdi_dir: self.dir.path().join("cdi"),
            state_dir: self.dir.path().join("state"),
            boot_id_file: self.dir.path().join("boot_id"),
            layout: Layout {
                driver_root: root.clone(),
                dev_root: root,
                driver_files: Vec::new(),
                hami_core_dir: self.dir.path().join("hami-core"),
            },
        }
    }

    async fn open(&self, claims: Vec<ResourceClaim>) -> (Arc<Preparer>, Recovery) {
        self.open_with(claims, catalog(), Arc::new(Unsupported))
            .await
    }

    async fn open_with(
        &self,
        claims: Vec<ResourceClaim>,
        catalog: Catalog,
        mig: Arc<dyn MigManager>,
    ) -> (Arc<Preparer>, Recovery) {
        let claims = claims
            .into_iter()
            .map(|c| (c.metadata.name.clone().unwrap(), c))
            .collect();
        let deps = Dependencies {
            claims: Arc::new(Claims(claims)),
            catalog: Arc::new(DeviceCatalog::fixed(catalog)),
            mps: self.sharing.clone(),
            time_slice: self.sharing.clone(),
            mig,
            status: None,
            events: None,
            on_change: Some({
                let changes = self.changes.clone();
                Arc::new(move |c| changes.lock().unwrap().push(c))
            }),
        };
        Preparer::open(self.config(), deps).await.unwrap()
    }

    /// Prepares [`whole_claim`] 3 on a GPU whose MIG mode the driver manages.
    async fn open_managed(&self, mig: Arc<MigRecorder>) -> Arc<Preparer> {
        let catalog = catalog().with_mig_managed(&[GPU]);
        self.open_with(vec![whole_claim(3)], catalog, mig).await.0
    }

    /// Writes claim `n`'s record as an earlier run left it; its path.
    fn record(&self, n: u8, state: EntryState, actions: Vec<Action>) -> std::path::PathBuf {
        let config = self.config();
        let (cp, _) =
            Checkpoint::<ClaimEntry>::open(&config.state_dir, &config.boot_id_file).unwrap();
        let entry = ClaimEntry {
            namespace: "ns".into(),
            name: format!("c{n}"),
            state,
            actions,
            devices: Vec::new(),
            spec: None,
            status: Vec::new(),
            ahead: false,
        };
        let claim = ClaimUid::parse(&uid(n)).unwrap();
        cp.put(claim.clone(), entry).unwrap();
        cp.dir().join(format!("{}.json", claim.as_str()))
    }

    /// Claims' spec files (not the driver's, nor the hidden spares of
    /// removed ones).
    fn cdi_files(&self) -> usize {
        std::fs::read_dir(self.dir.path().join("cdi"))
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        !name.starts_with('.') && name != "gpu.tessera.dev-driver.json"
                    })
                    .count()
            })
            .unwrap_or(0)
    }
}

fn uid(n: u8) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

fn isolated_claim(n: u8, config: serde_json::Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": format!("c{n}"), "namespace": "ns", "uid": uid(n)},
        "spec": {},
        "status": {"allocation": {"devices": {
            "results": [{"request": "share", "driver": DRIVER, "pool": NODE, "device": "gpu-0-isolated",
                         "shareID": "7a0b8c0d-0000-4000-8000-000000000001",
                         "consumedCapacity": {"memory": "8Gi", "cores": "25"}}],
            "config": config,
        }}}
    }))
    .unwrap()
}

fn claim_ref(n: u8) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        name: format!("c{n}"),
        uid: uid(n),
    }
}

#[tokio::test]
async fn isolated_share_gets_mps_limits_from_capacity_tightened_by_config() {
    let f = Fixture::new(false);
    let tighter = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "ShareConfig",
        "processLimits": {"memory": "2Gi"}}}}]);
    let (preparer, _) = f
        .open(vec![
            isolated_claim(1, tighter),
            isolated_claim(2, json!([])),
        ])
        .await;
    let results = preparer.prepare(vec![claim_ref(1), claim_ref(2)]).await;
    for (_, r) in &results {
        assert!(r.is_ok(), "{r:?}");
    }
    let entry = preparer.entry(&ClaimUid::parse(&uid(1)).unwrap()).unwrap();
    assert_eq!(entry.state, EntryState::Completed);
    let env = &entry.spec.as_ref().unwrap().devices[0].container_edits.env;
    for want in [
        format!("NVIDIA_VISIBLE_DEVICES={GPU}"),
        format!("CUDA_MPS_PIPE_DIRECTORY=/run/tessera/mps/{GPU}/pipe"),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M".to_owned(),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25".to_owned(),
    ] {
        assert!(env.contains(&want), "{want} not in {env:?}");
    }
    let data = &entry.status[0].data;
    assert_eq!(data.isolation_level.as_deref(), Some("Isolated"));
    assert_eq!(data.limits.as_ref().unwrap().memory, "2Gi");
    assert_eq!(data.limits.as_ref().unwrap().compute_percent, 25);
    // Claim 2 has no config: the consumed capacity is the limit.
    let entry2 = preparer.entry(&ClaimUid::parse(&uid(2)).unwrap()).unwrap();
    let env2 = &entry2.spec.as_ref().unwrap().devices[0].container_edits.env;
    assert!(env2.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M".to_owned()));

    // Unprepare releases this claim's MPS reference only.
    let un = preparer.unprepare(vec![claim_ref(1)]).await;
    assert!(un[0].1.is_ok());
    assert!(
        f.sharing
            .calls()
            .contains(&format!("release {} {GPU}", uid(1)))
    );
    assert!(
        !f.sharing
            .calls()
            .contains(&format!("release {} {GPU}", uid(2)))
    );
    assert_eq!(f.cdi_files(), 1);
}

#[tokio::test]
async fn failed_side_effect_rolls_back_and_other_claims_proceed() {
    let f = Fixture::new(true);
    let whole: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "c3", "namespace": "ns", "uid": uid(3)},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}}}
    }))
    .unwrap();
    let (preparer, _) = f.open(vec![isolated_claim(1, json!([])), whole]).await;
    let results = preparer.prepare(vec![claim_ref(1), claim_ref(3)]).await;
    let err = results[0].1.as_ref().unwrap_err().to_string();
    assert!(
        err.contains("cannot start MPS") && err.contains("daemon did not start"),
        "{err}"
    );
    assert!(err.starts_with("claim ns/c1 (uid"), "{err}");
    assert!(results[1].1.is_ok(), "{:?}", results[1].1);
    // Rolled back: no entry, no spec, the reference released.
    assert!(preparer.entry(&ClaimUid::parse(&uid(1)).unwrap()).is_none());
    assert_eq!(f.cdi_files(), 1);
    assert!(
        f.sharing
            .calls()
            .contains(&format!("release {} {GPU}", uid(1)))
    );
}

/// One GPU's MIG mode and instance count, as NVML would keep them, and the
/// switches asked for.
#[derive(Default)]
struct MigRecorder(Mutex<(bool, usize, Vec<String>)>);

impl MigRecorder {
    fn new(enabled: bool, instances: usize) -> Arc<Self> {
        Arc::new(MigRecorder(Mutex::new((enabled, instances, Vec::new()))))
    }
    fn switches(&self) -> Vec<String> {
        self.0.lock().unwrap().2.clone()
    }
    fn set_enabled(&self, enabled: bool) {
        self.0.lock().unwrap().0 = enabled;
    }
}

impl MigManager for MigRecorder {
    fn mig_enabled(&self, _gpu: &str) -> Result<bool, HostError> {
        Ok(self.0.lock().unwrap().0)
    }
    fn set_mig_mode(&self, gpu: &str, enabled: bool) -> Result<(), HostError> {
        let mut s = self.0.lock().unwrap();
        s.2.push(format!("{gpu} mig {}", if enabled { "on" } else { "off" }));
        if !enabled && s.1 > 0 {
            return Err(HostError::backend(std::io::Error::other(
                "NVML: in use (a GPU instance exists)",
            )));
        }
        s.0 = enabled;
        Ok(())
    }
    fn has_instances(&self, _gpu: &str) -> Result<bool, HostError> {
        Ok(self.0.lock().unwrap().1 > 0)
    }
    fn check_free(&self, _: &str, _: u32, _: MigPlacement) -> Result<(), HostError> {
        Err(HostError::backend(std::io::Error::other(
            "no MIG devices in this test",
        )))
    }
    fn create(
        &self,
        _: &str,
        _: u32,
        _: MigPlacement,
    ) -> Result<tessera_api::inventory::MigInstance, CreateError> {
        Err(CreateError::NothingMade(HostError::backend(
            std::io::Error::other("no MIG devices in this test"),
        )))
    }
    fn exists(&self, _: &str, _: &crate::state::records::MigRecord) -> Result<bool, HostError> {
        Ok(false)
    }
    fn destroy(
        &self,
        gpu: &str,
        _: u32,
        placement: MigPlacement,
        _: &crate::state::records::MigRecord,
    ) -> Result<(), HostError> {
        self.0
            .lock()
            .unwrap()
            .2
            .push(format!("{gpu} destroy {placement:?}"));
        Ok(())
    }
}

fn whole_claim(n: u8) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": format!("c{n}"), "namespace": "ns", "uid": uid(n)},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}}}
    }))
    .unwrap()
}

/// Waits until `done` holds (what a claim's release settles after the
/// unprepare has answered), for at most 10 s.
async fn settled(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not settled: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_managed_gpu_in_mig_mode_is_switched_off_for_a_whole_gpu_and_held_so() {
    let f = Fixture::new(false);
    let mig = MigRecorder::new(true, 0);
    let preparer = f.open_managed(mig.clone()).await;
    let results = preparer.prepare(vec![claim_ref(3)]).await;
    assert!(results[0].1.is_ok(), "{:?}", results[0].1);
    assert_eq!(mig.switches(), [format!("{GPU} mig off")]);
    let entry = preparer.entry(&ClaimUid::parse(&uid(3)).unwrap()).unwrap();
    assert!(entry.actions.contains(&Action::MigMode {
        gpu_uuid: GPU.into(),
        enabled: false
    }));

    // Someone turns MIG on under the held GPU: not switched back while held.
    mig.set_enabled(true);
    assert!(preparer.settle_mig_modes([GPU]).is_empty());
    assert_eq!(mig.switches().len(), 1, "a held GPU was switched");
    // With the last hold gone the GPU rests with MIG off (settled after
    // the answer).
    let results = preparer.unprepare(vec![claim_ref(3)]).await;
    assert!(results[0].1.is_ok(), "{:?}", results[0].1);
    assert!(
        preparer.entry(&ClaimUid::parse(&uid(3)).unwrap()).is_none(),
        "the record goes before the answer"
    );
    settled("the release settled", || !preparer.settling()).await;
    assert_eq!(
        mig.switches(),
        [format!("{GPU} mig off"), format!("{GPU} mig off")]
    );
}

#[tokio::test]
async fn an_unprepared_spec_goes_after_the_answer_unless_prepared_again() {
    let f = Fixture::new(false);
    let preparer = f.open_managed(MigRecorder::new(false, 0)).await;
    let three = ClaimUid::parse(&uid(3)).unwrap();
    assert!(preparer.prepare(vec![claim_ref(3)]).await[0].1.is_ok());
    assert_eq!(f.cdi_files(), 1);
    assert!(preparer.unprepare(vec![claim_ref(3)]).await[0].1.is_ok());
    assert!(preparer.entry(&three).is_none(), "the record goes first");
    // At the answer, before this test yields to the removal: what a kill
    // now leaves is a record start-up recovery finishes.
    let on_disk = |f: &Fixture| {
        crate::state::checkpoint::read_snapshot::<ClaimEntry>(&f.config().state_dir, None)
            .unwrap()
            .claims
    };
    assert_eq!(on_disk(&f)[&three].state, EntryState::Unpreparing);
    settled("the spec removed", || !preparer.settling()).await;
    assert_eq!(f.cdi_files(), 0);
    assert!(on_disk(&f).is_empty(), "the retired record removed");

    // Prepared again while its spec waits to go: the spec stays with the
    // new record.
    assert!(preparer.prepare(vec![claim_ref(3)]).await[0].1.is_ok());
    assert!(preparer.unprepare(vec![claim_ref(3)]).await[0].1.is_ok());
    assert!(preparer.prepare(vec![claim_ref(3)]).await[0].1.is_ok());
    settled("the spec removal done", || !preparer.settling()).await;
    assert!(preparer.entry(&three).is_some());
    assert_eq!(f.cdi_files(), 1, "the spec of a prepared claim was removed");
}

#[tokio::test]
async fn the_gpus_are_read_again_only_after_they_changed() {
    let f = Fixture::new(false);
    let mig = MigRecorder::new(false, 0);
    let preparer = f.open_managed(mig.clone()).await;
    let took = |f: &Fixture| std::mem::take(&mut *f.changes.lock().unwrap());
    took(&f);

    // MIG already off: the hold is a record, and the claim's one durable
    // write carries it.
    assert!(preparer.prepare(vec![claim_ref(3)]).await[0].1.is_ok());
    assert_eq!(took(&f), [NodeChange::Records]);
    assert!(mig.switches().is_empty());
    let on_disk =
        crate::state::checkpoint::read_snapshot::<ClaimEntry>(&f.config().state_dir, None).unwrap();
    let entry = &on_disk.claims[&ClaimUid::parse(&uid(3)).unwrap()];
    assert_eq!(entry.state, EntryState::Completed);
    assert!(entry.mig_mode_holds().any(|g| g == GPU));
    assert!(preparer.unprepare(vec![claim_ref(3)]).await[0].1.is_ok());
    settled("the release settled", || !preparer.settling()).await;
    assert_eq!(took(&f), [NodeChange::Records]);

    // MIG on: prepare switches it off, a change of the GPUs.
    mig.set_enabled(true);
    assert!(preparer.prepare(vec![claim_ref(3)]).await[0].1.is_ok());
    assert_eq!(took(&f), [NodeChange::Gpus]);
    // Switched on under the hold; the last hold going switches it off,
    // told once.
    mig.set_enabled(true);
    assert!(preparer.unprepare(vec![claim_ref(3)]).await[0].1.is_ok());
    // The record goes with the answer; the switch follows it.
    settled("the release settled", || !preparer.settling()).await;
    assert_eq!(took(&f), [NodeChange::Records, NodeChange::Gpus]);
}

#[tokio::test]
async fn a_managed_gpu_that_cannot_leave_mig_mode_fails_its_claim_alone() {
    let f = Fixture::new(false);
    let preparer = f.open_managed(MigRecorder::new(true, 1)).await;
    let results = preparer.prepare(vec![claim_ref(3)]).await;
    let err = results[0].1.as_ref().unwrap_err().to_string();
    assert!(
        err.contains("cannot prepare device gpu-0") && err.contains("in use"),
        "{err}"
    );
    // Rolled back: nothing recorded, no spec.
    assert!(preparer.entry(&ClaimUid::parse(&uid(3)).unwrap()).is_none());
    assert_eq!(f.cdi_files(), 0);
}

#[tokio::test]
async fn a_gpu_the_driver_does_not_manage_is_never_switched() {
    let f = Fixture::new(false);
    let mig = MigRecorder::new(false, 0);
    let (preparer, _) = f
        .open_with(vec![whole_claim(3)], catalog(), mig.clone())
        .await;
    let results = preparer.prepare(vec![claim_ref(3)]).await;
    assert!(results[0].1.is_ok(), "{:?}", results[0].1);
    preparer.unprepare(vec![claim_ref(3)]).await;
    assert!(mig.switches().is_empty());
}

#[tokio::test]
async fn start_up_rolls_back_started_and_finishes_unpreparing() {
    let f = Fixture::new(false);
    {
        let (cp, _) =
            Checkpoint::<ClaimEntry>::open(&f.config().state_dir, &f.config().boot_id_file)
                .unwrap();
        let mps = vec![Action::Mps {
            gpu_uuid: GPU.into(),
            mig_uuid: None,
            request: Some("gpu".into()),
        }];
        // Claims 8 and 9: whole GPUs' records retired by an unprepare that
        // answered, their files not yet removed; 8 by an earlier version
        // (in its record), 9 by this one (in the records' journal).
        for (n, state, actions) in [
            (5, EntryState::Started, mps.clone()),
            (6, EntryState::Unpreparing, mps),
            (8, EntryState::Unpreparing, Vec::new()),
            (9, EntryState::Completed, Vec::new()),
        ] {
            cp.put(
                ClaimUid::parse(&uid(n)).unwrap(),
                ClaimEntry {
                    namespace: "ns".into(),
                    name: format!("c{n}"),
                    state,
                    actions,
                    devices: Vec::new(),
                    spec: None,
                    status: Vec::new(),
                    ahead: false,
                },
            )
            .unwrap();
        }
        cp.retire(&ClaimUid::parse(&uid(9)).unwrap()).unwrap();
        // Specs for claims 6, 8 and 9, and an orphan no entry knows.
        let specs = SpecDir::new(f.config().cdi_dir);
        let spec = crate::cdi::Spec::for_claim(Vec::new());
        for n in [6, 8, 9] {
            specs
                .write(&ClaimUid::parse(&uid(n)).unwrap(), &spec)
                .unwrap();
        }
        specs
            .write(&ClaimUid::parse(&uid(7)).unwrap(), &spec)
            .unwrap();
    }
    let (preparer, recovery) = f.open(Vec::new()).await;
    assert_eq!(
        recovery.rolled_back,
        vec![ClaimUid::parse(&uid(5)).unwrap()]
    );
    assert_eq!(
        recovery.unprepared,
        [6, 8, 9].map(|n| ClaimUid::parse(&uid(n)).unwrap())
    );
    assert_eq!(
        recovery.orphans_removed,
        vec![ClaimUid::parse(&uid(7)).unwrap()]
    );
    assert!(recovery.problems.is_empty(), "{:?}", recovery.problems);
    assert_eq!(f.cdi_files(), 0);
    assert!(preparer.entry(&ClaimUid::parse(&uid(5)).unwrap()).is_none());
    let calls = f.sharing.calls();
    assert!(
        calls.contains(&format!("release {} {GPU}", uid(5))),
        "{calls:?}"
    );
    assert!(
        calls.contains(&format!("release {} {GPU}", uid(6))),
        "{calls:?}"
    );
}

/// A prepare interrupted between recording that it would create a MIG
/// device and recording what NVML made: whatever sits at the placement now
/// may be another actor's, so start-up destroys nothing there.
#[tokio::test]
async fn an_unproven_mig_device_is_left_alone_at_start_up() {
    let f = Fixture::new(false);
    let intent = Action::MigCreate {
        gpu_uuid: GPU.into(),
        profile_id: 19,
        placement: MigPlacement { start: 3, size: 1 },
        instance: None,
    };
    f.record(5, EntryState::Started, vec![intent]);
    // MigRecorder's check_free always finds the placement taken.
    let mig = MigRecorder::new(true, 1);
    let (preparer, recovery) = f.open_with(Vec::new(), catalog(), mig.clone()).await;
    assert_eq!(
        recovery.rolled_back,
        vec![ClaimUid::parse(&uid(5)).unwrap()]
    );
    assert!(preparer.entry(&ClaimUid::parse(&uid(5)).unwrap()).is_none());
    let destroyed: Vec<_> = (mig.switches().into_iter())
        .filter(|c| c.contains("destroy"))
        .collect();
    assert!(destroyed.is_empty(), "destroyed {destroyed:?}");
}

/// A claim whose record became unreadable is not forgotten: its unprepare
/// stops every daemon of the claim and undoes what the salvaged entry
/// names, then removes its spec.
#[tokio::test]
async fn unprepare_of_a_claim_whose_record_was_lost_releases_what_it_held() {
    let f = Fixture::new(false);
    let lost = ClaimUid::parse(&uid(5)).unwrap();
    let daemon = Action::Mps {
        gpu_uuid: GPU.into(),
        mig_uuid: None,
        request: Some("gpu".into()),
    };
    let path = f.record(5, EntryState::Completed, vec![daemon]);
    let spec = crate::cdi::Spec::for_claim(Vec::new());
    SpecDir::new(f.config().cdi_dir)
        .write(&lost, &spec)
        .unwrap();
    // A flipped byte that leaves the entry decodable: its checksum fails,
    // and what it names is still a hint of what to release.
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replacen("c5", "c6", 1)).unwrap();
    let (preparer, recovery) = f.open(Vec::new()).await;
    assert!(preparer.entry(&lost).is_none());
    assert!(preparer.lost_claims().may_hold(&lost));
    // Not an orphan: its Pod may run.
    assert!(recovery.orphans_removed.is_empty());
    assert_eq!(f.cdi_files(), 1);
    assert!(f.sharing.calls().is_empty(), "{:?}", f.sharing.calls());

    let results = preparer.unprepare(vec![claim_ref(5)]).await;
    assert!(results[0].1.is_ok(), "{:?}", results[0].1);
    let calls = f.sharing.calls();
    assert!(
        calls.contains(&format!("release every daemon of {lost}")),
        "{calls:?}"
    );
    assert!(
        calls.contains(&format!("release {lost} {GPU}")),
        "{calls:?}"
    );
    assert_eq!(f.cdi_files(), 0);
    assert!(!preparer.lost_claims().may_hold(&lost));
}

/// Makes claim `n`'s record fail its checksum, its entry text changed by
/// `damage`.
fn damage_record(path: &std::path::Path, damage: impl Fn(String) -> String) {
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let text = damage(record["entry"].as_str().unwrap().to_owned());
    record["entry"] = json!(text);
    std::fs::write(path, record.to_string()).unwrap();
}

/// Rewrites claim `n`'s record as a newer version would, valid, its entry
/// changed by `newer`.
fn rewrite_as_newer(path: &std::path::Path, newer: impl Fn(&mut serde_json::Value)) {
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let mut entry: serde_json::Value =
        serde_json::from_str(record["entry"].as_str().unwrap()).unwrap();
    newer(&mut entry);
    let text = entry.to_string();
    record["crc32"] = json!(crc32fast::hash(text.as_bytes()));
    record["entry"] = json!(text);
    std::fs::write(path, record.to_string()).unwrap();
}

fn reasons(preparer: &Preparer) -> Vec<&'static str> {
    (preparer.reported.lock().unwrap().iter())
        .map(|r| r.reason)
        .collect()
}

/// A record damaged beyond a whole decode still names what it created:
/// that goes at unprepare, and the operator hears that more may remain.
#[tokio::test]
async fn an_unsalvageable_record_still_destroys_the_mig_device_it_names() {
    let f = Fixture::new(false);
    let created = Action::MigCreate {
        gpu_uuid: GPU.into(),
        profile_id: 19,
        placement: MigPlacement { start: 3, size: 1 },
        instance: Some(crate::state::records::MigRecord {
            gpu_instance_id: 5,
            compute_instance_id: 0,
            mig_uuid: "MIG-5".into(),
        }),
    };
    let path = f.record(5, EntryState::Completed, vec![created]);
    damage_record(&path, |t| t.replacen("Completed", "Compl", 1));
    // Nothing of claim 6's entry decodes.
    let path = f.record(6, EntryState::Completed, Vec::new());
    damage_record(&path, |_| "{\"namesp".into());
    let mig = MigRecorder::new(true, 1);
    let (preparer, _) = f.open_with(Vec::new(), catalog(), mig.clone()).await;
    let lost = preparer.lost_claims();
    assert!(lost.may_hold(&ClaimUid::parse(&uid(5)).unwrap()));

    let results = preparer.unprepare(vec![claim_ref(5), claim_ref(6)]).await;
    assert!(results.iter().all(|(_, r)| r.is_ok()), "{results:?}");
    let destroyed: Vec<_> = (mig.switches().into_iter())
        .filter(|c| c.contains("destroy"))
        .collect();
    assert_eq!(
        destroyed,
        [format!(
            "{GPU} destroy MigPlacement {{ start: 3, size: 1 }}"
        )]
    );
    assert_eq!(
        reasons(&preparer),
        ["LostClaimPartlyReleased", "LostClaimPartlyReleased"]
    );
    assert!(preparer.lost_claims().claims.is_empty());
}

/// A lost claim's time slice holds the GPU's slice like a record's does.
#[tokio::test]
async fn the_time_slice_stays_while_a_lost_claim_holds_it() {
    let f = Fixture::new(false);
    let slice = || {
        vec![Action::TimeSlice {
            gpu_uuid: GPU.into(),
        }]
    };
    let path = f.record(5, EntryState::Completed, slice());
    damage_record(&path, |t| t.replacen("c5", "c6", 1));
    f.record(7, EntryState::Completed, slice());
    let (preparer, _) = f.open(Vec::new()).await;
    let reset = format!("reset timeslice {GPU}");

    let results = preparer.unprepare(vec![claim_ref(7)]).await;
    assert!(results[0].1.is_ok(), "{:?}", results[0].1);
    assert!(
        !f.sharing.calls().contains(&reset),
        "{:?}",
        f.sharing.calls()
    );
    let results = preparer.unprepare(vec![claim_ref(5)]).await;
    assert!(results[0].1.is_ok(), "{:?}", results[0].1);
    assert!(
        f.sharing.calls().contains(&reset),
        "{:?}",
        f.sharing.calls()
    );
}

/// After a rollback, a record with an action kind and a field this
/// version does not know keeps its claim prepared (not lost, its spec
/// kept); its unprepare undoes what is known and says what is not.
#[tokio::test]
async fn a_newer_versions_record_keeps_its_claim_with_what_is_known() {
    let f = Fixture::new(false);
    let daemon = Action::Mps {
        gpu_uuid: GPU.into(),
        mig_uuid: None,
        request: Some("gpu".into()),
    };
    let path = f.record(5, EntryState::Completed, vec![daemon]);
    rewrite_as_newer(&path, |entry| {
        entry["actions"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "gpuPartition", "gpuUuid": GPU}));
        entry["priority"] = json!("high");
    });
    let claim = ClaimUid::parse(&uid(5)).unwrap();
    let spec = crate::cdi::Spec::for_claim(Vec::new());
    SpecDir::new(f.config().cdi_dir)
        .write(&claim, &spec)
        .unwrap();
    let (preparer, recovery) = f.open(Vec::new()).await;
    assert_eq!(
        recovery.outcome,
        crate::state::checkpoint::LoadOutcome::Restored { claims: 1 }
    );
    assert!(preparer.entry(&claim).is_some());
    assert!(!preparer.lost_claims().may_hold(&claim));
    assert_eq!(f.cdi_files(), 1, "its spec is kept");

    let results = preparer.unprepare(vec![claim_ref(5)]).await;
    assert!(results[0].1.is_ok(), "{:?}", results[0].1);
    assert!(
        f.sharing
            .calls()
            .contains(&format!("release {claim} {GPU}"))
    );
    assert_eq!(reasons(&preparer), ["NewerRecordFieldsLeft"]);
    let reported = preparer.reported.lock().unwrap()[0].message.clone();
    assert!(
        reported.contains("entry.actions (1 of 2 items)") && reported.contains("entry.priority"),
        "{reported}"
    );
}

#[test]
fn fuzz_seed_is_a_valid_checkpoint() {
    let seed = include_bytes!("../../fuzz/seeds/two_claims.json");
    let (boot, entries) = crate::state::checkpoint::decode_legacy::<ClaimEntry>(seed).unwrap();
    assert_eq!(boot, "boot-a");
    assert_eq!(entries.len(), 2);
    let first = entries.values().next().unwrap();
    assert_eq!(first.state, EntryState::Completed);
    assert_eq!(
        first.actions[1],
        Action::MigCreate {
            gpu_uuid: "GPU-1".into(),
            profile_id: 9,
            placement: MigPlacement { start: 4, size: 4 },
            instance: None,
        }
    );
    fuzz_decode_checkpoint(seed);
    fuzz_decode_checkpoint(&seed[..seed.len() / 2]);
}

#[test]
fn checkpoint_entries_never_panic_on_mutated_input() {
    // What the fuzz target does, deterministically and briefly: byte flips
    // and truncations of a real checkpoint, with a fixed checksum so the
    // mutated entries reach the entry decoder.
    let seed = include_bytes!("../../fuzz/seeds/two_claims.json");
    let envelope: serde_json::Value = serde_json::from_slice(seed).unwrap();
    let claims = envelope["claims"].as_str().unwrap().as_bytes().to_vec();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..3000 {
        let mut text = claims.clone();
        for _ in 0..(next() % 3 + 1) {
            let i = (next() as usize) % text.len();
            text[i] = b"{}[]\",:0aZ\\"[(next() % 11) as usize];
        }
        text.truncate(text.len() - (next() as usize % 8).min(text.len()));
        let Ok(text) = String::from_utf8(text) else {
            continue;
        };
        let file = json!({"version": 1, "bootId": "b", "crc32": crc32fast::hash(text.as_bytes()), "claims": text});
        fuzz_decode_checkpoint(file.to_string().as_bytes());
    }
}

// ---------------------------------------------------------------------------
// Time slices through the driver root's `nvidia-smi` (the simulated one).

const SHARED_DEVICE: &str = "gpu-0-shared";

fn shared_catalog() -> Catalog {
    catalog_with_share(
        SHARED_DEVICE,
        DeviceKind::Share {
            level: IsolationLevel::Shared,
            provider: None,
            time_slice: Some(tessera_controller::model::policy::TimeSlice::Long),
        },
    )
}

fn shared_claim(n: u8) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": format!("c{n}"), "namespace": "ns", "uid": uid(n)},
        "spec": {},
        "status": {"allocation": {"devices": {
            "results": [{"request": "share", "driver": DRIVER, "pool": NODE, "device": SHARED_DEVICE,
                         "shareID": format!("7a0b8c0d-0000-4000-8000-0000000000{n:02x}"),
                         "consumedCapacity": {"memory": "8Gi", "cores": "25"}}],
        }}}
    }))
    .unwrap()
}

fn time_slicing_claim(n: u8, interval: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": format!("c{n}"), "namespace": "ns", "uid": uid(n)},
        "spec": {},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}],
            "config": [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}}}],
        }}}
    }))
    .unwrap()
}

impl Fixture {
    /// A fixture whose time-slice calls run `<driver root>/usr/bin/nvidia-smi`;
    /// with `install`, that is the stand-in on a simulated H100 node whose
    /// first GPU is [`GPU`].
    fn with_smi(install: bool) -> Self {
        let mut f = Fixture::new(false);
        let root = f.dir.path().join("root");
        f.sharing = Arc::new(Recorder {
            time_slicer: Some(NvidiaSmiTimeSlice::new(&root)),
            ..Default::default()
        });
        if install {
            let smi = tessera_test_kit::artifacts::fake_nvidia_smi();
            let lib = tessera_test_kit::artifacts::fake_nvml_lib();
            let topologies = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fake-nvml/topologies/h100x8.yaml");
            let topology = std::fs::read_to_string(topologies)
                .unwrap()
                .replace("GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f", GPU);
            let dir = f.dir.path();
            std::fs::write(dir.join("topology.yaml"), topology).unwrap();
            std::fs::create_dir_all(dir.join("lib")).unwrap();
            std::os::unix::fs::symlink(lib, dir.join("lib/libnvidia-ml.so.1")).unwrap();
            std::fs::create_dir_all(root.join("usr/bin")).unwrap();
            let tool = root.join("usr/bin/nvidia-smi");
            std::fs::write(
                &tool,
                format!(
                    "#!/bin/sh\nLD_LIBRARY_PATH={d}/lib TESSERA_FAKE_NVML_TOPOLOGY={d}/topology.yaml \
                     TESSERA_FAKE_NVML_STATE={d}/machine.state exec {smi} \"$@\"\n",
                    d = dir.display(),
                    smi = smi.display()
                ),
            )
            .unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        f
    }

    /// The simulated GPU's time slice, read back with the stand-in.
    fn time_slice(&self) -> String {
        let out = std::process::Command::new(self.dir.path().join("root/usr/bin/nvidia-smi"))
            .args(["compute-policy", "-i", GPU, "-l"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        text.lines()
            .find_map(|l| l.trim().strip_prefix("Timeslice"))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no time slice in {text}"))
    }
}

#[tokio::test]
async fn shared_shares_set_the_policy_time_slice_until_the_last_one_goes() {
    let f = Fixture::with_smi(true);
    let (preparer, _) = f
        .open_with(
            vec![shared_claim(1), shared_claim(2)],
            shared_catalog(),
            Arc::new(Unsupported),
        )
        .await;
    assert_eq!(f.time_slice(), "0 (Default)");
    let r = preparer.prepare(vec![claim_ref(1)]).await;
    assert!(r[0].1.is_ok(), "{:?}", r[0].1);
    assert_eq!(f.time_slice(), "3 (Long)");
    let entry = preparer.entry(&ClaimUid::parse(&uid(1)).unwrap()).unwrap();
    assert_eq!(
        entry.actions,
        vec![Action::TimeSlice {
            gpu_uuid: GPU.into()
        }]
    );
    assert_eq!(entry.status[0].data.time_slice.as_deref(), Some("Long"));
    let r = preparer.prepare(vec![claim_ref(2)]).await;
    assert!(r[0].1.is_ok(), "{:?}", r[0].1);

    // The first to go leaves the slice to the other.
    let un = preparer.unprepare(vec![claim_ref(1)]).await;
    assert!(un[0].1.is_ok(), "{:?}", un[0].1);
    assert_eq!(f.time_slice(), "3 (Long)");
    assert!(
        !f.sharing
            .calls()
            .iter()
            .any(|c| c.starts_with("reset timeslice"))
    );
    // The last one resets it.
    let un = preparer.unprepare(vec![claim_ref(2)]).await;
    assert!(un[0].1.is_ok(), "{:?}", un[0].1);
    assert_eq!(f.time_slice(), "0 (Default)");
    assert!(
        f.sharing
            .calls()
            .contains(&format!("reset timeslice {GPU}"))
    );
}

#[tokio::test]
async fn time_slicing_config_sets_a_whole_gpus_slice_and_start_up_rolls_it_back() {
    let f = Fixture::with_smi(true);
    let claims = vec![time_slicing_claim(3, "Medium")];
    let (preparer, _) = f
        .open_with(claims.clone(), shared_catalog(), Arc::new(Unsupported))
        .await;
    let r = preparer.prepare(vec![claim_ref(3)]).await;
    assert!(r[0].1.is_ok(), "{:?}", r[0].1);
    assert_eq!(f.time_slice(), "2 (Medium)");
    let entry = preparer.entry(&ClaimUid::parse(&uid(3)).unwrap()).unwrap();
    assert_eq!(entry.status[0].data.sharing.as_deref(), Some("TimeSlicing"));
    assert_eq!(entry.status[0].data.time_slice.as_deref(), Some("Medium"));

    // A crash after the slice was set and before prepare completed: the
    // recorded action is undone at start-up.
    let mut started = entry.clone();
    started.state = EntryState::Started;
    preparer
        .checkpoint
        .put(ClaimUid::parse(&uid(3)).unwrap(), started)
        .unwrap();
    drop(preparer);
    let (preparer, recovery) = f
        .open_with(claims, shared_catalog(), Arc::new(Unsupported))
        .await;
    assert_eq!(recovery.rolled_back.len(), 1, "{recovery:?}");
    assert!(preparer.entry(&ClaimUid::parse(&uid(3)).unwrap()).is_none());
    assert_eq!(f.time_slice(), "0 (Default)");
}

#[tokio::test]
async fn a_missing_nvidia_smi_is_a_per_claim_error() {
    let f = Fixture::with_smi(false);
    let (preparer, _) = f
        .open_with(
            vec![shared_claim(1), time_slicing_claim(3, "Short")],
            shared_catalog(),
            Arc::new(Unsupported),
        )
        .await;
    let results = preparer.prepare(vec![claim_ref(1)]).await;
    let err = results[0].1.as_ref().unwrap_err().to_string();
    for want in [
        "claim ns/c1",
        &format!("cannot set the time slice of GPU {GPU}"),
        "usr/bin/nvidia-smi does not exist",
        "fix:",
    ] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }
    // Rolled back, nothing left.
    assert!(preparer.entry(&ClaimUid::parse(&uid(1)).unwrap()).is_none());
    assert_eq!(f.cdi_files(), 0);
    let results = preparer.prepare(vec![claim_ref(3)]).await;
    assert!(results[0].1.is_err());
}

/// The driver's spec is there once the preparer opens, and a prepare after
/// it was removed (a cleared CDI directory) writes it again: every claim's
/// devices reference it.
#[tokio::test]
async fn the_driver_spec_is_written_at_open_and_after_it_went() {
    let f = Fixture::new(false);
    let preparer = f.open_managed(MigRecorder::new(false, 0)).await;
    let driver = f.dir.path().join("cdi/gpu.tessera.dev-driver.json");
    let spec: crate::cdi::Spec = serde_json::from_slice(&std::fs::read(&driver).unwrap()).unwrap();
    assert_eq!(spec.kind, "gpu.tessera.dev/driver");
    std::fs::remove_file(&driver).unwrap();
    let answer = preparer
        .prepare(vec![claim_ref(3)])
        .await
        .remove(0)
        .1
        .unwrap();
    assert!(driver.exists(), "prepare left the driver spec missing");
    assert!(
        answer
            .iter()
            .all(|d| d.cdi_device_ids.last().map(String::as_str)
                == Some("gpu.tessera.dev/driver=cuda")),
        "{answer:?}"
    );
}
