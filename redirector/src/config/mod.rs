//! The agent's configuration file (TOML): parsing and every check that needs no privileges.
//!
//! Everything is validated before the agent touches the kernel; each refusal names the key
//! (`listener[1].upstreams[0]`) and says what to change.
//!
//! One idea a module: the whole file and its defaults (here), the listeners (`listener`), the
//! probes of caches and upstreams (`probe`), the other agent-wide sections (`settings`: the
//! listener interface, Kubernetes, metrics, conntrack), DNS per workload (`workloads`), serde's
//! view of the file (`raw`) and the refusals (`error`).

use std::{
    collections::HashMap,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use redirector_common::{listener::MAX_LISTENERS, reverse::REVERSE_NAT_DEFAULT_ENTRIES};

pub use self::{
    error::ConfigError,
    keys::keys,
    listener::{Listener, UpstreamSource},
    probe::{
        DEFAULT_PROBE_NAME, DEFAULT_STALL_AFTER_MS, DEFAULT_UPSTREAM_INTERVAL_MS,
        DEFAULT_UPSTREAM_TIMEOUT_MS, ProbeSettings,
    },
    settings::{
        ConntrackSettings, DEFAULT_INTERFACE, DEFAULT_METRICS_ADDRESS, InterfaceKind,
        InterfaceSettings, KubernetesSettings, MetricsSettings,
    },
    workloads::{RateLimit, WorkloadSettings},
};
use self::{
    listener::{check_static_upstreams, validate_listener},
    probe::validate_probe,
    raw::RawConfig,
    settings::{validate_conntrack, validate_interface, validate_kubernetes, validate_metrics},
    workloads::validate_workloads,
};

mod error;
mod keys;
mod listener;
mod probe;
mod raw;
mod settings;
mod workloads;

/// Where the agent pins its maps unless told otherwise.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/redirector";
/// The configuration file the CLI reads unless told otherwise.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/redirector/config.toml";
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
    /// DNS per workload.
    pub workloads: WorkloadSettings,
    /// The listeners, in file order.
    pub listeners: Vec<Listener>,
}

/// Smallest accepted `reverse_nat_entries`.
const REVERSE_NAT_MIN_ENTRIES: u32 = 1024;

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
        let kubernetes = validate_kubernetes(raw.kubernetes)?;

        let conntrack = validate_conntrack(raw.conntrack)?;
        let metrics = validate_metrics(raw.metrics)?;
        let workloads = validate_workloads(raw.workloads)?;

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
            workloads,
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

#[cfg(test)]
mod tests;
