//! The cache's configuration file (TOML): parsing and validation. Each refusal names the key
//! (`zone[1].servers[0]`) and says what to give instead.
//!
//! ```toml
//! listen = ["127.0.0.1:53", "[::1]:53"]   # "ip:port", "[ipv6]:port", or an address alone for 53
//! default_servers = ["1.1.1.1", "9.9.9.9:53"]  # for names outside every zone; may be empty
//! max_ttl_secs = 3600              # positive answers are cached at most this long
//! max_negative_ttl_secs = 300      # NXDOMAIN / NODATA at most this long (0: not cached)
//! stale_for_secs = 30              # expired answers served while upstreams fail (0: never)
//! max_entries = 10000              # answers cached (and kept for serving stale)
//! upstream_timeout_ms = 2000       # per upstream server and transport
//! allow = ["10.0.0.0/8", "127.0.0.1"]  # clients answered; others get REFUSED (default below)
//!
//! [[zone]]
//! name = "cluster.local."          # this name and every name below it; the longest zone wins
//! servers = ["10.96.0.10:53"]      # tried in order
//! ```
//!
//! Without `allow`, the clients answered are [`DEFAULT_ALLOW`]: loopback, link-local and the
//! private ranges (RFC 1918, ULA), which is what pods and nodes use, so a cache listening on a
//! public address is not an open resolver. An unspecified listen address (`0.0.0.0`, `::`) is
//! refused unless `allow` is given explicitly.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use hickory_proto::rr::Name;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use redirector_common::parse_dns_server;
use serde::Deserialize;

mod error;

pub use error::{CacheConfigError, NetworkError};

/// Positive answers are cached at most this long unless told otherwise.
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(3600);
/// Negative answers (NXDOMAIN, NODATA) are cached at most this long unless told otherwise.
pub const DEFAULT_MAX_NEGATIVE_TTL: Duration = Duration::from_secs(300);
/// How long after expiry an answer may still be served while upstreams fail, unless told
/// otherwise.
pub const DEFAULT_STALE_FOR: Duration = Duration::from_secs(30);
/// Cache entries unless told otherwise.
pub const DEFAULT_MAX_ENTRIES: usize = 10_000;
/// How long one upstream server gets to answer, unless told otherwise.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// The clients answered unless `allow` says otherwise: loopback, link-local and the private
/// ranges (RFC 1918, RFC 4193 ULA), where pods and nodes are.
pub const DEFAULT_ALLOW: [IpNet; 8] = [
    v4(Ipv4Addr::new(127, 0, 0, 0), 8),
    v4(Ipv4Addr::new(169, 254, 0, 0), 16),
    v4(Ipv4Addr::new(10, 0, 0, 0), 8),
    v4(Ipv4Addr::new(172, 16, 0, 0), 12),
    v4(Ipv4Addr::new(192, 168, 0, 0), 16),
    v6(Ipv6Addr::LOCALHOST, 128),
    v6(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10),
    v6(Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0), 7),
];

const fn v4(network: Ipv4Addr, prefix_len: u8) -> IpNet {
    IpNet::V4(Ipv4Net::new_assert(network, prefix_len))
}

const fn v6(network: Ipv6Addr, prefix_len: u8) -> IpNet {
    IpNet::V6(Ipv6Net::new_assert(network, prefix_len))
}

/// Longest accepted `max_ttl_secs` and `stale_for_secs`: 7 days (RFC 8767's suggested cap).
const MAX_SECS: u64 = 7 * 24 * 3600;
/// Longest accepted `max_negative_ttl_secs`: 3 hours (RFC 2308's suggested cap).
const MAX_NEGATIVE_SECS: u64 = 3 * 3600;
/// Largest accepted `max_entries`.
const MAX_ENTRIES: u64 = 10_000_000;
/// Longest accepted `upstream_timeout_ms`.
const MAX_TIMEOUT_MS: u64 = 30_000;

/// A validated cache configuration.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct CacheConfig {
    /// Where to answer, each on UDP and TCP. Port 0 (only from code, the file refuses it) binds
    /// an ephemeral port, the same for both; [`crate::CacheServer::local_addrs`]
    /// tells which.
    pub listen: Vec<SocketAddr>,
    /// Zones with their own upstreams, lowercase and fully qualified.
    pub zones: Vec<Zone>,
    /// The upstreams of names outside every zone; empty: such names are REFUSED.
    pub default_servers: Vec<SocketAddr>,
    /// The longest a positive answer is cached.
    pub max_ttl: Duration,
    /// The longest a negative answer is cached; zero: negative answers are not cached.
    pub max_negative_ttl: Duration,
    /// How long after expiry an answer may be served stale; zero: never.
    pub stale_for: Duration,
    /// Most answers cached (hickory-resolver's cache), and most kept for serving stale.
    pub max_entries: usize,
    /// How long one upstream server gets per transport (UDP, then TCP after a truncated reply).
    pub upstream_timeout: Duration,
    /// The clients answered; everyone else gets REFUSED (over UDP a reply no larger than the
    /// query). [`DEFAULT_ALLOW`] unless the file says otherwise.
    pub allow: Vec<IpNet>,
}

/// Parses an `allow` entry: `"10.0.0.0/8"`, `"fd00::/8"`, or an address alone for just that
/// address (`/32`, `/128`). Refuses bits set beyond the prefix, which is most likely a host
/// address where a network was meant.
///
/// # Errors
///
/// [`NetworkError`] saying what is wrong and what to write instead.
pub fn parse_network(text: &str) -> Result<IpNet, NetworkError> {
    let network = match text.split_once('/') {
        None => IpNet::from(
            text.parse::<IpAddr>()
                .map_err(|source| NetworkError::Address { source })?,
        ),
        Some((address, _)) => {
            address
                .parse::<IpAddr>()
                .map_err(|source| NetworkError::Address { source })?;
            text.parse::<IpNet>()
                .map_err(|source| NetworkError::Prefix { source })?
        }
    };
    if network.trunc() != network {
        return Err(NetworkError::HostBits {
            network: network.trunc(),
        });
    }
    Ok(network)
}

/// True if `client` is in one of `allow`. An IPv4-mapped IPv6 address (`::ffff:10.0.0.1`, how a
/// dual-stack socket sees an IPv4 client) also counts as its IPv4 address.
#[must_use]
pub fn allowed(allow: &[IpNet], client: IpAddr) -> bool {
    let canonical = client.to_canonical();
    allow
        .iter()
        .any(|network| network.contains(&client) || network.contains(&canonical))
}

/// A zone forwarded to its own upstream servers.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Zone {
    /// The zone apex, lowercase and fully qualified: it covers itself and every name below.
    pub name: Name,
    /// Tried in order; never empty.
    pub servers: Vec<SocketAddr>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCacheConfig {
    #[serde(default)]
    listen: Vec<String>,
    #[serde(default, rename = "zone")]
    zones: Vec<RawZone>,
    #[serde(default)]
    default_servers: Vec<String>,
    max_ttl_secs: Option<u64>,
    max_negative_ttl_secs: Option<u64>,
    stale_for_secs: Option<u64>,
    max_entries: Option<u64>,
    /// Refused with [`CacheConfigError::MaxBytesGone`], not as an unknown key: it was valid once.
    max_bytes: Option<u64>,
    upstream_timeout_ms: Option<u64>,
    allow: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawZone {
    name: String,
    #[serde(default)]
    servers: Vec<String>,
}

impl CacheConfig {
    /// Reads and validates a cache configuration file.
    ///
    /// # Errors
    ///
    /// [`CacheConfigError::Read`] when the file cannot be read, else as [`Self::parse`].
    pub fn load(path: &Path) -> Result<Self, CacheConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| CacheConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|error| match error {
            CacheConfigError::Parse { source, .. } => CacheConfigError::Parse {
                path: path.to_owned(),
                source,
            },
            other => other,
        })
    }

    /// Parses and validates cache configuration text.
    ///
    /// # Errors
    ///
    /// [`CacheConfigError::Parse`] for TOML errors and unknown keys, the other variants for
    /// values that cannot work; each names its key.
    pub fn parse(text: &str) -> Result<Self, CacheConfigError> {
        let raw: RawCacheConfig =
            toml::from_str(text).map_err(|source| CacheConfigError::Parse {
                path: PathBuf::from("<text>"),
                source,
            })?;
        Self::validate(raw)
    }

    fn validate(raw: RawCacheConfig) -> Result<Self, CacheConfigError> {
        if raw.listen.is_empty() {
            return Err(CacheConfigError::NoListen);
        }
        let listen = parse_addresses("listen", &raw.listen)?;
        let allow = match &raw.allow {
            None => {
                if let Some((index, &address)) = listen
                    .iter()
                    .enumerate()
                    .find(|(_, address)| address.ip().is_unspecified())
                {
                    return Err(CacheConfigError::UnspecifiedListen {
                        key: format!("listen[{index}]"),
                        address,
                    });
                }
                DEFAULT_ALLOW.to_vec()
            }
            Some(values) if values.is_empty() => return Err(CacheConfigError::EmptyAllow),
            Some(values) => values
                .iter()
                .enumerate()
                .map(|(index, value)| {
                    parse_network(value).map_err(|source| CacheConfigError::BadCidr {
                        key: format!("allow[{index}]"),
                        value: value.clone(),
                        source,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        };

        let mut zones: Vec<Zone> = Vec::with_capacity(raw.zones.len());
        for (index, zone) in raw.zones.iter().enumerate() {
            let key = format!("zone[{index}]");
            let mut name = Name::from_ascii(&zone.name)
                .map_err(|source| CacheConfigError::BadZoneName {
                    key: format!("{key}.name"),
                    value: zone.name.clone(),
                    source,
                })?
                .to_lowercase();
            name.set_fqdn(true);
            if name.is_root() {
                return Err(CacheConfigError::RootZone {
                    key: format!("{key}.name"),
                });
            }
            if let Some(first) = zones.iter().position(|other| other.name == name) {
                return Err(CacheConfigError::DuplicateZone {
                    key: format!("{key}.name"),
                    name: name.to_string(),
                    first: format!("zone[{first}]"),
                });
            }
            let servers_key = format!("{key}.servers");
            if zone.servers.is_empty() {
                return Err(CacheConfigError::NoServers { key: servers_key });
            }
            let servers = parse_addresses(&servers_key, &zone.servers)?;
            zones.push(Zone { name, servers });
        }
        let default_servers = parse_addresses("default_servers", &raw.default_servers)?;
        if zones.is_empty() && default_servers.is_empty() {
            return Err(CacheConfigError::NothingToForwardTo);
        }

        let max_ttl = seconds(
            "max_ttl_secs",
            raw.max_ttl_secs,
            DEFAULT_MAX_TTL,
            1,
            MAX_SECS,
            "1 to 604800 seconds (0 would cache nothing)",
        )?;
        let max_negative_ttl = seconds(
            "max_negative_ttl_secs",
            raw.max_negative_ttl_secs,
            DEFAULT_MAX_NEGATIVE_TTL,
            0,
            MAX_NEGATIVE_SECS,
            "0 (negative answers not cached) to 10800 seconds",
        )?;
        let stale_for = seconds(
            "stale_for_secs",
            raw.stale_for_secs,
            DEFAULT_STALE_FOR,
            0,
            MAX_SECS,
            "0 (never serve stale) to 604800 seconds",
        )?;
        let max_entries = match raw.max_entries {
            None => DEFAULT_MAX_ENTRIES,
            Some(value @ 1..=MAX_ENTRIES) => usize::try_from(value).unwrap_or(usize::MAX),
            Some(value) => {
                return Err(CacheConfigError::OutOfRange {
                    key: "max_entries",
                    value,
                    allowed: "1 to 10000000 entries",
                });
            }
        };
        if raw.max_bytes.is_some() {
            return Err(CacheConfigError::MaxBytesGone);
        }
        let upstream_timeout = match raw.upstream_timeout_ms {
            None => DEFAULT_UPSTREAM_TIMEOUT,
            Some(value @ 1..=MAX_TIMEOUT_MS) => Duration::from_millis(value),
            Some(value) => {
                return Err(CacheConfigError::OutOfRange {
                    key: "upstream_timeout_ms",
                    value,
                    allowed: "1 to 30000 milliseconds",
                });
            }
        };

        Ok(Self {
            listen,
            zones,
            default_servers,
            max_ttl,
            max_negative_ttl,
            stale_for,
            max_entries,
            upstream_timeout,
            allow,
        })
    }

    /// The upstream servers for `name`: those of the longest zone containing it, else
    /// `default_servers` (possibly empty).
    #[must_use]
    pub fn upstreams_for(&self, name: &Name) -> &[SocketAddr] {
        longest_zone(&self.zones, name).map_or(&self.default_servers, |(_, zone)| &zone.servers)
    }
}

/// The longest of `zones` that contains `name` (any case), with its index.
pub(crate) fn longest_zone<'z>(zones: &'z [Zone], name: &Name) -> Option<(usize, &'z Zone)> {
    let name = name.to_lowercase();
    zones
        .iter()
        .enumerate()
        .filter(|(_, zone)| zone.name.zone_of_case(&name))
        .max_by_key(|(_, zone)| zone.name.num_labels())
}

/// Parses `values` (the list at `key`) as socket addresses, port 53 when none is given.
fn parse_addresses(key: &str, values: &[String]) -> Result<Vec<SocketAddr>, CacheConfigError> {
    let mut addresses: Vec<SocketAddr> = Vec::with_capacity(values.len());
    for (index, value) in values.iter().enumerate() {
        let item_key = format!("{key}[{index}]");
        let address = parse_dns_server(value).map_err(|source| CacheConfigError::BadAddress {
            key: item_key.clone(),
            value: value.clone(),
            source,
        })?;
        if address.port() == 0 {
            return Err(CacheConfigError::PortZero {
                key: item_key,
                value: value.clone(),
            });
        }
        if let Some(first) = addresses.iter().position(|other| *other == address) {
            return Err(CacheConfigError::DuplicateAddress {
                key: item_key,
                address,
                first: format!("{key}[{first}]"),
            });
        }
        addresses.push(address);
    }
    Ok(addresses)
}

/// A duration in seconds from `key`, `default` when absent, refused outside `min..=max`.
fn seconds(
    key: &'static str,
    value: Option<u64>,
    default: Duration,
    min: u64,
    max: u64,
    allowed: &'static str,
) -> Result<Duration, CacheConfigError> {
    match value {
        None => Ok(default),
        Some(value) if (min..=max).contains(&value) => Ok(Duration::from_secs(value)),
        Some(value) => Err(CacheConfigError::OutOfRange {
            key,
            value,
            allowed,
        }),
    }
}

#[cfg(test)]
mod tests;
