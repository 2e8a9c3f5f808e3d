//! The agent: turns a validated configuration into attached programs and filled maps (adopting
//! what an earlier agent pinned), keeps the kernel's view of the world true (probes, socket
//! counts, upstream pools from Kubernetes and resolv.conf), and leaves everything in place when it
//! stops: steering and in-kernel failover never depend on its process.
//!
//! Everything that can be refused is checked before the first map is written: the kernel's
//! release, the attach cgroup, every skipped cgroup, the pin directory and its layout, the lock,
//! the caches' namespace.

mod controller;
mod drain_socket;
mod environment;
mod ids;
mod start;
mod uninstall;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use redirector_common::{
    listener::{Reason, Route},
    settings::Liveness,
};
pub use start::NEXT_LAYOUT_MAP;
use tokio::{sync::mpsc, task::JoinHandle};
use tracing::{info, warn};
pub use uninstall::{UninstallReport, uninstall};

use crate::{
    config::{Config, UpstreamSource},
    conntrack_bypass::nft::NftError,
    datapath::{Datapath, DatapathError, Maps},
    liveness::{
        health::HealthTracker,
        probe::Prober,
        reconcile::{ReconcileError, Reconciler},
        sockdiag::SockDiagError,
    },
    sources::{SourceEvent, Upstream},
    sys::{
        cgroup::CgroupError,
        interface::InterfaceError,
        kernel_support::KernelLacks,
        lock::{InstanceLock, LockError},
        netns::NetnsError,
    },
    telemetry::{self, stats::AgentStats},
};

/// Why the agent could not start or stop cleanly. `key` is the configuration key the message
/// names, `path`, `dir` and `pin_dir` the file or directory it names.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A failure a test asked for (`REDIRECTOR_TEST_FAIL_BEFORE_ATTACH`).
    #[error(
        "failing the start after its maps were written, before the swap, as \
         REDIRECTOR_TEST_FAIL_BEFORE_ATTACH asks (tests only)"
    )]
    InjectedFailure,
    /// The kernel lacks a feature the programs need.
    #[error(transparent)]
    KernelLacks(#[from] KernelLacks),
    /// The process lacks capabilities its configuration needs.
    #[error(
        "the agent lacks {missing}: grant them (systemd: CapabilityBoundingSet= and \
         AmbientCapabilities= in the unit; Kubernetes: the container's \
         securityContext.capabilities.add), or run it as root with every capability",
        missing = Unmet(unmet)
    )]
    MissingCapabilities {
        /// What is missing, and what for.
        unmet: Vec<crate::sys::capabilities::Need>,
    },
    /// bpf(2) is refused to a process that holds the capabilities.
    #[error(transparent)]
    BpfRefused(#[from] crate::sys::capabilities::BpfRefused),
    /// A cgroup in the configuration is unusable.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A skipped cgroup too deep for the level mask.
    #[error("{key}: {path} is {level} levels deep; skipped cgroups must be at most {max} levels below the root", max = redirector_common::datapath::MAX_CGROUP_LEVEL)]
    CgroupTooDeep {
        key: String,
        path: PathBuf,
        /// Its level.
        level: u32,
    },
    /// An exempt cgroup that holds the attach cgroup: every workload would be exempt.
    #[error(
        "{key}: {path} holds the cgroup the programs attach to ({attach}), so no workload's DNS          would be counted; list the cgroups of the caches or services to leave out instead, or          set workloads.accounting = false"
    )]
    ExemptsEverything {
        key: String,
        path: PathBuf,
        /// The attach cgroup.
        attach: PathBuf,
    },
    /// The pin directory is not on a bpf filesystem.
    #[error(
        "{dir} is not on a bpf filesystem, so the maps cannot be pinned there; mount one with \
         `mount -t bpf bpf {mount}`, or set pin_dir to a directory on one"
    )]
    NoBpffs {
        dir: PathBuf,
        /// Where to mount bpffs.
        mount: PathBuf,
    },
    /// The pin directory could not be inspected or created.
    #[error("cannot prepare the pin directory {dir}")]
    PinDir {
        dir: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Programs run on pins this release cannot adopt: a layout from before the compatibility
    /// rule, or maps that break it.
    #[error(
        "{pin_dir} holds the maps of a redirector release this one cannot adopt (layout \
         {found}{unreadable}; this release adopts layout {min} and later, older or newer); DNS is \
         still steered by the programs attached on them. Upgrade first to a release of layout \
         {min} (which adopts these), or reset with `redirector run --replace` (DNS to the \
         listeners passes unsteered for a moment while the programs are replaced)",
        found = found.map_or_else(|| "unreadable".to_owned(), |version| version.to_string()),
        unreadable = if unreadable.is_empty() { String::new() } else { format!("; {unreadable}") },
        min = crate::datapath::layout::MIN_ADOPTABLE_LAYOUT
    )]
    IncompatiblePins {
        pin_dir: PathBuf,
        /// The pins' layout version (`None`: none could be read).
        found: Option<u32>,
        /// Maps that differ in more than their size, and how.
        unreadable: String,
    },
    /// Another agent runs.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The caches' network namespace is unusable.
    #[error("cache_netns: the caches' network namespace cannot be used")]
    CacheNetns(#[source] NetnsError),
    /// The caches' network namespace was replaced under the agent.
    #[error(
        "cache_netns: {path} is now another network namespace than the one this agent started in \
         (it was deleted and created again, with a new cache in it); exiting so that the \
         supervisor (systemd, the kubelet) restarts the agent into it, which adopts the pins \
         hitlessly. Steering goes on in the kernel meanwhile; run the agent again if nothing \
         restarts it"
    )]
    CacheNetnsReplaced {
        /// The namespace's path.
        path: PathBuf,
    },
    /// The socket tables cannot be opened.
    #[error("opening the caches' socket tables failed")]
    SocketTable(#[source] SockDiagError),
    /// The thread loading the datapath died.
    #[error("loading the datapath failed: its thread died")]
    LoadTask(#[source] tokio::task::JoinError),
    /// Seeding the socket counts failed.
    #[error("seeding the caches' socket counts failed")]
    Seed(#[source] ReconcileError),
    /// A probe name hickory refuses.
    #[error("{key}: {name:?} is not a DNS name hickory accepts")]
    ProbeName {
        key: String,
        name: String,
        /// What hickory said.
        #[source]
        source: hickory_proto::ProtoError,
    },
    /// The listener interface could not be set up.
    #[error(transparent)]
    Interface(#[from] InterfaceError),
    /// No Kubernetes client could be made.
    #[error(
        "cannot reach Kubernetes for the kube_dns listeners: no in-cluster configuration and no \
         usable kubeconfig (set kubernetes.kubeconfig)"
    )]
    KubeConfig(#[source] kube::Error),
    /// The given kubeconfig is unusable.
    #[error("kubernetes.kubeconfig: cannot use {path}")]
    Kubeconfig {
        path: PathBuf,
        /// What kube-rs said.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// Loading, attaching or filling the datapath failed.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    /// The programs' log could not be watched.
    #[error("cannot watch the programs' log records (kernel_log); run without kernel_log")]
    KernelLog {
        /// What tokio said.
        #[source]
        source: std::io::Error,
    },
    /// The metrics endpoint could not be opened.
    #[error(transparent)]
    Telemetry(#[from] telemetry::http::BindError),
    /// The drain socket could not be made.
    #[error(
        "cannot serve drains on {path}; fix the directory's permissions, set drain_socket to \
         another path, or to \"\" to serve none"
    )]
    DrainSocket {
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The conntrack bypass table could not be removed.
    #[error(
        "removing the nftables table inet redirector failed; remove it with `nft delete table inet redirector`"
    )]
    ConntrackBypass {
        /// What nft said.
        #[source]
        source: NftError,
    },
}

/// Unmet capability needs, for the error.
struct Unmet<'a>(&'a [crate::sys::capabilities::Need]);

impl std::fmt::Display for Unmet<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (position, need) in self.0.iter().enumerate() {
            let separator = if position == 0 { "" } else { ", " };
            write!(f, "{separator}{need}")?;
        }
        Ok(())
    }
}

/// How the agent starts.
#[derive(Clone, Debug, Default)]
pub struct StartOptions {
    /// Remove every pin before loading (an operator's explicit reset) instead of adopting them.
    pub replace: bool,
    /// Start as a release whose layout differs (tests only): every map that can migrate does,
    /// the pins record `LAYOUT_VERSION + 1`, and a map this release does not know is pinned.
    pub layout_bump: bool,
    /// Fail after the load and the migration, before anything runs (tests only).
    pub fail_after_load: bool,
    /// Fail after the maps the running programs share were written, before the swap (tests
    /// only): what a failed start puts back.
    pub fail_before_attach: bool,
    /// Kernel features to take as absent whatever the probes say (`kernel_support`'s ids;
    /// `REDIRECTOR_TEST_ABSENT_FEATURES`): for tests of the degraded paths only.
    pub absent_features: Vec<&'static str>,
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
    /// The pool the configuration or a source wants (`None`: a source has not spoken yet).
    desired: Option<Vec<Upstream>>,
    /// Where the pool comes from (`static`, `kubernetes`, `resolv.conf`).
    source: &'static str,
    /// The pool was synced into the kernel at least once (static pools: at start).
    synced: bool,
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
    events: mpsc::Receiver<SourceEvent>,
    sources: Vec<JoinHandle<()>>,
    /// The task keeping the conntrack bypass table (`None` when `conntrack.bypass` is off).
    bypass: Option<JoinHandle<()>>,
    /// The task reading the workloads' DNS (`None` when `workloads.accounting` is off).
    workload_readings: Option<JoinHandle<()>>,
    /// The task serving the drain socket (`None` when `drain_socket` is off).
    drains: Option<JoinHandle<()>>,
    /// The metrics and health endpoint: its address and server.
    telemetry: Option<(SocketAddr, telemetry::http::Server)>,
    lock: InstanceLock,
    /// This node's name: picks its subset of a pool too large for the kernel.
    node: String,
    /// The caches' namespace file and its identity (device and inode) at start: every socket
    /// count, probe and the listener interface are bound to that namespace.
    cache_netns: Option<(PathBuf, (u64, u64))>,
    /// Events on this node's Node when a route changes (with a Kubernetes client only).
    node_events: Option<telemetry::node_events::NodeEvents>,
    /// The verdicts of the checks of every listener's upstream targets.
    upstream_checks: crate::liveness::upstreams::UpstreamChecks,
}

impl Agent {
    fn log_listeners(&mut self) -> Result<(), AgentError> {
        for (listener, runtime) in self.config.listeners.iter().zip(self.listeners.iter_mut()) {
            runtime.observed = current_route(&self.maps, runtime.id, runtime.liveness)?;
            self.stats
                .record_initial_route(&runtime.name, runtime.observed.0);
            let counts = self.maps.socket_counts(runtime.id)?;
            let upstreams = match &listener.source {
                UpstreamSource::Static => listener
                    .upstreams
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                UpstreamSource::Kubernetes { namespace, service } => {
                    format!("EndpointSlices of {namespace}/{service}")
                }
                UpstreamSource::ResolvConf(path) => format!("nameservers of {}", path.display()),
            };
            info!(
                listener = %listener.name,
                id = runtime.id,
                address = %listener.address,
                cache = %listener.cache,
                upstreams = %upstreams,
                empty_pool = listener.empty_pool.label(),
                liveness = listener.liveness.label(),
                cache_udp_sockets = counts.udp,
                cache_tcp_sockets = counts.tcp,
                route = ?runtime.observed.0,
                reason = ?runtime.observed.1,
                "steering DNS for listener"
            );
        }
        Ok(())
    }

    /// The maps, for reading counters and state.
    #[must_use]
    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// What the agent observed.
    #[must_use]
    pub fn stats(&self) -> Arc<AgentStats> {
        Arc::clone(&self.stats)
    }

    /// Where `/metrics`, `/healthz` and `/readyz` are served (`None`: disabled).
    #[must_use]
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.telemetry.as_ref().map(|(address, _)| *address)
    }

    /// The cgroup the programs are attached to.
    #[must_use]
    pub fn cgroup(&self) -> Option<&Path> {
        self.datapath.attached_to()
    }

    /// Stops the agent and leaves the datapath in place: the pinned programs keep steering and
    /// failing over (a hung cache whose reads they cannot see is not noticed without the agent's
    /// probes). `uninstall` removes everything.
    pub fn shutdown(self) {
        if let Err(error) = crate::sys::sd_notify::notify("STOPPING=1") {
            warn!(error = %error, "cannot tell systemd the agent is stopping");
        }
        for source in &self.sources {
            source.abort();
        }
        if let Some(keeper) = &self.bypass {
            keeper.abort();
        }
        if let Some(readings) = &self.workload_readings {
            readings.abort();
        }
        if let Some(drains) = &self.drains {
            drains.abort();
        }
        if let Some(node_events) = &self.node_events {
            node_events.stop();
        }
        info!(
            pin_dir = %self.config.pin_dir.display(),
            lock = %self.lock.path().display(),
            "agent stopped; steering and in-kernel failover stay in place (`redirector uninstall` removes them)"
        );
    }
}

/// The identity of the namespace file at `path`: its device and inode (nsfs gives every
/// namespace its own inode).
fn namespace_identity(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let metadata = std::fs::metadata(path)?;
    Ok((metadata.dev(), metadata.ino()))
}

/// The route the kernel takes for listener `id` now, and why: the same truth table, on the same
/// map values.
fn current_route(maps: &Maps, id: u32, liveness: Liveness) -> Result<(Route, Reason), AgentError> {
    Ok(maps.route(id, liveness.value())?)
}
