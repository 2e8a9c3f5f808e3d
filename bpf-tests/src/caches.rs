//! Real caches for the failover tests: our test server, dnsmasq and unbound from Debian, and
//! redirector's own embedded cache, each run in the node namespace and the cache's cgroup,
//! serving the node listener's address.

use std::net::SocketAddr;

use crate::{
    pace::paced_ms,
    sandbox::{CacheSpec, Ns, Sandbox},
    topology::{CACHE, NODE_LISTENER, dns},
};

/// Which program serves as the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheKind {
    /// `dns-server` (one UDP and one TCP socket per address).
    TestServer,
    /// dnsmasq (Debian's dnsmasq-base).
    Dnsmasq,
    /// unbound (Debian's unbound).
    Unbound,
    /// `redirector cache`, forwarding to a test server on the node's loopback that answers as
    /// the cache (so its answers are told apart from the upstreams').
    Embedded,
}

impl CacheKind {
    /// The program's name, for tables and messages.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::TestServer => "dns-server",
            Self::Dnsmasq => "dnsmasq",
            Self::Unbound => "unbound",
            Self::Embedded => "embedded",
        }
    }

    /// Every kind.
    pub const ALL: [Self; 4] = [
        Self::TestServer,
        Self::Dnsmasq,
        Self::Unbound,
        Self::Embedded,
    ];
}

/// Where the embedded cache's backend listens (the node namespace's loopback).
const EMBEDDED_BACKEND: &str = "127.0.0.1:5300";

/// Starts `kind` as process `name`, serving `NODE_LISTENER:53` and answering the probe names
/// (`localhost.` and the test name) with the cache's identity.
pub fn start_cache(sandbox: &mut Sandbox, kind: CacheKind, name: &str) -> anyhow::Result<()> {
    start_cache_at(sandbox, kind, name, dns(NODE_LISTENER))
}

/// The same, serving `address` (an address of the node namespace).
pub fn start_cache_at(
    sandbox: &mut Sandbox,
    kind: CacheKind,
    name: &str,
    address: SocketAddr,
) -> anyhow::Result<()> {
    let cgroup = sandbox.skipped_cgroup().path().to_owned();
    match kind {
        CacheKind::TestServer => sandbox.start_cache(
            name,
            &CacheSpec {
                listen: vec![address],
                ..CacheSpec::standard()
            },
        ),
        CacheKind::Dnsmasq => {
            let args: Vec<String> = [
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--user=root",
                "--pid-file=",
                "--log-facility=-",
                "--cache-size=0",
            ]
            .iter()
            .map(|arg| (*arg).to_owned())
            .chain([
                format!("--listen-address={}", address.ip()),
                format!("--port={}", address.port()),
                format!("--address=/#/{}", CACHE.a),
            ])
            .collect();
            sandbox.start_process(
                name,
                Some(Ns::Node),
                Some(&cgroup),
                "dnsmasq",
                &args,
                "started",
            )
        }
        CacheKind::Unbound => {
            let config = sandbox.write_file(
                &format!("unbound-{name}.conf"),
                &format!(
                    "server:\n  interface: {ip}\n  port: {port}\n  do-daemonize: no\n  username: \"\"\n  chroot: \"\"\n  directory: \"/tmp\"\n  pidfile: \"\"\n  use-syslog: no\n  logfile: \"\"\n  verbosity: 1\n  num-threads: 1\n  access-control: 0.0.0.0/0 allow\n  local-zone: \"test.\" static\n  local-data: \"probe.redirector.test. 0 IN A {a}\"\nremote-control:\n  control-enable: no\n",
                    ip = address.ip(),
                    port = address.port(),
                    a = CACHE.a,
                ),
            )?;
            let args = vec![
                "-d".to_owned(),
                "-c".to_owned(),
                config.display().to_string(),
            ];
            sandbox.start_process(
                name,
                Some(Ns::Node),
                Some(&cgroup),
                "unbound",
                &args,
                "start of service",
            )
        }
        CacheKind::Embedded => {
            let backend = format!("{name}-backend");
            if sandbox.process(&backend).is_err() {
                sandbox.start_cache(
                    &backend,
                    &CacheSpec {
                        listen: vec![EMBEDDED_BACKEND.parse()?],
                        ..CacheSpec::standard()
                    },
                )?;
            }
            // The forwarding hop gets the machine's pace like every other wait: a fixed 200 ms
            // answered SERVFAIL under a VM's TCG, where a freshly started cache's first exchange
            // can take longer. It stays below the test clients' own (paced 300 ms) timeout.
            let upstream_timeout_ms = paced_ms(200);
            let config = sandbox.write_file(
                &format!("embedded-{name}.toml"),
                &format!(
                    "listen = [\"{address}\"]\ndefault_servers = [\"{EMBEDDED_BACKEND}\"]\nupstream_timeout_ms = {upstream_timeout_ms}\n# The sandbox's pods and node use 198.18.0.0/15 and fd00::/8 (benchmark ranges).\nallow = [\"127.0.0.0/8\", \"169.254.0.0/16\", \"198.18.0.0/15\", \"fd00::/8\"]\n"
                ),
            )?;
            let args = vec![
                "cache".to_owned(),
                "--config".to_owned(),
                config.display().to_string(),
            ];
            let binary = crate::sandbox::redirector_bin().display().to_string();
            sandbox.start_process(
                name,
                Some(Ns::Node),
                Some(&cgroup),
                &binary,
                &args,
                "DNS cache serving",
            )
        }
    }
}
