//! The upstream targets a listener fails over to, checked while it routes upstream: a target
//! that fails `failures_to_fail_over` checks in a row leaves the kernel's pool, and returns at
//! its first answer. A socket is pinned to one target by its cookie, so without this a dead or
//! hung kube-dns pod fails its share of the node's failed-over DNS until its endpoint's readiness
//! catches up (tens of seconds; a hung process may stay Ready). The egress program already moves
//! connected sockets off a target that left the pool.
//!
//! A pool is never emptied for its checks: when every target fails, all stay (an empty pool would
//! turn "slow" into "fails at once"), and the agent says so.
//!
//! Slow is not dead. A check fails only when nothing answers it: no response within
//! `probe.upstream_timeout_ms` (2 s by default, far above a kube-dns pod slowed by load, and its
//! own setting: the cache probe's 250 ms is a budget for a local process), an ICMP refusal, a
//! socket error. Any response is proof of life, whatever its code: SERVFAIL is what a loaded
//! CoreDNS answers when its own upstreams time out, and REFUSED what its `forward` plugin answers
//! past `max_concurrent`, its load shedding. Taking a target out for either, on every node at
//! once, would push its load onto the others, which then shed and answer the same way. Whether a
//! target answers *correctly* is its readiness probe's question (the kube-dns pool holds ready
//! endpoints only). CoreDNS's own `forward` health checks judge their upstreams alike.
//!
//! Checks run only while a listener routes upstream, so a fleet whose caches serve sends none;
//! each node routing upstream sends one query per target per `probe.upstream_interval_ms` on
//! average. A fleet fails over together (a bad cache rollout): so that its nodes do not check in
//! step, the first round of checks after a node starts routing upstream comes at a point drawn
//! uniformly within one interval, and each wait between two rounds is the interval ± 20 %
//! (`CheckSchedule`). The unit test `fleet_model` runs 5,000 nodes through it.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    ops::Add,
    time::Duration,
};

use hickory_proto::op::ResponseCode;

use crate::sources::Upstream;

#[cfg(test)]
mod fleet_model;

/// How far each wait between two rounds of checks strays from the interval, either way, as a
/// fraction (`JITTER_PERCENT` / 100): a fifth decorrelates nodes that failed over together within
/// a few rounds, and keeps every wait within 0.8 to 1.2 intervals, so the detection time of a dead
/// target moves by at most a fifth.
pub const JITTER_PERCENT: u64 = 20;

/// When the rounds of checks are due: none while no listener routes upstream; the first within
/// one interval of the moment one starts to (a uniform draw); each next one the interval
/// ± `JITTER_PERCENT` after the last (a uniform draw). The mean wait is the interval, so the checks
/// a target receives from a fleet average `nodes / interval` a second, spread evenly over time
/// instead of in step. Generic over the clock (`tokio::time::Instant` in the agent, a `Duration`
/// since a failover in the model).
#[derive(Debug)]
pub struct CheckSchedule<T> {
    /// The mean wait between two rounds, in nanoseconds.
    interval_ns: u64,
    rng: fastrand::Rng,
    /// When the next round is due (`None`: no listener routes upstream).
    due: Option<T>,
}

impl<T: Copy + Add<Duration, Output = T>> CheckSchedule<T> {
    /// A schedule of rounds every `interval` on average, with its own random seed: every node
    /// draws its own waits.
    #[must_use]
    pub fn new(interval: Duration) -> Self {
        Self::with_rng(interval, fastrand::Rng::new())
    }

    /// The same with a fixed seed (a reproducible model).
    #[must_use]
    pub fn seeded(interval: Duration, seed: u64) -> Self {
        Self::with_rng(interval, fastrand::Rng::with_seed(seed))
    }

    fn with_rng(interval: Duration, rng: fastrand::Rng) -> Self {
        Self {
            // Configured intervals are milliseconds, at least 100: far from either end of u64.
            interval_ns: u64::try_from(interval.as_nanos())
                .unwrap_or(u64::MAX)
                .max(1),
            rng,
            due: None,
        }
    }

    /// Follows the listeners' routes at `now`: with one routing upstream and no round due, the
    /// first is due within one interval; with none, no round is due (the next failover draws its
    /// first round afresh).
    pub fn follow(&mut self, routing_upstream: bool, now: T) {
        match (routing_upstream, self.due) {
            (true, None) => {
                let wait = self.rng.u64(0..self.interval_ns);
                self.due = Some(now + Duration::from_nanos(wait));
            }
            (false, Some(_)) => self.due = None,
            _ => {}
        }
    }

    /// When the next round is due, if one is.
    #[must_use]
    pub fn due(&self) -> Option<T> {
        self.due
    }

    /// The round due was sent at `now`: the next is due the interval ± `JITTER_PERCENT` later
    /// (from when it was sent, not when it was due, so a late round never brings a burst).
    pub fn sent(&mut self, now: T) {
        let spread = self.interval_ns / 100 * JITTER_PERCENT;
        let wait = self
            .rng
            .u64(self.interval_ns - spread..=self.interval_ns.saturating_add(spread));
        self.due = Some(now + Duration::from_nanos(wait));
    }
}

/// What one check of a target found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckOutcome {
    /// A response within the upstream timeout, whatever its code.
    Answered {
        /// Time to the response.
        latency: Duration,
        /// Its code (NOERROR, NXDOMAIN, SERVFAIL, REFUSED, ...).
        code: ResponseCode,
    },
    /// No response: a timeout, an ICMP refusal (nothing listens), a socket error.
    Silent {
        /// Why, as the prober says it.
        reason: String,
    },
}

impl CheckOutcome {
    /// The outcome of one exchange (`Prober::exchange`): a response, or why none came.
    #[must_use]
    pub fn of(exchange: Result<(ResponseCode, Duration), String>) -> Self {
        match exchange {
            Ok((code, latency)) => Self::Answered { latency, code },
            Err(reason) => Self::Silent { reason },
        }
    }

    /// Whether the target is alive: it answered, however slowly within the timeout and with
    /// whatever code (see the module's comment).
    #[must_use]
    pub fn is_proof_of_life(&self) -> bool {
        matches!(self, Self::Answered { .. })
    }
}

/// What the checks know of one target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct TargetState {
    failures: u32,
    down: bool,
}

/// The checks' verdicts on every listener's targets.
#[derive(Debug)]
pub struct UpstreamChecks {
    failures_to_fail: u32,
    /// (listener id, the target's UDP address) → its state.
    targets: HashMap<(u32, SocketAddr), TargetState>,
}

/// The address a target is checked at (its UDP port: the checks are UDP queries).
#[must_use]
pub fn checked_address(upstream: &Upstream) -> SocketAddr {
    SocketAddr::new(upstream.ip, upstream.udp_port)
}

impl UpstreamChecks {
    /// No verdicts yet; `failures_to_fail` failed checks in a row take a target out.
    #[must_use]
    pub fn new(failures_to_fail: u32) -> Self {
        Self {
            failures_to_fail: failures_to_fail.max(1),
            targets: HashMap::new(),
        }
    }

    /// Records one check of `target` of `listener`. Returns the target's new state (`true`:
    /// down) when it changed, and the pool must be written again.
    pub fn record(&mut self, listener: u32, target: SocketAddr, answered: bool) -> Option<bool> {
        let state = self.targets.entry((listener, target)).or_default();
        let before = state.down;
        if answered {
            *state = TargetState::default();
        } else {
            state.failures = state.failures.saturating_add(1);
            if state.failures >= self.failures_to_fail {
                state.down = true;
            }
        }
        (state.down != before).then_some(state.down)
    }

    /// Whether `target` of `listener` is out for failing its checks.
    #[must_use]
    pub fn is_down(&self, listener: u32, target: SocketAddr) -> bool {
        self.targets
            .get(&(listener, target))
            .is_some_and(|state| state.down)
    }

    /// The targets of `pool` to give the kernel: those not down; all of them when every one is
    /// (the second value is then true).
    #[must_use]
    pub fn usable(&self, listener: u32, pool: &[Upstream]) -> (Vec<Upstream>, bool) {
        let up: Vec<Upstream> = pool
            .iter()
            .filter(|upstream| !self.is_down(listener, checked_address(upstream)))
            .copied()
            .collect();
        if up.is_empty() && !pool.is_empty() {
            (pool.to_vec(), true)
        } else {
            (up, false)
        }
    }

    /// Forgets the targets of `listener` that `pool` no longer holds (a target that returns is
    /// judged afresh).
    pub fn retain(&mut self, listener: u32, pool: &[Upstream]) {
        let kept: HashSet<SocketAddr> = pool.iter().map(checked_address).collect();
        self.targets
            .retain(|(id, target), _| *id != listener || kept.contains(target));
    }

    /// Every target of `listener` with a verdict: (address, down).
    #[must_use]
    pub fn verdicts(&self, listener: u32) -> Vec<(SocketAddr, bool)> {
        let mut verdicts: Vec<(SocketAddr, bool)> = self
            .targets
            .iter()
            .filter(|((id, _), _)| *id == listener)
            .map(|((_, target), state)| (*target, state.down))
            .collect();
        verdicts.sort_unstable();
        verdicts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(text: &str) -> Upstream {
        Upstream::from(text.parse::<SocketAddr>().unwrap())
    }

    #[test]
    fn a_target_leaves_after_its_failures_and_returns_at_its_first_answer() {
        let mut checks = UpstreamChecks::new(2);
        let dead = "10.0.0.2:53".parse().unwrap();
        let pool = [upstream("10.0.0.1:53"), upstream("10.0.0.2:53")];
        assert_eq!(
            checks.record(1, dead, false),
            None,
            "one failure decides nothing"
        );
        assert_eq!(checks.usable(1, &pool), (pool.to_vec(), false));
        assert_eq!(checks.record(1, dead, false), Some(true));
        assert_eq!(checks.usable(1, &pool), (vec![pool[0]], false));
        assert_eq!(checks.record(1, dead, false), None, "still down");
        // Another listener's pool with the same target is judged on its own checks.
        assert_eq!(checks.usable(2, &pool), (pool.to_vec(), false));
        assert_eq!(
            checks.record(1, dead, true),
            Some(false),
            "back at its first answer"
        );
        assert_eq!(checks.usable(1, &pool), (pool.to_vec(), false));
    }

    #[test]
    fn a_pool_whose_every_target_fails_is_kept_whole() {
        let mut checks = UpstreamChecks::new(1);
        let pool = [upstream("10.0.0.1:53"), upstream("10.0.0.2:1053")];
        for target in &pool {
            checks.record(1, checked_address(target), false);
        }
        assert_eq!(checks.usable(1, &pool), (pool.to_vec(), true));
        assert_eq!(checks.usable(1, &[]), (Vec::new(), false));
    }

    #[test]
    fn rounds_are_due_only_while_a_listener_routes_upstream_and_stray_within_the_jitter() {
        let interval = Duration::from_millis(500);
        let spread = interval * u32::try_from(JITTER_PERCENT).unwrap() / 100;
        let mut schedule = CheckSchedule::seeded(interval, 7);
        schedule.follow(false, Duration::ZERO);
        assert_eq!(schedule.due(), None, "nothing routes upstream");
        let failover = Duration::from_secs(3);
        schedule.follow(true, failover);
        let first = schedule.due().unwrap();
        assert!(
            first >= failover && first < failover + interval,
            "{first:?}"
        );
        schedule.follow(true, failover + Duration::from_millis(1));
        assert_eq!(schedule.due(), Some(first), "a round due stays due");

        let mut sent = first;
        let mut waits = Vec::new();
        for _ in 0..1000 {
            schedule.sent(sent);
            let due = schedule.due().unwrap();
            waits.push(due - sent);
            sent = due;
        }
        let shortest = *waits.iter().min().unwrap();
        let longest = *waits.iter().max().unwrap();
        assert!(
            shortest >= interval - spread && longest <= interval + spread,
            "{shortest:?} to {longest:?}"
        );
        // Drawn, not fixed: the waits cover most of their range, and average the interval.
        assert!(longest - shortest > spread, "{shortest:?} to {longest:?}");
        let mean = waits.iter().sum::<Duration>() / 1000;
        assert!(
            mean.abs_diff(interval) < interval / 50,
            "mean wait {mean:?}"
        );

        schedule.follow(false, sent);
        assert_eq!(schedule.due(), None, "back on the caches: no round due");
    }

    #[test]
    fn nodes_failing_over_together_draw_different_first_rounds() {
        let interval = Duration::from_millis(500);
        let firsts: HashSet<Duration> = (0..100)
            .map(|_| {
                let mut schedule = CheckSchedule::new(interval);
                schedule.follow(true, Duration::ZERO);
                schedule.due().unwrap()
            })
            .collect();
        assert!(firsts.len() > 90, "{} distinct first rounds", firsts.len());
        assert!(firsts.iter().all(|first| *first < interval));
    }

    #[test]
    fn any_answer_is_proof_of_life_and_silence_is_not() {
        for code in [
            ResponseCode::NoError,
            ResponseCode::NXDomain,
            ResponseCode::ServFail,
            ResponseCode::Refused,
            ResponseCode::NotImp,
        ] {
            let outcome = CheckOutcome::of(Ok((code, Duration::from_millis(1900))));
            assert!(outcome.is_proof_of_life(), "{outcome:?}");
        }
        for reason in ["timeout", "refused (nothing listens)"] {
            let outcome = CheckOutcome::of(Err(reason.to_owned()));
            assert!(!outcome.is_proof_of_life(), "{outcome:?}");
        }
    }

    #[test]
    fn targets_that_left_the_pool_are_forgotten() {
        let mut checks = UpstreamChecks::new(1);
        let gone = "10.0.0.2:53".parse().unwrap();
        checks.record(1, gone, false);
        checks.retain(1, &[upstream("10.0.0.1:53")]);
        assert!(!checks.is_down(1, gone));
        assert!(checks.verdicts(1).is_empty());
    }
}
