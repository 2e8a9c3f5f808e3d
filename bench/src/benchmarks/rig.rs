//! The bench's node: a sandbox with conntrack on (as on every node), dnsmasq as the cache on an
//! address of its own, the two upstreams, and the incumbents' rules a step away.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::Context as _;

use bpf_tests::{
    caches::{CacheKind, start_cache_at},
    cli::start_agent,
    command::{TestProcess, output_within},
    conntrack,
    sandbox::{Ns, Sandbox, Tools, UNMANAGED_INTERFACE},
};

/// Where the cache listens: an address of the node that is no listener, so that redirector
/// rewrites (the realistic path) and the incumbents can address it directly.
pub const CACHE_ADDRESS: Ipv4Addr = Ipv4Addr::new(169, 254, 10, 20);
/// The listener redirector steers to the cache.
pub const LISTENER: Ipv4Addr = bpf_tests::topology::NODE_LISTENER;
/// A service VIP the incumbent NATs to the cache (a ClusterIP stand-in).
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// The agent's listener for the bench: the listener steered to the cache, upstreams A and B.
pub fn listeners() -> String {
    format!(
        "[[listener]]\nname = \"node\"\naddress = \"{LISTENER}\"\ncache = \"{CACHE_ADDRESS}:53\"\nupstreams = [\"198.18.2.2\", \"198.18.2.3\"]\n"
    )
}

/// The bench's listener with the cache on the listener address itself (nothing is rewritten
/// while it serves), upstreams A and B.
pub fn listeners_cache_on_listener() -> String {
    format!(
        "[[listener]]\nname = \"node\"\naddress = \"{LISTENER}\"\nupstreams = [\"198.18.2.2\", \"198.18.2.3\"]\n"
    )
}

/// An agent stopped with its programs still attached.
#[derive(Debug)]
pub struct Stopped(());

/// The node, its cache and upstreams.
#[derive(Debug)]
pub struct Rig {
    /// The sandbox.
    pub sandbox: Sandbox,
    /// The `hook-cost` helper.
    pub hook_cost: PathBuf,
    /// The `dns-load` helper (connected UDP load).
    pub dns_load: PathBuf,
    /// The agent's configuration file (the cache on an address of its own).
    pub config: PathBuf,
    /// The same with the cache on the listener address.
    pub config_cache_on_listener: PathBuf,
}

impl Rig {
    /// Builds it.
    pub fn new() -> anyhow::Result<Self> {
        let tools = Tools::beside_current_exe()?;
        let hook_cost = tools.dns_query.with_file_name("hook-cost");
        let dns_load = tools.dns_query.with_file_name("dns-load");
        let mut sandbox = Sandbox::new(tools)?;
        sandbox.netns(Ns::Node).ip(&[
            "addr",
            "add",
            &format!("{CACHE_ADDRESS}/32"),
            "dev",
            "lo",
        ])?;
        sandbox.start_upstreams()?;
        start_cache_at(
            &mut sandbox,
            CacheKind::Dnsmasq,
            "cache",
            SocketAddr::new(IpAddr::V4(CACHE_ADDRESS), 53),
        )?;
        conntrack::activate(sandbox.netns(Ns::Node))?;
        // The agent's default probes, not the tests' faster ones.
        let probe = redirector::config::ProbeSettings::default();
        let write_config = |file: &str, listeners: &str| {
            let text = sandbox.config_toml_probing(
                listeners,
                UNMANAGED_INTERFACE,
                probe.interval,
                probe.timeout,
            );
            sandbox.write_file(file, &text)
        };
        let config = write_config("config.toml", &listeners())?;
        let config_cache_on_listener =
            write_config("config-on-listener.toml", &listeners_cache_on_listener())?;
        Ok(Self {
            sandbox,
            hook_cost,
            dns_load,
            config,
            config_cache_on_listener,
        })
    }

    /// Runs `iptables args` in the node namespace (iptables-nft, as current distributions ship
    /// it).
    pub fn iptables(&self, args: &[&str]) -> anyhow::Result<()> {
        self.sandbox.netns(Ns::Node).run("iptables", args)?;
        Ok(())
    }

    /// The incumbent's raw-table NOTRACK rules for the cache (NodeLocal DNSCache's layout),
    /// added (`-A`) or deleted (`-D`).
    pub fn notrack(&self, action: &str) -> anyhow::Result<()> {
        let cache = CACHE_ADDRESS.to_string();
        for protocol in ["udp", "tcp"] {
            self.iptables(&[
                "-t",
                "raw",
                action,
                "PREROUTING",
                "-d",
                &cache,
                "-p",
                protocol,
                "--dport",
                "53",
                "-j",
                "NOTRACK",
            ])?;
            self.iptables(&[
                "-t", "raw", action, "OUTPUT", "-s", &cache, "-p", protocol, "--sport", "53", "-j",
                "NOTRACK",
            ])?;
        }
        Ok(())
    }

    /// DNAT from `from:53` to `to:53` (the NAT way: a VIP, or the fallback's listener to an
    /// upstream), added (`-A`) or deleted (`-D`).
    pub fn dnat(&self, action: &str, from: Ipv4Addr, to: Ipv4Addr) -> anyhow::Result<()> {
        let (from, to) = (from.to_string(), format!("{to}:53"));
        for protocol in ["udp", "tcp"] {
            self.iptables(&[
                "-t",
                "nat",
                action,
                "PREROUTING",
                "-d",
                &from,
                "-p",
                protocol,
                "--dport",
                "53",
                "-j",
                "DNAT",
                "--to-destination",
                &to,
            ])?;
        }
        Ok(())
    }

    /// Starts the agent (`redirector run`).
    pub fn start_agent(&self) -> anyhow::Result<TestProcess> {
        start_agent(&self.config)
    }

    /// Starts the agent with the cache on the listener address.
    pub fn start_agent_cache_on_listener(&self) -> anyhow::Result<TestProcess> {
        start_agent(&self.config_cache_on_listener)
    }

    /// Stops `agent` (SIGTERM) and uninstalls: no program, pin or table left.
    pub fn stop_and_uninstall(&self, agent: TestProcess) -> anyhow::Result<()> {
        let stopped = self.stop_agent(agent)?;
        self.uninstall(stopped)
    }

    /// Stops `agent` (SIGTERM); its programs stay attached.
    pub fn stop_agent(&self, mut agent: TestProcess) -> anyhow::Result<Stopped> {
        agent.signal(nix::sys::signal::Signal::SIGTERM)?;
        agent.wait_exit(Duration::from_secs(10))?;
        Ok(Stopped(()))
    }

    /// Removes what a stopped agent left.
    pub fn uninstall(&self, _stopped: Stopped) -> anyhow::Result<()> {
        let uninstall = bpf_tests::cli::redirector(&[
            "uninstall",
            "--config",
            &self.config.display().to_string(),
        ])?;
        anyhow::ensure!(
            uninstall.code == 0,
            "uninstall failed: {}",
            uninstall.stderr
        );
        Ok(())
    }

    /// Runs `program args` in the pod namespace, in the cgroup the programs attach to, and
    /// returns its stdout.
    pub fn in_pod(&self, program: &str, args: &[&str], limit: Duration) -> anyhow::Result<String> {
        let (mut command, _procs) =
            self.sandbox
                .client_command(Ns::Pod, self.sandbox.cgroup(), program)?;
        command.args(args);
        let output = output_within(&mut command, limit)?;
        anyhow::ensure!(
            output.status.success(),
            "{program} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).context("output is text")
    }
}
