//! What the agent observed: route transitions with their causes, time spent failed over, probe
//! results, pool syncs per source, errors, the conntrack bypass, readiness and liveness. Shared
//! with the metrics endpoint, `status`-like views and the tests.

use std::{
    collections::HashMap,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use prometheus_client::metrics::{
    family::Family,
    histogram::{Histogram, exponential_buckets},
};
use redirector_common::listener::{Reason, Route};

use crate::conntrack_bypass::BypassStatus;

/// Transitions kept in memory (the oldest are dropped beyond this).
const TRANSITION_LOG: usize = 4096;

/// A change of a listener's route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The listener's name.
    pub listener: String,
    /// The route before.
    pub from: Route,
    /// The route after.
    pub to: Route,
    /// Why it changed.
    pub reason: Reason,
    /// When the agent saw it (kernel-side flips happen earlier, at the last socket's close).
    pub at: SystemTime,
}

/// Kinds of errors the agent survives and counts. Errors while it sets up (attaching, pinning,
/// the listener interface) stop it with a message instead: a half-set-up agent must not run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Writing a pool into the kernel's map failed.
    PoolWrite,
    /// `nft` failed to install or restore the conntrack bypass table.
    Nftables,
    /// A call to the Kubernetes API failed (the EndpointSlice watch, an Event).
    KubeApi,
    /// Reading the workloads' DNS counts from the kernel's maps failed.
    WorkloadRead,
    /// More cgroups were exempt than the kernel's exempt set holds: some were left out.
    ExemptOverflow,
}

impl ErrorKind {
    /// Every kind, in the order metrics list them.
    pub const ALL: [Self; 5] = [
        Self::PoolWrite,
        Self::Nftables,
        Self::KubeApi,
        Self::WorkloadRead,
        Self::ExemptOverflow,
    ];

    /// The `kind` label of `redirector_errors_total`.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::PoolWrite => "pool_write",
            Self::Nftables => "nftables",
            Self::KubeApi => "kube_api",
            Self::WorkloadRead => "workload_read",
            Self::ExemptOverflow => "exempt_overflow",
        }
    }
}

/// The label set of a per-listener histogram.
pub type ListenerLabel = [(&'static str, String); 1];

/// One source's pool syncs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceSyncs {
    /// Successful syncs (a pool written, or found already right).
    pub count: u64,
    /// When the source last answered (`record_source_contact`): the API server listed or sent a
    /// change, resolv.conf was read; a static pool, when it was last written. Not the agent's
    /// own periodic rewrite of the kernel's pools, which succeeds with the source gone.
    pub last_success: Option<SystemTime>,
}

/// The mutable part, under one lock.
#[derive(Debug, Default)]
struct Observations {
    transitions: Vec<Transition>,
    by_reason: HashMap<(String, Reason), u64>,
    probes: HashMap<(String, bool), (u64, Duration)>,
    probe_servfails: HashMap<String, u64>,
    pool_left_out: HashMap<String, usize>,
    /// listener → the source of its pool (`static`, `kubernetes`, `resolv_conf`).
    pool_sources: HashMap<String, &'static str>,
    /// (listener, target) → whether its last checks left it in the pool.
    upstream_up: HashMap<(String, String), bool>,
    /// (listener, answered) → checks of its upstream targets.
    upstream_checks: HashMap<(String, bool), u64>,
    pool_syncs: HashMap<String, u64>,
    pool_writes: HashMap<String, u64>,
    source_syncs: HashMap<&'static str, SourceSyncs>,
    rejections: HashMap<(&'static str, &'static str), u64>,
    errors: HashMap<ErrorKind, u64>,
    /// Per listener: time spent away from the cache before the current episode, and since when
    /// the current one lasts.
    failover: HashMap<String, (Duration, Option<Instant>)>,
    conntrack_bypass: (BypassStatus, u64),
    /// The optional kernel features the agent runs without (`kernel_support` ids).
    kernel_degraded: Vec<&'static str>,
}

/// Counters and logs of one agent.
#[derive(Debug)]
pub struct AgentStats {
    observations: Mutex<Observations>,
    probe_latency: Family<ListenerLabel, Histogram>,
    sync_duration: Family<[(&'static str, &'static str); 1], Histogram>,
    ready: AtomicBool,
    /// Milliseconds since `started` of the control loop's last turn.
    heartbeat_ms: AtomicU64,
    started: Instant,
    /// The node's name (`sources::node_name`), the `node` label of `redirector_build_info`:
    /// what joins the agent's series to an inventory of nodes (kube-state-metrics'
    /// `kube_node_info`) for the alert on a node with no agent.
    node: String,
    /// What the agent last read of the workloads (`None` before its first reading, or with
    /// `workloads.accounting` off).
    workloads: Mutex<Option<crate::workloads::View>>,
}

impl Default for AgentStats {
    fn default() -> Self {
        Self {
            observations: Mutex::default(),
            // 100 µs to about 1.6 s: probes answer in well under a millisecond when healthy.
            probe_latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_1, 2.0, 15))
            }),
            // 10 µs to about 5 s: a pool write is one map update.
            sync_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_01, 3.0, 13))
            }),
            ready: AtomicBool::new(false),
            heartbeat_ms: AtomicU64::new(0),
            started: Instant::now(),
            node: String::new(),
            workloads: Mutex::default(),
        }
    }
}

impl AgentStats {
    /// The statistics of the agent on node `node`.
    #[must_use]
    pub fn for_node(node: String) -> Self {
        Self {
            node,
            ..Self::default()
        }
    }

    /// The node's name (empty where none is known).
    #[must_use]
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Records what the agent read of the workloads.
    pub fn record_workloads(&self, view: crate::workloads::View) {
        *self
            .workloads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(view);
    }

    /// What the agent last read of the workloads.
    #[must_use]
    pub fn workloads(&self) -> Option<crate::workloads::View> {
        self.workloads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn observations(&self) -> MutexGuard<'_, Observations> {
        // A panic while holding the lock must not stop the agent from reporting.
        self.observations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records where a listener's route starts (at the agent's start).
    pub fn record_initial_route(&self, listener: &str, route: Route) {
        let mut observations = self.observations();
        let since = (route != Route::Cache).then(Instant::now);
        observations
            .failover
            .insert(listener.to_owned(), (Duration::ZERO, since));
    }

    /// Records a transition.
    pub fn record_transition(&self, transition: Transition) {
        let mut observations = self.observations();
        *observations
            .by_reason
            .entry((transition.listener.clone(), transition.reason))
            .or_default() += 1;
        let episode = observations
            .failover
            .entry(transition.listener.clone())
            .or_default();
        match (transition.to, episode.1) {
            (Route::Cache, Some(since)) => {
                episode.0 += since.elapsed();
                episode.1 = None;
            }
            (Route::Upstream, None) => episode.1 = Some(Instant::now()),
            _ => {}
        }
        if observations.transitions.len() == TRANSITION_LOG {
            observations.transitions.remove(0);
        }
        observations.transitions.push(transition);
    }

    /// Records a probe result (and its latency when it succeeded).
    pub fn record_probe(&self, listener: &str, alive: bool, latency: Duration) {
        if alive {
            self.probe_latency
                .get_or_create(&[("listener", listener.to_owned())])
                .observe(latency.as_secs_f64());
        }
        let mut observations = self.observations();
        let entry = observations
            .probes
            .entry((listener.to_owned(), alive))
            .or_default();
        entry.0 += 1;
        entry.1 += latency;
    }

    /// Records a probe the cache answered with SERVFAIL (also recorded as alive).
    pub fn record_probe_servfail(&self, listener: &str) {
        *self
            .observations()
            .probe_servfails
            .entry(listener.to_owned())
            .or_default() += 1;
    }

    /// Records that a source changed a listener's desired pool.
    pub fn record_pool_sync(&self, listener: &str) {
        let mut observations = self.observations();
        *observations
            .pool_syncs
            .entry(listener.to_owned())
            .or_default() += 1;
    }

    /// Records where a listener's pool comes from.
    pub fn record_pool_source(&self, listener: &str, source: &'static str) {
        self.observations()
            .pool_sources
            .insert(listener.to_owned(), source);
    }

    /// Where a listener's pool comes from, if recorded.
    #[must_use]
    pub fn pool_source(&self, listener: &str) -> Option<&'static str> {
        self.observations().pool_sources.get(listener).copied()
    }

    /// Records how many upstreams of a listener's desired pool did not fit the kernel's.
    pub fn record_pool_left_out(&self, listener: &str, left_out: usize) {
        self.observations()
            .pool_left_out
            .insert(listener.to_owned(), left_out);
    }

    /// Upstreams left out of each listener's pool as (listener, count).
    #[must_use]
    pub fn pool_left_out(&self) -> Vec<(String, usize)> {
        self.observations()
            .pool_left_out
            .iter()
            .map(|(listener, count)| (listener.clone(), *count))
            .collect()
    }

    /// Records one check of an upstream target of `listener`.
    pub fn record_upstream_check(&self, listener: &str, answered: bool) {
        *self
            .observations()
            .upstream_checks
            .entry((listener.to_owned(), answered))
            .or_default() += 1;
    }

    /// Records whether `target` of `listener` is in its pool (`up`) or out for failing its
    /// checks.
    pub fn record_upstream_state(&self, listener: &str, target: &str, up: bool) {
        self.observations()
            .upstream_up
            .insert((listener.to_owned(), target.to_owned()), up);
    }

    /// Forgets the targets of `listener` other than `kept` (they left its pool).
    pub fn retain_upstreams(&self, listener: &str, kept: &[String]) {
        self.observations()
            .upstream_up
            .retain(|(name, target), _| name != listener || kept.contains(target));
    }

    /// Every checked target: (listener, target, up).
    #[must_use]
    pub fn upstream_states(&self) -> Vec<(String, String, bool)> {
        let mut states: Vec<(String, String, bool)> = self
            .observations()
            .upstream_up
            .iter()
            .map(|((listener, target), up)| (listener.clone(), target.clone(), *up))
            .collect();
        states.sort();
        states
    }

    /// Checks of upstream targets: (listener, answered, count).
    #[must_use]
    pub fn upstream_checks(&self) -> Vec<(String, bool, u64)> {
        self.observations()
            .upstream_checks
            .iter()
            .map(|((listener, answered), count)| (listener.clone(), *answered, *count))
            .collect()
    }

    /// Records a write of a listener's pool into the kernel.
    pub fn record_pool_write(&self, listener: &str) {
        let mut observations = self.observations();
        *observations
            .pool_writes
            .entry(listener.to_owned())
            .or_default() += 1;
    }

    /// Records a successful sync of a pool from `source` into the kernel (written, or found
    /// right) that took `duration`.
    pub fn record_source_sync(&self, source: &'static str, duration: Duration) {
        self.sync_duration
            .get_or_create(&[("source", source)])
            .observe(duration.as_secs_f64());
        let mut observations = self.observations();
        observations.source_syncs.entry(source).or_default().count += 1;
    }

    /// Records that `source` answered now: what `redirector_pool_last_sync_age_seconds`
    /// measures from.
    pub fn record_source_contact(&self, source: &'static str) {
        let mut observations = self.observations();
        observations
            .source_syncs
            .entry(source)
            .or_default()
            .last_success = Some(SystemTime::now());
    }

    /// Records an address a source offered and redirector refused.
    pub fn record_rejection(&self, source: &'static str, reason: &'static str) {
        let mut observations = self.observations();
        *observations.rejections.entry((source, reason)).or_default() += 1;
    }

    /// Records an error the agent survived, by kind.
    pub fn record_error(&self, kind: ErrorKind) {
        let mut observations = self.observations();
        *observations.errors.entry(kind).or_default() += 1;
    }

    /// Records where the conntrack bypass stands and how often its table was restored.
    pub fn record_conntrack_bypass(&self, status: BypassStatus, restorations: u64) {
        let mut observations = self.observations();
        observations.conntrack_bypass = (status, restorations);
    }

    /// Records the optional kernel features the agent runs without (`kernel_support` ids).
    pub fn record_kernel_degraded(&self, features: Vec<&'static str>) {
        self.observations().kernel_degraded = features;
    }

    /// The optional kernel features the agent runs without.
    #[must_use]
    pub fn kernel_degraded(&self) -> Vec<&'static str> {
        self.observations().kernel_degraded.clone()
    }

    /// Marks the agent ready: programs attached and every pool synced once.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    /// Whether the agent is ready.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Records a turn of the control loop.
    pub fn heartbeat(&self) {
        let elapsed = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.heartbeat_ms.store(elapsed, Ordering::Release);
    }

    /// How long ago the control loop last turned.
    #[must_use]
    pub fn since_heartbeat(&self) -> Duration {
        let last = Duration::from_millis(self.heartbeat_ms.load(Ordering::Acquire));
        self.started.elapsed().saturating_sub(last)
    }

    /// Where the conntrack bypass stands and how often its table was restored.
    #[must_use]
    pub fn conntrack_bypass(&self) -> (BypassStatus, u64) {
        self.observations().conntrack_bypass.clone()
    }

    /// How often `listener`'s desired pool changed (source updates that changed it).
    #[must_use]
    pub fn pool_syncs(&self, listener: &str) -> u64 {
        self.observations()
            .pool_syncs
            .get(listener)
            .copied()
            .unwrap_or(0)
    }

    /// How often `listener`'s pool was written into the kernel.
    #[must_use]
    pub fn pool_writes(&self, listener: &str) -> u64 {
        self.observations()
            .pool_writes
            .get(listener)
            .copied()
            .unwrap_or(0)
    }

    /// Each source's syncs.
    #[must_use]
    pub fn source_syncs(&self) -> HashMap<&'static str, SourceSyncs> {
        self.observations().source_syncs.clone()
    }

    /// How many addresses `source` offered that were refused for `reason`.
    #[must_use]
    pub fn rejections(&self, source: &str, reason: &str) -> u64 {
        self.observations()
            .rejections
            .iter()
            .find(|((s, r), _)| *s == source && *r == reason)
            .map_or(0, |(_, count)| *count)
    }

    /// Every refusal count, by (source, reason).
    #[must_use]
    pub fn all_rejections(&self) -> HashMap<(&'static str, &'static str), u64> {
        self.observations().rejections.clone()
    }

    /// Errors survived, by kind.
    #[must_use]
    pub fn errors(&self) -> HashMap<ErrorKind, u64> {
        self.observations().errors.clone()
    }

    /// Every transition of `listener` still in the log, oldest first.
    #[must_use]
    pub fn transitions(&self, listener: &str) -> Vec<Transition> {
        self.observations()
            .transitions
            .iter()
            .filter(|transition| transition.listener == listener)
            .cloned()
            .collect()
    }

    /// Transition counts by (listener, reason).
    #[must_use]
    pub fn transitions_by_reason(&self) -> HashMap<(String, Reason), u64> {
        self.observations().by_reason.clone()
    }

    /// How many transitions of `listener` had `reason`.
    #[must_use]
    pub fn transitions_by(&self, listener: &str, reason: Reason) -> u64 {
        self.observations()
            .by_reason
            .get(&(listener.to_owned(), reason))
            .copied()
            .unwrap_or(0)
    }

    /// How long `listener` has spent routed away from its cache since the agent started.
    #[must_use]
    pub fn failover_time(&self, listener: &str) -> Duration {
        self.observations()
            .failover
            .get(listener)
            .map(|(before, since)| *before + since.map_or(Duration::ZERO, |since| since.elapsed()))
            .unwrap_or_default()
    }

    /// (successful, failed) probes of `listener`.
    #[must_use]
    pub fn probes(&self, listener: &str) -> (u64, u64) {
        let observations = self.observations();
        let count = |alive| {
            observations
                .probes
                .get(&(listener.to_owned(), alive))
                .map_or(0, |(count, _)| *count)
        };
        (count(true), count(false))
    }

    /// Probe counts as (listener, alive, count).
    #[must_use]
    pub fn probe_counts(&self) -> Vec<(String, bool, u64)> {
        self.observations()
            .probes
            .iter()
            .map(|((listener, alive), (count, _))| (listener.clone(), *alive, *count))
            .collect()
    }

    /// Probes answered with SERVFAIL as (listener, count).
    #[must_use]
    pub fn probe_servfails(&self) -> Vec<(String, u64)> {
        self.observations()
            .probe_servfails
            .iter()
            .map(|(listener, count)| (listener.clone(), *count))
            .collect()
    }

    /// The probe latency histograms, by listener.
    #[must_use]
    pub fn probe_latency(&self) -> &Family<ListenerLabel, Histogram> {
        &self.probe_latency
    }

    /// The pool sync duration histograms, by source.
    #[must_use]
    pub fn sync_duration(&self) -> &Family<[(&'static str, &'static str); 1], Histogram> {
        &self.sync_duration
    }
}
