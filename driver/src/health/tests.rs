use super::*;
use crate::kubelet::health::HealthService;
use h::dra_resource_health_server::DraResourceHealth as _;
use tessera_api::inventory::Inventory;
use tessera_api::kubelet::health::v1alpha1 as h;
use tessera_controller::model::{DeviceKind, DeviceRef};
use tonic::Request;

const GPU0: &str = "GPU-0";
const GPU1: &str = "GPU-1";

#[test]
fn xids_are_classified() {
    let policy = XidPolicy::default();
    for x in [48, 63, 64, 74, 79, 92, 94, 95, 119, 120] {
        assert_eq!(policy.classify(Some(x)), XidClass::Fatal, "XID {x}");
    }
    for x in [13, 31, 43, 45, 68] {
        assert_eq!(policy.classify(Some(x)), XidClass::Benign, "XID {x}");
    }
    assert_eq!(policy.classify(Some(8)), XidClass::Unlisted);
    assert_eq!(policy.classify(None), XidClass::Unlisted);
    // The operator's list replaces the default; fatal stays fatal.
    let policy = XidPolicy::new([8, 79]);
    assert_eq!(policy.classify(Some(8)), XidClass::Benign);
    assert_eq!(policy.classify(Some(13)), XidClass::Unlisted);
    assert_eq!(policy.classify(Some(79)), XidClass::Fatal);
}

#[test]
fn transitions_and_taints_follow_the_health() {
    let t0 = UNIX_EPOCH + Duration::from_secs(1_000);
    let tracker = HealthTracker::new(XidPolicy::default(), Some(Duration::from_secs(30)));
    tracker.watching(GPU0, t0);
    tracker.not_watched(GPU1, "no events".into(), t0);
    let start = tracker.current();
    assert_eq!(
        transitions(&HealthMap::new(), &start),
        [Transition::NotWatched {
            gpu: GPU1.into(),
            reason: "no events".into()
        }]
    );
    assert!(unhealthy_gpus(&start).is_empty());

    tracker.xid(GPU0, Some(79), t0 + Duration::from_secs(5));
    let sick = tracker.current();
    assert_eq!(
        transitions(&start, &sick),
        [Transition::Unhealthy {
            gpu: GPU0.into(),
            xid: 79
        }]
    );
    let taints = unhealthy_gpus(&sick);
    assert_eq!(taints[GPU0].reason, "xid-79");
    assert_eq!(taints[GPU0].since, 1_005);
    // The same fatal XID again: no new transition, the taint keeps its
    // time (no slice rewrite), the recovery clock restarts.
    tracker.xid(GPU0, Some(79), t0 + Duration::from_secs(20));
    let again = tracker.current();
    assert!(transitions(&sick, &again).is_empty());
    assert_eq!(unhealthy_gpus(&again), taints);
    assert!(tracker.recover(t0 + Duration::from_secs(40)).is_empty());
    assert_eq!(
        tracker.recover(t0 + Duration::from_secs(50)),
        vec![GPU0.to_owned()]
    );
    let healthy = tracker.current();
    assert_eq!(
        transitions(&again, &healthy),
        [Transition::Recovered { gpu: GPU0.into() }]
    );
    assert!(unhealthy_gpus(&healthy).is_empty());
    let HealthEvent {
        warning,
        reason,
        action,
        note: message,
    } = event(
        &Transition::Unhealthy {
            gpu: GPU0.into(),
            xid: 79,
        },
        Some(&catalog()),
        "gpu.tessera.dev/unhealthy",
        None,
    );
    assert!(warning);
    assert_eq!(reason, "GpuUnhealthy");
    assert_eq!(action, "Taint GPU-0 XID 79");
    assert!(
        message.starts_with("GPU gpu-0 (GPU-0): XID 79 (GPU has fallen off the bus)")
            && message.contains("gpu.tessera.dev/unhealthy=xid-79:NoSchedule"),
        "{message}"
    );
    assert_eq!(tracker.xid_counts()[&(GPU0.to_owned(), 79)], 2);
}

#[test]
fn fatal_xids_make_the_gpu_unhealthy_until_recovery() {
    let t0 = UNIX_EPOCH + Duration::from_secs(1_000);
    let tracker = HealthTracker::new(XidPolicy::default(), Some(Duration::from_secs(30)));
    tracker.watching(GPU0, t0);
    tracker.watching(GPU1, t0);
    assert_eq!(tracker.xid(GPU0, Some(13), t0), XidClass::Benign);
    assert_eq!(tracker.current()[GPU0].health, Health::Healthy);
    assert_eq!(tracker.xid(GPU0, Some(79), t0), XidClass::Fatal);
    assert_eq!(
        tracker.current()[GPU0].health,
        Health::Unhealthy { xid: 79 }
    );
    assert_eq!(tracker.current()[GPU1].health, Health::Healthy);
    assert!(tracker.recover(t0 + Duration::from_secs(29)).is_empty());
    assert_eq!(
        tracker.recover(t0 + Duration::from_secs(30)),
        vec![GPU0.to_owned()]
    );
    assert_eq!(tracker.current()[GPU0].health, Health::Healthy);

    // Without a recovery time it stays Unhealthy.
    let tracker = HealthTracker::new(XidPolicy::default(), None);
    tracker.watching(GPU0, t0);
    tracker.xid(GPU0, Some(48), t0);
    assert!(
        tracker
            .recover(t0 + Duration::from_secs(1 << 30))
            .is_empty()
    );
    assert_eq!(
        tracker.current()[GPU0].health,
        Health::Unhealthy { xid: 48 }
    );
}

fn catalog() -> Catalog {
    let device = |gpu: &str, kind| DeviceRef {
        gpu_uuid: gpu.into(),
        gpu_index: 0,
        kind,
    };
    let devices = [
        ("gpu-0".to_owned(), device(GPU0, DeviceKind::Whole)),
        (
            "gpu-0-shared".to_owned(),
            device(
                GPU0,
                DeviceKind::Share {
                    level: tessera_controller::model::IsolationLevel::Shared,
                    provider: None,
                    time_slice: None,
                },
            ),
        ),
        ("gpu-1".to_owned(), device(GPU1, DeviceKind::Whole)),
        ("gpu-2".to_owned(), device("GPU-2", DeviceKind::Whole)),
    ]
    .into_iter()
    .collect();
    Catalog::new(Inventory::default(), devices)
}

#[tokio::test]
async fn the_stream_starts_with_every_device_and_follows_changes() {
    let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let tracker = Arc::new(HealthTracker::new(XidPolicy::default(), None));
    tracker.watching(GPU0, at);
    tracker.watching(GPU1, at);
    tracker.xid(GPU1, Some(79), at);
    let service = HealthService::new(
        "node-a".into(),
        Arc::new(DeviceCatalog::fixed(catalog())),
        tracker.clone(),
    );
    let mut stream = service
        .node_watch_resources(Request::new(h::NodeWatchResourcesRequest {}))
        .await
        .unwrap()
        .into_inner();
    use futures::StreamExt as _;
    let first = stream.next().await.unwrap().unwrap();
    let seen: Vec<(String, h::HealthStatus)> = first
        .devices
        .iter()
        .map(|d| {
            let id = d.device.as_ref().unwrap();
            assert_eq!(id.pool_name, "node-a");
            assert_eq!(d.health_check_timeout_seconds, HEALTH_CHECK_TIMEOUT_SECONDS);
            (id.device_name.clone(), d.health())
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("gpu-0".to_owned(), h::HealthStatus::Healthy),
            ("gpu-0-shared".to_owned(), h::HealthStatus::Healthy),
            ("gpu-1".to_owned(), h::HealthStatus::Unhealthy),
            // A GPU the monitor does not know.
            ("gpu-2".to_owned(), h::HealthStatus::Unknown),
        ]
    );
    let gpu1 = &first.devices[2];
    assert_eq!(gpu1.last_updated_time, 1_700_000_000);
    assert!(gpu1.message.contains("XID 79"), "{}", gpu1.message);

    // A change is sent at once: all of GPU 0's devices turn Unhealthy.
    tracker.xid(GPU0, Some(48), SystemTime::now());
    let next = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("an update before the resend period")
        .unwrap()
        .unwrap();
    let unhealthy: Vec<&str> = next
        .devices
        .iter()
        .filter(|d| d.health() == h::HealthStatus::Unhealthy)
        .map(|d| d.device.as_ref().unwrap().device_name.as_str())
        .collect();
    assert_eq!(unhealthy, ["gpu-0", "gpu-0-shared", "gpu-1"]);
}
