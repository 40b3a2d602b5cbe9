use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tessera_api::inventory::{Gpu, Inventory, Mig};
use tokio::sync::watch;

use super::*;
use crate::model::{SliceModel, desired_slices};

fn gpu(uuid: &str, pci: &str) -> Gpu {
    Gpu {
        uuid: uuid.into(),
        product_name: "NVIDIA L4".into(),
        brand: "nvidia".into(),
        architecture: "ada".into(),
        cuda_compute_capability: "8.9".into(),
        pci_bus_id: pci.into(),
        memory_bytes: 23034 * 1024 * 1024,
        multiprocessors: 58,
        minor: 0,
        mig: Mig::NotSupported,
    }
}

fn inventory(gpus: Vec<Gpu>) -> Inventory {
    Inventory {
        driver_version: "550.90.07".into(),
        cuda_driver_version: "12.4".into(),
        gpus,
    }
}

const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

#[test]
fn gpu_numbers_are_read_back_from_published_slices() {
    let inv = inventory(vec![gpu(A, "0000:01:00.0"), gpu(B, "0000:02:00.0")]);
    for caps in [Capabilities::full(), Capabilities::legacy()] {
        let slices = desired_slices(
            &inv,
            &NodePolicy::default(),
            caps,
            "node-a",
            &DriverName::default(),
        )
        .unwrap();
        let indices = indices_from_slices(&slices);
        assert_eq!(indices.get(A), Some(&0), "{caps:?}");
        assert_eq!(indices.get(B), Some(&1), "{caps:?}");
        assert_eq!(indices.len(), 2);
    }
}

#[test]
fn a_vanished_gpu_does_not_renumber_the_others() {
    // Published with both GPUs; A is gone at the next start. Read back, B
    // keeps gpu-1 (PCI order alone would make it gpu-0 and rewrite it).
    let both = inventory(vec![gpu(A, "0000:01:00.0"), gpu(B, "0000:02:00.0")]);
    let published = desired_slices(
        &both,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
        &DriverName::default(),
    )
    .unwrap();
    let only_b = inventory(vec![gpu(B, "0000:02:00.0")]);
    let model = SliceModel::new(
        &only_b,
        &NodePolicy::default(),
        Capabilities::full(),
        "node-a",
    )
    .previous_indices(indices_from_slices(&published))
    .build()
    .unwrap();
    assert!(model.devices.contains_key("gpu-1"));
    assert!(!model.devices.contains_key("gpu-0"));
}

fn claim(results: serde_json::Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {},
        "status": {"allocation": {"devices": {"results": results}}},
    }))
    .unwrap()
}

#[test]
fn held_devices_are_this_drivers_in_this_pool() {
    let claims = vec![
        claim(json!([
            {"request": "r", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-0-isolated"},
            {"request": "r", "driver": "gpu.tessera.dev", "pool": "node-b", "device": "gpu-1"},
            {"request": "r", "driver": "other.example.com", "pool": "node-a", "device": "gpu-2"},
        ])),
        claim(json!([
            {"request": "r", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-3-mig-1g-10gb-0"},
        ])),
        serde_json::from_value(json!({"metadata": {"name": "pending"}, "spec": {}})).unwrap(),
    ];
    let held = held_in(&claims, "gpu.tessera.dev", "node-a");
    assert_eq!(
        held.into_iter().collect::<Vec<_>>(),
        vec![
            "gpu-0-isolated".to_string(),
            "gpu-3-mig-1g-10gb-0".to_string()
        ]
    );
}

#[test]
fn write_counts_subtract() {
    let a = WriteCounts {
        creates: 5,
        updates: 3,
        deletes: 1,
    };
    let b = WriteCounts {
        creates: 2,
        updates: 3,
        deletes: 0,
    };
    assert_eq!(
        a - b,
        WriteCounts {
            creates: 3,
            updates: 0,
            deletes: 1
        }
    );
    assert_eq!((a - b).total(), 4);
}

#[test]
fn api_errors_read_as_the_servers_words() {
    let status = kube::core::Status {
        code: 422,
        reason: "Invalid".into(),
        message: "ResourceSlice.resource.k8s.io \"x\" is invalid: spec.devices: Too many".into(),
        ..Default::default()
    };
    let e = PublishError::api("applying slice x", kube::Error::Api(Box::new(status)));
    assert_eq!(
        e.to_string(),
        "applying slice x: ResourceSlice.resource.k8s.io \"x\" is invalid: spec.devices: Too many (422 Invalid)"
    );
}

fn result(pool: &str, device: &str) -> serde_json::Value {
    json!({"request": "r", "driver": "gpu.tessera.dev", "pool": pool, "device": device})
}

#[test]
fn a_device_is_dropped_when_gone_or_on_another_gpu() {
    let before: Published = [
        ("gpu-0".to_string(), Some(A.to_string())),
        ("gpu-1".to_string(), Some(B.to_string())),
        ("gpu-1-shared".to_string(), Some(B.to_string())),
    ]
    .into();
    // Same names, same GPUs, one device more: nothing dropped.
    let mut after = before.clone();
    after.insert("gpu-0-shared".into(), Some(A.into()));
    assert!(dropped_devices(&before, &after).is_empty());
    // A device gone, and a name now given to another card.
    after.remove("gpu-1-shared");
    after.insert("gpu-0".into(), Some("GPU-new".into()));
    assert_eq!(
        dropped_devices(&before, &after),
        BTreeSet::from(["gpu-0".to_string(), "gpu-1-shared".to_string()])
    );
}

mod with_server {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::publisher::fake_api::FakeApi;

    const NODE: &str = "node-a";

    fn api_claim(uid: &str, pool: &str, device: &str) -> serde_json::Value {
        json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [result(pool, device)]}}},
        })
    }

    fn published(api: &FakeApi) -> BTreeSet<String> {
        api.slices()
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| d.name.clone())
            .collect()
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "timed out: {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn count(requests: &[String], what: &str) -> usize {
        requests.iter().filter(|r| r.as_str() == what).count()
    }

    fn shared_only() -> NodePolicy {
        NodePolicy::from_yaml("gpus:\n- select: {all: true}\n  modes: [shared]\n").unwrap()
    }

    fn config(policy: NodePolicy) -> PublisherConfig {
        let mut config = PublisherConfig::new(NODE, DriverName::default(), policy);
        config.capabilities = Some(Capabilities::full());
        config.debounce = Duration::from_millis(20);
        config.held_recheck = Duration::from_millis(50);
        config
    }

    fn two_gpus() -> NodeView {
        NodeView::from(inventory(vec![
            gpu(A, "0000:01:00.0"),
            gpu(B, "0000:02:00.0"),
        ]))
    }

    /// Runs `publisher` on `view` until the returned sender is dropped or
    /// the stop handle fires.
    fn start(
        publisher: Publisher,
        view: NodeView,
    ) -> (
        watch::Sender<NodeView>,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let (tx, rx) = watch::channel(view);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(publisher.run(rx, async move {
            let _ = stopped.await;
        }));
        (tx, stop, task)
    }

    /// Waits until the publisher has made no reconcile for a while.
    async fn settled(counters: &WriteCounters) -> u64 {
        let mut settled = counters.reconciles();
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if counters.reconciles() == settled {
                return settled;
            }
            settled = counters.reconciles();
        }
    }

    /// The node's claim traffic does not grow with the cluster: no claim
    /// watch, and claims allocated anywhere (this pool included) cost the
    /// running publisher no request and no reconcile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_of_the_cluster_cost_a_running_node_nothing() {
        let api = FakeApi::new(NODE, "node-uid-1");
        api.put_claim(api_claim("other-0", "node-b", "gpu-0"));
        let publisher = Publisher::new(api.client(), config(NodePolicy::default()));
        let counters = publisher.counters();
        let (_tx, stop, task) = start(publisher, two_gpus());
        until("first publish", || !api.slices().is_empty()).await;
        until("slice watch", || {
            count(&api.requests(), "GET resourceslices watch") > 0
        })
        .await;
        let settled = settled(&counters).await;
        // A node with nothing published yet has nothing to compare with:
        // its first model is built knowing the held devices.
        assert_eq!(count(&api.requests(), "GET resourceclaims list"), 1);

        let mark = api.requests().len();
        for n in 0..50 {
            api.put_claim(api_claim(&format!("other-{n}"), "node-b", "gpu-1"));
            api.put_claim(api_claim(&format!("mine-{n}"), NODE, "gpu-0-shared"));
        }
        let mut foreign = api_claim("other-driver", NODE, "gpu-0");
        foreign["status"]["allocation"]["devices"]["results"][0]["driver"] =
            json!("other.example.com");
        api.put_claim(foreign);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(counters.reconciles(), settled);
        assert_eq!(api.requests()[mark..], [] as [String; 0]);
        let requests = api.requests();
        assert_eq!(
            count(&requests, "GET resourceclaims watch"),
            0,
            "{requests:?}"
        );

        let _ = stop.send(());
        task.await.unwrap();
    }

    /// A restart with the slices already published compares with them:
    /// nothing dropped, so no claim is listed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restart_that_drops_nothing_lists_no_claims() {
        let api = FakeApi::new(NODE, "node-uid-1");
        api.put_claim(api_claim("held-1", NODE, "gpu-1"));
        let mut first = Publisher::new(api.client(), config(NodePolicy::default()));
        first.reconcile(&two_gpus()).await.unwrap();

        let mut restarted = Publisher::new(api.client(), config(NodePolicy::default()));
        let again = restarted.reconcile(&two_gpus()).await.unwrap();
        assert!(again.unchanged);
        assert_eq!(again.reads.claim_lists, 0);

        // The policy now offers shares only, but the node itself prepared
        // the whole GPU: kept from what the node knows, with no API read.
        let api = FakeApi::new(NODE, "node-uid-1");
        let one_gpu = NodeView::from(inventory(vec![gpu(A, "0000:01:00.0")]));
        let whole_and_shared =
            NodePolicy::from_yaml("gpus:\n- select: {all: true}\n  modes: [whole, shared]\n")
                .unwrap();
        let mut first = Publisher::new(api.client(), config(whole_and_shared));
        first.reconcile(&one_gpu).await.unwrap();
        let mut prepared = one_gpu.clone();
        prepared.prepared.insert("gpu-0".into());
        let mut restarted = Publisher::new(api.client(), config(shared_only()));
        let r = restarted.reconcile(&prepared).await.unwrap();
        assert_eq!(r.reads.claim_lists, 0);
        assert_eq!(r.held_devices, 1);
        assert!(published(&api).contains("gpu-0"));
    }

    /// A policy change that would drop a device a claim holds: the claims
    /// are listed then, the device stays published until the claim is
    /// deallocated, and goes at the next recheck after that.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_device_a_claim_holds_stays_published() {
        let api = FakeApi::new(NODE, "node-uid-1");
        let mut first = Publisher::new(api.client(), config(NodePolicy::default()));
        first.reconcile(&two_gpus()).await.unwrap();
        assert!(
            published(&api)
                .is_superset(&BTreeSet::from(["gpu-0".to_string(), "gpu-1".to_string()]))
        );
        // The scheduler allocated gpu-1; then the node restarts with a
        // policy that offers shares only.
        api.put_claim(api_claim("held-1", NODE, "gpu-1"));
        api.put_claim(api_claim("other-0", "node-b", "gpu-0"));

        let publisher = Publisher::new(api.client(), config(shared_only()));
        let counters = publisher.counters();
        let (_tx, stop, task) = start(publisher, two_gpus());
        until("republished", || !published(&api).contains("gpu-0")).await;
        let devices = published(&api);
        assert!(devices.contains("gpu-1"), "{devices:?}");
        assert!(devices.contains("gpu-0-shared"), "{devices:?}");
        // Never written without it: every write came after a claim list.
        let requests = api.requests();
        let first_list = requests
            .iter()
            .position(|r| r == "GET resourceclaims list")
            .unwrap();
        let first_write = requests
            .iter()
            .rposition(|r| r.starts_with("PATCH"))
            .unwrap();
        assert!(first_list < first_write, "{requests:?}");
        assert!(counters.reads().claim_lists >= 1);

        // Deallocated: gone at a recheck, with no other event.
        let mut released = api_claim("held-1", NODE, "gpu-1");
        released["status"] = json!({});
        api.put_claim(released);
        until("gpu-1 dropped", || !published(&api).contains("gpu-1")).await;
        assert!(published(&api).contains("gpu-1-shared"));

        // Nothing kept for claims any more: no further claim list.
        let settled = settled(&counters).await;
        let lists = counters.reads().claim_lists;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(counters.reconciles(), settled);
        assert_eq!(counters.reads().claim_lists, lists);

        // Someone else deletes one of our slices: it is restored.
        let victim = api.slices()[0].metadata.name.clone().unwrap();
        let slices = api.slices().len();
        api.delete_slice(&victim);
        until("slice restored", || api.slices().len() == slices).await;

        let _ = stop.send(());
        task.await.unwrap();
    }

    /// The node prepares a device the model publishes anyway: no reconcile,
    /// no request. It unprepares a device kept only because it was
    /// prepared (the policy no longer offers it): the claims are listed, as
    /// the claim may still be allocated.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn prepares_cost_nothing_unless_a_device_may_go() {
        let api = FakeApi::new(NODE, "node-uid-1");
        let mut first = Publisher::new(api.client(), config(NodePolicy::default()));
        first.reconcile(&two_gpus()).await.unwrap();
        let mut view = two_gpus();
        view.prepared.insert("gpu-1".into());
        let publisher = Publisher::new(api.client(), config(shared_only()));
        let counters = publisher.counters();
        let (tx, stop, task) = start(publisher, view.clone());
        until("gpu-0 dropped", || !published(&api).contains("gpu-0")).await;
        until("slice watch", || {
            count(&api.requests(), "GET resourceslices watch") > 0
        })
        .await;
        let settled = settled(&counters).await;
        assert!(published(&api).contains("gpu-1"));

        let mark = api.requests().len();
        view.prepared.insert("gpu-0-shared".into());
        tx.send_replace(view.clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(counters.reconciles(), settled);
        assert_eq!(api.requests()[mark..], [] as [String; 0]);

        // Unprepared; the claim is still allocated, so gpu-1 stays.
        api.put_claim(api_claim("held-1", NODE, "gpu-1"));
        let lists = counters.reads().claim_lists;
        view.prepared.remove("gpu-1");
        tx.send_replace(view);
        until("claims listed", || counters.reads().claim_lists > lists).await;
        assert!(published(&api).contains("gpu-1"));
        // Deallocated: gone at a recheck.
        let mut released = api_claim("held-1", NODE, "gpu-1");
        released["status"] = json!({});
        api.put_claim(released);
        until("gpu-1 dropped", || !published(&api).contains("gpu-1")).await;

        let _ = stop.send(());
        task.await.unwrap();
    }

    /// The Node's UID is cached; a Node recreated under the same name (its
    /// slices garbage-collected) gets slices owned by the new one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_recreated_node_owns_the_republished_slices() {
        let api = FakeApi::new(NODE, "node-uid-1");
        let mut config = PublisherConfig::new(NODE, DriverName::default(), NodePolicy::default());
        config.capabilities = Some(Capabilities::full());
        config.debounce = Duration::from_millis(20);
        let publisher = Publisher::new(api.client(), config);
        let view = NodeView::from(inventory(vec![gpu(A, "0000:01:00.0")]));
        let (_tx, rx) = watch::channel(view);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(publisher.run(rx, async move {
            let _ = stopped.await;
        }));
        let owners = |api: &FakeApi| -> BTreeSet<String> {
            api.slices()
                .iter()
                .flat_map(|s| s.metadata.owner_references.iter().flatten())
                .map(|o| o.uid.clone())
                .collect()
        };
        until("first publish", || !api.slices().is_empty()).await;
        assert_eq!(owners(&api), BTreeSet::from(["node-uid-1".to_string()]));
        api.recreate_node("node-uid-2");
        until("republished for the new node", || {
            !api.slices().is_empty() && owners(&api) == BTreeSet::from(["node-uid-2".to_string()])
        })
        .await;
        let _ = stop.send(());
        task.await.unwrap();
    }

    /// `publish --once` on a node with nothing published lists the claims
    /// once; again, with nothing dropped, it lists none.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_reconcile_lists_the_claims_only_with_nothing_to_compare() {
        let api = FakeApi::new(NODE, "node-uid-1");
        api.put_claim(api_claim("held-1", NODE, "gpu-1"));
        let mut publisher = Publisher::new(api.client(), config(shared_only()));
        let first = publisher.reconcile(&two_gpus()).await.unwrap();
        assert!(!first.unchanged);
        assert_eq!(first.held_devices, 1);
        assert_eq!(
            first.reads,
            ReadCounts {
                claim_lists: 1,
                node_gets: 1,
                slice_lists: 1
            }
        );
        // Again, nothing changed: the Node is cached, and gpu-1 (kept for
        // the claim) would be dropped, so the claims are listed again.
        let again = publisher.reconcile(&two_gpus()).await.unwrap();
        assert!(again.unchanged);
        assert_eq!(
            again.reads,
            ReadCounts {
                claim_lists: 1,
                node_gets: 0,
                slice_lists: 1
            }
        );
    }
}
