//! The agent's verdict on a cache, from its probes, with hysteresis; and its place in the kernel's
//! epochs (see `CacheHealth::confirmed_epoch`).

use std::time::Duration;

use redirector_common::{
    activity::{CacheActivity, FLIP_DRAINED, FLIP_SIGNALLED},
    listener::{CacheHealth, HEALTH_DOWN, HEALTH_UP},
};

/// How many probes decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hysteresis {
    /// Consecutive failures that turn the verdict down.
    pub failures_to_fail_over: u32,
    /// Consecutive successes that turn it up (and confirm the current epoch).
    pub successes_to_fail_back: u32,
}

/// What one probe says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The cache answered.
    Answered,
    /// The cache answered, but its epoch is held: the answer confirms nothing.
    Held,
    /// No answer.
    Failed,
}

impl Probe {
    /// The probe of a cache that answered (`alive`) or not, `held` or not.
    #[must_use]
    pub const fn new(alive: bool, held: bool) -> Self {
        match (alive, held) {
            (false, _) => Self::Failed,
            (true, true) => Self::Held,
            (true, false) => Self::Answered,
        }
    }
}

/// Whether the kernel's epoch `epoch` is held: begun by a drain (held until the drain ends or the
/// cache's next life begins a new epoch), or by a terminating signal less than `signal_hold` ago
/// at `now_ns` (a cache shutting down may answer its probes until its last socket closes, which
/// begins the next epoch; one that survived its signal gets DNS back after the hold). Times are
/// monotonic ns, as the kernel's `flip_ns`.
#[must_use]
pub fn held(activity: &CacheActivity, epoch: u64, now_ns: u64, signal_hold: Duration) -> bool {
    if activity.flip_epoch != epoch {
        return false;
    }
    match activity.flip_reason {
        FLIP_DRAINED => true,
        FLIP_SIGNALLED => {
            u128::from(now_ns.saturating_sub(activity.flip_ns)) < signal_hold.as_nanos()
        }
        _ => false,
    }
}

/// Now on the clock the kernel's `bpf_ktime_get_*ns` read (`CLOCK_MONOTONIC`), in ns.
#[must_use]
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |now| {
        u64::try_from(Duration::from(now).as_nanos()).unwrap_or(u64::MAX)
    })
}

/// One cache's verdict and the probe streaks behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthTracker {
    hysteresis: Hysteresis,
    health: CacheHealth,
    successes: u32,
    failures: u32,
    seen_epoch: u64,
}

impl HealthTracker {
    /// Starts up (the cache's sockets exist) or down, confirmed in the kernel's current `epoch`.
    #[must_use]
    pub fn new(hysteresis: Hysteresis, up: bool, epoch: u64) -> Self {
        Self {
            hysteresis,
            health: CacheHealth {
                verdict: if up { HEALTH_UP } else { HEALTH_DOWN },
                _padding: 0,
                confirmed_epoch: epoch,
            },
            successes: 0,
            failures: 0,
            seen_epoch: epoch,
        }
    }

    /// Goes on from `pinned`, the verdict an earlier agent left in `CACHE_HEALTH`, with the
    /// kernel now at `epoch`: a restart keeps the verdict until the probes' hysteresis turns it,
    /// and a cache that went away meanwhile still has to be confirmed in the new epoch. `None`
    /// when `pinned` holds no verdict (`HEALTH_UNKNOWN`).
    #[must_use]
    pub fn resume(hysteresis: Hysteresis, pinned: CacheHealth, epoch: u64) -> Option<Self> {
        (pinned.verdict == HEALTH_UP || pinned.verdict == HEALTH_DOWN).then_some(Self {
            hysteresis,
            health: pinned,
            successes: 0,
            failures: 0,
            seen_epoch: epoch,
        })
    }

    /// The verdict of a start: the one an earlier agent pinned, if any, else up when `vouched`
    /// (the cache's sockets exist, or only probes judge it) and the epoch is not held; then the
    /// start's first `probe` counts as one more in its streak. So a slow first answer is the
    /// first of the failures it takes to turn the verdict down, not the verdict: a start must not
    /// fail the DNS of a serving cache over to pools its sources have not filled yet.
    #[must_use]
    pub fn first(
        hysteresis: Hysteresis,
        pinned: CacheHealth,
        epoch: u64,
        vouched: bool,
        probe: Probe,
    ) -> Self {
        let mut tracker = Self::resume(hysteresis, pinned, epoch)
            .unwrap_or_else(|| Self::new(hysteresis, vouched && probe != Probe::Held, epoch));
        tracker.record(probe, epoch);
        tracker
    }

    /// What to write into `CACHE_HEALTH`.
    #[must_use]
    pub fn health(&self) -> CacheHealth {
        self.health
    }

    /// Records one probe, seen while the kernel is at `kernel_epoch`. Returns the new health when
    /// it changed (and must be written).
    ///
    /// A new epoch means the kernel saw every UDP socket of the cache close since the previous
    /// probe: whatever serves now must earn a full streak of successes, counted from then, before
    /// the epoch is confirmed and the cache gets DNS back.
    ///
    /// `kernel_epoch` is the epoch the probe was *sent* in: an answer vouches only for the cache
    /// that existed then. Probes overlap, so one sent in an earlier epoch than the newest seen
    /// may come back late; it says nothing about the cache serving now and is ignored.
    ///
    /// `Probe::Held` is an answer that must not confirm the epoch (the kernel's flip that began it
    /// is a drain, or a signal whose cache may still be shutting down): it keeps the verdict from
    /// turning down, and starts no streak.
    pub fn record(&mut self, probe: Probe, kernel_epoch: u64) -> Option<CacheHealth> {
        let before = self.health;
        if kernel_epoch < self.seen_epoch {
            return None;
        }
        if kernel_epoch != self.seen_epoch {
            self.seen_epoch = kernel_epoch;
            self.successes = 0;
        }
        if probe == Probe::Held {
            self.failures = 0;
            self.successes = 0;
        } else if probe == Probe::Answered {
            self.successes = self.successes.saturating_add(1);
            self.failures = 0;
            if self.successes >= self.hysteresis.successes_to_fail_back {
                self.health.verdict = HEALTH_UP;
                self.health.confirmed_epoch = kernel_epoch;
            }
        } else {
            self.failures = self.failures.saturating_add(1);
            self.successes = 0;
            if self.failures >= self.hysteresis.failures_to_fail_over {
                self.health.verdict = HEALTH_DOWN;
            }
        }
        (self.health != before).then_some(self.health)
    }
}

#[cfg(test)]
mod tests {
    use redirector_common::activity::FLIP_STALLED;

    use super::*;

    const DEFAULTS: Hysteresis = Hysteresis {
        failures_to_fail_over: 2,
        successes_to_fail_back: 3,
    };

    #[test]
    fn a_first_start_s_failed_probe_is_the_first_of_two() {
        let none = CacheHealth::default();
        let mut tracker = HealthTracker::first(DEFAULTS, none, 3, true, Probe::Failed);
        assert_eq!(
            tracker.health().verdict,
            HEALTH_UP,
            "one slow answer decides nothing"
        );
        let changed = tracker
            .record(Probe::Failed, 3)
            .expect("the second failure decides");
        assert_eq!(changed.verdict, HEALTH_DOWN);
        // Nothing vouches for a cache without sockets: down, as the kernel has it.
        let tracker = HealthTracker::first(DEFAULTS, none, 3, false, Probe::Failed);
        assert_eq!(tracker.health().verdict, HEALTH_DOWN);
        // A held epoch is not confirmed by the start either.
        let tracker = HealthTracker::first(DEFAULTS, none, 3, true, Probe::Held);
        assert_eq!(tracker.health().verdict, HEALTH_DOWN);
        // A pinned verdict stands, and the probe is one more in its streak.
        let pinned = CacheHealth {
            verdict: HEALTH_UP,
            _padding: 0,
            confirmed_epoch: 3,
        };
        let mut tracker = HealthTracker::first(DEFAULTS, pinned, 3, true, Probe::Failed);
        assert_eq!(tracker.health().verdict, HEALTH_UP);
        assert!(
            tracker.record(Probe::Failed, 3).is_some(),
            "the second failure decides"
        );
    }

    #[test]
    fn two_failures_turn_it_down_not_one() {
        let mut tracker = HealthTracker::new(DEFAULTS, true, 0);
        assert_eq!(tracker.record(Probe::Failed, 0), None);
        let changed = tracker
            .record(Probe::Failed, 0)
            .expect("second failure decides");
        assert_eq!(changed.verdict, HEALTH_DOWN);
        assert_eq!(
            tracker.record(Probe::Failed, 0),
            None,
            "no change while it stays down"
        );
    }

    #[test]
    fn three_successes_turn_it_up_and_a_failure_restarts_the_streak() {
        let mut tracker = HealthTracker::new(DEFAULTS, false, 0);
        assert_eq!(tracker.record(Probe::Answered, 0), None);
        assert_eq!(tracker.record(Probe::Answered, 0), None);
        assert_eq!(tracker.record(Probe::Failed, 0), None);
        assert_eq!(tracker.record(Probe::Answered, 0), None);
        assert_eq!(tracker.record(Probe::Answered, 0), None);
        let changed = tracker
            .record(Probe::Answered, 0)
            .expect("third success in a row decides");
        assert_eq!(changed.verdict, HEALTH_UP);
    }

    #[test]
    fn a_new_epoch_must_be_confirmed_by_a_fresh_streak() {
        let mut tracker = HealthTracker::new(DEFAULTS, true, 4);
        assert_eq!(tracker.record(Probe::Answered, 4), None);
        assert_eq!(tracker.record(Probe::Answered, 4), None);
        // The cache died and came back between probes: the kernel is at epoch 5.
        assert_eq!(
            tracker.record(Probe::Answered, 5),
            None,
            "1st success in the new epoch"
        );
        assert_eq!(tracker.record(Probe::Answered, 5), None, "2nd");
        let changed = tracker.record(Probe::Answered, 5).expect("3rd confirms");
        assert_eq!((changed.verdict, changed.confirmed_epoch), (HEALTH_UP, 5));
    }

    #[test]
    fn a_probe_sent_in_an_earlier_epoch_is_ignored() {
        let quick = Hysteresis {
            failures_to_fail_over: 1,
            successes_to_fail_back: 1,
        };
        let mut tracker = HealthTracker::new(quick, true, 5);
        assert_eq!(
            tracker
                .record(Probe::Answered, 6)
                .map(|h| h.confirmed_epoch),
            Some(6)
        );
        assert_eq!(
            tracker.record(Probe::Answered, 5),
            None,
            "a late success of epoch 5"
        );
        assert_eq!(
            tracker.record(Probe::Failed, 5),
            None,
            "a late failure of epoch 5"
        );
        assert_eq!(tracker.health().confirmed_epoch, 6);
        assert_eq!(tracker.health().verdict, HEALTH_UP);
    }

    #[test]
    fn a_restart_keeps_the_pinned_verdict_until_the_hysteresis_turns_it() {
        let pinned = HealthTracker::new(DEFAULTS, true, 3).health();
        let mut tracker = HealthTracker::resume(DEFAULTS, pinned, 3).expect("a verdict");
        assert_eq!(
            tracker.record(Probe::Failed, 3),
            None,
            "one failure is not enough"
        );
        assert_eq!(tracker.health().verdict, HEALTH_UP);
        assert_eq!(
            tracker.record(Probe::Failed, 3).map(|h| h.verdict),
            Some(HEALTH_DOWN)
        );
        // The cache came back while no agent ran: it is confirmed in the new epoch only.
        let mut tracker = HealthTracker::resume(DEFAULTS, pinned, 4).expect("a verdict");
        assert_eq!(tracker.record(Probe::Answered, 4), None);
        assert_eq!(tracker.record(Probe::Answered, 4), None);
        assert_eq!(
            tracker
                .record(Probe::Answered, 4)
                .map(|h| h.confirmed_epoch),
            Some(4)
        );
        assert!(
            HealthTracker::resume(DEFAULTS, CacheHealth::default(), 0).is_none(),
            "a zeroed entry holds no verdict"
        );
    }

    #[test]
    fn an_epoch_change_mid_streak_restarts_it() {
        let mut tracker = HealthTracker::new(DEFAULTS, false, 0);
        tracker.record(Probe::Answered, 0);
        tracker.record(Probe::Answered, 0);
        assert_eq!(
            tracker.record(Probe::Answered, 1),
            None,
            "the streak restarts in epoch 1"
        );
        assert_eq!(tracker.record(Probe::Answered, 1), None);
        assert_eq!(
            tracker
                .record(Probe::Answered, 1)
                .map(|health| health.confirmed_epoch),
            Some(1)
        );
    }

    #[test]
    fn a_held_epoch_is_not_confirmed_and_not_failed() {
        let mut tracker = HealthTracker::new(DEFAULTS, true, 4);
        for _ in 0..10 {
            assert_eq!(tracker.record(Probe::Held, 5), None);
        }
        assert_eq!(tracker.health().confirmed_epoch, 4);
        assert_eq!(tracker.health().verdict, HEALTH_UP);
        // Released: a full streak, counted from the release, confirms it.
        assert_eq!(tracker.record(Probe::Answered, 5), None);
        assert_eq!(tracker.record(Probe::Answered, 5), None);
        assert_eq!(
            tracker
                .record(Probe::Answered, 5)
                .map(|h| h.confirmed_epoch),
            Some(5)
        );
    }

    #[test]
    fn drains_hold_their_epoch_and_signals_hold_it_for_a_while() {
        let hold = Duration::from_secs(6);
        let flip = |reason| CacheActivity {
            flip_epoch: 9,
            flip_ns: 1_000_000_000,
            flip_reason: reason,
            ..CacheActivity::default()
        };
        let later = |secs: u64| 1_000_000_000 + secs * 1_000_000_000;
        assert!(held(&flip(FLIP_DRAINED), 9, later(3600), hold));
        assert!(held(&flip(FLIP_SIGNALLED), 9, later(5), hold));
        assert!(!held(&flip(FLIP_SIGNALLED), 9, later(6), hold));
        // A stall is confirmed by the probes at once: the cache is back when it answers.
        assert!(!held(&flip(FLIP_STALLED), 9, later(0), hold));
        // The cache's sockets closed since: its next life is probed as any other.
        assert!(!held(&flip(FLIP_DRAINED), 10, later(0), hold));
    }
}
