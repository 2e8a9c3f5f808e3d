//! Connected sockets steered under an older decision: whether a connected DNS socket's peer is
//! still where its listener's route points, and if not, which way it must move.
//!
//! connect decides a connected socket's peer once. A resolver that keeps its socket (c-ares with
//! `ARES_FLAG_STAYOPEN`, nginx) would otherwise stay on a dead or hung cache, or on an upstream
//! long after the cache is back. The egress program refuses the next send of such a socket (after
//! a failback, once the socket is past a short grace); the resolver sees the error, opens a new
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

/// How long a socket whose peer connect chose may stay on an upstream once the route is the
/// cache again: 1 s, CLOCK_MONOTONIC. Longer than a resolver takes from its connect to its first
/// datagrams (glibc sends A and AAAA at once, by `sendmmsg`), shorter than any failover takes
/// to confirm the cache and fail back.
pub const FAILBACK_GRACE_NS: u64 = 1_000_000_000;

/// Where a connected socket's peer stands against its listener's route now.
///
/// - `on_cache`: the peer is the listener's cache address and port.
/// - `in_pool`: the peer is a target of the listener's pool (read only when the route is the
///   upstream pool, as is `pool_len`).
/// - `pool_len`: the pool's size. With an empty pool nothing is moved towards it: new sockets
///   meet the empty-pool policy, and a socket already open keeps what it has rather than being
///   refused for nothing better.
/// - `fresh`: connect chose the socket's peer less than [`FAILBACK_GRACE_NS`] ago.
///
/// An upstream peer that is still in the pool stays even if the socket's hash would pick another
/// target of a changed pool: a socket moves only when its peer is wrong, never to rebalance.
///
/// A fresh socket on an upstream keeps it after a failback: the upstream answers it, and a
/// resolver with a socket per query (glibc) that connected the moment before the failback would
/// otherwise have its query refused for nothing, and fail it unless it tries again. A socket
/// that is kept moves at its first send after the grace. Towards the upstream pool nothing is
/// spared: the cache is dead or hung, and a target that left the pool is going away, so the send
/// would be lost, and the refusal makes the resolver ask again at once.
#[inline(always)]
#[must_use]
pub const fn standing(
    route: Route,
    on_cache: bool,
    in_pool: bool,
    pool_len: u32,
    fresh: bool,
) -> Standing {
    match route {
        Route::Cache if on_cache || fresh => Standing::Current,
        Route::Cache => Standing::MoveToCache,
        Route::Upstream if pool_len == 0 || (in_pool && !on_cache) => Standing::Current,
        Route::Upstream => Standing::MoveToUpstream,
    }
}

/// Whether a socket steered at `steered_ns` is fresh at `now_ns` (both CLOCK_MONOTONIC).
#[inline(always)]
#[must_use]
pub const fn is_fresh(steered_ns: u64, now_ns: u64) -> bool {
    now_ns.saturating_sub(steered_ns) < FAILBACK_GRACE_NS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_on_the_current_route_stays() {
        assert_eq!(
            standing(Route::Cache, true, false, 2, false),
            Standing::Current
        );
        assert_eq!(
            standing(Route::Upstream, false, true, 2, false),
            Standing::Current
        );
    }

    #[test]
    fn a_socket_on_the_cache_moves_when_the_route_is_upstream() {
        assert_eq!(
            standing(Route::Upstream, true, false, 2, false),
            Standing::MoveToUpstream
        );
        // A cache address that is also a pool target is still the cache.
        assert_eq!(
            standing(Route::Upstream, true, true, 2, false),
            Standing::MoveToUpstream
        );
    }

    #[test]
    fn a_socket_off_the_cache_moves_back_when_the_route_is_the_cache() {
        // An upstream target, or the listener address left untouched (empty pool, `pass`).
        assert_eq!(
            standing(Route::Cache, false, true, 2, false),
            Standing::MoveToCache
        );
        assert_eq!(
            standing(Route::Cache, false, false, 0, false),
            Standing::MoveToCache
        );
    }

    #[test]
    fn a_target_that_left_the_pool_moves_to_one_in_it() {
        assert_eq!(
            standing(Route::Upstream, false, false, 2, false),
            Standing::MoveToUpstream
        );
    }

    #[test]
    fn nothing_moves_towards_an_empty_pool() {
        assert_eq!(
            standing(Route::Upstream, true, false, 0, false),
            Standing::Current
        );
        assert_eq!(
            standing(Route::Upstream, false, false, 0, false),
            Standing::Current
        );
    }

    #[test]
    fn a_fresh_socket_on_an_upstream_stays_there_after_failback() {
        assert_eq!(
            standing(Route::Cache, false, true, 2, true),
            Standing::Current
        );
        assert_eq!(
            standing(Route::Cache, false, true, 2, false),
            Standing::MoveToCache
        );
    }

    #[test]
    fn a_fresh_socket_on_a_dead_cache_or_a_target_gone_from_the_pool_moves() {
        assert_eq!(
            standing(Route::Upstream, true, false, 2, true),
            Standing::MoveToUpstream
        );
        assert_eq!(
            standing(Route::Upstream, false, false, 2, true),
            Standing::MoveToUpstream
        );
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
