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
//! Checks run only while a listener routes upstream, so a fleet whose caches serve sends none;
//! each node routing upstream sends one query per target per `probe.upstream_interval_ms`.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

use crate::sources::Upstream;

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
    fn targets_that_left_the_pool_are_forgotten() {
        let mut checks = UpstreamChecks::new(1);
        let gone = "10.0.0.2:53".parse().unwrap();
        checks.record(1, gone, false);
        checks.retain(1, &[upstream("10.0.0.1:53")]);
        assert!(!checks.is_down(1, gone));
        assert!(checks.verdicts(1).is_empty());
    }
}
