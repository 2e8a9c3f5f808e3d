//! The agent's verdict on a cache, from its probes, with hysteresis; and its place in the kernel's
//! epochs (see `CacheHealth::confirmed_epoch`).

use redirector_common::listener::{CacheHealth, HEALTH_DOWN, HEALTH_UP};

/// How many probes decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hysteresis {
    /// Consecutive failures that turn the verdict down.
    pub failures_to_fail_over: u32,
    /// Consecutive successes that turn it up (and confirm the current epoch).
    pub successes_to_fail_back: u32,
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
    pub fn record(&mut self, alive: bool, kernel_epoch: u64) -> Option<CacheHealth> {
        let before = self.health;
        if kernel_epoch != self.seen_epoch {
            self.seen_epoch = kernel_epoch;
            self.successes = 0;
        }
        if alive {
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
    use super::*;

    const DEFAULTS: Hysteresis = Hysteresis {
        failures_to_fail_over: 2,
        successes_to_fail_back: 3,
    };

    #[test]
    fn two_failures_turn_it_down_not_one() {
        let mut tracker = HealthTracker::new(DEFAULTS, true, 0);
        assert_eq!(tracker.record(false, 0), None);
        let changed = tracker.record(false, 0).expect("second failure decides");
        assert_eq!(changed.verdict, HEALTH_DOWN);
        assert_eq!(
            tracker.record(false, 0),
            None,
            "no change while it stays down"
        );
    }

    #[test]
    fn three_successes_turn_it_up_and_a_failure_restarts_the_streak() {
        let mut tracker = HealthTracker::new(DEFAULTS, false, 0);
        assert_eq!(tracker.record(true, 0), None);
        assert_eq!(tracker.record(true, 0), None);
        assert_eq!(tracker.record(false, 0), None);
        assert_eq!(tracker.record(true, 0), None);
        assert_eq!(tracker.record(true, 0), None);
        let changed = tracker
            .record(true, 0)
            .expect("third success in a row decides");
        assert_eq!(changed.verdict, HEALTH_UP);
    }

    #[test]
    fn a_new_epoch_must_be_confirmed_by_a_fresh_streak() {
        let mut tracker = HealthTracker::new(DEFAULTS, true, 4);
        assert_eq!(tracker.record(true, 4), None);
        assert_eq!(tracker.record(true, 4), None);
        // The cache died and came back between probes: the kernel is at epoch 5.
        assert_eq!(
            tracker.record(true, 5),
            None,
            "1st success in the new epoch"
        );
        assert_eq!(tracker.record(true, 5), None, "2nd");
        let changed = tracker.record(true, 5).expect("3rd confirms");
        assert_eq!((changed.verdict, changed.confirmed_epoch), (HEALTH_UP, 5));
    }

    #[test]
    fn an_epoch_change_mid_streak_restarts_it() {
        let mut tracker = HealthTracker::new(DEFAULTS, false, 0);
        tracker.record(true, 0);
        tracker.record(true, 0);
        assert_eq!(
            tracker.record(true, 1),
            None,
            "the streak restarts in epoch 1"
        );
        assert_eq!(tracker.record(true, 1), None);
        assert_eq!(
            tracker.record(true, 1).map(|health| health.confirmed_epoch),
            Some(1)
        );
    }
}
