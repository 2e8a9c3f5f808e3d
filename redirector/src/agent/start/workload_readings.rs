//! The agent's readings of each workload's DNS (with `workloads.accounting` on), every
//! `workloads.interval`: the counts read into rates, the busiest and the node's totals for the
//! metrics, the workloads the rate limit holds back told once, then the exempt cgroups written as
//! they are now, and the counted cgroups a change of them concerns forgotten (their counts read
//! just before), to be judged again. Each reading runs on a blocking thread: a walk of a large
//! `WORKLOADS` map (two syscalls an entry) or of the cgroup hierarchy must never stall the probes
//! and the control loop on the agent's runtime.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use redirector_common::workloads::ROUTE_LIMITED;
use tokio::task::JoinHandle;
use tracing::warn;

use super::services::TaskGuard;
use crate::{
    agent::{AgentError, environment},
    config::{Config, RateLimit, WorkloadSettings},
    datapath::{ExemptEntry, Maps},
    sys::cgroup::Cgroup,
    telemetry::{
        node_events::{EventQueue, Limited},
        stats::{AgentStats, ErrorKind},
    },
    workloads::{self, Resolver, names_file, pods::PodNames, rates::Rates},
};

/// Workloads told as held back, at most, before the record starts again (a workload told twice
/// then is one more log line and Event).
const TOLD_LIMIT: usize = 65_536;

/// Starts the readings; `None` with `workloads.accounting` off. `base` is the exempt set the
/// start wrote (the skipped cgroups, the agent's, the listed ones that existed), and
/// `exempt_changed` the entries its write changed; the pods are named through `kube_client` when
/// there is one.
#[expect(
    clippy::too_many_arguments,
    reason = "what the start hands the readings, each once"
)]
pub(super) fn read_workloads(
    config: &Config,
    stats: &Arc<AgentStats>,
    attach: Cgroup,
    base: Vec<ExemptEntry>,
    exempt_changed: Vec<u64>,
    kube_client: Option<kube::Client>,
    node: &str,
    events: Option<EventQueue>,
) -> Option<JoinHandle<()>> {
    if !config.workloads.accounting {
        return None;
    }
    let settings = config.workloads.clone();
    let (names, pods, follower) = workload_names(settings.interval, kube_client, node);
    let recorded_pods = pods.map(|pods| {
        (
            pods,
            names_file::Writer::new(names_file::path(&config.lock_file)),
        )
    });
    let readings = Readings {
        limited: LimitedWorkloads::new(settings.rate_limit, events),
        settings,
        pin_dir: config.pin_dir.clone(),
        attach,
        base,
        exempt_changed,
        stats: Arc::clone(stats),
        names,
        recorded_pods,
        recording_failed: false,
        rates: Rates::default(),
        maps: None,
        failing: false,
        overflowing: false,
    };
    let interval = readings.settings.interval;
    Some(tokio::spawn(async move {
        // Ends with this task.
        let _follower = follower;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = tokio::time::Instant::now();
        let mut readings = readings;
        loop {
            tick.tick().await;
            let now = tokio::time::Instant::now();
            let window = now - last;
            last = now;
            match tokio::task::spawn_blocking(move || {
                readings.read(window);
                readings
            })
            .await
            {
                Ok(read) => readings = read,
                Err(error) => {
                    warn!(error = %error, "the reading of the workloads' DNS failed; the workloads' metrics stop until the agent restarts");
                    return;
                }
            }
        }
    }))
}

/// What the readings keep from one to the next.
struct Readings {
    settings: WorkloadSettings,
    pin_dir: PathBuf,
    attach: Cgroup,
    base: Vec<ExemptEntry>,
    /// Exempt entries changed since the counted cgroups they concern were last forgotten.
    exempt_changed: Vec<u64>,
    stats: Arc<AgentStats>,
    names: Option<Resolver>,
    /// The pods' names from the API server, and the record of them for the CLI.
    recorded_pods: Option<(PodNames, names_file::Writer)>,
    /// Whether the last record of them failed.
    recording_failed: bool,
    rates: Rates,
    maps: Option<Maps>,
    limited: LimitedWorkloads,
    /// Whether the last reading failed (a failure is told when it starts).
    failing: bool,
    /// Whether the last reading left exempt cgroups out of the kernel's set.
    overflowing: bool,
}

impl Readings {
    /// One reading, `window` after the last.
    fn read(&mut self, window: Duration) {
        if let Some((pods, writer)) = &mut self.recorded_pods {
            match writer.write(pods) {
                Ok(_) => self.recording_failed = false,
                // Told when it starts failing; tried again at every reading.
                Err(error) if !std::mem::replace(&mut self.recording_failed, true) => {
                    warn!(error = %crate::error_chain(&error), "each reading tries again");
                }
                Err(_) => {}
            }
        }
        let opened = match self.maps.take() {
            Some(opened) => Ok(opened),
            None => Maps::open_pinned(&self.pin_dir),
        };
        let mut maps = match opened {
            Ok(maps) => maps,
            Err(error) => {
                self.failed(
                    "cannot open the pinned maps to read the workloads' DNS",
                    &error,
                );
                return;
            }
        };
        self.read_counts(&maps, window);
        match self.write_exempt_cgroups(&mut maps) {
            Ok(changed) => self.exempt_changed.extend(changed),
            Err(error) => {
                warn!(error = %crate::error_chain(&error), "cannot write the exempt cgroups; the next reading tries again");
            }
        }
        self.judge_again(&mut maps);
        self.maps = Some(maps);
    }

    /// Reads every counted workload's counts into the rates and the metrics.
    fn read_counts(&mut self, maps: &Maps, window: Duration) {
        match maps.workload_counts() {
            Ok(counts) => {
                self.failing = false;
                let tracked = counts.len();
                let read = self.rates.read(counts, window);
                let names = &mut self.names;
                let (read, named) = workloads::rates::by_workload(read, |cgroup| {
                    workloads::name_of(names.as_mut(), cgroup)
                });
                self.limited.report(&read, &named);
                self.stats.record_workloads(workloads::View {
                    top: workloads::rates::top(read, self.settings.top),
                    names: named,
                    queries_total: self.rates.queries_total,
                    replies_total: self.rates.replies_total,
                    tracked,
                    window,
                });
            }
            Err(error) => self.failed("cannot read the workloads' DNS counts", &error),
        }
    }

    /// Forgets the counted cgroups that the exempt entries changed since the last time concern
    /// (`workloads::judged`), so that the programs judge them again at their next count. Their
    /// counts were read just before; what they count between that read and this removal is lost
    /// (microseconds), and their rate stamps start again. A removal that fails is tried again at
    /// the next reading.
    fn judge_again(&mut self, maps: &mut Maps) {
        if self.exempt_changed.is_empty() {
            return;
        }
        let concerned = workloads::judged::concerned(
            &self.exempt_changed,
            &maps.counted_cgroups(),
            self.names.as_mut(),
        );
        match maps.forget_workloads(&concerned) {
            Ok(()) => {
                self.rates.forget(&concerned);
                self.exempt_changed.clear();
            }
            Err(error) => {
                warn!(error = %crate::error_chain(&error), "cannot forget the counted cgroups whose exemption changed; the next reading tries again");
            }
        }
    }

    /// Tells a failure when it starts, and counts it.
    fn failed(&mut self, what: &str, error: &(dyn std::error::Error + 'static)) {
        if !self.failing {
            warn!(error = %crate::error_chain(error), "{what}; trying again at each interval");
            self.stats.record_error(ErrorKind::WorkloadRead);
        }
        self.failing = true;
    }

    /// Writes the exempt cgroups as they are now: the start's, each listed cgroup that exists (a
    /// service started since the start is exempt from here on), and the cgroups caches bound
    /// from that still exist. Rebuilt at every reading, so a listed unit's earlier cgroup and a
    /// cache gone drop out. Returns the entries that changed.
    fn write_exempt_cgroups(&mut self, maps: &mut Maps) -> Result<Vec<u64>, AgentError> {
        let mut exempt = self.base.clone();
        for (list, exempt_from) in environment::exempt_lists(&self.settings) {
            for cgroup in environment::existing_cgroups(list.key, list.paths, &self.attach)? {
                environment::add_exempt(&mut exempt, &cgroup, exempt_from);
            }
        }
        // A cgroup the hierarchy no longer has is gone; without the hierarchy every one is kept.
        let exempt = match self.names.as_mut() {
            Some(names) => environment::with_caches(&exempt, maps, |cgroup| {
                names.describe(cgroup).cgroup_path.is_some()
            }),
            None => environment::with_caches(&exempt, maps, |_| true),
        };
        let written = maps.set_exempt_cgroups(&exempt)?;
        let overflowing = written.left_out > 0;
        // Told and counted once for each run of readings that leave cgroups out.
        if overflowing && !self.overflowing {
            environment::tell_overflow(written.left_out);
            self.stats.record_error(ErrorKind::ExemptOverflow);
        }
        self.overflowing = overflowing;
        Ok(written.changed)
    }
}

/// The workloads the rate limit has held back since the agent started: each is told once (by
/// the cgroup its rates are keyed by), in the log and as an Event on the Node.
struct LimitedWorkloads {
    limit: Option<RateLimit>,
    events: Option<EventQueue>,
    told: HashSet<u64>,
}

impl LimitedWorkloads {
    fn new(limit: Option<RateLimit>, events: Option<EventQueue>) -> Self {
        Self {
            limit,
            events,
            told: HashSet::new(),
        }
    }

    /// Tells each workload of `rates` (named by `names`) held back for the first time.
    fn report(
        &mut self,
        rates: &[workloads::rates::WorkloadRate],
        names: &HashMap<u64, workloads::Name>,
    ) {
        let Some(limit) = self.limit else {
            return;
        };
        for rate in rates {
            let refused = rate.queries[ROUTE_LIMITED];
            if refused <= 0.0 {
                continue;
            }
            if self.told.len() >= TOLD_LIMIT {
                self.told.clear();
            }
            if !self.told.insert(rate.cgroup) {
                continue;
            }
            let workload = names.get(&rate.cgroup).map_or_else(
                || format!("cgroup/{}", rate.cgroup),
                |name| name.workload.clone(),
            );
            warn!(workload = %workload, qps = limit.qps, burst = limit.burst, refused_per_second = refused, "a workload asks for DNS faster than the rate limit: its queries over it are refused");
            if let Some(events) = &self.events {
                events.limited(Limited {
                    workload,
                    qps: limit.qps,
                    burst: limit.burst,
                    refused_per_second: refused,
                });
            }
        }
    }
}

/// What names the workloads: their cgroups' paths (walked again at most once an `interval` for
/// an id not seen yet), and this node's pods from the API server when there is a client (the
/// task following them ends with the returned guard), also returned on their own.
fn workload_names(
    interval: Duration,
    kube_client: Option<kube::Client>,
    node: &str,
) -> (Option<Resolver>, Option<PodNames>, TaskGuard) {
    let Some(resolver) = workloads::host_resolver(interval) else {
        return (None, None, TaskGuard(None));
    };
    let Some(client) = kube_client else {
        return (Some(resolver), None, TaskGuard(None));
    };
    let pods = PodNames::new();
    match pods.follow(client, node) {
        Ok(follow) => (
            Some(resolver.with_pods(pods.clone())),
            Some(pods),
            TaskGuard(Some(tokio::spawn(follow))),
        ),
        Err(error) => {
            warn!(error = %crate::error_chain(&error), "pods are named by their UIDs");
            (Some(resolver), None, TaskGuard(None))
        }
    }
}
