//! Node Events (`tessera_driver::state::events::NodeEvents`) against the real
//! API server, without a kubelet: a warning repeated is one Event whose
//! series counts the repeats, as both the `events.k8s.io/v1` and the core
//! `v1` Events API show it (tests and `kubectl describe node` read the
//! latter); the same reason about another subject (action) is an Event of
//! its own, with its own note.

use std::time::Duration;

use anyhow::{Result, ensure};
use k8s_openapi::api::core::v1::Event as CoreEvent;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::ListParams;
use tessera_conformance::{TestCluster, unique_name, wait_for};
use tessera_driver::state::events::NodeEvents;

const TIMEOUT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_repeated_warning_is_one_event_with_a_count() -> Result<()> {
    let cluster = TestCluster::shared().await?;
    // The Node need not exist: events name it, nothing looks it up.
    let node = unique_name("events-node");
    let component = "gpu.events.tessera.dev-plugin";
    let events = NodeEvents::new(cluster.client(), &node, component);
    let reason = "GpuUnhealthy";
    events
        .warning(reason, "Taint GPU-0 XID 79", "GPU gpu-0: XID 79 (first)")
        .await;
    events
        .warning(reason, "Taint GPU-0 XID 79", "GPU gpu-0: XID 79 (again)")
        .await;
    // Another recorder of the same node (a clone) counts with it.
    events
        .clone()
        .warning(reason, "Taint GPU-0 XID 79", "GPU gpu-0: XID 79 (third)")
        .await;
    events
        .warning(reason, "Taint GPU-1 XID 48", "GPU gpu-1: XID 48")
        .await;

    let selector = format!("regarding.name={node},reason={reason}");
    let v1: Api<Event> = Api::namespaced(cluster.client(), "default");
    let seen = wait_for(
        "the Node's events, the first counted 3 times",
        TIMEOUT,
        || async {
            let list = v1.list(&ListParams::default().fields(&selector)).await?;
            let counted = list
                .items
                .iter()
                .any(|e| e.series.as_ref().is_some_and(|s| s.count == 3));
            Ok(counted.then_some(list.items))
        },
    )
    .await?;
    ensure!(seen.len() == 2, "two Events (one per GPU), got {seen:#?}");
    let gpu0 = seen
        .iter()
        .find(|e| e.action.as_deref() == Some("Taint GPU-0 XID 79"));
    ensure!(
        gpu0.is_some_and(|e| e.note.as_deref() == Some("GPU gpu-0: XID 79 (first)")
            && e.type_.as_deref() == Some("Warning")
            && e.reporting_controller.as_deref() == Some(component)
            && e.reporting_instance.as_deref() == Some(node.as_str())),
        "GPU-0's event: {gpu0:#?}"
    );

    // What readers of core/v1 Events (kubectl describe node) see.
    let core: Api<CoreEvent> = Api::namespaced(cluster.client(), "default");
    let legacy = core
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind=Node,involvedObject.name={node},reason={reason}"
        )))
        .await?
        .items;
    ensure!(legacy.len() == 2, "core/v1 shows both Events: {legacy:#?}");
    let counted = legacy
        .iter()
        .find(|e| e.message.as_deref() == Some("GPU gpu-0: XID 79 (first)"));
    ensure!(
        counted.is_some_and(|e| e.series.as_ref().and_then(|s| s.count) == Some(3)
            && e.reporting_component.as_deref() == Some(component)),
        "GPU-0's event as core/v1: {counted:#?}"
    );
    for e in seen {
        if let Some(name) = e.metadata.name {
            v1.delete(&name, &Default::default()).await?;
        }
    }
    Ok(())
}
