//! Connected sockets steered under an older decision: whether a connected DNS socket's peer is
//! still where its listener's route points, and if not, which way it must move.
//!
//! connect decides a connected socket's peer once. A resolver that keeps its socket (c-ares with
//! `ARES_FLAG_STAYOPEN`, nginx) would otherwise stay on a dead or hung cache, or on an upstream
//! long after the cache is back. The egress program refuses the next send of such a socket; the
//! resolver sees the error, opens a new socket, and connect steers that one to the current route.

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

/// Where a connected socket's peer stands against its listener's route now.
///
/// - `on_cache`: the peer is the listener's cache address and port.
/// - `in_pool`: the peer is a target of the listener's pool.
/// - `pool_len`: the pool's size. With an empty pool nothing is moved towards it: new sockets
///   meet the empty-pool policy, and a socket already open keeps what it has rather than being
///   refused for nothing better.
/// - `first_send`: this is the socket's first datagram since connect chose its peer.
///
/// An upstream peer that is still in the pool stays even if the socket's hash would pick another
/// target of a changed pool: a socket moves only when its peer is wrong, never to rebalance.
///
/// The first datagram of a socket on an upstream goes there even when the route is the cache
/// again. A resolver that opens a socket per query (glibc) and connected it the moment before
/// the failback would fail a query for nothing: the upstream answers it. A socket that sends
/// again is one that is kept, and it moves at that send. Towards the upstream pool nothing is
/// spared: the cache is dead or hung, and a target that left the pool is going away, so the send
/// would be lost and the refusal makes the resolver ask again at once.
#[inline(always)]
#[must_use]
pub const fn standing(
    route: Route,
    on_cache: bool,
    in_pool: bool,
    pool_len: u32,
    first_send: bool,
) -> Standing {
    match route {
        Route::Cache if on_cache || first_send => Standing::Current,
        Route::Cache => Standing::MoveToCache,
        Route::Upstream if pool_len == 0 || (in_pool && !on_cache) => Standing::Current,
        Route::Upstream => Standing::MoveToUpstream,
    }
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
    fn the_first_send_of_a_socket_on_an_upstream_goes_there_after_failback() {
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
    fn the_first_send_to_a_dead_cache_or_a_target_gone_from_the_pool_is_refused() {
        assert_eq!(
            standing(Route::Upstream, true, false, 2, true),
            Standing::MoveToUpstream
        );
        assert_eq!(
            standing(Route::Upstream, false, false, 2, true),
            Standing::MoveToUpstream
        );
    }
}
