//! What the agent serves, made without a kernel: a listener as the maps would show it, and the
//! `/metrics` text of an agent that has seen one of everything it counts.

use std::{
    net::IpAddr,
    time::{Duration, SystemTime},
};

use redirector::{
    conntrack_bypass::BypassStatus,
    telemetry::{
        metrics,
        snapshot::{CounterSnapshot, FlipCounts, ListenerSnapshot, PoolTarget},
        stats::{AgentStats, ErrorKind, Transition},
    },
};
use redirector_common::listener::{Reason, Route};

/// The listener `name` on 169.254.20.10, on its cache, with one upstream target at `target`.
pub fn healthy_listener(name: &str, target: IpAddr) -> ListenerSnapshot {
    ListenerSnapshot {
        id: 0,
        name: name.to_owned(),
        address: IpAddr::from([169, 254, 20, 10]),
        cache: "169.254.20.10:53".parse().expect("an address"),
        mode: "auto",
        route: "cache",
        reason: "the cache serves",
        reason_code: "healthy",
        cache_sockets: Some((2, 2)),
        probe_verdict: "up",
        pool: vec![PoolTarget {
            address: target,
            udp_port: 53,
            tcp_port: 53,
        }],
        empty_pool: "pass",
        counters: CounterSnapshot::default(),
        flips: FlipCounts::default(),
    }
}

/// What the agent serves at `/metrics` with one listener (`node`) and one of each observation,
/// so that every family has a sample (a family without one is not printed).
pub fn metrics_text() -> String {
    let listener = "node";
    let stats = AgentStats::for_node("node-a".to_owned());
    stats.record_transition(Transition {
        listener: listener.to_owned(),
        from: Route::Cache,
        to: Route::Upstream,
        reason: Reason::NoSockets,
        at: SystemTime::now(),
    });
    stats.record_probe(listener, true, Duration::from_millis(1));
    stats.record_probe(listener, false, Duration::from_millis(250));
    stats.record_probe_servfail(listener);
    stats.record_pool_source(listener, "kubernetes");
    stats.record_pool_sync(listener);
    stats.record_pool_left_out(listener, 0);
    stats.record_upstream_check(listener, true);
    stats.record_upstream_state(listener, "10.244.0.5:53", true);
    stats.record_source_sync("kubernetes", Duration::from_millis(1));
    stats.record_source_contact("kubernetes");
    stats.record_rejection("kubernetes", "no DNS port");
    stats.record_error(ErrorKind::KubeApi);
    stats.record_conntrack_bypass(BypassStatus::Active, 1);
    stats.set_ready();
    let listener = healthy_listener(listener, IpAddr::from([10, 96, 0, 10]));
    metrics::render(&[listener], &stats, SystemTime::now())
}
