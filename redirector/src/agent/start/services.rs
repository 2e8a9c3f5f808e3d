//! What runs beside the steering, set up by the start: the conntrack bypass on a task of its own,
//! the telemetry endpoint, the forwarding of the programs' log; a task ends with a start that
//! fails (`TaskGuard`).

use std::{net::SocketAddr, path::Path, sync::Arc};

use redirector_common::workloads::ROUTE_LIMITED;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::{
    agent::{AgentError, environment},
    config::{Config, RateLimit, WorkloadSettings},
    conntrack_bypass::{self, BypassStatus, ConntrackBypass, nft::Nft, ruleset::Ruleset},
    datapath::{ExemptEntry, Maps},
    sys::netns::NetnsWorker,
    telemetry::{
        self,
        node_events::{EventQueue, Limited},
        stats::{AgentStats, ErrorKind},
    },
    workloads::{self, rates::Rates},
};

/// A task that ends with the start that spawned it, unless the start completes and keeps it.
#[derive(Debug)]
pub(super) struct TaskGuard(pub(super) Option<JoinHandle<()>>);

impl TaskGuard {
    pub(super) fn keep(mut self) -> Option<JoinHandle<()>> {
        self.0.take()
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Installs the conntrack bypass table when configured (its failure is reported, never fatal)
/// and keeps it on a task of its own, so that a slow or hung nft never delays the control loop;
/// when not configured, removes one an earlier configuration left.
pub(super) async fn start_conntrack_bypass(
    config: &Config,
    netns: Option<&Path>,
    stats: &Arc<AgentStats>,
) -> Result<Option<JoinHandle<()>>, AgentError> {
    let worker = NetnsWorker::start(netns).map_err(AgentError::CacheNetns)?;
    let nft = Nft::new(&config.conntrack.nft, worker);
    if !config.conntrack.bypass {
        if let Err(error) = conntrack_bypass::remove(&nft).await
            && !error.is_unavailable()
        {
            warn!(error = %crate::error_chain(&error), "conntrack.bypass is off, but removing an earlier bypass table failed");
        }
        stats.record_conntrack_bypass(BypassStatus::Disabled, 0);
        return Ok(None);
    }
    let desired = Ruleset {
        local: conntrack_bypass::local_endpoints(config),
    };
    let mut bypass = ConntrackBypass::new(nft, desired);
    let mut reported = None;
    let mut report = move |bypass: &ConntrackBypass, stats: &AgentStats| {
        let status = bypass.status().clone();
        // A failure is counted when it starts, not at every check of a node without nftables.
        if status != BypassStatus::Active && reported.as_ref() != Some(&status) {
            stats.record_error(ErrorKind::Nftables);
        }
        stats.record_conntrack_bypass(status.clone(), bypass.restorations());
        reported = Some(status);
    };
    bypass.check().await;
    report(&bypass, stats);
    let stats = Arc::clone(stats);
    let interval = config.conntrack.check_interval;
    Ok(Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            bypass.check().await;
            report(&bypass, &stats);
        }
    })))
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener`, from the maps now pinned.
pub(super) fn serve_telemetry(
    listener: std::net::TcpListener,
    config: &Config,
    stats: &Arc<AgentStats>,
) -> Result<(SocketAddr, telemetry::http::Server), AgentError> {
    let address = listener.local_addr().unwrap_or(config.metrics.address);
    let endpoint = telemetry::http::Endpoint {
        maps: std::sync::Mutex::new(Maps::open_pinned(&config.pin_dir)?),
        stats: Arc::clone(stats),
        health_window: health_window(config),
    };
    let server = telemetry::http::serve(listener, endpoint)
        .map_err(|source| telemetry::http::BindError { address, source })?;
    info!(address = %address, "serving /metrics, /healthz and /readyz");
    Ok((address, server))
}

/// How long the control loop may go without a turn before `/healthz` fails: it turns at least
/// at every probe interval; allow three, and never less than ten seconds (a slow socket-table
/// dump or nft run is no stall).
fn health_window(config: &Config) -> std::time::Duration {
    (config.probe.interval * 3).max(std::time::Duration::from_secs(10))
}

/// Forwards the programs' log records into the agent's log, on a task of their own.
pub(super) fn forward_kernel_log(
    logger: aya_log::EbpfLogger<&'static dyn log::Log>,
) -> Result<(), AgentError> {
    // SAFETY: the logger owns its ring buffer's fd for its whole life, and the AsyncFd owns the
    // logger, so the fd stays open and the same until the AsyncFd is dropped.
    let mut logger = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    }
    .map_err(|error| AgentError::KernelLog {
        source: std::io::Error::from(error),
    })?;
    warn!(
        "kernel_log is on: the programs log their decisions (debugging only; it costs every logged syscall a ring buffer write)"
    );
    tokio::spawn(async move {
        loop {
            let Ok(mut ready) = logger.readable_mut().await else {
                return;
            };
            ready.get_inner_mut().flush();
            ready.clear_ready();
        }
    });
    Ok(())
}

/// Reads every workload's counts each `workloads.interval` (with `workloads.accounting` on):
/// their rates, the busiest and the node's totals for the metrics; and exempts the listed cgroups
/// that did not exist at the start once they do.
pub(super) fn read_workloads(
    config: &Config,
    stats: &Arc<AgentStats>,
    attach: crate::sys::cgroup::Cgroup,
    mut exempt: Vec<ExemptEntry>,
    kube_client: Option<kube::Client>,
    node: &str,
    events: Option<EventQueue>,
) -> Option<JoinHandle<()>> {
    if !config.workloads.accounting {
        return None;
    }
    let mut limited = LimitedWorkloads::new(config.workloads.rate_limit, events);
    let settings = config.workloads.clone();
    let pin_dir = config.pin_dir.clone();
    let stats = Arc::clone(stats);
    let (mut names, follower) = workload_names(settings.interval, kube_client, node);
    Some(tokio::spawn(async move {
        // Ends with this task.
        let _follower = follower;
        let mut tick = tokio::time::interval(settings.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut rates = Rates::default();
        let mut maps: Option<Maps> = None;
        let mut last = tokio::time::Instant::now();
        let mut failing = false;
        loop {
            tick.tick().await;
            let now = tokio::time::Instant::now();
            let window = now - last;
            last = now;
            let opened = match maps.take() {
                Some(opened) => Ok(opened),
                None => Maps::open_pinned(&pin_dir),
            };
            let mut opened = match opened {
                Ok(opened) => opened,
                Err(error) => {
                    if !failing {
                        warn!(error = %crate::error_chain(&error), "cannot open the pinned maps to read the workloads' DNS; trying again at each interval");
                        stats.record_error(ErrorKind::WorkloadRead);
                    }
                    failing = true;
                    continue;
                }
            };
            if let Err(error) = exempt_new_cgroups(&mut opened, &settings, &attach, &mut exempt) {
                warn!(error = %crate::error_chain(&error), "cannot exempt a cgroup created since the start");
            }
            match opened.workload_counts() {
                Ok(counts) => {
                    failing = false;
                    let tracked = counts.len();
                    let read = rates.read(counts, window);
                    let (read, names) = workloads::rates::by_workload(read, |cgroup| {
                        workloads::name_of(names.as_mut(), cgroup)
                    });
                    limited.report(&read, &names);
                    let top = workloads::rates::top(read, settings.top);
                    stats.record_workloads(workloads::View {
                        top,
                        names,
                        queries_total: rates.queries_total,
                        replies_total: rates.replies_total,
                        tracked,
                        window,
                    });
                }
                Err(error) => {
                    if !failing {
                        warn!(error = %crate::error_chain(&error), "cannot read the workloads' DNS counts; trying again at each interval");
                        stats.record_error(ErrorKind::WorkloadRead);
                    }
                    failing = true;
                }
            }
            maps = Some(opened);
        }
    }))
}

/// The workloads the rate limit has held back since the agent started: each is told once, in
/// the log and as an Event on the Node.
struct LimitedWorkloads {
    limit: Option<RateLimit>,
    events: Option<EventQueue>,
    told: std::collections::HashSet<String>,
}

impl LimitedWorkloads {
    fn new(limit: Option<RateLimit>, events: Option<EventQueue>) -> Self {
        Self {
            limit,
            events,
            told: std::collections::HashSet::new(),
        }
    }

    /// Tells each workload of `rates` (named by `names`) held back for the first time.
    fn report(
        &mut self,
        rates: &[workloads::rates::WorkloadRate],
        names: &std::collections::HashMap<u64, workloads::Name>,
    ) {
        let Some(limit) = self.limit else {
            return;
        };
        for rate in rates {
            let refused = rate.queries[ROUTE_LIMITED];
            if refused <= 0.0 {
                continue;
            }
            let Some(name) = names.get(&rate.cgroup) else {
                continue;
            };
            // Bounded by the workloads the kernel tracks that were ever limited.
            if !self.told.insert(name.workload.clone()) {
                continue;
            }
            warn!(workload = %name.workload, qps = limit.qps, burst = limit.burst, refused_per_second = refused, "a workload asks for DNS faster than the rate limit: its queries over it are refused");
            if let Some(events) = &self.events {
                events.limited(Limited {
                    workload: name.workload.clone(),
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
/// task following them ends with the returned guard).
fn workload_names(
    interval: std::time::Duration,
    kube_client: Option<kube::Client>,
    node: &str,
) -> (Option<workloads::Resolver>, TaskGuard) {
    let Some(resolver) = workloads::host_resolver(interval) else {
        return (None, TaskGuard(None));
    };
    let Some(client) = kube_client else {
        return (Some(resolver), TaskGuard(None));
    };
    let pods = workloads::pods::PodNames::new();
    match pods.follow(client, node) {
        Ok(follow) => (
            Some(resolver.with_pods(pods)),
            TaskGuard(Some(tokio::spawn(follow))),
        ),
        Err(error) => {
            warn!(error = %crate::error_chain(&error), "pods are named by their UIDs");
            (Some(resolver), TaskGuard(None))
        }
    }
}

/// Adds each listed exempt cgroup that exists now and was not exempt yet (a service started
/// since), and writes the set.
fn exempt_new_cgroups(
    maps: &mut Maps,
    settings: &WorkloadSettings,
    attach: &crate::sys::cgroup::Cgroup,
    exempt: &mut Vec<ExemptEntry>,
) -> Result<(), AgentError> {
    let mut added = false;
    for (list, exempt_from) in environment::exempt_lists(settings) {
        for cgroup in environment::existing_cgroups(list.key, list.paths, attach)? {
            if environment::add_exempt(exempt, &cgroup, exempt_from) {
                info!(cgroup = %cgroup.path.display(), list = list.key, "an exempt cgroup exists now; it is exempt from here on");
                added = true;
            }
        }
    }
    if added {
        maps.set_exempt_cgroups(exempt)?;
    }
    Ok(())
}
