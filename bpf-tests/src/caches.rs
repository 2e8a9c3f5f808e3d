//! Real caches for the failover tests: our test server, dnsmasq and unbound from Debian,
//! redirector's own embedded cache, and CoreDNS (what NodeLocal DNSCache and AKS LocalDNS run)
//! with either's Corefile, each run in the node namespace and the cache's cgroup, serving the
//! node listener's address.

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
    /// CoreDNS (`bpf-tests/go/coredns`) with a Corefile of this shape, forwarding to a test
    /// server on the node's loopback that answers as the cache, as the embedded cache does.
    CoreDns(Corefile),
}

/// The Corefiles CoreDNS runs with as a node cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Corefile {
    /// The one NodeLocal DNSCache's node-cache runs: its template (k8s.io/kubernetes
    /// `cluster/addons/dns/nodelocaldns/nodelocaldns.yaml`) with the pillars filled in: the
    /// cluster domain, in-addr.arpa and ip6.arpa forwarded over TCP to the cluster DNS, the rest
    /// to the upstream servers; `cache`, `reload`, `loop`, `bind`, `prometheus`, and `health`
    /// with no lameduck.
    NodeLocal,
    /// AKS LocalDNS's shape (one server block, as its documentation describes it): `forward`
    /// with a sequential policy, `cache` with `serve_stale`, `ready`, `nsid`, and `health` with a
    /// lameduck: after SIGTERM it goes on serving, sockets open, for the lameduck period.
    LocalDns,
    /// NodeLocal's, with `multisocket N` in every server block: N reuseport sockets of each
    /// protocol per address.
    NodeLocalMultisocket(u8),
}

/// LocalDNS's lameduck in the tests (its own is longer): long enough that a query sent after
/// SIGTERM and steered to the lingering CoreDNS would be answered and seen, short enough to keep
/// a restart brief.
pub const LOCALDNS_LAMEDUCK_MS: u64 = 2000;

impl CacheKind {
    /// The program's name, for tables and messages.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::TestServer => "dns-server",
            Self::Dnsmasq => "dnsmasq",
            Self::Unbound => "unbound",
            Self::Embedded => "embedded",
            Self::CoreDns(_) => "coredns",
        }
    }
}

/// Where the backend the embedded cache and CoreDNS forward to listens (the node namespace's
/// loopback).
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
    start_cache_in(sandbox, kind, name, address, &cgroup)
}

/// The same, in `cgroup` (below the attach point): a cache restarted in a new cgroup at every
/// restart, as a kubelet restarts a container. The test server starts in the cache's cgroup only.
pub fn start_cache_in(
    sandbox: &mut Sandbox,
    kind: CacheKind,
    name: &str,
    address: SocketAddr,
    cgroup: &std::path::Path,
) -> anyhow::Result<()> {
    let cgroup = cgroup.to_owned();
    match kind {
        CacheKind::TestServer => {
            anyhow::ensure!(
                cgroup == sandbox.skipped_cgroup().path(),
                "the test server starts as the cache in the cache's cgroup only"
            );
            sandbox.start_cache(
                name,
                &CacheSpec {
                    listen: vec![address],
                    ..CacheSpec::standard()
                },
            )
        }
        CacheKind::Dnsmasq => {
            let args: Vec<String> = [
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                // As its package runs it: root binds, then it drops to its own user.
                "--user=dnsmasq",
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
                    "server:\n  interface: {ip}\n  port: {port}\n  do-daemonize: no\n  username: \"unbound\"\n  chroot: \"\"\n  directory: \"/tmp\"\n  pidfile: \"\"\n  use-syslog: no\n  logfile: \"\"\n  verbosity: 1\n  num-threads: 1\n  access-control: 0.0.0.0/0 allow\n  local-zone: \"test.\" static\n  local-data: \"probe.redirector.test. 0 IN A {a}\"\nremote-control:\n  control-enable: no\n",
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
            start_backend(sandbox, name)?;
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
        CacheKind::CoreDns(corefile) => {
            start_backend(sandbox, name)?;
            let config = sandbox.write_file(
                &format!("Corefile-{name}"),
                &corefile_text(corefile, address),
            )?;
            let args = vec!["-conf".to_owned(), config.display().to_string()];
            let binary = crate::go_peers::binary("coredns")?.display().to_string();
            // It prints its version once every server block listens.
            sandbox.start_process(
                name,
                Some(Ns::Node),
                Some(&cgroup),
                &binary,
                &args,
                "CoreDNS-",
            )
        }
    }
}

/// Starts the test server the embedded cache and CoreDNS forward to (`{name}-backend`, on the
/// node's loopback, answering as the cache), unless it runs.
fn start_backend(sandbox: &mut Sandbox, name: &str) -> anyhow::Result<()> {
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
    Ok(())
}

/// The Corefile of `corefile`'s shape for a CoreDNS serving `address`. Its health, readiness and
/// metrics listen on that address too, as node-cache's do on its link-local one, so that no two
/// CoreDNS of a test share a port; every zone forwards to the backend (`EMBEDDED_BACKEND`): a
/// node cache forwards what it has not cached, and the backend's answers name the cache.
fn corefile_text(corefile: Corefile, address: SocketAddr) -> String {
    let ip = address.ip();
    let port = address.port();
    // `bind` and the side listeners take a bare address; IPv6 ones in brackets after it.
    let host = match ip {
        std::net::IpAddr::V4(v4) => v4.to_string(),
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
    };
    match corefile {
        Corefile::NodeLocal | Corefile::NodeLocalMultisocket(_) => {
            let multisocket = match corefile {
                Corefile::NodeLocalMultisocket(sockets) => format!("\n    multisocket {sockets}"),
                _ => String::new(),
            };
            // node-cache's template, pillars filled in: __PILLAR__DNS__DOMAIN__ cluster.local,
            // __PILLAR__LOCAL__DNS__ the listener, __PILLAR__CLUSTER__DNS__ and
            // __PILLAR__UPSTREAM__SERVERS__ the backend.
            let zone = |zone: &str, cache: &str, forward: &str, extra: &str| {
                format!(
                    "{zone}:{port} {{\n    errors\n    {cache}\n    reload\n    loop\n    bind {ip}{multisocket}\n    forward . {EMBEDDED_BACKEND}{forward}\n    prometheus {host}:9253{extra}\n}}\n"
                )
            };
            let tcp = " {\n        force_tcp\n    }";
            [
                zone(
                    "cluster.local",
                    "cache {\n        success 9984 30\n        denial 9984 5\n    }",
                    tcp,
                    &format!("\n    health {host}:8080"),
                ),
                zone("in-addr.arpa", "cache 30", tcp, ""),
                zone("ip6.arpa", "cache 30", tcp, ""),
                zone(".", "cache 30", "", ""),
            ]
            .concat()
        }
        Corefile::LocalDns => format!(
            ".:{port} {{\n    errors\n    bind {ip}\n    forward . {EMBEDDED_BACKEND} {{\n        policy sequential\n        max_concurrent 1000\n    }}\n    ready {host}:8181\n    cache 3600 {{\n        success 9984\n        denial 9984\n        serve_stale 3600s verify\n        servfail 0\n    }}\n    loop\n    nsid localdns\n    prometheus {host}:9253\n    health {host}:8080 {{\n        lameduck {LOCALDNS_LAMEDUCK_MS}ms\n    }}\n}}\n"
        ),
    }
}
