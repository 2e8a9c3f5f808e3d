//! A cache's activity as the programs see it, and the record of the kernel's own flips.
//!
//! The programs see every UDP query handed to a cache (an unconnected client's `sendmsg`, a
//! connected client's datagram at egress) and every datagram the cache reads (`recvmsg` on a
//! counted cache socket). A cache that has left a query unread for longer than its listener's
//! `StallTiming` is stalled (a `SIGSTOP`, a frozen cgroup, a deadlock): the next query moves its
//! listener upstream, in the kernel, as the last close of its sockets does. A saturated cache
//! that keeps reading is never stalled, however long its queue.

use crate::listener::{Reason, SocketCounts};

/// Value of `CACHE_ACTIVITY`, indexed by listener id. Written by the programs (and, for a drain,
/// by the agent) through the mmapable array, field by field: never replaced whole.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CacheActivity {
    /// Coarse monotonic ns (`StallTiming` has the clock) of the first UDP query handed to the
    /// cache in a clock tick after its last read: the query is unread while this is later than
    /// `last_read_ns` ([`unread_since`]); 0 after a stall's flip.
    pub first_unread_ns: u64,
    /// Coarse monotonic ns of a read of the cache's that answered the stamp: its first read
    /// ever, and its first after each query stamped unread (so once a tick at most; the reads in
    /// between need no clock); 0 while no read was ever seen (the cache runs outside the attach
    /// cgroup, or serves only TCP): such a cache is never called stalled.
    pub last_read_ns: u64,
    /// The `SocketCounts::down_epoch` the kernel's latest flip of this listener began (a signal,
    /// a stall or a drain); the flip explains the listener's route while the epoch is unchanged.
    pub flip_epoch: u64,
    /// Monotonic time (coarse, ns) of that flip.
    pub flip_ns: u64,
    /// `FLIP_SIGNALLED`, `FLIP_STALLED` or `FLIP_DRAINED`; `FLIP_NONE` before the first.
    pub flip_reason: u32,
    /// Zero.
    pub _padding: u32,
    /// Flips on a terminating signal to the cache (one per thread that saw it).
    pub signalled: u64,
    /// Flips on a stall.
    pub stalled: u64,
    /// Drains.
    pub drained: u64,
}
const _: () = assert!(size_of::<CacheActivity>() == 64);

/// `CacheActivity::flip_reason`: no flip recorded.
pub const FLIP_NONE: u32 = 0;
/// `CacheActivity::flip_reason`: a process that bound the cache's sockets was delivered a
/// terminating signal.
pub const FLIP_SIGNALLED: u32 = 1;
/// `CacheActivity::flip_reason`: the cache left a query unread past its `StallTiming`.
pub const FLIP_STALLED: u32 = 2;
/// `CacheActivity::flip_reason`: an operator (or the cache's stop hook) drained the listener.
pub const FLIP_DRAINED: u32 = 3;

/// Value of `STALL_TIMING`, indexed by listener id: how long the cache may leave a query unread,
/// and the clock the programs stamp `CacheActivity` with. Written by the agent at every start.
///
/// The stamps are coarse monotonic ns. The programs make them from the kernel's tick count
/// (`bpf_jiffies64`, which the verifier turns into one load of `jiffies_64` on 64-bit kernels)
/// rather than from `bpf_ktime_get_coarse_ns` (a helper call that reads the timekeeper under its
/// seqcount): both advance together at each tick, so the stamps mean what they meant before, but
/// every query handed to the cache pays a load, a subtraction and a multiplication instead of a
/// call. The tick's length is `CONFIG_HZ`'s, which userspace cannot read everywhere: the agent
/// measures it against `CLOCK_MONOTONIC_COARSE` once a boot ([`StallTiming::tick_ns`] 0 until
/// then, or where it could not: the programs call the helper).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct StallTiming {
    /// How long the cache may leave a query unread before it is stalled, in ns; 0: never.
    pub stall_after_ns: u64,
    /// The kernel's tick (`TICK_NSEC`), ns; 0: the programs read `bpf_ktime_get_coarse_ns`.
    pub tick_ns: u64,
    /// A tick count (`jiffies_64`) the agent read...
    pub base_ticks: u64,
    /// ...and `CLOCK_MONOTONIC_COARSE` in that tick, ns.
    pub base_ns: u64,
}
const _: () = assert!(size_of::<StallTiming>() == 32);

impl StallTiming {
    /// Coarse monotonic ns at tick count `ticks` (no earlier than `base_ticks`). Within a tick of
    /// `bpf_ktime_get_coarse_ns` read in the same tick, for as long as the kernel runs: the tick
    /// count is derived from the monotonic clock by whole `TICK_NSEC` periods.
    #[inline(always)]
    #[must_use]
    pub const fn ticks_to_ns(&self, ticks: u64) -> u64 {
        self.base_ns.wrapping_add(
            ticks
                .wrapping_sub(self.base_ticks)
                .wrapping_mul(self.tick_ns),
        )
    }
}

/// When the oldest query the cache has not read was handed to it, from `CacheActivity`'s two
/// stamps: `None` when it has read since (or its reads were never seen). Each side writes its
/// stamp at most once a clock tick (a query only when the stamp is not later than the last read
/// and the tick changed, the cache only when a query is unread), so a cache under load and its
/// clients do not bounce the stamps' cache line between CPUs at every query; a stall is seen a
/// tick late at most.
#[inline(always)]
#[must_use]
pub const fn unread_since(first_unread_ns: u64, last_read_ns: u64) -> Option<u64> {
    if last_read_ns != 0 && first_unread_ns > last_read_ns {
        Some(first_unread_ns)
    } else {
        None
    }
}

/// Whether a cache handed its first unread query at `first_unread_ns` is stalled at `now_ns`
/// under `limit` (all coarse monotonic ns). A clock read on another CPU may be a tick behind the
/// stamp: that is never a stall.
#[inline(always)]
#[must_use]
pub const fn is_stalled(first_unread_ns: u64, now_ns: u64, limit: &StallTiming) -> bool {
    limit.stall_after_ns != 0
        && first_unread_ns != 0
        && now_ns > first_unread_ns
        && now_ns - first_unread_ns >= limit.stall_after_ns
}

/// The reason for a listener's route, with the kernel's own flips told apart: a listener awaiting
/// confirmation in the epoch its latest flip began routes upstream because of that flip.
#[inline(always)]
#[must_use]
pub const fn explain_flip(
    reason: Reason,
    activity: &CacheActivity,
    sockets: &SocketCounts,
) -> Reason {
    if !matches!(reason, Reason::AwaitingConfirmation) || activity.flip_epoch != sockets.down_epoch
    {
        return reason;
    }
    match activity.flip_reason {
        FLIP_SIGNALLED => Reason::Signalled,
        FLIP_STALLED => Reason::Stalled,
        FLIP_DRAINED => Reason::Drained,
        _ => reason,
    }
}

/// Words of the `CACHE_PORTS` array: one bit per port (network byte order), as `REPLY_PORTS`.
pub const CACHE_PORT_WORDS: usize = crate::reverse::REPLY_PORT_WORDS;

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: StallTiming = StallTiming {
        stall_after_ns: 80_000_000,
        tick_ns: 0,
        base_ticks: 0,
        base_ns: 0,
    };

    #[test]
    fn a_query_unread_past_the_limit_is_a_stall() {
        assert!(is_stalled(1_000, 1_000 + 80_000_000, &LIMIT));
        assert!(!is_stalled(1_000, 1_000 + 79_999_999, &LIMIT));
    }

    #[test]
    fn nothing_unread_no_limit_or_a_clock_behind_is_no_stall() {
        assert!(!is_stalled(0, u64::MAX, &LIMIT));
        assert!(!is_stalled(1_000, u64::MAX, &StallTiming::default()));
        assert!(!is_stalled(2_000, 1_000, &LIMIT));
    }

    #[test]
    fn ticks_count_whole_periods_from_the_base() {
        let timing = StallTiming {
            tick_ns: 4_000_000,
            base_ticks: 4_300_000_000,
            base_ns: 23_000_000_123,
            ..LIMIT
        };
        assert_eq!(timing.ticks_to_ns(4_300_000_000), 23_000_000_123);
        assert_eq!(timing.ticks_to_ns(4_300_000_020), 23_080_000_123);
    }

    #[test]
    fn a_query_is_unread_only_when_stamped_after_the_last_read() {
        assert_eq!(unread_since(2_000, 1_000), Some(2_000));
        // Read in the same tick, or later: nothing unread.
        assert_eq!(unread_since(1_000, 1_000), None);
        assert_eq!(unread_since(1_000, 2_000), None);
        // Reads never seen, or the stamp cleared by a flip.
        assert_eq!(unread_since(2_000, 0), None);
        assert_eq!(unread_since(0, 1_000), None);
    }

    #[test]
    fn a_flip_explains_only_the_epoch_it_began() {
        let activity = CacheActivity {
            flip_epoch: 7,
            flip_reason: FLIP_STALLED,
            ..CacheActivity::default()
        };
        let at = |down_epoch| SocketCounts {
            udp: 1,
            tcp: 0,
            down_epoch,
        };
        assert_eq!(
            explain_flip(Reason::AwaitingConfirmation, &activity, &at(7)),
            Reason::Stalled
        );
        // The cache's sockets closed since: a new epoch, the plain reason.
        assert_eq!(
            explain_flip(Reason::AwaitingConfirmation, &activity, &at(8)),
            Reason::AwaitingConfirmation
        );
        // Confirmed failing by the probes, or no socket left: those say more.
        for reason in [Reason::ProbesFailing, Reason::NoSockets, Reason::Healthy] {
            assert_eq!(explain_flip(reason, &activity, &at(7)), reason);
        }
    }
}
