//! A sandbox with servers and a running agent (in-process, its control loop on a thread of its
//! own), for the steering and failover tests.

use std::{net::SocketAddr, sync::Arc, thread::JoinHandle, time::Duration};

use anyhow::Context as _;
use redirector::{
    agent::{Agent, StartOptions, uninstall},
    config::Config,
    datapath::Maps,
    sources::Upstream,
    telemetry::stats::AgentStats,
};
use redirector_common::{
    counters::ListenerCounters,
    listener::SocketCounts,
    pool::Target,
    reverse::{ReverseKey, ReverseValue},
    settings::Mode,
};

use crate::{
    sandbox::{CacheSpec, Ns, Query, Sandbox, Tools, Transport},
    topology::{NODE_LISTENER, dns, who},
};

/// What a test does to the standard cache (`cache`), and how it undoes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// SIGSTOP, then SIGCONT: its sockets stay, so only the probes notice.
    Hang,
    /// SIGKILL, then a new cache: its sockets close, so the kernel notices.
    Kill,
}

impl CacheEvent {
    /// Hangs or kills the cache.
    pub fn strike(self, sandbox: &mut Sandbox) -> anyhow::Result<()> {
        use nix::sys::signal::Signal;
        let signal = match self {
            Self::Hang => Signal::SIGSTOP,
            Self::Kill => Signal::SIGKILL,
        };
        sandbox.process("cache")?.signal(signal)
    }

    /// Resumes the hung cache, or starts a new one in place of the killed one.
    pub fn restore(self, sandbox: &mut Sandbox) -> anyhow::Result<()> {
        match self {
            Self::Hang => sandbox
                .process("cache")?
                .signal(nix::sys::signal::Signal::SIGCONT),
            Self::Kill => {
                sandbox.stop_server("cache")?;
                sandbox.start_cache("cache", &CacheSpec::standard())
            }
        }
    }
}

/// The listeners most tests use:
/// - `node` (169.254.10.10): upstreams A and B, its cache's own queries skipped;
/// - `cluster` (169.254.10.11): no upstreams, `fail` when its cache is down;
/// - `v6` (fd00:53::10): IPv6 upstreams A and B.
#[must_use]
pub fn standard_listeners(sandbox: &Sandbox) -> String {
    format!(
        r#"
[[listener]]
name = "node"
address = "169.254.10.10"
upstreams = ["198.18.2.2", "198.18.2.3:53"]
skip_cgroups = [{skipped:?}]

[[listener]]
name = "cluster"
address = "169.254.10.11"
empty_pool = "fail"

[[listener]]
name = "v6"
address = "fd00:53::10"
upstreams = ["fd00:2::2", "[fd00:2::3]:53"]
"#,
        skipped = sandbox.skipped_cgroup().path().display().to_string()
    )
}

/// Writes the sandbox's agent configuration with [`standard_listeners`] (`config.toml` in its
/// scratch directory) and returns its path.
pub fn write_standard_config(sandbox: &Sandbox) -> anyhow::Result<std::path::PathBuf> {
    sandbox.write_file(
        "config.toml",
        &sandbox.config_toml(&standard_listeners(sandbox)),
    )
}

/// Who answered a UDP query from the pod to the node listener: `cache`, `upstream A`, ...
pub fn answered_by(sandbox: &Sandbox) -> anyhow::Result<&'static str> {
    answered_at(sandbox, Ns::Pod, NODE_LISTENER.into())
}

/// Who answered a UDP query from `ns` to `listener`.
pub fn answered_at(
    sandbox: &Sandbox,
    ns: Ns,
    listener: std::net::IpAddr,
) -> anyhow::Result<&'static str> {
    let query = Query::new(dns(listener), Transport::Udp);
    Ok(who(sandbox.query(ns, query)?.answer()))
}

/// The node listener's reason, as `status` and the metrics give it (`healthy`, `stalled`, ...).
pub fn node_reason(sandbox: &Sandbox) -> anyhow::Result<&'static str> {
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    redirector::telemetry::snapshot::listeners(&maps)?
        .into_iter()
        .find(|listener| listener.id == NODE_ID)
        .map(|listener| listener.reason_code)
        .context("no node listener in the pinned maps")
}

/// Starts `redirector run` with [`write_standard_config`]'s configuration and waits until the
/// node listener's DNS is answered by the cache; returns the configuration's path and the agent.
pub fn agent_serving_from_cache(
    sandbox: &Sandbox,
) -> anyhow::Result<(std::path::PathBuf, crate::command::TestProcess)> {
    let config = write_standard_config(sandbox)?;
    let agent = crate::cli::start_agent(&config)?;
    wait_for_cache(sandbox, "the agent confirms the cache")?;
    Ok((config, agent))
}

/// Waits until the node listener's DNS is answered by the cache (`what` says why it should be),
/// for at most 10 s stretched to the machine's pace.
pub fn wait_for_cache(sandbox: &Sandbox, what: &str) -> anyhow::Result<()> {
    wait_for_cache_at(sandbox, Ns::Pod, NODE_LISTENER.into(), what)
}

/// The same for `listener`, asked from `ns`.
pub fn wait_for_cache_at(
    sandbox: &Sandbox,
    ns: Ns,
    listener: std::net::IpAddr,
    what: &str,
) -> anyhow::Result<()> {
    crate::pace::wait_until(
        what,
        Duration::from_secs(10),
        Duration::from_millis(50),
        || Ok(answered_at(sandbox, ns, listener)? == "cache"),
    )
}

/// Listener ids in `standard_listeners`.
pub const NODE_ID: u32 = 0;
/// See [`NODE_ID`].
pub const CLUSTER_ID: u32 = 1;
/// See [`NODE_ID`].
pub const V6_ID: u32 = 2;

/// An agent running on its own thread; stopped (programs detached, pins removed) on drop.
#[derive(Debug)]
pub struct AgentThread {
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// What the agent observed.
    pub stats: Arc<AgentStats>,
    /// Where it serves `/metrics`, `/healthz` and `/readyz`.
    pub metrics: Option<SocketAddr>,
}

impl AgentThread {
    /// Starts an agent for `config` on its own thread and runs its control loop until dropped.
    /// Returns once the agent has started (or failed to).
    pub fn start(config: &Config) -> anyhow::Result<Self> {
        let config = config.clone();
        let (started, start_result) =
            std::sync::mpsc::channel::<anyhow::Result<(Arc<AgentStats>, Option<SocketAddr>)>>();
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("agent".to_owned())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(error) => {
                        let _ = started.send(Err(error.into()));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let mut agent = match Agent::start(&config, StartOptions::default()).await {
                        Ok(agent) => agent,
                        Err(error) => {
                            let _ = started.send(Err(anyhow::Error::new(error)
                                .context("starting the agent in the sandbox")));
                            return;
                        }
                    };
                    let _ = started.send(Ok((agent.stats(), agent.metrics_address())));
                    let ran = agent
                        .run(async {
                            let _ = stop.await;
                        })
                        .await;
                    agent.shutdown();
                    if let Err(error) = ran {
                        eprintln!("the agent stopped: {:#}", anyhow::Error::new(error));
                    }
                    if let Err(error) = uninstall(&config).await {
                        eprintln!("uninstalling the agent: {error:#}");
                    }
                });
            })
            .context("starting the agent thread")?;
        let (stats, metrics) = start_result
            .recv()
            .context("the agent thread died while starting")??;
        Ok(Self {
            shutdown: Some(shutdown),
            thread: Some(thread),
            stats,
            metrics,
        })
    }
}

impl Drop for AgentThread {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A sandbox with servers and a running agent. Fields drop in order: the agent first (it
/// detaches), then the test's own handle on the maps, then the sandbox.
#[derive(Debug)]
pub struct Harness {
    /// The agent.
    pub agent: AgentThread,
    /// The test's handle on the agent's pinned maps (what `redirector state` would open).
    pub maps: Maps,
    /// The sandbox.
    pub sandbox: Sandbox,
}

impl Harness {
    /// Builds a sandbox, lets `setup` start its servers, then starts an agent for
    /// `listeners(sandbox)`.
    pub fn start(
        tools: Tools,
        setup: impl FnOnce(&mut Sandbox) -> anyhow::Result<()>,
        listeners: impl FnOnce(&Sandbox) -> String,
    ) -> anyhow::Result<Self> {
        let mut sandbox = Sandbox::new(tools)?;
        setup(&mut sandbox)?;
        let agent = start_agent_thread(&sandbox, &listeners(&sandbox))?;
        let maps = Maps::open_pinned(&sandbox.pin_dir())?;
        Ok(Self {
            agent,
            maps,
            sandbox,
        })
    }

    /// Starts an agent for the configuration `text` in an already prepared `sandbox`.
    pub fn with_config(sandbox: Sandbox, text: &str) -> anyhow::Result<Self> {
        let config = Config::parse(text).context("the test configuration is valid")?;
        let agent = AgentThread::start(&config)?;
        let maps = Maps::open_pinned(&sandbox.pin_dir())?;
        Ok(Self {
            agent,
            maps,
            sandbox,
        })
    }

    /// Stops the agent the way `AgentThread` does (which uninstalls it) and returns the sandbox.
    #[must_use]
    pub fn stop(self) -> Sandbox {
        let Self {
            agent,
            maps,
            sandbox,
        } = self;
        drop(agent);
        drop(maps);
        sandbox
    }

    /// The standard servers (cache on every listener address, upstreams A and B) and
    /// `standard_listeners`.
    pub fn standard(tools: Tools) -> anyhow::Result<Self> {
        Self::start(tools, Sandbox::start_standard_servers, standard_listeners)
    }

    /// Sets a listener's mode, as `redirector state` does.
    pub fn set_mode(&mut self, id: u32, mode: Mode) -> anyhow::Result<()> {
        Ok(self.maps.set_mode(id, mode)?)
    }

    /// Replaces a listener's upstream pool.
    pub fn set_pool(&mut self, id: u32, upstreams: &[SocketAddr]) -> anyhow::Result<()> {
        let targets: Vec<Target> = upstreams
            .iter()
            .map(|&address| Upstream::from(address).target())
            .collect();
        self.maps.set_pool(id, &targets)?;
        Ok(())
    }

    /// A listener's counters, UDP and TCP together.
    pub fn counters(&self, id: u32) -> anyhow::Result<ListenerCounters> {
        Ok(self.maps.counters(id)?.total())
    }

    /// The kernel's count of a listener's cache sockets.
    pub fn sockets(&self, id: u32) -> anyhow::Result<SocketCounts> {
        Ok(self.maps.socket_counts(id)?)
    }

    /// Every entry of the reverse-translation map.
    #[must_use]
    pub fn reverse_entries(&self) -> Vec<(ReverseKey, ReverseValue)> {
        self.maps.reverse_entries()
    }

    /// Where DNS for listener `id` goes now (`cache` or `upstream`), as the pinned maps say.
    pub fn route(&self, id: u32) -> anyhow::Result<&'static str> {
        redirector::telemetry::snapshot::listeners(&self.maps)?
            .iter()
            .find(|listener| listener.id == id)
            .map(|listener| listener.route)
            .with_context(|| format!("the maps hold no listener {id}"))
    }

    /// Waits until listener `id` routes to `route` (`cache` or `upstream`), for at most 15 s
    /// (stretched by [`crate::pace`]).
    pub fn wait_for_route(&self, id: u32, route: &str) -> anyhow::Result<()> {
        self.wait_until(
            &format!("listener {id} routes to {route}"),
            Duration::from_secs(15),
            |harness| Ok(harness.route(id)? == route),
        )
    }

    /// Waits until `condition` holds, checking every 20 ms, for at most `limit` (stretched by
    /// [`crate::pace`]); fails with `what` otherwise. For states the system must reach, not for
    /// timing claims.
    pub fn wait_until(
        &self,
        what: &str,
        limit: Duration,
        mut condition: impl FnMut(&Self) -> anyhow::Result<bool>,
    ) -> anyhow::Result<()> {
        crate::pace::wait_until(what, limit, Duration::from_millis(20), || condition(self))
    }
}

/// Starts an in-process agent for the sandbox with `listeners` (`cli::start_agent` starts the binary).
pub fn start_agent_thread(sandbox: &Sandbox, listeners: &str) -> anyhow::Result<AgentThread> {
    let config = Config::parse(&sandbox.config_toml(listeners))
        .context("the test configuration is valid")?;
    AgentThread::start(&config)
}

/// Parses `recvfrom`/`getpeername` output of `dns-query`.
#[must_use]
pub fn socket_addr(text: Option<&String>) -> Option<SocketAddr> {
    text?.parse().ok()
}

/// `address:53` as a dual-stack socket shows an IPv4 peer (`[::ffff:a.b.c.d]:53`).
#[must_use]
pub fn mapped(address: std::net::Ipv4Addr) -> SocketAddr {
    SocketAddr::new(std::net::IpAddr::V6(address.to_ipv6_mapped()), 53)
}

/// An agent configuration whose node listener has upstream A as its pool and whose cluster
/// listener (and, with `v6`, the v6 listener) follows kube-system/kube-dns through the API
/// server `kubeconfig` names, resyncing every 2 s; the interface left alone.
#[must_use]
pub fn kube_dns_config(sandbox: &Sandbox, kubeconfig: &std::path::Path, v6: bool) -> String {
    let mut listeners = r#"
[[listener]]
name = "node"
address = "169.254.10.10"
upstreams = ["198.18.2.2"]

[[listener]]
name = "cluster"
address = "169.254.10.11"
kube_dns = "kube-system/kube-dns"
"#
    .to_owned();
    if v6 {
        listeners.push_str(
            r#"
[[listener]]
name = "v6"
address = "fd00:53::10"
kube_dns = "kube-system/kube-dns"
"#,
        );
    }
    let tables = format!(
        "[interface]\nmanage = false\n\n[kubernetes]\nkubeconfig = {:?}\nresync_interval_ms = 2000\n",
        kubeconfig.display().to_string()
    );
    sandbox.config_toml_with(&listeners, &tables)
}
