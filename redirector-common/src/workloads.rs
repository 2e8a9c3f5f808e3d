//! DNS per workload: what the programs count for each cgroup (its queries by route, its replies by
//! rcode class), and the rule that names a reply's class.
//!
//! A workload is a cgroup v2 directory, keyed by its id (the directory's inode number, as
//! `bpf_get_current_cgroup_id` reports it); the agent names it (a pod, a systemd unit).

/// Default entries of `WORKLOADS`: the cgroups tracked at once. An LRU: the least recently
/// counted cgroup makes room for a new one, and its counts start again from zero if it returns.
pub const WORKLOADS_DEFAULT_ENTRIES: u32 = 4096;

/// Entries of `WORKLOAD_EXEMPT`: every skipped cgroup (`MAX_SKIP_CGROUPS`), the agent's, and
/// those the operator lists (`MAX_LISTED_EXEMPT_CGROUPS`).
pub const MAX_EXEMPT_CGROUPS: usize = 256;
/// Most cgroups `workloads.exempt_cgroups` may list.
pub const MAX_LISTED_EXEMPT_CGROUPS: usize = 128;
const _: () = assert!(
    crate::datapath::MAX_SKIP_CGROUPS + 1 + MAX_LISTED_EXEMPT_CGROUPS <= MAX_EXEMPT_CGROUPS
);

/// Deepest cgroup level the programs walk when they look for an exempt ancestor (a new cgroup's
/// first count only).
pub const MAX_EXEMPT_LEVEL: i32 = 31;

/// A query the programs steered to the listener's cache.
pub const ROUTE_CACHE: usize = 0;
/// A query the programs steered to an upstream target (the cache was down, drained or stalled).
pub const ROUTE_UPSTREAM: usize = 1;
/// A query the programs refused (the cache was down and the pool empty under the `fail` policy).
pub const ROUTE_REFUSED: usize = 2;
/// A query to port 53 the programs left where it was addressed: a server that is no listener
/// (a pod asking kube-dns's Service or a public resolver itself: around the cache), or a listener
/// left untouched (the `pass` policy with an empty pool).
pub const ROUTE_DIRECT: usize = 3;
/// A query the programs refused because its workload was over its rate (`workloads.rate_limit`).
pub const ROUTE_LIMITED: usize = 4;
/// Routes a query is counted under.
pub const ROUTES: usize = 5;

/// A reply with rcode 0.
pub const RCODE_NOERROR: usize = 0;
/// A reply with rcode 3: the name does not exist.
pub const RCODE_NXDOMAIN: usize = 1;
/// A reply with rcode 2: the server failed.
pub const RCODE_SERVFAIL: usize = 2;
/// A reply with rcode 5: the server refused.
pub const RCODE_REFUSED: usize = 3;
/// Any other rcode (FORMERR, NOTIMP, ...).
pub const RCODE_OTHER: usize = 4;
/// Classes a reply is counted under.
pub const RCODE_CLASSES: usize = 5;

/// The class of a reply whose header's fourth byte is `flags_low` (the low 4 bits are the rcode,
/// RFC 1035 4.1.1).
#[inline(always)]
#[must_use]
pub const fn rcode_class(flags_low: u8) -> usize {
    match flags_low & 0x0f {
        0 => RCODE_NOERROR,
        3 => RCODE_NXDOMAIN,
        2 => RCODE_SERVFAIL,
        5 => RCODE_REFUSED,
        _ => RCODE_OTHER,
    }
}

/// Whether a DNS header's third byte (`QR`, opcode, `AA`, `TC`, `RD`) is a standard query's
/// reply: `QR` set, opcode 0.
#[inline(always)]
#[must_use]
pub const fn is_reply(flags_high: u8) -> bool {
    flags_high & 0xf8 == 0x80
}

/// `WorkloadCounters::flags`: the cgroup is exempt (the caches, the agent, and the cgroups the
/// operator lists, with their descendants): the programs count nothing for it.
pub const WORKLOAD_FLAG_EXEMPT: u32 = 1;
/// `WorkloadCounters::flags`: the cgroup is counted but never held to the rate limit.
pub const WORKLOAD_FLAG_UNLIMITED: u32 = 2;

/// `ExemptCgroup::exempt_from`: not counted (nor limited).
pub const EXEMPT_ACCOUNTING: u32 = 1;
/// `ExemptCgroup::exempt_from`: counted, never limited.
pub const EXEMPT_RATE_LIMIT: u32 = 2;

/// The flags a cgroup is entered with, from the `exempt_from` bits of it and its ancestors.
#[inline(always)]
#[must_use]
pub const fn entry_flags(exempt_from: u32) -> u32 {
    let mut flags = 0;
    if exempt_from & EXEMPT_ACCOUNTING != 0 {
        flags |= WORKLOAD_FLAG_EXEMPT;
    }
    if exempt_from & EXEMPT_RATE_LIMIT != 0 {
        flags |= WORKLOAD_FLAG_UNLIMITED;
    }
    flags
}

/// The rate limit's decision for a query at `now_ns` (the generic cell rate algorithm: one
/// stamp per workload, the time its next query is due): `next_ns` is the workload's stamp,
/// `interval_ns` the time one query's token takes to come back (1 s / rate), `tolerance_ns` how
/// far ahead of its due time a query may come ((burst - 1) x interval). Returns the new stamp
/// when the query is admitted, `None` when it is over the limit (the stamp stays).
#[inline(always)]
#[must_use]
pub const fn admit(now_ns: u64, next_ns: u64, interval_ns: u64, tolerance_ns: u64) -> Option<u64> {
    let due = if next_ns > now_ns { next_ns } else { now_ns };
    if due - now_ns > tolerance_ns {
        None
    } else {
        Some(due + interval_ns)
    }
}

/// Value of `WORKLOADS`, keyed by cgroup id. Shared by every CPU and changed by atomic adds only
/// (one entry per cgroup, not one per CPU: a node's thousands of cgroups times its CPUs would be
/// too much memory for counts read every few seconds).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct WorkloadCounters {
    /// Queries by route (`ROUTE_*`): a datagram sent, or a TCP connection made.
    pub queries: [u64; ROUTES],
    /// Replies received by rcode class (`RCODE_*`).
    pub replies: [u64; RCODE_CLASSES],
    /// `WORKLOAD_FLAG_*` bits, set when the programs enter the cgroup.
    pub flags: u32,
    /// A random number, never 0, drawn when the programs enter the cgroup: a reading that finds
    /// another than the last is of a new life (the cgroup was evicted and entered again), whatever
    /// its counts.
    pub life: u32,
    /// The rate limit's stamp (monotonic ns, `admit`): when the workload's next query is due.
    pub next_ns: u64,
}
const _: () = assert!(size_of::<WorkloadCounters>() == 96);

impl WorkloadCounters {
    /// Whether the programs count nothing for this cgroup.
    #[must_use]
    pub const fn is_exempt(&self) -> bool {
        self.flags & WORKLOAD_FLAG_EXEMPT != 0
    }

    /// Every query, whatever its route.
    #[must_use]
    pub fn total_queries(&self) -> u64 {
        self.queries.iter().sum()
    }

    /// Every reply, whatever its class.
    #[must_use]
    pub fn total_replies(&self) -> u64 {
        self.replies.iter().sum()
    }
}

/// Value of `WORKLOAD_EXEMPT`, keyed by cgroup id: what this cgroup and its descendants are
/// exempt from.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ExemptCgroup {
    /// The cgroup's level (root is 0), for the agent's records.
    pub level: u32,
    /// `EXEMPT_ACCOUNTING` and/or `EXEMPT_RATE_LIMIT`.
    pub exempt_from: u32,
}
const _: () = assert!(size_of::<ExemptCgroup>() == 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rcode_has_one_class() {
        assert_eq!(rcode_class(0x80), RCODE_NOERROR);
        assert_eq!(rcode_class(0x83), RCODE_NXDOMAIN);
        assert_eq!(rcode_class(0x02), RCODE_SERVFAIL);
        assert_eq!(rcode_class(0x05), RCODE_REFUSED);
        for rcode in [1, 4, 6, 9, 15] {
            assert_eq!(rcode_class(rcode), RCODE_OTHER, "{rcode}");
        }
    }

    #[test]
    fn only_a_standard_querys_reply_is_a_reply() {
        // QR|RD, QR|AA|RD, QR|TC.
        for flags in [0x81, 0x85, 0x82, 0x80] {
            assert!(is_reply(flags), "{flags:#x}");
        }
        // A query, a NOTIFY reply (opcode 4), an UPDATE reply (opcode 5).
        for flags in [0x01, 0x00, 0xa0, 0xa8] {
            assert!(!is_reply(flags), "{flags:#x}");
        }
    }

    #[test]
    fn a_burst_is_admitted_then_one_query_per_interval() {
        let (interval, burst) = (10, 3);
        let tolerance = (burst - 1) * interval;
        let mut next = 0;
        let mut admitted = 0;
        // 10 queries at once at t=1000: the burst passes, the rest are held.
        for _ in 0..10 {
            if let Some(stamp) = admit(1000, next, interval, tolerance) {
                next = stamp;
                admitted += 1;
            }
        }
        assert_eq!(admitted, burst);
        assert_eq!(admit(1000, next, interval, tolerance), None);
        // One interval later, one more.
        assert!(admit(1010, next, interval, tolerance).is_some());
        // A workload idle for long starts again with a whole burst, not a backlog.
        assert_eq!(admit(1_000_000, next, interval, tolerance), Some(1_000_010));
    }

    #[test]
    fn exemptions_become_entry_flags() {
        assert_eq!(entry_flags(0), 0);
        assert_eq!(entry_flags(EXEMPT_ACCOUNTING), WORKLOAD_FLAG_EXEMPT);
        assert_eq!(entry_flags(EXEMPT_RATE_LIMIT), WORKLOAD_FLAG_UNLIMITED);
    }

    #[test]
    fn totals_add_every_route_and_class() {
        let counters = WorkloadCounters {
            queries: [1, 2, 3, 4, 0],
            replies: [5, 6, 7, 8, 9],
            ..WorkloadCounters::default()
        };
        assert_eq!(counters.total_queries(), 10);
        assert_eq!(counters.total_replies(), 35);
        assert!(!counters.is_exempt());
    }
}
