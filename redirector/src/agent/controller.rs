//! The agent's control loop: one task, driven by upstream-source events (coalesced over a few
//! milliseconds), a probe timer and the probes' outcomes, a socket-reconcile timer and a
//! pool-resync timer. It writes only the agent's own state (`CACHE_HEALTH`, pools) and
//! corrections to the socket counts; the kernel decides every route by itself, so a stalled or
//! dead loop never stops DNS.

use std::{
    collections::HashSet,
    future::Future,
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use hickory_proto::op::ResponseCode;
use tokio::{
    task::JoinSet,
    time::{Instant, MissedTickBehavior, sleep_until},
};
use tracing::{debug, info, warn};

use super::{Agent, AgentError, current_route};
use redirector_common::{
    listener::Route,
    pool::{MAX_POOL_TARGETS, Target},
};

use crate::{
    liveness::{
        health::{self, Probe},
        probe::ProbeOutcome,
        upstreams::{CheckOutcome, CheckSchedule, checked_address},
    },
    sources::{STATIC_SOURCE, SourceEvent, SourceKind, Upstream, plausible::Rejection, subset},
    sys::sd_notify,
    telemetry::{
        node_events::{Refusal, RouteChange},
        stats::{ErrorKind, Transition},
    },
};

/// How long source events are collected before the pools are written: a burst of endpoint
/// changes becomes one write per listener.
const COALESCE: Duration = Duration::from_millis(10);
/// The first retry delay of a failed pool write, doubled up to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(100);
/// The longest retry delay.
const MAX_RETRY: Duration = Duration::from_secs(10);

/// A check of an upstream target, with what it was sent for.
struct UpstreamCheck {
    /// The listener's index in `Agent::listeners`.
    index: usize,
    /// The target's UDP address.
    target: SocketAddr,
    /// What came back.
    outcome: CheckOutcome,
}

/// A probe's outcome, with what it was sent for.
struct SentProbe {
    /// The listener's index in `Agent::listeners`.
    index: usize,
    /// The kernel's `down_epoch` of the listener when the probe was sent.
    epoch: u64,
    /// What came back.
    outcome: ProbeOutcome,
}

impl Agent {
    /// Probes, reconciles, syncs pools and watches the listeners until `shutdown` completes, or
    /// until the caches' network namespace is replaced (an error: the agent must be started
    /// again to follow it).
    pub async fn run(&mut self, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
        let mut probe_tick = tokio::time::interval(self.config.probe.interval);
        probe_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut reconcile_tick = tokio::time::interval(self.config.socket_reconcile_interval);
        reconcile_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut resync_tick = tokio::time::interval(self.config.kubernetes.resync_interval);
        resync_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Counts were just seeded and pools just written.
        reconcile_tick.tick().await;
        resync_tick.tick().await;
        // Probes in flight: one is sent to every cache on each tick, whether or not the earlier
        // ones have answered, so a hang is seen `timeout` after the first unanswered probe (and
        // decided `failures_to_fail_over - 1` intervals later), not after whole rounds of
        // timeouts. Outcomes are folded in as they complete.
        let mut probes: JoinSet<SentProbe> = JoinSet::new();
        // Checks of the upstream targets of listeners that route upstream (none while every
        // listener is on its cache), in rounds drawn so that a fleet that failed over together
        // does not check its targets in step (`CheckSchedule`). Like probes, a round is sent
        // whether or not the earlier ones answered.
        let mut upstream_schedule: Option<CheckSchedule<Instant>> =
            self.config.probe.upstream_interval.map(CheckSchedule::new);
        let mut upstream_checks: JoinSet<UpstreamCheck> = JoinSet::new();
        let mut dirty: HashSet<u32> = HashSet::new();
        let mut write_at: Option<Instant> = None;
        let mut retry = FIRST_RETRY;
        tokio::pin!(shutdown);
        self.stats.heartbeat();
        // systemd hears READY=1 once the programs steer, not only once every pool synced: an
        // API server unreachable at boot must not make systemd kill (and restart) the agent, nor
        // hold back kubelet, which is ordered after it. `/readyz` waits for the pools.
        if let Err(error) = sd_notify::notify(
            "READY=1\nSTATUS=steering; waiting for the first sync of every upstream pool",
        ) {
            warn!(error = %error, "cannot tell systemd the agent is ready (NOTIFY_SOCKET)");
        }
        self.announce_readiness();
        loop {
            let upstream_due = upstream_schedule.as_mut().and_then(|schedule| {
                schedule.follow(self.routes_upstream(), Instant::now());
                schedule.due()
            });
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                Some(event) = self.events.recv() => {
                    if let Some(listener) = self.take_event(event) {
                        dirty.insert(listener);
                        write_at.get_or_insert_with(|| Instant::now() + COALESCE);
                    }
                }
                () = sleep_until(write_at.unwrap_or_else(Instant::now)), if write_at.is_some() => {
                    if self.write_pools(&mut dirty) {
                        write_at = None;
                        retry = FIRST_RETRY;
                    } else {
                        write_at = Some(Instant::now() + retry);
                        retry = (retry * 2).min(MAX_RETRY);
                    }
                }
                _ = resync_tick.tick() => {
                    dirty.extend(self.listeners.iter().filter(|listener| listener.desired.is_some()).map(|listener| listener.id));
                    write_at.get_or_insert_with(Instant::now);
                }
                _ = probe_tick.tick() => self.send_probes(&mut probes),
                () = sleep_until(upstream_due.unwrap_or_else(Instant::now)), if upstream_due.is_some() => {
                    self.send_upstream_checks(&mut upstream_checks);
                    if let Some(schedule) = &mut upstream_schedule {
                        schedule.sent(Instant::now());
                    }
                }
                Some(done) = upstream_checks.join_next(), if !upstream_checks.is_empty() => {
                    if let Ok(check) = done
                        && let Some(listener) = self.record_upstream_check(&check)
                    {
                        dirty.insert(listener);
                        write_at.get_or_insert_with(Instant::now);
                    }
                }
                Some(done) = probes.join_next(), if !probes.is_empty() => {
                    if let Ok(probe) = done {
                        self.record_probe(&probe);
                    }
                }
                _ = reconcile_tick.tick() => {
                    self.check_cache_netns()?;
                    self.reconcile_round().await;
                }
            }
            self.observe_routes();
            self.stats.heartbeat();
            self.announce_readiness();
        }
    }

    /// Once every pool was synced, marks the agent ready (`/readyz`) and says so to systemd.
    fn announce_readiness(&mut self) {
        if self.stats.is_ready() || !self.listeners.iter().all(|listener| listener.synced) {
            return;
        }
        self.stats.set_ready();
        info!("ready: programs attached and every upstream pool synced");
        if let Err(error) = sd_notify::notify("STATUS=steering; every upstream pool synced") {
            warn!(error = %error, "cannot tell systemd the agent's status (NOTIFY_SOCKET)");
        }
    }

    /// Folds a source event into the desired pools; returns the listener to write, if any.
    fn take_event(&mut self, event: SourceEvent) -> Option<u32> {
        match event {
            SourceEvent::Pool {
                listener,
                upstreams,
                source,
            } => {
                let runtime = self
                    .listeners
                    .iter_mut()
                    .find(|runtime| runtime.id == listener)?;
                if runtime.desired.as_ref() == Some(&upstreams) {
                    return None;
                }
                debug!(listener = %runtime.name, source = source.name(), upstreams = upstreams.len(), "desired pool changed");
                runtime.desired = Some(upstreams);
                self.stats.record_pool_sync(&runtime.name);
                Some(listener)
            }
            SourceEvent::Rejected {
                source,
                address,
                reason,
            } => {
                self.stats.record_rejection(source.name(), reason.name());
                // A whole EndpointSlice refused is told on the Node too: its pods are missing
                // from every pool, which no address-level warning makes plain.
                if reason == Rejection::NoDnsPort
                    && let Some(node_events) = &self.node_events
                {
                    node_events.refused(Refusal {
                        source: source.name(),
                        offered: address,
                        reason: reason.name(),
                    });
                }
                None
            }
            SourceEvent::Contact { source } => {
                self.stats.record_source_contact(source.name());
                None
            }
            SourceEvent::Failed { source } => {
                if source == SourceKind::Kubernetes {
                    self.stats.record_error(ErrorKind::KubeApi);
                }
                None
            }
        }
    }

    /// Writes the desired pools of `dirty` listeners whose kernel pool differs. Returns false when
    /// a write failed (the failed ones stay dirty for the retry).
    fn write_pools(&mut self, dirty: &mut HashSet<u32>) -> bool {
        let mut failed = HashSet::new();
        for id in dirty.drain() {
            let Some(runtime) = self.listeners.iter_mut().find(|runtime| runtime.id == id) else {
                continue;
            };
            let Some(desired) = &runtime.desired else {
                continue;
            };
            let started = Instant::now();
            let (subset, left_out) = subset::for_node(desired, &self.node, MAX_POOL_TARGETS);
            self.stats.record_pool_left_out(&runtime.name, left_out);
            self.upstream_checks.retain(id, &subset);
            self.stats.retain_upstreams(
                &runtime.name,
                &subset
                    .iter()
                    .map(|upstream| checked_address(upstream).to_string())
                    .collect::<Vec<_>>(),
            );
            // Without the targets that fail their checks; never emptied for them.
            let (pool, all_failing) = self.upstream_checks.usable(id, &subset);
            if all_failing {
                warn!(listener = %runtime.name, upstreams = pool.len(), "EVERY upstream target fails its checks: keeping them all in the pool (an empty pool would fail DNS at once)");
            }
            let targets: Vec<Target> = pool.iter().map(Upstream::target).collect();
            let written = self.maps.set_pool(id, &targets);
            if written.is_ok() {
                runtime.synced = true;
                self.stats
                    .record_source_sync(runtime.source, started.elapsed());
                // A static pool's only source is the configuration: written is current.
                if runtime.source == STATIC_SOURCE {
                    self.stats.record_source_contact(runtime.source);
                }
            }
            match written {
                Ok(true) => {
                    self.stats.record_pool_write(&runtime.name);
                    info!(
                        listener = %runtime.name,
                        upstreams = ?pool.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "upstream pool written"
                    );
                    if left_out > 0 {
                        warn!(listener = %runtime.name, offered = desired.len(), kept = pool.len(), left_out, node = %self.node, "the upstream pool is larger than the kernel's: this node keeps its own subset (chosen by its name), others keep theirs");
                    }
                    if desired.is_empty() {
                        warn!(listener = %runtime.name, "the upstream pool is EMPTY: while the cache is down, the empty-pool policy applies");
                    }
                }
                Ok(false) => {}
                Err(error) => {
                    warn!(listener = %runtime.name, error = %error, "writing the upstream pool failed; retrying");
                    self.stats.record_error(ErrorKind::PoolWrite);
                    failed.insert(id);
                }
            }
        }
        let written = failed.is_empty();
        dirty.extend(failed);
        written
    }

    /// Sends one probe to every cache (each gives up after the probe timeout), with the kernel's
    /// epoch read before it is sent: an answer can only vouch for the cache that existed then. An
    /// epoch read after the answer could be a newer one, bumped by the death of the cache that
    /// answered, and that answer would confirm its successor unprobed.
    fn send_probes(&self, probes: &mut JoinSet<SentProbe>) {
        for (index, listener) in self.listeners.iter().enumerate() {
            let epoch = match self.maps.socket_counts(listener.id) {
                Ok(counts) => counts.down_epoch,
                Err(error) => {
                    warn!(listener = %listener.name, error = %error, "cannot read the socket counts; skipping this probe");
                    continue;
                }
            };
            let prober = listener.prober.clone();
            probes.spawn(async move {
                SentProbe {
                    index,
                    epoch,
                    outcome: prober.probe().await,
                }
            });
        }
    }

    /// Folds one probe's outcome into its listener's verdict.
    fn record_probe(&mut self, probe: &SentProbe) {
        let SentProbe {
            index,
            epoch,
            ref outcome,
        } = *probe;
        let Some(listener) = self.listeners.get_mut(index) else {
            return;
        };
        match outcome {
            ProbeOutcome::Alive { latency, servfail } => {
                self.stats.record_probe(&listener.name, true, *latency);
                if *servfail {
                    // Alive: the cache serves; what fails is behind it (see `liveness::probe`).
                    self.stats.record_probe_servfail(&listener.name);
                    debug!(listener = %listener.name, cache = %listener.prober.target(), "the cache answered the probe with SERVFAIL: its upstreams fail");
                }
            }
            ProbeOutcome::Failed { reason } => {
                self.stats
                    .record_probe(&listener.name, false, Duration::ZERO);
                debug!(listener = %listener.name, cache = %listener.prober.target(), reason, "probe failed");
            }
        }
        let held = self.maps.cache_activity(listener.id).is_ok_and(|activity| {
            health::held(
                &activity,
                epoch,
                health::monotonic_ns(),
                self.config.probe.signal_hold,
            )
        });
        let probe = Probe::new(outcome.is_alive(), held);
        if let Some(health) = listener.tracker.record(probe, epoch) {
            info!(
                listener = %listener.name,
                cache = %listener.prober.target(),
                verdict = crate::telemetry::snapshot::verdict_name(health.verdict),
                confirmed_epoch = health.confirmed_epoch,
                probe = ?outcome,
                "cache verdict changed"
            );
            if let Err(error) = self.maps.set_health(listener.id, health) {
                warn!(listener = %listener.name, error = %error, "cannot write the cache verdict");
            }
        }
    }

    /// Whether a listener routes upstream, as last observed: its targets are checked then.
    fn routes_upstream(&self) -> bool {
        self.listeners
            .iter()
            .any(|listener| listener.observed.0 == Route::Upstream)
    }

    /// Sends one check to every upstream target of every listener that routes upstream: the
    /// targets of the kernel's subset of its desired pool, those out for failing too (their
    /// first answer brings them back). Each waits `probe.upstream_timeout_ms`, not the cache
    /// probe's timeout.
    fn send_upstream_checks(&self, checks: &mut JoinSet<UpstreamCheck>) {
        for (index, listener) in self.listeners.iter().enumerate() {
            if listener.observed.0 != Route::Upstream {
                continue;
            }
            let Some(desired) = &listener.desired else {
                continue;
            };
            let (subset, _) = subset::for_node(desired, &self.node, MAX_POOL_TARGETS);
            for upstream in &subset {
                let target = checked_address(upstream);
                let prober = listener
                    .prober
                    .of(target, self.config.probe.upstream_timeout);
                checks.spawn(async move {
                    UpstreamCheck {
                        index,
                        target,
                        outcome: CheckOutcome::of(prober.exchange().await),
                    }
                });
            }
        }
    }

    /// Folds one check into its target's verdict; returns the listener whose pool must be
    /// written again when the target left it or came back.
    fn record_upstream_check(&mut self, check: &UpstreamCheck) -> Option<u32> {
        let listener = self.listeners.get(check.index)?;
        let answered = check.outcome.is_proof_of_life();
        self.stats.record_upstream_check(&listener.name, answered);
        match &check.outcome {
            // Proof of life all the same: a loaded CoreDNS sheds with REFUSED and answers
            // SERVFAIL when its own upstreams time out (see `liveness::upstreams`).
            CheckOutcome::Answered { latency, code }
                if *code != ResponseCode::NoError && *code != ResponseCode::NXDomain =>
            {
                debug!(listener = %listener.name, target = %check.target, code = %code, latency = ?latency, "an upstream target answered its check with an error code: it answers, so it stays");
            }
            CheckOutcome::Answered { .. } => {}
            CheckOutcome::Silent { reason } => {
                debug!(listener = %listener.name, target = %check.target, reason, "an upstream target did not answer its check");
            }
        }
        // A target that left the pool while its check was out: its verdict is not brought back.
        let (subset, _) =
            subset::for_node(listener.desired.as_ref()?, &self.node, MAX_POOL_TARGETS);
        if !subset
            .iter()
            .any(|upstream| checked_address(upstream) == check.target)
        {
            return None;
        }
        let target = check.target.to_string();
        let Some(down) = self
            .upstream_checks
            .record(listener.id, check.target, answered)
        else {
            if !self.upstream_checks.is_down(listener.id, check.target) {
                self.stats
                    .record_upstream_state(&listener.name, &target, true);
            }
            return None;
        };
        if down {
            warn!(listener = %listener.name, target = %target, failures = self.config.probe.failures_to_fail_over, timeout = ?self.config.probe.upstream_timeout, "an upstream target does not answer its checks: out of the kernel's pool until it answers");
        } else {
            info!(listener = %listener.name, target = %target, "an upstream target answers again: back in the kernel's pool");
        }
        self.stats
            .record_upstream_state(&listener.name, &target, !down);
        Some(listener.id)
    }

    /// Fails when the caches' namespace file now names another namespace. A missing file is no
    /// failure: the agent's handles keep the old namespace, and whatever recreates the file is
    /// seen on a later round.
    fn check_cache_netns(&self) -> Result<(), AgentError> {
        let Some((path, identity)) = &self.cache_netns else {
            return Ok(());
        };
        match super::namespace_identity(path) {
            Ok(now) if now != *identity => {
                warn!(path = %path.display(), "the caches' network namespace was replaced");
                Err(AgentError::CacheNetnsReplaced { path: path.clone() })
            }
            Ok(_) => Ok(()),
            Err(error) => {
                debug!(path = %path.display(), error = %error, "the caches' namespace file is gone for now");
                Ok(())
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
        for (listener, configured) in self.listeners.iter_mut().zip(&self.config.listeners) {
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
            if let Some(node_events) = &self.node_events {
                // The kernel's pool, as the programs see it (no entry: empty).
                let upstreams = self.maps.pool(listener.id).map_or(0, |pool| pool.len);
                node_events.route_changed(RouteChange {
                    listener: listener.name.clone(),
                    address: configured.address,
                    to,
                    reason,
                    upstreams,
                    empty_pool: configured.empty_pool,
                });
            }
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
