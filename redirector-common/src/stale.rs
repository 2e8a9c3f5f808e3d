//! Connected sockets steered under an older decision: whether a connected DNS socket's peer is
//! still where its listener's route points, and if not, which way it must move.
//!
//! connect decides a connected socket's peer once. A resolver that keeps its socket (c-ares with
//! `ARES_FLAG_STAYOPEN`, nginx) would otherwise stay on a dead or hung cache, or on an upstream
//! long after the cache is back. The egress program refuses the next send of such a socket (after
//! a failback or a drain, once past a short grace); the resolver sees the error, opens a new
//! socket, and connect steers that one to the current route.

use crate::listener::Route;

/// What the egress program does with a connected DNS socket's datagram.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Standing {
    /// The peer is where a connect would send it now: the datagram goes.
    Current,
    /// The route is the cache and the peer is not: refuse, so the socket reconnects to the cache.
    MoveToCache,
    /// The route is the upstream pool and the peer is the cache, or a target no longer in the
    /// pool: refuse, so the socket reconnects to a target of the pool.
    MoveToUpstream,
}

/// A grace that keeps a connected socket where it is although the route changed: either
/// spares a resolver that connected the moment before the change, whose first send would
/// otherwise be refused on its way to a server that still answers it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Grace {
    /// No grace: the socket is judged by its peer alone.
    None,
    /// connect chose the socket's peer (an upstream) less than [`FAILBACK_GRACE_NS`] ago, and the
    /// route is the cache again.
    Connected,
    /// The listener routes upstream only because its cache was drained (`redirector drain`), less
    /// than [`DRAIN_GRACE_NS`] ago: the drained cache still serves.
    Drained,
}

/// How long a socket whose peer connect chose may stay on an upstream once the route is the
/// cache again: 1 s, CLOCK_MONOTONIC. Longer than a resolver takes from its connect to its first
/// datagrams (glibc sends A and AAAA at once, by `sendmmsg`), shorter than any failover takes
/// to confirm the cache and fail back.
pub const FAILBACK_GRACE_NS: u64 = 1_000_000_000;

/// How long after a drain a socket connected to the cache may still send there: 250 ms,
/// CLOCK_MONOTONIC. A resolver that connected the moment before the drain sends within it (also
/// from a CPU-throttled pod, held back for the rest of a 100 ms CFS period, the default), and a
/// drain's wait outlasts it (`redirector drain --wait` never returns sooner), so what the cache
/// is handed meanwhile is read and answered before it may be stopped. Short, because a socket
/// kept on the cache goes on sending there for the grace.
pub const DRAIN_GRACE_NS: u64 = 250_000_000;

/// Where a connected socket's peer stands against its listener's route now.
///
/// - `on_cache`: the peer is the listener's cache address and port.
/// - `in_pool`: the peer is a target of the listener's pool (read only when the route is the
///   upstream pool, as is `pool_len`).
/// - `pool_len`: the pool's size. With an empty pool nothing is moved towards it: new sockets
///   meet the empty-pool policy, and a socket already open keeps what it has rather than being
///   refused for nothing better.
/// - `grace`: whether a [`Grace`] applies.
///
/// An upstream peer that is still in the pool stays even if the socket's hash would pick another
/// target of a changed pool: a socket moves only when its peer is wrong, never to rebalance.
///
/// A socket that connected to an upstream moments before a failback keeps it: the upstream
/// answers it, and a resolver with a socket per query (glibc) that connected the moment before
/// would otherwise have its query refused for nothing, and fail it unless it tries again. So
/// does a socket on the cache moments after a drain: the drained cache answers it. A socket that
/// is kept moves at its first send after the grace. Towards the upstream pool nothing else is
/// spared: a cache that died, hung or was told to stop may lose the send (a signalled cache may
/// exit at once), and a target that left the pool is going away, so the refusal, which makes the
/// resolver ask again at once, is the safer answer.
#[inline(always)]
#[must_use]
pub const fn standing(
    route: Route,
    on_cache: bool,
    in_pool: bool,
    pool_len: u32,
    grace: Grace,
) -> Standing {
    match (route, grace) {
        (Route::Cache, Grace::Connected) => Standing::Current,
        (Route::Cache, _) if on_cache => Standing::Current,
        (Route::Cache, _) => Standing::MoveToCache,
        (Route::Upstream, _) if pool_len == 0 || (in_pool && !on_cache) => Standing::Current,
        (Route::Upstream, Grace::Drained) if on_cache => Standing::Current,
        (Route::Upstream, _) => Standing::MoveToUpstream,
    }
}

/// Whether a socket steered at `steered_ns` is fresh at `now_ns` (both CLOCK_MONOTONIC).
#[inline(always)]
#[must_use]
pub const fn is_fresh(steered_ns: u64, now_ns: u64) -> bool {
    now_ns.saturating_sub(steered_ns) < FAILBACK_GRACE_NS
}

/// Whether a listener drained at `drained_ns` is still in the drain's grace at `now_ns` (both
/// CLOCK_MONOTONIC; a clock read on another CPU may be behind the drain's: in the grace).
#[inline(always)]
#[must_use]
pub const fn in_drain_grace(drained_ns: u64, now_ns: u64) -> bool {
    now_ns.saturating_sub(drained_ns) < DRAIN_GRACE_NS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_on_the_current_route_stays() {
        assert_eq!(
            standing(Route::Cache, true, false, 2, Grace::None),
            Standing::Current
        );
        assert_eq!(
            standing(Route::Upstream, false, true, 2, Grace::None),
            Standing::Current
        );
    }

    #[test]
    fn a_socket_on_the_cache_moves_when_the_route_is_upstream() {
        assert_eq!(
            standing(Route::Upstream, true, false, 2, Grace::None),
            Standing::MoveToUpstream
        );
        // A cache address that is also a pool target is still the cache.
        assert_eq!(
            standing(Route::Upstream, true, true, 2, Grace::None),
            Standing::MoveToUpstream
        );
    }

    #[test]
    fn a_socket_off_the_cache_moves_back_when_the_route_is_the_cache() {
        // An upstream target, or the listener address left untouched (empty pool, `pass`).
        assert_eq!(
            standing(Route::Cache, false, true, 2, Grace::None),
            Standing::MoveToCache
        );
        assert_eq!(
            standing(Route::Cache, false, false, 0, Grace::None),
            Standing::MoveToCache
        );
    }

    #[test]
    fn a_target_that_left_the_pool_moves_to_one_in_it() {
        assert_eq!(
            standing(Route::Upstream, false, false, 2, Grace::None),
            Standing::MoveToUpstream
        );
    }

    #[test]
    fn nothing_moves_towards_an_empty_pool() {
        assert_eq!(
            standing(Route::Upstream, true, false, 0, Grace::None),
            Standing::Current
        );
        assert_eq!(
            standing(Route::Upstream, false, false, 0, Grace::None),
            Standing::Current
        );
    }

    #[test]
    fn a_fresh_socket_on_an_upstream_stays_there_after_failback() {
        assert_eq!(
            standing(Route::Cache, false, true, 2, Grace::Connected),
            Standing::Current
        );
        assert_eq!(
            standing(Route::Cache, false, true, 2, Grace::None),
            Standing::MoveToCache
        );
    }

    #[test]
    fn a_fresh_socket_on_a_dead_cache_or_a_target_gone_from_the_pool_moves() {
        assert_eq!(
            standing(Route::Upstream, true, false, 2, Grace::Connected),
            Standing::MoveToUpstream
        );
        assert_eq!(
            standing(Route::Upstream, false, false, 2, Grace::Connected),
            Standing::MoveToUpstream
        );
    }

    #[test]
    fn a_socket_on_a_cache_drained_moments_ago_stays_there() {
        assert_eq!(
            standing(Route::Upstream, true, false, 2, Grace::Drained),
            Standing::Current
        );
        // Past the grace it moves; a target gone from the pool moves in the grace too.
        assert_eq!(
            standing(Route::Upstream, true, false, 2, Grace::None),
            Standing::MoveToUpstream
        );
        assert_eq!(
            standing(Route::Upstream, false, false, 2, Grace::Drained),
            Standing::MoveToUpstream
        );
        // A drain's grace never keeps a socket off the cache once the route is the cache.
        assert_eq!(
            standing(Route::Cache, false, true, 2, Grace::Drained),
            Standing::MoveToCache
        );
    }

    #[test]
    fn a_drain_is_in_its_grace_for_the_grace_only() {
        assert!(in_drain_grace(100, 100));
        assert!(in_drain_grace(100, 100 + DRAIN_GRACE_NS - 1));
        assert!(!in_drain_grace(100, 100 + DRAIN_GRACE_NS));
        // A clock read before the drain's (another CPU) is in the grace.
        assert!(in_drain_grace(100, 50));
    }

    #[test]
    fn a_socket_is_fresh_for_the_grace_only() {
        assert!(is_fresh(100, 100));
        assert!(is_fresh(100, 100 + FAILBACK_GRACE_NS - 1));
        assert!(!is_fresh(100, 100 + FAILBACK_GRACE_NS));
        // A time before the steering (another CPU's clock read) is fresh.
        assert!(is_fresh(100, 50));
    }
}
