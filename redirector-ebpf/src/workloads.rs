//! DNS per workload: each cgroup's queries by route, counted where the programs decide the route,
//! and its replies by rcode class, counted where a reply is delivered to it
//! (`redirector_common::workloads` has the classes).
//!
//! A query is counted once, where it is certain:
//! - an unconnected UDP datagram and a TCP connection at `sendmsg` and `connect`, where the
//!   route is decided;
//! - a connected UDP socket's datagrams at egress (`stale`), one by one: to port 53, or to the
//!   cache or target connect steered it to on another port; its connect counts only a refusal.
//!
//! A reply is counted at `cgroup_skb` ingress: a UDP datagram or TCP segment from port 53 (or a
//! port a target or cache uses) whose payload begins with a standard query's reply. The check of
//! anything else reads the packet's first bytes in place (direct packet access, 4.20 for
//! `cgroup_skb`) and returns.
//!
//! A workload may be held to a rate (`workloads.rate_limit_qps`): where a query is counted, one
//! over the rate is refused instead (`Workload::over_limit`): at `sendmsg` and `connect` before
//! any packet exists, a connected UDP socket's datagram at egress.
//!
//! The whole of it is dead code the verifier removes while `WORKLOADS_ON` is 0, and the limit
//! while `RATE_INTERVAL_NS` is 0.
//!
//! Kernel features: `bpf_get_current_cgroup_id` and `bpf_get_current_ancestor_cgroup_id` in
//! sock_addr programs 5.7; `bpf_skb_cgroup_id` 5.3 and `bpf_skb_ancestor_cgroup_id` 4.19 in
//! `cgroup_skb` programs; `bpf_skb_load_bytes` 4.5; `bpf_get_prandom_u32` (an entry's life) in
//! cgroup programs 4.17; LRU hash maps 4.10; `BPF_ADD` atomics (every JIT); `BPF_CMPXCHG` (the
//! rate limit's stamp) 5.12, where the JIT has it.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{
    EbpfContext as _,
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_prandom_u32,
        bpf_ktime_get_ns, bpf_skb_ancestor_cgroup_id, bpf_skb_cgroup_id,
    },
    programs::SkBuffContext,
};
use redirector_common::{
    DNS_PORT,
    counters::{IPPROTO_TCP, IPPROTO_UDP},
    reverse::reply_port_bit,
    workloads::{
        EXEMPT_ACCOUNTING, ExemptCgroup, MAX_EXEMPT_LEVEL, ROUTE_LIMITED, WORKLOAD_FLAG_EXEMPT,
        WORKLOAD_FLAG_UNLIMITED, WorkloadCounters, admit, entry_flags, is_reply, rcode_class,
    },
};

use crate::{
    atomic::{add_u64, compare_exchange_u64, fetching},
    maps::{
        RATE_INTERVAL_NS, RATE_TOLERANCE_NS, REPLY_PORTS, WORKLOAD_EXEMPT, WORKLOADS, WORKLOADS_ON,
    },
    skb::{ETH_P_IP_BE, ETH_P_IPV6_BE, read_bytes},
};

/// An IPv4 header without options.
const IPV4_HEADER: usize = 20;
/// The IPv6 header (a reply with extension headers is not counted).
const IPV6_HEADER: usize = 40;
/// The UDP header.
const UDP_HEADER: usize = 8;
/// TCP's length prefix before a DNS message (RFC 1035 4.2.2).
const TCP_LENGTH_PREFIX: usize = 2;

/// Whether the agent asked for the counts (`WORKLOADS_ON`, a constant to the verifier).
#[inline(always)]
pub fn enabled() -> bool {
    WORKLOADS_ON.load() != 0
}

/// A counted workload's entry in `WORKLOADS`.
#[derive(Clone, Copy)]
pub struct Workload(*mut WorkloadCounters);

impl Workload {
    /// The calling task's workload, from a sock_addr program: `None` with accounting off, for an
    /// exempt cgroup, or when the LRU could not make room.
    #[inline(always)]
    pub fn of_task() -> Option<Self> {
        if !enabled() {
            return None;
        }
        // SAFETY: plain helper call (sock_addr programs, 5.7).
        let cgroup = unsafe { bpf_get_current_cgroup_id() };
        counters(cgroup, |level| {
            // SAFETY: plain helper call (sock_addr programs, 5.7); 0 above the task's level.
            unsafe { bpf_get_current_ancestor_cgroup_id(level) }
        })
        .map(Self)
    }

    /// The workload of the packet's socket, from a `cgroup_skb` program.
    #[inline(always)]
    pub fn of_skb(ctx: &SkBuffContext) -> Option<Self> {
        if !enabled() {
            return None;
        }
        let skb = ctx.as_ptr().cast();
        // SAFETY: plain helper call on the context's skb (cgroup_skb programs, 5.3).
        let cgroup = unsafe { bpf_skb_cgroup_id(skb) };
        counters(cgroup, |level| {
            // SAFETY: plain helper call on the context's skb (cgroup_skb programs, 4.19); 0
            // above the socket's cgroup's level.
            unsafe { bpf_skb_ancestor_cgroup_id(skb, level) }
        })
        .map(Self)
    }

    /// Counts one query under `route` (`ROUTE_*`).
    #[inline(always)]
    pub fn count(self, route: usize) {
        // SAFETY: an element of WORKLOADS (preallocated), 8-byte aligned, changed by atomic adds
        // only; every caller passes a `ROUTE_*` constant, below ROUTES.
        unsafe {
            let queries = addr_of_mut!((*self.0).queries).cast::<u64>();
            add_u64(queries.add(route), 1);
        }
    }

    /// Whether this query is over the workload's rate (`workloads.rate_limit_qps`): counted as
    /// limited if so, else it takes its place in the workload's schedule. Always false while the
    /// limit is off (`RATE_INTERVAL_NS` 0, a constant to the verifier) and for a cgroup the
    /// operator exempts from it.
    ///
    /// The stamp moves by compare-and-swap: a query that loses it to another CPU is judged again
    /// on the stamp it lost to, so that CPUs flooding at once share one schedule
    /// ([`RATE_RETRIES`] times, then it is counted limited). Without the fetching atomics (an
    /// arm64 JIT before 5.18) the stamp is written plainly, and a racing CPU may pass on the
    /// token another took.
    #[inline(always)]
    pub fn over_limit(self) -> bool {
        let interval = RATE_INTERVAL_NS.load();
        if interval == 0 {
            return false;
        }
        let tolerance = RATE_TOLERANCE_NS.load();
        let counters = self.0;
        // SAFETY: as in `count`; `flags` is written only when the entry is created, `next_ns`
        // whole, here only.
        unsafe {
            if read_volatile(addr_of!((*counters).flags)) & WORKLOAD_FLAG_UNLIMITED != 0 {
                return false;
            }
            let stamp = addr_of_mut!((*counters).next_ns);
            let mut next = read_volatile(stamp);
            let now = bpf_ktime_get_ns();
            if !fetching() {
                return match admit(now, next, interval, tolerance) {
                    Some(later) => {
                        write_volatile(stamp, later);
                        false
                    }
                    None => {
                        self.count(ROUTE_LIMITED);
                        true
                    }
                };
            }
            let mut tries = 0;
            while tries < RATE_RETRIES {
                let Some(later) = admit(now, next, interval, tolerance) else {
                    break;
                };
                let held = compare_exchange_u64(stamp, next, later);
                if held == next {
                    return false;
                }
                next = held;
                tries += 1;
            }
            self.count(ROUTE_LIMITED);
            true
        }
    }
}

/// How many times a query judges the rate limit's stamp before it is counted limited: each try
/// after the first follows a CPU that moved the stamp meanwhile, by at least one interval, so a
/// query still due after this many is racing a flood from as many CPUs.
const RATE_RETRIES: u32 = 4;

/// Exempts the cgroup of a process that binds a cache socket (`post_bind`), from that moment:
/// entered in `WORKLOAD_EXEMPT` (unless it is there already) and forgotten in `WORKLOADS`, so its
/// next count finds it exempt. The agent keeps the entries of caches that live.
#[inline(always)]
pub fn exempt_cache(cgroup: u64) {
    if !enabled() || cgroup == 0 {
        return;
    }
    let exempt = ExemptCgroup {
        level: 0,
        exempt_from: EXEMPT_ACCOUNTING,
    };
    if WORKLOAD_EXEMPT
        .insert(cgroup, exempt, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        let _ = WORKLOADS.remove(cgroup);
    }
}

/// `cgroup_skb/ingress`: counts a DNS reply delivered to a workload by its rcode class.
/// Anything that is not one returns after the packet's first bytes are read in place: a reply
/// comes from port 53 or from a port a target or cache listens on (`REPLY_PORTS`).
#[inline(always)]
pub fn note_reply(ctx: &SkBuffContext) {
    if !enabled() {
        return;
    }
    let Some((protocol, transport)) = transport(ctx) else {
        return;
    };
    let Some(source_port_be) = read_be16(ctx, transport) else {
        return;
    };
    if source_port_be != DNS_PORT.to_be() && !is_reply_port(source_port_be) {
        return;
    }
    let header = if protocol == IPPROTO_UDP {
        udp_reply_header(ctx, transport)
    } else {
        tcp_reply_header(ctx, transport)
    };
    let Some([flags_high, flags_low]) = header else {
        return;
    };
    if !is_reply(flags_high) {
        return;
    }
    if let Some(Workload(counters)) = Workload::of_skb(ctx) {
        // SAFETY: an element of WORKLOADS (preallocated), 8-byte aligned; changed by atomic
        // adds only. The index is below RCODE_CLASSES.
        unsafe {
            let replies = addr_of_mut!((*counters).replies).cast::<u64>();
            add_u64(replies.add(rcode_class(flags_low)), 1);
        }
    }
}

/// The counters of cgroup `cgroup`, or `None` if it is exempt (or the LRU cannot make room). A
/// cgroup seen for the first time is looked up in `WORKLOAD_EXEMPT` at each of its levels
/// (`ancestor(level)`, 0 past its own) and entered with what it is exempt from, so that every
/// later count of an exempt cgroup costs the one lookup that finds it so.
#[inline(always)]
fn counters(cgroup: u64, ancestor: impl Fn(i32) -> u64) -> Option<*mut WorkloadCounters> {
    if cgroup == 0 {
        return None;
    }
    if let Some(counters) = WORKLOADS.get_ptr_mut(cgroup) {
        // SAFETY: an element of WORKLOADS; `flags` is written only when the entry is created.
        let flags = unsafe { read_volatile(addr_of!((*counters).flags)) };
        return (flags & WORKLOAD_FLAG_EXEMPT == 0).then_some(counters);
    }
    let fresh = WorkloadCounters {
        flags: entry_flags(exempt_from(ancestor)),
        // SAFETY: plain helper call (every program type, 3.19).
        life: unsafe { bpf_get_prandom_u32() } | 1,
        ..WorkloadCounters::default()
    };
    // Another CPU may have entered it meanwhile: its entry stands, and is the one counted.
    let _ = WORKLOADS.insert(cgroup, fresh, u64::from(BPF_NOEXIST));
    if fresh.flags & WORKLOAD_FLAG_EXEMPT != 0 {
        return None;
    }
    WORKLOADS.get_ptr_mut(cgroup)
}

/// What the cgroup is exempt from (`EXEMPT_*`): the union of its own and its ancestors' entries
/// in `WORKLOAD_EXEMPT`. Walks its levels from the first below the root down to its own (about
/// five on a Kubernetes node); run once per cgroup, at its first count.
#[inline(always)]
fn exempt_from(ancestor: impl Fn(i32) -> u64) -> u32 {
    let mut exempt = 0;
    let mut level = 1;
    while level <= MAX_EXEMPT_LEVEL {
        let id = ancestor(level);
        if id == 0 {
            break;
        }
        if let Some(entry) = WORKLOAD_EXEMPT.get_ptr(id) {
            // SAFETY: entries are written whole by the agent.
            exempt |= unsafe { (*entry).exempt_from };
        }
        level += 1;
    }
    exempt
}

/// Whether `port_be` is a port targets use (`REPLY_PORTS`): replies come from it.
#[inline(always)]
pub fn is_reply_port(port_be: u16) -> bool {
    let (word, bit) = reply_port_bit(port_be);
    REPLY_PORTS.get(word).is_some_and(|ports| *ports & bit != 0)
}

/// The packet's transport protocol (UDP or TCP) and where its header starts, for an IPv4 packet
/// without options or an IPv6 packet without extension headers. `cgroup_skb` programs see the
/// packet from its network header.
#[inline(always)]
fn transport(ctx: &SkBuffContext) -> Option<(u32, usize)> {
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer the kernel passed; the verifier rewrites the load.
    let protocol = unsafe { read_volatile(addr_of!((*skb).protocol)) };
    let (next_header, offset) = if protocol == ETH_P_IP_BE {
        let [version_ihl] = read_bytes::<1>(ctx, 0)?;
        if version_ihl != 0x45 {
            return None;
        }
        (read_bytes::<1>(ctx, 9)?[0], IPV4_HEADER)
    } else if protocol == ETH_P_IPV6_BE {
        (read_bytes::<1>(ctx, 6)?[0], IPV6_HEADER)
    } else {
        return None;
    };
    let next_header = u32::from(next_header);
    if next_header == IPPROTO_UDP || next_header == IPPROTO_TCP {
        Some((next_header, offset))
    } else {
        None
    }
}

/// The DNS header's flag bytes of a UDP datagram whose header starts at `transport`.
#[inline(always)]
fn udp_reply_header(ctx: &SkBuffContext, transport: usize) -> Option<[u8; 2]> {
    read_bytes::<2>(ctx, transport + UDP_HEADER + 2)
}

/// The DNS header's flag bytes of a TCP segment whose header starts at `transport`, when the
/// segment begins a message: its payload starts with a length prefix no shorter than the rest of
/// the payload (a message that fits, or the first segment of a longer one). A segment in the
/// middle of a long message whose bytes happen to look so is miscounted; stub resolvers' replies
/// over TCP fit in one segment.
#[inline(always)]
fn tcp_reply_header(ctx: &SkBuffContext, transport: usize) -> Option<[u8; 2]> {
    let [data_offset] = read_bytes::<1>(ctx, transport + 12)?;
    let header = usize::from(data_offset >> 4) * 4;
    let payload = transport + header;
    // SAFETY: the context pointer the kernel passed; `len` is the packet's length from the
    // network header.
    let len = unsafe { read_volatile(addr_of!((*ctx.skb.skb).len)) } as usize;
    if len < payload + TCP_LENGTH_PREFIX + 4 {
        return None;
    }
    let [high, low] = read_bytes::<2>(ctx, payload)?;
    let message = usize::from(u16::from_be_bytes([high, low]));
    if message + TCP_LENGTH_PREFIX < len - payload {
        return None;
    }
    read_bytes::<2>(ctx, payload + TCP_LENGTH_PREFIX + 2)
}

/// A big-endian `u16` at `offset` of the packet, as its raw bytes (network byte order).
#[inline(always)]
fn read_be16(ctx: &SkBuffContext, offset: usize) -> Option<u16> {
    read_bytes::<2>(ctx, offset).map(u16::from_ne_bytes)
}
