//! A fake Kubernetes API server for EndpointSlices, on loopback, speaking the real list and watch
//! protocol to the real kube-rs client: `resourceVersion`s, chunked watch streams of JSON events,
//! bookmarks, `410 Gone` for expired versions, and outages. It also takes the agent's Events
//! (`events.k8s.io/v1`: create, and the merge patch of a series) and keeps them for the test.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::{Request, Response, StatusCode, body::Frame, service::service_fn};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// One change, kept for watches that resume from an older `resourceVersion`.
#[derive(Clone, Debug)]
struct Change {
    version: u64,
    kind: &'static str,
    object: Value,
}

#[derive(Debug, Default)]
struct State {
    version: u64,
    slices: BTreeMap<String, Value>,
    changes: Vec<Change>,
    /// Watches from versions below this get `410 Gone`.
    expired_below: u64,
    down: bool,
    watchers: Vec<mpsc::UnboundedSender<Bytes>>,
    lists: u64,
    watches: u64,
    /// The Events created, as they stand after every patch, in order of creation.
    events: Vec<Value>,
}

/// A running fake API server. Dropping it stops it.
#[derive(Debug)]
pub struct FakeKube {
    address: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const SERVICE_LABEL: &str = "kubernetes.io/service-name";

impl FakeKube {
    /// Starts the server on a loopback port, on a thread of its own.
    pub fn start() -> anyhow::Result<Self> {
        let state = Arc::new(Mutex::new(State::default()));
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").context("binding the fake API server")?;
        listener.set_nonblocking(true)?;
        let address = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("fake-kube".to_owned())
            .spawn(move || {
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                runtime.block_on(serve(listener, served, stopped));
            })
            .context("starting the fake API server thread")?;
        Ok(Self {
            address,
            state,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// A kubeconfig that points kube-rs at this server.
    #[must_use]
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\nusers:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\n",
            self.address
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Creates or replaces an object (an EndpointSlice as JSON, `metadata.name` set).
    pub fn apply(&self, mut object: Value) {
        let mut state = self.lock();
        state.version += 1;
        let version = state.version;
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let kind = if state.slices.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        state.slices.insert(name, object.clone());
        record(
            &mut state,
            Change {
                version,
                kind,
                object,
            },
        );
    }

    /// Deletes an object by name.
    pub fn delete(&self, name: &str) {
        let mut state = self.lock();
        let Some(mut object) = state.slices.remove(name) else {
            return;
        };
        state.version += 1;
        let version = state.version;
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        record(
            &mut state,
            Change {
                version,
                kind: "DELETED",
                object,
            },
        );
    }

    /// Takes the server down (requests fail with 503, watches end) or brings it back.
    pub fn set_down(&self, down: bool) {
        let mut state = self.lock();
        state.down = down;
        if down {
            state.watchers.clear();
        }
    }

    /// Forgets the history: every watch resuming from an older version gets `410 Gone`, and the
    /// open watches end, as after an etcd compaction.
    pub fn expire_history(&self) {
        let mut state = self.lock();
        state.expired_below = state.version + 1;
        state.changes.clear();
        state.watchers.clear();
    }

    /// Sends a bookmark to every open watch.
    pub fn bookmark(&self) {
        let mut state = self.lock();
        let line = event_line(
            "BOOKMARK",
            &json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"resourceVersion": state.version.to_string()}
            }),
        );
        state
            .watchers
            .retain(|watcher| watcher.send(line.clone()).is_ok());
    }

    /// (lists, watches) served so far.
    #[must_use]
    pub fn requests(&self) -> (u64, u64) {
        let state = self.lock();
        (state.lists, state.watches)
    }
}

impl FakeKube {
    /// The Events the agent published (each with `metadata.namespace` set, as the API server
    /// sets it).
    #[must_use]
    pub fn events(&self) -> Vec<Value> {
        self.lock().events.clone()
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Keeps `change` for resuming watches and sends it to the open ones.
fn record(state: &mut State, change: Change) {
    let line = event_line(change.kind, &change.object);
    state.changes.push(change);
    state
        .watchers
        .retain(|watcher| watcher.send(line.clone()).is_ok());
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

type Body = BoxBody<Bytes, Infallible>;

async fn serve(
    listener: std::net::TcpListener,
    state: Arc<Mutex<State>>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let state = Arc::clone(&state);
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let state = Arc::clone(&state);
                        async move { Ok::<_, Infallible>(handle(&state, request).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        }
    }
}

/// `labelSelector=kubernetes.io/service-name=NAME` and the other query parameters.
fn query(request: &Request<hyper::body::Incoming>) -> BTreeMap<String, String> {
    request
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(key, value)| (key.to_owned(), percent_decode(value)))
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        if bytes[index] == b'%'
            && let Some(value) = text
                .get(index + 1..index + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            out.push(value);
            index += 3;
            continue;
        }
        out.push(bytes[index]);
        index += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn selected(object: &Value, selector: Option<&String>) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    let Some((key, value)) = selector.split_once('=') else {
        return true;
    };
    object["metadata"]["labels"][key].as_str() == Some(value)
}

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code})
}

/// The state, or `None` while the server is down (answer [`unavailable`] then).
fn serving(state: &Arc<Mutex<State>>) -> Option<std::sync::MutexGuard<'_, State>> {
    let locked = state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    (!locked.down).then_some(locked)
}

/// What a server that is down answers.
fn unavailable() -> Response<Body> {
    json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        &status(503, "ServiceUnavailable", "the fake API server is down"),
    )
}

/// The path prefix of the Events API.
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/";

async fn handle(
    state: &Arc<Mutex<State>>,
    request: Request<hyper::body::Incoming>,
) -> Response<Body> {
    if !request.uri().path().starts_with(EVENTS) {
        return respond(state, &request);
    }
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    events(state, &parts.method, parts.uri.path(), &body)
}

/// `POST .../namespaces/NS/events` creates, `PATCH .../namespaces/NS/events/NAME` merges (one
/// level deep, as the recorder's series patches need).
fn events(
    state: &Arc<Mutex<State>>,
    method: &hyper::Method,
    path: &str,
    body: &[u8],
) -> Response<Body> {
    let Some(mut locked) = serving(state) else {
        return unavailable();
    };
    let Ok(mut object) = serde_json::from_slice::<Value>(body) else {
        return json_response(
            StatusCode::BAD_REQUEST,
            &status(400, "BadRequest", "not JSON"),
        );
    };
    let rest = path.trim_start_matches(EVENTS);
    let mut parts = rest.split('/');
    let (Some(namespace), Some("events")) = (parts.next(), parts.next()) else {
        return json_response(StatusCode::NOT_FOUND, &status(404, "NotFound", path));
    };
    let name = parts.next();
    locked.version += 1;
    let version = locked.version.to_string();
    match (method.as_str(), name) {
        ("POST", None) => {
            object["metadata"]["namespace"] = json!(namespace);
            object["metadata"]["resourceVersion"] = json!(version);
            locked.events.push(object.clone());
            json_response(StatusCode::CREATED, &object)
        }
        ("PATCH", Some(name)) => {
            let Some(stored) = locked.events.iter_mut().find(|event| {
                event["metadata"]["namespace"] == namespace && event["metadata"]["name"] == name
            }) else {
                return json_response(StatusCode::NOT_FOUND, &status(404, "NotFound", name));
            };
            if let (Some(stored), Some(patch)) = (stored.as_object_mut(), object.as_object()) {
                for (key, value) in patch {
                    if key != "metadata" {
                        stored.insert(key.clone(), value.clone());
                    }
                }
            }
            stored["metadata"]["resourceVersion"] = json!(version);
            let stored = stored.clone();
            json_response(StatusCode::OK, &stored)
        }
        _ => json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &status(405, "MethodNotAllowed", method.as_str()),
        ),
    }
}

fn respond(state: &Arc<Mutex<State>>, request: &Request<hyper::body::Incoming>) -> Response<Body> {
    let Some(mut locked) = serving(state) else {
        return unavailable();
    };
    let path = request.uri().path();
    if !path.starts_with("/apis/discovery.k8s.io/v1/") || !path.ends_with("/endpointslices") {
        return json_response(StatusCode::NOT_FOUND, &status(404, "NotFound", path));
    }
    let query = query(request);
    let selector = query
        .get("labelSelector")
        .filter(|selector| selector.starts_with(SERVICE_LABEL));
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    if !watch {
        locked.lists += 1;
        let items: Vec<&Value> = locked
            .slices
            .values()
            .filter(|object| selected(object, selector))
            .collect();
        return json_response(
            StatusCode::OK,
            &json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": locked.version.to_string()},
                "items": items,
            }),
        );
    }
    locked.watches += 1;
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|version| version.parse().ok())
        .unwrap_or(locked.version);
    let (sender, receiver) = mpsc::unbounded_channel::<Bytes>();
    if from < locked.expired_below {
        let _ = sender.send(event_line(
            "ERROR",
            &status(410, "Expired", &format!("too old resource version: {from}")),
        ));
    } else {
        for change in locked.changes.iter().filter(|change| change.version > from) {
            if selected(&change.object, selector) {
                let _ = sender.send(event_line(change.kind, &change.object));
            }
        }
        // Live changes are not filtered by label: every test object carries the watched one.
        locked.watchers.push(sender);
    }
    let stream = futures::stream::unfold(receiver, |mut receiver| async move {
        let line = tokio::time::timeout(Duration::from_secs(290), receiver.recv())
            .await
            .ok()??;
        Some((Ok::<_, Infallible>(Frame::data(line)), receiver))
    });
    let mut response = Response::new(StreamBody::new(stream).boxed());
    response.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

/// An EndpointSlice of `service` named `name` with `endpoints` (address, ready, terminating), of
/// `address_type` ("IPv4"/"IPv6"), with the kube-dns ports (`dns` UDP, `dns-tcp` TCP) on `port`.
#[must_use]
pub fn endpoint_slice(
    name: &str,
    service: &str,
    address_type: &str,
    port: u16,
    endpoints: &[(&str, bool, bool)],
) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "kube-system",
            "labels": {SERVICE_LABEL: service},
        },
        "addressType": address_type,
        "endpoints": endpoints.iter().map(|(address, ready, terminating)| json!({
            "addresses": [address],
            "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
        })).collect::<Vec<_>>(),
        "ports": [
            {"name": "dns", "port": port, "protocol": "UDP"},
            {"name": "dns-tcp", "port": port, "protocol": "TCP"},
        ],
    })
}
