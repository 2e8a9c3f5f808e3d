//! cgroup_skb/egress: a connected UDP DNS socket whose peer is no longer where its listener's route
//! points is refused its next send, so its resolver opens a new socket, which connect steers to
//! the current route (`redirector_common::stale` has the rule). A socket that connected the
//! moment before a failback or a drain is spared for a grace: its server still answers it.
//!
//! A drop at cgroup egress fails the sender's `send` with EPERM, for connected UDP also from a
//! process of the cgroup inside another network namespace (`bpf-tests/tests/long_lived.rs` shows
//! it on 6.1, 6.12 and 6.18), and needs no setns and no socket iterator. TCP is left alone: a
//! dropped segment is retransmitted, not reported, so refusing it would only stall the
//! connection; a TCP DNS socket carries one exchange or a few.
//!
//! A datagram it lets go is counted for its workload's queries (`workloads`): connect counted
//! none of a connected UDP socket's. One the socket sent with an address of its own (`sendto` on
//! a connected socket) is sendmsg's to judge, and passes here untouched (one read of its
//! destination).
//!
//! Kernel features: cgroup_skb egress 4.10; `__sk_buff.sk` and `bpf_sk_fullsock` 5.1;
//! `bpf_sk_storage_get` 5.2; `bpf_skb_ancestor_cgroup_id` 4.19; `bpf_ktime_get_ns` 4.1 (all in
//! cgroup_skb programs).

use core::ptr::{addr_of, read_volatile};

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_sock,
    helpers::{bpf_ktime_get_ns, bpf_skb_ancestor_cgroup_id},
    programs::SkBuffContext,
};
use redirector_common::{
    DNS_PORT,
    addr::{NetAddr, port_be},
    counters::{IPPROTO_UDP, PROTOCOL_UDP, counter_index},
    listener::{ListenerConfig, Route},
    pool::MAX_POOL_TARGETS,
    reverse::SteeredSocket,
    stale::{Grace, Standing, in_drain_grace, is_fresh, standing},
    workloads::{ROUTE_CACHE, ROUTE_DIRECT, ROUTE_UPSTREAM},
};

use crate::{
    activity, context,
    maps::{LISTENERS, POOLS, STEERED_SOCKS},
    skb,
    steer::{self, count},
    workloads::{self, Workload},
};

/// `AF_INET6`; anything else with a DNS port is IPv4 here.
const AF_INET6: u32 = 10;

/// What egress does with a datagram.
pub enum Egress {
    /// Let it go (everything but a stale connected DNS socket's send).
    Pass,
    /// Drop it: the send fails with EPERM and the resolver reconnects.
    Refuse,
}

/// Checks a datagram of a connected socket to port 53 against its listener's current route.
/// Everything else returns after one field load: `remote_port` is the socket's connected port
/// (zero for an unconnected socket, whose every datagram sendmsg steers anyway).
#[inline(always)]
pub fn try_check_egress(ctx: &SkBuffContext) -> Egress {
    let skb = ctx.skb.skb;
    // SAFETY: `skb` is the context pointer the kernel passed; the verifier rewrites the load to
    // the socket's `skc_dport`, as a 32-bit network-order value.
    let remote_port = unsafe { read_volatile(addr_of!((*skb).remote_port)) };
    if remote_port != u32::from(DNS_PORT).to_be() {
        return count_elsewhere(ctx, remote_port);
    }
    // The sending socket.
    let Some(sk) = skb::full_socket(ctx) else {
        return Egress::Pass;
    };
    // SAFETY: a full socket, as the verifier knows after the null check.
    if unsafe { read_volatile(addr_of!((*sk).protocol)) } != IPPROTO_UDP {
        return Egress::Pass;
    }
    // A datagram the socket sent with an address of its own (`sendto` on a connected socket)
    // goes there, not to its peer: sendmsg counted it and held it to the rate (`steer`), and the
    // peer's standing says nothing of it.
    let fields = skb::peer(ctx);
    if !skb::sent_to_peer(ctx, fields) {
        return Egress::Pass;
    }
    let peer = remote_addr(fields);
    let steered = steered(sk, &peer);
    // The socket's listener: the one it was steered for, when its peer is that translation's
    // target, else the listener it connected to untouched.
    let listener_addr = steered.map_or(peer, |steered| steered.listener);
    let Some(listener) = LISTENERS.get_ptr(listener_addr) else {
        if let Some(workload) = Workload::of_skb(ctx) {
            workload.count(ROUTE_DIRECT);
        }
        return Egress::Pass;
    };
    // SAFETY: the agent replaces LISTENERS entries whole.
    let listener = unsafe { context::snapshot(listener) };
    if steer::in_skipped_cgroup(listener.id, |level| {
        // SAFETY: plain helper call on the context's skb; 0 above the socket's cgroup depth.
        unsafe { bpf_skb_ancestor_cgroup_id(ctx.as_ptr().cast(), level) }
    }) {
        return Egress::Pass;
    }
    let Some(mut route) = steer::current_route(&listener) else {
        return Egress::Pass;
    };
    let on_cache = peer == listener.cache.addr && port_be(DNS_PORT) == listener.cache.udp_port_be;
    // A socket on the cache may send there for a drain's grace: the drained cache still serves.
    let mut grace = if route == Route::Upstream && on_cache && drained_moments_ago(&listener) {
        Grace::Drained
    } else {
        Grace::None
    };
    // A query leaving for the cache is refused if the cache has stopped reading.
    if on_cache
        && (route == Route::Cache || grace == Grace::Drained)
        && activity::cache_stalled(listener.id)
    {
        route = Route::Upstream;
        grace = Grace::None;
    }
    // The pool matters only towards the upstreams: a socket on the cache route is judged by its
    // peer alone, without the pool's lookup and scan on every send.
    let (in_pool, pool_len) = match route {
        Route::Upstream => in_pool(listener.id, &peer),
        Route::Cache => (false, 0),
    };
    // The clock is read only for a socket off the cache while the route is the cache.
    if route == Route::Cache
        && !on_cache
        && steered.is_some_and(|steered| {
            // SAFETY: plain helper call (4.1+).
            is_fresh(steered.steered_ns, unsafe { bpf_ktime_get_ns() })
        })
    {
        grace = Grace::Connected;
    }
    let counters = counter_index(listener.id, PROTOCOL_UDP);
    match standing(route, on_cache, in_pool, pool_len, grace) {
        Standing::Current => {
            let Some(workload) = Workload::of_skb(ctx) else {
                return Egress::Pass;
            };
            // A datagram over its workload's rate is dropped: the send fails with EPERM.
            if workload.over_limit() {
                return Egress::Refuse;
            }
            // Where this datagram goes: the cache, the upstream connect steered it to, or the
            // listener's address untouched (the `pass` policy).
            workload.count(if on_cache {
                ROUTE_CACHE
            } else if steered.is_some() {
                ROUTE_UPSTREAM
            } else {
                ROUTE_DIRECT
            });
            Egress::Pass
        }
        Standing::MoveToCache => {
            count(counters, |c| c.moved_to_cache += 1);
            Egress::Refuse
        }
        Standing::MoveToUpstream => {
            count(counters, |c| c.moved_to_upstream += 1);
            Egress::Refuse
        }
    }
}

/// A datagram of a socket connected to a port other than 53: when connect steered it there (a
/// cache or a target listening on another port), it is a query of its workload, counted and held
/// to the rate like one to port 53 (`workloads`); such a socket is never moved (`standing` looks
/// at port 53 only). Anything else returns after two array lookups when the port is neither a
/// cache's nor a target's, and at once with the accounting off.
#[inline(always)]
fn count_elsewhere(ctx: &SkBuffContext, remote_port: u32) -> Egress {
    if !workloads::enabled() || remote_port == 0 {
        return Egress::Pass;
    }
    // `remote_port` holds the port's network-order bytes in its upper half.
    let port_be = (remote_port >> 16) as u16;
    if !workloads::is_reply_port(port_be) && !activity::is_cache_port(port_be) {
        return Egress::Pass;
    }
    let Some(sk) = skb::full_socket(ctx) else {
        return Egress::Pass;
    };
    // SAFETY: a full socket, as the verifier knows after the null check.
    if unsafe { read_volatile(addr_of!((*sk).protocol)) } != IPPROTO_UDP {
        return Egress::Pass;
    }
    let fields = skb::peer(ctx);
    let peer = remote_addr(fields);
    let Some(steered) = skb::storage(&STEERED_SOCKS, sk)
        // SAFETY: non-null storage of this socket.
        .map(|value| unsafe { context::snapshot(value) })
        .filter(|steered| steered.peer == peer && steered.peer_port_be == port_be)
    else {
        return Egress::Pass;
    };
    let Some(listener) = LISTENERS.get_ptr(steered.listener) else {
        return Egress::Pass;
    };
    // SAFETY: the agent replaces LISTENERS entries whole.
    let cache = unsafe { context::snapshot(listener) }.cache;
    // As above: a datagram addressed elsewhere was judged at sendmsg.
    if !skb::sent_to_peer(ctx, fields) {
        return Egress::Pass;
    }
    let Some(workload) = Workload::of_skb(ctx) else {
        return Egress::Pass;
    };
    if workload.over_limit() {
        return Egress::Refuse;
    }
    workload.count(if peer == cache.addr && port_be == cache.udp_port_be {
        ROUTE_CACHE
    } else {
        ROUTE_UPSTREAM
    });
    Egress::Pass
}

/// Whether the listener routes upstream only because its cache was drained, less than
/// `DRAIN_GRACE_NS` ago. Asked only of a socket on the cache while the route is upstream (one
/// that would be refused otherwise), so the send path of a socket on its route never pays it.
#[inline(always)]
fn drained_moments_ago(listener: &ListenerConfig) -> bool {
    steer::drained_at(listener).is_some_and(|drained| {
        // SAFETY: plain helper call (4.1+).
        in_drain_grace(drained, unsafe { bpf_ktime_get_ns() })
    })
}

/// The socket's connected peer (`skb::peer`), in the shared representation (a dual-stack socket's
/// IPv4 peer is IPv4-mapped already).
#[inline(always)]
fn remote_addr((family, ip4, ip6): (u32, u32, [u32; 4])) -> NetAddr {
    if family == AF_INET6 {
        NetAddr { words_be: ip6 }
    } else {
        NetAddr::from_ipv4_be(ip4)
    }
}

/// The socket's translation, if connect steered it to `peer` (port 53).
#[inline(always)]
fn steered(sk: *mut bpf_sock, peer: &NetAddr) -> Option<SteeredSocket> {
    let value = skb::storage(&STEERED_SOCKS, sk)?;
    // SAFETY: non-null storage of this socket.
    let steered = unsafe { context::snapshot(value) };
    (steered.peer == *peer && steered.peer_port_be == port_be(DNS_PORT)).then_some(steered)
}

/// Whether `peer` (port 53) is a target of the listener's pool, and the pool's size.
#[inline(always)]
fn in_pool(listener_id: u32, peer: &NetAddr) -> (bool, u32) {
    let membership = pool_membership(listener_id, peer);
    (membership >> 32 != 0, membership as u32)
}

/// `in_pool`'s scan, as a function of its own (a BPF-to-BPF call, 4.16): inlined into the egress
/// program, the compiler laid the loop out with a fall-through back edge, which the floor's
/// verifier refuses (`kernel_support`'s test of the object checks every loop), and an unrolled
/// scan was too many states for 6.1's. Returns the pool's size, and bit 32 set when `peer` is in
/// it. It runs only while the route is the upstreams.
#[inline(never)]
fn pool_membership(listener_id: u32, peer: &NetAddr) -> u64 {
    let Some(pool) = POOLS.get_ptr(listener_id) else {
        return 0;
    };
    // SAFETY: POOLS is BPF_F_NO_PREALLOC: the element stays whole for this RCU read section.
    let pool = unsafe { &*pool };
    let len = if pool.len as usize > MAX_POOL_TARGETS {
        MAX_POOL_TARGETS as u32
    } else {
        pool.len
    };
    let mut index = 0;
    while index < len as usize {
        if let Some(target) = pool.targets.get(index)
            && target.addr == *peer
            && target.udp_port_be == port_be(DNS_PORT)
        {
            return 1 << 32 | u64::from(len);
        }
        index += 1;
    }
    u64::from(len)
}
