//! The clients that query through the sandbox, in a namespace and a cgroup: `dns-query` runs
//! (one query, several, or a held socket the test paces), `dig` and glibc's `getent`.

use std::{
    net::{IpAddr, SocketAddr},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, bail};

use super::{Ns, Sandbox};
use crate::{
    cgroup::TestCgroup,
    command::{join_cgroup_before_exec, output_within},
    dns::QueryOutcome,
};

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
    /// Unconnected UDP's transport, from a socket connected to this address first: each query
    /// still sent to the server with `sendto`.
    pub connected_to: Option<SocketAddr>,
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
            connected_to: None,
        }
    }

    /// The same query from a UDP socket connected to `peer`, sent to the server with `sendto`
    /// (the kernel sends it to the server, and delivers the socket no reply but its peer's).
    #[must_use]
    pub fn connected_to(self, peer: SocketAddr) -> Self {
        Self {
            connected_to: Some(peer),
            ..self
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

impl Sandbox {
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

    /// Runs one query from `ns` in the test cgroup (where the programs apply).
    pub fn query(&self, ns: Ns, query: Query) -> anyhow::Result<QueryOutcome> {
        self.query_in(ns, &self.cgroup, query)
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
    pub fn dns_query_command(
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
        if let Some(peer) = query.connected_to {
            command.args(["--connected-to", &peer.to_string()]);
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
}
