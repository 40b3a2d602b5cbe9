//! A small in-memory API server for the publisher's tests: a Node, this
//! node's ResourceSlices (server-side apply stores what was sent), and
//! ResourceClaims with list + watch. Every request is logged, so a test can
//! count what a reconcile asked the server.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{Value, json};
use tokio::sync::broadcast;

type Body = UnsyncBoxBody<Bytes, Infallible>;

const CLAIMS: &str = "/apis/resource.k8s.io/v1/resourceclaims";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const NODES: &str = "/api/v1/nodes/";

/// A watch event: the collection's path, its resourceVersion, the JSON line.
type Event = (&'static str, u64, String);

#[derive(Default)]
struct State {
    rv: u64,
    log: Vec<String>,
    node: Option<(String, String)>,
    slices: BTreeMap<String, Value>,
    claims: BTreeMap<String, Value>,
    /// Watch events (resource, resourceVersion, line), for watches that
    /// start from an older version.
    events: Vec<Event>,
}

/// See the module docs.
#[derive(Clone)]
pub struct FakeApi {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<Event>,
}

impl FakeApi {
    /// A server with Node `node` (uid `uid`).
    pub fn new(node: &str, uid: &str) -> Self {
        let state = State {
            rv: 1,
            node: Some((node.into(), uid.into())),
            ..State::default()
        };
        FakeApi {
            state: Arc::new(Mutex::new(state)),
            events: broadcast::channel(1024).0,
        }
    }

    pub fn client(&self) -> kube::Client {
        let api = self.clone();
        let service = tower::service_fn(move |req: Request<kube::client::Body>| {
            let api = api.clone();
            async move { Ok::<_, Infallible>(api.handle(req).await) }
        });
        kube::Client::new(service, "default")
    }

    /// Requests so far, as `VERB what` (`GET resourceclaims list`, ...).
    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().log.clone()
    }

    /// The slices stored.
    pub fn slices(&self) -> Vec<ResourceSlice> {
        let state = self.state.lock().unwrap();
        state
            .slices
            .values()
            .map(|v| serde_json::from_value(v.clone()).unwrap())
            .collect()
    }

    /// Creates or updates a claim (`metadata.uid` required), sending a
    /// watch event.
    pub fn put_claim(&self, mut claim: Value) {
        let mut state = self.state.lock().unwrap();
        state.rv += 1;
        let rv = state.rv;
        claim["apiVersion"] = json!("resource.k8s.io/v1");
        claim["kind"] = json!("ResourceClaim");
        claim["metadata"]["resourceVersion"] = json!(rv.to_string());
        let uid = claim["metadata"]["uid"].as_str().unwrap().to_string();
        let kind = if state.claims.contains_key(&uid) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.event(&mut state, CLAIMS, kind, &claim);
        state.claims.insert(uid, claim);
    }

    /// The Node deleted and created again under the same name (a new UID),
    /// and the garbage collector deleting the slices the old one owned.
    pub fn recreate_node(&self, uid: &str) {
        let names: Vec<String> = {
            let mut state = self.state.lock().unwrap();
            if let Some(node) = &mut state.node {
                node.1 = uid.into();
            }
            state.slices.keys().cloned().collect()
        };
        for name in names {
            self.delete_slice(&name);
        }
    }

    /// Deletes a slice as someone else would.
    pub fn delete_slice(&self, name: &str) {
        let mut state = self.state.lock().unwrap();
        let slice = state.slices.remove(name).unwrap();
        state.rv += 1;
        self.event(&mut state, SLICES, "DELETED", &slice);
    }

    fn event(&self, state: &mut State, resource: &'static str, kind: &str, object: &Value) {
        let rv = state.rv;
        let mut object = object.clone();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let line = json!({"type": kind, "object": object}).to_string() + "\n";
        state.events.push((resource, rv, line.clone()));
        let _ = self.events.send((resource, rv, line));
    }

    async fn handle(&self, req: Request<kube::client::Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let path = parts.uri.path().to_string();
        let query: BTreeMap<String, String> = parts
            .uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
        let method = parts.method.clone();

        let mut state = self.state.lock().unwrap();
        let what = match path.as_str() {
            CLAIMS if watch => "resourceclaims watch".to_string(),
            CLAIMS => "resourceclaims list".to_string(),
            SLICES if watch => "resourceslices watch".to_string(),
            SLICES => "resourceslices list".to_string(),
            p if p.starts_with(SLICES) => "resourceslice".to_string(),
            p if p.starts_with(NODES) => "node".to_string(),
            p => p.to_string(),
        };
        state.log.push(format!("{method} {what}"));

        match (method, path.as_str()) {
            (Method::GET, resource @ (CLAIMS | SLICES)) if watch => {
                let resource: &'static str = if resource == CLAIMS { CLAIMS } else { SLICES };
                let from: u64 = query
                    .get("resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let replay: Vec<String> = state
                    .events
                    .iter()
                    .filter(|(r, rv, _)| *r == resource && *rv > from)
                    .map(|(_, _, l)| l.clone())
                    .collect();
                let rx = self.events.subscribe();
                drop(state);
                let live = futures::stream::unfold(rx, move |mut rx| async move {
                    loop {
                        match rx.recv().await {
                            Ok((r, _, line)) if r == resource => return Some((line, rx)),
                            Ok(_) => continue,
                            Err(broadcast::error::RecvError::Lagged(_)) => continue,
                            Err(broadcast::error::RecvError::Closed) => return None,
                        }
                    }
                });
                let lines = futures::stream::iter(replay)
                    .chain(live)
                    .map(|l| Ok::<_, Infallible>(Frame::data(Bytes::from(l))));
                stream(StreamBody::new(lines))
            }
            (Method::GET, CLAIMS) => {
                let items: Vec<Value> = state.claims.values().cloned().collect();
                list(&state, "ResourceClaimList", items)
            }
            (Method::GET, SLICES) => {
                let items: Vec<Value> = state.slices.values().cloned().collect();
                list(&state, "ResourceSliceList", items)
            }
            (Method::PATCH, p) if p.starts_with(SLICES) => {
                let name = p.trim_start_matches(SLICES).trim_start_matches('/');
                let mut slice: Value = serde_json::from_slice(&body).unwrap();
                state.rv += 1;
                slice["metadata"]["resourceVersion"] = json!(state.rv.to_string());
                slice["metadata"]["uid"] = json!(format!("uid-{name}"));
                let kind = if state.slices.contains_key(name) {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                self.event(&mut state, SLICES, kind, &slice);
                state.slices.insert(name.to_string(), slice.clone());
                ok(&slice)
            }
            (Method::DELETE, p) if p.starts_with(SLICES) => {
                let name = p.trim_start_matches(SLICES).trim_start_matches('/');
                match state.slices.remove(name) {
                    Some(slice) => {
                        state.rv += 1;
                        self.event(&mut state, SLICES, "DELETED", &slice);
                        ok(&slice)
                    }
                    None => not_found(),
                }
            }
            (Method::GET, p) if p.starts_with(NODES) => {
                let name = p.trim_start_matches(NODES);
                match &state.node {
                    Some((node, uid)) if node == name => ok(&json!({
                        "apiVersion": "v1",
                        "kind": "Node",
                        "metadata": {"name": node, "uid": uid, "resourceVersion": "1"},
                    })),
                    _ => not_found(),
                }
            }
            _ => not_found(),
        }
    }
}

fn stream<S>(body: StreamBody<S>) -> Response<Body>
where
    S: futures::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + 'static,
{
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(UnsyncBoxBody::new(body))
        .unwrap()
}

fn list(state: &State, kind: &str, items: Vec<Value>) -> Response<Body> {
    ok(&json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": kind,
        "metadata": {"resourceVersion": state.rv.to_string()},
        "items": items,
    }))
}

fn ok(value: &Value) -> Response<Body> {
    respond(StatusCode::OK, value)
}

fn not_found() -> Response<Body> {
    respond(
        StatusCode::NOT_FOUND,
        &json!({
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "message": "not found",
            "reason": "NotFound",
            "code": 404,
        }),
    )
}

fn respond(status: StatusCode, value: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(UnsyncBoxBody::new(Full::new(Bytes::from(
            value.to_string(),
        ))))
        .unwrap()
}
