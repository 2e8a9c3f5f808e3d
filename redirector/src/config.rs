//! The agent's configuration file (TOML): parsing and every check that needs no privileges.
//!
//! Everything is validated before the agent touches the kernel; each refusal names the key
//! (`listener[1].upstreams[0]`) and says what to change.

use std::{
    collections::HashMap,
    net::{AddrParseError, IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use redirector_common::{
    DNS_PORT,
    listener::{LISTENER_NAME_MAX, MAX_LISTENERS},
    pool::MAX_POOL_TARGETS,
    reverse::REVERSE_NAT_DEFAULT_ENTRIES,
    settings::{EmptyPoolPolicy, Liveness},
};
use serde::Deserialize;

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

/// How the agent probes caches with real DNS queries.
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

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the configuration file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The file is not TOML of the expected shape (unknown key, wrong type, ...).
    #[error("the configuration file {path} is not valid (see the cause below for the key)")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the TOML parser said, with line and key.
        #[source]
        source: toml::de::Error,
    },
    /// No `[[listener]]` section.
    #[error("no listener is configured: add a [[listener]] section with a name and an address")]
    NoListeners,
    /// More listeners than the maps hold.
    #[error("{count} listeners are configured; at most {max} are supported")]
    TooManyListeners {
        /// How many were given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A name that is empty or does not fit the maps.
    #[error(
        "{key}: the name {name:?} must be 1 to {max} bytes long",
        max = LISTENER_NAME_MAX
    )]
    BadName {
        /// The offending key.
        key: String,
        /// The name given.
        name: String,
    },
    /// Two listeners with one name.
    #[error("{key}: the name {name:?} is already used by {first}; listener names must be unique")]
    DuplicateName {
        /// The offending key.
        key: String,
        /// The name.
        name: String,
        /// The key of the listener that has it first.
        first: String,
    },
    /// Two listeners with one address.
    #[error(
        "{key}: the address {address} is already the address of {first}; listener addresses must be unique"
    )]
    DuplicateAddress {
        /// The offending key.
        key: String,
        /// The address.
        address: IpAddr,
        /// The key of the listener that has it first.
        first: String,
    },
    /// Not an IP address (or `ip:port`).
    #[error("{key}: {value:?} is not {expected}")]
    BadAddress {
        /// The offending key.
        key: String,
        /// The text given.
        value: String,
        /// What was expected there.
        expected: &'static str,
        /// The parser's complaint.
        #[source]
        source: AddrParseError,
    },
    /// A listener address with a port.
    #[error(
        "{key}: {value:?} has a port; a listener always listens on port 53, give the address alone"
    )]
    ListenerPort {
        /// The offending key.
        key: String,
        /// The text given.
        value: String,
    },
    /// Port 0.
    #[error(
        "{key}: {value:?} has port 0, which no DNS server listens on; give the server's port, or none for 53"
    )]
    PortZero {
        /// The offending key.
        key: String,
        /// The text given.
        value: String,
    },
    /// An address no client can send DNS to.
    #[error("{key}: {address} cannot be a listener address ({why})")]
    UnusableListener {
        /// The offending key.
        key: String,
        /// The address.
        address: IpAddr,
        /// Why not.
        why: &'static str,
    },
    /// A cache or upstream of the other family.
    #[error(
        "{key}: {target} is {target_family} but the listener {listener:?} listens on {listener_family} \
         {address}; each listener's targets share its family, so give {target_family} servers to an \
         {target_family} listener",
        target_family = family(target.ip()),
        listener_family = family(*address),
    )]
    FamilyMismatch {
        /// The offending key.
        key: String,
        /// The target given.
        target: SocketAddr,
        /// The listener's name.
        listener: String,
        /// The listener's address.
        address: IpAddr,
    },
    /// More upstreams than a pool holds.
    #[error("{key}: {count} upstreams given; a pool holds at most {max}")]
    TooManyUpstreams {
        /// The offending key.
        key: String,
        /// How many were given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// More than one source of upstreams.
    #[error("{key}: give one of upstreams, kube_dns and resolv_conf, not several")]
    ConflictingSources {
        /// The listener's key.
        key: String,
    },
    /// A Service reference that is not `namespace/name`.
    #[error(
        "{key}: {value:?} is not a Service reference; write it as namespace/name, e.g. kube-system/kube-dns"
    )]
    BadService {
        /// The offending key.
        key: String,
        /// The text given.
        value: String,
    },
    /// An interface name the kernel would refuse.
    #[error(
        "interface.name: {name:?} is not a valid interface name (1 to 15 bytes, no '/', ':' or spaces)"
    )]
    BadInterfaceName {
        /// The text given.
        name: String,
    },
    /// Probe or reconcile settings that cannot work.
    #[error("{key}: {problem}")]
    BadTiming {
        /// The offending key.
        key: &'static str,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A probe name that is not a DNS name.
    #[error("{key}: {name:?} is not a DNS name (write it like localhost. or health.check.local.)")]
    BadProbeName {
        /// The offending key.
        key: String,
        /// The text given.
        name: String,
    },
    /// A metrics address that is no socket address.
    #[error(
        "metrics.address: {value:?} is not an address with a port (write it like 127.0.0.1:9353)"
    )]
    BadMetricsAddress {
        /// The value given.
        value: String,
        /// Why it does not parse.
        #[source]
        source: AddrParseError,
    },
    /// A reverse map that cannot work.
    #[error(
        "reverse_nat_entries: {value} is too small; give at least {min} (the default is {default})"
    )]
    ReverseNatTooSmall {
        /// The value given.
        value: u32,
        /// The smallest accepted.
        min: u32,
        /// The default.
        default: usize,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    cgroup: Option<PathBuf>,
    pin_dir: Option<PathBuf>,
    log_level: Option<String>,
    reverse_nat_entries: Option<u32>,
    #[serde(default)]
    kernel_log: bool,
    cache_netns: Option<PathBuf>,
    socket_reconcile_interval_ms: Option<u64>,
    lock_file: Option<PathBuf>,
    #[serde(default)]
    probe: RawProbe,
    #[serde(default)]
    interface: RawInterface,
    #[serde(default)]
    kubernetes: RawKubernetes,
    #[serde(default)]
    conntrack: RawConntrack,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default, rename = "listener")]
    listeners: Vec<RawListener>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawInterface {
    manage: Option<bool>,
    name: Option<String>,
    kind: Option<InterfaceKind>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawKubernetes {
    kubeconfig: Option<PathBuf>,
    resync_interval_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    enabled: Option<bool>,
    address: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConntrack {
    bypass: Option<bool>,
    nft: Option<PathBuf>,
    check_interval_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawProbe {
    name: Option<String>,
    interval_ms: Option<u64>,
    timeout_ms: Option<u64>,
    failures_to_fail_over: Option<u32>,
    successes_to_fail_back: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListener {
    name: String,
    address: String,
    cache: Option<String>,
    #[serde(default)]
    upstreams: Vec<String>,
    kube_dns: Option<String>,
    resolv_conf: Option<PathBuf>,
    #[serde(default)]
    empty_pool: EmptyPoolPolicy,
    #[serde(default)]
    skip_cgroups: Vec<PathBuf>,
    #[serde(default)]
    liveness: Liveness,
    probe_name: Option<String>,
}

/// Smallest accepted `reverse_nat_entries`.
const REVERSE_NAT_MIN_ENTRIES: u32 = 1024;
/// A probe is sent every `probe.interval_ms` whether or not the earlier ones answered: at most
/// this many of one cache may wait for their answer at once.
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
    Ok(ProbeSettings {
        name,
        interval,
        timeout,
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
    let target = match text.parse::<SocketAddr>() {
        Ok(target) => target,
        Err(with_port) => match text.parse::<IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, DNS_PORT),
            Err(_) => {
                return Err(ConfigError::BadAddress {
                    key: key.to_owned(),
                    value: text.to_owned(),
                    expected: "an address, `ip:port` or `[ipv6]:port`",
                    source: with_port,
                });
            }
        },
    };
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

fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
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
mod tests {
    use super::*;

    fn refusal(text: &str) -> String {
        let error = Config::parse(text).expect_err("the configuration must be refused");
        crate::error_chain(&error)
    }

    const AKS: &str = r#"
        cgroup = "/sys/fs/cgroup"
        [[listener]]
        name = "node"
        address = "169.254.10.10"
        upstreams = ["168.63.129.16"]
        [[listener]]
        name = "cluster"
        address = "169.254.10.11"
        cache = "169.254.10.11:53"
        upstreams = ["10.244.0.5:53", "10.244.1.7:1053"]
        empty_pool = "fail"
        skip_cgroups = ["/sys/fs/cgroup/kubepods.slice/cache"]
    "#;

    #[test]
    fn parses_a_full_configuration_with_defaults() {
        let config = Config::parse(AKS).unwrap();
        assert_eq!(config.cgroup, Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(config.pin_dir, PathBuf::from(DEFAULT_PIN_DIR));
        assert_eq!(
            config.reverse_nat_entries,
            REVERSE_NAT_DEFAULT_ENTRIES as u32
        );
        let node = &config.listeners[0];
        assert_eq!(node.cache, "169.254.10.10:53".parse().unwrap());
        assert_eq!(node.upstreams, vec!["168.63.129.16:53".parse().unwrap()]);
        assert_eq!(node.empty_pool, EmptyPoolPolicy::Pass);
        let (id, cluster) = config.listener("cluster").unwrap();
        assert_eq!(id, 1);
        assert_eq!(cluster.upstreams[1], "10.244.1.7:1053".parse().unwrap());
        assert_eq!(cluster.empty_pool, EmptyPoolPolicy::Fail);
        assert_eq!(cluster.skip_cgroups.len(), 1);
    }

    #[test]
    fn parses_ipv6_listeners_and_targets() {
        let config = Config::parse(
            r#"
            [[listener]]
            name = "v6"
            address = "fd00:53::10"
            cache = "[fd00:53::20]:5353"
            upstreams = ["fd00:53::1", "[fd00:53::2]:53"]
            "#,
        )
        .unwrap();
        let listener = &config.listeners[0];
        assert_eq!(listener.cache, "[fd00:53::20]:5353".parse().unwrap());
        assert_eq!(listener.upstreams[0], "[fd00:53::1]:53".parse().unwrap());
    }

    #[test]
    fn refuses_an_unparseable_address_naming_the_key() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.300"
            "#,
        );
        assert!(
            message.starts_with("listener[0] (\"node\").address: \"169.254.10.300\""),
            "{message}"
        );
    }

    #[test]
    fn refuses_an_unparseable_upstream_naming_the_key() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            upstreams = ["10.0.0.1", "ten.0.0.2"]
            "#,
        );
        assert!(
            message.starts_with("listener[0] (\"node\").upstreams[1]: \"ten.0.0.2\""),
            "{message}"
        );
    }

    #[test]
    fn refuses_port_zero() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            upstreams = ["10.0.0.1:0"]
            "#,
        );
        assert!(
            message.contains("upstreams[0]") && message.contains("port 0"),
            "{message}"
        );
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            cache = "169.254.20.10:0"
            "#,
        );
        assert!(
            message.contains(".cache") && message.contains("port 0"),
            "{message}"
        );
    }

    #[test]
    fn refuses_a_duplicate_listener_name() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            [[listener]]
            name = "node"
            address = "169.254.10.11"
            "#,
        );
        assert!(
            message
                .starts_with("listener[1].name: the name \"node\" is already used by listener[0]"),
            "{message}"
        );
    }

    #[test]
    fn refuses_a_duplicate_listener_address() {
        let message = refusal(
            r#"
            [[listener]]
            name = "a"
            address = "169.254.10.10"
            [[listener]]
            name = "b"
            address = "169.254.10.10"
            "#,
        );
        assert!(
            message.contains("listener[1].address") && message.contains("listener[0]"),
            "{message}"
        );
    }

    #[test]
    fn refuses_a_v6_backend_in_a_v4_pool() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            upstreams = ["10.0.0.1", "[fd00::1]:53"]
            "#,
        );
        assert!(
            message.starts_with("listener[0] (\"node\").upstreams[1]: [fd00::1]:53 is IPv6"),
            "{message}"
        );
    }

    #[test]
    fn refuses_a_cache_of_the_other_family() {
        let message = refusal(
            r#"
            [[listener]]
            name = "v6"
            address = "fd00::10"
            cache = "10.0.0.1:53"
            "#,
        );
        assert!(message.contains(".cache: 10.0.0.1:53 is IPv4"), "{message}");
    }

    #[test]
    fn refuses_a_listener_address_with_a_port() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10:53"
            "#,
        );
        assert!(message.contains("has a port"), "{message}");
    }

    #[test]
    fn refuses_unusable_listener_addresses() {
        for (address, why) in [
            ("0.0.0.0", "unspecified"),
            ("::", "unspecified"),
            ("224.0.0.53", "multicast"),
            ("::ffff:169.254.10.10", "IPv4-mapped"),
        ] {
            let message = refusal(&format!(
                "[[listener]]\nname = \"x\"\naddress = \"{address}\"\n"
            ));
            assert!(message.contains(why), "{address}: {message}");
        }
    }

    #[test]
    fn accepts_a_mapped_upstream_as_ipv4() {
        let config = Config::parse(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            upstreams = ["[::ffff:10.0.0.1]:53"]
            "#,
        )
        .unwrap();
        assert_eq!(
            config.listeners[0].upstreams[0],
            "10.0.0.1:53".parse().unwrap()
        );
    }

    #[test]
    fn refuses_unknown_keys_naming_them() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            upstream = ["10.0.0.1"]
            "#,
        );
        assert!(message.contains("upstream"), "{message}");
        assert!(message.contains("unknown field"), "{message}");
    }

    #[test]
    fn refuses_an_unknown_empty_pool_policy() {
        let message = refusal(
            r#"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            empty_pool = "drop"
            "#,
        );
        assert!(
            message.contains("empty_pool") || message.contains("drop"),
            "{message}"
        );
    }

    #[test]
    fn refuses_no_listeners_and_too_many() {
        assert!(refusal("").contains("no listener"));
        let many: String = (0..=MAX_LISTENERS)
            .map(|i| {
                format!(
                    "[[listener]]\nname = \"l{i}\"\naddress = \"10.1.{}.{}\"\n",
                    i / 250,
                    i % 250 + 1
                )
            })
            .collect();
        assert!(refusal(&many).contains("at most 64"));
    }

    #[test]
    fn refuses_bad_names() {
        assert!(
            refusal("[[listener]]\nname = \"\"\naddress = \"10.0.0.1\"\n")
                .contains("listener[0].name")
        );
        let long = "n".repeat(LISTENER_NAME_MAX + 1);
        assert!(
            refusal(&format!(
                "[[listener]]\nname = \"{long}\"\naddress = \"10.0.0.1\"\n"
            ))
            .contains("1 to 32 bytes")
        );
    }

    #[test]
    fn refuses_too_many_upstreams() {
        let upstreams: Vec<String> = (1..=MAX_POOL_TARGETS + 1)
            .map(|i| format!("\"10.0.1.{i}\""))
            .collect();
        let message = refusal(&format!(
            "[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\nupstreams = [{}]\n",
            upstreams.join(", ")
        ));
        assert!(
            message.contains("upstreams: 33 upstreams given"),
            "{message}"
        );
    }

    #[test]
    fn probe_settings_default_and_override() {
        let config = Config::parse("[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n").unwrap();
        assert_eq!(config.probe, ProbeSettings::default());
        assert_eq!(config.probe.interval, Duration::from_millis(100));
        assert_eq!(config.probe.timeout, Duration::from_millis(250));
        assert_eq!(config.probe.failures_to_fail_over, 2);
        assert_eq!(config.probe.successes_to_fail_back, 3);
        assert_eq!(config.listeners[0].probe_name, "localhost.");
        assert_eq!(config.listeners[0].liveness, Liveness::SocketsAndProbes);
        assert_eq!(
            config.socket_reconcile_interval,
            DEFAULT_SOCKET_RECONCILE_INTERVAL
        );

        let config = Config::parse(
            r#"
            cache_netns = "/run/netns/node"
            socket_reconcile_interval_ms = 1000
            [probe]
            name = "health.check.local"
            interval_ms = 200
            timeout_ms = 100
            failures_to_fail_over = 1
            successes_to_fail_back = 5
            [[listener]]
            name = "n"
            address = "10.0.0.1"
            liveness = "probes"
            probe_name = "other.local."
            "#,
        )
        .unwrap();
        assert_eq!(config.cache_netns, Some(PathBuf::from("/run/netns/node")));
        assert_eq!(config.probe.name, "health.check.local.");
        assert_eq!(config.probe.interval, Duration::from_millis(200));
        assert_eq!(config.listeners[0].liveness, Liveness::Probes);
        assert_eq!(config.listeners[0].probe_name, "other.local.");
    }

    #[test]
    fn refuses_probe_settings_that_cannot_work() {
        let listener = "[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n";
        for (probe, expected) in [
            (
                "interval_ms = 20\ntimeout_ms = 300",
                "probe.timeout_ms: 300 ms would keep more than 10 probes of a cache in flight",
            ),
            (
                "interval_ms = 0",
                "probe.interval_ms: 0 would probe without pause",
            ),
            (
                "timeout_ms = 0",
                "probe.timeout_ms: 0 would fail every probe",
            ),
            (
                "failures_to_fail_over = 0",
                "probe.failures_to_fail_over: 0",
            ),
            (
                "successes_to_fail_back = 0",
                "probe.successes_to_fail_back: 0",
            ),
            (
                "name = \"bad name\"",
                "probe.name: \"bad name\" is not a DNS name",
            ),
            ("name = \"a..b\"", "probe.name: \"a..b\" is not a DNS name"),
        ] {
            let message = refusal(&format!("[probe]\n{probe}\n{listener}"));
            assert!(message.starts_with(expected), "{probe}: {message}");
        }
        let message = refusal(&format!("{listener}probe_name = \"x y\"\n"));
        assert!(
            message.starts_with("listener[0] (\"n\").probe_name"),
            "{message}"
        );
    }

    #[test]
    fn upstream_sources_and_their_conflicts() {
        let config = Config::parse(
            r#"
            [[listener]]
            name = "cluster"
            address = "169.254.10.11"
            kube_dns = "kube-system/kube-dns"
            [[listener]]
            name = "node"
            address = "169.254.10.10"
            resolv_conf = "/run/systemd/resolve/resolv.conf"
            [[listener]]
            name = "static"
            address = "169.254.10.12"
            upstreams = ["10.0.0.1"]
            "#,
        )
        .unwrap();
        assert_eq!(
            config.listeners[0].source,
            UpstreamSource::Kubernetes {
                namespace: "kube-system".to_owned(),
                service: "kube-dns".to_owned()
            }
        );
        assert_eq!(
            config.listeners[1].source,
            UpstreamSource::ResolvConf(PathBuf::from("/run/systemd/resolve/resolv.conf"))
        );
        assert_eq!(config.listeners[2].source, UpstreamSource::Static);
        assert_eq!(config.kubernetes, KubernetesSettings::default());
        assert_eq!(config.interface, InterfaceSettings::default());
        assert_eq!(config.lock_file, PathBuf::from(DEFAULT_LOCK_FILE));
        assert_eq!(config.conntrack, ConntrackSettings::default());
        assert_eq!(config.metrics.address.to_string(), DEFAULT_METRICS_ADDRESS);
        assert!(config.metrics.enabled);
        assert!(config.conntrack.bypass);

        let message = refusal(
            "[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\nupstreams = [\"10.0.0.2\"]\nkube_dns = \"kube-system/kube-dns\"\n",
        );
        assert!(
            message.starts_with("listener[0] (\"n\"): give one of upstreams"),
            "{message}"
        );
        let message = refusal(
            "[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\nkube_dns = \"kube-dns\"\n",
        );
        assert!(
            message.starts_with(
                "listener[0] (\"n\").kube_dns: \"kube-dns\" is not a Service reference"
            ),
            "{message}"
        );
    }

    #[test]
    fn interface_settings_and_their_refusals() {
        let config = Config::parse(
            "[interface]\nmanage = false\nname = \"veth-dns\"\nkind = \"existing\"\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
        )
        .unwrap();
        assert_eq!(
            config.interface,
            InterfaceSettings {
                manage: false,
                name: "veth-dns".to_owned(),
                kind: InterfaceKind::Existing
            }
        );
        for name in ["", "a/b", "this-name-is-too-long", "with space"] {
            let message = refusal(&format!(
                "[interface]\nname = {name:?}\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n"
            ));
            assert!(message.starts_with("interface.name"), "{name}: {message}");
        }
    }

    #[test]
    fn conntrack_settings_and_their_refusals() {
        let config = Config::parse(
            "[conntrack]\nbypass = true\nnft = \"/usr/sbin/nft\"\ncheck_interval_ms = 1000\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
        )
        .unwrap();
        assert_eq!(
            config.conntrack,
            ConntrackSettings {
                bypass: true,
                nft: PathBuf::from("/usr/sbin/nft"),
                check_interval: Duration::from_secs(1),
            }
        );
        let message = refusal(
            "[conntrack]\ncheck_interval_ms = 0\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
        );
        assert!(
            message.starts_with("conntrack.check_interval_ms"),
            "{message}"
        );
        let message = refusal(
            "[conntrack]\nnotrack = true\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
        );
        assert!(message.contains("notrack"), "{message}");
        let message = refusal(
            "[metrics]\naddress = \"localhost\"\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
        );
        assert!(message.starts_with("metrics.address"), "{message}");
    }

    #[test]
    fn refuses_a_tiny_reverse_map() {
        let message = refusal(
            "reverse_nat_entries = 10\n[[listener]]\nname = \"n\"\naddress = \"10.0.0.1\"\n",
        );
        assert!(message.contains("reverse_nat_entries"), "{message}");
    }
}
