//! Events on this node's Node object: what an operator must see (a
//! quarantined checkpoint, a GPU's health, a claim whose status lags).
//!
//! They go through kube's event [`Recorder`] (`events.k8s.io/v1`, in the
//! `default` namespace where Node events live): an event repeated within
//! minutes with the same reason, action and related object is one Event
//! whose `series.count` grows, not a new object per occurrence. The action
//! names what happened to what (a GPU's UUID, say), so that repeats about
//! different subjects stay separate Events with their own notes.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::warn;

/// The API server refuses a longer `note` (events.k8s.io/v1).
const NOTE_LIMIT: usize = 1024;

/// Records Events about one Node; cheap to clone (clones share what was
/// recorded, so their repeats count together).
#[derive(Clone)]
pub struct NodeEvents {
    recorder: Recorder,
    node: ObjectReference,
}

impl NodeEvents {
    /// Events about `node`, reported by `component` (the reporting
    /// controller) from that node (the instance).
    pub fn new(client: Client, node: impl Into<String>, component: impl Into<String>) -> Self {
        let node = node.into();
        let reporter = Reporter {
            controller: component.into(),
            instance: Some(node.clone()),
        };
        NodeEvents {
            recorder: Recorder::new(client, reporter),
            node: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.clone()),
                uid: Some(node),
                ..Default::default()
            },
        }
    }

    /// Records a Warning; failures are logged, never fatal.
    pub async fn warning(&self, reason: &str, action: &str, note: &str) {
        self.publish(EventType::Warning, reason, action, note, None)
            .await
    }

    /// Records a Normal event; failures are logged, never fatal.
    pub async fn normal(&self, reason: &str, action: &str, note: &str) {
        self.publish(EventType::Normal, reason, action, note, None)
            .await
    }

    /// Records an event that also concerns `related` (a claim, say).
    pub async fn publish(
        &self,
        kind: EventType,
        reason: &str,
        action: &str,
        note: &str,
        related: Option<ObjectReference>,
    ) {
        let event = Event {
            type_: kind,
            reason: reason.into(),
            note: Some(truncated(note, NOTE_LIMIT).into()),
            action: action.into(),
            secondary: related,
        };
        if let Err(e) = self.recorder.publish(&event, &self.node).await {
            warn!("cannot record Node event {reason} ({note}): {e}");
        }
    }
}

impl NodeEvents {
    /// Records a Warning about another object (a Pod, say) in its own
    /// namespace, reported from this node; failures are logged.
    pub async fn warning_about(
        &self,
        object: &ObjectReference,
        reason: &str,
        action: &str,
        note: &str,
    ) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(truncated(note, NOTE_LIMIT).into()),
            action: action.into(),
            secondary: Some(self.node.clone()),
        };
        if let Err(e) = self.recorder.publish(&event, object).await {
            warn!("cannot record event {reason} ({note}): {e}");
        }
    }
}

/// At most `limit` bytes of `s`, cut at a character boundary.
fn truncated(s: &str, limit: usize) -> &str {
    if s.len() <= limit {
        return s;
    }
    let mut end = limit;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::truncated;

    #[test]
    fn notes_are_cut_at_a_character_boundary() {
        assert_eq!(truncated("short", 1024), "short");
        assert_eq!(truncated("GPU ü", 5), "GPU ");
        assert_eq!(truncated(&"x".repeat(2000), 1024).len(), 1024);
    }
}
