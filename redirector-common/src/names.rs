//! Names of the maps and programs in the eBPF object. The kernel crate names its statics and
//! functions exactly so; the agent looks them up with these constants, and a test checks the built
//! object against this list (a kernel object name holds at most 15 characters, so these stay short).

/// Listener address (`NetAddr`) → `ListenerConfig`.
pub const MAP_LISTENERS: &str = "LISTENERS";
/// Listener id → `ListenerMode`, the operator's override (written by the CLI).
pub const MAP_LISTENER_MODE: &str = "LISTENER_MODE";
/// Listener id → `CacheHealth`, the agent's verdict on the cache (written by the agent).
pub const MAP_CACHE_HEALTH: &str = "CACHE_HEALTH";
/// Listener id → `ListenerInfo` (name, address): for the CLI only, the programs never read it.
pub const MAP_LISTENER_INFO: &str = "LISTENER_INFO";
/// Listener id → `SocketCounts` of the cache (mmapable; changed with atomic adds only).
pub const MAP_SOCKET_COUNTS: &str = "SOCKET_COUNTS";
/// `BindKey` → `BindListeners`: bound sockets that are some listener's cache.
pub const MAP_CACHE_BINDS: &str = "CACHE_BINDS";
/// Socket cookie → `CacheSocket`: the counted cache sockets.
pub const MAP_CACHE_SOCKETS: &str = "CACHE_SOCKETS";
/// Socket-local storage: marks the cache sockets `post_bind` counted (`CacheMark`).
pub const MAP_CACHE_MARKS: &str = "CACHE_MARKS";
/// Listener id → `Pool` of upstream targets, replaced whole on every change.
pub const MAP_POOLS: &str = "POOLS";
/// `ReverseKey` → `ReverseValue`: what a reply's source must be rewritten to.
pub const MAP_REVERSE_NAT: &str = "REVERSE_NAT";
/// Socket-local storage: marks sockets that were steered at least once.
pub const MAP_STEERED_SOCKS: &str = "STEERED_SOCKS";
/// `reply_port_bit` word → bits of the ports some target uses (replies come from them).
pub const MAP_REPLY_PORTS: &str = "REPLY_PORTS";
/// `counter_index(listener, protocol)` → per-CPU `ListenerCounters`.
pub const MAP_COUNTERS: &str = "COUNTERS";
/// tgid → `CacheTask`: the processes that bound a cache socket, for the signal program.
pub const MAP_CACHE_TASKS: &str = "CACHE_TASKS";
/// cgroup id → `SkipCgroup`: sockets of these cgroups (and their descendants) are never steered.
pub const MAP_SKIP_CGROUPS: &str = "SKIP_CGROUPS";
/// Listener id → `CacheActivity`: the cache's unread queries and reads, and the kernel's latest
/// flip (mmapable; changed field by field).
pub const MAP_CACHE_ACTIVITY: &str = "CACHE_ACTIVITY";
/// Retired (a listener's stall limit alone, 8 bytes): its released row keeps the name.
pub const MAP_STALL_LIMITS: &str = "STALL_LIMITS";
/// Listener id → `StallTiming`: the stall limit and the clock of the stamps (written by the
/// agent).
pub const MAP_STALL_TIMING: &str = "STALL_TIMING";
/// Index 0 → the listeners (a bit per id) whose cache's next read is wanted: a query stamped
/// unread, or no read seen yet (set by the programs and by the agent at each start, cleared by
/// the read that answers).
pub const MAP_CACHE_PENDING: &str = "CACHE_PENDING";
/// `reply_port_bit` word → bits of the ports caches listen on: `recvmsg` looks further only on
/// sockets bound to one.
pub const MAP_CACHE_PORTS: &str = "CACHE_PORTS";
/// Index 0 → `DatapathConfig`.
pub const MAP_DATAPATH_CONFIG: &str = "DATAPATH_CONFIG";
/// Socket-local storage: the listeners a socket on a cache port reads for (`CacheReader`), so
/// that `recvmsg` finds them without a cookie and a hash lookup at every datagram.
pub const MAP_CACHE_READERS: &str = "CACHE_READERS";
/// cgroup id → `WorkloadCounters`: each workload's queries by route and replies by rcode class
/// (an LRU, sized by `workloads.tracked`).
pub const MAP_WORKLOADS: &str = "WORKLOADS";
/// cgroup id → `ExemptCgroup`: cgroups whose DNS (and their descendants') is not counted: the
/// caches, the agent, and those the operator lists.
pub const MAP_WORKLOAD_EXEMPT: &str = "WORKLOAD_EXEMPT";

/// Every map in the object.
pub const ALL_MAPS: [&str; 23] = [
    MAP_LISTENERS,
    MAP_LISTENER_MODE,
    MAP_CACHE_HEALTH,
    MAP_SOCKET_COUNTS,
    MAP_CACHE_BINDS,
    MAP_CACHE_SOCKETS,
    MAP_CACHE_MARKS,
    MAP_LISTENER_INFO,
    MAP_POOLS,
    MAP_REVERSE_NAT,
    MAP_STEERED_SOCKS,
    MAP_REPLY_PORTS,
    MAP_COUNTERS,
    MAP_SKIP_CGROUPS,
    MAP_DATAPATH_CONFIG,
    MAP_CACHE_TASKS,
    MAP_CACHE_ACTIVITY,
    MAP_STALL_TIMING,
    MAP_CACHE_PENDING,
    MAP_CACHE_PORTS,
    MAP_CACHE_READERS,
    MAP_WORKLOADS,
    MAP_WORKLOAD_EXEMPT,
];

/// `cgroup/connect4`: TCP connect and UDP connect, IPv4.
pub const PROG_CONNECT4: &str = "dns_connect4";
/// `cgroup/connect6`: TCP connect and UDP connect, IPv6 (incl. IPv4-mapped).
pub const PROG_CONNECT6: &str = "dns_connect6";
/// `cgroup/sendmsg4`: unconnected UDP sends, IPv4 (and IPv4-mapped sends of dual-stack sockets).
pub const PROG_SENDMSG4: &str = "dns_sendmsg4";
/// `cgroup/sendmsg6`: unconnected UDP sends, IPv6.
pub const PROG_SENDMSG6: &str = "dns_sendmsg6";
/// `cgroup/recvmsg4`: source address of received UDP datagrams, IPv4.
pub const PROG_RECVMSG4: &str = "dns_recvmsg4";
/// `cgroup/recvmsg6`: source address of received UDP datagrams, IPv6.
pub const PROG_RECVMSG6: &str = "dns_recvmsg6";
/// `cgroup/getpeername4`: peer address of connected sockets, IPv4.
pub const PROG_GETPEERNAME4: &str = "dns_getpeer4";
/// `cgroup/getpeername6`: peer address of connected sockets, IPv6.
pub const PROG_GETPEERNAME6: &str = "dns_getpeer6";

/// Every `cgroup_sock_addr` program in the object.
pub const SOCK_ADDR_PROGRAMS: [&str; 8] = [
    PROG_CONNECT4,
    PROG_CONNECT6,
    PROG_SENDMSG4,
    PROG_SENDMSG6,
    PROG_RECVMSG4,
    PROG_RECVMSG6,
    PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
];

/// `cgroup/post_bind4`: counts sockets bound to a cache's IPv4 address (or the wildcard).
pub const PROG_POST_BIND4: &str = "dns_post_bind4";
/// `cgroup/post_bind6`: the same for IPv6 (and IPv4-mapped, and dual-stack wildcard) binds.
pub const PROG_POST_BIND6: &str = "dns_post_bind6";
/// `cgroup/sock_release`: uncounts them, and fails the listener over when the last UDP one goes.
pub const PROG_SOCK_RELEASE: &str = "dns_release";

/// Every `cgroup_sock` program in the object.
pub const SOCK_PROGRAMS: [&str; 3] = [PROG_POST_BIND4, PROG_POST_BIND6, PROG_SOCK_RELEASE];

/// `cgroup_skb/egress`: refuses the next send of a connected DNS socket whose peer is no longer
/// where its listener's route points (`stale`).
pub const PROG_EGRESS: &str = "dns_egress";

/// `cgroup_skb/ingress`: notes a query where it reaches a cache's socket (the stall detection's
/// unread stamp), and counts a DNS reply's rcode class for the workload that receives it.
pub const PROG_INGRESS: &str = "dns_ingress";

/// Every `cgroup_skb` program in the object.
pub const SKB_PROGRAMS: [&str; 2] = [PROG_EGRESS, PROG_INGRESS];

/// `raw_tracepoint/signal_deliver`: fails a cache's listeners over the moment a process that
/// bound its sockets is delivered a terminating signal.
pub const PROG_SIGNAL: &str = "dns_signal";
/// The tracepoint `PROG_SIGNAL` attaches to.
pub const SIGNAL_TRACEPOINT: &str = "signal_deliver";

/// Every `raw_tracepoint` program in the object that is attached.
pub const RAW_TRACEPOINT_PROGRAMS: [&str; 1] = [PROG_SIGNAL];

/// `raw_tracepoint` never attached: run by the agent (`BPF_PROG_TEST_RUN`, 5.10) to read the
/// kernel's tick count, half by half (argument 0: 0 the low 32 bits, 1 the high), when it measures
/// the tick the programs stamp with (`StallTiming`).
pub const PROG_TICKS: &str = "dns_ticks";

/// Read-only global (`u8`, 0 or 1): whether sock_addr programs may call `bpf_set_retval` (6.1).
/// The agent sets it from its probe of the running kernel before the load; at 0 the verifier
/// removes the call as dead code, so the programs load on kernels without the helper and the
/// `fail` policy's syscalls fail with the plain rejection's `EPERM`.
pub const GLOBAL_SET_RETVAL: &str = "SET_RETVAL_OK";
/// The programs' read-only global: 1 where the kernel runs atomic instructions that return the
/// old value (`BPF_FETCH`: `atomic_fetch_add`, `_or`, `_and`, `cmpxchg`; the x86_64 JIT from
/// 5.12, arm64's from 5.18). The agent sets it from its probe (it loads a program with each);
/// at 0 the verifier removes every such instruction as dead code before the JIT sees it, so the
/// programs load where the JIT cannot compile them (arm64 before 5.18 with
/// `CONFIG_BPF_JIT_ALWAYS_ON`): counts and epochs are then kept with plain atomic adds, and the
/// kernel's stall detection is off.
pub const GLOBAL_ATOMIC_FETCH: &str = "ATOMIC_FETCH_OK";
/// The programs' read-only global (`u8`, 0 or 1): whether they count DNS per workload
/// (`workloads.accounting`). At 0 the verifier removes the counting as dead code (a load of the
/// switch and a branch stay at each place).
pub const GLOBAL_WORKLOADS: &str = "WORKLOADS_ON";
/// The programs' read-only global (`u64`): the rate limit's interval, 1 s / the rate per
/// workload in ns (`workloads.rate_limit_qps`); 0 while the limit is off, and the verifier
/// removes it.
pub const GLOBAL_RATE_INTERVAL: &str = "RATE_INTERVAL_NS";
/// The programs' read-only global (`u64`): how far ahead of its schedule a workload may ask,
/// (burst - 1) x the interval, in ns (`workloads.rate_limit_burst`).
pub const GLOBAL_RATE_TOLERANCE: &str = "RATE_TOLERANCE_NS";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_the_kernel_object_name_limit() {
        for name in ALL_MAPS
            .iter()
            .chain(SOCK_ADDR_PROGRAMS.iter())
            .chain(SOCK_PROGRAMS.iter())
            .chain(SKB_PROGRAMS.iter())
            .chain(RAW_TRACEPOINT_PROGRAMS.iter())
            .chain([MAP_STALL_LIMITS, PROG_TICKS].iter())
        {
            assert!(
                name.len() <= 15,
                "{name} is longer than BPF_OBJ_NAME_LEN - 1"
            );
        }
    }
}
