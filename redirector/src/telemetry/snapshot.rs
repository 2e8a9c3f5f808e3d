//! One listener's state as the pinned maps hold it: what `status` prints and `/metrics` exports.
//! Read from the maps alone, so it is true whether or not an agent runs.

use std::net::{IpAddr, SocketAddr};

use redirector_common::{
    addr::port_from_be,
    listener::{HEALTH_DOWN, HEALTH_UP, LIVENESS_PROBES, Reason, Route},
    settings::{EmptyPoolPolicy, Mode},
};
use serde::Serialize;

use crate::datapath::{DatapathError, ListenerTotals, Maps};

/// A listener as the kernel sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ListenerSnapshot {
    /// The id indexing its per-listener state.
    pub id: u32,
    /// Its name.
    pub name: String,
    /// Its address.
    pub address: IpAddr,
    /// Where DNS goes while the cache serves.
    pub cache: SocketAddr,
    /// `auto`, `cache` or `upstream` (`redirector state`).
    pub mode: &'static str,
    /// Where DNS goes now: `cache` or `upstream`.
    pub route: &'static str,
    /// Why, for people.
    pub reason: &'static str,
    /// Why, as a metrics label (`healthy`, `no_sockets`, ...).
    pub reason_code: &'static str,
    /// The cache's sockets the kernel counts (UDP, TCP); `None` when liveness is probes only.
    pub cache_sockets: Option<(i64, i64)>,
    /// The agent's probe verdict on the cache.
    pub probe_verdict: &'static str,
    /// The upstream pool.
    pub pool: Vec<PoolTarget>,
    /// What an empty pool does: `pass` or `fail`.
    pub empty_pool: &'static str,
    /// Decisions and rewrites since the maps were created, per protocol.
    pub counters: CounterSnapshot,
    /// The kernel's own moves of the listener upstream, and the drains, since the maps were
    /// created.
    pub flips: FlipCounts,
}

/// The kernel's flips of one listener by reason, since the maps were created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FlipCounts {
    /// A terminating signal to the cache (one per thread that saw it).
    pub signalled: u64,
    /// The cache left a query unread past its stall limit.
    pub stalled: u64,
    /// `redirector drain`.
    pub drained: u64,
}

/// One upstream target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PoolTarget {
    /// Its address.
    pub address: IpAddr,
    /// Its UDP port.
    pub udp_port: u16,
    /// Its TCP port.
    pub tcp_port: u16,
}

/// Counters of one protocol.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProtocolCounters {
    /// Sent to the cache.
    pub to_cache: u64,
    /// Sent to an upstream.
    pub to_upstream: u64,
    /// Left untouched (empty pool, policy `pass`).
    pub passed_through: u64,
    /// Failed at once (empty pool, policy `fail`).
    pub failed_empty_pool: u64,
    /// Left untouched (a skipped cgroup).
    pub skipped_cgroup: u64,
    /// Replies shown as coming from the listener.
    pub replies_rewritten: u64,
    /// Replies on a steered socket with no translation left.
    pub reply_misses: u64,
    /// Connected sockets refused a send so they reconnect to the cache.
    pub moved_to_cache: u64,
    /// Connected sockets refused a send so they reconnect to the upstream pool.
    pub moved_to_upstream: u64,
}

/// Counters of both protocols.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CounterSnapshot {
    /// UDP.
    pub udp: ProtocolCounters,
    /// TCP.
    pub tcp: ProtocolCounters,
}

impl From<ListenerTotals> for CounterSnapshot {
    fn from(totals: ListenerTotals) -> Self {
        let row = |counters: redirector_common::counters::ListenerCounters| ProtocolCounters {
            to_cache: counters.to_cache,
            to_upstream: counters.to_upstream,
            passed_through: counters.passed_through,
            failed_empty_pool: counters.failed_empty_pool,
            skipped_cgroup: counters.skipped_cgroup,
            replies_rewritten: counters.reverse_translated,
            reply_misses: counters.reverse_missed,
            moved_to_cache: counters.moved_to_cache,
            moved_to_upstream: counters.moved_to_upstream,
        };
        Self {
            udp: row(totals.udp),
            tcp: row(totals.tcp),
        }
    }
}

/// The name of a route.
#[must_use]
pub fn route_name(route: Route) -> &'static str {
    match route {
        Route::Cache => "cache",
        Route::Upstream => "upstream",
    }
}

/// A reason as operators read it.
#[must_use]
pub fn reason_text(reason: Reason) -> &'static str {
    match reason {
        Reason::Override => "operator override",
        Reason::NoSockets => "the cache has no socket",
        Reason::ProbesFailing => "the cache fails its probes",
        Reason::AwaitingConfirmation => "the cache is back, awaiting its probes",
        Reason::Unprobed => "the cache has no verdict yet",
        Reason::Signalled => "the cache was told to stop, awaiting its next life",
        Reason::Stalled => "the cache left a query unread, awaiting its probes",
        Reason::Drained => "drained, until the cache's next life is confirmed",
        Reason::Healthy => "the cache is healthy",
    }
}

/// The name of a reason in metrics labels.
#[must_use]
pub const fn reason_label(reason: Reason) -> &'static str {
    match reason {
        Reason::Override => "override",
        Reason::NoSockets => "no_sockets",
        Reason::ProbesFailing => "probes_failing",
        Reason::AwaitingConfirmation => "awaiting_confirmation",
        Reason::Unprobed => "unprobed",
        Reason::Signalled => "signalled",
        Reason::Stalled => "stalled",
        Reason::Drained => "drained",
        Reason::Healthy => "healthy",
    }
}

/// The name of a raw probe verdict (`CacheHealth::verdict`).
#[must_use]
pub fn verdict_name(verdict: u32) -> &'static str {
    match verdict {
        HEALTH_UP => "up",
        HEALTH_DOWN => "down",
        _ => "unknown",
    }
}

/// The name of a raw mode; a value this build does not know is `auto`, as the programs read it.
#[must_use]
pub fn mode_name(mode: u32) -> &'static str {
    Mode::try_from(mode).unwrap_or_default().label()
}

/// Every listener in the maps, by id.
pub fn listeners(maps: &Maps) -> Result<Vec<ListenerSnapshot>, DatapathError> {
    let mut snapshots = Vec::new();
    for (id, info) in maps.listeners()? {
        let Some(name) = info.name() else {
            continue;
        };
        let address = IpAddr::from(info.addr);
        // The address entry is written last and removed first: no entry, no listener (yet).
        let Some(config) = maps.listener_config(address)? else {
            continue;
        };
        let mode = maps.mode(id)?;
        let health = maps.health(id)?;
        let counts = maps.socket_counts(id)?;
        let (route, reason) = maps.route(id, config.liveness)?;
        let pool = maps
            .pool(id)?
            .targets()
            .iter()
            .map(|target| PoolTarget {
                address: IpAddr::from(target.addr),
                udp_port: port_from_be(target.udp_port_be),
                tcp_port: port_from_be(target.tcp_port_be),
            })
            .collect();
        snapshots.push(ListenerSnapshot {
            id,
            name: name.to_owned(),
            address,
            cache: SocketAddr::new(
                IpAddr::from(config.cache.addr),
                port_from_be(config.cache.udp_port_be),
            ),
            mode: mode_name(mode.mode),
            route: route_name(route),
            reason: reason_text(reason),
            reason_code: reason_label(reason),
            cache_sockets: (config.liveness != LIVENESS_PROBES).then_some((counts.udp, counts.tcp)),
            probe_verdict: verdict_name(health.verdict),
            pool,
            // A value this build does not know is `pass`, as the programs read it.
            empty_pool: EmptyPoolPolicy::try_from(config.empty_pool_policy)
                .unwrap_or_default()
                .label(),
            counters: maps.counters(id)?.into(),
            flips: {
                let activity = maps.cache_activity(id)?;
                FlipCounts {
                    signalled: activity.signalled,
                    stalled: activity.stalled,
                    drained: activity.drained,
                }
            },
        });
    }
    Ok(snapshots)
}
