//! The names of this node's pods, from the API server: pod UID (and, for a static pod, its
//! configuration hash, which its cgroup is named after) → namespace and name.
//!
//! A kube-rs watcher on the pods whose `spec.nodeName` is this node, metadata only (the API
//! server sends `PartialObjectMetadata`: no spec, no status, so a pod's status updates are small
//! events). The watcher relists on its own and backs off on errors; meanwhile the last complete
//! view keeps answering, and each kind of failure is logged once per outage.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, PoisonError, RwLock, Weak},
};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client,
    api::{ObjectMeta, PartialObjectMeta},
    runtime::{WatchStreamExt as _, watcher},
};
use tracing::{debug, error, info, warn};

/// The annotation the kubelet gives a static pod's mirror pod (and the pod itself): the hash of
/// its configuration, which is the pod's UID to the kubelet, and so its cgroup's name.
pub const CONFIG_HASH_ANNOTATION: &str = "kubernetes.io/config.hash";
/// The annotation that marks a mirror pod, whose value is the same hash.
pub const CONFIG_MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// One pod, as much of its metadata as naming it needs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PodRecord {
    /// The pod's UID in the API.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// A static pod's configuration hash (`None` for other pods).
    pub config_hash: Option<String>,
}

impl PodRecord {
    /// The record of a pod's metadata; `None` without a UID or a name (the API server always
    /// gives both).
    #[must_use]
    pub fn from_meta(meta: &ObjectMeta) -> Option<Self> {
        let annotation = |key: &str| {
            meta.annotations
                .as_ref()
                .and_then(|annotations| annotations.get(key))
                .filter(|value| !value.is_empty())
                .cloned()
        };
        Some(Self {
            uid: meta.uid.clone().filter(|uid| !uid.is_empty())?,
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().filter(|name| !name.is_empty())?,
            config_hash: annotation(CONFIG_HASH_ANNOTATION)
                .or_else(|| annotation(CONFIG_MIRROR_ANNOTATION)),
        })
    }
}

/// The map the watcher keeps: pods by UID, and static pods' UIDs by configuration hash. During a
/// relist the previous view keeps answering, and the new one replaces it whole when complete
/// (pods deleted while the watch was down vanish then).
#[derive(Debug, Default)]
struct PodIndex {
    pods: HashMap<String, PodRecord>,
    /// Configuration hash → the UID of the mirror pod that carries it.
    hashes: HashMap<String, String>,
    /// The relist under way, if any.
    relisting: Option<HashMap<String, PodRecord>>,
    /// Whether a list ever completed.
    listed: bool,
}

impl PodIndex {
    /// Takes one watcher event in.
    fn handle(&mut self, event: watcher::Event<PodRecord>) {
        match event {
            watcher::Event::Init => self.relisting = Some(HashMap::new()),
            watcher::Event::InitApply(pod) => {
                if let Some(buffer) = self.relisting.as_mut() {
                    buffer.insert(pod.uid.clone(), pod);
                }
            }
            watcher::Event::InitDone => {
                if let Some(buffer) = self.relisting.take() {
                    self.hashes = buffer
                        .values()
                        .filter_map(|pod| Some((pod.config_hash.clone()?, pod.uid.clone())))
                        .collect();
                    self.pods = buffer;
                }
                self.listed = true;
            }
            watcher::Event::Apply(pod) => self.apply(pod),
            watcher::Event::Delete(pod) => self.delete(&pod.uid),
        }
    }

    fn apply(&mut self, pod: PodRecord) {
        // A hash never changes on a pod; were it to, the old one must not keep naming it.
        if let Some(previous) = self.pods.get(&pod.uid)
            && previous.config_hash != pod.config_hash
            && let Some(hash) = previous.config_hash.clone()
        {
            self.forget_hash(&hash, &pod.uid);
        }
        if let Some(hash) = &pod.config_hash {
            self.hashes.insert(hash.clone(), pod.uid.clone());
        }
        self.pods.insert(pod.uid.clone(), pod);
    }

    fn delete(&mut self, uid: &str) {
        if let Some(pod) = self.pods.remove(uid)
            && let Some(hash) = pod.config_hash
        {
            self.forget_hash(&hash, uid);
        }
    }

    /// Drops `hash` if `uid` is what it names: a static pod's new mirror pod (same hash, new
    /// UID) may be seen before its old one's deletion.
    fn forget_hash(&mut self, hash: &str, uid: &str) {
        if self.hashes.get(hash).is_some_and(|named| named == uid) {
            self.hashes.remove(hash);
        }
    }

    /// The pod whose UID, or whose configuration hash (a static pod), is `uid_or_hash`.
    fn get(&self, uid_or_hash: &str) -> Option<&PodRecord> {
        self.pods.get(uid_or_hash).or_else(|| {
            self.hashes
                .get(uid_or_hash)
                .and_then(|uid| self.pods.get(uid))
        })
    }

    fn len(&self) -> usize {
        self.pods.len()
    }

    fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }
}

/// The names of this node's pods, shared: a cheap clone, read by whoever names cgroups and
/// written by [`PodNames::follow`].
#[derive(Clone, Debug, Default)]
pub struct PodNames {
    index: Arc<RwLock<PodIndex>>,
}

/// Why the pods cannot be followed.
#[derive(Debug, thiserror::Error)]
pub enum PodsError {
    /// The node's name is unknown, so no selector can keep the watch to this node's pods.
    #[error(
        "the node's name is unknown, so the pods cannot be named: set NODE_NAME (the DaemonSet \
         sets it from spec.nodeName)"
    )]
    NoNodeName,
}

impl PodNames {
    /// An empty map (every pod unnamed until [`Self::follow`] fills it).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The namespace and name of the pod whose UID, or whose configuration hash (a static pod:
    /// its cgroup is named after the hash), is `uid_or_hash`.
    #[must_use]
    pub fn name(&self, uid_or_hash: &str) -> Option<(String, String)> {
        self.read(|index| {
            index
                .get(uid_or_hash)
                .map(|pod| (pod.namespace.clone(), pod.name.clone()))
        })
    }

    /// Names `records` (pods listed elsewhere: the agent's record of them for the CLI,
    /// [`super::names_file`]), as one complete list.
    #[must_use]
    pub fn from_records(records: impl IntoIterator<Item = PodRecord>) -> Self {
        let names = Self::new();
        names.handle(watcher::Event::Init);
        for record in records {
            names.handle(watcher::Event::InitApply(record));
        }
        names.handle(watcher::Event::InitDone);
        names
    }

    /// Every pod named now, by UID.
    #[must_use]
    pub fn records(&self) -> Vec<PodRecord> {
        self.read(|index| {
            let mut records: Vec<PodRecord> = index.pods.values().cloned().collect();
            records.sort_unstable_by(|a, b| a.uid.cmp(&b.uid));
            records
        })
    }

    /// Whether a list of the node's pods ever completed (before, every pod is unnamed).
    #[must_use]
    pub fn listed(&self) -> bool {
        self.read(|index| index.listed)
    }

    /// How many pods are named.
    #[must_use]
    pub fn len(&self) -> usize {
        self.read(PodIndex::len)
    }

    /// Whether none is.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.read(PodIndex::is_empty)
    }

    fn read<T>(&self, f: impl FnOnce(&PodIndex) -> T) -> T {
        // A writer that panicked left a map that is whole at each step (one insert or removal,
        // or a swap): it can still be read.
        f(&self.index.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Takes one watcher event in (the watch's, or a test's).
    pub(super) fn handle(&self, event: watcher::Event<PodRecord>) {
        self.index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .handle(event);
    }

    /// The watch that follows the pods of node `node` (`sources::node_name()`) into this map,
    /// for the caller to spawn. It runs until every `PodNames` of this map is dropped (it
    /// notices at the watch's next event) or its task is aborted; API errors never end it: the
    /// watcher backs off and retries, and the map keeps its last view.
    pub fn follow(
        &self,
        client: Client,
        node: &str,
    ) -> Result<impl Future<Output = ()> + Send + 'static, PodsError> {
        let selector = node_selector(node)?;
        let index = Arc::downgrade(&self.index);
        Ok(follow(client, node.to_owned(), selector, index))
    }
}

/// The field selector of node `node`'s pods. An empty name would select the pods no node runs
/// yet (`spec.nodeName=`), so it is refused.
fn node_selector(node: &str) -> Result<String, PodsError> {
    if node.is_empty() {
        return Err(PodsError::NoNodeName);
    }
    Ok(format!("spec.nodeName={node}"))
}

/// The watch itself; holds the map weakly, so that it ends once nobody reads it.
async fn follow(client: Client, node: String, selector: String, index: Weak<RwLock<PodIndex>>) {
    // Metadata only: `Api<PartialObjectMeta<_>>` makes kube-rs ask for PartialObjectMetadata,
    // and the field selector applies to those lists and watches as to full ones. Lists are
    // served from the API server's cache (`any_semantic`, resourceVersion=0, as the kubelet's
    // own pod list): a quorum read would have etcd read every pod of the cluster for each node
    // that starts, and a name a moment old is good enough for a label.
    let api: Api<PartialObjectMeta<Pod>> = Api::all(client);
    let config = watcher::Config::default().fields(&selector).any_semantic();
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut failures = Failures::default();
    while let Some(event) = stream.next().await {
        let Some(names) = index.upgrade().map(|index| PodNames { index }) else {
            debug!(node, "nobody names pods any more; stopping the pod watch");
            return;
        };
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                failures.failed(&error, &node);
                continue;
            }
        };
        let contact = !matches!(event, watcher::Event::Init);
        let listed = matches!(event, watcher::Event::InitDone);
        let Some(event) = record_event(event) else {
            continue;
        };
        names.handle(event);
        if contact && failures.recovered() {
            info!(node, "watching this node's pods again");
        }
        if listed {
            debug!(node, pods = names.len(), "listed this node's pods");
        }
    }
}

/// The event with each pod's metadata reduced to its record; `None` for a pod without a UID or
/// name (never sent by an API server).
fn record_event(
    event: watcher::Event<PartialObjectMeta<Pod>>,
) -> Option<watcher::Event<PodRecord>> {
    Some(match event {
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
        watcher::Event::InitApply(pod) => {
            watcher::Event::InitApply(PodRecord::from_meta(&pod.metadata)?)
        }
        watcher::Event::Apply(pod) => watcher::Event::Apply(PodRecord::from_meta(&pod.metadata)?),
        watcher::Event::Delete(pod) => watcher::Event::Delete(PodRecord::from_meta(&pod.metadata)?),
    })
}

/// What the agent says when the API server refuses it pods (403).
const RBAC_HINT: &str = "the API server refused the agent's ServiceAccount a verb it needs on \
    pods (list and watch pods, cluster-wide); pods stay named by their UID alone, and the \
    agent retries. Apply the ClusterRole and ClusterRoleBinding of deploy/kubernetes/base \
    (clusterrole.yaml, clusterrolebinding.yaml), bound to the ServiceAccount the agent runs as";

/// The kinds of failure a watch can meet, each logged once per outage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum FailureKind {
    /// A 403: the RBAC of deploy/kubernetes/base is missing.
    Forbidden,
    /// The list failed otherwise.
    List,
    /// A watch could not be started.
    WatchStart,
    /// A watch broke (the connection, or an error the API server sent in it).
    Watch,
    /// The API server's answer lacked a resource version.
    NoResourceVersion,
}

impl FailureKind {
    fn of(error: &watcher::Error) -> Self {
        let forbidden = |error: &kube::Error| {
            let kube::Error::Api(status) = error else {
                return false;
            };
            status.is_forbidden()
        };
        match error {
            watcher::Error::InitialListFailed(error)
            | watcher::Error::WatchStartFailed(error)
            | watcher::Error::WatchFailed(error)
                if forbidden(error) =>
            {
                Self::Forbidden
            }
            watcher::Error::WatchError(status) if status.is_forbidden() => Self::Forbidden,
            watcher::Error::InitialListFailed(_) => Self::List,
            watcher::Error::WatchStartFailed(_) => Self::WatchStart,
            watcher::Error::WatchFailed(_) | watcher::Error::WatchError(_) => Self::Watch,
            watcher::Error::NoResourceVersion => Self::NoResourceVersion,
        }
    }
}

/// The failures logged since the watch last worked. An outage of the API server fails every
/// retry of the backoff alike: the first says so, the rest are debug lines.
#[derive(Debug, Default)]
struct Failures {
    logged: HashSet<FailureKind>,
}

impl Failures {
    /// Notes a failure; `true` when it is the first of its kind since the watch last worked.
    fn first(&mut self, kind: FailureKind) -> bool {
        self.logged.insert(kind)
    }

    /// Logs `error` if it is the first of its kind.
    fn failed(&mut self, error: &watcher::Error, node: &str) {
        let kind = FailureKind::of(error);
        if !self.first(kind) {
            debug!(node, error = %error, "watching this node's pods still fails");
        } else if kind == FailureKind::Forbidden {
            error!(node, error = %error, "{RBAC_HINT}");
        } else {
            warn!(node, error = %error, "watching this node's pods failed; pods keep their last known names, and the watch retries");
        }
    }

    /// The watch works again: `true` if it had failed.
    fn recovered(&mut self) -> bool {
        let failed = !self.logged.is_empty();
        self.logged.clear();
        failed
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn pod(uid: &str, namespace: &str, name: &str) -> PodRecord {
        PodRecord {
            uid: uid.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            config_hash: None,
        }
    }

    fn mirror(uid: &str, hash: &str, name: &str) -> PodRecord {
        PodRecord {
            config_hash: Some(hash.to_owned()),
            ..pod(uid, "kube-system", name)
        }
    }

    fn named(names: &PodNames, key: &str) -> Option<(String, String)> {
        names.name(key)
    }

    fn pair(namespace: &str, name: &str) -> Option<(String, String)> {
        Some((namespace.to_owned(), name.to_owned()))
    }

    fn send(names: &PodNames, events: impl IntoIterator<Item = watcher::Event<PodRecord>>) {
        for event in events {
            names.handle(event);
        }
    }

    fn list(pods: Vec<PodRecord>) -> Vec<watcher::Event<PodRecord>> {
        std::iter::once(watcher::Event::Init)
            .chain(pods.into_iter().map(watcher::Event::InitApply))
            .chain([watcher::Event::InitDone])
            .collect()
    }

    #[test]
    fn a_list_names_every_pod_when_it_completes() {
        let names = PodNames::new();
        assert!(!names.listed());
        send(
            &names,
            [
                watcher::Event::Init,
                watcher::Event::InitApply(pod("u1", "default", "web")),
            ],
        );
        // Not before the list is complete.
        assert_eq!(named(&names, "u1"), None);
        send(&names, [watcher::Event::InitDone]);
        assert!(names.listed());
        assert_eq!(named(&names, "u1"), pair("default", "web"));
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn applied_and_deleted_pods() {
        let names = PodNames::new();
        send(&names, list(vec![]));
        send(&names, [watcher::Event::Apply(pod("u1", "default", "web"))]);
        assert_eq!(named(&names, "u1"), pair("default", "web"));
        send(&names, [watcher::Event::Apply(pod("u2", "team", "job"))]);
        send(
            &names,
            [watcher::Event::Delete(pod("u1", "default", "web"))],
        );
        assert_eq!(named(&names, "u1"), None);
        assert_eq!(named(&names, "u2"), pair("team", "job"));
        // Deleting an unknown pod is no error.
        send(
            &names,
            [watcher::Event::Delete(pod("u9", "default", "gone"))],
        );
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn a_relist_keeps_the_old_view_until_done_and_then_replaces_it() {
        let names = PodNames::new();
        send(
            &names,
            list(vec![
                pod("u1", "default", "web"),
                pod("u2", "default", "db"),
            ]),
        );
        // The watch restarts (410 Gone, or the API server came back): u1 was deleted meanwhile.
        send(
            &names,
            [
                watcher::Event::Init,
                watcher::Event::InitApply(pod("u2", "default", "db")),
            ],
        );
        assert_eq!(
            named(&names, "u1"),
            pair("default", "web"),
            "the old view answers"
        );
        send(
            &names,
            [watcher::Event::InitApply(pod("u3", "default", "new"))],
        );
        assert_eq!(named(&names, "u3"), None);
        send(&names, [watcher::Event::InitDone]);
        assert_eq!(named(&names, "u1"), None);
        assert_eq!(named(&names, "u2"), pair("default", "db"));
        assert_eq!(named(&names, "u3"), pair("default", "new"));
    }

    #[test]
    fn a_static_pod_is_found_by_its_config_hash() {
        let names = PodNames::new();
        let hash = "d41d8cd98f00b204e9800998ecf8427e";
        send(&names, list(vec![mirror("m1", hash, "kube-proxy-node1")]));
        assert_eq!(named(&names, hash), pair("kube-system", "kube-proxy-node1"));
        assert_eq!(named(&names, "m1"), pair("kube-system", "kube-proxy-node1"));
        // The mirror pod is recreated (new UID, same hash), the new one seen first.
        send(
            &names,
            [watcher::Event::Apply(mirror(
                "m2",
                hash,
                "kube-proxy-node1",
            ))],
        );
        send(
            &names,
            [watcher::Event::Delete(mirror(
                "m1",
                hash,
                "kube-proxy-node1",
            ))],
        );
        assert_eq!(named(&names, hash), pair("kube-system", "kube-proxy-node1"));
        send(
            &names,
            [watcher::Event::Delete(mirror(
                "m2",
                hash,
                "kube-proxy-node1",
            ))],
        );
        assert_eq!(named(&names, hash), None);
        // After a relist too.
        send(&names, list(vec![mirror("m3", hash, "kube-proxy-node1")]));
        assert_eq!(named(&names, hash), pair("kube-system", "kube-proxy-node1"));
        send(&names, list(vec![]));
        assert_eq!(named(&names, hash), None);
    }

    #[test]
    fn records_come_from_metadata_and_annotations() {
        let meta = ObjectMeta {
            uid: Some("m1".to_owned()),
            namespace: Some("kube-system".to_owned()),
            name: Some("etcd-node1".to_owned()),
            annotations: Some(BTreeMap::from([(
                CONFIG_MIRROR_ANNOTATION.to_owned(),
                "abc".to_owned(),
            )])),
            ..ObjectMeta::default()
        };
        assert_eq!(
            PodRecord::from_meta(&meta),
            Some(mirror("m1", "abc", "etcd-node1"))
        );
        let both = ObjectMeta {
            annotations: Some(BTreeMap::from([
                (CONFIG_MIRROR_ANNOTATION.to_owned(), "abc".to_owned()),
                (CONFIG_HASH_ANNOTATION.to_owned(), "def".to_owned()),
            ])),
            ..meta.clone()
        };
        assert_eq!(
            PodRecord::from_meta(&both).and_then(|pod| pod.config_hash),
            Some("def".to_owned())
        );
        let plain = ObjectMeta {
            annotations: None,
            ..meta.clone()
        };
        assert_eq!(
            PodRecord::from_meta(&plain),
            Some(pod("m1", "kube-system", "etcd-node1"))
        );
        let nameless = ObjectMeta { uid: None, ..meta };
        assert_eq!(PodRecord::from_meta(&nameless), None);
    }

    #[test]
    fn the_watch_selects_the_nodes_pods_and_needs_its_name() {
        assert_eq!(
            node_selector("node-1").expect("a selector"),
            "spec.nodeName=node-1"
        );
        let error = node_selector("").expect_err("an empty node name selects unscheduled pods");
        assert!(matches!(error, PodsError::NoNodeName));
        assert!(error.to_string().contains("NODE_NAME"), "{error}");
    }

    #[test]
    fn each_kind_of_failure_is_logged_once_per_outage() {
        let refused = kube::core::Status::failure("pods is forbidden", "Forbidden").with_code(403);
        let gone =
            kube::core::Status::failure("too old resource version", "Expired").with_code(410);
        let kinds = [
            watcher::Error::InitialListFailed(kube::Error::Api(refused.clone().boxed())),
            watcher::Error::WatchError(refused.boxed()),
            watcher::Error::InitialListFailed(kube::Error::Api(gone.clone().boxed())),
            watcher::Error::WatchStartFailed(kube::Error::Api(gone.clone().boxed())),
            watcher::Error::WatchError(gone.boxed()),
            watcher::Error::NoResourceVersion,
        ]
        .iter()
        .map(FailureKind::of)
        .collect::<Vec<_>>();
        assert_eq!(
            kinds,
            [
                FailureKind::Forbidden,
                FailureKind::Forbidden,
                FailureKind::List,
                FailureKind::WatchStart,
                FailureKind::Watch,
                FailureKind::NoResourceVersion,
            ]
        );
        let mut failures = Failures::default();
        assert!(!failures.recovered(), "nothing failed yet");
        assert!(failures.first(FailureKind::List));
        assert!(!failures.first(FailureKind::List));
        assert!(failures.first(FailureKind::Forbidden));
        assert!(failures.recovered());
        assert!(!failures.recovered());
        assert!(failures.first(FailureKind::List), "a new outage logs again");
    }
}
