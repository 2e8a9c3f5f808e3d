//! A sandbox with the standard servers and a running agent (in-process), for the steering tests.

use std::net::{IpAddr, SocketAddr};

use anyhow::Context as _;
use redirector::{agent::Agent, config::Config};
use redirector_common::{
    counters::ListenerCounters,
    reverse::{ReverseKey, ReverseValue},
};

use crate::sandbox::{Sandbox, Tools};

/// The listeners most tests use:
/// - `node` (169.254.10.10): upstreams A and B, its cache's own queries skipped;
/// - `cluster` (169.254.10.11): no upstreams, `fail` when its cache is down;
/// - `v6` (fd00:53::10): IPv6 upstreams A and B.
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

/// Listener ids in `standard_listeners`.
pub const NODE_ID: u32 = 0;
/// See [`NODE_ID`].
pub const CLUSTER_ID: u32 = 1;
/// See [`NODE_ID`].
pub const V6_ID: u32 = 2;

/// A sandbox with the cache and both upstreams serving, and the agent steering. The agent is
/// declared first so it detaches before the sandbox goes.
#[derive(Debug)]
pub struct Bench {
    /// The agent (programs attached to the sandbox's cgroup).
    pub agent: Agent,
    /// The sandbox.
    pub sandbox: Sandbox,
}

impl Bench {
    /// Builds a sandbox, starts the standard servers and an agent for `listeners(sandbox)`.
    pub fn start(tools: Tools, listeners: impl FnOnce(&Sandbox) -> String) -> anyhow::Result<Self> {
        let mut sandbox = Sandbox::new(tools)?;
        sandbox.start_standard_servers()?;
        let config = Config::parse(&sandbox.config_toml(&listeners(&sandbox)))
            .context("the test configuration is valid")?;
        let agent = Agent::start(&config).context("starting the agent in the sandbox")?;
        Ok(Self { agent, sandbox })
    }

    /// With `standard_listeners`.
    pub fn standard(tools: Tools) -> anyhow::Result<Self> {
        Self::start(tools, standard_listeners)
    }

    /// Sets a listener's mode (`MODE_*`), as `redirector state` does.
    pub fn set_mode(&mut self, id: u32, mode: u32) -> anyhow::Result<()> {
        Ok(self.agent.maps_mut().set_mode(id, mode)?)
    }

    /// Sets the agent's verdict on a listener's cache (`HEALTH_*`).
    pub fn set_health(&mut self, id: u32, verdict: u32) -> anyhow::Result<()> {
        Ok(self.agent.maps_mut().set_health(id, verdict)?)
    }

    /// Replaces a listener's upstream pool.
    pub fn set_pool(&mut self, id: u32, upstreams: &[SocketAddr]) -> anyhow::Result<()> {
        Ok(self.agent.maps_mut().set_pool(id, upstreams)?)
    }

    /// A listener's counters, UDP and TCP together.
    pub fn counters(&self, id: u32) -> anyhow::Result<ListenerCounters> {
        Ok(self.agent.maps().counters(id)?.total())
    }

    /// Every entry of the reverse-translation map.
    #[must_use]
    pub fn reverse_entries(&self) -> Vec<(ReverseKey, ReverseValue)> {
        self.agent.maps().reverse_entries()
    }
}

/// Parses `recvfrom`/`getpeername` output of `dns-query`.
#[must_use]
pub fn socket_addr(text: Option<&String>) -> Option<SocketAddr> {
    text?.parse().ok()
}

/// `address:53` as a dual-stack socket shows an IPv4 peer (`[::ffff:a.b.c.d]:53`).
#[must_use]
pub fn mapped(address: std::net::Ipv4Addr) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(address.to_ipv6_mapped()), 53)
}
