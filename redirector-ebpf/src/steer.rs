//! connect and sendmsg: choose where a listener's DNS goes and rewrite the destination.

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_get_current_ancestor_cgroup_id, bpf_ktime_get_ns, bpf_set_retval},
    programs::SockAddrContext,
};
use aya_log_ebpf::info;
use redirector_common::{
    DNS_PORT,
    activity::explain_flip,
    addr::port_be,
    counters::{ListenerCounters, PROTOCOL_TCP, counter_index},
    datapath::{MAX_CGROUP_LEVEL, listener_bit},
    listener::{
        CacheHealth, EMPTY_POOL_FAIL, ListenerConfig, ListenerMode, Reason, Route, SocketCounts,
        explain, route,
    },
    pool::{MAX_POOL_TARGETS, Target, pick_index},
    reverse::{ReverseKey, ReverseValue, SteeredSocket},
    workloads::{ROUTE_CACHE, ROUTE_DIRECT, ROUTE_REFUSED, ROUTE_UPSTREAM},
};

use crate::{
    activity,
    context::{self, Family},
    maps::{
        CACHE_ACTIVITY, CACHE_HEALTH, COUNTERS, DATAPATH_CONFIG, LISTENER_MODE, LISTENERS, POOLS,
        REVERSE_NAT, SET_RETVAL_OK, SKIP_CGROUPS, SOCKET_COUNTS, STEERED_SOCKS,
    },
    workloads::Workload,
};

/// `EHOSTUNREACH`: what a client sees when a listener's cache is down and its pool is empty under
/// the `fail` policy. Resolvers treat it as "this server is unreachable" and try the next one at
/// once, instead of waiting out a timeout.
const EHOSTUNREACH: i32 = 113;

/// `ECONNREFUSED`: what a client over its workload's rate sees (`rate_limited`).
const ECONNREFUSED: i32 = 111;

/// Why a syscall must fail.
pub enum Refused {
    /// Upstream wanted, the pool is empty and the listener's policy is `fail`.
    EmptyPool,
    /// The workload is over its rate.
    RateLimited,
}

/// Which syscall the program sees.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// `connect(2)`: the socket's destination for its lifetime.
    Connect,
    /// `sendmsg(2)` and friends with an address: one datagram's destination.
    Sendmsg,
}

/// Steers the destination of a connect or sendmsg when it is a listener address on port 53.
/// Everything else returns `Ok` untouched, after at most a port comparison and one map lookup.
#[inline(always)]
pub fn try_steer(ctx: &SockAddrContext, family: Family, hook: Hook) -> Result<(), Refused> {
    if context::user_port_be(ctx) != port_be(DNS_PORT) {
        return Ok(());
    }
    // A connected socket was steered (or not) at connect: its sends stay where it connected, and
    // egress counts them. One it sends with an address of its own goes there instead.
    if hook == Hook::Sendmsg && context::is_connected(ctx) {
        return judge_addressed_send(ctx, family);
    }
    let Some(protocol) = context::protocol(ctx) else {
        return Ok(());
    };
    let listener_addr = context::user_addr(ctx, family);
    let Some(listener) = LISTENERS.get_ptr(listener_addr) else {
        if counted_here(hook, protocol) {
            count_workload(Workload::of_task(), ROUTE_DIRECT);
        }
        return Ok(());
    };
    // SAFETY: the agent only ever replaces LISTENERS entries whole (a new element under RCU); a
    // stale copy is still a complete configuration.
    let listener = unsafe { context::snapshot(listener) };
    // The workload is looked up only where its query is counted: a UDP connect counts nothing
    // unless it is refused (its datagrams are counted at egress).
    let workload = if counted_here(hook, protocol) {
        Workload::of_task()
    } else {
        None
    };
    // A workload over its rate is refused before anything is decided for its query.
    if let Some(workload) = workload
        && workload.over_limit()
    {
        return rate_limited(ctx, &listener);
    }
    let counters = counter_index(listener.id, protocol);
    let Some(mut route) = current_route(&listener) else {
        return Ok(());
    };
    if route == Route::Cache
        && listener.cache.addr == listener_addr
        && listener.cache.port_be(protocol) == port_be(DNS_PORT)
    {
        // The cache listens on the listener address itself and serves: nothing is rewritten,
        // whoever asks (a skipped cgroup's socket reaches it untouched all the same), so the
        // cgroup check is spared on the path every query takes in this layout, unless the cache
        // has stopped reading.
        if !activity::cache_stalled(listener.id) {
            count(counters, |c| c.to_cache += 1);
            count_workload(workload, ROUTE_CACHE);
            return Ok(());
        }
        route = Route::Upstream;
    }

    // SAFETY: plain helper call; `bpf_get_current_ancestor_cgroup_id` is available to sock_addr
    // programs since 5.7 and returns 0 above the task's own depth.
    if in_skipped_cgroup(listener.id, |level| unsafe {
        bpf_get_current_ancestor_cgroup_id(level)
    }) {
        count(counters, |c| c.skipped_cgroup += 1);
        return Ok(());
    }
    if route == Route::Cache && activity::cache_stalled(listener.id) {
        route = Route::Upstream;
    }
    // The cookie is a helper call: fetched once, and only when a target choice or a reverse
    // entry needs it.
    let (target, cookie) = match route {
        Route::Cache => {
            count(counters, |c| c.to_cache += 1);
            count_workload(workload, ROUTE_CACHE);
            (listener.cache, None)
        }
        Route::Upstream => {
            let cookie = context::socket_cookie(ctx);
            match pick_upstream(cookie, listener.id) {
                Some(target) => {
                    count(counters, |c| c.to_upstream += 1);
                    count_workload(workload, ROUTE_UPSTREAM);
                    // Compiled in, but removed by the verifier unless the agent runs with
                    // `kernel_log` (AYA_LOG_LEVEL is a read-only global): no cost otherwise.
                    info!(
                        ctx,
                        "listener {}: DNS to upstream {:i} port {}",
                        listener.id,
                        target.addr.octets(),
                        u16::from_be(target.port_be(protocol))
                    );
                    (target, Some(cookie))
                }
                None => return empty_pool(ctx, &listener, counters, workload),
            }
        }
    };

    let target_port_be = target.port_be(protocol);
    if target.addr == listener_addr && target_port_be == port_be(DNS_PORT) {
        // An upstream on the listener address itself: nothing to rewrite.
        return Ok(());
    }
    context::set_user_addr(ctx, family, &target.addr);
    context::set_user_port_be(ctx, target_port_be);
    let translation = SteeredSocket {
        listener_id: listener.id,
        peer_port_be: target_port_be,
        _padding: 0,
        peer: target.addr,
        listener: listener_addr,
        steered_ns: 0,
    };
    remember_translation(ctx, hook, cookie, translation, route);
    Ok(())
}

/// Where the listener's DNS goes now: the operator's mode, the agent's verdict and the kernel's
/// socket counts, through the truth table (`listener::route`).
#[inline(always)]
pub fn current_route(listener: &ListenerConfig) -> Option<Route> {
    let (mode, health, sockets) = route_inputs(listener.id)?;
    Some(route(listener.liveness, &mode, &health, &sockets))
}

/// When the listener was drained (monotonic ns), if its drain is all that routes it upstream
/// now: the cache holds its sockets and answers its probes, and the drain began the epoch they
/// have not confirmed (`activity::explain_flip`).
#[inline(always)]
pub fn drained_at(listener: &ListenerConfig) -> Option<u64> {
    let (mode, health, sockets) = route_inputs(listener.id)?;
    let activity = CACHE_ACTIVITY.get_ptr(listener.id)?;
    // SAFETY: as in `route_inputs`. The record is written field by field (the agent's drain,
    // the programs' flips), so a copy may be torn: one that mixes a drain with the flip after it
    // for the instant between their writes lets one send through to the cache that flip moved
    // away from, as the send would have gone a moment earlier; any other mix names no drain.
    let activity = unsafe { context::snapshot(activity) };
    let (_, reason) = explain(listener.liveness, &mode, &health, &sockets);
    matches!(explain_flip(reason, &activity, &sockets), Reason::Drained).then_some(activity.flip_ns)
}

/// The listener's mode, its cache's verdict and its socket counts, copied.
#[inline(always)]
fn route_inputs(listener_id: u32) -> Option<(ListenerMode, CacheHealth, SocketCounts)> {
    let (Some(mode), Some(health), Some(sockets)) = (
        LISTENER_MODE.get_ptr(listener_id),
        CACHE_HEALTH.get_ptr(listener_id),
        SOCKET_COUNTS.get_ptr(listener_id),
    ) else {
        return None;
    };
    // SAFETY: array elements, valid for the program's lifetime; the CLI, the agent and the other
    // programs change them concurrently, so they are copied, never borrowed.
    Some(unsafe {
        (
            context::snapshot(mode),
            context::snapshot(health),
            context::snapshot(sockets),
        )
    })
}

/// The upstream target for the socket with `cookie`, or `None` when the pool is empty.
#[inline(always)]
fn pick_upstream(cookie: u64, listener_id: u32) -> Option<Target> {
    let pool = POOLS.get_ptr(listener_id)?;
    // SAFETY: POOLS is BPF_F_NO_PREALLOC, so the element stays valid (and unchanged) for this
    // RCU read section even if the agent replaces it meanwhile.
    let pool = unsafe { &*pool };
    let len = pool.len;
    if len == 0 {
        return None;
    }
    let len = if len as usize > MAX_POOL_TARGETS {
        MAX_POOL_TARGETS as u32
    } else {
        len
    };
    let index = pick_index(cookie, len) as usize;
    pool.targets.get(index).copied()
}

/// The listener's cache is not serving and it has no upstream to offer.
#[inline(always)]
fn empty_pool(
    ctx: &SockAddrContext,
    listener: &ListenerConfig,
    counters: u32,
    workload: Option<Workload>,
) -> Result<(), Refused> {
    info!(
        ctx,
        "listener {}: the cache is down and the pool empty (policy {})",
        listener.id,
        listener.empty_pool_policy
    );
    if listener.empty_pool_policy == EMPTY_POOL_FAIL {
        count(counters, |c| c.failed_empty_pool += 1);
        // Counted here whatever the syscall: no datagram follows a refused connect.
        if let Some(workload) = workload.or_else(Workload::of_task) {
            workload.count(ROUTE_REFUSED);
        }
        // bpf_set_retval makes the rejected syscall fail with this errno instead of EPERM;
        // sock_addr programs may call it since 6.1 (5.18 added it for sockopt, sysctl and device
        // programs only). Where the agent's probe found it missing, the verifier drops the call
        // (`SET_RETVAL_OK` is a read-only 0) and the client sees EPERM.
        if SET_RETVAL_OK.load() != 0 {
            // SAFETY: plain helper call.
            unsafe { bpf_set_retval(-EHOSTUNREACH) };
        }
        Err(Refused::EmptyPool)
    } else {
        count(counters, |c| c.passed_through += 1);
        count_workload(workload, ROUTE_DIRECT);
        Ok(())
    }
}

/// Records `translation`, what replies from its target on this socket must look like: in the
/// socket's own storage, which lives as long as the socket and which the reply hooks read first.
/// A socket moving from the translation its storage holds to another one (an unconnected socket
/// asking two listeners at once) pushes the one it held into the LRU map, where replies still on
/// their way find it; a socket that only ever talks to one target, nearly every socket, never
/// writes the LRU map and fetches no cookie for it. A socket without storage (the kernel could
/// not allocate it) writes its translation into the LRU map instead. The storage's time is that
/// of the last change, and taken only for an upstream target: only a socket off the cache is
/// ever judged by it (`stale::standing`).
///
/// Two threads sending a fresh socket's first datagrams to two different targets at the same
/// instant can both find the storage empty: the translation written first is lost, its reply is
/// shown from the target's own address (counted as `reverse_missed`) and the resolver asks again.
#[inline(always)]
fn remember_translation(
    ctx: &SockAddrContext,
    hook: Hook,
    cookie: Option<u64>,
    mut translation: SteeredSocket,
    route: Route,
) {
    let mut fresh = SteeredSocket::default();
    // SAFETY: the storage belongs to the context's socket, which this program holds.
    let stored = unsafe { STEERED_SOCKS.get_or_insert_ptr_mut(ctx, Some(&mut fresh)) };
    if stored.is_null() {
        remember_in_lru(ctx, cookie, &translation);
        return;
    }
    // SAFETY: non-null storage of this socket.
    let held = unsafe { context::snapshot(stored) };
    if held.translates_like(&translation) {
        return;
    }
    // A connected socket hears only from its new peer; an unconnected one may still hear from
    // the target it held.
    if hook == Hook::Sendmsg && held.holds_translation() {
        remember_in_lru(ctx, cookie, &held);
    }
    if route == Route::Upstream {
        // SAFETY: plain helper call (4.1+); read only when the translation changes.
        translation.steered_ns = unsafe { bpf_ktime_get_ns() };
    }
    // SAFETY: non-null storage of this socket; a concurrent send of another thread on the same
    // socket writes a translation just as valid.
    unsafe { *stored = translation };
}

/// Writes `translation` of this socket into the LRU map. A full LRU evicts its oldest entry; an
/// error here leaves only the replies from that target unrewritten once the socket has moved on.
#[inline(always)]
fn remember_in_lru(ctx: &SockAddrContext, cookie: Option<u64>, translation: &SteeredSocket) {
    let cookie = cookie.unwrap_or_else(|| context::socket_cookie(ctx));
    let key = ReverseKey::new(cookie, translation.peer, translation.peer_port_be);
    let value = ReverseValue {
        listener: translation.listener,
        listener_id: translation.listener_id,
    };
    let _ = REVERSE_NAT.insert(key, value, u64::from(BPF_ANY));
}

/// True when the socket's cgroup is skipped for this listener, or is one of its descendants (the
/// cache's own upstream queries must never be steered back to it). `ancestor(level)` is the id of
/// the cgroup's ancestor at `level` (0 above its depth): the calling task's in sock_addr programs,
/// the skb's socket's at egress. Checks only the levels at which a skipped cgroup exists: usually
/// one helper call and one lookup.
#[inline(always)]
pub fn in_skipped_cgroup(listener_id: u32, ancestor: impl Fn(i32) -> u64) -> bool {
    let Some(config) = DATAPATH_CONFIG.get(0) else {
        return false;
    };
    let levels = config.skip_cgroup_levels;
    if levels == 0 {
        return false;
    }
    let mut level = 0;
    while level <= MAX_CGROUP_LEVEL {
        if levels & (1 << level) != 0 {
            let id = ancestor(level as i32);
            if id != 0
                && let Some(skip) = SKIP_CGROUPS.get_ptr(id)
                // SAFETY: entries are written whole by the agent.
                && unsafe { (*skip).listeners } & listener_bit(listener_id) != 0
            {
                return true;
            }
        }
        level += 1;
    }
    false
}

/// A datagram a connected socket sends with an address of its own (`sendto`), which the kernel
/// sends there rather than to the socket's peer: to a listener, a query of its workload, counted
/// and held to the rate here (egress passes it, `skb::sent_to_peer`), and sent where it is
/// addressed, untouched (`ROUTE_DIRECT`): the socket keeps the peer connect gave it, whose
/// translation its replies follow, and takes no reply from another address. A dual-stack
/// socket connected to an IPv4-mapped address passes `sendmsg4` with its own peer filled in at
/// every send: egress judges those.
#[inline(always)]
fn judge_addressed_send(ctx: &SockAddrContext, family: Family) -> Result<(), Refused> {
    if !crate::workloads::enabled() || context::sends_to_peer(ctx, family) {
        return Ok(());
    }
    let workload = Workload::of_task();
    if let Some(listener) = LISTENERS.get_ptr(context::user_addr(ctx, family)) {
        // SAFETY: the agent replaces LISTENERS entries whole.
        let listener = unsafe { context::snapshot(listener) };
        if let Some(workload) = workload
            && workload.over_limit()
        {
            return rate_limited(ctx, &listener);
        }
    }
    count_workload(workload, ROUTE_DIRECT);
    Ok(())
}

/// Whether this syscall is where its query is counted (`workloads`): an unconnected datagram or a
/// TCP connection. A connected UDP socket is counted at egress, datagram by datagram (`stale`).
#[inline(always)]
fn counted_here(hook: Hook, protocol: u32) -> bool {
    hook == Hook::Sendmsg || protocol == PROTOCOL_TCP
}

/// Counts a query of `workload` (looked up where `counted_here`) under `route`.
#[inline(always)]
fn count_workload(workload: Option<Workload>, route: usize) {
    if let Some(workload) = workload {
        workload.count(route);
    }
}

/// A query over its workload's rate: refused with `ECONNREFUSED` where the kernel lets the
/// program say so (6.1), else `EPERM`. Resolvers take either at once as "this server cannot
/// answer now" (glibc returns EAI_AGAIN, Go a temporary error, c-ares ECONNREFUSED, musl after
/// its timeout); never `EAGAIN`, on which glibc resends at once and c-ares waits.
#[inline(always)]
fn rate_limited(ctx: &SockAddrContext, listener: &ListenerConfig) -> Result<(), Refused> {
    info!(
        ctx,
        "listener {}: a workload over its rate is refused", listener.id
    );
    if SET_RETVAL_OK.load() != 0 {
        // SAFETY: plain helper call (sock_addr programs, 6.1; see `empty_pool`).
        unsafe { bpf_set_retval(-ECONNREFUSED) };
    }
    Err(Refused::RateLimited)
}

/// Adds to this CPU's counters of a (listener, protocol) row.
#[inline(always)]
pub fn count(index: u32, bump: impl FnOnce(&mut ListenerCounters)) {
    if let Some(counters) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot of this program's CPU; sock_addr programs run with migration off.
        bump(unsafe { &mut *counters });
    }
}
