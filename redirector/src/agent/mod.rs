//! The agent: turns a validated configuration into attached programs and filled maps, keeps the
//! kernel's view of each cache true (probes, socket-count reconciliation), and takes it all down
//! again on request.
//!
//! Everything that can be refused is checked before the first map is written: the attach cgroup,
//! every skipped cgroup, the pin directory, the caches' network namespace.

mod controller;
mod stats;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use redirector_common::{
    datapath::{MAX_CGROUP_LEVEL, listener_bit},
    listener::{LIVENESS_PROBES, LIVENESS_SOCKETS_AND_PROBES, Reason, Route, explain},
};
pub use stats::{AgentStats, Transition};
use tracing::{info, warn};

use crate::{
    cgroup::{self, Cgroup, CgroupError},
    config::{Config, EmptyPoolPolicy, Liveness},
    datapath::{self, Datapath, DatapathError, ListenerEntry, Maps, SkipEntry},
    liveness::{
        binds::{TrackedCache, cache_binds},
        health::{HealthTracker, Hysteresis},
        probe::Prober,
        reconcile::{ReconcileError, Reconciler},
        sockdiag::{SockDiagError, SocketTable},
    },
    netns::{self, NetnsError, NetnsWorker},
};

/// Why the agent could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A cgroup in the configuration is unusable.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A skipped cgroup too deep for the level mask.
    #[error("{key}: {path} is {level} levels deep; skipped cgroups must be at most {max} levels below the root", max = MAX_CGROUP_LEVEL)]
    CgroupTooDeep {
        /// The configuration key.
        key: String,
        /// The directory.
        path: PathBuf,
        /// Its level.
        level: u32,
    },
    /// The pin directory is not on a bpf filesystem.
    #[error(
        "{dir} is not on a bpf filesystem, so the maps cannot be pinned there; mount one with \
         `mount -t bpf bpf {mount}`, or set pin_dir to a directory on one"
    )]
    NoBpffs {
        /// The directory checked.
        dir: PathBuf,
        /// Where to mount bpffs.
        mount: PathBuf,
    },
    /// The pin directory could not be inspected or created.
    #[error("cannot prepare the pin directory {dir}")]
    PinDir {
        /// The directory.
        dir: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The caches' network namespace is unusable.
    #[error("cache_netns: the caches' network namespace cannot be used")]
    CacheNetns(#[source] NetnsError),
    /// The socket tables cannot be opened.
    #[error("opening the caches' socket tables failed")]
    SocketTable(#[source] SockDiagError),
    /// Seeding the socket counts failed.
    #[error("seeding the caches' socket counts failed")]
    Seed(#[source] ReconcileError),
    /// A probe name hickory refuses.
    #[error("{key}: {name:?} is not a DNS name hickory accepts")]
    ProbeName {
        /// The configuration key.
        key: String,
        /// The name.
        name: String,
        /// What hickory said.
        #[source]
        source: hickory_proto::ProtoError,
    },
    /// Loading, attaching or filling the datapath failed.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
}

/// One configured listener, as the agent tracks it.
#[derive(Debug)]
struct ListenerRuntime {
    id: u32,
    name: String,
    liveness: Liveness,
    prober: Prober,
    tracker: HealthTracker,
    observed: (Route, Reason),
}

/// A running agent: programs attached (and pinned), maps filled and pinned.
#[derive(Debug)]
pub struct Agent {
    datapath: Datapath,
    maps: Maps,
    reconciler: Reconciler,
    listeners: Vec<ListenerRuntime>,
    config: Config,
    stats: Arc<AgentStats>,
}

impl Agent {
    /// Checks the environment against `config`, loads the datapath, fills its maps, seeds the
    /// caches' socket counts, probes every cache once and attaches. Nothing is attached unless
    /// every check passed.
    pub async fn start(config: &Config) -> Result<Self, AgentError> {
        let attach_path = match &config.cgroup {
            Some(path) => path.clone(),
            None => cgroup::default_attach_cgroup()?,
        };
        let attach = Cgroup::resolve("cgroup", &attach_path)?;
        let skips = skip_entries(config, &attach)?;
        prepare_pin_dir(&config.pin_dir)?;
        let netns = config.cache_netns.as_deref();
        let netns_cookie = netns::cookie(netns).map_err(AgentError::CacheNetns)?;
        let worker = NetnsWorker::start(netns).map_err(AgentError::CacheNetns)?;
        let socket_table = SocketTable::open(netns).map_err(AgentError::SocketTable)?;
        let hysteresis = Hysteresis {
            failures_to_fail_over: config.probe.failures_to_fail_over,
            successes_to_fail_back: config.probe.successes_to_fail_back,
        };
        let mut probers = Vec::with_capacity(config.listeners.len());
        for (id, listener) in config.listeners.iter().enumerate() {
            let prober = Prober::new(
                listener.cache,
                &listener.probe_name,
                config.probe.timeout,
                worker.clone(),
            )
            .map_err(|source| AgentError::ProbeName {
                key: format!("listener[{id}] ({:?}).probe_name", listener.name),
                name: listener.probe_name.clone(),
                source,
            })?;
            probers.push(prober);
        }

        if datapath::has_pinned_attachments(&config.pin_dir) {
            warn!(
                pin_dir = %config.pin_dir.display(),
                "an earlier agent left its programs attached; replacing them"
            );
        }
        let (mut datapath, mut maps) = Datapath::load(config.reverse_nat_entries, &config.pin_dir)?;
        maps.configure(&skips, netns_cookie)?;
        let tracked: Vec<TrackedCache> = config
            .listeners
            .iter()
            .enumerate()
            .filter(|(_, listener)| listener.liveness == Liveness::SocketsAndProbes)
            .map(|(id, listener)| TrackedCache {
                id: id as u32,
                cache: listener.cache,
            })
            .collect();
        let binds = cache_binds(&tracked);
        maps.set_cache_binds(&binds)?;
        for (id, listener) in config.listeners.iter().enumerate() {
            let entry = ListenerEntry {
                id: id as u32,
                name: &listener.name,
                address: listener.address,
                cache: listener.cache,
                empty_pool: listener.empty_pool,
                liveness: listener.liveness,
            };
            maps.install_listener(&entry, &listener.upstreams)?;
        }

        // Seed the counts from the socket tables before the programs see any traffic, so a
        // cache that started before the agent is alive from the first steered syscall.
        let mut reconciler = Reconciler::new(socket_table, binds);
        reconciler
            .reconcile(&mut maps, true)
            .await
            .map_err(AgentError::Seed)?;
        // One probe of every cache before any DNS is steered: the first verdict is a real one.
        let mut first_probes = tokio::task::JoinSet::new();
        for (index, prober) in probers.iter().enumerate() {
            let prober = prober.clone();
            first_probes.spawn(async move { (index, prober.probe().await) });
        }
        let mut alive = vec![false; probers.len()];
        while let Some(Ok((index, outcome))) = first_probes.join_next().await {
            alive[index] = outcome.is_alive();
        }
        let mut listeners = Vec::with_capacity(config.listeners.len());
        for ((id, listener), prober) in config.listeners.iter().enumerate().zip(probers) {
            let counts = maps.socket_counts(id as u32)?;
            let up = alive[id] && (listener.liveness == Liveness::Probes || counts.udp > 0);
            let id = id as u32;
            let tracker = HealthTracker::new(hysteresis, up, counts.down_epoch);
            maps.set_health(id, tracker.health())?;
            listeners.push(ListenerRuntime {
                id,
                name: listener.name.clone(),
                liveness: listener.liveness,
                prober,
                tracker,
                observed: (Route::Cache, Reason::Healthy),
            });
        }

        datapath.attach(&attach.path)?;
        // Binds and releases that raced the attach are caught here, or by the next pass.
        if let Err(error) = reconciler.reconcile(&mut maps, true).await {
            warn!(error = %error, "re-counting the caches' sockets after attaching failed; the next pass retries");
        }

        let mut agent = Self {
            datapath,
            maps,
            reconciler,
            listeners,
            config: config.clone(),
            stats: Arc::new(AgentStats::default()),
        };
        for (listener, runtime) in config.listeners.iter().zip(agent.listeners.iter_mut()) {
            runtime.observed = current_route(&agent.maps, runtime.id, runtime.liveness)?;
            let counts = agent.maps.socket_counts(runtime.id)?;
            let upstreams: Vec<String> =
                listener.upstreams.iter().map(ToString::to_string).collect();
            info!(
                listener = %listener.name,
                address = %listener.address,
                cache = %listener.cache,
                upstreams = %upstreams.join(","),
                empty_pool = match listener.empty_pool {
                    EmptyPoolPolicy::Pass => "pass",
                    EmptyPoolPolicy::Fail => "fail",
                },
                liveness = ?listener.liveness,
                cache_udp_sockets = counts.udp,
                cache_tcp_sockets = counts.tcp,
                route = ?runtime.observed.0,
                reason = ?runtime.observed.1,
                "steering DNS for listener"
            );
        }
        info!(
            cgroup = %attach.path.display(),
            pin_dir = %config.pin_dir.display(),
            listeners = config.listeners.len(),
            "redirector is steering"
        );
        Ok(agent)
    }

    /// The maps, for reading counters and state.
    #[must_use]
    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// The maps, for changing state and pools.
    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// What the agent observed.
    #[must_use]
    pub fn stats(&self) -> Arc<AgentStats> {
        Arc::clone(&self.stats)
    }

    /// The cgroup the programs are attached to.
    #[must_use]
    pub fn cgroup(&self) -> Option<&Path> {
        self.datapath.attached_to()
    }

    /// Detaches the programs and removes the pins.
    pub fn stop(self) -> Result<(), AgentError> {
        let Self { datapath, maps, .. } = self;
        drop(maps);
        datapath.detach()?;
        info!("programs detached, pins removed");
        Ok(())
    }
}

/// The route the kernel takes for listener `id` now, and why: the same truth table, on the same
/// map values.
fn current_route(maps: &Maps, id: u32, liveness: Liveness) -> Result<(Route, Reason), AgentError> {
    let liveness = match liveness {
        Liveness::SocketsAndProbes => LIVENESS_SOCKETS_AND_PROBES,
        Liveness::Probes => LIVENESS_PROBES,
    };
    Ok(explain(
        liveness,
        &maps.mode(id)?,
        &maps.health(id)?,
        &maps.socket_counts(id)?,
    ))
}

/// The skipped cgroups of every listener, one entry per cgroup with the bits of every listener
/// that skips it; plus the agent's own cgroup, for every listener, when it sits below the attach
/// point (its probes must never be steered).
fn skip_entries(config: &Config, attach: &Cgroup) -> Result<Vec<SkipEntry>, AgentError> {
    let mut entries: Vec<SkipEntry> = Vec::new();
    let mut add = |cgroup: &Cgroup, bits: u64, key: &str| -> Result<(), AgentError> {
        if cgroup.level > MAX_CGROUP_LEVEL {
            return Err(AgentError::CgroupTooDeep {
                key: key.to_owned(),
                path: cgroup.path.clone(),
                level: cgroup.level,
            });
        }
        match entries.iter_mut().find(|entry| entry.id == cgroup.id) {
            Some(entry) => entry.listeners |= bits,
            None => entries.push(SkipEntry {
                id: cgroup.id,
                level: cgroup.level,
                listeners: bits,
            }),
        }
        Ok(())
    };
    for (id, listener) in config.listeners.iter().enumerate() {
        for (index, path) in listener.skip_cgroups.iter().enumerate() {
            let key = format!("listener[{id}] ({:?}).skip_cgroups[{index}]", listener.name);
            let cgroup = Cgroup::resolve(&key, path)?;
            add(&cgroup, listener_bit(id as u32), &key)?;
        }
    }
    match cgroup::own_cgroup() {
        Ok(own) if own.path.starts_with(&attach.path) && own.level > attach.level => {
            let every_listener =
                (0..config.listeners.len() as u32).fold(0, |bits, id| bits | listener_bit(id));
            add(&own, every_listener, "the agent's own cgroup")?;
        }
        Ok(own) if own.path == attach.path => warn!(
            cgroup = %own.path.display(),
            "the agent runs in the cgroup the programs attach to: its probes to a cache on a \
             listener address are steered like any client's; run it in a cgroup of its own \
             (a systemd service or a pod is one)"
        ),
        Ok(_) => {}
        Err(error) => warn!(error = %error, "cannot find the agent's own cgroup"),
    }
    Ok(entries)
}

/// Creates the pin directory on a bpf filesystem, or says how to get one.
fn prepare_pin_dir(pin_dir: &Path) -> Result<(), AgentError> {
    // The deepest existing ancestor tells which filesystem the directory would be on.
    let existing = pin_dir
        .ancestors()
        .find(|dir| dir.exists())
        .unwrap_or_else(|| Path::new("/"));
    let on_bpffs = nix::sys::statfs::statfs(existing)
        .map(|stat| stat.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
        .unwrap_or(false);
    if !on_bpffs {
        return Err(AgentError::NoBpffs {
            dir: pin_dir.to_owned(),
            mount: if existing == Path::new("/") || existing == Path::new("/sys/fs") {
                PathBuf::from("/sys/fs/bpf")
            } else {
                existing.to_owned()
            },
        });
    }
    std::fs::create_dir_all(pin_dir).map_err(|source| AgentError::PinDir {
        dir: pin_dir.to_owned(),
        source,
    })
}
