//! The agent's control loop: one task, driven by a probe timer and a reconcile timer. It writes
//! only the agent's own state (`CACHE_HEALTH`) and corrections to the socket counts; the kernel
//! decides every route by itself, so a stalled or dead loop never stops DNS.

use std::{future::Future, time::SystemTime};

use tokio::{task::JoinSet, time::MissedTickBehavior};
use tracing::{debug, info, warn};

use super::{Agent, Transition, current_route};
use crate::liveness::probe::ProbeOutcome;

impl Agent {
    /// Probes, reconciles and watches the listeners until `shutdown` completes.
    pub async fn run(&mut self, shutdown: impl Future<Output = ()>) {
        let mut probe_tick = tokio::time::interval(self.config.probe.interval);
        probe_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut reconcile_tick = tokio::time::interval(self.config.socket_reconcile_interval);
        reconcile_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // The counts were just seeded.
        reconcile_tick.tick().await;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = probe_tick.tick() => self.probe_round().await,
                _ = reconcile_tick.tick() => self.reconcile_round().await,
            }
            self.observe_routes();
        }
    }

    /// Probes every cache at once and folds the results into the verdicts.
    async fn probe_round(&mut self) {
        let mut probes = JoinSet::new();
        for (index, listener) in self.listeners.iter().enumerate() {
            let prober = listener.prober.clone();
            probes.spawn(async move { (index, prober.probe().await) });
        }
        while let Some(result) = probes.join_next().await {
            let Ok((index, outcome)) = result else {
                continue;
            };
            let Some(listener) = self.listeners.get_mut(index) else {
                continue;
            };
            let latency = match &outcome {
                ProbeOutcome::Alive { latency } => *latency,
                ProbeOutcome::Failed { .. } => std::time::Duration::ZERO,
            };
            self.stats
                .record_probe(&listener.name, outcome.is_alive(), latency);
            let epoch = match self.maps.socket_counts(listener.id) {
                Ok(counts) => counts.down_epoch,
                Err(error) => {
                    warn!(listener = %listener.name, error = %error, "cannot read the socket counts");
                    continue;
                }
            };
            if let ProbeOutcome::Failed { reason } = &outcome {
                debug!(listener = %listener.name, cache = %listener.prober.target(), reason, "probe failed");
            }
            if let Some(health) = listener.tracker.record(outcome.is_alive(), epoch) {
                info!(
                    listener = %listener.name,
                    cache = %listener.prober.target(),
                    verdict = if health.verdict == redirector_common::listener::HEALTH_UP { "up" } else { "down" },
                    confirmed_epoch = health.confirmed_epoch,
                    probe = ?outcome,
                    "cache verdict changed"
                );
                if let Err(error) = self.maps.set_health(listener.id, health) {
                    warn!(listener = %listener.name, error = %error, "cannot write the cache verdict");
                }
            }
        }
    }

    /// Compares the kernel's socket counts with the socket tables.
    async fn reconcile_round(&mut self) {
        if let Err(error) = self.reconciler.reconcile(&mut self.maps, false).await {
            warn!(error = %error, "reconciling the caches' socket counts failed; retrying next round");
        }
    }

    /// Logs and counts every change of route since the last look.
    fn observe_routes(&mut self) {
        for listener in &mut self.listeners {
            let now = match current_route(&self.maps, listener.id, listener.liveness) {
                Ok(now) => now,
                Err(error) => {
                    warn!(listener = %listener.name, error = %error, "cannot read the listener's state");
                    continue;
                }
            };
            if now == listener.observed {
                continue;
            }
            let (from, _) = listener.observed;
            let (to, reason) = now;
            listener.observed = now;
            if from == to {
                debug!(listener = %listener.name, route = ?to, reason = ?reason, "reason changed");
                continue;
            }
            info!(listener = %listener.name, from = ?from, to = ?to, reason = ?reason, "route changed");
            self.stats.record_transition(Transition {
                listener: listener.name.clone(),
                from,
                to,
                reason,
                at: SystemTime::now(),
            });
        }
    }
}
