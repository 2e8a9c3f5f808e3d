//! Per-listener counters, kept per CPU by the programs and summed by the agent.

use crate::listener::MAX_LISTENERS;

/// The protocol numbers index a listener's rows: here too, where the counters' users find them.
pub use crate::protocol::{
    IPPROTO_TCP, IPPROTO_UDP, PROTOCOL_TCP, PROTOCOL_UDP, PROTOCOLS, protocol_row,
};

/// Entries of the `COUNTERS` map.
pub const COUNTER_ENTRIES: usize = MAX_LISTENERS * PROTOCOLS as usize;

/// Index into `COUNTERS` of a listener's row for `protocol`.
#[inline(always)]
#[must_use]
pub const fn counter_index(listener_id: u32, protocol: u32) -> u32 {
    listener_id * PROTOCOLS + protocol
}

/// Value of `COUNTERS` (per CPU). Each field counts syscalls, not bytes.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ListenerCounters {
    /// DNS syscalls sent to the cache.
    pub to_cache: u64,
    /// DNS syscalls sent to an upstream target.
    pub to_upstream: u64,
    /// Upstream wanted, pool empty, policy `pass`: left untouched.
    pub passed_through: u64,
    /// Upstream wanted, pool empty, policy `fail`: failed with `EHOSTUNREACH`.
    pub failed_empty_pool: u64,
    /// Sockets of a skipped cgroup (the cache's own queries): left untouched.
    pub skipped_cgroup: u64,
    /// Replies (`recvmsg`) and peer lookups (`getpeername`) rewritten back to the listener.
    pub reverse_translated: u64,
    /// Replies and peer lookups on a steered socket with no translation recorded (evicted, or the
    /// socket also talks to servers directly).
    pub reverse_missed: u64,
    /// Sends of connected sockets refused so that they reconnect to the cache (their peer was an
    /// upstream, or the listener left untouched, while the route is the cache).
    pub moved_to_cache: u64,
    /// Sends of connected sockets refused so that they reconnect to the pool (their peer was the
    /// cache, or a target that left the pool, while the route is upstream).
    pub moved_to_upstream: u64,
}
const _: () = assert!(size_of::<ListenerCounters>() == 72);

impl ListenerCounters {
    /// Field-wise sum, for folding the per-CPU values.
    #[must_use]
    pub const fn add(self, other: &Self) -> Self {
        Self {
            to_cache: self.to_cache + other.to_cache,
            to_upstream: self.to_upstream + other.to_upstream,
            passed_through: self.passed_through + other.passed_through,
            failed_empty_pool: self.failed_empty_pool + other.failed_empty_pool,
            skipped_cgroup: self.skipped_cgroup + other.skipped_cgroup,
            reverse_translated: self.reverse_translated + other.reverse_translated,
            reverse_missed: self.reverse_missed + other.reverse_missed,
            moved_to_cache: self.moved_to_cache + other.moved_to_cache,
            moved_to_upstream: self.moved_to_upstream + other.moved_to_upstream,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_listeners_do_not_overlap() {
        let last = counter_index(MAX_LISTENERS as u32 - 1, PROTOCOL_TCP);
        assert_eq!(last as usize, COUNTER_ENTRIES - 1);
        assert_ne!(
            counter_index(1, PROTOCOL_UDP),
            counter_index(0, PROTOCOL_TCP)
        );
    }

    #[test]
    fn add_sums_every_field() {
        let one = ListenerCounters {
            to_cache: 1,
            to_upstream: 2,
            passed_through: 3,
            failed_empty_pool: 4,
            skipped_cgroup: 5,
            reverse_translated: 6,
            reverse_missed: 7,
            moved_to_cache: 8,
            moved_to_upstream: 9,
        };
        let two = one.add(&one);
        assert_eq!(two.to_cache, 2);
        assert_eq!(two.reverse_missed, 14);
        assert_eq!(two.skipped_cgroup, 10);
        assert_eq!(two.moved_to_cache, 16);
        assert_eq!(two.moved_to_upstream, 18);
    }
}
