//! The maps, named as `redirector_common::names` says (the statics' names are the map names).

use aya_ebpf::{
    Global,
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray, SkStorage},
    macros::btf_map,
};
use redirector_common::{
    activity::{CACHE_PORT_WORDS, CacheActivity, StallTiming},
    addr::NetAddr,
    binds::{
        BindKey, BindListeners, CacheMark, CacheReader, CacheSocket, CacheTask, MAX_CACHE_BINDS,
        MAX_CACHE_SOCKETS, MAX_CACHE_TASKS,
    },
    counters::{COUNTER_ENTRIES, ListenerCounters},
    datapath::{DatapathConfig, MAX_SKIP_CGROUPS, SkipCgroup},
    listener::{
        CacheHealth, ListenerConfig, ListenerInfo, ListenerMode, MAX_LISTENERS, SocketCounts,
    },
    pool::Pool,
    reverse::{
        REPLY_PORT_WORDS, REVERSE_NAT_DEFAULT_ENTRIES, ReverseKey, ReverseValue, SteeredSocket,
    },
    workloads::{ExemptCgroup, MAX_EXEMPT_CGROUPS, WORKLOADS_DEFAULT_ENTRIES, WorkloadCounters},
};

/// Listener address → its configuration. A miss means "not DNS for us": the common case, so it
/// is the first lookup, after the port check.
#[btf_map]
pub static LISTENERS: HashMap<NetAddr, ListenerConfig, MAX_LISTENERS> = HashMap::new();

/// Listener id → the operator's override. Arrays: the verifier inlines their lookups.
#[btf_map]
pub static LISTENER_MODE: Array<ListenerMode, MAX_LISTENERS> = Array::new();

/// Listener id → the agent's verdict on the cache.
#[btf_map]
pub static CACHE_HEALTH: Array<CacheHealth, MAX_LISTENERS> = Array::new();

/// Listener id → the cache's live sockets. Mmapable (5.5+) so the agent can correct the counts
/// with atomic adds that never race the programs' own.
#[btf_map]
pub static SOCKET_COUNTS: Array<SocketCounts, MAX_LISTENERS, { BPF_F_MMAPABLE as usize }> =
    Array::new();

/// Bound address, port and protocol → the listeners whose cache such a socket is.
#[btf_map]
pub static CACHE_BINDS: HashMap<BindKey, BindListeners, MAX_CACHE_BINDS> = HashMap::new();

/// Socket cookie → a counted cache socket. `sock_release` cannot read a socket's address (the
/// verifier allows it only in `post_bind`), so the counted sockets are remembered by cookie.
#[btf_map]
pub static CACHE_SOCKETS: HashMap<u64, CacheSocket, MAX_CACHE_SOCKETS> = HashMap::new();

/// Marks the sockets `post_bind` counted (socket-local storage, 5.2+; from cgroup sock programs
/// since 5.9), so that `sock_release` passes over the node's other sockets after one storage
/// lookup instead of a cookie and a hash lookup.
#[btf_map]
pub static CACHE_MARKS: SkStorage<CacheMark> = SkStorage::new();

/// The listeners a socket bound to a cache port reads for (socket-local storage, from sock_addr
/// programs since 5.3): `recvmsg` notes a cache's read after one storage lookup, and looks up
/// the socket's cookie in `CACHE_SOCKETS` only at its first read and after the agent changed
/// the counted sockets.
#[btf_map]
pub static CACHE_READERS: SkStorage<CacheReader> = SkStorage::new();

/// Listener id → name and address, for the CLI. Never read here; defined here so that it is
/// created and pinned with the others.
#[btf_map]
pub static LISTENER_INFO: Array<ListenerInfo, MAX_LISTENERS> = Array::new();

/// Listener id → upstream pool. `BPF_F_NO_PREALLOC`: an update allocates a new element and frees
/// the old one after an RCU grace period, so a reader never sees a pool being rewritten (with
/// preallocation the old element could be recycled while still read).
#[btf_map]
pub static POOLS: HashMap<u32, Pool, MAX_LISTENERS, { BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

/// (socket cookie, target, port) → listener, for rewriting replies. LRU: entries of closed
/// sockets age out without bookkeeping. The agent may resize it at load time.
#[btf_map]
pub static REVERSE_NAT: LruHashMap<ReverseKey, ReverseValue, REVERSE_NAT_DEFAULT_ENTRIES> =
    LruHashMap::new();

/// Marks steered sockets (socket-local storage, 5.2+; usable from sock_addr programs since 5.3).
#[btf_map]
pub static STEERED_SOCKS: SkStorage<SteeredSocket> = SkStorage::new();

/// `reply_port_bit` word → the ports targets use, set by the agent before it installs a target
/// and never cleared: the reply hooks pass over datagrams from any other port without touching
/// the socket. An array, so the verifier inlines the lookup.
#[btf_map]
pub static REPLY_PORTS: Array<u64, REPLY_PORT_WORDS> = Array::new();

/// Per-CPU counters per (listener, protocol).
#[btf_map]
pub static COUNTERS: PerCpuArray<ListenerCounters, COUNTER_ENTRIES> = PerCpuArray::new();

/// cgroup id → the listeners its sockets (and its descendants') are not steered for.
#[btf_map]
pub static SKIP_CGROUPS: HashMap<u64, SkipCgroup, MAX_SKIP_CGROUPS> = HashMap::new();

/// tgid → the listeners whose cache socket that process bound, and its cgroup then. Written by
/// `post_bind`, read by the signal program. An LRU, preallocated as maps used from tracing
/// programs should be: the entries of processes long gone age out.
#[btf_map]
pub static CACHE_TASKS: LruHashMap<u32, CacheTask, MAX_CACHE_TASKS> = LruHashMap::new();

/// Listener id → what the programs saw the cache read and leave unread, and their latest flip.
/// Mmapable, so that the agent reads it and records a drain field by field, with the atomic
/// operations the programs use, never replacing an element under them.
#[btf_map]
pub static CACHE_ACTIVITY: Array<CacheActivity, MAX_LISTENERS, { BPF_F_MMAPABLE as usize }> =
    Array::new();

/// Listener id → how long its cache may leave a query unread (0: never stalled), and the clock of
/// the activity stamps.
#[btf_map]
pub static STALL_TIMING: Array<StallTiming, MAX_LISTENERS> = Array::new();

/// Index 0 → the listeners (a bit per id) whose cache has a query stamped unread that no read
/// has answered yet, or whose first read is wanted: the caches' reads look further only while
/// one is set (nearly always none: a stamp is answered by the next read). Set by the programs,
/// cleared by the read that answers; the agent sets every bit at each start, so that stamps the
/// programs before it left are answered.
#[btf_map]
pub static CACHE_PENDING: Array<u64, 1> = Array::new();

/// `reply_port_bit` word → the ports caches listen on (network byte order): `recvmsg` looks up a
/// socket's cache entry only when it is bound to one of them.
#[btf_map]
pub static CACHE_PORTS: Array<u64, CACHE_PORT_WORDS> = Array::new();

/// cgroup id → its DNS counts (`workloads`). An LRU: a node's cgroups come and go, and the least
/// recently counted one makes room. Preallocated (the default for hash maps), so a count never
/// allocates. The agent sizes it at load time (`workloads.tracked`).
#[btf_map]
pub static WORKLOADS: LruHashMap<u64, WorkloadCounters, { WORKLOADS_DEFAULT_ENTRIES as usize }> =
    LruHashMap::new();

/// cgroup id → a cgroup whose DNS, and its descendants', is not counted: the caches (their own
/// upstream queries), the agent (its probes) and the cgroups the operator lists. Written by the
/// agent at every start; read at a cgroup's first count only.
#[btf_map]
pub static WORKLOAD_EXEMPT: HashMap<u64, ExemptCgroup, MAX_EXEMPT_CGROUPS> = HashMap::new();

/// Datapath-wide settings at index 0.
#[btf_map]
pub static DATAPATH_CONFIG: Array<DatapathConfig, 1> = Array::new();

/// `names::GLOBAL_SET_RETVAL`: 1 where the running kernel lets sock_addr programs call
/// `bpf_set_retval` (6.1), as the agent probed it. A read-only global (`.rodata`, frozen before
/// the load; its values are constants to the verifier since 5.5): at 0 the call is dead
/// code the verifier removes before it resolves helpers, so an older kernel loads the programs.
/// 0 unless the agent says otherwise: a load that forgot it still works, with `EPERM`.
#[unsafe(no_mangle)]
pub static SET_RETVAL_OK: Global<u8> = Global::new(0);

/// `names::GLOBAL_ATOMIC_FETCH`: 1 where the running kernel's JIT compiles the fetching atomics
/// (`BPF_FETCH`, `BPF_CMPXCHG`), as the agent probed it. A read-only global like
/// `SET_RETVAL_OK`: at 0 the verifier removes every path that uses one before the JIT runs
/// (`atomic::fetching`). 0 unless the agent says otherwise: a load that forgot it runs degraded,
/// never refused.
#[unsafe(no_mangle)]
pub static ATOMIC_FETCH_OK: Global<u8> = Global::new(0);

/// `names::GLOBAL_WORKLOADS`: 1 when the agent counts DNS per workload (`workloads.accounting`).
/// A read-only global like `SET_RETVAL_OK`: at 0 the verifier removes the counting (a load of the
/// switch and a branch stay at each place).
#[unsafe(no_mangle)]
pub static WORKLOADS_ON: Global<u8> = Global::new(0);

/// `names::GLOBAL_RATE_INTERVAL`: the rate limit's interval, 1 s / the rate (ns); 0 while the
/// limit is off, and the verifier removes it. A read-only global like `WORKLOADS_ON`.
#[unsafe(no_mangle)]
pub static RATE_INTERVAL_NS: Global<u64> = Global::new(0);

/// `names::GLOBAL_RATE_TOLERANCE`: how far ahead of its schedule a workload may ask, (burst - 1)
/// x the interval (ns). A read-only global.
#[unsafe(no_mangle)]
pub static RATE_TOLERANCE_NS: Global<u64> = Global::new(0);
