//! What the agent serves, made without a kernel: a listener as the maps would show it.

use std::net::IpAddr;

use redirector::telemetry::snapshot::{CounterSnapshot, FlipCounts, ListenerSnapshot, PoolTarget};

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
