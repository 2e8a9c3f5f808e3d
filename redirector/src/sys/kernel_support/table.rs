//! The table: every kernel feature redirector uses, the first mainline release with it, whether
//! the agent can run without it, how the agent decides whether the kernel has it, and what in the
//! eBPF object depends on it; and the oldest release redirector supports.

use aya::{maps::MapType, programs::ProgramType, sys::BpfHelper, util::KernelVersion};
use redirector_common::names;

/// `major.minor` of a release, as the table and the messages name releases (aya's
/// [`KernelVersion`] prints the patch level too, which the table's mainline releases do not
/// have).
#[must_use]
pub fn mainline(version: KernelVersion) -> String {
    let code = version.code();
    format!("{}.{}", code >> 16, (code >> 8) & 0xff)
}

/// The oldest release redirector supports: at or above every required feature (a test checks),
/// and the LTS that node images still run (AKS's Ubuntu 22.04 images, Bottlerocket's older
/// variants). Anything newer that the programs use is optional, behind a switch.
pub const FLOOR: KernelVersion = KernelVersion::new(5, 15, 0);

/// Whether the agent can run without a feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The programs or the agent cannot work without it: the agent refuses to start.
    Required,
    /// The agent degrades: it runs without the named function and reports it in status and its
    /// log.
    Optional {
        /// What the agent does without it.
        without: &'static str,
        /// The programs' read-only global (`redirector_common::names::GLOBAL_*`) that turns the
        /// feature's calls off, so that the verifier removes them; `None` when the programs do
        /// not use it.
        switch: Option<&'static str>,
    },
}

/// How the agent decides whether the running kernel has a feature.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Probe {
    /// `aya::sys::is_program_supported`.
    Program(ProgramType),
    /// `aya::sys::is_map_supported`.
    Map(MapType),
    /// `aya::sys::is_helper_supported` for every helper of the row's [`Uses::Helpers`], from each
    /// of its program types.
    Helpers,
    /// No probe: the release number decides (attach types, map flags, instructions, socket
    /// options; aya probes none of them, and a wrong answer here surfaces as the load's error).
    Release,
    /// Decided where it is used, at run time (`nft` installing the table).
    AtUse,
    /// Loading a program with every fetching atomic (`atomics::probe`): the JIT decides, not the
    /// release (arm64's compiles them only from 5.18).
    AtomicFetch,
}

/// What in the eBPF object depends on a feature, for the audit of the object.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Uses {
    /// Calls to these helpers from programs of these types.
    Helpers {
        /// The program types that call them.
        programs: &'static [ProgramType],
        /// The helpers.
        helpers: &'static [BpfHelper],
    },
    /// Atomic instructions that return the old value (`BPF_FETCH`).
    AtomicFetch,
    /// Nothing an instruction shows: hook and map types, flags, the agent's own syscalls.
    Other,
}

/// One kernel feature redirector uses.
#[derive(Clone, Copy, Debug)]
pub struct KernelFeature {
    /// A short stable name (for [`ABSENT_FOR_TESTS_VARIABLE`](super::ABSENT_FOR_TESTS_VARIABLE)).
    pub id: &'static str,
    /// The feature, as the kernel names it.
    pub name: &'static str,
    /// What redirector uses it for.
    pub used_for: &'static str,
    /// The first mainline release with it.
    pub since: KernelVersion,
    /// Whether the agent can run without it.
    pub need: Need,
    /// How the agent decides whether the kernel has it.
    pub probe: Probe,
    /// What in the object depends on it.
    pub uses: Uses,
}

const SOCK_ADDR: &[ProgramType] = &[ProgramType::CgroupSockAddr];
const SOCK: &[ProgramType] = &[ProgramType::CgroupSock];
const SKB: &[ProgramType] = &[ProgramType::CgroupSkb];
const SOCK_ADDR_AND_SKB: &[ProgramType] = &[ProgramType::CgroupSockAddr, ProgramType::CgroupSkb];
const SOCK_ADDR_SKB_AND_RAW_TRACEPOINT: &[ProgramType] = &[
    ProgramType::CgroupSockAddr,
    ProgramType::CgroupSkb,
    ProgramType::RawTracePoint,
];
const RAW_TRACEPOINT: &[ProgramType] = &[ProgramType::RawTracePoint];
const ALL_TYPES: &[ProgramType] = &[
    ProgramType::CgroupSockAddr,
    ProgramType::CgroupSock,
    ProgramType::CgroupSkb,
];

/// [`KernelFeature::id`] of `bpf_set_retval` in sock_addr programs.
pub const SET_RETVAL: &str = "set_retval";
/// [`KernelFeature::id`] of the fetching atomics.
pub const ATOMIC_FETCH: &str = "atomic_fetch";
/// [`KernelFeature::id`] of `BPF_PROG_TEST_RUN` of raw tracepoint programs (the tick's
/// measurement).
pub const TICK_TEST_RUN: &str = "raw_tracepoint_test_run";

/// Every kernel feature redirector uses, in `docs/kernels.md`'s order.
pub const FEATURES: &[KernelFeature] = &[
    KernelFeature {
        id: "cgroup_skb",
        name: "cgroup v2 `cgroup_skb` egress and ingress",
        used_for: "moving connected DNS sockets off a stale peer; noting a query where it reaches the cache's socket",
        since: KernelVersion::new(4, 10, 0),
        need: Need::Required,
        probe: Probe::Program(ProgramType::CgroupSkb),
        uses: Uses::Other,
    },
    KernelFeature {
        id: "skb_load_bytes",
        name: "`bpf_skb_load_bytes` in cgroup_skb programs",
        used_for: "a DNS reply's header where it is not in the packet's linear data",
        since: KernelVersion::new(4, 10, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SKB,
            helpers: &[BpfHelper::BPF_FUNC_skb_load_bytes],
        },
    },
    KernelFeature {
        id: "connect",
        name: "cgroup v2 `connect4`/`connect6`",
        used_for: "steering TCP and connected UDP",
        since: KernelVersion::new(4, 17, 0),
        need: Need::Required,
        probe: Probe::Program(ProgramType::CgroupSockAddr),
        uses: Uses::Other,
    },
    KernelFeature {
        id: "post_bind",
        name: "cgroup v2 `post_bind4`/`post_bind6`",
        used_for: "counting the caches' sockets",
        since: KernelVersion::new(4, 17, 0),
        need: Need::Required,
        probe: Probe::Program(ProgramType::CgroupSock),
        uses: Uses::Other,
    },
    KernelFeature {
        id: "base_helpers",
        name: "`bpf_map_lookup_elem`, `bpf_map_update_elem`, `bpf_map_delete_elem`, `bpf_ktime_get_ns`, `bpf_get_prandom_u32` in cgroup programs",
        used_for: "every map access; socket ages; a workload entry's life number",
        since: KernelVersion::new(4, 17, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: ALL_TYPES,
            helpers: &[
                BpfHelper::BPF_FUNC_map_lookup_elem,
                BpfHelper::BPF_FUNC_map_update_elem,
                BpfHelper::BPF_FUNC_map_delete_elem,
                BpfHelper::BPF_FUNC_ktime_get_ns,
                BpfHelper::BPF_FUNC_get_prandom_u32,
            ],
        },
    },
    KernelFeature {
        id: "raw_tracepoint",
        name: "`raw_tracepoint` programs (`BPF_RAW_TRACEPOINT_OPEN`) on `signal_deliver`",
        used_for: "failing a cache over when it is told to stop",
        since: KernelVersion::new(4, 17, 0),
        need: Need::Required,
        probe: Probe::Program(ProgramType::RawTracePoint),
        uses: Uses::Other,
    },
    KernelFeature {
        id: "sendmsg",
        name: "cgroup v2 `sendmsg4`/`sendmsg6`",
        used_for: "steering unconnected UDP",
        since: KernelVersion::new(4, 18, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "raw_tracepoint_helpers",
        name: "`bpf_map_lookup_elem`, `bpf_get_current_pid_tgid`, `bpf_get_current_cgroup_id`, `bpf_ktime_get_ns` in raw tracepoint programs",
        used_for: "whether a signalled process is a cache; when it was signalled",
        since: KernelVersion::new(4, 18, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: RAW_TRACEPOINT,
            helpers: &[
                BpfHelper::BPF_FUNC_map_lookup_elem,
                BpfHelper::BPF_FUNC_get_current_pid_tgid,
                BpfHelper::BPF_FUNC_get_current_cgroup_id,
                BpfHelper::BPF_FUNC_ktime_get_ns,
            ],
        },
    },
    KernelFeature {
        id: "sock_addr_socket_cookie",
        name: "`bpf_get_socket_cookie` in sock_addr programs",
        used_for: "per-socket target choice, reverse keys",
        since: KernelVersion::new(4, 19, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR,
            helpers: &[BpfHelper::BPF_FUNC_get_socket_cookie],
        },
    },
    KernelFeature {
        id: "skb_ancestor_cgroup_id",
        name: "`bpf_skb_ancestor_cgroup_id` in cgroup_skb programs",
        used_for: "skipped cgroups at egress",
        since: KernelVersion::new(4, 19, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SKB,
            helpers: &[BpfHelper::BPF_FUNC_skb_ancestor_cgroup_id],
        },
    },
    KernelFeature {
        id: "skb_direct_access",
        name: "direct packet access (`__sk_buff.data`, `data_end`) in cgroup_skb programs",
        used_for: "a delivered packet's ports and a DNS reply's rcode, read in place",
        since: KernelVersion::new(4, 20, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "sk_fullsock",
        name: "`__sk_buff.sk`, `bpf_sk_fullsock` in cgroup_skb programs",
        used_for: "the sending socket at egress",
        since: KernelVersion::new(5, 1, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SKB,
            helpers: &[BpfHelper::BPF_FUNC_sk_fullsock],
        },
    },
    KernelFeature {
        id: "recvmsg",
        name: "cgroup v2 `recvmsg4`/`recvmsg6`",
        used_for: "reply source rewrite",
        since: KernelVersion::new(5, 2, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "skb_sk_storage",
        name: "`bpf_sk_storage_get` in cgroup_skb programs",
        used_for: "a connected socket's translation at egress",
        since: KernelVersion::new(5, 2, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SKB,
            helpers: &[BpfHelper::BPF_FUNC_sk_storage_get],
        },
    },
    KernelFeature {
        id: "skb_cgroup_id",
        name: "`bpf_skb_cgroup_id` in cgroup_skb programs",
        used_for: "the workload a connected socket's query or a reply belongs to",
        since: KernelVersion::new(5, 3, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SKB,
            helpers: &[BpfHelper::BPF_FUNC_skb_cgroup_id],
        },
    },
    KernelFeature {
        id: "sock_addr_sk_storage",
        name: "`bpf_sk_storage_get` in sock_addr programs",
        used_for: "marking steered sockets; a cache socket's listeners at its reads",
        since: KernelVersion::new(5, 3, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR,
            helpers: &[BpfHelper::BPF_FUNC_sk_storage_get],
        },
    },
    KernelFeature {
        id: "read_only_globals",
        name: "read-only global data (`BPF_MAP_FREEZE`), its values constants to the verifier",
        used_for: "the switches the verifier prunes on (kernel-log level, `bpf_set_retval`)",
        since: KernelVersion::new(5, 5, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "mmapable_array",
        name: "`BPF_F_MMAPABLE` array",
        used_for: "socket counts shared with the agent's atomic corrections",
        since: KernelVersion::new(5, 5, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "jiffies64",
        name: "`bpf_jiffies64` in sock_addr, cgroup_skb and raw tracepoint programs",
        used_for: "the clock of a cache's unread queries and reads (a load once the verifier inlines it)",
        since: KernelVersion::new(5, 5, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR_SKB_AND_RAW_TRACEPOINT,
            helpers: &[BpfHelper::BPF_FUNC_jiffies64],
        },
    },
    KernelFeature {
        id: "current_ancestor_cgroup_id",
        name: "`bpf_get_current_ancestor_cgroup_id`, `bpf_get_current_cgroup_id` in sock_addr programs",
        used_for: "skipped cgroups; the workload a query belongs to",
        since: KernelVersion::new(5, 7, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR,
            helpers: &[
                BpfHelper::BPF_FUNC_get_current_ancestor_cgroup_id,
                BpfHelper::BPF_FUNC_get_current_cgroup_id,
            ],
        },
    },
    KernelFeature {
        id: "sock_addr_current_pid_tgid",
        name: "`bpf_get_current_pid_tgid` in sock_addr programs",
        used_for: "the process that reads a cache socket, known as a cache whatever the agent may see of it",
        since: KernelVersion::new(5, 7, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR,
            helpers: &[BpfHelper::BPF_FUNC_get_current_pid_tgid],
        },
    },
    KernelFeature {
        id: "cgroup_link",
        name: "cgroup `bpf_link`",
        used_for: "attachments pinned across restarts, next to other owners' programs",
        since: KernelVersion::new(5, 7, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "sock_cookies",
        name: "`bpf_get_netns_cookie`, `bpf_get_socket_cookie` in cgroup sock programs",
        used_for: "the caches' namespace; socket identity",
        since: KernelVersion::new(5, 7, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK,
            helpers: &[
                BpfHelper::BPF_FUNC_get_netns_cookie,
                BpfHelper::BPF_FUNC_get_socket_cookie,
            ],
        },
    },
    KernelFeature {
        id: "sock_current_task",
        name: "`bpf_get_current_pid_tgid`, `bpf_get_current_cgroup_id` in cgroup sock programs",
        used_for: "the process that binds a cache socket",
        since: KernelVersion::new(5, 7, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK,
            helpers: &[
                BpfHelper::BPF_FUNC_get_current_pid_tgid,
                BpfHelper::BPF_FUNC_get_current_cgroup_id,
            ],
        },
    },
    KernelFeature {
        id: "getpeername",
        name: "cgroup v2 `getpeername4`/`getpeername6`",
        used_for: "connected peer rewrite",
        since: KernelVersion::new(5, 8, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "ringbuf",
        name: "`BPF_MAP_TYPE_RINGBUF`, `bpf_ringbuf_reserve`/`submit`/`discard`",
        used_for: "aya-log's buffer for kernel logging (created even with `kernel_log` off)",
        since: KernelVersion::new(5, 8, 0),
        need: Need::Required,
        probe: Probe::Map(MapType::RingBuf),
        uses: Uses::Helpers {
            programs: ALL_TYPES,
            helpers: &[
                BpfHelper::BPF_FUNC_ringbuf_reserve,
                BpfHelper::BPF_FUNC_ringbuf_submit,
                BpfHelper::BPF_FUNC_ringbuf_discard,
            ],
        },
    },
    KernelFeature {
        id: "sock_release",
        name: "cgroup v2 `sock_release`",
        used_for: "uncounting the caches' sockets: in-kernel failover",
        since: KernelVersion::new(5, 9, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "sock_sk_storage",
        name: "`bpf_sk_storage_get` in cgroup sock programs",
        used_for: "marking the caches' sockets, so other closes skip the cookie lookup",
        since: KernelVersion::new(5, 9, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK,
            helpers: &[BpfHelper::BPF_FUNC_sk_storage_get],
        },
    },
    KernelFeature {
        id: "ktime_get_coarse_ns",
        name: "`bpf_ktime_get_coarse_ns` in sock_addr and cgroup_skb programs",
        used_for: "that clock where the tick could not be measured",
        since: KernelVersion::new(5, 11, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR_AND_SKB,
            helpers: &[BpfHelper::BPF_FUNC_ktime_get_coarse_ns],
        },
    },
    KernelFeature {
        id: ATOMIC_FETCH,
        name: "`BPF_ATOMIC` with `BPF_FETCH` (`atomic_fetch_add`, `_or`, `_and`, `cmpxchg`), compiled by the JIT (arm64: 5.18)",
        used_for: "the close that takes a cache's socket count to zero, and the query that finds a \
                   cache stalled, decided atomically; a waiting stamp shown to the cache's reads",
        since: KernelVersion::new(5, 12, 0),
        need: Need::Optional {
            without: "the kernel does not detect a stalled cache (the agent's probes still move a \
                      hung one, after `failures_to_fail_over` probes), and socket counts and \
                      epochs are kept with plain atomic adds (a cache's last close and its next \
                      life's first bind, racing, may be taken for one life: the new one is \
                      trusted without its probes' confirmation)",
            switch: Some(names::GLOBAL_ATOMIC_FETCH),
        },
        probe: Probe::AtomicFetch,
        uses: Uses::AtomicFetch,
    },
    KernelFeature {
        id: "so_netns_cookie",
        name: "`SO_NETNS_COOKIE` (agent)",
        used_for: "the caches' namespace cookie",
        since: KernelVersion::new(5, 14, 0),
        need: Need::Required,
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: SET_RETVAL,
        name: "`bpf_set_retval` in sock_addr programs",
        used_for: "`EHOSTUNREACH` for the `fail` policy",
        since: KernelVersion::new(6, 1, 0),
        need: Need::Optional {
            without: "the `fail` policy's syscalls fail with `EPERM` (the hook's plain rejection) instead of `EHOSTUNREACH`",
            switch: Some(names::GLOBAL_SET_RETVAL),
        },
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR,
            helpers: &[BpfHelper::BPF_FUNC_set_retval],
        },
    },
    KernelFeature {
        id: TICK_TEST_RUN,
        name: "`BPF_PROG_TEST_RUN` of raw tracepoint programs (agent)",
        used_for: "measuring the kernel's tick, for that clock",
        since: KernelVersion::new(5, 10, 0),
        need: Need::Optional {
            without: "the programs read `bpf_ktime_get_coarse_ns` instead: a few ns more per query handed to a cache",
            switch: None,
        },
        probe: Probe::Release,
        uses: Uses::Other,
    },
    KernelFeature {
        id: "nft_notrack",
        name: "nf_tables `notrack` in raw-priority `inet` chains (agent, via `nft`)",
        used_for: "conntrack bypass",
        since: KernelVersion::new(4, 3, 0),
        need: Need::Optional {
            without: "DNS stays tracked; status and `redirector_conntrack_bypass_active` say so",
            switch: None,
        },
        probe: Probe::AtUse,
        uses: Uses::Other,
    },
];
