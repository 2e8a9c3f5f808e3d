//! Failover under load: a steady query stream from the pod while the cache (dnsmasq; unbound
//! and the embedded cache for the restarts) is killed (-9), stopped (SIGTERM), drained or hung
//! (SIGSTOP), then brought back. redirector: a query every 1 ms from
//! fresh sockets, from a long-lived unconnected socket and from a long-lived connected one each,
//! sent whether or not the earlier ones were answered (`dns-stream --open-loop`), so the gap is
//! seen at 1 ms resolution and a lost query holds no later one back. The incumbent, a NAT fallback driven by a probe loop with
//! the seed's parameters (a probe every 5 s, DNAT to an upstream after 3 failures in a row, removed
//! after the first success), over 30 s: a query every 20 ms from fresh sockets and a long-lived
//! unconnected socket.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use nix::sys::signal::Signal;
use serde::Serialize;

use super::{
    Spread,
    rig::{CACHE_ADDRESS, LISTENER, Rig},
};
use bpf_tests::{
    caches::{CacheKind, start_cache_at},
    dns::now_ms,
    sandbox::{Ns, Query, Transport},
    stream::{Stream, StreamReport},
    topology::{UPSTREAM_A_V4, dns},
};

/// What happens to the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Event {
    /// SIGKILL, then a restart.
    Kill,
    /// SIGTERM (a clean exit), then a restart.
    Term,
    /// SIGSTOP (a hang, sockets open), then SIGCONT.
    Stop,
    /// SIGSTOP with no agent running (the kernel alone sees the stall), then SIGCONT.
    StopAlone,
    /// `redirector drain --wait`, SIGTERM, then a restart: a planned restart.
    DrainThenTerm,
}

impl Event {
    /// The name in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill -9",
            Self::Term => "SIGTERM",
            Self::Stop => "SIGSTOP",
            Self::StopAlone => "SIGSTOP, no agent",
            Self::DrainThenTerm => "drain --wait, SIGTERM",
        }
    }
}

/// One failover run.
#[derive(Clone, Debug, Serialize)]
pub struct Failover {
    /// `redirector` or the incumbent.
    pub who: &'static str,
    /// The cache.
    pub cache: &'static str,
    /// What happened to the cache.
    pub event: Event,
    /// Last cache answer to first upstream answer, ms (`None`: never failed over).
    pub gap_ms: Option<u64>,
    /// Queries without an answer.
    pub lost: usize,
    /// Of those, queries from the long-lived sockets.
    pub lost_long: usize,
    /// Of those, queries begun after the first upstream answer: every other lost query went to
    /// the cache before the listener flipped (taken into a socket that then died or hung).
    pub lost_after_flip: usize,
    /// Of those, queries begun after the event (the signal, the drain).
    pub lost_after_event: usize,
    /// Queries sent.
    pub total: usize,
    /// From the cache's return until every query is answered by the cache again, ms: the send
    /// time of the first cache answer after the last query (of either socket kind) that the cache
    /// did not answer. `None`: never.
    pub failback_ms: Option<u64>,
    /// Answers per 100 ms from the event on: (ms since the event, cache, upstream, failed).
    pub timeline: Vec<(i64, usize, usize, usize)>,
}

/// Repeated failover trials of one kind: medians and ranges over the trials.
#[derive(Clone, Debug, Serialize)]
pub struct FailoverTrials {
    /// `redirector` or the incumbent.
    pub who: &'static str,
    /// The cache.
    pub cache: &'static str,
    /// What happened to the cache.
    pub event: Event,
    /// Last cache answer to first upstream answer, ms, over the trials that failed over.
    pub gap_ms: Spread,
    /// Trials that never failed over.
    pub never_failed_over: usize,
    /// Queries without an answer, per trial.
    pub lost: Spread,
    /// Of those, from the long-lived sockets, per trial.
    pub lost_long: Spread,
    /// Of those, begun after the flip, per trial.
    pub lost_after_flip: Spread,
    /// Of those, begun after the event, per trial.
    pub lost_after_event: Spread,
    /// Queries sent, per trial.
    pub total: Spread,
    /// From the cache's return until every socket is answered by the cache again, ms, over the
    /// trials that failed back (see [`Failover::failback_ms`]).
    pub failback_ms: Spread,
    /// Trials that never failed back.
    pub never_failed_back: usize,
    /// Every trial, in order (the chart shows the one with the median gap).
    pub runs: Vec<Failover>,
}

impl FailoverTrials {
    /// The summary of `runs` (at least one, all of one `who` and `event`).
    #[must_use]
    pub fn of(runs: Vec<Failover>) -> Self {
        let (who, cache, event) = runs.first().map_or(("none", "none", Event::Kill), |run| {
            (run.who, run.cache, run.event)
        });
        let gaps: Vec<f64> = runs
            .iter()
            .filter_map(|run| run.gap_ms)
            .map(|gap| gap as f64)
            .collect();
        let failbacks: Vec<f64> = runs
            .iter()
            .filter_map(|run| run.failback_ms)
            .map(|failback| failback as f64)
            .collect();
        Self {
            who,
            cache,
            event,
            never_failed_over: runs.len() - gaps.len(),
            never_failed_back: runs.len() - failbacks.len(),
            gap_ms: Spread::of(gaps),
            failback_ms: Spread::of(failbacks),
            lost: Spread::of(runs.iter().map(|run| run.lost as f64).collect()),
            lost_long: Spread::of(runs.iter().map(|run| run.lost_long as f64).collect()),
            lost_after_flip: Spread::of(
                runs.iter().map(|run| run.lost_after_flip as f64).collect(),
            ),
            lost_after_event: Spread::of(
                runs.iter().map(|run| run.lost_after_event as f64).collect(),
            ),
            total: Spread::of(runs.iter().map(|run| run.total as f64).collect()),
            runs,
        }
    }

    /// The trial whose gap is closest to the median (the first when none failed over).
    #[must_use]
    pub fn typical(&self) -> Option<&Failover> {
        self.runs.iter().min_by(|a, b| {
            let distance = |run: &Failover| {
                run.gap_ms
                    .map_or(f64::INFINITY, |gap| (gap as f64 - self.gap_ms.median).abs())
            };
            distance(a).total_cmp(&distance(b))
        })
    }
}

fn summarize(
    who: &'static str,
    cache: CacheKind,
    event: Event,
    report: &StreamReport,
    struck: u64,
    back: u64,
    end: u64,
) -> Failover {
    let first_upstream = report
        .first_upstream_answer(struck)
        .map(|record| record.begun_ms);
    let last_cache = first_upstream
        .and_then(|first| report.last_cache_answer(first))
        .map(|record| record.begun_ms);
    // Every socket back on the cache: after the last query since the return that anyone else
    // answered (or nobody did).
    let last_elsewhere = report
        .between(back, u64::MAX)
        .filter(|record| StreamReport::answered_by(record) != "cache")
        .map(|record| record.begun_ms)
        .max()
        .unwrap_or(back);
    let failback = report
        .first_cache_answer(last_elsewhere)
        .map(|record| record.begun_ms);
    let start = report.started_ms();
    let mut timeline = Vec::new();
    let mut from = start;
    while from < end {
        let to = from + 100;
        let count = |who: &str| {
            report
                .between(from, to)
                .filter(|record| StreamReport::answered_by(record).starts_with(who))
                .count()
        };
        timeline.push((
            i64::try_from(from).unwrap_or(i64::MAX) - i64::try_from(struck).unwrap_or(i64::MAX),
            count("cache"),
            count("upstream"),
            count("failed"),
        ));
        from = to;
    }
    Failover {
        who,
        cache: cache.name(),
        event,
        gap_ms: first_upstream
            .zip(last_cache)
            .map(|(first, last)| first - last),
        lost: report.failures_between(0, u64::MAX),
        lost_long: report
            .records
            .iter()
            .filter(|record| record.kind != "fresh" && record.error.is_some())
            .count(),
        lost_after_flip: first_upstream.map_or(0, |flip| report.failures_between(flip, u64::MAX)),
        lost_after_event: report.failures_between(struck, u64::MAX),
        total: report.records.len(),
        failback_ms: failback.map(|answer| answer.saturating_sub(back)),
        timeline,
    }
}

/// Replaces the rig's cache (dead or alive) with a fresh `kind`.
pub fn restart_cache(rig: &mut Rig, kind: CacheKind) -> anyhow::Result<()> {
    rig.sandbox.stop_server("cache")?;
    start_cache_at(
        &mut rig.sandbox,
        kind,
        "cache",
        SocketAddr::new(IpAddr::V4(CACHE_ADDRESS), 53),
    )
}

/// Strikes the cache with `event`.
fn strike(rig: &mut Rig, event: Event) -> anyhow::Result<()> {
    let cache = rig.sandbox.process("cache")?;
    match event {
        Event::Kill => cache.signal(Signal::SIGKILL)?,
        Event::Term => {
            cache.signal(Signal::SIGTERM)?;
            cache.wait_exit(Duration::from_secs(5))?;
        }
        Event::Stop | Event::StopAlone => cache.signal(Signal::SIGSTOP)?,
        Event::DrainThenTerm => {
            let drained = bpf_tests::cli::redirector(&[
                "drain",
                "--listener",
                "node",
                "--wait",
                "--config",
                &rig.config.display().to_string(),
            ])?;
            anyhow::ensure!(drained.code == 0, "the drain failed: {}", drained.stderr);
            let cache = rig.sandbox.process("cache")?;
            cache.signal(Signal::SIGTERM)?;
            cache.wait_exit(Duration::from_secs(5))?;
        }
    }
    Ok(())
}

/// Brings the cache (a `kind`) back from `event`.
fn revive(rig: &mut Rig, event: Event, kind: CacheKind) -> anyhow::Result<()> {
    match event {
        Event::Stop | Event::StopAlone => rig.sandbox.process("cache")?.signal(Signal::SIGCONT),
        Event::Kill | Event::Term | Event::DrainThenTerm => restart_cache(rig, kind),
    }
}

/// redirector (agent running unless the event says not): a 6 s stream to the listener, a query
/// every 1 ms from each socket kind, the event at 1.5 s, the cache (the rig's, a `kind`) back at
/// 3.5 s.
pub fn redirector(rig: &mut Rig, event: Event, kind: CacheKind) -> anyhow::Result<Failover> {
    let stream = Stream::open_loop(&rig.sandbox, dns(LISTENER), Duration::from_secs(6), 1)?;
    std::thread::sleep(Duration::from_millis(1500));
    let struck = now_ms();
    strike(rig, event)?;
    std::thread::sleep(Duration::from_millis(2000));
    let back = now_ms();
    revive(rig, event, kind)?;
    let report = stream.finish()?;
    Ok(summarize(
        "redirector",
        kind,
        event,
        &report,
        struck,
        back,
        back + 2500,
    ))
}

/// The incumbent's probe period (the seed's parameters).
pub const PROBE_EVERY_MS: u64 = 5000;
/// Failed probes in a row before the incumbent installs its DNAT.
const STRIKES: u32 = 3;

/// The incumbent: pods use the cache's address; a probe loop every 5 s; 3 failures install DNAT
/// to upstream A, a success removes it. A 30 s stream, the cache killed at 1 s and back at 20 s,
/// both `phase_ms` later: a cache dies and returns at any moment of the probe period, so the
/// trials spread their events over it.
pub fn nat_fallback(rig: &mut Rig, phase_ms: u64) -> anyhow::Result<Failover> {
    let stream = Stream::start(
        &rig.sandbox,
        Ns::Pod,
        dns(CACHE_ADDRESS),
        Duration::from_secs(30),
    )?;
    let started = now_ms();
    let (mut struck, mut back) = (None, None);
    let (mut failures, mut failed_over) = (0, false);
    let mut next_probe = started;
    let upstream: Ipv4Addr = UPSTREAM_A_V4;
    while now_ms() < started + 30_000 {
        let now = now_ms();
        if struck.is_none() && now >= started + 1000 + phase_ms {
            strike(rig, Event::Kill)?;
            struck = Some(now_ms());
        }
        if back.is_none() && now >= started + 20_000 + phase_ms {
            revive(rig, Event::Kill, CacheKind::Dnsmasq)?;
            back = Some(now_ms());
        }
        if now >= next_probe {
            next_probe += PROBE_EVERY_MS;
            // The seed's probe: one query to the cache from the node, 2 s timeout.
            let probe = rig.sandbox.query_in(
                Ns::Node,
                rig.sandbox.skipped_cgroup(),
                Query::new(dns(CACHE_ADDRESS), Transport::Udp),
            )?;
            if probe.ok {
                failures = 0;
                if failed_over {
                    rig.dnat("-D", CACHE_ADDRESS, upstream)?;
                    failed_over = false;
                }
            } else {
                failures += 1;
                if failures >= STRIKES && !failed_over {
                    rig.dnat("-A", CACHE_ADDRESS, upstream)?;
                    failed_over = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if failed_over {
        rig.dnat("-D", CACHE_ADDRESS, upstream)?;
    }
    let report = stream.finish()?;
    let (struck, back) = (struck.unwrap_or(started), back.unwrap_or(started));
    Ok(summarize(
        "NAT fallback (probe every 5 s, 3 strikes)",
        CacheKind::Dnsmasq,
        Event::Kill,
        &report,
        struck,
        back,
        started + 30_000,
    ))
}
