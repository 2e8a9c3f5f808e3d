//! The agent-wide sections besides the probes, each with its defaults and its validation: the
//! listener interface (`[interface]`), Kubernetes (`[kubernetes]`), the metrics endpoint
//! (`[metrics]`) and the conntrack bypass (`[conntrack]`).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use serde::Deserialize;

use super::{
    ConfigError,
    raw::{RawConntrack, RawInterface, RawKubernetes, RawMetrics},
};

/// The listener interface unless told otherwise.
pub const DEFAULT_INTERFACE: &str = "redirector0";

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

pub(super) fn validate_interface(raw: RawInterface) -> Result<InterfaceSettings, ConfigError> {
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

/// How the agent talks to Kubernetes.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct KubernetesSettings {
    /// A kubeconfig file; `None`: kube's inference (`kube::Config::infer`), which loads the
    /// kubeconfig `$KUBECONFIG` names (or, with it unset, `~/.kube/config`) and only when that
    /// fails the in-cluster configuration (the pod's service account).
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

pub(super) fn validate_kubernetes(raw: RawKubernetes) -> Result<KubernetesSettings, ConfigError> {
    Ok(KubernetesSettings {
        kubeconfig: raw.kubeconfig,
        resync_interval: match raw.resync_interval_ms {
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
    })
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

pub(super) fn validate_metrics(raw: RawMetrics) -> Result<MetricsSettings, ConfigError> {
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

pub(super) fn validate_conntrack(raw: RawConntrack) -> Result<ConntrackSettings, ConfigError> {
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
