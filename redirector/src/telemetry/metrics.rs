//! `/metrics`: Prometheus text, built at each scrape from the kernel's maps (counters, routes,
//! socket counts, pools) and what the agent observed (transitions, probes, syncs, errors).
//! Building a registry per scrape keeps every kernel-derived value exactly as the maps hold it,
//! with no copy to keep in step; scrapes come seconds apart and cost a few map reads.

use std::{sync::atomic::AtomicU64, time::SystemTime};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::{Registry, Unit},
};

use redirector_common::listener::Reason;

use super::snapshot::{ListenerSnapshot, ProtocolCounters, reason_label};

/// Every reason's label, so that each listener has one stable series per reason.
const REASONS: [&str; 9] = [
    reason_label(Reason::Override),
    reason_label(Reason::NoSockets),
    reason_label(Reason::ProbesFailing),
    reason_label(Reason::AwaitingConfirmation),
    reason_label(Reason::Unprobed),
    reason_label(Reason::Signalled),
    reason_label(Reason::Stalled),
    reason_label(Reason::Drained),
    reason_label(Reason::Healthy),
];
use super::stats::{AgentStats, ErrorKind};

type Labels = Vec<(&'static str, String)>;
type CounterFamily = Family<Labels, Counter>;
type GaugeFamily = Family<Labels, Gauge>;
type SecondsCounter = Family<Labels, Counter<f64, AtomicU64>>;
type SecondsGauge = Family<Labels, Gauge<f64, AtomicU64>>;

fn labels(pairs: &[(&'static str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(key, value)| (*key, (*value).to_owned()))
        .collect()
}

/// Renders every metric as of `now` (the scrape's time: what ages are measured to).
/// `listeners` from [`super::snapshot::listeners`].
#[must_use]
pub fn render(listeners: &[ListenerSnapshot], stats: &AgentStats, now: SystemTime) -> String {
    let mut registry = Registry::with_prefix("redirector");

    let build = GaugeFamily::default();
    registry.register(
        "build_info",
        "The running agent's release, the commit it was built from, the layout of pins it \
         reads, and its node's name (NODE_NAME, else the hostname)",
        build.clone(),
    );
    build
        .get_or_create(&labels(&[
            ("version", crate::release::VERSION),
            ("commit", crate::release::COMMIT),
            ("layout", &crate::release::LAYOUT.to_string()),
            ("node", stats.node()),
        ]))
        .set(1);
    let ready = Gauge::<i64>::default();
    registry.register(
        "ready",
        "1 once the programs are attached and every upstream pool was synced once",
        ready.clone(),
    );
    ready.set(i64::from(stats.is_ready()));

    register_listeners(&mut registry, listeners, stats);
    register_agent(&mut registry, stats, now);
    if let Some(view) = stats.workloads() {
        register_workloads(&mut registry, &view);
    }

    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut text, &registry);
    text
}

/// DNS per workload: the node's totals, and the busiest workloads' rates with the rest summed
/// under `workload="other"`, so that a node has at most `workloads.top + 1` workloads' series
/// whatever its number of pods.
fn register_workloads(registry: &mut Registry, view: &crate::workloads::View) {
    use crate::workloads::{RCODE_LABELS, ROUTE_LABELS};
    let queries = CounterFamily::default();
    registry.register(
        "workload_queries",
        "DNS queries of the node's workloads (the caches and the agent left out), by route: \
         cache, upstream, refused (the `fail` policy), direct (a server that is no listener, or \
         a listener left untouched), limited (over the workload's rate)",
        queries.clone(),
    );
    let replies = CounterFamily::default();
    registry.register(
        "workload_replies",
        "DNS replies delivered to the node's workloads, by rcode class: noerror, nxdomain, \
         servfail, refused, other",
        replies.clone(),
    );
    for (route, total) in ROUTE_LABELS.iter().zip(view.queries_total) {
        queries
            .get_or_create(&labels(&[("route", route)]))
            .inc_by(total);
    }
    for (rcode, total) in RCODE_LABELS.iter().zip(view.replies_total) {
        replies
            .get_or_create(&labels(&[("rcode", rcode)]))
            .inc_by(total);
    }
    let tracked = Gauge::<i64>::default();
    registry.register(
        "workloads_tracked",
        "cgroups whose DNS the kernel counts now (at most workloads.tracked)",
        tracked.clone(),
    );
    tracked.set(i64::try_from(view.tracked).unwrap_or(i64::MAX));
    let query_rate = SecondsGauge::default();
    registry.register(
        "workload_query_rate",
        "Queries per second over the agent's last window, of the workloads.top busiest \
         workloads by route, and of all others summed (workload=\"other\")",
        query_rate.clone(),
    );
    let reply_rate = SecondsGauge::default();
    registry.register(
        "workload_reply_rate",
        "Replies per second over the agent's last window, of the same workloads by rcode class",
        reply_rate.clone(),
    );
    let other = crate::workloads::Name {
        workload: "other".to_owned(),
        ..crate::workloads::Name::default()
    };
    let unnamed = crate::workloads::Name::default();
    let rows = view
        .top
        .busiest
        .iter()
        .map(|rate| (view.names.get(&rate.cgroup).unwrap_or(&unnamed), rate))
        .chain(view.top.rest.iter().map(|rate| (&other, rate)));
    for (name, rate) in rows {
        let workload = [
            ("workload", name.workload.as_str()),
            ("namespace", name.namespace.as_str()),
            ("pod", name.pod.as_str()),
        ];
        for (route, per_second) in ROUTE_LABELS.iter().zip(rate.queries) {
            let mut series = labels(&workload);
            series.push(("route", (*route).to_owned()));
            query_rate.get_or_create(&series).set(per_second);
        }
        for (rcode, per_second) in RCODE_LABELS.iter().zip(rate.replies) {
            let mut series = labels(&workload);
            series.push(("rcode", (*rcode).to_owned()));
            reply_rate.get_or_create(&series).set(per_second);
        }
    }
}

/// What the kernel's maps say, per listener.
fn register_listeners(registry: &mut Registry, listeners: &[ListenerSnapshot], stats: &AgentStats) {
    let decisions = CounterFamily::default();
    registry.register(
        "steering_decisions",
        "DNS syscalls (connect, unconnected send) to a listener, by where the programs sent them: \
         cache, upstream, pass (empty pool, policy pass), fail (empty pool, policy fail), \
         skipped (a skipped cgroup)",
        decisions.clone(),
    );
    let rewritten = CounterFamily::default();
    registry.register(
        "replies_rewritten",
        "Replies (recvmsg) and peer lookups (getpeername) shown as coming from the listener",
        rewritten.clone(),
    );
    let misses = CounterFamily::default();
    registry.register(
        "reply_rewrite_misses",
        "Replies on a steered socket with no translation left (evicted, or a direct server)",
        misses.clone(),
    );
    let moved = CounterFamily::default();
    registry.register(
        "sockets_moved",
        "Sends of connected DNS sockets refused so that the resolver reconnects to where the \
         listener's route points now: to the cache, or to the upstream pool",
        moved.clone(),
    );
    let route = GaugeFamily::default();
    registry.register(
        "listener_route",
        "1 for where a listener's DNS goes now: route cache or upstream",
        route.clone(),
    );
    let reason = GaugeFamily::default();
    registry.register(
        "listener_reason",
        "1 for why a listener's DNS goes where it goes",
        reason.clone(),
    );
    let sockets = GaugeFamily::default();
    registry.register(
        "cache_sockets",
        "The cache's sockets the kernel counts, by protocol",
        sockets.clone(),
    );
    let backends = GaugeFamily::default();
    registry.register(
        "pool_backends",
        "Upstream targets in a listener's pool, with the pool's source (static, kubernetes, \
         resolv.conf): a static pool configured empty is no fault",
        backends.clone(),
    );
    let flips = CounterFamily::default();
    registry.register(
        "kernel_flips",
        "Moves of a listener upstream the kernel made itself, by reason: signalled (a terminating \
         signal to the cache, counted once per thread that saw it), stalled (the cache left a \
         query unread past its limit); and drained (redirector drain)",
        flips.clone(),
    );
    let failover = SecondsCounter::default();
    registry.register_with_unit(
        "failover",
        "Time a listener spent routed away from its cache since the agent started",
        Unit::Seconds,
        failover.clone(),
    );

    for listener in listeners {
        let family = if listener.address.is_ipv4() {
            "ipv4"
        } else {
            "ipv6"
        };
        let name = listener.name.as_str();
        for (protocol, counters) in [
            ("udp", listener.counters.udp),
            ("tcp", listener.counters.tcp),
        ] {
            let ProtocolCounters {
                to_cache,
                to_upstream,
                passed_through,
                failed_empty_pool,
                skipped_cgroup,
                replies_rewritten,
                reply_misses,
                moved_to_cache,
                moved_to_upstream,
            } = counters;
            for (decision, count) in [
                ("cache", to_cache),
                ("upstream", to_upstream),
                ("pass", passed_through),
                ("fail", failed_empty_pool),
                ("skipped", skipped_cgroup),
            ] {
                decisions
                    .get_or_create(&labels(&[
                        ("listener", name),
                        ("family", family),
                        ("protocol", protocol),
                        ("decision", decision),
                    ]))
                    .inc_by(count);
            }
            let per_protocol = labels(&[
                ("listener", name),
                ("family", family),
                ("protocol", protocol),
            ]);
            rewritten
                .get_or_create(&per_protocol)
                .inc_by(replies_rewritten);
            misses.get_or_create(&per_protocol).inc_by(reply_misses);
            for (direction, count) in [("cache", moved_to_cache), ("upstream", moved_to_upstream)] {
                moved
                    .get_or_create(&labels(&[
                        ("listener", name),
                        ("family", family),
                        ("protocol", protocol),
                        ("to", direction),
                    ]))
                    .inc_by(count);
            }
        }
        for candidate in ["cache", "upstream"] {
            route
                .get_or_create(&labels(&[("listener", name), ("route", candidate)]))
                .set(i64::from(candidate == listener.route));
        }
        for candidate in REASONS {
            reason
                .get_or_create(&labels(&[("listener", name), ("reason", candidate)]))
                .set(i64::from(candidate == listener.reason_code));
        }
        if let Some((udp, tcp)) = listener.cache_sockets {
            for (protocol, count) in [("udp", udp), ("tcp", tcp)] {
                sockets
                    .get_or_create(&labels(&[("listener", name), ("protocol", protocol)]))
                    .set(count.max(0));
            }
        }
        for (reason, count) in [
            ("signalled", listener.flips.signalled),
            ("stalled", listener.flips.stalled),
            ("drained", listener.flips.drained),
        ] {
            flips
                .get_or_create(&labels(&[("listener", name), ("reason", reason)]))
                .inc_by(count);
        }
        backends
            .get_or_create(&labels(&[
                ("listener", name),
                ("source", stats.pool_source(name).unwrap_or("unknown")),
            ]))
            .set(i64::try_from(listener.pool.len()).unwrap_or(i64::MAX));
        failover
            .get_or_create(&labels(&[("listener", name)]))
            .inc_by(stats.failover_time(name).as_secs_f64());
    }
}

/// What the agent observed.
fn register_agent(registry: &mut Registry, stats: &AgentStats, now: SystemTime) {
    let transitions = CounterFamily::default();
    registry.register(
        "route_transitions",
        "Route changes of a listener, by cause (no_sockets, probes_failing, override, healthy, ...)",
        transitions.clone(),
    );
    for ((listener, reason), count) in stats.transitions_by_reason() {
        transitions
            .get_or_create(&labels(&[
                ("listener", &listener),
                ("cause", reason_label(reason)),
            ]))
            .inc_by(count);
    }

    registry.register_with_unit(
        "probe_duration",
        "Latency of successful probes of a listener's cache",
        Unit::Seconds,
        stats.probe_latency().clone(),
    );
    let probes = CounterFamily::default();
    registry.register(
        "probes",
        "Probes of a listener's cache, by result",
        probes.clone(),
    );
    let degraded = GaugeFamily::default();
    registry.register(
        "kernel_degraded",
        "1 for an optional kernel feature the agent runs without (docs/kernels.md says what is lost), 0 for one it has",
        degraded.clone(),
    );
    let missing = stats.kernel_degraded();
    for feature in crate::sys::kernel_support::FEATURES {
        if let crate::sys::kernel_support::Need::Optional { .. } = feature.need {
            degraded
                .get_or_create(&labels(&[("feature", feature.id)]))
                .set(i64::from(missing.contains(&feature.id)));
        }
    }
    let upstream_up = GaugeFamily::default();
    registry.register(
        "upstream_up",
        "1 while an upstream target of a listener answers its checks (or was never checked), 0 while it is out of the kernel's pool for failing them; checked only while the listener routes upstream",
        upstream_up.clone(),
    );
    for (listener, target, up) in stats.upstream_states() {
        upstream_up
            .get_or_create(&labels(&[("listener", &listener), ("target", &target)]))
            .set(i64::from(up));
    }
    let upstream_checks = CounterFamily::default();
    registry.register(
        "upstream_checks",
        "Checks of a listener's upstream targets while it routes upstream, by result",
        upstream_checks.clone(),
    );
    for (listener, answered, count) in stats.upstream_checks() {
        let result = if answered { "success" } else { "failure" };
        upstream_checks
            .get_or_create(&labels(&[("listener", &listener), ("result", result)]))
            .inc_by(count);
    }
    let left_out = GaugeFamily::default();
    registry.register(
        "pool_upstreams_left_out",
        "Upstreams of a listener's desired pool left out of the kernel's (at most 32); this node keeps its own subset",
        left_out.clone(),
    );
    for (listener, count) in stats.pool_left_out() {
        left_out
            .get_or_create(&labels(&[("listener", &listener)]))
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }
    let servfails = CounterFamily::default();
    registry.register(
        "probe_servfails",
        "Probes the cache answered with SERVFAIL: it serves (counted successful) but its own upstreams fail",
        servfails.clone(),
    );
    for (listener, count) in stats.probe_servfails() {
        servfails
            .get_or_create(&labels(&[("listener", &listener)]))
            .inc_by(count);
    }
    registry.register_with_unit(
        "pool_sync_duration",
        "Time to sync one pool from its source into the kernel",
        Unit::Seconds,
        stats.sync_duration().clone(),
    );
    let syncs = CounterFamily::default();
    registry.register(
        "pool_syncs",
        "Successful pool syncs, by source",
        syncs.clone(),
    );
    let sync_age = SecondsGauge::default();
    registry.register_with_unit(
        "pool_last_sync_age",
        "Time since the last successful pool sync, by source",
        Unit::Seconds,
        sync_age.clone(),
    );
    for (source, synced) in stats.source_syncs() {
        let source_labels = labels(&[("source", source)]);
        syncs.get_or_create(&source_labels).inc_by(synced.count);
        if let Some(last) = synced.last_success {
            let age = now.duration_since(last).unwrap_or_default().as_secs_f64();
            sync_age.get_or_create(&source_labels).set(age);
        }
    }
    let rejections = CounterFamily::default();
    registry.register(
        "upstream_rejections",
        "Addresses a source offered and redirector refused, by reason",
        rejections.clone(),
    );
    for ((source, reason), count) in stats.all_rejections() {
        rejections
            .get_or_create(&labels(&[("source", source), ("reason", reason)]))
            .inc_by(count);
    }
    let errors = CounterFamily::default();
    registry.register(
        "errors",
        "Errors the agent survived, by kind (pool_write, nftables, kube_api, workload_read)",
        errors.clone(),
    );
    let seen = stats.errors();
    for kind in ErrorKind::ALL {
        errors
            .get_or_create(&labels(&[("kind", kind.label())]))
            .inc_by(seen.get(&kind).copied().unwrap_or(0));
    }
    let (bypass, restorations) = stats.conntrack_bypass();
    let active = GaugeFamily::default();
    registry.register(
        "conntrack_bypass_active",
        "1 while the nftables table keeps DNS to the caches out of conntrack",
        active.clone(),
    );
    active
        .get_or_create(&labels(&[("status", bypass.name())]))
        .set(i64::from(
            bypass == crate::conntrack_bypass::BypassStatus::Active,
        ));
    let restored = Counter::<u64>::default();
    registry.register(
        "conntrack_bypass_restorations",
        "Times the bypass table was found changed or removed and restored",
        restored.clone(),
    );
    restored.inc_by(restorations);
    probe_counts(&probes, stats);
}

fn probe_counts(probes: &CounterFamily, stats: &AgentStats) {
    for (listener, alive, count) in stats.probe_counts() {
        probes
            .get_or_create(&labels(&[
                ("listener", &listener),
                ("result", if alive { "success" } else { "failure" }),
            ]))
            .inc_by(count);
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, time::Duration};

    use redirector_common::workloads::{RCODE_CLASSES, ROUTES};

    use super::*;
    use crate::workloads::{
        Name, View,
        rates::{WorkloadRate, top},
    };

    /// The series of `family` in `text`.
    fn series<'a>(text: &'a str, family: &str) -> Vec<&'a str> {
        text.lines()
            .filter(|line| line.starts_with(&format!("{family}{{")))
            .collect()
    }

    #[test]
    fn a_thousand_workloads_are_the_top_n_and_other_in_the_series() {
        let rates: Vec<WorkloadRate> = (1..=1000_u64)
            .map(|cgroup| WorkloadRate {
                cgroup,
                queries: [cgroup as f64; ROUTES],
                replies: [1.0; RCODE_CLASSES],
            })
            .collect();
        let names: HashMap<u64, Name> = (1..=1000_u64)
            .map(|cgroup| {
                (
                    cgroup,
                    Name {
                        workload: format!("pod/ns/web-{cgroup}"),
                        namespace: "ns".to_owned(),
                        pod: format!("web-{cgroup}"),
                    },
                )
            })
            .collect();
        let n = 5;
        let stats = AgentStats::default();
        stats.record_workloads(View {
            top: top(rates, n),
            names,
            tracked: 1000,
            window: Duration::from_secs(10),
            ..View::default()
        });
        let text = render(&[], &stats, SystemTime::now());
        let queries = series(&text, "redirector_workload_query_rate");
        assert_eq!(queries.len(), (n + 1) * ROUTES, "{queries:#?}");
        assert_eq!(
            series(&text, "redirector_workload_reply_rate").len(),
            (n + 1) * RCODE_CLASSES
        );
        assert!(
            queries
                .iter()
                .any(|line| line.contains("workload=\"pod/ns/web-1000\"")),
            "{queries:#?}"
        );
        let other = queries
            .iter()
            .find(|line| line.contains("workload=\"other\"") && line.contains("route=\"cache\""))
            .expect("the rest summed");
        // Workloads 1 to 995, each its id a second on every route.
        assert!(other.ends_with(" 495510.0"), "{other}");
        assert_eq!(
            series(&text, "redirector_workload_queries_total").len(),
            ROUTES
        );
    }
}
