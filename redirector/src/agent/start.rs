//! An agent's start, phase by phase: check the environment (capabilities, the kernel, the cgroups,
//! the pin directory, the lock), plan what to do with the pins, load and verify the object and
//! migrate what changed beside the running set, own the listener interface and the conntrack
//! bypass, fill the maps, count the caches' sockets and probe them, bind the metrics port, and
//! only then swap the programs in and start following the sources. Every phase before the swap
//! can fail and leave what runs untouched; each is timed (`StartPhases`) and logged with
//! "redirector is steering".
//!
//! Here the sequence; in the modules below the phases' timing (`phases`), the plan for the pins
//! (`pins`), what runs beside the steering (`services`: the conntrack bypass, the telemetry
//! endpoint, the kernel log), the first probes and verdicts (`verdicts`), the commit into the
//! shared maps and its undoing (`commit`), what a failed first start takes back (`revert`), and
//! the watchers of the upstream sources (`watchers`).

use std::{net::IpAddr, sync::Arc};

use redirector_common::settings::Liveness;
use tracing::{info, warn};

use super::{Agent, AgentError, StartOptions, drain_socket, environment, ids, namespace_identity};
use crate::{
    config::Config,
    datapath::{self, Datapath, LoadOptions},
    liveness::{
        binds::{TrackedCache, cache_binds},
        reconcile::Reconciler,
        sockdiag::SocketTable,
        upstreams::UpstreamChecks,
    },
    sources,
    sys::{
        cgroup::{self, Cgroup},
        interface,
        kernel_support::{self, KernelSupport, Need},
        lock::InstanceLock,
        netns::{self, NetnsError, NetnsWorker},
    },
    telemetry::{self, stats::AgentStats},
};

mod commit;
mod phases;
mod pins;
mod revert;
mod services;
mod verdicts;
mod watchers;
mod workload_readings;

use commit::{Commit, put_back};
use phases::StartPhases;
pub use pins::NEXT_LAYOUT_MAP;
use pins::plan_pins;
use revert::FirstStart;
use services::{TaskGuard, forward_kernel_log, serve_telemetry, start_conntrack_bypass};
use verdicts::probe_caches;
use watchers::{kube_client, start_sources};
use workload_readings::read_workloads;

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
                sizes: pins::map_sizes(config),
                workloads: config.workloads.accounting,
                rate_limit_ns: config.workloads.rate_limit.map(|limit| limit.schedule_ns()),
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
        let skips = environment::skip_entries(&skip_cgroups, &ids, &attach);
        let exempt = environment::exempt_entries(config, &skips, &attach)?;
        let commit = Commit {
            config,
            journal: &journal,
            ids: &ids,
            removed: &removed,
            binds: &binds,
            netns_cookie,
            layout_version: redirector_common::LAYOUT_VERSION + u32::from(options.layout_bump),
            exempt: exempt.clone(),
            skips,
            fail_before_attach: options.fail_before_attach,
        };
        let committed = match commit
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
            Ok(committed) => committed,
            Err(error) => {
                put_back(&mut maps, &journal, &mut reconciler).await;
                return Err(error);
            }
        };
        for listener in &committed.listeners {
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
        let workload_readings = read_workloads(
            config,
            &stats,
            attach.clone(),
            exempt,
            committed.exempt_changed,
            kube_client.clone(),
            &node,
            node_events
                .as_ref()
                .map(telemetry::node_events::NodeEvents::queue),
        );
        let (events, sources) = start_sources(config, &ids, kube_client);
        let mut agent = Self {
            datapath,
            maps,
            reconciler,
            listeners: committed.listeners,
            config: config.clone(),
            stats,
            events,
            sources,
            bypass: bypass.keep(),
            workload_readings,
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
