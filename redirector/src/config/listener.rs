//! The listeners (`[[listener]]`): each one's address, cache, upstream source and policies, and
//! the checks that refuse one the programs could not steer (addresses, families, ports, sources,
//! implausible upstreams).

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use redirector_common::{
    DNS_PORT,
    listener::LISTENER_NAME_MAX,
    parse_dns_server,
    pool::MAX_POOL_TARGETS,
    settings::{EmptyPoolPolicy, Liveness},
};

use super::{ConfigError, probe::checked_dns_name, raw::RawListener};
use crate::sources::plausible::{self, Expect, Rejection};

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

pub(super) fn validate_listener(
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

/// Gives static upstreams the checks the sources' addresses get (`sources::plausible`, as for a
/// node's nameservers: link-local allowed): a loopback address is, for a pod, the pod itself, and
/// a listener address would steer failed-over DNS back to the listener.
pub(super) fn check_static_upstreams(
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
