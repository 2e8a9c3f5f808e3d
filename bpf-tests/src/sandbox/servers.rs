//! The servers the sandbox runs: the test cache (in the node namespace and the skipped cgroup),
//! the two upstreams, and any other process a test starts, each stopped with the sandbox.

use std::{net::SocketAddr, path::Path, process::Command, time::Duration};

use anyhow::Context as _;

use super::{Ns, Sandbox};
use crate::{
    command::{TestProcess, join_cgroup_before_exec},
    dns::Identity,
    topology::{
        self, CACHE, CLUSTER_LISTENER, NODE_LISTENER, UPSTREAM_A, UPSTREAM_B, V6_LISTENER, dns,
    },
};

/// How a test cache serves.
#[derive(Clone, Debug)]
pub struct CacheSpec {
    /// Addresses it binds (UDP and TCP).
    pub listen: Vec<SocketAddr>,
    /// UDP sockets per address (an SO_REUSEPORT group when more than one).
    pub udp_sockets: u32,
    /// Milliseconds it stays silent after binding.
    pub mute_ms: u64,
    /// More `dns-server` flags (`--rcode servfail`, `--answer-delay-ms 700`, ...).
    pub extra_args: Vec<String>,
}

impl CacheSpec {
    /// On every listener address, one socket each, answering at once.
    #[must_use]
    pub fn standard() -> Self {
        Self {
            listen: vec![dns(NODE_LISTENER), dns(CLUSTER_LISTENER), dns(V6_LISTENER)],
            udp_sockets: 1,
            mute_ms: 0,
            extra_args: Vec::new(),
        }
    }
}

/// The `dns-server` arguments for answering as `identity` on `listen`.
fn server_args(listen: &[SocketAddr], identity: Identity) -> Vec<String> {
    let mut args = Vec::new();
    for address in listen {
        args.extend(["--listen".to_owned(), address.to_string()]);
    }
    args.extend([
        "--a".to_owned(),
        identity.a.to_string(),
        "--aaaa".to_owned(),
        identity.aaaa.to_string(),
    ]);
    args
}

/// The `dns-server` arguments of a cache.
fn cache_args(cache: &CacheSpec) -> Vec<String> {
    let mut args = server_args(&cache.listen, CACHE);
    args.extend([
        "--udp-sockets".to_owned(),
        cache.udp_sockets.to_string(),
        "--mute-ms".to_owned(),
        cache.mute_ms.to_string(),
    ]);
    args.extend(cache.extra_args.iter().cloned());
    args
}

impl Sandbox {
    /// Starts a test DNS server in `ns` answering as `identity` on every address of `listen`
    /// (UDP and TCP). Not in the test cgroup: servers are never steered.
    pub fn start_server(
        &mut self,
        name: &str,
        ns: Ns,
        listen: &[SocketAddr],
        identity: Identity,
    ) -> anyhow::Result<()> {
        let program = self.tools.dns_server.display().to_string();
        self.start_process(
            name,
            Some(ns),
            None,
            &program,
            &server_args(listen, identity),
            "ready",
        )
    }

    /// Starts `program args` as `name` in `ns` (`None`: the test's own namespace, where /sys
    /// shows the cgroup hierarchy, which `ip netns exec` hides), and in `cgroup` when given
    /// (joined before it runs), and waits until it prints a line containing `ready`.
    pub fn start_process(
        &mut self,
        name: &str,
        ns: Option<Ns>,
        cgroup: Option<&Path>,
        program: &str,
        args: &[String],
        ready: &str,
    ) -> anyhow::Result<()> {
        let mut command = match ns {
            Some(ns) => self.netns(ns).command(program),
            None => Command::new(program),
        };
        command.args(args);
        let procs = cgroup.map(crate::cgroup::open_procs).transpose()?;
        if let Some(procs) = &procs {
            join_cgroup_before_exec(&mut command, procs);
        }
        let process = TestProcess::start(name, command, ready, Duration::from_secs(10))?;
        drop(procs);
        self.servers.push((name.to_owned(), process));
        Ok(())
    }

    /// Starts a test DNS server as the cache: in the node namespace and in the cache's cgroup
    /// (below the attach point, so the kernel counts its sockets; skipped, so its own queries are
    /// never steered).
    pub fn start_cache(&mut self, name: &str, cache: &CacheSpec) -> anyhow::Result<()> {
        let args = cache_args(cache);
        let program = self.tools.dns_server.display().to_string();
        let cgroup = self.skipped.path().to_owned();
        self.start_process(
            name,
            Some(Ns::Node),
            Some(&cgroup),
            &program,
            &args,
            "ready",
        )
    }

    /// Starts a test DNS server as the cache, as `start_cache` does, but outside the attach
    /// cgroup (in the test's own): the programs never see its binds or its reads, and only the
    /// agent's socket table counts its sockets.
    pub fn start_cache_outside_attach(
        &mut self,
        name: &str,
        cache: &CacheSpec,
    ) -> anyhow::Result<()> {
        let args = cache_args(cache);
        let program = self.tools.dns_server.display().to_string();
        self.start_process(name, Some(Ns::Node), None, &program, &args, "ready")
    }

    /// The process started as `name`.
    pub fn process(&mut self, name: &str) -> anyhow::Result<&mut TestProcess> {
        self.servers
            .iter_mut()
            .find(|(server, _)| server == name)
            .map(|(_, process)| process)
            .with_context(|| format!("no process {name} was started"))
    }

    /// Starts the cache (on every listener address, in the node) and upstreams A and B.
    pub fn start_standard_servers(&mut self) -> anyhow::Result<()> {
        self.start_cache("cache", &CacheSpec::standard())?;
        self.start_upstreams()
    }

    /// Starts upstreams A and B.
    pub fn start_upstreams(&mut self) -> anyhow::Result<()> {
        self.start_upstream_a()?;
        self.start_upstream_b()
    }

    /// Starts "upstream A" on its IPv4 and IPv6 addresses (again, after `stop_server`).
    pub fn start_upstream_a(&mut self) -> anyhow::Result<()> {
        self.start_upstream_a_with(&[])
    }

    /// Starts "upstream B" on its IPv4 and IPv6 addresses (again, after `stop_server`).
    pub fn start_upstream_b(&mut self) -> anyhow::Result<()> {
        self.start_upstream_b_with(&[])
    }

    /// Starts "upstream A" with more `dns-server` flags (`--mute-ms N`: a hung server that
    /// answers nothing; `--answer-delay-ms N`: a slow one).
    pub fn start_upstream_a_with(&mut self, flags: &[&str]) -> anyhow::Result<()> {
        self.start_upstream(
            "upstream A",
            &[dns(topology::UPSTREAM_A_V4), dns(topology::UPSTREAM_A_V6)],
            UPSTREAM_A,
            flags,
        )
    }

    /// Starts "upstream B" with more `dns-server` flags, as [`Self::start_upstream_a_with`].
    pub fn start_upstream_b_with(&mut self, flags: &[&str]) -> anyhow::Result<()> {
        self.start_upstream(
            "upstream B",
            &[dns(topology::UPSTREAM_B_V4), dns(topology::UPSTREAM_B_V6)],
            UPSTREAM_B,
            flags,
        )
    }

    fn start_upstream(
        &mut self,
        name: &str,
        listen: &[SocketAddr],
        identity: Identity,
        flags: &[&str],
    ) -> anyhow::Result<()> {
        let program = self.tools.dns_server.display().to_string();
        let mut args = server_args(listen, identity);
        args.extend(flags.iter().map(|flag| (*flag).to_owned()));
        self.start_process(name, Some(Ns::Upstream), None, &program, &args, "ready")
    }

    /// Stops (SIGKILL) the server started as `name`.
    pub fn stop_server(&mut self, name: &str) -> anyhow::Result<()> {
        let index = self
            .servers
            .iter()
            .position(|(server, _)| server == name)
            .with_context(|| format!("no server {name} was started"))?;
        drop(self.servers.remove(index));
        Ok(())
    }
}
