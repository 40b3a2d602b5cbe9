use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tessera_api::inventory::{Gpu, Inventory, Mig};

use super::*;
use crate::model::desired_slices;

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

fn claim_event(uid: &str, results: serde_json::Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": uid, "namespace": "ns", "uid": uid},
        "spec": {},
        "status": {"allocation": {"devices": {"results": results}}},
    }))
    .unwrap()
}

fn result(pool: &str, device: &str) -> serde_json::Value {
    json!({"request": "r", "driver": "gpu.tessera.dev", "pool": pool, "device": device})
}

#[test]
fn claim_index_keeps_only_this_pools_held_devices() {
    use kube::runtime::watcher::Event;
    let mut index = HeldClaims::new("gpu.tessera.dev", "node-a");
    assert!(!index.synced());
    // The initial list: nothing is visible until it is complete.
    assert!(!index.apply(Event::Init));
    assert!(!index.apply(Event::InitApply(claim_event(
        "a",
        json!([result("node-a", "gpu-0")])
    ))));
    assert!(!index.apply(Event::InitApply(claim_event(
        "b",
        json!([result("node-b", "gpu-0")])
    ))));
    assert!(index.held().is_empty());
    assert!(index.apply(Event::InitDone));
    assert!(index.synced());
    assert_eq!(index.held().iter().collect::<Vec<_>>(), ["gpu-0"]);
    // Claims of another pool are not kept at all.
    assert_eq!(index.claims(), 1);
    // Another node's claim changes nothing; so does a second claim of a
    // device already held, and its release.
    assert!(!index.apply(Event::Apply(claim_event(
        "c",
        json!([result("node-b", "gpu-1")])
    ))));
    assert!(!index.apply(Event::Apply(claim_event(
        "d",
        json!([result("node-a", "gpu-0")])
    ))));
    assert!(!index.apply(Event::Delete(claim_event("d", json!([])))));
    // A new device held; then its allocation goes away (deallocated).
    assert!(index.apply(Event::Apply(claim_event(
        "e",
        json!([result("node-a", "gpu-1-isolated")])
    ))));
    assert_eq!(index.held().len(), 2);
    let deallocated: ResourceClaim = serde_json::from_value(
        json!({"metadata": {"name": "e", "namespace": "ns", "uid": "e"}, "spec": {}}),
    )
    .unwrap();
    assert!(index.apply(Event::Apply(deallocated)));
    assert_eq!(index.claims(), 1);
    // A relist (e.g. after 410 Gone) replaces the map once complete: the
    // old view stays until then.
    assert!(!index.apply(Event::Init));
    assert_eq!(index.held().len(), 1);
    assert!(index.apply(Event::InitDone));
    assert!(index.held().is_empty());
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

    /// The publisher's loop against an API server that counts requests:
    /// the held devices come from the claim watch, never from a list per
    /// reconcile; only this pool's held devices trigger a republish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_devices_come_from_the_claim_watch() {
        let api = FakeApi::new(NODE, "node-uid-1");
        // Before the publisher starts: a claim on this node holding gpu-1,
        // and one on another node.
        api.put_claim(api_claim("held-1", NODE, "gpu-1"));
        api.put_claim(api_claim("other-1", "node-b", "gpu-0"));

        // Only shares are offered: whole GPUs appear only when held.
        let policy =
            NodePolicy::from_yaml("gpus:\n- select: {all: true}\n  modes: [shared]\n").unwrap();
        let mut config = PublisherConfig::new(NODE, DriverName::default(), policy);
        config.capabilities = Some(Capabilities::full());
        config.debounce = Duration::from_millis(20);
        let publisher = Publisher::new(api.client(), config);
        let counters = publisher.counters();
        let inv = inventory(vec![gpu(A, "0000:01:00.0"), gpu(B, "0000:02:00.0")]);
        let view = NodeView::from(inv);
        let (tx, rx) = watch::channel(view.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(publisher.run(rx, async move {
            let _ = stopped.await;
        }));

        // The first publish already has the device the listed claim holds:
        // nothing was written before the claim list was complete.
        until("first publish", || !api.slices().is_empty()).await;
        let requests = api.requests();
        let first_write = requests
            .iter()
            .position(|r| r.starts_with("PATCH"))
            .unwrap();
        assert!(
            requests[..first_write].contains(&"GET resourceclaims list".to_string()),
            "{requests:?}"
        );
        let devices = published(&api);
        assert!(devices.contains("gpu-1"), "{devices:?}");
        assert!(!devices.contains("gpu-0"), "{devices:?}");
        assert!(devices.contains("gpu-0-shared"), "{devices:?}");

        // Settle: both watches are watching, and the reconciles the slice
        // watch's first list brings are done.
        until("watches", || {
            let requests = api.requests();
            count(&requests, "GET resourceslices watch") > 0
                && count(&requests, "GET resourceclaims watch") > 0
        })
        .await;
        let mut settled = counters.reconciles();
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if counters.reconciles() == settled {
                break;
            }
            settled = counters.reconciles();
        }
        // The first reconcile and the end of the slice watch's first list;
        // our writes coming back through the watch bring none.
        assert!(settled <= 2, "{settled} reconciles");
        let writes = counters.snapshot();

        // (c) Claims on another node (or of another driver) arrive: no
        // reconcile, no request.
        let mark = api.requests().len();
        api.put_claim(api_claim("other-2", "node-b", "gpu-1"));
        let mut foreign = api_claim("other-driver", NODE, "gpu-0");
        foreign["status"]["allocation"]["devices"]["results"][0]["driver"] =
            json!("other.example.com");
        api.put_claim(foreign);
        // A second claim of a device already held changes no held set either.
        api.put_claim(api_claim("held-1b", NODE, "gpu-1"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(counters.reconciles(), settled);
        assert_eq!(api.requests()[mark..], [] as [String; 0]);

        // (a) The node prepared gpu-1, which a claim already holds: what the
        // model is built from is unchanged, so no reconcile and no request.
        let mark = api.requests().len();
        let mut node = view.clone();
        node.prepared.insert("gpu-1".into());
        tx.send_replace(node.clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(counters.reconciles(), settled);
        assert_eq!(api.requests()[mark..], [] as [String; 0]);

        // (a') It prepared a device no claim is known to hold yet (the claim
        // watch lags): a reconcile, with no claim list, no Node GET, one
        // narrow slice list and no write (the device is published anyway).
        let reads = counters.reads();
        node.prepared.insert("gpu-0-shared".into());
        tx.send_replace(node);
        until("reconcile", || counters.reconciles() == settled + 1).await;
        until("slice list", || api.requests().len() > mark).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let requests = api.requests()[mark..].to_vec();
        assert_eq!(requests, ["GET resourceslices list"]);
        assert_eq!(
            counters.reads() - reads,
            ReadCounts {
                claim_lists: 0,
                node_gets: 0,
                slice_lists: 1
            }
        );
        assert_eq!(counters.snapshot(), writes);

        // (b) A claim on this node allocates gpu-0 (not offered by the
        // policy), known only through the watch: republished with gpu-0.
        let mark = api.requests().len();
        api.put_claim(api_claim("held-0", NODE, "gpu-0"));
        until("gpu-0 published", || published(&api).contains("gpu-0")).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let requests = api.requests()[mark..].to_vec();
        assert_eq!(
            count(&requests, "GET resourceclaims list"),
            0,
            "{requests:?}"
        );
        assert_eq!(
            count(&requests, "GET resourceslices list"),
            1,
            "{requests:?}"
        );
        // The cached owner is read again before writing.
        assert_eq!(count(&requests, "GET node"), 1, "{requests:?}");
        assert!(published(&api).contains("gpu-1"));
        // The write came back through the slice watch: no reconcile for it.
        assert_eq!(counters.reconciles(), settled + 2);

        // The claim is deleted... by deallocation: gpu-0 goes again.
        let mut released = api_claim("held-0", NODE, "gpu-0");
        released["status"] = json!({});
        api.put_claim(released);
        until("gpu-0 dropped", || !published(&api).contains("gpu-0")).await;
        assert!(published(&api).contains("gpu-1"));
        assert_eq!(count(&api.requests(), "GET resourceclaims list"), 1);

        // Someone else deletes one of our slices: it is restored.
        let victim = api.slices()[0].metadata.name.clone().unwrap();
        let slices = api.slices().len();
        api.delete_slice(&victim);
        until("slice restored", || api.slices().len() == slices).await;

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

    /// `publish --once` has no watch: its reconcile lists the claims.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_reconcile_lists_the_claims() {
        let api = FakeApi::new(NODE, "node-uid-1");
        api.put_claim(api_claim("held-1", NODE, "gpu-1"));
        let policy =
            NodePolicy::from_yaml("gpus:\n- select: {all: true}\n  modes: [shared]\n").unwrap();
        let mut config = PublisherConfig::new(NODE, DriverName::default(), policy);
        config.capabilities = Some(Capabilities::full());
        let mut publisher = Publisher::new(api.client(), config);
        let view = NodeView::from(inventory(vec![
            gpu(A, "0000:01:00.0"),
            gpu(B, "0000:02:00.0"),
        ]));
        let first = publisher.reconcile(&view).await.unwrap();
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
        // Again, nothing changed: the Node is cached.
        let again = publisher.reconcile(&view).await.unwrap();
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
