//! Kubernetes Events on this node's Node object when a listener's route changes: `DNSFailover`
//! (Warning) when its DNS leaves the cache, `DNSFailback` (Normal) when it returns; and
//! `DNSUpstreamsRefused` (Warning) when a source offers upstreams that cannot be used at all (an
//! EndpointSlice without a DNS port); and `DNSRateLimited` (Warning) when the rate limit first
//! holds a workload back, so that `kubectl describe node` and event-based alerting see what the
//! metrics see.
//!
//! Published off the control loop, by one task fed through a bounded queue: an API server that
//! is slow or down never delays a probe or a pool write, and a change that finds the queue full
//! is dropped (and logged) rather than waited for. kube-runtime's `Recorder` turns a repeat of
//! the same event within minutes into a series on one Event (a PATCH) instead of a new object.
//! It tells events apart by reason, reporting instance and object, not by message, so each
//! listener has a recorder (and a reporting instance, `redirector-NODE-LISTENER`) of its own:
//! with one, the failovers of three listeners at once became one Event counting 3, naming the
//! first listener only (seen in the test).
//!
//! Like the kubelet's own Node events, the reference names the Node by name and gives its name
//! as its uid (the agent never reads the Node object, so it does not know the real uid, and
//! `kubectl describe node` looks events up that way), and the Events land in `default`: the API
//! server puts Events about cluster-scoped objects there.

use std::{collections::HashMap, net::IpAddr, sync::Arc};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use redirector_common::{
    listener::{Reason, Route},
    settings::EmptyPoolPolicy,
};
use tokio::{sync::mpsc, task::JoinHandle};
use tracing::{debug, warn};

use super::{
    snapshot::reason_text,
    stats::{AgentStats, ErrorKind},
};

/// `reportingController` of every Event.
pub const REPORTING_CONTROLLER: &str = "redirector";
/// Reason of an Event for DNS that left its cache.
pub const FAILOVER: &str = "DNSFailover";
/// Reason of an Event for DNS back at its cache.
pub const FAILBACK: &str = "DNSFailback";
/// Reason of an Event for upstreams a source offered and redirector refused wholesale (an
/// EndpointSlice without a usable DNS port).
pub const UPSTREAMS_REFUSED: &str = "DNSUpstreamsRefused";
/// Reason of an Event for a workload the rate limit held back for the first time.
pub const RATE_LIMITED: &str = "DNSRateLimited";
/// Changes waiting for the API server before new ones are dropped.
const QUEUE: usize = 64;
/// The recorder key (and reporting instance suffix) of Events about pools, not listeners.
const POOLS: &str = "pools";
/// The recorder key of Events about workloads.
const WORKLOADS: &str = "workloads";

/// A workload the rate limit held back for the first time since the agent started.
#[derive(Clone, Debug, PartialEq)]
pub struct Limited {
    /// Its name (`pod/NAMESPACE/NAME`, `pod/UID`, `unit/NAME`, a path).
    pub workload: String,
    /// The limit: queries per second.
    pub qps: u32,
    /// The limit's burst.
    pub burst: u32,
    /// Its queries refused per second over the window the agent saw it in.
    pub refused_per_second: f64,
}

/// What a source offered that redirector refused as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The source (`kubernetes`).
    pub source: &'static str,
    /// What it offered (`EndpointSlice kube-dns-abcde`).
    pub offered: String,
    /// Why it was refused (`no DNS port`).
    pub reason: &'static str,
}

/// What one Event on the Node reports.
#[derive(Clone, Debug, PartialEq)]
enum NodeEvent {
    Route(RouteChange),
    Refused(Refusal),
    Limited(Limited),
}

/// One listener's change of route, as the control loop saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteChange {
    /// The listener's name.
    pub listener: String,
    /// Its address.
    pub address: IpAddr,
    /// The route now.
    pub to: Route,
    /// Why.
    pub reason: Reason,
    /// Targets in the kernel's upstream pool at the change.
    pub upstreams: u32,
    /// What the listener does when that pool is empty.
    pub empty_pool: EmptyPoolPolicy,
}

/// The task publishing Events, and its queue.
#[derive(Debug)]
pub struct NodeEvents {
    queue: mpsc::Sender<NodeEvent>,
    task: JoinHandle<()>,
}

impl NodeEvents {
    /// Starts publishing Events about the Node `node` through `client`.
    #[must_use]
    pub fn start(client: kube::Client, node: &str, stats: Arc<AgentStats>) -> Self {
        let (queue, changes) = mpsc::channel(QUEUE);
        let task = tokio::spawn(publish(client, node.to_owned(), changes, stats));
        Self { queue, task }
    }

    /// Queues an Event for `change`; drops it when the queue is full.
    pub fn route_changed(&self, change: RouteChange) {
        if let Err(error) = self.queue.try_send(NodeEvent::Route(change)) {
            warn!(error = %error, "the API server is behind: an Event about a route change is dropped");
        }
    }

    /// Queues an Event for `refusal`; drops it when the queue is full.
    pub fn refused(&self, refusal: Refusal) {
        if let Err(error) = self.queue.try_send(NodeEvent::Refused(refusal)) {
            warn!(error = %error, "the API server is behind: an Event about refused upstreams is dropped");
        }
    }

    /// A handle that queues Events from another task.
    #[must_use]
    pub fn queue(&self) -> EventQueue {
        EventQueue(self.queue.clone())
    }

    /// Stops publishing (what is queued is dropped).
    pub fn stop(&self) {
        self.task.abort();
    }
}

/// Queues Events from a task other than the control loop's.
#[derive(Clone, Debug)]
pub struct EventQueue(mpsc::Sender<NodeEvent>);

impl EventQueue {
    /// Queues an Event for `limited`; drops it when the queue is full.
    pub fn limited(&self, limited: Limited) {
        if let Err(error) = self.0.try_send(NodeEvent::Limited(limited)) {
            warn!(error = %error, "the API server is behind: an Event about a rate-limited workload is dropped");
        }
    }
}

/// The Node `node`, as the kubelet refers to it in its own Events.
fn node_reference(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Node".to_owned()),
        name: Some(node.to_owned()),
        uid: Some(node.to_owned()),
        ..ObjectReference::default()
    }
}

/// The Event for `change`.
#[must_use]
pub fn event_for(change: &RouteChange) -> Event {
    let (type_, reason, goes) = match (change.to, change.upstreams, change.empty_pool) {
        (Route::Upstream, 0, EmptyPoolPolicy::Pass) => (
            EventType::Warning,
            FAILOVER,
            "the listener address untouched, as the upstream pool is empty (policy pass)"
                .to_owned(),
        ),
        (Route::Upstream, 0, EmptyPoolPolicy::Fail) => (
            EventType::Warning,
            FAILOVER,
            "nowhere: queries fail at once, as the upstream pool is empty (policy fail)".to_owned(),
        ),
        (Route::Upstream, 1, _) => (
            EventType::Warning,
            FAILOVER,
            "the upstream pool (1 target)".to_owned(),
        ),
        (Route::Upstream, upstreams, _) => (
            EventType::Warning,
            FAILOVER,
            format!("the upstream pool ({upstreams} targets)"),
        ),
        (Route::Cache, _, _) => (EventType::Normal, FAILBACK, "the cache".to_owned()),
    };
    Event {
        type_,
        reason: reason.to_owned(),
        note: Some(format!(
            "listener {} ({}): DNS goes to {goes}: {}",
            change.listener,
            change.address,
            reason_text(change.reason)
        )),
        action: "SteerDNS".to_owned(),
        secondary: None,
    }
}

/// The Event for `refusal`.
#[must_use]
pub fn refusal_event(refusal: &Refusal) -> Event {
    Event {
        type_: EventType::Warning,
        reason: UPSTREAMS_REFUSED.to_owned(),
        note: Some(format!(
            "{} offered {}, refused ({}): none of its endpoints is in an upstream pool",
            refusal.source, refusal.offered, refusal.reason
        )),
        action: "SyncPool".to_owned(),
        secondary: None,
    }
}

/// The Event for `limited`.
#[must_use]
pub fn limited_event(limited: &Limited) -> Event {
    Event {
        type_: EventType::Warning,
        reason: RATE_LIMITED.to_owned(),
        note: Some(format!(
            "{} asks for DNS faster than {} queries/s (burst {}): {:.0} queries/s over it are \
             refused at the syscall (ECONNREFUSED, or EPERM before Linux 6.1), which resolvers \
             take as \"try again\"; `redirector top --sort limited` on this node shows it",
            limited.workload, limited.qps, limited.burst, limited.refused_per_second
        )),
        action: "LimitDNS".to_owned(),
        secondary: None,
    }
}

/// Who reports the Events of `listener` on `node`.
fn reporter(node: &str, listener: &str) -> Reporter {
    Reporter {
        controller: REPORTING_CONTROLLER.to_owned(),
        instance: Some(format!("{REPORTING_CONTROLLER}-{node}-{listener}")),
    }
}

async fn publish(
    client: kube::Client,
    node: String,
    mut changes: mpsc::Receiver<NodeEvent>,
    stats: Arc<AgentStats>,
) {
    let reference = node_reference(&node);
    let mut recorders: HashMap<String, Recorder> = HashMap::new();
    while let Some(change) = changes.recv().await {
        let (about, event) = match &change {
            NodeEvent::Route(change) => (change.listener.as_str(), event_for(change)),
            NodeEvent::Refused(refusal) => (POOLS, refusal_event(refusal)),
            NodeEvent::Limited(limited) => (WORKLOADS, limited_event(limited)),
        };
        let recorder = recorders
            .entry(about.to_owned())
            .or_insert_with(|| Recorder::new(client.clone(), reporter(&node, about)));
        match recorder.publish(&event, &reference).await {
            Ok(()) => {
                debug!(about, reason = %event.reason, "published an Event on the Node");
            }
            Err(error) => {
                // Forbidden: the RBAC of deploy/kubernetes/node-events is not applied.
                warn!(about, reason = %event.reason, error = %error, "cannot publish an Event on the Node (the agent needs create and patch on events.k8s.io events in the default namespace: deploy/kubernetes/node-events)");
                stats.record_error(ErrorKind::KubeApi);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_slice_is_a_warning_naming_it_and_why() {
        let event = refusal_event(&Refusal {
            source: "kubernetes",
            offered: "EndpointSlice kube-dns-abcde".to_owned(),
            reason: "no DNS port",
        });
        assert_eq!(event.type_, EventType::Warning);
        assert_eq!(event.reason, UPSTREAMS_REFUSED);
        assert_eq!(
            event.note.as_deref(),
            Some(
                "kubernetes offered EndpointSlice kube-dns-abcde, refused (no DNS port): none of its endpoints is in an upstream pool"
            )
        );
    }

    #[test]
    fn a_limited_workload_is_a_warning_naming_it_and_the_limit() {
        let event = limited_event(&Limited {
            workload: "pod/default/crawler-0".to_owned(),
            qps: 200,
            burst: 400,
            refused_per_second: 1234.4,
        });
        assert_eq!(event.type_, EventType::Warning);
        assert_eq!(event.reason, RATE_LIMITED);
        let note = event.note.expect("a note");
        assert!(
            note.starts_with(
                "pod/default/crawler-0 asks for DNS faster than 200 queries/s (burst 400): 1234 \
                 queries/s over it are refused"
            ),
            "{note}"
        );
    }

    #[test]
    fn failover_is_a_warning_and_failback_normal_each_saying_why() {
        let change = RouteChange {
            listener: "node".to_owned(),
            address: "169.254.10.10".parse().expect("an address"),
            to: Route::Upstream,
            reason: Reason::NoSockets,
            upstreams: 2,
            empty_pool: EmptyPoolPolicy::Pass,
        };
        let event = event_for(&change);
        assert_eq!(event.type_, EventType::Warning);
        assert_eq!(event.reason, FAILOVER);
        let note = event.note.expect("a note");
        assert!(
            note.starts_with(
                "listener node (169.254.10.10): DNS goes to the upstream pool (2 targets): "
            ),
            "{note}"
        );
        assert!(note.ends_with(reason_text(Reason::NoSockets)), "{note}");
        // An empty pool: the Event says what its policy does instead of naming a pool.
        for (policy, says) in [
            (
                EmptyPoolPolicy::Pass,
                "DNS goes to the listener address untouched",
            ),
            (
                EmptyPoolPolicy::Fail,
                "DNS goes to nowhere: queries fail at once",
            ),
        ] {
            let note = event_for(&RouteChange {
                upstreams: 0,
                empty_pool: policy,
                ..change.clone()
            })
            .note
            .expect("a note");
            assert!(note.contains(says), "{policy:?}: {note}");
            assert!(!note.contains("target"), "{note}");
        }
        let one = event_for(&RouteChange {
            upstreams: 1,
            ..change.clone()
        })
        .note
        .expect("a note");
        assert!(one.contains("the upstream pool (1 target): "), "{one}");
        let back = event_for(&RouteChange {
            to: Route::Cache,
            reason: Reason::Healthy,
            ..change
        });
        assert_eq!(back.type_, EventType::Normal);
        assert_eq!(back.reason, FAILBACK);
        let reference = node_reference("node-a");
        assert_eq!(reference.kind.as_deref(), Some("Node"));
        assert_eq!(reference.uid.as_deref(), Some("node-a"));
        assert_eq!(
            reference.namespace, None,
            "Events about a Node go to default"
        );
    }
}
