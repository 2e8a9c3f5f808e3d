//! What the agent serves, made without a kernel: a listener as the maps would show it, the
//! workloads as the agent reads them, and the `/metrics` text of an agent that has seen one of
//! everything it counts.

use std::{
    collections::HashMap,
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
    workloads::{
        Name, View,
        rates::{Top, WorkloadRate},
    },
};
use redirector_common::{
    listener::{Reason, Route},
    workloads::{RCODE_CLASSES, ROUTES},
};

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
    stats.record_workloads(workloads_view(
        WorkloadRate {
            cgroup: 1,
            queries: [30.0, 2.0, 0.0, 5.0, 1.0],
            replies: [20.0, 12.0, 1.0, 0.0, 0.0],
        },
        [1_000, 20, 0, 50, 10],
        [900, 300, 10, 0, 0],
    ));
    let listener = healthy_listener(listener, IpAddr::from([10, 96, 0, 10]));
    metrics::render(&[listener], &stats, SystemTime::now())
}

/// The pod the busiest workload is: `shop/checkout-7d9f`, as the API server names it.
pub fn busiest_pod() -> Name {
    Name {
        workload: "pod/shop/checkout-7d9f".to_owned(),
        namespace: "shop".to_owned(),
        pod: "checkout-7d9f".to_owned(),
    }
}

/// What the agent reads of the workloads: `pod` (its rates per second, named [`busiest_pod`])
/// the busiest, another workload asking 100 queries a second through the cache (summed under
/// `workload="other"`), and the node's totals since the agent started. Every route and rcode
/// class is a series of its own, so each is served.
pub fn workloads_view(
    pod: WorkloadRate,
    queries_total: [u64; ROUTES],
    replies_total: [u64; RCODE_CLASSES],
) -> View {
    let rest = WorkloadRate {
        cgroup: 0,
        queries: [100.0, 0.0, 0.0, 0.0, 0.0],
        replies: [100.0, 0.0, 0.0, 0.0, 0.0],
    };
    View {
        names: HashMap::from([(pod.cgroup, busiest_pod())]),
        top: Top {
            busiest: vec![pod],
            rest: Some(rest),
        },
        queries_total,
        replies_total,
        tracked: 40,
        window: Duration::from_secs(10),
    }
}
