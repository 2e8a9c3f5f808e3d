//! The kernel features redirector uses, the mainline release that introduced each, how the agent
//! decides whether the running kernel has it, and the check it runs before it loads anything: a
//! kernel without a required feature is refused with the features' names instead of a verifier
//! log, and one without an optional feature degrades by name.
//!
//! The decision is a probe of the running kernel wherever aya has one (program types, map types,
//! helpers per program type: `aya::sys::is_*_supported`), because distribution kernels backport
//! features and release numbers lie in both directions. The rest (attach types, map flags, bpf
//! links, instructions, a socket option) has no probe short of loading the programs; for those the
//! release number stands, all of them at or below [`FLOOR`].
//!
//! The table is `docs/kernels.md`'s (a test keeps the two equal), and a test
//! reads the embedded object and checks every helper call and fetching atomic in it against this
//! table: a new one cannot land without its row, nor one newer than [`FLOOR`] without a switch.

mod atomics;

use aya::{
    maps::MapType,
    programs::{ProgramError, ProgramType},
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
    util::KernelVersion,
};
use redirector_common::names;
use tracing::warn;

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

/// The variable that makes the agent (and `status`) take features as absent whatever the probes
/// say: a comma-separated list of [`KernelFeature::id`]s. For tests only: it exists so that the
/// degraded paths run on the kernels the tests can boot, all of which have every feature.
pub const ABSENT_FOR_TESTS_VARIABLE: &str = "REDIRECTOR_TEST_ABSENT_FEATURES";

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
    /// A short stable name (for [`ABSENT_FOR_TESTS_VARIABLE`]).
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
        name: "`bpf_map_lookup_elem`, `bpf_map_update_elem`, `bpf_map_delete_elem`, `bpf_ktime_get_ns` in cgroup programs",
        used_for: "every map access; socket ages",
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
        name: "`bpf_get_current_ancestor_cgroup_id` in sock_addr programs",
        used_for: "skipped cgroups",
        since: KernelVersion::new(5, 7, 0),
        need: Need::Required,
        probe: Probe::Helpers,
        uses: Uses::Helpers {
            programs: SOCK_ADDR,
            helpers: &[BpfHelper::BPF_FUNC_get_current_ancestor_cgroup_id],
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

/// How a feature's presence was decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// By aya's probe of the running kernel.
    Probe,
    /// By the release number: the feature has no probe, or its probe failed (logged).
    Release,
    /// By [`ABSENT_FOR_TESTS_VARIABLE`].
    TestOverride,
}

/// What the agent found for one feature.
#[derive(Clone, Copy, Debug)]
pub struct Finding {
    /// The feature.
    pub feature: &'static KernelFeature,
    /// Whether the running kernel has it.
    pub present: bool,
    /// How that was decided.
    pub decided_by: Decision,
}

/// The running kernel, feature by feature.
#[derive(Clone, Debug)]
pub struct KernelSupport {
    /// `uname -r`.
    pub release: String,
    /// One per feature decided before the load ([`Probe::AtUse`] features are left out).
    pub findings: Vec<Finding>,
}

/// [`ABSENT_FOR_TESTS_VARIABLE`] names a feature the table does not have.
#[derive(Debug, thiserror::Error)]
#[error(
    "{variable} names {id:?}, which is no kernel feature of redirector's: give a comma-separated \
     list of {known} (it exists for tests; unset it in production)"
)]
pub struct UnknownFeature {
    /// The variable.
    pub variable: &'static str,
    /// The unknown id.
    pub id: String,
    /// The ids there are, joined.
    pub known: String,
}

/// The features [`ABSENT_FOR_TESTS_VARIABLE`]'s value `list` names.
///
/// # Errors
/// [`UnknownFeature`] for an id the table does not have.
pub fn parse_absent(list: &str) -> Result<Vec<&'static str>, UnknownFeature> {
    list.split(',')
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(|id| {
            FEATURES
                .iter()
                .find(|feature| feature.id == id)
                .map(|feature| feature.id)
                .ok_or_else(|| UnknownFeature {
                    variable: ABSENT_FOR_TESTS_VARIABLE,
                    id: id.to_owned(),
                    known: FEATURES
                        .iter()
                        .map(|feature| feature.id)
                        .collect::<Vec<_>>()
                        .join(", "),
                })
        })
        .collect()
}

impl KernelSupport {
    /// Probes the running kernel (`uname(2)` and aya's probes), taking the features `absent`
    /// names as missing whatever the probes say. Needs `bpf(2)`: run it after the capability
    /// and seccomp checks.
    #[must_use]
    pub fn probe(absent: &[&str]) -> Self {
        let release = nix::sys::utsname::uname().map_or_else(
            |_| String::new(),
            |name| name.release().to_string_lossy().into_owned(),
        );
        // aya reads the version the way libbpf does: Ubuntu's `/proc/version_signature` and
        // Debian's `uname -v` name the upstream release where `uname -r` may not.
        let version = KernelVersion::current()
            .inspect_err(|error| {
                warn!(%release, %error, "the kernel's version cannot be read: only probes decide");
            })
            .ok();
        Self::decide(&release, version, absent, probe_feature)
    }

    /// Decides every feature for the kernel `release` (its version `version`, `None` when it
    /// cannot be read), with `probe` answering for the features that have one (`Err`: the probe
    /// failed, and the version decides).
    pub fn decide(
        release: &str,
        version: Option<KernelVersion>,
        absent: &[&str],
        mut probe: impl FnMut(&KernelFeature) -> Result<bool, ProgramError>,
    ) -> Self {
        // A version that cannot be read lacks nothing by its number: the verifier has the last
        // word.
        let by_release =
            |feature: &KernelFeature| version.is_none_or(|version| version >= feature.since);
        let findings = FEATURES
            .iter()
            .filter(|feature| feature.probe != Probe::AtUse)
            .map(|feature| {
                let (present, decided_by) = if absent.contains(&feature.id) {
                    (false, Decision::TestOverride)
                } else if feature.probe == Probe::Release {
                    (by_release(feature), Decision::Release)
                } else {
                    match probe(feature) {
                        Ok(present) => (present, Decision::Probe),
                        Err(error) => {
                            warn!(feature = feature.name, error = %crate::error_chain(&error), "the kernel probe failed: the release number decides");
                            (by_release(feature), Decision::Release)
                        }
                    }
                };
                Finding {
                    feature,
                    present,
                    decided_by,
                }
            })
            .collect();
        Self {
            release: release.to_owned(),
            findings,
        }
    }

    /// The features the kernel lacks.
    pub fn missing(&self) -> impl Iterator<Item = &Finding> + '_ {
        self.findings.iter().filter(|finding| !finding.present)
    }

    /// The optional features the kernel lacks: what the agent runs without.
    pub fn degraded(&self) -> impl Iterator<Item = &Finding> + '_ {
        self.missing()
            .filter(|finding| matches!(finding.feature.need, Need::Optional { .. }))
    }

    /// Whether the kernel has the feature `id` (features decided at use count as present).
    #[must_use]
    pub fn has(&self, id: &str) -> bool {
        self.findings
            .iter()
            .find(|finding| finding.feature.id == id)
            .is_none_or(|finding| finding.present)
    }
}

/// aya's probe for `feature`: every listed helper from every listed program type.
fn probe_feature(feature: &KernelFeature) -> Result<bool, ProgramError> {
    match (feature.probe, feature.uses) {
        (Probe::Program(program), _) => is_program_supported(program),
        (Probe::Map(map), _) => is_map_supported(map).map_err(ProgramError::SyscallError),
        (Probe::Helpers, Uses::Helpers { programs, helpers }) => {
            for program in programs {
                for helper in helpers {
                    if !is_helper_supported(*program, *helper)? {
                        return Ok(false);
                    }
                }
            }
            Ok(true)
        }
        (Probe::AtomicFetch, _) => atomics::probe().map_err(|io_error| {
            ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_prog_load",
                io_error,
            })
        }),
        // Rows without a probe never reach here; a `Helpers` probe without helpers has nothing
        // to ask (the table test refuses such a row).
        _ => Ok(true),
    }
}

/// The running kernel lacks a required feature.
#[derive(Debug, thiserror::Error)]
#[error(
    "Linux {release} lacks {missing}, which redirector needs: run it on Linux {} or later \
     (or on a kernel with these backported) (nothing was loaded or attached)",
    mainline(*.floor)
)]
pub struct KernelLacks {
    /// `uname -r`.
    pub release: String,
    /// The missing features with the release of each and how it was decided, joined.
    pub missing: String,
    /// The oldest release redirector supports.
    pub floor: KernelVersion,
}

/// Refuses a kernel without a required feature.
///
/// # Errors
/// [`KernelLacks`], naming every missing feature.
pub fn require(support: &KernelSupport) -> Result<(), KernelLacks> {
    let missing: Vec<String> = support
        .missing()
        .filter(|finding| finding.feature.need == Need::Required)
        .map(|finding| {
            let how = match finding.decided_by {
                Decision::Probe => "probed",
                Decision::Release => "by release",
                Decision::TestOverride => "forced by the test override",
            };
            format!(
                "{} ({}, {how})",
                finding.feature.name.replace('`', ""),
                mainline(finding.feature.since)
            )
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(KernelLacks {
        release: support.release.clone(),
        missing: missing.join(", "),
        floor: FLOOR,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use aya_obj::generated::{
        BPF_ATOMIC, BPF_CALL, BPF_EXIT, BPF_FETCH, BPF_JA, BPF_JMP, BPF_STX, bpf_insn,
    };

    use super::*;

    #[test]
    fn releases_are_named_by_major_and_minor() {
        assert_eq!(mainline(FLOOR), "5.15");
        assert_eq!(mainline(KernelVersion::new(6, 12, 117)), "6.12");
        assert_eq!(mainline(KernelVersion::new(4, 19, 325)), "4.19");
    }

    #[test]
    fn every_required_feature_is_at_or_below_the_floor() {
        for feature in FEATURES {
            if feature.since > FLOOR {
                assert!(
                    matches!(feature.need, Need::Optional { .. }),
                    "{} ({}) is newer than the floor {}: it must be optional",
                    feature.name,
                    mainline(feature.since),
                    mainline(FLOOR)
                );
            }
            // A helper probe needs helpers to ask about.
            assert!(
                feature.probe != Probe::Helpers || matches!(feature.uses, Uses::Helpers { .. }),
                "{}",
                feature.name
            );
        }
        let ids: BTreeSet<&str> = FEATURES.iter().map(|feature| feature.id).collect();
        assert_eq!(ids.len(), FEATURES.len(), "ids are unique");
    }

    /// The 5.15 node the floor is for, with the probes answering as its kernel would: every
    /// feature up to 5.15, nothing newer.
    fn on_5_15(feature: &KernelFeature) -> Result<bool, ProgramError> {
        Ok(feature.since <= FLOOR)
    }

    #[test]
    fn a_5_15_kernel_runs_without_set_retval_and_says_so() {
        let support = KernelSupport::decide(
            "5.15.0-1064-azure",
            Some(KernelVersion::new(5, 15, 0)),
            &[],
            on_5_15,
        );
        assert!(require(&support).is_ok());
        let degraded: Vec<&str> = support
            .degraded()
            .map(|finding| finding.feature.id)
            .collect();
        assert_eq!(degraded, [SET_RETVAL]);
        assert!(!support.has(SET_RETVAL));
        assert!(support.has("nft_notrack"), "decided at use, not here");
    }

    /// `docs/kernels.md`'s example: Amazon Linux 2's 5.10, its probes answering as its release would.
    #[test]
    fn a_5_10_kernel_is_refused_with_what_it_lacks() {
        let support = KernelSupport::decide(
            "5.10.240-238.955.amzn2.x86_64",
            Some(KernelVersion::new(5, 10, 240)),
            &[],
            |feature| Ok(feature.since <= KernelVersion::new(5, 10, 0)),
        );
        assert_eq!(
            require(&support).unwrap_err().to_string(),
            "Linux 5.10.240-238.955.amzn2.x86_64 lacks bpf_ktime_get_coarse_ns in sock_addr and \
             cgroup_skb programs (5.11, probed), SO_NETNS_COOKIE (agent) (5.14, by release), which \
             redirector needs: run it on Linux 5.15 or later (or on a kernel with these \
             backported) (nothing was loaded or attached)"
        );
    }

    /// An arm64 node on 5.15 (Ubuntu 22.04, `CONFIG_BPF_JIT_ALWAYS_ON`): its JIT compiles the
    /// fetching atomics only from 5.18, so the probe's load fails and the agent runs without
    /// them, switched off, instead of crash-looping on the programs' load.
    #[test]
    fn an_arm64_5_15_without_the_fetching_atomics_in_its_jit_runs_degraded() {
        let support = KernelSupport::decide(
            "5.15.0-1064-azure",
            Some(KernelVersion::new(5, 15, 0)),
            &[],
            |feature| Ok(feature.since <= FLOOR && feature.id != ATOMIC_FETCH),
        );
        assert!(require(&support).is_ok());
        let degraded: Vec<&str> = support
            .degraded()
            .map(|finding| finding.feature.id)
            .collect();
        assert_eq!(degraded, [ATOMIC_FETCH, SET_RETVAL]);
        assert!(!support.has(ATOMIC_FETCH));
    }

    #[test]
    fn probes_decide_over_the_release_number() {
        // A backport: a 5.15 whose probe finds bpf_set_retval has it.
        let support = KernelSupport::decide(
            "5.15.0-1064-azure",
            Some(KernelVersion::new(5, 15, 0)),
            &[],
            |_| Ok(true),
        );
        assert!(support.has(SET_RETVAL));
        assert_eq!(support.degraded().count(), 0);
        // A kernel new by its number whose probe misses a required helper is refused, and the
        // error says the probe decided.
        let support = KernelSupport::decide(
            "6.18.0",
            Some(KernelVersion::new(6, 18, 0)),
            &[],
            |feature| Ok(feature.id != "sock_addr_sk_storage"),
        );
        let error = require(&support).unwrap_err();
        assert_eq!(
            error.missing,
            "bpf_sk_storage_get in sock_addr programs (5.3, probed)"
        );
        let text = error.to_string();
        assert!(text.contains("Linux 6.18.0 lacks"), "{text}");
        assert!(text.contains("Linux 5.15 or later"), "{text}");
    }

    #[test]
    fn features_without_a_probe_are_decided_by_release_and_a_failed_probe_falls_back() {
        let failed = || {
            ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_prog_load",
                io_error: std::io::Error::from_raw_os_error(libc::EPERM),
            })
        };
        let support = KernelSupport::decide(
            "5.4.0-1-generic",
            Some(KernelVersion::new(5, 4, 0)),
            &[],
            |_| Err(failed()),
        );
        let error = require(&support).unwrap_err();
        for expected in [
            "cgroup v2 sock_release (5.9, by release)",
            "BPF_F_MMAPABLE array (5.5, by release)",
            "SO_NETNS_COOKIE (agent) (5.14, by release)",
        ] {
            assert!(error.missing.contains(expected), "{}", error.missing);
        }
        assert!(!error.missing.contains("recvmsg"), "{}", error.missing);
        assert!(
            !error.missing.contains("set_retval"),
            "optional: {}",
            error.missing
        );
        // Unreadable: nothing is missing by its number, the verifier decides.
        let support = KernelSupport::decide("weird", None, &[], |_| Err(failed()));
        assert!(require(&support).is_ok());
    }

    #[test]
    fn the_test_override_names_known_features_only() {
        assert_eq!(parse_absent(" set_retval ,").unwrap(), [SET_RETVAL]);
        assert_eq!(parse_absent("").unwrap(), Vec::<&str>::new());
        let error = parse_absent("set_retval,bpf_loop").unwrap_err();
        assert_eq!(error.id, "bpf_loop");
        assert!(
            error
                .to_string()
                .contains("set_retval, raw_tracepoint_test_run, nft_notrack"),
            "{error}"
        );
        let support = KernelSupport::decide(
            "6.18.0",
            Some(KernelVersion::new(6, 18, 0)),
            &[SET_RETVAL],
            |_| Ok(true),
        );
        let degraded: Vec<Decision> = support
            .degraded()
            .map(|finding| finding.decided_by)
            .collect();
        assert_eq!(degraded, [Decision::TestOverride]);
    }

    /// The program type of each program in the object, by the shared names.
    fn program_type(name: &str) -> ProgramType {
        if names::SOCK_ADDR_PROGRAMS.contains(&name) {
            ProgramType::CgroupSockAddr
        } else if names::SOCK_PROGRAMS.contains(&name) {
            ProgramType::CgroupSock
        } else if names::SKB_PROGRAMS.contains(&name) {
            ProgramType::CgroupSkb
        } else if names::RAW_TRACEPOINT_PROGRAMS.contains(&name) || name == names::PROG_TICKS {
            ProgramType::RawTracePoint
        } else {
            panic!("the object holds a program the shared names do not: {name}")
        }
    }

    /// What the audit finds in one program.
    #[derive(Default)]
    struct Found {
        helpers: BTreeSet<i32>,
        kfuncs: BTreeSet<i32>,
        atomic_fetch: bool,
    }

    fn scan(found: &mut Found, instructions: &[bpf_insn]) -> bool {
        let call = u8::try_from(BPF_JMP | BPF_CALL).expect("an opcode is a byte");
        let mut calls_functions = false;
        for insn in instructions {
            if insn.code == call {
                // src_reg: 0 a helper, 1 a bpf-to-bpf call, 2 a kfunc (BPF_PSEUDO_*).
                match insn.src_reg() {
                    0 => {
                        found.helpers.insert(insn.imm);
                    }
                    1 => calls_functions = true,
                    _ => {
                        found.kfuncs.insert(insn.imm);
                    }
                }
            }
            let class_and_mode = u32::from(insn.code) & 0xe7;
            let fetch = u32::try_from(insn.imm).is_ok_and(|imm| imm & BPF_FETCH != 0);
            if class_and_mode == (BPF_STX | BPF_ATOMIC) && fetch {
                found.atomic_fetch = true;
            }
        }
        calls_functions
    }

    /// Every helper call, kfunc call and fetching atomic in the embedded object, by program.
    fn audit_object() -> BTreeMap<String, (ProgramType, Found)> {
        let object = aya_obj::Object::parse(crate::datapath::OBJECT).expect("the object parses");
        let program_sections: BTreeSet<usize> = object
            .programs
            .values()
            .map(|program| program.section_index)
            .collect();
        object
            .programs
            .iter()
            .map(|(name, program)| {
                let mut found = Found::default();
                let mut calls_functions = false;
                // A program's section can hold subprograms of its own; calls to shared code go
                // to `.text`. Conservatively, a program that makes any bpf-to-bpf call is
                // charged with every function outside the programs' sections.
                for ((section, _), function) in &object.functions {
                    if *section == program.section_index {
                        calls_functions |= scan(&mut found, &function.instructions);
                    }
                }
                if calls_functions {
                    for ((section, _), function) in &object.functions {
                        if !program_sections.contains(section) {
                            scan(&mut found, &function.instructions);
                        }
                    }
                }
                (name.clone(), (program_type(name), found))
            })
            .collect()
    }

    /// The instructions a depth-first walk of `instructions` finds entered by falling through a
    /// non-jump instruction while on the walk's own path: a loop closed that way. The floor's
    /// verifier (5.15, and 6.1 as the VM test saw: "back-edge from insn N to N+1") accepts a
    /// loop's back edge only from a jump, and walks as this does (a conditional jump's fall-through
    /// first); newer ones accept either, so the host's verifier never shows it.
    fn fall_through_back_edges(instructions: &[bpf_insn]) -> Vec<usize> {
        const BPF_JMP32: u8 = 0x06;
        const BPF_LD_IMM64: u8 = 0x18;
        let jump_class = |code: u8| code & 0x07 == BPF_JMP as u8 || code & 0x07 == BPF_JMP32;
        // (target, whether it is a non-jump instruction's fall-through).
        let edges = |at: usize| -> Vec<(usize, bool)> {
            let insn = &instructions[at];
            let op = insn.code & 0xf0;
            if !jump_class(insn.code) || op == BPF_CALL as u8 {
                let width = if insn.code == BPF_LD_IMM64 { 2 } else { 1 };
                return vec![(at + width, true)];
            }
            if op == BPF_EXIT as u8 {
                return Vec::new();
            }
            let target = usize::try_from(at as i64 + 1 + i64::from(insn.off)).unwrap_or(usize::MAX);
            if op == BPF_JA as u8 {
                vec![(target, false)]
            } else {
                vec![(at + 1, false), (target, false)]
            }
        };
        let (mut state, mut closed) = (vec![0u8; instructions.len()], Vec::new());
        let mut path = vec![(0usize, edges(0), 0usize)];
        state[0] = 1;
        while let Some((at, out, next)) = path.last_mut() {
            let Some(&(target, fell)) = out.get(*next) else {
                state[*at] = 2;
                path.pop();
                continue;
            };
            *next += 1;
            match state.get(target) {
                Some(1) if fell => closed.push(target),
                Some(0) => {
                    state[target] = 1;
                    path.push((target, edges(target), 0));
                }
                _ => {}
            }
        }
        closed
    }

    #[test]
    fn no_loop_in_the_object_closes_by_falling_through() {
        let object = aya_obj::Object::parse(crate::datapath::OBJECT).expect("the object parses");
        let mut closed = Vec::new();
        for ((section, offset), function) in &object.functions {
            for at in fall_through_back_edges(&function.instructions) {
                closed.push(format!(
                    "{} (section {section}, offset {offset}): insn {at}",
                    function.name
                ));
            }
        }
        assert!(
            closed.is_empty(),
            "loops that 5.15 and 6.1 refuse (\"back-edge from insn\"); restructure the loop (a \
             constant trip count the compiler unrolls, or the exit test at its bottom):\n{}",
            closed.join("\n")
        );
    }

    #[test]
    fn every_helper_call_in_the_object_has_its_row_and_none_is_newer_than_the_floor_unswitched() {
        let audit = audit_object();
        let mut unlisted = Vec::new();
        let mut used: BTreeSet<(&str, i32)> = BTreeSet::new();
        for (name, (program, found)) in &audit {
            assert!(
                found.kfuncs.is_empty(),
                "{name} calls kfuncs {:?}: kfuncs need a row and a probe of their own (BTF), \
                 which this table does not have yet",
                found.kfuncs
            );
            for helper in &found.helpers {
                let rows: Vec<&KernelFeature> = FEATURES
                    .iter()
                    .filter(|feature| match feature.uses {
                        Uses::Helpers { programs, helpers } => {
                            programs.contains(program)
                                && helpers.iter().any(|listed| *listed as i32 == *helper)
                        }
                        _ => false,
                    })
                    .collect();
                if rows.is_empty() {
                    unlisted.push(format!("{name} ({program:?}) calls helper #{helper}"));
                }
                for row in rows {
                    used.insert((row.id, *helper));
                    if row.since > FLOOR {
                        let switch = match row.need {
                            Need::Optional { switch, .. } => switch,
                            Need::Required => None,
                        };
                        let switch = switch.unwrap_or_else(|| {
                            panic!(
                                "{name} calls helper #{helper} ({}, {}) above the floor {} \
                                 without a switch",
                                row.name,
                                mainline(row.since),
                                mainline(FLOOR)
                            )
                        });
                        assert!(
                            crate::datapath::OBJECT
                                .windows(switch.len())
                                .any(|window| window == switch.as_bytes()),
                            "the switch {switch} of {} is not in the object",
                            row.name
                        );
                    }
                }
            }
            if found.atomic_fetch {
                // Above the floor on arm64 (5.18): behind its switch, which the object has.
                let switch = FEATURES
                    .iter()
                    .find(|feature| feature.uses == Uses::AtomicFetch)
                    .and_then(|feature| match feature.need {
                        Need::Optional { switch, .. } => switch,
                        Need::Required => None,
                    })
                    .unwrap_or_else(|| {
                        panic!("{name} uses a fetching atomic without its switched row")
                    });
                assert!(
                    crate::datapath::OBJECT
                        .windows(switch.len())
                        .any(|window| window == switch.as_bytes()),
                    "the switch {switch} of the fetching atomics is not in the object"
                );
            }
        }
        assert!(
            unlisted.is_empty(),
            "helper calls without a row in FEATURES (add one, with its release and probe):\n{}",
            unlisted.join("\n")
        );
        // And no row lists a helper the object no longer calls.
        for feature in FEATURES {
            if let Uses::Helpers { helpers, .. } = feature.uses {
                for helper in helpers {
                    assert!(
                        used.contains(&(feature.id, *helper as i32)),
                        "{} lists {helper:?}, which no program of its types calls",
                        feature.name
                    );
                }
            }
        }
        assert!(
            audit.values().any(|(_, found)| found.atomic_fetch),
            "the fetching atomic row has no use left"
        );
    }

    #[test]
    fn the_documented_table_is_this_table() {
        let page = include_str!("../../../docs/kernels.md");
        let rows: Vec<Vec<String>> = page
            .lines()
            .skip_while(|line| !line.starts_with("| feature"))
            .skip(2)
            .take_while(|line| line.starts_with('|'))
            .map(|line| {
                line.trim_matches('|')
                    .split(" | ")
                    .map(|cell| cell.trim().to_owned())
                    .collect()
            })
            .collect();
        let expected: Vec<Vec<String>> = FEATURES
            .iter()
            .map(|feature| {
                vec![
                    feature.name.to_owned(),
                    feature.used_for.to_owned(),
                    mainline(feature.since),
                    match feature.probe {
                        Probe::Program(_) => "probe: program type",
                        Probe::Map(_) => "probe: map type",
                        Probe::Helpers => "probe: helper",
                        Probe::Release => "release",
                        Probe::AtUse => "at use",
                        Probe::AtomicFetch => "probe: loads them",
                    }
                    .to_owned(),
                    match feature.need {
                        Need::Required => "refuses to start".to_owned(),
                        Need::Optional { without, .. } => format!("degrades: {without}"),
                    },
                ]
            })
            .collect();
        assert_eq!(rows, expected, "docs/kernels.md's table");
    }
}
