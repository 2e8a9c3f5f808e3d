//! The agent's configuration file (TOML): parsing and every check that needs no privileges.
//!
//! Everything is validated before the agent touches the kernel; each refusal names the key
//! (`listener[1].upstreams[0]`) and says what to change.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use redirector_common::{
    DNS_PORT,
    listener::{LISTENER_NAME_MAX, MAX_LISTENERS},
    parse_dns_server,
    pool::MAX_POOL_TARGETS,
    reverse::REVERSE_NAT_DEFAULT_ENTRIES,
    settings::{EmptyPoolPolicy, Liveness},
};
use serde::Deserialize;

use self::raw::{RawConfig, RawConntrack, RawInterface, RawListener, RawMetrics, RawProbe};
pub use self::{error::ConfigError, keys::keys};
use crate::sources::plausible::{self, Expect, Rejection};

mod error;
mod keys;
mod raw;

/// Where the agent pins its maps unless told otherwise.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/redirector";
/// The configuration file the CLI reads unless told otherwise.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/redirector/config.toml";
/// What probes ask unless told otherwise: caches answer `localhost` themselves (unbound, dnsmasq
/// and CoreDNS with its hosts file do), and NXDOMAIN counts as alive anyway.
pub const DEFAULT_PROBE_NAME: &str = "localhost.";
/// The listener interface unless told otherwise.
pub const DEFAULT_INTERFACE: &str = "redirector0";
/// The lock that keeps one agent per node unless told otherwise.
pub const DEFAULT_LOCK_FILE: &str = "/run/redirector/agent.lock";
/// The drain socket unless told otherwise: beside the lock, in a directory of its own that a
/// cache's pod can be given alone.
pub const DEFAULT_DRAIN_SOCKET: &str = "/run/redirector/drain/drain.sock";
/// How often socket counts are reconciled unless told otherwise.
pub const DEFAULT_SOCKET_RECONCILE_INTERVAL: Duration = Duration::from_secs(5);

/// A validated configuration.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Config {
    /// The cgroup v2 directory the programs attach to; `None`: the cgroup v2 root.
    pub cgroup: Option<PathBuf>,
    /// The bpffs directory the maps are pinned in.
    pub pin_dir: PathBuf,
    /// Log filter (`info`, `debug`, or a `tracing` directive).
    pub log_level: Option<String>,
    /// Entries of the reverse-translation LRU map.
    pub reverse_nat_entries: u32,
    /// The kernel programs log their decisions (aya-log) into the agent's log. For debugging:
    /// off, the logging code is removed by the verifier.
    pub kernel_log: bool,
    /// The network namespace the caches run in (a path such as `/proc/1/ns/net` or
    /// `/run/netns/NAME`); `None`: the agent's own. Only sockets bound there count as a cache's,
    /// and probes are sent from there.
    pub cache_netns: Option<PathBuf>,
    /// How the caches are probed.
    pub probe: ProbeSettings,
    /// How often the kernel's socket counts are compared with the socket tables.
    pub socket_reconcile_interval: Duration,
    /// The file locked by the running agent (one agent per node).
    pub lock_file: PathBuf,
    /// The unix socket on which caches' stop hooks ask for drains (`redirector drain
    /// --socket`); `None`: none is served.
    pub drain_socket: Option<PathBuf>,
    /// Where the listener addresses live.
    pub interface: InterfaceSettings,
    /// How the agent talks to Kubernetes (listeners with `kube_dns`).
    pub kubernetes: KubernetesSettings,
    /// The nftables table that keeps DNS to and from the caches out of conntrack.
    pub conntrack: ConntrackSettings,
    /// The HTTP endpoint for `/metrics`, `/healthz` and `/readyz`.
    pub metrics: MetricsSettings,
    /// The listeners, in file order.
    pub listeners: Vec<Listener>,
}

/// `probe.stall_after_ms` unless configured.
pub const DEFAULT_STALL_AFTER_MS: u64 = 80;
/// The shortest `probe.stall_after_ms` accepted.
const MIN_STALL_AFTER_MS: u64 = 20;
/// `probe.upstream_interval_ms` unless configured: CoreDNS's `forward` checks its upstreams
/// every 0.5 s too.
pub const DEFAULT_UPSTREAM_INTERVAL_MS: u64 = 500;
/// The shortest `probe.upstream_interval_ms` accepted: every node that routes upstream checks
/// every target of its pool at this pace.
const MIN_UPSTREAM_INTERVAL_MS: u64 = 100;
/// `probe.upstream_timeout_ms` unless configured: a check fails only when nothing answers, and a
/// kube-dns pod loaded by a fleet's failover can take hundreds of milliseconds to answer while it
/// serves. 2 s is well above that, and below the 5 s a glibc client waits for an answer: a target
/// silent that long fails its clients too.
pub const DEFAULT_UPSTREAM_TIMEOUT_MS: u64 = 2000;

/// How the agent probes caches with real DNS queries, and how the kernel's own judgements of a
/// cache (a stall, a signal) are weighed.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ProbeSettings {
    /// The name asked for (A); any answer or NXDOMAIN means alive.
    pub name: String,
    /// Time between probes of one cache (sent whether or not the earlier ones answered).
    pub interval: Duration,
    /// How long a probe waits for its answer (may exceed the interval).
    pub timeout: Duration,
    /// Consecutive failures that fail a listener over.
    pub failures_to_fail_over: u32,
    /// Consecutive successes that fail it back.
    pub successes_to_fail_back: u32,
    /// How long a cache may leave a query unread before the programs move its listener upstream
    /// (`None`: never).
    pub stall_after: Option<Duration>,
    /// How long after a terminating signal to the cache its probes' answers are not trusted to
    /// bring DNS back (a cache shutting down answers until it closes its sockets).
    pub signal_hold: Duration,
    /// Time between checks of each upstream target of a listener while it routes upstream, on
    /// average: each wait is drawn within ± 20 % of it (`None`: never checked).
    pub upstream_interval: Option<Duration>,
    /// How long a check of an upstream target waits for its answer: any answer by then keeps the
    /// target (slow is not dead), none fails the check.
    pub upstream_timeout: Duration,
}

impl Default for ProbeSettings {
    fn default() -> Self {
        Self {
            name: DEFAULT_PROBE_NAME.to_owned(),
            // A probe every 100 ms, each given 250 ms, two failures in a row: a hung cache is
            // failed over 350 to 450 ms after it stopped answering.
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(250),
            failures_to_fail_over: 2,
            successes_to_fail_back: 3,
            // Above the 50 ms a cache under a half-core CPU quota can sit throttled in a 100 ms
            // period; the flip comes within about 85 ms of the first unread query (the kernel's
            // coarse clock ticks every 4 ms at HZ=250).
            stall_after: Some(Duration::from_millis(DEFAULT_STALL_AFTER_MS)),
            // Above CoreDNS's `lameduck 5s`, the longest shutdown a shipped cache is told to take.
            signal_hold: Duration::from_secs(6),
            // With `failures_to_fail_over` failures in a row, a dead target leaves the kernel's
            // pool within about a second of the first check that finds it.
            upstream_interval: Some(Duration::from_millis(DEFAULT_UPSTREAM_INTERVAL_MS)),
            upstream_timeout: Duration::from_millis(DEFAULT_UPSTREAM_TIMEOUT_MS),
        }
    }
}

/// Where a listener's upstream pool comes from.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum UpstreamSource {
    /// `upstreams`, as configured.
    Static,
    /// The ready endpoints of a Service's EndpointSlices (kube-dns: the cluster listener).
    Kubernetes {
        /// The Service's namespace.
        namespace: String,
        /// The Service's name.
        service: String,
    },
    /// The `nameserver` lines of a resolv.conf (the node's upstreams: the node listener).
    ResolvConf(PathBuf),
}

/// Where the listener addresses live.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct InterfaceSettings {
    /// The agent owns the listener addresses (false: the cache creates them, as NodeLocal
    /// DNSCache does).
    pub manage: bool,
    /// The link's name.
    pub name: String,
    /// Create a `dummy` link, or use an `existing` one.
    pub kind: InterfaceKind,
}

impl Default for InterfaceSettings {
    fn default() -> Self {
        Self {
            manage: true,
            name: DEFAULT_INTERFACE.to_owned(),
            kind: InterfaceKind::Dummy,
        }
    }
}

/// How the listener interface comes to be.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InterfaceKind {
    /// A `dummy` link the agent creates (and `uninstall` deletes).
    #[default]
    Dummy,
    /// A link that exists already (kernels without the dummy driver; tests); the agent adds and
    /// removes only the listener addresses.
    Existing,
}

/// How the agent talks to Kubernetes.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct KubernetesSettings {
    /// A kubeconfig file; `None`: in-cluster, else `$KUBECONFIG` or `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// How often the pools are rewritten from the last known state even without events.
    pub resync_interval: Duration,
}

impl Default for KubernetesSettings {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            resync_interval: Duration::from_secs(60),
        }
    }
}

/// The default metrics address: loopback, because an agent on every node must not open an
/// unauthenticated port on every node's addresses unless the operator chooses to; 9353 is next to
/// CoreDNS's 9153 and unclaimed in Prometheus's list of default ports.
pub const DEFAULT_METRICS_ADDRESS: &str = "127.0.0.1:9353";

/// The HTTP endpoint for metrics and health.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct MetricsSettings {
    /// Serve it.
    pub enabled: bool,
    /// Where (port 0: any free port, for tests).
    pub address: SocketAddr,
}

impl Default for MetricsSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            address: DEFAULT_METRICS_ADDRESS
                .parse()
                .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 9353))),
        }
    }
}

/// The conntrack bypass: the agent's nftables table of raw-priority `notrack` rules.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ConntrackSettings {
    /// Install and keep the table (false: DNS to the listeners stays tracked).
    pub bypass: bool,
    /// The `nft` binary.
    pub nft: PathBuf,
    /// How often the table is compared with what the agent installed (and restored).
    pub check_interval: Duration,
}

impl Default for ConntrackSettings {
    fn default() -> Self {
        Self {
            bypass: true,
            nft: PathBuf::from("/usr/sbin/nft"),
            check_interval: Duration::from_secs(5),
        }
    }
}

/// One listener address and where its DNS goes.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Listener {
    /// Unique name, used by the CLI.
    pub name: String,
    /// The address clients send DNS to (port 53).
    pub address: IpAddr,
    /// Where DNS goes while the cache serves.
    pub cache: SocketAddr,
    /// Where DNS goes while it does not: this static list, unless `source` names a dynamic one.
    pub upstreams: Vec<SocketAddr>,
    /// Where the upstream pool comes from.
    pub source: UpstreamSource,
    /// What happens when the cache is down and `upstreams` is empty.
    pub empty_pool: EmptyPoolPolicy,
    /// cgroup v2 directories whose processes (and their descendants) are never steered for this
    /// listener: the cache's own queries.
    pub skip_cgroups: Vec<PathBuf>,
    /// What judges the cache alive.
    pub liveness: Liveness,
    /// The probe name for this listener's cache (overrides `probe.name`).
    pub probe_name: String,
}

/// Smallest accepted `reverse_nat_entries`.
const REVERSE_NAT_MIN_ENTRIES: u32 = 1024;
/// A probe is sent every `probe.interval_ms` whether or not the earlier ones answered: at most
/// this many of one cache may wait for their answer at once. The same bound holds for the checks
/// of one upstream target (`probe.upstream_timeout_ms` against `probe.upstream_interval_ms`).
const MAX_PROBES_IN_FLIGHT: u32 = 10;

impl Config {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|error| match error {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: path.to_owned(),
                source,
            },
            other => other,
        })
    }

    /// Parses and validates configuration text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: PathBuf::from("<text>"),
            source,
        })?;
        Self::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        if raw.listeners.is_empty() {
            return Err(ConfigError::NoListeners);
        }
        if raw.listeners.len() > MAX_LISTENERS {
            return Err(ConfigError::TooManyListeners {
                count: raw.listeners.len(),
                max: MAX_LISTENERS,
            });
        }
        let reverse_nat_entries = match raw.reverse_nat_entries {
            Some(value) if value < REVERSE_NAT_MIN_ENTRIES => {
                return Err(ConfigError::ReverseNatTooSmall {
                    value,
                    min: REVERSE_NAT_MIN_ENTRIES,
                    default: REVERSE_NAT_DEFAULT_ENTRIES,
                });
            }
            Some(value) => value,
            None => REVERSE_NAT_DEFAULT_ENTRIES as u32,
        };

        let probe = validate_probe(raw.probe)?;
        let socket_reconcile_interval = match raw.socket_reconcile_interval_ms {
            Some(0) => {
                return Err(ConfigError::BadTiming {
                    key: "socket_reconcile_interval_ms",
                    problem: "0 would reconcile in a busy loop; give milliseconds, e.g. 5000"
                        .to_owned(),
                });
            }
            Some(ms) => Duration::from_millis(ms),
            None => DEFAULT_SOCKET_RECONCILE_INTERVAL,
        };

        let interface = validate_interface(raw.interface)?;
        let kubernetes = KubernetesSettings {
            kubeconfig: raw.kubernetes.kubeconfig,
            resync_interval: match raw.kubernetes.resync_interval_ms {
                Some(0) => {
                    return Err(ConfigError::BadTiming {
                        key: "kubernetes.resync_interval_ms",
                        problem: "0 would resync in a busy loop; give milliseconds, e.g. 60000"
                            .to_owned(),
                    });
                }
                Some(ms) => Duration::from_millis(ms),
                None => KubernetesSettings::default().resync_interval,
            },
        };

        let conntrack = validate_conntrack(raw.conntrack)?;
        let metrics = validate_metrics(raw.metrics)?;

        let mut names: HashMap<String, String> = HashMap::new();
        let mut addresses: HashMap<IpAddr, String> = HashMap::new();
        let mut listeners = Vec::with_capacity(raw.listeners.len());
        for (index, raw_listener) in raw.listeners.into_iter().enumerate() {
            let key = format!("listener[{index}]");
            let listener = validate_listener(&key, raw_listener, &probe.name)?;
            if let Some(first) = names.get(&listener.name) {
                return Err(ConfigError::DuplicateName {
                    key: format!("{key}.name"),
                    name: listener.name,
                    first: first.clone(),
                });
            }
            if let Some(first) = addresses.get(&listener.address) {
                return Err(ConfigError::DuplicateAddress {
                    key: format!("{key}.address"),
                    address: listener.address,
                    first: first.clone(),
                });
            }
            names.insert(listener.name.clone(), key.clone());
            addresses.insert(listener.address, key);
            listeners.push(listener);
        }
        check_static_upstreams(&listeners, &addresses.keys().copied().collect())?;

        Ok(Self {
            cgroup: raw.cgroup,
            pin_dir: raw
                .pin_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_PIN_DIR)),
            log_level: raw.log_level,
            reverse_nat_entries,
            kernel_log: raw.kernel_log,
            cache_netns: raw.cache_netns,
            probe,
            socket_reconcile_interval,
            lock_file: raw
                .lock_file
                .unwrap_or_else(|| PathBuf::from(DEFAULT_LOCK_FILE)),
            drain_socket: match raw.drain_socket {
                None => Some(PathBuf::from(DEFAULT_DRAIN_SOCKET)),
                Some(path) if path.as_os_str().is_empty() => None,
                Some(path) => Some(path),
            },
            interface,
            kubernetes,
            conntrack,
            metrics,
            listeners,
        })
    }

    /// The listener called `name`, with its id.
    #[must_use]
    pub fn listener(&self, name: &str) -> Option<(u32, &Listener)> {
        self.listeners
            .iter()
            .enumerate()
            .find(|(_, listener)| listener.name == name)
            .map(|(id, listener)| (id as u32, listener))
    }
}

fn validate_metrics(raw: RawMetrics) -> Result<MetricsSettings, ConfigError> {
    let defaults = MetricsSettings::default();
    let address = match raw.address {
        Some(text) => {
            text.parse::<SocketAddr>()
                .map_err(|source| ConfigError::BadMetricsAddress {
                    value: text.clone(),
                    source,
                })?
        }
        None => defaults.address,
    };
    Ok(MetricsSettings {
        enabled: raw.enabled.unwrap_or(defaults.enabled),
        address,
    })
}

fn validate_conntrack(raw: RawConntrack) -> Result<ConntrackSettings, ConfigError> {
    let defaults = ConntrackSettings::default();
    let check_interval = match raw.check_interval_ms {
        Some(0) => {
            return Err(ConfigError::BadTiming {
                key: "conntrack.check_interval_ms",
                problem: "0 would check in a busy loop; give milliseconds, e.g. 5000".to_owned(),
            });
        }
        Some(ms) => Duration::from_millis(ms),
        None => defaults.check_interval,
    };
    Ok(ConntrackSettings {
        bypass: raw.bypass.unwrap_or(defaults.bypass),
        nft: raw.nft.unwrap_or(defaults.nft),
        check_interval,
    })
}

fn validate_interface(raw: RawInterface) -> Result<InterfaceSettings, ConfigError> {
    let defaults = InterfaceSettings::default();
    let name = raw.name.unwrap_or(defaults.name);
    let valid = !name.is_empty()
        && name.len() <= 15
        && !name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace());
    if !valid {
        return Err(ConfigError::BadInterfaceName { name });
    }
    Ok(InterfaceSettings {
        manage: raw.manage.unwrap_or(defaults.manage),
        name,
        kind: raw.kind.unwrap_or(defaults.kind),
    })
}

fn validate_probe(raw: RawProbe) -> Result<ProbeSettings, ConfigError> {
    let defaults = ProbeSettings::default();
    let name = match raw.name {
        Some(name) => checked_dns_name("probe.name", name)?,
        None => defaults.name,
    };
    let interval = raw
        .interval_ms
        .map_or(defaults.interval, Duration::from_millis);
    let timeout = raw
        .timeout_ms
        .map_or(defaults.timeout, Duration::from_millis);
    if timeout.is_zero() {
        return Err(ConfigError::BadTiming {
            key: "probe.timeout_ms",
            problem: "0 would fail every probe; give milliseconds, e.g. 300".to_owned(),
        });
    }
    if interval.is_zero() {
        return Err(ConfigError::BadTiming {
            key: "probe.interval_ms",
            problem: "0 would probe without pause; give milliseconds, e.g. 100".to_owned(),
        });
    }
    if timeout > interval * MAX_PROBES_IN_FLIGHT {
        return Err(ConfigError::BadTiming {
            key: "probe.timeout_ms",
            problem: format!(
                "{} ms would keep more than {MAX_PROBES_IN_FLIGHT} probes of a cache in flight \
                 (one is sent every interval_ms, {} ms): shorten it or lengthen interval_ms",
                timeout.as_millis(),
                interval.as_millis()
            ),
        });
    }
    let failures_to_fail_over = raw
        .failures_to_fail_over
        .unwrap_or(defaults.failures_to_fail_over);
    let successes_to_fail_back = raw
        .successes_to_fail_back
        .unwrap_or(defaults.successes_to_fail_back);
    for (key, value) in [
        ("probe.failures_to_fail_over", failures_to_fail_over),
        ("probe.successes_to_fail_back", successes_to_fail_back),
    ] {
        if value == 0 {
            return Err(ConfigError::BadTiming {
                key,
                problem: "0 would decide without a single probe; give at least 1".to_owned(),
            });
        }
    }
    let stall_after = match raw.stall_after_ms {
        None => defaults.stall_after,
        Some(0) => None,
        Some(ms) if ms < MIN_STALL_AFTER_MS => {
            return Err(ConfigError::BadTiming {
                key: "probe.stall_after_ms",
                problem: format!(
                    "{ms} ms is within a busy cache's scheduling jitter and would move its DNS \
                     upstream while it serves; give at least {MIN_STALL_AFTER_MS} (the default is \
                     {DEFAULT_STALL_AFTER_MS}), or 0 to turn stall detection off"
                ),
            });
        }
        Some(ms) => Some(Duration::from_millis(ms)),
    };
    let signal_hold = raw
        .signal_hold_ms
        .map_or(defaults.signal_hold, Duration::from_millis);
    let upstream_interval = match raw.upstream_interval_ms {
        None => defaults.upstream_interval,
        Some(0) => None,
        Some(ms) if ms < MIN_UPSTREAM_INTERVAL_MS => {
            return Err(ConfigError::BadTiming {
                key: "probe.upstream_interval_ms",
                problem: format!(
                    "{ms} ms: every node routing upstream would check every target {} times a \
                     second; give at least {MIN_UPSTREAM_INTERVAL_MS} (the default is \
                     {DEFAULT_UPSTREAM_INTERVAL_MS}), or 0 to never check upstreams",
                    1000 / ms.max(1)
                ),
            });
        }
        Some(ms) => Some(Duration::from_millis(ms)),
    };
    let upstream_timeout = raw
        .upstream_timeout_ms
        .map_or(defaults.upstream_timeout, Duration::from_millis);
    if upstream_timeout.is_zero() {
        return Err(ConfigError::BadTiming {
            key: "probe.upstream_timeout_ms",
            problem: format!(
                "0 would fail every check and take every answering target out; give \
                 milliseconds above the slowest answer of a serving upstream (the default is \
                 {DEFAULT_UPSTREAM_TIMEOUT_MS})"
            ),
        });
    }
    if let Some(upstream_interval) = upstream_interval
        && upstream_timeout > upstream_interval * MAX_PROBES_IN_FLIGHT
    {
        return Err(ConfigError::BadTiming {
            key: "probe.upstream_timeout_ms",
            problem: format!(
                "{} ms would keep more than {MAX_PROBES_IN_FLIGHT} checks of a target in flight \
                 (one is sent about every upstream_interval_ms, {} ms): shorten it or lengthen \
                 upstream_interval_ms",
                upstream_timeout.as_millis(),
                upstream_interval.as_millis()
            ),
        });
    }
    Ok(ProbeSettings {
        name,
        interval,
        timeout,
        stall_after,
        signal_hold,
        upstream_interval,
        upstream_timeout,
        failures_to_fail_over,
        successes_to_fail_back,
    })
}

/// A DNS name as probes send it (fully qualified, with the trailing dot).
fn checked_dns_name(key: &str, name: String) -> Result<String, ConfigError> {
    let labels_ok = name.trim_end_matches('.').split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
    });
    if name.is_empty() || name.len() > 253 || !labels_ok {
        return Err(ConfigError::BadProbeName {
            key: key.to_owned(),
            name,
        });
    }
    Ok(if name.ends_with('.') {
        name
    } else {
        format!("{name}.")
    })
}

/// Gives static upstreams the checks the sources' addresses get (`sources::plausible`, as for a
/// node's nameservers: link-local allowed): a loopback address is, for a pod, the pod itself, and
/// a listener address would steer failed-over DNS back to the listener.
fn check_static_upstreams(
    listeners: &[Listener],
    addresses: &HashSet<IpAddr>,
) -> Result<(), ConfigError> {
    for (index, listener) in listeners.iter().enumerate() {
        for (position, upstream) in listener.upstreams.iter().enumerate() {
            let Err(reason) = plausible::check(
                upstream.ip(),
                listener.address,
                addresses,
                Expect::Nameserver,
            ) else {
                continue;
            };
            let why = match reason {
                Rejection::Loopback => {
                    "a loopback address is, for a pod, the pod itself. Give the resolver's \
                     address on the network (for systemd-resolved's stub 127.0.0.53, use \
                     resolv_conf = \"/run/systemd/resolve/resolv.conf\" instead)"
                }
                Rejection::Listener => {
                    "it is a listener address, so failed-over DNS would be steered back to a \
                     listener. Give the servers behind it"
                }
                Rejection::Unspecified => "0.0.0.0 and :: are no server. Give a server's address",
                Rejection::Multicast => {
                    "a multicast or broadcast address is no server. Give a server's address"
                }
                Rejection::Unparseable
                | Rejection::LinkLocal
                | Rejection::WrongFamily
                | Rejection::NoDnsPort => "it is no usable server address",
            };
            return Err(ConfigError::ImplausibleUpstream {
                key: format!(
                    "listener[{index}] ({:?}).upstreams[{position}]",
                    listener.name
                ),
                address: *upstream,
                why,
            });
        }
    }
    Ok(())
}

fn validate_listener(
    key: &str,
    raw: RawListener,
    default_probe_name: &str,
) -> Result<Listener, ConfigError> {
    if raw.name.is_empty() || raw.name.len() > LISTENER_NAME_MAX {
        return Err(ConfigError::BadName {
            key: format!("{key}.name"),
            name: raw.name,
        });
    }
    let key = format!("{key} ({:?})", raw.name);

    let address_key = format!("{key}.address");
    let address = parse_listener_address(&address_key, &raw.address)?;

    let cache_key = format!("{key}.cache");
    let cache = match &raw.cache {
        Some(text) => parse_target(&cache_key, text)?,
        None => SocketAddr::new(address, DNS_PORT),
    };
    check_family(&cache_key, cache, &raw.name, address)?;

    if raw.upstreams.len() > MAX_POOL_TARGETS {
        return Err(ConfigError::TooManyUpstreams {
            key: format!("{key}.upstreams"),
            count: raw.upstreams.len(),
            max: MAX_POOL_TARGETS,
        });
    }
    let upstreams = raw
        .upstreams
        .iter()
        .enumerate()
        .map(|(index, text)| {
            let upstream_key = format!("{key}.upstreams[{index}]");
            let upstream = parse_target(&upstream_key, text)?;
            check_family(&upstream_key, upstream, &raw.name, address)?;
            Ok(upstream)
        })
        .collect::<Result<Vec<_>, ConfigError>>()?;

    let source = match (&raw.kube_dns, &raw.resolv_conf, raw.upstreams.is_empty()) {
        (None, None, _) => UpstreamSource::Static,
        (Some(service), None, true) => {
            let (namespace, name) = service
                .split_once('/')
                .filter(|(namespace, name)| {
                    !namespace.is_empty() && !name.is_empty() && !name.contains('/')
                })
                .ok_or_else(|| ConfigError::BadService {
                    key: format!("{key}.kube_dns"),
                    value: service.clone(),
                })?;
            UpstreamSource::Kubernetes {
                namespace: namespace.to_owned(),
                service: name.to_owned(),
            }
        }
        (None, Some(path), true) => UpstreamSource::ResolvConf(path.clone()),
        _ => return Err(ConfigError::ConflictingSources { key }),
    };

    let probe_name = match raw.probe_name {
        Some(name) => checked_dns_name(&format!("{key}.probe_name"), name)?,
        None => default_probe_name.to_owned(),
    };

    Ok(Listener {
        name: raw.name,
        address,
        cache,
        upstreams,
        source,
        empty_pool: raw.empty_pool,
        skip_cgroups: raw.skip_cgroups,
        liveness: raw.liveness,
        probe_name,
    })
}

fn parse_listener_address(key: &str, text: &str) -> Result<IpAddr, ConfigError> {
    let address: IpAddr = match text.parse() {
        Ok(address) => address,
        Err(source) => {
            return Err(if text.parse::<SocketAddr>().is_ok() {
                ConfigError::ListenerPort {
                    key: key.to_owned(),
                    value: text.to_owned(),
                }
            } else {
                ConfigError::BadAddress {
                    key: key.to_owned(),
                    value: text.to_owned(),
                    expected: "an IPv4 or IPv6 address",
                    source,
                }
            });
        }
    };
    let unusable = |why| {
        Err(ConfigError::UnusableListener {
            key: key.to_owned(),
            address,
            why,
        })
    };
    if address.is_unspecified() {
        return unusable("it is the unspecified address");
    }
    if address.is_multicast() {
        return unusable("it is a multicast address");
    }
    if let IpAddr::V6(v6) = address
        && v6.to_ipv4_mapped().is_some()
    {
        return unusable(
            "it is IPv4-mapped; write the IPv4 address, dual-stack sockets are steered too",
        );
    }
    Ok(address)
}

/// `ip`, `ip:port` or `[ipv6]:port`; port 53 when none is given.
fn parse_target(key: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    let target = parse_dns_server(text).map_err(|source| ConfigError::BadAddress {
        key: key.to_owned(),
        value: text.to_owned(),
        expected: "an address, `ip:port` or `[ipv6]:port`",
        source,
    })?;
    if target.port() == 0 {
        return Err(ConfigError::PortZero {
            key: key.to_owned(),
            value: text.to_owned(),
        });
    }
    // `::ffff:a.b.c.d` is IPv4 to the kernel programs; keep it as such here too.
    let ip = target.ip().to_canonical();
    Ok(SocketAddr::new(ip, target.port()))
}

fn check_family(
    key: &str,
    target: SocketAddr,
    listener: &str,
    address: IpAddr,
) -> Result<(), ConfigError> {
    if target.is_ipv4() == address.is_ipv4() {
        return Ok(());
    }
    Err(ConfigError::FamilyMismatch {
        key: key.to_owned(),
        target,
        listener: listener.to_owned(),
        address,
    })
}

#[cfg(test)]
mod tests;
