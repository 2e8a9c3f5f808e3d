//! A fleet failing over at once, modelled with the agent's own pieces: every node's
//! `CheckSchedule` (seeded per node, so the run is reproducible), its subset of the kube-dns pool
//! (`sources::subset`), the verdict of each check (`CheckOutcome`) and the targets' states
//! (`UpstreamChecks`), under the default `[probe]` settings. Time is simulated: checks and their
//! outcomes are events in time order; a pod answers each check after its own latency, and the
//! probe timeout is what `Prober::exchange` enforces (no answer by then: "timeout").
//!
//! The question is the one of issue 39: after a bad cache rollout fails every node over together,
//! what do the checks cost each kube-dns pod, and does a pod slowed by that load leave the pools?

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use hickory_proto::op::ResponseCode;
use redirector_common::pool::MAX_POOL_TARGETS;

use super::{CheckOutcome, CheckSchedule, UpstreamChecks, checked_address};
use crate::{
    config::ProbeSettings,
    sources::{Upstream, subset},
};

/// The nodes that fail over together.
const NODES: usize = 5_000;
/// kube-dns pods (every node's pool holds them all: fewer than `MAX_POOL_TARGETS`).
const PODS: usize = 10;
/// The pod slowed by the load: it answers every query, in `SLOW`.
const SLOW_POD: usize = 0;
const SLOW: Duration = Duration::from_millis(300);
/// The pod that hangs: it answers nothing.
const HUNG_POD: usize = 1;
/// How the others answer.
const FAST: Duration = Duration::from_millis(2);
/// The load is counted in windows this long.
const WINDOW: Duration = Duration::from_millis(100);
/// How long after the failover the model runs.
const RUN: Duration = Duration::from_secs(20);
/// The listener every node checks (one: the cluster listener).
const LISTENER: u32 = 1;

/// What the checks of the whole fleet did.
struct Fleet {
    /// Per pod, checks it received in each window of the run.
    windows: Vec<Vec<u64>>,
    /// Per pod, the nodes whose pool it left at least once.
    removed_on: Vec<usize>,
    /// Per pod, the nodes whose pool it is out of at the end.
    out_at_end: Vec<usize>,
    /// The latest moment a node took the hung pod out (`None`: some node never did).
    hung_out_by: Option<Duration>,
    /// Pool writes in which every target failed (kept whole: never emptied).
    all_failing: usize,
    /// How many nodes hold each pod in their subset.
    holders: Vec<usize>,
}

/// An event of the model, ordered by time (then kind, node, pod, to be deterministic).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A check's outcome reaches its node: (node, pod, answered).
    Outcome(usize, usize, bool),
    /// A node's round of checks is due.
    Round(usize),
}

fn pod_address(pod: usize) -> SocketAddr {
    let pod = u8::try_from(pod).expect("a small fleet of pods");
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 244, 7, pod + 2)), 53)
}

/// How long `pod` takes to answer, if it does.
fn latency(pod: usize) -> Option<Duration> {
    match pod {
        SLOW_POD => Some(SLOW),
        HUNG_POD => None,
        _ => Some(FAST),
    }
}

/// What `Prober::exchange` returns for a check of `pod` waiting `timeout`, and when.
fn exchange(pod: usize, timeout: Duration) -> (Duration, Result<(ResponseCode, Duration), String>) {
    match latency(pod) {
        Some(latency) if latency <= timeout => (latency, Ok((ResponseCode::NoError, latency))),
        _ => (timeout, Err("timeout".to_owned())),
    }
}

/// Runs `nodes` nodes failing over at 0 with `probe`'s settings.
fn fail_over(nodes: usize, probe: &ProbeSettings) -> Fleet {
    let interval = probe.upstream_interval.expect("upstream checks on");
    let pool: Vec<Upstream> = (0..PODS)
        .map(|pod| Upstream::from(pod_address(pod)))
        .collect();
    let windows_in_run = usize::try_from(RUN.as_nanos() / WINDOW.as_nanos()).expect("small");
    let mut fleet = Fleet {
        windows: vec![vec![0; windows_in_run]; PODS],
        removed_on: vec![0; PODS],
        out_at_end: vec![0; PODS],
        hung_out_by: Some(Duration::ZERO),
        all_failing: 0,
        holders: vec![0; PODS],
    };
    let mut schedules: Vec<CheckSchedule<Duration>> = Vec::with_capacity(nodes);
    let mut verdicts: Vec<UpstreamChecks> = Vec::with_capacity(nodes);
    // Per node: its subset, and the pods in it.
    let mut subsets: Vec<(Vec<Upstream>, Vec<usize>)> = Vec::with_capacity(nodes);
    let mut removed = vec![vec![false; PODS]; nodes];
    let mut events = BinaryHeap::new();
    for node in 0..nodes {
        let (subset, _) = subset::for_node(&pool, &format!("node-{node}"), MAX_POOL_TARGETS);
        let pods: Vec<usize> = subset
            .iter()
            .map(|upstream| {
                (0..PODS)
                    .find(|pod| pod_address(*pod) == checked_address(upstream))
                    .expect("a pod of the pool")
            })
            .collect();
        for pod in &pods {
            fleet.holders[*pod] += 1;
        }
        subsets.push((subset, pods));
        let mut schedule = CheckSchedule::seeded(interval, node as u64);
        // Every node starts routing upstream at the same moment.
        schedule.follow(true, Duration::ZERO);
        events.push(Reverse((schedule.due().expect("due"), Event::Round(node))));
        schedules.push(schedule);
        verdicts.push(UpstreamChecks::new(probe.failures_to_fail_over));
    }
    let mut hung_out_at = vec![None; nodes];
    while let Some(Reverse((now, event))) = events.pop() {
        match event {
            Event::Round(node) => {
                let window = usize::try_from(now.as_nanos() / WINDOW.as_nanos()).expect("small");
                for pod in &subsets[node].1 {
                    fleet.windows[*pod][window] += 1;
                    let (after, result) = exchange(*pod, probe.upstream_timeout);
                    let answered = CheckOutcome::of(result).is_proof_of_life();
                    events.push(Reverse((now + after, Event::Outcome(node, *pod, answered))));
                }
                schedules[node].sent(now);
                let next = schedules[node].due().expect("still routing upstream");
                if next < RUN {
                    events.push(Reverse((next, Event::Round(node))));
                }
            }
            Event::Outcome(node, pod, answered) => {
                let Some(down) = verdicts[node].record(LISTENER, pod_address(pod), answered) else {
                    continue;
                };
                if down {
                    removed[node][pod] = true;
                    if pod == HUNG_POD {
                        hung_out_at[node] = Some(now);
                    }
                }
                // The pool the controller would write now.
                let (usable, all_failing) = verdicts[node].usable(LISTENER, &subsets[node].0);
                assert!(!usable.is_empty(), "node {node}'s pool was emptied");
                fleet.all_failing += usize::from(all_failing);
            }
        }
    }
    for ((removed, verdicts), hung_out_at) in removed.iter().zip(&verdicts).zip(&hung_out_at) {
        for (pod, removed) in removed.iter().enumerate() {
            fleet.removed_on[pod] += usize::from(*removed);
            fleet.out_at_end[pod] += usize::from(verdicts.is_down(LISTENER, pod_address(pod)));
        }
        fleet.hung_out_by = match (fleet.hung_out_by, hung_out_at) {
            (Some(latest), Some(at)) => Some(latest.max(*at)),
            _ => None,
        };
    }
    fleet
}

#[test]
fn a_fleet_failing_over_at_once_checks_each_pod_evenly_and_keeps_the_slow_one() {
    let probe = ProbeSettings::default();
    let interval = probe
        .upstream_interval
        .expect("upstream checks on by default");
    let fleet = fail_over(NODES, &probe);

    let run_s = RUN.as_secs_f64();
    let windows = fleet.windows[0].len() as f64;
    println!(
        "{NODES} nodes fail over at 0 s; {PODS} kube-dns pods; checks every {} ms ± {} %, \
         timeout {} ms, out after {} failures; {} s modelled",
        interval.as_millis(),
        super::JITTER_PERCENT,
        probe.upstream_timeout.as_millis(),
        probe.failures_to_fail_over,
        RUN.as_secs()
    );
    println!("pod  nodes  checks/s  expected/s  mean/100ms  peak/100ms  peak/mean");
    for pod in 0..PODS {
        let checks: u64 = fleet.windows[pod].iter().sum();
        let peak = *fleet.windows[pod].iter().max().expect("windows");
        let rate = checks as f64 / run_s;
        let expected = fleet.holders[pod] as f64 / interval.as_secs_f64();
        let mean = checks as f64 / windows;
        println!(
            "{pod:>3}  {:>5}  {rate:>8.0}  {expected:>10.0}  {mean:>10.0}  {peak:>10}  {:>9.2}",
            fleet.holders[pod],
            peak as f64 / mean
        );
        assert!(
            (rate - expected).abs() <= expected / 10.0,
            "pod {pod}: {rate:.0} checks a second, not {expected:.0} (nodes / interval) within 10 %"
        );
        assert!(
            peak as f64 <= 1.5 * mean,
            "pod {pod}: {peak} checks in one 100 ms window, {:.2} times the mean {mean:.0}",
            peak as f64 / mean
        );
    }
    // For comparison, in step (every node checking at the same instant, as without the jitter
    // and the spread first round): one window in each interval holds every node's check.
    println!(
        "in step instead: {NODES} checks in one {} ms window of every {} ms, {:.1} times the mean",
        WINDOW.as_millis(),
        interval.as_millis(),
        interval.as_secs_f64() / WINDOW.as_secs_f64()
    );

    let hung_out_by = fleet.hung_out_by.expect("every node took the hung pod out");
    println!(
        "the slow pod ({} ms) left {} of {NODES} pools; the hung pod left all {} by {:.2} s; \
         pools whose every target failed: {}",
        SLOW.as_millis(),
        fleet.removed_on[SLOW_POD],
        fleet.out_at_end[HUNG_POD],
        hung_out_by.as_secs_f64(),
        fleet.all_failing
    );
    assert_eq!(fleet.removed_on[SLOW_POD], 0, "slow is not dead");
    assert_eq!(
        fleet.out_at_end[HUNG_POD], NODES,
        "a pod that answers nothing leaves"
    );
    for pod in (0..PODS).filter(|pod| *pod != HUNG_POD) {
        assert_eq!(
            fleet.removed_on[pod], 0,
            "pod {pod} answers and was taken out"
        );
    }
    // Its failures come one timeout after the checks that find it, the first of them within one
    // interval of the failover, the next within 1.2 intervals of it.
    let latest =
        interval + interval * 6 / 5 * (probe.failures_to_fail_over - 1) + probe.upstream_timeout;
    assert!(hung_out_by <= latest, "{hung_out_by:?} > {latest:?}");
    assert_eq!(fleet.all_failing, 0);
}

/// What the issue measured: with the cache probe's timeout (250 ms), the same slow pod leaves
/// every node's pool, and the model sees it (so its "never removed" above can fail).
#[test]
fn with_the_cache_probes_timeout_the_slow_pod_would_leave_every_pool() {
    let defaults = ProbeSettings::default();
    let probe = ProbeSettings {
        upstream_timeout: defaults.timeout,
        ..defaults
    };
    let nodes = 500;
    let fleet = fail_over(nodes, &probe);
    println!(
        "with a {} ms timeout the {} ms pod left {} of {nodes} pools",
        probe.upstream_timeout.as_millis(),
        SLOW.as_millis(),
        fleet.removed_on[SLOW_POD]
    );
    assert_eq!(fleet.removed_on[SLOW_POD], nodes);
}
