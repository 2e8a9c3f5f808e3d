//! The commit: what a start writes into the maps the running programs share, then the swap; and
//! what a failure puts back.

use std::{collections::HashMap, path::Path};

use redirector_common::pool::Target;
use tracing::{info, warn};

use super::{
    phases::StartPhases,
    verdicts::{first_verdicts, static_pool},
};
use crate::{
    agent::{AgentError, ListenerRuntime, environment},
    config::Config,
    datapath::{self, Datapath, Journal, ListenerEntry, Maps},
    liveness::{cache_tasks, probe::Prober, reconcile::Reconciler},
    sources::Upstream,
};

/// What a start writes into the maps the running programs share, and the swap: the part of a
/// start that a failure must take back (`put_back`).
pub(super) struct Commit<'a> {
    pub(super) config: &'a Config,
    /// What the ids held before: a listener that is not what its id held starts clean.
    pub(super) journal: &'a Journal,
    pub(super) ids: &'a [u32],
    pub(super) removed: &'a [u32],
    pub(super) binds: &'a HashMap<redirector_common::binds::BindKey, u64>,
    pub(super) netns_cookie: u64,
    pub(super) layout_version: u32,
    pub(super) skips: Vec<datapath::SkipEntry>,
    pub(super) exempt: Vec<datapath::ExemptEntry>,
    pub(super) fail_before_attach: bool,
}

/// What a commit leaves to the running agent.
pub(super) struct Committed {
    pub(super) listeners: Vec<ListenerRuntime>,
    /// The exempt cgroups the commit changed (`ExemptWrite::changed`): the workload readings
    /// forget the counted cgroups they concern once they have read their counts.
    pub(super) exempt_changed: Vec<u64>,
}

impl Commit<'_> {
    /// Writes every listener, counts the caches' sockets that existed before the programs, sets
    /// the first verdicts and swaps the programs in.
    #[expect(
        clippy::too_many_arguments,
        reason = "the start's parts that the commit borrows, each once"
    )]
    pub(super) async fn run(
        self,
        datapath: &mut Datapath,
        maps: &mut Maps,
        reconciler: &mut Reconciler,
        probers: Vec<Prober>,
        alive: &[bool],
        cgroup: &Path,
        phases: &mut StartPhases,
    ) -> Result<Committed, AgentError> {
        let config = self.config;
        for id in self.removed {
            info!(listener_id = id, "removing a listener no longer configured");
            maps.remove_listener(*id)?;
        }
        maps.configure(&self.skips, self.netns_cookie, self.layout_version)?;
        // The caches that live: however many came and went before this start (each restart of
        // a kubelet's container is a new cgroup), the record and the exempt set hold those only.
        let gone = cache_tasks::forget_gone(maps).await?;
        if gone > 0 {
            info!(
                processes = gone,
                "forgot the processes known as caches whose cgroups are gone"
            );
        }
        let exempt = environment::with_caches(&self.exempt, maps, |_| true);
        let written = maps.set_exempt_cgroups(&exempt)?;
        environment::tell_overflow(written.left_out);
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
        Ok(Committed {
            listeners,
            exempt_changed: written.changed,
        })
    }
}

/// Puts back what a failed start changed in the maps the running programs read, and counts the
/// caches' sockets by the binds it found. Says what it did: the programs that run now (the
/// earlier agent's, or this start's where the swap had begun) steer on that state.
pub(super) async fn put_back(maps: &mut Maps, journal: &Journal, reconciler: &mut Reconciler) {
    if let Err(error) = maps.restore(journal) {
        warn!(error = %crate::error_chain(&error), "cannot put back the listeners, pools and verdicts this failed start changed; start the agent again (its next start writes them whole)");
        return;
    }
    // The record of the caches came back whole: those gone since go again.
    if let Err(error) = cache_tasks::forget_gone(maps).await {
        warn!(error = %crate::error_chain(&error), "cannot forget the processes known as caches whose cgroups are gone; the next start does");
    }
    reconciler.restore_binds(journal.cache_binds());
    match reconciler.reconcile(maps, true).await {
        Ok(_) => info!(
            "put back the listeners, pools, verdicts, drains, caches, exempt cgroups and socket counts this failed start changed"
        ),
        Err(error) => {
            warn!(error = %crate::error_chain(&error), "put back the listeners, pools and verdicts this failed start changed, but cannot re-count the caches' sockets; start the agent again")
        }
    }
}
