//! What the agent observed: route transitions with their causes, and probe results. Shared with
//! whoever watches the agent (tests now, metrics later).

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, SystemTime},
};

use redirector_common::listener::{Reason, Route};

use crate::conntrack_bypass::BypassStatus;

/// Transitions kept in memory (the oldest are dropped beyond this).
const TRANSITION_LOG: usize = 4096;

/// A change of a listener's route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The listener's name.
    pub listener: String,
    /// The route before.
    pub from: Route,
    /// The route after.
    pub to: Route,
    /// Why it changed.
    pub reason: Reason,
    /// When the agent saw it (kernel-side flips happen earlier, at the last socket's close).
    pub at: SystemTime,
}

/// Counters and logs of one agent.
#[derive(Debug, Default)]
pub struct AgentStats {
    transitions: Mutex<Vec<Transition>>,
    by_reason: Mutex<HashMap<(String, Reason), u64>>,
    probes: Mutex<HashMap<(String, bool), (u64, Duration)>>,
    pool_syncs: Mutex<HashMap<String, u64>>,
    pool_writes: Mutex<HashMap<String, u64>>,
    rejections: Mutex<HashMap<(&'static str, &'static str), u64>>,
    conntrack_bypass: Mutex<(BypassStatus, u64)>,
}

impl AgentStats {
    /// Records a transition.
    pub fn record_transition(&self, transition: Transition) {
        if let Ok(mut counts) = self.by_reason.lock() {
            *counts
                .entry((transition.listener.clone(), transition.reason))
                .or_default() += 1;
        }
        if let Ok(mut log) = self.transitions.lock() {
            if log.len() == TRANSITION_LOG {
                log.remove(0);
            }
            log.push(transition);
        }
    }

    /// Records a probe result (and its latency when it succeeded).
    pub fn record_probe(&self, listener: &str, alive: bool, latency: Duration) {
        if let Ok(mut probes) = self.probes.lock() {
            let entry = probes.entry((listener.to_owned(), alive)).or_default();
            entry.0 += 1;
            entry.1 += latency;
        }
    }

    /// Records that a source changed a listener's desired pool.
    pub fn record_pool_sync(&self, listener: &str) {
        if let Ok(mut syncs) = self.pool_syncs.lock() {
            *syncs.entry(listener.to_owned()).or_default() += 1;
        }
    }

    /// Records a write of a listener's pool into the kernel.
    pub fn record_pool_write(&self, listener: &str) {
        if let Ok(mut writes) = self.pool_writes.lock() {
            *writes.entry(listener.to_owned()).or_default() += 1;
        }
    }

    /// Records an address a source offered and redirector refused.
    pub fn record_rejection(&self, source: &'static str, reason: &'static str) {
        if let Ok(mut rejections) = self.rejections.lock() {
            *rejections.entry((source, reason)).or_default() += 1;
        }
    }

    /// Records where the conntrack bypass stands and how often its table was restored.
    pub fn record_conntrack_bypass(&self, status: BypassStatus, restorations: u64) {
        if let Ok(mut bypass) = self.conntrack_bypass.lock() {
            *bypass = (status, restorations);
        }
    }

    /// Where the conntrack bypass stands and how often its table was restored.
    #[must_use]
    pub fn conntrack_bypass(&self) -> (BypassStatus, u64) {
        self.conntrack_bypass
            .lock()
            .map(|bypass| bypass.clone())
            .unwrap_or_default()
    }

    /// How often `listener`'s desired pool changed (source updates that changed it).
    #[must_use]
    pub fn pool_syncs(&self, listener: &str) -> u64 {
        self.pool_syncs
            .lock()
            .ok()
            .and_then(|syncs| syncs.get(listener).copied())
            .unwrap_or(0)
    }

    /// How often `listener`'s pool was written into the kernel.
    #[must_use]
    pub fn pool_writes(&self, listener: &str) -> u64 {
        self.pool_writes
            .lock()
            .ok()
            .and_then(|writes| writes.get(listener).copied())
            .unwrap_or(0)
    }

    /// How many addresses `source` offered that were refused for `reason`.
    #[must_use]
    pub fn rejections(&self, source: &str, reason: &str) -> u64 {
        self.rejections
            .lock()
            .ok()
            .and_then(|rejections| {
                rejections
                    .iter()
                    .find(|((s, r), _)| *s == source && *r == reason)
                    .map(|(_, count)| *count)
            })
            .unwrap_or(0)
    }

    /// Every transition of `listener` still in the log, oldest first.
    #[must_use]
    pub fn transitions(&self, listener: &str) -> Vec<Transition> {
        self.transitions
            .lock()
            .map(|log| {
                log.iter()
                    .filter(|transition| transition.listener == listener)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// How many transitions of `listener` had `reason`.
    #[must_use]
    pub fn transitions_by(&self, listener: &str, reason: Reason) -> u64 {
        self.by_reason
            .lock()
            .ok()
            .and_then(|counts| counts.get(&(listener.to_owned(), reason)).copied())
            .unwrap_or(0)
    }

    /// (successful, failed) probes of `listener`.
    #[must_use]
    pub fn probes(&self, listener: &str) -> (u64, u64) {
        self.probes
            .lock()
            .map(|probes| {
                let count = |alive| {
                    probes
                        .get(&(listener.to_owned(), alive))
                        .map_or(0, |(count, _)| *count)
                };
                (count(true), count(false))
            })
            .unwrap_or((0, 0))
    }
}
