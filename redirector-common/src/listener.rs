//! Listeners: the addresses clients send DNS to, and the state that decides where it goes.

use crate::{addr::NetAddr, pool::Target};

/// Most listeners one datapath serves (ids are `0..MAX_LISTENERS`).
pub const MAX_LISTENERS: usize = 64;
/// Longest listener name kept in `ListenerInfo`, in bytes.
pub const LISTENER_NAME_MAX: usize = 32;

/// `ListenerConfig::empty_pool_policy`: the upstream pool is empty, let the syscall through to
/// the listener address untouched.
pub const EMPTY_POOL_PASS: u32 = 0;
/// `ListenerConfig::empty_pool_policy`: the upstream pool is empty, fail the syscall with
/// `EHOSTUNREACH` at once, so the resolver moves on instead of waiting for a timeout.
pub const EMPTY_POOL_FAIL: u32 = 1;

/// `ListenerConfig::liveness`: the cache's sockets are counted in the kernel (it runs in the
/// observed network namespace) and its health is probed; losing its last UDP socket fails the
/// listener over at once.
pub const LIVENESS_SOCKETS_AND_PROBES: u32 = 0;
/// `ListenerConfig::liveness`: only probes judge the cache (its sockets are not visible, e.g. it
/// runs in another network namespace).
pub const LIVENESS_PROBES: u32 = 1;

/// Value of `LISTENERS`, keyed by the listener address (`NetAddr`). Written by the agent only.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ListenerConfig {
    /// Index of this listener in the per-listener maps.
    pub id: u32,
    /// `EMPTY_POOL_PASS` or `EMPTY_POOL_FAIL`.
    pub empty_pool_policy: u32,
    /// Where DNS goes while the cache serves (often the listener address itself, port 53).
    pub cache: Target,
    /// `LIVENESS_SOCKETS_AND_PROBES` or `LIVENESS_PROBES`.
    pub liveness: u32,
}
const _: () = assert!(size_of::<ListenerConfig>() == 32);

/// `ListenerMode::mode`: follow the cache's health.
pub const MODE_AUTO: u32 = 0;
/// `ListenerMode::mode`: operator override, always the cache.
pub const MODE_CACHE: u32 = 1;
/// `ListenerMode::mode`: operator override, always the upstream pool.
pub const MODE_UPSTREAM: u32 = 2;

/// Value of `LISTENER_MODE`, indexed by listener id: the operator's override. Written by the CLI
/// only, and kept across agent restarts.
///
/// Each listener's state is split by writer (`LISTENER_MODE`, `CACHE_HEALTH`): userspace replaces
/// an array element whole, so two writers of one element would lose each other's updates. Array
/// lookups are inlined by the verifier, so the split costs the programs nothing.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ListenerMode {
    /// `MODE_AUTO`, `MODE_CACHE` or `MODE_UPSTREAM`.
    pub mode: u32,
}
const _: () = assert!(size_of::<ListenerMode>() == 4);

/// `CacheHealth::verdict`: nobody has judged the cache yet. A zeroed entry reads as this, so a
/// listener whose verdict was never written (or was reset) gets no DNS sent to its cache.
pub const HEALTH_UNKNOWN: u32 = 0;
/// `CacheHealth::verdict`: the cache is serving.
pub const HEALTH_UP: u32 = 1;
/// `CacheHealth::verdict`: the cache is not serving.
pub const HEALTH_DOWN: u32 = 2;

/// Value of `CACHE_HEALTH`, indexed by listener id: the agent's judgement of the cache, from its
/// probes. Written by the agent only.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CacheHealth {
    /// `HEALTH_UNKNOWN`, `HEALTH_UP` or `HEALTH_DOWN`.
    pub verdict: u32,
    /// Zero.
    pub _padding: u32,
    /// The `SocketCounts::down_epoch` this verdict was reached in. After the kernel saw the
    /// cache's sockets vanish (and bumped the epoch), an older "up" no longer counts: the cache
    /// gets traffic back only once the agent's probes confirm it in the new epoch, so a cache
    /// that binds before it can answer never receives queries.
    pub confirmed_epoch: u64,
}
const _: () = assert!(size_of::<CacheHealth>() == 16);

/// Value of `SOCKET_COUNTS`, indexed by listener id: the cache's live sockets on its address and
/// port, one for each of its entries in `CACHE_SOCKETS`. The map is mmapable: the kernel programs
/// and the agent (seeding sockets that existed before it, removing ones gone unseen) change it
/// only with atomic adds, so neither loses the other's updates.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SocketCounts {
    /// Live UDP sockets. Signed, and anything at or below zero means none: a bug can never make
    /// a wrapped count look like a live cache.
    pub udp: i64,
    /// Live TCP sockets (bound or listening; accepted connections are not counted).
    pub tcp: i64,
    /// Incremented every time the UDP count falls to zero, and when a process that bound the
    /// cache's sockets is delivered a terminating signal (the signal program; once per thread
    /// that sees it): a new life of the cache begins after it, which the agent's probes must
    /// confirm before the cache gets DNS again. One death may so count more than once.
    pub down_epoch: u64,
}
const _: () = assert!(size_of::<SocketCounts>() == 24);

/// Where a listener's DNS goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Route {
    /// To `ListenerConfig::cache`.
    Cache,
    /// To a target of the listener's upstream pool.
    Upstream,
}

/// Why a listener routes where it does.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Reason {
    /// The operator forced it (`redirector state`).
    Override,
    /// The cache has no UDP socket left (seen by the kernel).
    NoSockets,
    /// The agent's probes find the cache not answering.
    ProbesFailing,
    /// The cache's sockets came back after it went away; the probes have not confirmed it yet.
    AwaitingConfirmation,
    /// No verdict on the cache has been written yet (or it was reset).
    Unprobed,
    /// A process that bound the cache's sockets was told to stop (the signal program); the probes
    /// have not confirmed a cache since.
    Signalled,
    /// The cache left a query unread past its stall limit (the programs); the probes have not
    /// confirmed it since.
    Stalled,
    /// Drained for planned work (`redirector drain`), until the cache's next life is confirmed.
    Drained,
    /// The cache serves.
    Healthy,
}

/// The routing truth table, with its reason. The operator's override wins; in `auto`, the cache
/// gets DNS only when every source of truth agrees it serves. A mode this build does not know
/// counts as `auto`: never a reason to lose DNS.
///
/// | mode       | UDP sockets¹ | probe verdict | confirmed epoch¹   | route    | reason                 |
/// |------------|--------------|---------------|--------------------|----------|------------------------|
/// | `cache`    | any          | any           | any                | cache    | override               |
/// | `upstream` | any          | any           | any                | upstream | override               |
/// | `auto`     | none         | any           | any                | upstream | no sockets             |
/// | `auto`     | some         | down          | any                | upstream | probes failing         |
/// | `auto`     | some         | unknown²      | any                | upstream | unprobed               |
/// | `auto`     | some         | up            | ≠ `down_epoch`     | upstream | awaiting confirmation  |
/// | `auto`     | some         | up            | = `down_epoch`     | cache    | healthy                |
///
/// ¹ Only with `LIVENESS_SOCKETS_AND_PROBES`; with `LIVENESS_PROBES` these columns are ignored.
/// ² `HEALTH_UNKNOWN`, or a value this build does not know.
#[inline(always)]
#[must_use]
pub const fn explain(
    config_liveness: u32,
    mode: &ListenerMode,
    health: &CacheHealth,
    sockets: &SocketCounts,
) -> (Route, Reason) {
    match mode.mode {
        MODE_CACHE => return (Route::Cache, Reason::Override),
        MODE_UPSTREAM => return (Route::Upstream, Reason::Override),
        _ => {}
    }
    let tracks_sockets = config_liveness == LIVENESS_SOCKETS_AND_PROBES;
    if tracks_sockets && sockets.udp <= 0 {
        return (Route::Upstream, Reason::NoSockets);
    }
    if health.verdict == HEALTH_DOWN {
        return (Route::Upstream, Reason::ProbesFailing);
    }
    if health.verdict != HEALTH_UP {
        return (Route::Upstream, Reason::Unprobed);
    }
    if tracks_sockets && health.confirmed_epoch != sockets.down_epoch {
        return (Route::Upstream, Reason::AwaitingConfirmation);
    }
    (Route::Cache, Reason::Healthy)
}

/// The route alone (what the programs need).
#[inline(always)]
#[must_use]
pub const fn route(
    config_liveness: u32,
    mode: &ListenerMode,
    health: &CacheHealth,
    sockets: &SocketCounts,
) -> Route {
    explain(config_liveness, mode, health, sockets).0
}

/// Value of `LISTENER_INFO`, indexed by listener id: what the CLI shows. The programs never read
/// it. An all-zero entry is an unused id.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ListenerInfo {
    /// The listener's name, UTF-8, zero-padded.
    pub name: [u8; LISTENER_NAME_MAX],
    /// The listener address (the key of its `LISTENERS` entry).
    pub addr: NetAddr,
    /// 1 when this id is in use.
    pub in_use: u32,
}
const _: () = assert!(size_of::<ListenerInfo>() == 52);

impl ListenerInfo {
    /// The name as text, or `None` when it is not UTF-8.
    #[must_use]
    pub fn name(&self) -> Option<&str> {
        let len = self
            .name
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(self.name.len());
        core::str::from_utf8(&self.name[..len]).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOCKETS: u32 = LIVENESS_SOCKETS_AND_PROBES;

    fn health(verdict: u32, confirmed_epoch: u64) -> CacheHealth {
        CacheHealth {
            verdict,
            _padding: 0,
            confirmed_epoch,
        }
    }

    fn sockets(udp: i64, down_epoch: u64) -> SocketCounts {
        SocketCounts {
            udp,
            tcp: 0,
            down_epoch,
        }
    }

    fn mode(mode: u32) -> ListenerMode {
        ListenerMode { mode }
    }

    #[test]
    fn routing_truth_table() {
        let alive = sockets(2, 5);
        let dead = sockets(0, 6);
        let cases = [
            (
                mode(MODE_CACHE),
                health(HEALTH_DOWN, 0),
                dead,
                Route::Cache,
                Reason::Override,
            ),
            (
                mode(MODE_UPSTREAM),
                health(HEALTH_UP, 5),
                alive,
                Route::Upstream,
                Reason::Override,
            ),
            (
                mode(MODE_AUTO),
                health(HEALTH_UP, 5),
                dead,
                Route::Upstream,
                Reason::NoSockets,
            ),
            (
                mode(MODE_AUTO),
                health(HEALTH_DOWN, 5),
                alive,
                Route::Upstream,
                Reason::ProbesFailing,
            ),
            (
                mode(MODE_AUTO),
                health(HEALTH_UP, 4),
                alive,
                Route::Upstream,
                Reason::AwaitingConfirmation,
            ),
            (
                mode(MODE_AUTO),
                health(HEALTH_UP, 5),
                alive,
                Route::Cache,
                Reason::Healthy,
            ),
        ];
        for (mode, health, sockets, route, reason) in cases {
            assert_eq!(
                explain(SOCKETS, &mode, &health, &sockets),
                (route, reason),
                "{mode:?} {health:?} {sockets:?}"
            );
        }
    }

    #[test]
    fn negative_counts_mean_no_sockets() {
        assert_eq!(
            explain(
                SOCKETS,
                &mode(MODE_AUTO),
                &health(HEALTH_UP, 0),
                &sockets(-1, 0)
            ),
            (Route::Upstream, Reason::NoSockets)
        );
    }

    #[test]
    fn probes_only_liveness_ignores_sockets_and_epochs() {
        let nothing = sockets(0, 9);
        assert_eq!(
            explain(
                LIVENESS_PROBES,
                &mode(MODE_AUTO),
                &health(HEALTH_UP, 0),
                &nothing
            ),
            (Route::Cache, Reason::Healthy)
        );
        assert_eq!(
            explain(
                LIVENESS_PROBES,
                &mode(MODE_AUTO),
                &health(HEALTH_DOWN, 0),
                &nothing
            ),
            (Route::Upstream, Reason::ProbesFailing)
        );
    }

    #[test]
    fn unknown_mode_is_auto() {
        assert_eq!(
            route(SOCKETS, &mode(77), &health(HEALTH_UP, 1), &sockets(1, 1)),
            Route::Cache
        );
        assert_eq!(
            route(SOCKETS, &mode(77), &health(HEALTH_UP, 1), &sockets(0, 2)),
            Route::Upstream
        );
    }

    #[test]
    fn a_zeroed_or_unknown_verdict_sends_no_dns_to_the_cache() {
        for verdict in [HEALTH_UNKNOWN, 77] {
            for liveness in [SOCKETS, LIVENESS_PROBES] {
                assert_eq!(
                    explain(
                        liveness,
                        &mode(MODE_AUTO),
                        &health(verdict, 5),
                        &sockets(2, 5)
                    ),
                    (Route::Upstream, Reason::Unprobed),
                    "verdict {verdict}, liveness {liveness}"
                );
            }
        }
        assert_eq!(CacheHealth::default().verdict, HEALTH_UNKNOWN);
    }

    #[test]
    fn a_fresh_listener_without_sockets_goes_upstream() {
        // Zeroed maps: nothing counted yet means no cache to send to.
        assert_eq!(
            explain(
                SOCKETS,
                &ListenerMode::default(),
                &CacheHealth::default(),
                &SocketCounts::default()
            ),
            (Route::Upstream, Reason::NoSockets)
        );
    }

    #[test]
    fn info_name_stops_at_the_padding() {
        let mut name = [0u8; LISTENER_NAME_MAX];
        name[..4].copy_from_slice(b"node");
        let info = ListenerInfo {
            name,
            addr: NetAddr::default(),
            in_use: 1,
        };
        assert_eq!(info.name(), Some("node"));
    }
}
