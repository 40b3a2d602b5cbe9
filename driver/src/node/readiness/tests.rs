use super::*;
use crate::node::config::HostCgroupPlace;
use crate::node::standby::Takeover;
use crate::state::catalog::Catalog;

fn checks(nvml: Result<&str, &str>) -> PreFlight {
    PreFlight {
        nvml: nvml.map(str::to_owned).map_err(|reason| {
            CheckFailed::NvmlLoad(Arc::new(discovery::Error::LibraryNotFound {
                library: "libnvidia-ml.so.1".into(),
                reason: reason.into(),
            }))
        }),
        api_server: Ok("the API server (v1.37.2) answers".into()),
        records: Ok("0 prepared-claim record(s) decode".into()),
        placement: Ok("MPS daemons stay in this process's cgroup".into()),
    }
}

/// A standby that could not place MPS daemons in the host cgroup is
/// not Ready: taking over, it would exit at its start.
#[test]
fn a_standby_that_cannot_place_daemons_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let takeover = |cgroup: Option<HostCgroupPlace>| Takeover {
        state_dir: dir.path().join("state"),
        boot_id_file: dir.path().join("boot_id"),
        mps_cgroup: cgroup,
    };
    assert!(takeover(None).check_placement().is_ok());
    // A directory that is no cgroup filesystem.
    let r = Readiness::default();
    let mut preflight = checks(Ok("NVML 580 lists 2 GPUs"));
    preflight.placement = takeover(Some(HostCgroupPlace {
        fs: dir.path().into(),
        name: "tessera-mps".into(),
    }))
    .check_placement();
    r.set(Phase::Standby(Some(preflight)));
    let answer = r.ready();
    assert!(!answer.ok, "{answer:?}");
    assert!(
        answer.text.contains("cannot place MPS daemons"),
        "{answer:?}"
    );
}

/// A standby whose version cannot decode the records it would take
/// over is not Ready: taking over would set their claims aside.
#[test]
fn a_standby_that_cannot_decode_the_records_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let boot_id_file = dir.path().join("boot_id");
    std::fs::write(&boot_id_file, "boot-a\n").unwrap();
    let takeover = Takeover {
        state_dir: dir.path().join("state"),
        boot_id_file,
        mps_cgroup: None,
    };
    let records = dir
        .path()
        .join("state")
        .join(crate::state::checkpoint::RECORDS_DIR);
    std::fs::create_dir_all(&records).unwrap();
    let record = records.join("0b9d2a3e-5c4f-4a7b-9e0d-1f2a3b4c5d6e.json");
    std::fs::write(
        &record,
        r#"{"version":3,"bootId":"boot-a","crc32":0,"entry":"{}"}"#,
    )
    .unwrap();

    let r = Readiness::default();
    let mut preflight = checks(Ok("NVML 580 lists 2 GPUs"));
    preflight.records = takeover.check_records();
    r.set(Phase::Standby(Some(preflight)));
    let answer = r.ready();
    assert!(!answer.ok, "{answer:?}");
    assert!(
        answer.text.contains("version 3 is not supported"),
        "{answer:?}"
    );
    assert!(record.exists(), "read only: nothing moved aside");

    std::fs::remove_file(&record).unwrap();
    assert!(takeover.check_records().is_ok());
}

#[test]
fn a_standby_is_ready_only_when_its_checks_pass() {
    let r = Readiness::default();
    assert!(!r.ready().ok, "starting");
    r.set(Phase::Standby(None));
    assert!(!r.ready().ok, "not checked yet");
    r.set(Phase::Standby(Some(checks(Err(
        "cannot load the NVML library",
    )))));
    let answer = r.ready();
    assert!(!answer.ok);
    assert!(
        answer.text.contains("cannot load the NVML library"),
        "{answer:?}"
    );
    assert!(r.live().ok, "a standby is never killed for waiting");
    r.set(Phase::Standby(Some(checks(Ok("NVML 580 lists 2 GPUs")))));
    let answer = r.ready();
    assert!(answer.ok);
    assert!(
        answer.text.starts_with("standby: ready to take over"),
        "{answer:?}"
    );
}

#[test]
fn an_active_instance_is_ready_once_its_devices_are_known() {
    let r = Readiness::default();
    let catalog = Arc::new(DeviceCatalog::awaiting_model());
    r.set(Phase::Active(catalog.clone()));
    assert!(!r.ready().ok);
    assert!(r.live().ok);
    catalog.set(Catalog::new(Default::default(), Default::default()));
    assert!(r.ready().ok);
}

#[tokio::test]
async fn answers_over_its_socket_and_replaces_only_a_stale_one() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/health.sock");
    // A previous run's socket, nobody listening.
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let readiness = Arc::new(Readiness::default());
    serve(&socket, readiness.clone()).await.unwrap();
    let ask = |path: &'static str| {
        let socket = socket.clone();
        tokio::task::spawn_blocking(move || ask(&socket, path, Duration::from_secs(5)))
    };
    assert_eq!(ask("/readyz").await.unwrap().unwrap().0, 503);
    assert_eq!(ask("/livez").await.unwrap().unwrap().0, 200);
    readiness.set(Phase::Standby(Some(checks(Ok("NVML lists 1 GPUs")))));
    let (code, body) = ask("/readyz").await.unwrap().unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("standby: ready to take over"), "{body}");
    assert_eq!(ask("/nothing").await.unwrap().unwrap().0, 404);

    // Status serves once registered and published, not before.
    let status = |body: &str| serde_json::from_str::<NodeStatus>(body.trim()).unwrap();
    let (code, body) = ask("/status").await.unwrap().unwrap();
    assert_eq!((code, status(&body).phase.as_str()), (503, "standby"));
    readiness.set(Phase::Active(Arc::new(DeviceCatalog::awaiting_model())));
    readiness.set_published(3);
    let (code, body) = ask("/status").await.unwrap().unwrap();
    assert_eq!(code, 503, "not registered yet: {body}");
    readiness.set_registered(true);
    readiness.set_metrics_address("127.0.0.1:9400".parse().unwrap());
    readiness.set_secure_metrics_address("10.0.0.7:9401".parse().unwrap());
    let (code, body) = ask("/status").await.unwrap().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        status(&body),
        NodeStatus {
            phase: "active".into(),
            ready: false,
            registered: true,
            published_generation: Some(3),
            metrics_address: Some("127.0.0.1:9400".parse().unwrap()),
            secure_metrics_address: Some("10.0.0.7:9401".parse().unwrap()),
        }
    );
    readiness.set_registered(false);
    assert_eq!(ask("/status").await.unwrap().unwrap().0, 503, "refused");

    // A second instance on the same socket is refused, not let in.
    let err = serve(&socket, Arc::new(Readiness::default()))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("emptyDir"), "{err:#}");
}
