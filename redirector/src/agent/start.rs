//! An agent's start, phase by phase: check the environment (capabilities, the kernel, the cgroups,
//! the pin directory, the lock), plan what to do with the pins, load and verify the object and
//! migrate what changed beside the running set, own the listener interface and the conntrack
//! bypass, fill the maps, count the caches' sockets and probe them, bind the metrics port, and
//! only then swap the programs in and start following the sources. Every phase before the swap
//! can fail and leave what runs untouched; each is timed (`StartPhases`) and logged with
//! "redirector is steering".

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::Arc,
};

use redirector_common::{
    listener::{Reason, Route},
    pool::Target,
    settings::Liveness,
};
use tokio::{sync::mpsc, task::JoinHandle};
use tracing::{info, warn};

use super::{
    Agent, AgentError, ListenerRuntime, StartOptions, drain_socket, environment, ids,
    namespace_identity,
};
use crate::{
    config::{Config, UpstreamSource},
    conntrack_bypass::{self, BypassStatus, ConntrackBypass, nft::Nft, ruleset::Ruleset},
    datapath::{
        self, Datapath, Journal, ListenerEntry, LoadOptions, MapAction, Maps, Plan, Verdict,
    },
    liveness::{
        binds::{TrackedCache, cache_binds},
        health::{self, HealthTracker, Hysteresis, Probe},
        probe::Prober,
        reconcile::Reconciler,
        sockdiag::SocketTable,
        upstreams::UpstreamChecks,
    },
    sources::{self, FedListener, SourceEvent, Upstream},
    sys::{
        cgroup::{self, Cgroup},
        interface,
        kernel_support::{self, KernelSupport, Need},
        lock::InstanceLock,
        netns::{self, NetnsError, NetnsWorker},
    },
    telemetry::{
        self,
        stats::{AgentStats, ErrorKind},
    },
};

/// Where an agent's start spends its time, phase by phase: logged with "redirector is steering"
/// as comma-separated `name=ms` pairs, in order (the bench reads them).
struct StartPhases {
    last: std::time::Instant,
    ended: Vec<(&'static str, std::time::Duration)>,
}

impl StartPhases {
    fn new() -> Self {
        Self {
            last: std::time::Instant::now(),
            ended: Vec::new(),
        }
    }

    /// Ends the phase `name`, begun where the previous one ended.
    fn end(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.ended.push((name, now - self.last));
        self.last = now;
    }

    /// Ends a phase that ran alongside the previous one: its `parts` as they were timed where
    /// they ran, and `name` for what it took beyond the previous phase's end.
    fn end_parts(&mut self, name: &'static str, parts: &[(&'static str, std::time::Duration)]) {
        self.ended.extend_from_slice(parts);
        self.end(name);
    }
}

impl std::fmt::Display for StartPhases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (position, (name, took)) in self.ended.iter().enumerate() {
            let separator = if position == 0 { "" } else { "," };
            write!(f, "{separator}{name}={:.1}", took.as_secs_f64() * 1000.0)?;
        }
        Ok(())
    }
}

impl Agent {
    /// Checks the environment against `config`, loads the datapath (adopting compatible pins),
    /// fills its maps, owns the listener addresses, seeds the caches' socket counts, probes
    /// every cache once, attaches, and starts the upstream sources. Nothing is attached unless
    /// every check passed.
    pub async fn start(config: &Config, options: StartOptions) -> Result<Self, AgentError> {
        let mut first = FirstStart::default();
        let started = Self::start_steps(config, options, &mut first).await;
        if started.is_err() {
            first.revert(config).await;
        }
        started
    }

    /// The start's steps; `first` learns whether nothing steered when it took the lock (what a
    /// failure then leaves serves nobody, and `FirstStart::revert` removes it).
    async fn start_steps(
        config: &Config,
        options: StartOptions,
        first: &mut FirstStart,
    ) -> Result<Self, AgentError> {
        let mut phases = StartPhases::new();
        let unmet = crate::sys::capabilities::unmet(&crate::sys::capabilities::needs(
            config.cache_netns.is_some(),
        ));
        if !unmet.is_empty() {
            return Err(AgentError::MissingCapabilities { unmet });
        }
        crate::sys::capabilities::check_bpf_allowed()?;
        let kernel = KernelSupport::probe(&options.absent_features);
        kernel_support::require(&kernel)?;
        log_degraded(&kernel);
        phases.end("kernel_probe");
        let attach_path = match &config.cgroup {
            Some(path) => path.clone(),
            None => cgroup::default_attach_cgroup()?,
        };
        let attach = Cgroup::resolve("cgroup", &attach_path)?;
        let skip_cgroups = environment::resolve_skip_cgroups(config)?;
        environment::prepare_pin_dir(&config.pin_dir)?;
        let lock = InstanceLock::acquire(&config.lock_file)?;
        first.nothing_steered = !datapath::has_pinned_attachments(&config.pin_dir);
        let plan = plan_pins(config, &options)?;
        phases.end("checks");
        let netns = config.cache_netns.as_deref();
        let cache_netns = netns
            .map(|path| {
                namespace_identity(path)
                    .map(|identity| (path.to_owned(), identity))
                    .map_err(|source| {
                        AgentError::CacheNetns(NetnsError::Open {
                            path: path.to_owned(),
                            source,
                        })
                    })
            })
            .transpose()?;
        let netns_cookie = netns::cookie(netns).map_err(AgentError::CacheNetns)?;
        let worker = NetnsWorker::start(netns).map_err(AgentError::CacheNetns)?;
        let socket_table = SocketTable::open(netns).map_err(AgentError::SocketTable)?;
        phases.end("namespace");
        let kube_client = kube_client(config).await?;
        phases.end("kube_client");

        // The kernel verifies the programs on a blocking thread while `nft` installs the
        // conntrack bypass (most of the start, and the largest part of the rest, were spent one
        // after the other before); both end before anything is attached, so steered DNS is
        // untracked from the first query. A bypass failure is not fatal.
        let load = {
            let options = LoadOptions {
                reverse_nat_entries: config.reverse_nat_entries,
                pin_dir: config.pin_dir.clone(),
                kernel_log: config.kernel_log,
                set_retval: kernel.has(kernel_support::SET_RETVAL),
                atomic_fetch: kernel.has(kernel_support::ATOMIC_FETCH),
                measure_tick: kernel.has(kernel_support::TICK_TEST_RUN),
                fail_after_load: options.fail_after_load,
            };
            tokio::task::spawn_blocking(move || Datapath::load(&options, plan))
        };
        let node = sources::node_name();
        let stats = Arc::new(AgentStats::for_node(node.clone()));
        stats.record_kernel_degraded(
            kernel
                .degraded()
                .map(|finding| finding.feature.id)
                .collect(),
        );
        // Ends with a failed start (a failed load included): a table it keeps would outlive the
        // revert.
        let bypass = start_conntrack_bypass(config, netns, &stats)
            .await
            .map(TaskGuard);
        phases.end("conntrack_bypass");
        let (mut datapath, mut maps) = load.await.map_err(AgentError::LoadTask)??;
        let bypass = bypass?;
        let load_times = datapath.load_times();
        phases.end_parts(
            "load",
            &[
                ("object", load_times.object),
                ("verify", load_times.verify),
                ("migrate", load_times.migrate),
            ],
        );
        if config.kernel_log {
            forward_kernel_log(datapath.kernel_logger()?)?;
        }
        let pinned: Vec<(u32, String)> = maps
            .listeners()?
            .into_iter()
            .filter_map(|(id, info)| Some((id, info.name()?.to_owned())))
            .collect();
        let names: Vec<&str> = config
            .listeners
            .iter()
            .map(|listener| listener.name.as_str())
            .collect();
        let (ids, removed) = ids::assign(&names, &pinned);

        // Everything that can fail without touching what the running programs read comes
        // first: the listener interface (it only adds), the probe names, the first probes, the
        // ports this agent serves. The maps the running programs share are written only after.
        let addresses: Vec<IpAddr> = config
            .listeners
            .iter()
            .map(|listener| listener.address)
            .collect();
        if config.interface.manage {
            interface::ensure(
                &config.interface,
                &addresses,
                &worker,
                &interface::record_path(&config.lock_file),
            )
            .await?;
        }
        phases.end("interface");
        let (probers, alive) = probe_caches(config, &worker).await?;
        phases.end("first_probes");
        let metrics_socket = if config.metrics.enabled {
            Some(telemetry::http::bind(config.metrics.address)?)
        } else {
            None
        };
        let drains = match &config.drain_socket {
            Some(path) => Some(TaskGuard(Some(drain_socket::serve(
                path,
                config.pin_dir.clone(),
                config.cache_netns.clone(),
                Arc::new(
                    config
                        .listeners
                        .iter()
                        .zip(&probers)
                        .map(|(listener, prober)| (listener.name.clone(), prober.clone()))
                        .collect(),
                ),
            )?))),
            None => None,
        };
        if options.layout_bump {
            // The stand-in for the state a newer layout adds, which a rollback must retire.
            datapath::pin_next_layout_map(&config.pin_dir, NEXT_LAYOUT_MAP)?;
        }
        phases.end("telemetry");

        // The commit: from the first write on, a failure puts back what the running programs
        // read (`Journal`), and counts the caches' sockets by the binds it found again.
        let journal = maps.journal()?;
        let tracked: Vec<TrackedCache> = config
            .listeners
            .iter()
            .zip(&ids)
            .filter(|(listener, _)| listener.liveness == Liveness::SocketsAndProbes)
            .map(|(listener, id)| TrackedCache {
                id: *id,
                cache: listener.cache,
            })
            .collect();
        let binds = cache_binds(&tracked);
        let mut reconciler =
            Reconciler::new(socket_table, binds.clone(), config.cache_netns.clone());
        let commit = Commit {
            config,
            journal: &journal,
            ids: &ids,
            removed: &removed,
            binds: &binds,
            netns_cookie,
            layout_version: redirector_common::LAYOUT_VERSION + u32::from(options.layout_bump),
            skips: environment::skip_entries(&skip_cgroups, &ids, &attach),
            fail_before_attach: options.fail_before_attach,
        };
        let listeners = match commit
            .run(
                &mut datapath,
                &mut maps,
                &mut reconciler,
                probers,
                &alive,
                &attach.path,
                &mut phases,
            )
            .await
        {
            Ok(listeners) => listeners,
            Err(error) => {
                put_back(&mut maps, &journal, &mut reconciler).await;
                return Err(error);
            }
        };
        for listener in &listeners {
            stats.record_pool_source(&listener.name, listener.source);
        }
        if config.interface.manage {
            // Only now: until this set steered, the running one may still have sent DNS there.
            if let Err(error) = interface::remove_unconfigured(
                &config.interface,
                &addresses,
                &worker,
                &interface::record_path(&config.lock_file),
            )
            .await
            {
                warn!(error = %crate::error_chain(&error), "cannot remove the addresses of listeners no longer configured; `redirector uninstall` removes them");
            }
        }
        for other in datapath::other_attached_sets(&config.pin_dir) {
            warn!(pin_dir = %other.display(), "ANOTHER redirector set is attached from this directory: unless a second agent runs it on purpose, it is stale (was pin_dir changed?) and steers DNS on state no agent updates; remove its pins to detach it: rm -r {}", other.display());
        }
        phases.end("attach");
        let telemetry = match metrics_socket {
            Some(listener) => Some(serve_telemetry(listener, config, &stats)?),
            None => None,
        };
        // Binds and releases that raced the attach are caught here, or by the next pass.
        if let Err(error) = reconciler.reconcile(&mut maps, true).await {
            warn!(error = %error, "re-counting the caches' sockets after attaching failed; the next pass retries");
        }
        phases.end("recount");

        let node_events = kube_client.as_ref().map(|client| {
            telemetry::node_events::NodeEvents::start(client.clone(), &node, Arc::clone(&stats))
        });
        let (events, sources) = start_sources(config, &ids, kube_client);
        let mut agent = Self {
            datapath,
            maps,
            reconciler,
            listeners,
            config: config.clone(),
            stats,
            events,
            sources,
            bypass: bypass.keep(),
            drains: drains.and_then(TaskGuard::keep),
            telemetry,
            lock,
            node,
            cache_netns,
            node_events,
            upstream_checks: UpstreamChecks::new(config.probe.failures_to_fail_over),
        };
        agent.log_listeners()?;
        info!(
            cgroup = %attach.path.display(),
            pin_dir = %config.pin_dir.display(),
            adopted = agent.datapath.adopted(),
            listeners = config.listeners.len(),
            startup_ms = %phases,
            "redirector is steering"
        );
        Ok(agent)
    }
}

/// Decides what the start does with the pins: adopt them (reusing, migrating or creating each
/// map), remove stale ones no program uses, or refuse pins no release of the rule wrote. Nothing
/// that runs is changed here (but with `--replace`, which removes everything).
fn plan_pins(config: &Config, options: &StartOptions) -> Result<Plan, AgentError> {
    let pin_dir = &config.pin_dir;
    let plan = || datapath::pins::plan(pin_dir, config.reverse_nat_entries, options.layout_bump);
    let first = plan()?;
    match first.verdict() {
        Verdict::Empty => Ok(first),
        Verdict::Adopt if !options.replace => {
            let migrating = first.differences(false);
            info!(
                pin_dir = %pin_dir.display(),
                layout = first.layout,
                reused = first.count(|action| *action == MapAction::Reuse),
                migrated = first.count(|action| matches!(action, MapAction::Migrate { .. })),
                created = first.count(|action| *action == MapAction::Create),
                retired = first.unknown.len(),
                migrating = %migrating,
                "adopting the maps an earlier agent pinned"
            );
            Ok(first)
        }
        Verdict::Stale => {
            // No attachment uses them: nothing steers through these maps, so nothing is lost.
            warn!(pin_dir = %pin_dir.display(), layout = first.layout, "removing maps no program uses (an earlier start failed before it attached)");
            datapath::remove_pins(pin_dir)?;
            environment::prepare_pin_dir(pin_dir)?;
            Ok(plan()?)
        }
        _ if options.replace => {
            warn!(pin_dir = %pin_dir.display(), "removing every pinned program and map (--replace): DNS to the listeners passes unsteered until the new programs are attached");
            datapath::remove_pins(pin_dir)?;
            environment::prepare_pin_dir(pin_dir)?;
            Ok(plan()?)
        }
        _ => Err(AgentError::IncompatiblePins {
            pin_dir: pin_dir.clone(),
            found: first.layout,
            unreadable: first.differences(true),
        }),
    }
}

/// The map `REDIRECTOR_TEST_LAYOUT_BUMP` pins.
pub const NEXT_LAYOUT_MAP: &str = "NEXT_LAYOUT";

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener`, from the maps now pinned.
fn serve_telemetry(
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

/// Says, once per start, what the agent runs without on this kernel.
fn log_degraded(kernel: &KernelSupport) {
    for finding in kernel.degraded() {
        if let Need::Optional { without, .. } = finding.feature.need {
            warn!(
                release = %kernel.release,
                feature = finding.feature.name,
                since = %kernel_support::mainline(finding.feature.since),
                decided_by = ?finding.decided_by,
                "the kernel lacks an optional feature, so redirector runs degraded: {without}"
            );
        }
    }
}

/// Forwards the programs' log records into the agent's log, on a task of their own.
fn forward_kernel_log(
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

/// Installs the conntrack bypass table when configured (its failure is reported, never fatal)
/// and keeps it on a task of its own, so that a slow or hung nft never delays the control loop;
/// when not configured, removes one an earlier configuration left.
/// What a start that failed must take back: when nothing steered as it took the lock (a first
/// install, or after an uninstall), the nftables table and the listener addresses (or link) it
/// set up serve nobody, and a node whose agent never starts must not keep them.
#[derive(Debug, Default)]
struct FirstStart {
    nothing_steered: bool,
}

impl FirstStart {
    /// Removes the conntrack bypass table and what the agent owns of the listener link, if this
    /// start took the lock with nothing steering and nothing steers now. Under the lock again:
    /// another agent may have started meanwhile, and what it set up is left alone.
    async fn revert(&self, config: &Config) {
        if !self.nothing_steered {
            return;
        }
        let Ok(lock) = InstanceLock::acquire(&config.lock_file) else {
            return;
        };
        // Looked at under the lock: nothing may steer through what would be removed, neither from
        // this pin directory nor from another one on the same bpffs (a changed pin_dir's set).
        if datapath::has_pinned_attachments(&config.pin_dir)
            || !datapath::other_attached_sets(&config.pin_dir).is_empty()
        {
            return;
        }
        let worker = match NetnsWorker::start(config.cache_netns.as_deref()) {
            Ok(worker) => worker,
            Err(error) => {
                warn!(error = %crate::error_chain(&error), "cannot enter the caches' namespace to remove what this failed start set up; `redirector uninstall` removes it");
                return;
            }
        };
        if config.conntrack.bypass {
            match conntrack_bypass::remove(&Nft::new(&config.conntrack.nft, worker.clone())).await {
                Ok(()) => warn!("removed the conntrack bypass table of this failed start"),
                Err(error) if error.is_unavailable() => {}
                Err(error) => {
                    warn!(error = %crate::error_chain(&error), "cannot remove the conntrack bypass table of this failed start; `redirector uninstall` removes it");
                }
            }
        }
        let record = interface::record_path(&config.lock_file);
        if config.interface.manage || record.exists() {
            match interface::remove(&config.interface, &worker, &record).await {
                Ok(true) => {
                    warn!(link = %config.interface.name, "removed the listener addresses (or link) of this failed start")
                }
                Ok(false) => {}
                Err(error) => {
                    warn!(error = %crate::error_chain(&error), "cannot remove the listener addresses of this failed start; `redirector uninstall` removes them");
                }
            }
        }
        drop(lock);
    }
}

/// A task that ends with the start that spawned it, unless the start completes and keeps it.
#[derive(Debug)]
struct TaskGuard(Option<JoinHandle<()>>);

impl TaskGuard {
    fn keep(mut self) -> Option<JoinHandle<()>> {
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

async fn start_conntrack_bypass(
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

/// How long the control loop may go without a turn before `/healthz` fails: it turns at least
/// at every probe interval; allow three, and never less than ten seconds (a slow socket-table
/// dump or nft run is no stall).
fn health_window(config: &Config) -> std::time::Duration {
    (config.probe.interval * 3).max(std::time::Duration::from_secs(10))
}

/// The name of a pool source in logs and metrics.
fn source_name(source: &UpstreamSource) -> &'static str {
    match source {
        UpstreamSource::Static => sources::STATIC_SOURCE,
        UpstreamSource::Kubernetes { .. } => sources::SourceKind::Kubernetes.name(),
        UpstreamSource::ResolvConf(_) => sources::SourceKind::ResolvConf.name(),
    }
}

/// The configured pool of a static listener (`None` for dynamic sources).
fn static_pool(listener: &crate::config::Listener) -> Option<Vec<Upstream>> {
    (listener.source == UpstreamSource::Static).then(|| {
        listener
            .upstreams
            .iter()
            .copied()
            .map(Upstream::from)
            .collect()
    })
}

/// Makes each listener's prober (refusing a probe name that is no DNS name) and probes every
/// cache once, concurrently: whether each answered. Writes nothing.
async fn probe_caches(
    config: &Config,
    worker: &NetnsWorker,
) -> Result<(Vec<Prober>, Vec<bool>), AgentError> {
    let mut probers = Vec::with_capacity(config.listeners.len());
    for (position, listener) in config.listeners.iter().enumerate() {
        let prober = Prober::new(
            listener.cache,
            &listener.probe_name,
            config.probe.timeout,
            worker.clone(),
        )
        .map_err(|source| AgentError::ProbeName {
            key: format!("listener[{position}] ({:?}).probe_name", listener.name),
            name: listener.probe_name.clone(),
            source,
        })?;
        probers.push(prober);
    }
    let mut first_probes = tokio::task::JoinSet::new();
    for (index, prober) in probers.iter().enumerate() {
        let prober = prober.clone();
        first_probes.spawn(async move { (index, prober.probe().await) });
    }
    let mut alive = vec![false; probers.len()];
    while let Some(Ok((index, outcome))) = first_probes.join_next().await {
        alive[index] = outcome.is_alive();
    }
    Ok((probers, alive))
}

/// Sets the first verdicts from the first probes (`alive`, in the configuration's order): a
/// cache is up when it answered (and, when its sockets are tracked, has some).
fn first_verdicts(
    config: &Config,
    ids: &[u32],
    probers: Vec<Prober>,
    alive: &[bool],
    maps: &mut Maps,
) -> Result<Vec<ListenerRuntime>, AgentError> {
    let hysteresis = Hysteresis {
        failures_to_fail_over: config.probe.failures_to_fail_over,
        successes_to_fail_back: config.probe.successes_to_fail_back,
    };
    let mut listeners = Vec::with_capacity(config.listeners.len());
    for (((listener, id), prober), alive) in
        config.listeners.iter().zip(ids).zip(probers).zip(alive)
    {
        let counts = maps.socket_counts(*id)?;
        let held = health::held(
            &maps.cache_activity(*id)?,
            counts.down_epoch,
            health::monotonic_ns(),
            config.probe.signal_hold,
        );
        // A verdict an earlier agent pinned stands; a first one is up while the cache's sockets
        // exist (until it is written the listener gets no DNS to its cache). Either way this
        // probe is one more in the streak, never a verdict of its own.
        let tracker = HealthTracker::first(
            hysteresis,
            maps.health(*id)?,
            counts.down_epoch,
            listener.liveness == Liveness::Probes || counts.udp > 0,
            Probe::new(*alive, held),
        );
        maps.set_health(*id, tracker.health())?;
        listeners.push(ListenerRuntime {
            id: *id,
            name: listener.name.clone(),
            liveness: listener.liveness,
            prober,
            tracker,
            observed: (Route::Cache, Reason::Healthy),
            desired: static_pool(listener),
            source: source_name(&listener.source),
            synced: listener.source == UpstreamSource::Static,
        });
    }
    Ok(listeners)
}

/// What a start writes into the maps the running programs share, and the swap: the part of a
/// start that a failure must take back (`put_back`).
struct Commit<'a> {
    config: &'a Config,
    /// What the ids held before: a listener that is not what its id held starts clean.
    journal: &'a Journal,
    ids: &'a [u32],
    removed: &'a [u32],
    binds: &'a HashMap<redirector_common::binds::BindKey, u64>,
    netns_cookie: u64,
    layout_version: u32,
    skips: Vec<datapath::SkipEntry>,
    fail_before_attach: bool,
}

impl Commit<'_> {
    /// Writes every listener, counts the caches' sockets that existed before the programs, sets
    /// the first verdicts and swaps the programs in.
    #[expect(
        clippy::too_many_arguments,
        reason = "the start's parts that the commit borrows, each once"
    )]
    async fn run(
        self,
        datapath: &mut Datapath,
        maps: &mut Maps,
        reconciler: &mut Reconciler,
        probers: Vec<Prober>,
        alive: &[bool],
        cgroup: &Path,
        phases: &mut StartPhases,
    ) -> Result<Vec<ListenerRuntime>, AgentError> {
        let config = self.config;
        for id in self.removed {
            info!(listener_id = id, "removing a listener no longer configured");
            maps.remove_listener(*id)?;
        }
        maps.configure(&self.skips, self.netns_cookie, self.layout_version)?;
        maps.set_cache_binds(self.binds)?;
        for (listener, id) in config.listeners.iter().zip(self.ids) {
            let entry = ListenerEntry {
                id: *id,
                name: &listener.name,
                address: listener.address,
                cache: listener.cache,
                empty_pool: listener.empty_pool,
                liveness: listener.liveness,
            };
            let pool: Option<Vec<Target>> =
                static_pool(listener).map(|pool| pool.iter().map(Upstream::target).collect());
            let previous = self.journal.listener(*id);
            let other =
                previous.is_none_or(|(info, _)| info.name() != Some(listener.name.as_str()));
            let moved = previous.is_some_and(|(_, was)| {
                was.cache != datapath::target_of(listener.cache)
                    || was.liveness != listener.liveness.value()
            });
            maps.start_clean(*id, other, moved)?;
            maps.install_listener(&entry, pool.as_deref())?;
            maps.set_stall_limit(
                *id,
                config.probe.stall_after,
                datapath.tick_clock(),
                listener.cache.port(),
            )?;
        }
        maps.forget_unread_stamps();
        maps.want_next_reads()?;
        phases.end("maps");
        // Count the sockets that existed before the programs (or that moved between listeners)
        // before the programs see any traffic, so a running cache is alive from the first
        // steered syscall.
        reconciler
            .reconcile(maps, true)
            .await
            .map_err(AgentError::Seed)?;
        phases.end("seed");
        let listeners = first_verdicts(config, self.ids, probers, alive, maps)?;
        phases.end("verdicts");
        if self.fail_before_attach {
            return Err(AgentError::InjectedFailure);
        }
        datapath.attach(cgroup)?;
        Ok(listeners)
    }
}

/// Puts back what a failed start changed in the maps the running programs read, and counts the
/// caches' sockets by the binds it found. Says what it did: the programs that run now (the
/// earlier agent's, or this start's where the swap had begun) steer on that state.
async fn put_back(maps: &mut Maps, journal: &Journal, reconciler: &mut Reconciler) {
    if let Err(error) = maps.restore(journal) {
        warn!(error = %crate::error_chain(&error), "cannot put back the listeners, pools and verdicts this failed start changed; start the agent again (its next start writes them whole)");
        return;
    }
    reconciler.restore_binds(journal.cache_binds());
    match reconciler.reconcile(maps, true).await {
        Ok(_) => info!(
            "put back the listeners, pools, verdicts and socket counts this failed start changed"
        ),
        Err(error) => {
            warn!(error = %crate::error_chain(&error), "put back the listeners, pools and verdicts this failed start changed, but cannot re-count the caches' sockets; start the agent again")
        }
    }
}

/// A Kubernetes client when some listener follows kube-dns.
async fn kube_client(config: &Config) -> Result<Option<kube::Client>, AgentError> {
    let needed = config
        .listeners
        .iter()
        .any(|listener| matches!(listener.source, UpstreamSource::Kubernetes { .. }));
    if !needed {
        return Ok(None);
    }
    let kube_config = match &config.kubernetes.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                AgentError::Kubeconfig {
                    path: path.clone(),
                    source,
                }
            })?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|source| AgentError::Kubeconfig {
                path: path.clone(),
                source,
            })?
        }
        None => kube::Config::infer()
            .await
            .map_err(|error| AgentError::KubeConfig(kube::Error::InferConfig(error)))?,
    };
    let mut kube_config = kube_config;
    // The watcher retries with its own backoff and reports each failure, so an outage shows in
    // the log and the metrics at once; the client's own retries (up to 15, for minutes) would
    // hide it.
    kube_config.default_retry = false;
    kube::Client::try_from(kube_config)
        .map(Some)
        .map_err(AgentError::KubeConfig)
}

/// Starts one task per dynamic source (one watcher per Service, one per resolv.conf), each
/// feeding every listener that names it.
fn start_sources(
    config: &Config,
    ids: &[u32],
    kube_client: Option<kube::Client>,
) -> (mpsc::Receiver<SourceEvent>, Vec<JoinHandle<()>>) {
    let (sender, events) = mpsc::channel(1024);
    let listener_addresses: HashSet<IpAddr> = config
        .listeners
        .iter()
        .map(|listener| listener.address)
        .collect();
    let mut services: HashMap<(String, String), Vec<FedListener>> = HashMap::new();
    let mut files: HashMap<PathBuf, Vec<FedListener>> = HashMap::new();
    for (listener, id) in config.listeners.iter().zip(ids) {
        let fed = FedListener {
            id: *id,
            address: listener.address,
        };
        match &listener.source {
            UpstreamSource::Static => {}
            UpstreamSource::Kubernetes { namespace, service } => services
                .entry((namespace.clone(), service.clone()))
                .or_default()
                .push(fed),
            UpstreamSource::ResolvConf(path) => files.entry(path.clone()).or_default().push(fed),
        }
    }
    let mut tasks = Vec::new();
    if let Some(client) = kube_client {
        for ((namespace, service), fed) in services {
            tasks.push(tokio::spawn(sources::kubernetes::watch(
                client.clone(),
                namespace,
                service,
                fed,
                listener_addresses.clone(),
                config.kubernetes.resync_interval,
                sender.clone(),
            )));
        }
    }
    for (path, fed) in files {
        tasks.push(tokio::spawn(sources::resolv_conf::watch(
            path,
            fed,
            listener_addresses.clone(),
            sender.clone(),
        )));
    }
    (events, tasks)
}
