//! A throwaway node: a cgroup, a "node" network namespace with the listener addresses, a "pod"
//! namespace behind a veth, an "upstream" namespace with two DNS servers, and a private bpffs.
//! Everything is removed when the sandbox is dropped, also when a test fails.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::{
    bpffs::BpfFs,
    cgroup::TestCgroup,
    command::{TestProcess, join_cgroup_before_exec, output_within},
    dns::{Identity, QueryOutcome},
    netns::NetNs,
    pace::{paced, paced_ms},
    topology::{
        self, CACHE, CLUSTER_LISTENER, NODE_LISTENER, UPSTREAM_A, UPSTREAM_B, V6_LISTENER, dns,
    },
};

/// Prefix of every cgroup, namespace, link and mount a sandbox creates (`cargo xtask test`
/// sweeps leftovers with it after a crash).
pub const PREFIX: &str = "rdt";

/// The `[interface]` table of the sandbox's agent configurations: the listener addresses are the
/// sandbox's (on the node namespace's loopback), not the agent's to manage.
pub const UNMANAGED_INTERFACE: &str = "[interface]\nmanage = false\n";

/// A `dns-query --hold` client: one long-lived UDP socket whose queries the test paces. Killed
/// (it is the test's own child) when dropped.
#[derive(Debug)]
pub struct HeldClient {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    started: bool,
    /// With `--idle-first`: the client's monotonic clock just before it connected.
    opened_ns: Option<u64>,
}

impl HeldClient {
    /// How long ago the socket was connected (`None` unless held idle first): from the client's
    /// own clock, so the time it took to start is not counted.
    #[must_use]
    pub fn since_connected(&self) -> Option<Duration> {
        self.opened_ns
            .map(|opened| Duration::from_nanos(crate::pace::monotonic_ns().saturating_sub(opened)))
    }

    /// Sends the socket's next query and returns its outcome (the client's own timeout bounds
    /// the wait).
    pub fn ask(&mut self) -> anyhow::Result<QueryOutcome> {
        use std::io::{BufRead as _, Write as _};
        if self.started {
            self.stdin
                .write_all(b"next\n")
                .and_then(|()| self.stdin.flush())
                .context("asking the held client for its next query")?;
        }
        self.started = true;
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .context("reading the held client's outcome")?;
        serde_json::from_str(line.trim())
            .with_context(|| format!("the held client printed {line:?}"))
    }
}

impl Drop for HeldClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the helper binaries are (tests pass `env!("CARGO_BIN_EXE_...")`).
#[derive(Clone, Debug)]
pub struct Tools {
    /// The test DNS server.
    pub dns_server: PathBuf,
    /// The test DNS client.
    pub dns_query: PathBuf,
    /// The continuous DNS client.
    pub dns_stream: PathBuf,
}

/// The helper binaries of the calling test crate (`env!("CARGO_BIN_EXE_...")`, which cargo sets
/// for integration tests of this package).
#[macro_export]
macro_rules! tools {
    () => {
        $crate::sandbox::Tools {
            dns_server: env!("CARGO_BIN_EXE_dns-server").into(),
            dns_query: env!("CARGO_BIN_EXE_dns-query").into(),
            dns_stream: env!("CARGO_BIN_EXE_dns-stream").into(),
        }
    };
}

impl Tools {
    /// The helpers next to the running executable (how the demo finds them), unless
    /// `DNS_SERVER_BIN` / `DNS_QUERY_BIN` say otherwise.
    pub fn beside_current_exe() -> anyhow::Result<Self> {
        let dir = std::env::current_exe()
            .context("locating the running executable")?
            .parent()
            .context("the executable has a directory")?
            .to_owned();
        let pick = |variable: &str, name: &str| {
            std::env::var_os(variable).map_or_else(|| dir.join(name), PathBuf::from)
        };
        Ok(Self {
            dns_server: pick("DNS_SERVER_BIN", "dns-server"),
            dns_query: pick("DNS_QUERY_BIN", "dns-query"),
            dns_stream: pick("DNS_STREAM_BIN", "dns-stream"),
        })
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

/// Which namespace a process runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ns {
    /// The node ("host network"): listener addresses and the cache.
    Node,
    /// A pod behind a veth.
    Pod,
    /// The upstream servers' namespace.
    Upstream,
}

/// How `dns-query` talks to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Unconnected UDP: `sendto` / `recvfrom` (sendmsg and recvmsg hooks).
    Udp,
    /// Connected UDP: `connect`, `send`, `recv`, `getpeername`.
    UdpConnected,
    /// TCP.
    Tcp,
}

impl Transport {
    fn arg(self) -> &'static str {
        match self {
            Self::Udp => "udp",
            Self::UdpConnected => "udp-connected",
            Self::Tcp => "tcp",
        }
    }
}

/// One `dns-query` run.
#[derive(Clone, Copy, Debug)]
pub struct Query {
    /// The server.
    pub server: SocketAddr,
    /// How.
    pub transport: Transport,
    /// Use an AF_INET6 socket and the IPv4-mapped form of an IPv4 server.
    pub mapped: bool,
    /// Unconnected UDP: also send each query to this server from the same socket, before
    /// reading either reply (two outcomes per query, in the order the replies arrive).
    pub also: Option<SocketAddr>,
    /// Ask for AAAA instead of A.
    pub aaaa: bool,
}

impl Query {
    /// An A query over `transport`.
    #[must_use]
    pub fn new(server: SocketAddr, transport: Transport) -> Self {
        Self {
            server,
            transport,
            mapped: false,
            also: None,
            aaaa: false,
        }
    }

    /// The same query sent to `server` too, from the same socket, before either reply is read.
    #[must_use]
    pub fn also(self, server: SocketAddr) -> Self {
        Self {
            also: Some(server),
            ..self
        }
    }

    /// The same query from a dual-stack AF_INET6 socket to `::ffff:a.b.c.d`.
    #[must_use]
    pub fn mapped(self) -> Self {
        Self {
            mapped: true,
            ..self
        }
    }
}

/// What dig printed.
#[derive(Clone, Debug)]
pub struct DigOutcome {
    /// The answer addresses (`+short`).
    pub answers: Vec<IpAddr>,
    /// Everything it printed, for assertion messages.
    pub output: String,
}

impl DigOutcome {
    /// The first answer.
    #[must_use]
    pub fn answer(&self) -> Option<IpAddr> {
        self.answers.first().copied()
    }
}

/// A sandbox. Fields drop in order: processes, cgroups (child first), namespaces, bpffs.
#[derive(Debug)]
pub struct Sandbox {
    servers: Vec<(String, TestProcess)>,
    skipped: TestCgroup,
    cgroup: TestCgroup,
    pod: NetNs,
    upstream: NetNs,
    node: NetNs,
    bpffs: BpfFs,
    scratch: ScratchDir,
    tools: Tools,
    tag: String,
}

/// A directory for the test's files (configurations), removed on drop.
#[derive(Debug)]
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

static SANDBOXES: AtomicU32 = AtomicU32::new(0);

/// Fails loudly unless the process can do what the sandbox needs.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "bpf-tests load eBPF programs, create cgroups and network namespaces: they must run as \
         root. Run `sudo cargo xtask test` (or `cargo xtask test` as root)."
    );
}

impl Sandbox {
    /// Builds the sandbox: cgroups, namespaces, links, addresses, routes, bpffs.
    pub fn new(tools: Tools) -> anyhow::Result<Self> {
        require_root();
        let serial = SANDBOXES.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|since| since.subsec_nanos())
            .unwrap_or_default();
        let tag = format!(
            "{:06x}",
            (std::process::id().wrapping_mul(0x9E37_79B9)
                ^ serial.wrapping_mul(0x85EB_CA6B)
                ^ nanos)
                & 0x00ff_ffff
        );
        let root = redirector::sys::cgroup::default_attach_cgroup()
            .context("finding the cgroup v2 hierarchy")?;
        let scratch = ScratchDir(std::env::temp_dir().join(format!("{PREFIX}-{tag}-files")));
        std::fs::create_dir_all(&scratch.0)
            .with_context(|| format!("creating {}", scratch.0.display()))?;
        // `cargo xtask sweep` removes a sandbox only once this process is gone.
        std::fs::write(scratch.0.join("owner"), std::process::id().to_string())
            .context("recording the sandbox owner")?;
        let bpffs = BpfFs::mount(&std::env::temp_dir().join(format!("{PREFIX}-{tag}-bpffs")))?;
        let node = NetNs::create(&format!("{PREFIX}-{tag}-node"))?;
        let upstream = NetNs::create(&format!("{PREFIX}-{tag}-up"))?;
        let pod = NetNs::create(&format!("{PREFIX}-{tag}-pod"))?;
        let cgroup = TestCgroup::create(&root, &format!("{PREFIX}-{tag}"))?;
        let skipped = cgroup.child("cache")?;
        let sandbox = Self {
            servers: Vec::new(),
            skipped,
            cgroup,
            pod,
            upstream,
            node,
            bpffs,
            scratch,
            tools,
            tag,
        };
        sandbox.wire().context("wiring the sandbox network")?;
        Ok(sandbox)
    }

    fn wire(&self) -> anyhow::Result<()> {
        let tag = &self.tag;
        let (node, pod, up) = (&self.node, &self.pod, &self.upstream);
        // Before any link exists, so that every interface inherits it: no duplicate address
        // detection (addresses, link-local ones included, are usable at once, so NDP never waits
        // on a tentative address), and the node forwards between pod and upstreams.
        for netns in [node, pod, up] {
            netns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
            netns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
        }
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv6.conf.default.forwarding", "1")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        // Listener addresses on the node (their own namespace's loopback).
        for address in [
            format!("{NODE_LISTENER}/32"),
            format!("{CLUSTER_LISTENER}/32"),
        ] {
            node.ip(&["addr", "add", &address, "dev", "lo"])?;
        }
        node.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{V6_LISTENER}/128"),
            "dev",
            "lo",
            "nodad",
        ])?;

        let links = [
            (
                pod,
                format!("{PREFIX}{tag}np"),
                format!("{PREFIX}{tag}pn"),
                "1",
            ),
            (
                up,
                format!("{PREFIX}{tag}nu"),
                format!("{PREFIX}{tag}un"),
                "2",
            ),
        ];
        for (peer_ns, node_end, peer_end, net) in &links {
            node.ip(&[
                "link",
                "add",
                node_end,
                "type",
                "veth",
                "peer",
                "name",
                peer_end,
                "netns",
                peer_ns.name(),
            ])?;
            node.ip(&[
                "addr",
                "add",
                &format!("198.18.{net}.1/24"),
                "dev",
                node_end,
            ])?;
            node.ip(&[
                "-6",
                "addr",
                "add",
                &format!("fd00:{net}::1/64"),
                "dev",
                node_end,
                "nodad",
            ])?;
            node.ip(&["link", "set", node_end, "up"])?;
            peer_ns.ip(&["link", "set", peer_end, "up"])?;
        }
        pod.ip(&[
            "addr",
            "add",
            &format!("{}/24", topology::POD_V4),
            "dev",
            &links[0].2,
        ])?;
        pod.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{}/64", topology::POD_V6),
            "dev",
            &links[0].2,
            "nodad",
        ])?;
        for address in [topology::UPSTREAM_A_V4, topology::UPSTREAM_B_V4] {
            up.ip(&["addr", "add", &format!("{address}/24"), "dev", &links[1].2])?;
        }
        for address in [topology::UPSTREAM_A_V6, topology::UPSTREAM_B_V6] {
            up.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{address}/64"),
                "dev",
                &links[1].2,
                "nodad",
            ])?;
        }
        for (peer_ns, gateway_v4, gateway_v6) in [
            (pod, topology::NODE_POD_SIDE_V4, topology::NODE_POD_SIDE_V6),
            (
                up,
                topology::NODE_UPSTREAM_SIDE_V4,
                topology::NODE_UPSTREAM_SIDE_V6,
            ),
        ] {
            peer_ns.ip(&["route", "add", "default", "via", &gateway_v4.to_string()])?;
            peer_ns.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &gateway_v6.to_string(),
            ])?;
        }

        let resolv = format!("nameserver {NODE_LISTENER}\noptions timeout:2 attempts:1\n");
        pod.write_resolv_conf(&resolv)?;
        node.write_resolv_conf(&resolv)?;
        Ok(())
    }

    /// The namespace `ns`.
    #[must_use]
    pub fn netns(&self, ns: Ns) -> &NetNs {
        match ns {
            Ns::Node => &self.node,
            Ns::Pod => &self.pod,
            Ns::Upstream => &self.upstream,
        }
    }

    /// The cgroup the programs attach to; clients run in it.
    #[must_use]
    pub fn cgroup(&self) -> &TestCgroup {
        &self.cgroup
    }

    /// A child cgroup for "the cache's own queries", to configure as skipped.
    #[must_use]
    pub fn skipped_cgroup(&self) -> &TestCgroup {
        &self.skipped
    }

    /// The bpffs directory for the agent's pins.
    #[must_use]
    pub fn pin_dir(&self) -> PathBuf {
        self.bpffs.path().join("redirector")
    }

    /// The pinned array map `name` (of `names`), opened for a test to read or set by hand what
    /// the programs or an earlier agent would have left there.
    pub fn pinned_array<V: aya::Pod>(
        &self,
        name: &str,
    ) -> anyhow::Result<aya::maps::Array<aya::maps::MapData, V>> {
        use aya::maps::{Array, Map, MapData};
        let path = self.pin_dir().join("maps").join(name);
        let data =
            MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Array::try_from(Map::from_map_data(data)?)?)
    }

    /// The layout version the pinned maps record (`DATAPATH_CONFIG`).
    pub fn pinned_layout(&self) -> anyhow::Result<u32> {
        Ok(redirector::datapath::Maps::open_pinned(&self.pin_dir())?
            .datapath_config()?
            .layout_version)
    }

    /// The helper binaries.
    #[must_use]
    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// The node namespace's file, for `cache_netns`.
    #[must_use]
    pub fn node_netns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(self.node.name())
    }

    /// An agent configuration for this sandbox: its cgroup, pin directory, lock file and node
    /// namespace, probes every 250 ms with a 200 ms timeout (the defaults' hysteresis), the
    /// default stall limit, a signal hold of 1.5 s (the default's 6 s would only slow the tests
    /// that wait it out), the upstream checks' default interval and timeout, socket
    /// counts reconciled every 500 ms (all stretched by [`crate::pace`]), metrics on a free
    /// loopback port, the listener addresses left to the sandbox (they are on the node's
    /// loopback), then `listeners` (TOML `[[listener]]` sections).
    #[must_use]
    pub fn config_toml(&self, listeners: &str) -> String {
        self.config_toml_with(listeners, UNMANAGED_INTERFACE)
    }

    /// The same, with `tables` (TOML tables such as `[interface]` or `[kubernetes]`) instead of
    /// the default `[interface] manage = false`.
    #[must_use]
    pub fn config_toml_with(&self, listeners: &str, tables: &str) -> String {
        self.config_toml_probing(
            listeners,
            tables,
            paced(Duration::from_millis(250)),
            paced(Duration::from_millis(200)),
        )
    }

    /// The same, probing every `interval` with `timeout` (the benchmarks use the agent's
    /// defaults).
    #[must_use]
    pub fn config_toml_probing(
        &self,
        listeners: &str,
        tables: &str,
        interval: Duration,
        timeout: Duration,
    ) -> String {
        self.config_toml_with_probe(
            listeners,
            tables,
            &format!(
                "interval_ms = {}\ntimeout_ms = {}\nstall_after_ms = {}\nsignal_hold_ms = {}\n\
                 upstream_interval_ms = {}\nupstream_timeout_ms = {}\n",
                interval.as_millis(),
                timeout.as_millis(),
                paced_ms(redirector::config::DEFAULT_STALL_AFTER_MS),
                paced_ms(1500),
                // The upstream checks' defaults, stretched together, so that a slower machine
                // checks each target as often per timeout as the host does.
                paced_ms(redirector::config::DEFAULT_UPSTREAM_INTERVAL_MS),
                paced_ms(redirector::config::DEFAULT_UPSTREAM_TIMEOUT_MS),
            ),
        )
    }

    /// The same, with `probe` as the body of the `[probe]` table (hysteresis included).
    #[must_use]
    pub fn config_toml_with_probe(&self, listeners: &str, tables: &str, probe: &str) -> String {
        format!(
            "cgroup = {:?}\npin_dir = {:?}\nlock_file = {:?}\ndrain_socket = {:?}\ncache_netns = {:?}\nsocket_reconcile_interval_ms = {}\n\n[probe]\n{probe}\n[metrics]\naddress = \"127.0.0.1:0\"\n\n{tables}\n{listeners}",
            self.cgroup.path().display().to_string(),
            self.pin_dir().display().to_string(),
            self.lock_file().display().to_string(),
            self.drain_socket().display().to_string(),
            self.node_netns_path().display().to_string(),
            paced_ms(500),
        )
    }

    /// The agent's drain socket in this sandbox (`drain_socket`).
    #[must_use]
    pub fn drain_socket(&self) -> PathBuf {
        self.scratch.0.join("drain").join("drain.sock")
    }

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

    /// A command running `program` in `ns`, moved into `cgroup` before it executes. Keep the
    /// returned descriptor until the command is spawned.
    pub fn client_command(
        &self,
        ns: Ns,
        cgroup: &TestCgroup,
        program: &str,
    ) -> anyhow::Result<(Command, std::os::fd::OwnedFd)> {
        let procs = cgroup.procs()?;
        let mut command = self.netns(ns).command(program);
        join_cgroup_before_exec(&mut command, &procs);
        Ok((command, procs))
    }

    /// Runs one query with `dns-query` from `ns`, in `cgroup`.
    pub fn query_in(
        &self,
        ns: Ns,
        cgroup: &TestCgroup,
        query: Query,
    ) -> anyhow::Result<QueryOutcome> {
        let mut outcomes = self.queries_in(ns, cgroup, query, 1)?;
        outcomes.pop().context("dns-query printed no outcome")
    }

    /// Runs one query from `ns` in the sandbox's cgroup and returns every outcome it printed
    /// (two for a query sent to two servers with `Query::also`).
    pub fn query_all(&self, ns: Ns, query: Query) -> anyhow::Result<Vec<QueryOutcome>> {
        self.queries_in(ns, self.cgroup(), query, 1)
    }

    /// Runs `count` queries one after the other from `ns` in `cgroup`, each from a fresh socket.
    pub fn queries_in(
        &self,
        ns: Ns,
        cgroup: &TestCgroup,
        query: Query,
        count: u16,
    ) -> anyhow::Result<Vec<QueryOutcome>> {
        let (mut command, _procs) = self.dns_query_command(ns, cgroup, query, count)?;
        let output = output_within(&mut command, Duration::from_secs(60))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        stdout
            .lines()
            .map(|line| {
                serde_json::from_str(line.trim()).with_context(|| {
                    format!(
                        "dns-query printed {line:?} (stderr {:?})",
                        String::from_utf8_lossy(&output.stderr)
                    )
                })
            })
            .collect()
    }

    /// `dns-query` asking `query` `count` times, from `ns` in `cgroup` (keep the descriptor
    /// until the command is spawned).
    fn dns_query_command(
        &self,
        ns: Ns,
        cgroup: &TestCgroup,
        query: Query,
        count: u16,
    ) -> anyhow::Result<(Command, std::os::fd::OwnedFd)> {
        let (mut command, procs) =
            self.client_command(ns, cgroup, &self.tools.dns_query.display().to_string())?;
        command.args([
            "--server",
            &query.server.to_string(),
            "--transport",
            query.transport.arg(),
            "--count",
            &count.to_string(),
        ]);
        if query.mapped {
            command.arg("--mapped");
        }
        if query.aaaa {
            command.arg("--aaaa");
        }
        if let Some(also) = query.also {
            command.args(["--also", &also.to_string()]);
        }
        Ok((command, procs))
    }

    /// Starts `dns-query --hold` from `ns` in `cgroup`: `count` UDP queries of `query` from one
    /// long-lived socket, each after the first sent when [`HeldClient::ask`] asks. With
    /// `reopen`, a send that fails closes the socket and the query is asked again from a new one
    /// (`--reopen`), as c-ares and glibc do on a socket error.
    pub fn held_client(
        &self,
        ns: Ns,
        cgroup: &TestCgroup,
        query: Query,
        count: u16,
        reopen: bool,
    ) -> anyhow::Result<HeldClient> {
        self.spawn_held(ns, cgroup, query, count, reopen, false)
    }

    /// As [`Self::held_client`], but the first query too waits for [`HeldClient::ask`]: this
    /// returns once the client's socket is open (and connected, for `udp-connected`), so a test
    /// can change the route between the connect and the first send.
    pub fn held_client_idle(
        &self,
        ns: Ns,
        cgroup: &TestCgroup,
        query: Query,
        count: u16,
        reopen: bool,
    ) -> anyhow::Result<HeldClient> {
        use std::io::BufRead as _;
        let mut client = self.spawn_held(ns, cgroup, query, count, reopen, true)?;
        let mut line = String::new();
        client
            .stdout
            .read_line(&mut line)
            .context("reading whether the held client opened its socket")?;
        #[derive(serde::Deserialize)]
        struct Opened {
            opened: bool,
            monotonic_ns: u64,
        }
        match serde_json::from_str::<Opened>(line.trim()) {
            Ok(Opened {
                opened: true,
                monotonic_ns,
            }) => client.opened_ns = Some(monotonic_ns),
            _ => bail!("the held client did not open its socket: it printed {line:?}"),
        }
        client.started = true;
        Ok(client)
    }

    fn spawn_held(
        &self,
        ns: Ns,
        cgroup: &TestCgroup,
        query: Query,
        count: u16,
        reopen: bool,
        idle_first: bool,
    ) -> anyhow::Result<HeldClient> {
        let (mut command, _procs) = self.dns_query_command(ns, cgroup, query, count)?;
        command.arg("--hold");
        if reopen {
            command.arg("--reopen");
        }
        if idle_first {
            command.arg("--idle-first");
        }
        command
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {command:?}"))?;
        let stdin = child.stdin.take().context("dns-query's stdin is piped")?;
        let stdout = child.stdout.take().context("dns-query's stdout is piped")?;
        Ok(HeldClient {
            child,
            stdin,
            stdout: std::io::BufReader::new(stdout),
            started: false,
            opened_ns: None,
        })
    }

    /// Runs one query from `ns` in the test cgroup (where the programs apply).
    pub fn query(&self, ns: Ns, query: Query) -> anyhow::Result<QueryOutcome> {
        self.query_in(ns, &self.cgroup, query)
    }

    /// Asks `dig @server` for the probe name (A, or AAAA), over UDP or TCP.
    pub fn dig(&self, ns: Ns, server: IpAddr, tcp: bool, aaaa: bool) -> anyhow::Result<DigOutcome> {
        let (mut command, _procs) = self.client_command(ns, &self.cgroup, "dig")?;
        command.arg(format!("@{server}"));
        command.args([
            "+tries=1",
            "+time=2",
            "+short",
            crate::dns::PROBE_NAME,
            if aaaa { "AAAA" } else { "A" },
        ]);
        if tcp {
            command.arg("+tcp");
        }
        let output = output_within(&mut command, Duration::from_secs(10))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let answers = text
            .lines()
            .filter(|line| !line.starts_with(';'))
            .filter_map(|line| line.trim().parse().ok())
            .collect();
        Ok(DigOutcome {
            answers,
            output: text,
        })
    }

    /// Resolves the probe name with glibc (`getent ahosts`, or `ahostsv4`/`ahostsv6`), reading
    /// the namespace's resolv.conf.
    pub fn getent(&self, ns: Ns, database: &str) -> anyhow::Result<Vec<IpAddr>> {
        let (mut command, _procs) = self.client_command(ns, &self.cgroup, "getent")?;
        command.args([database, crate::dns::PROBE_NAME.trim_end_matches('.')]);
        let output = output_within(&mut command, Duration::from_secs(10))?;
        let mut addresses: Vec<IpAddr> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| line.split_whitespace().next()?.parse().ok())
            .collect();
        addresses.dedup();
        if addresses.is_empty() {
            bail!(
                "getent {database} resolved nothing (exit {}, stderr {:?})",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(addresses)
    }

    /// The sandbox's unique tag.
    #[must_use]
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The sandbox's scratch folder (removed with it), for files a test writes.
    #[must_use]
    pub fn scratch_dir(&self) -> &Path {
        &self.scratch.0
    }

    /// Writes `text` to `name` in the sandbox's scratch directory (readable by everyone) and
    /// returns the path.
    pub fn write_file(&self, name: &str, text: &str) -> anyhow::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = self.scratch.0.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        for open in [&self.scratch.0, &path] {
            std::fs::set_permissions(open, std::fs::Permissions::from_mode(0o755))
                .with_context(|| format!("opening up {}", open.display()))?;
        }
        Ok(path)
    }

    /// Copies the executable `from` into the sandbox's scratch directory as `name`, runnable by
    /// any user: a process of another user cannot reach it where cargo built it when the
    /// workspace is below a private directory (`/root`).
    ///
    /// `install(1)` writes the copy, never this process: a file this process had open for
    /// writing stays open in every child another test thread forks meanwhile, until that child
    /// execs, and executing the file then fails with ETXTBSY ("Text file busy"; seen in the VMs).
    pub fn copy_executable(&self, from: &Path, name: &str) -> anyhow::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = self.scratch.0.join(name);
        crate::command::run(
            "install",
            [
                "-m",
                "0755",
                &from.display().to_string(),
                &path.display().to_string(),
            ],
        )
        .with_context(|| format!("copying {} to {}", from.display(), path.display()))?;
        std::fs::set_permissions(&self.scratch.0, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("opening up {}", self.scratch.0.display()))?;
        Ok(path)
    }

    /// Writes the script `text` to `name` in the sandbox's scratch directory, executable, and
    /// returns its path. Written as a draft by this process, then installed by `install(1)` (see
    /// [`Self::copy_executable`]).
    pub fn write_executable(&self, name: &str, text: &str) -> anyhow::Result<PathBuf> {
        let draft = self.write_file(&format!("{name}.draft"), text)?;
        self.copy_executable(&draft, name)
    }

    /// A link of the sandbox's own in the node namespace for listener addresses the agent
    /// manages (`[interface] kind = "existing"`): one end of a veth pair, up. This kernel has no
    /// `dummy` driver; the pair goes away with the namespace.
    pub fn add_listener_link(&self) -> anyhow::Result<String> {
        let (link, peer) = (
            format!("{PREFIX}{}l0", self.tag),
            format!("{PREFIX}{}l1", self.tag),
        );
        self.node
            .ip(&["link", "add", &link, "type", "veth", "peer", "name", &peer])?;
        for end in [&link, &peer] {
            self.node.ip(&["link", "set", end, "up"])?;
        }
        Ok(link)
    }

    /// The agent's lock file in the sandbox's configurations.
    #[must_use]
    pub fn lock_file(&self) -> PathBuf {
        self.scratch.0.join("agent.lock")
    }

    /// What `bpftool cgroup show` lists on the sandbox's cgroup (empty: nothing attached).
    pub fn attached_programs(&self) -> anyhow::Result<String> {
        crate::command::run(
            "bpftool",
            ["cgroup", "show", &self.cgroup.path().display().to_string()],
        )
    }
}

/// The `redirector` binary under test: `$REDIRECTOR_BIN`, or the one cargo built next to the
/// test executable (`cargo xtask test` builds it first).
#[must_use]
pub fn redirector_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIRECTOR_BIN") {
        return PathBuf::from(path);
    }
    let beside_tests = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("redirector")));
    match beside_tests {
        Some(path) if path.exists() => path,
        _ => panic!(
            "the redirector binary is not built: run `cargo build -p redirector` first, or \
             `cargo xtask test`, which does (or set REDIRECTOR_BIN)"
        ),
    }
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
