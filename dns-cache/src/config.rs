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
    net::{AddrParseError, IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use hickory_proto::{ProtoError, rr::Name};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use redirector_common::parse_dns_server;
use serde::Deserialize;

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

/// Why a text is not an `allow` network.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// The part before the `/` is not an address.
    #[error("the part before \"/\" is not an IPv4 or IPv6 address")]
    Address {
        #[source]
        source: AddrParseError,
    },
    /// The part after the `/` is not a prefix length of the address's family.
    #[error("the prefix length is not a number from 0 to 32 (IPv4) or 128 (IPv6)")]
    Prefix {
        #[source]
        source: ipnet::AddrParseError,
    },
    /// Bits set beyond the prefix: probably a host address where the network was meant.
    #[error("bits are set beyond the prefix length; write the network address, {network}")]
    HostBits {
        /// The network the text most likely meant.
        network: IpNet,
    },
}

/// A zone forwarded to its own upstream servers.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Zone {
    /// The zone apex, lowercase and fully qualified: it covers itself and every name below.
    pub name: Name,
    /// Tried in order; never empty.
    pub servers: Vec<SocketAddr>,
}

/// Why a cache configuration was refused. In every variant `key` is the path of the offending
/// key in the file (`zone[1].servers[0]`), `value` the text given there, and `source` what the
/// parser or the OS said.
#[derive(Debug, thiserror::Error)]
pub enum CacheConfigError {
    /// The file could not be read.
    #[error("cannot read the cache configuration file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Not TOML of the expected shape (unknown key, wrong type, ...).
    #[error("the cache configuration {path} is not valid (see the cause below for the key)")]
    Parse {
        /// The file, or `<text>`.
        path: PathBuf,
        /// What the TOML parser said, with line and key.
        #[source]
        source: toml::de::Error,
    },
    /// `listen` is missing or empty.
    #[error("listen: no address given; give at least one, e.g. listen = [\"127.0.0.1:53\"]")]
    NoListen,
    /// Not an address.
    #[error(
        "{key}: {value:?} is not an address like \"10.0.0.10\", \"10.0.0.10:53\" or \"[fd00::10]:53\""
    )]
    BadAddress {
        key: String,
        value: String,
        #[source]
        source: AddrParseError,
    },
    /// Port 0.
    #[error("{key}: {value:?} has port 0; give a real port, or none for 53")]
    PortZero { key: String, value: String },
    /// The same address twice in one list.
    #[error("{key}: {address} is already given as {first}")]
    DuplicateAddress {
        key: String,
        address: SocketAddr,
        /// The key that has it first.
        first: String,
    },
    /// A zone name that is not a DNS name.
    #[error("{key}: {value:?} is not a DNS name")]
    BadZoneName {
        key: String,
        value: String,
        #[source]
        source: ProtoError,
    },
    /// A zone for the root.
    #[error("{key}: the root zone \".\" is configured with default_servers, not as a [[zone]]")]
    RootZone { key: String },
    /// The same zone twice.
    #[error("{key}: the zone {name} is already configured as {first}")]
    DuplicateZone {
        key: String,
        name: String,
        /// The key of the zone that has it first.
        first: String,
    },
    /// A zone without servers.
    #[error("{key}: no server given; give at least one, e.g. servers = [\"10.96.0.10:53\"]")]
    NoServers { key: String },
    /// Neither zones nor default servers.
    #[error(
        "default_servers: empty and no [[zone]] is configured, so every query would be refused; \
         give default_servers = [\"ip:port\", ...] or a [[zone]]"
    )]
    NothingToForwardTo,
    /// Not a CIDR.
    #[error("{key}: {value:?} is not a network like \"10.0.0.0/8\", \"fd00::/8\" or \"10.1.2.3\"")]
    BadCidr {
        key: String,
        value: String,
        /// What is wrong with it.
        #[source]
        source: NetworkError,
    },
    /// `allow = []`.
    #[error(
        "allow: empty, so every client would be refused; list the client networks, e.g. \
         allow = [\"10.0.0.0/8\"], or leave allow out for the default (loopback, link-local \
         and private ranges)"
    )]
    EmptyAllow,
    /// `0.0.0.0` or `::` without an explicit `allow`.
    #[error(
        "{key}: {address} listens on every interface, public ones included; listen on a specific \
         address, or say which clients may use it with allow = [\"10.0.0.0/8\", ...]"
    )]
    UnspecifiedListen { key: String, address: SocketAddr },
    /// `max_bytes`, which the cache before hickory-resolver had.
    #[error(
        "max_bytes: the cache no longer has a byte budget (hickory-resolver's cache counts \
         answers); remove the key and bound the cache with max_entries"
    )]
    MaxBytesGone,
    /// A number out of range.
    #[error("{key}: {value} is out of range; give {allowed}")]
    OutOfRange {
        key: &'static str,
        value: u64,
        /// What is accepted, and why.
        allowed: &'static str,
    },
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
mod tests {

    use super::*;

    fn parse_err(text: &str) -> String {
        match CacheConfig::parse(text) {
            Ok(config) => panic!("accepted: {config:?}"),
            Err(error) => {
                let mut message = error.to_string();
                let mut source = std::error::Error::source(&error);
                while let Some(cause) = source {
                    message.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                message
            }
        }
    }

    fn name(text: &str) -> Name {
        Name::from_ascii(text).expect("a name")
    }

    #[test]
    fn parses_a_full_configuration() {
        let config = CacheConfig::parse(
            r#"
            listen = ["127.0.0.1:5353", "::1"]
            default_servers = ["1.1.1.1", "[2606:4700::1111]:53"]
            max_ttl_secs = 600
            max_negative_ttl_secs = 0
            stale_for_secs = 45
            max_entries = 100
            upstream_timeout_ms = 750
            allow = ["10.0.0.0/8", "192.0.2.7", "fd00::/8", "0.0.0.0/0"]

            [[zone]]
            name = "Cluster.Local"
            servers = ["10.96.0.10:53", "10.96.0.11"]
            "#,
        )
        .expect("valid");
        assert_eq!(
            config.listen,
            vec![
                "127.0.0.1:5353".parse::<SocketAddr>().expect("address"),
                "[::1]:53".parse().expect("address"),
            ]
        );
        assert_eq!(
            config.default_servers,
            vec![
                "1.1.1.1:53".parse::<SocketAddr>().expect("address"),
                "[2606:4700::1111]:53".parse().expect("address"),
            ]
        );
        assert_eq!(config.zones.len(), 1);
        assert_eq!(config.zones[0].name.to_string(), "cluster.local.");
        assert!(config.zones[0].name.is_fqdn());
        assert_eq!(
            config.zones[0].servers,
            vec![
                "10.96.0.10:53".parse::<SocketAddr>().expect("address"),
                "10.96.0.11:53".parse().expect("address"),
            ]
        );
        assert_eq!(config.max_ttl, Duration::from_secs(600));
        assert_eq!(config.max_negative_ttl, Duration::ZERO);
        assert_eq!(config.stale_for, Duration::from_secs(45));
        assert_eq!(config.max_entries, 100);
        assert_eq!(config.upstream_timeout, Duration::from_millis(750));
        assert_eq!(
            config
                .allow
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["10.0.0.0/8", "192.0.2.7/32", "fd00::/8", "0.0.0.0/0"]
        );
    }

    #[test]
    fn defaults_apply() {
        let config = CacheConfig::parse(
            r#"
            listen = ["127.0.0.1:53"]
            default_servers = ["9.9.9.9"]
            "#,
        )
        .expect("valid");
        assert!(config.zones.is_empty());
        assert_eq!(config.max_ttl, DEFAULT_MAX_TTL);
        assert_eq!(config.max_negative_ttl, DEFAULT_MAX_NEGATIVE_TTL);
        assert_eq!(config.stale_for, DEFAULT_STALE_FOR);
        assert_eq!(config.max_entries, DEFAULT_MAX_ENTRIES);
        assert_eq!(config.upstream_timeout, DEFAULT_UPSTREAM_TIMEOUT);
        assert_eq!(config.allow, DEFAULT_ALLOW);
    }

    #[test]
    fn the_default_allow_is_loopback_link_local_and_private() {
        let is_allowed = |text: &str| {
            let address: IpAddr = text.parse().expect("address");
            allowed(&DEFAULT_ALLOW, address)
        };
        for inside in [
            "127.0.0.1",
            "127.255.255.254",
            "169.254.20.10",
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.0",
            "172.31.255.255",
            "192.168.1.1",
            "::1",
            "fe80::1",
            "febf:ffff::1",
            "fc00::1",
            "fd00:1::2",
            "::ffff:10.1.2.3",
        ] {
            assert!(is_allowed(inside), "{inside} is allowed");
        }
        for outside in [
            "8.8.8.8",
            "9.255.255.255",
            "11.0.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "169.253.255.255",
            "198.18.1.2",
            "100.64.0.1",
            "0.0.0.0",
            "::",
            "::2",
            "fec0::1",
            "fe00::1",
            "2001:db8::1",
            "::ffff:8.8.8.8",
        ] {
            assert!(!is_allowed(outside), "{outside} is refused");
        }
        for network in DEFAULT_ALLOW {
            assert_eq!(network.trunc(), network, "{network} is a network address");
        }
    }

    #[test]
    fn cidrs_parse_strictly() {
        const PREFIX: &str = "the prefix length is not a number from 0 to 32 (IPv4) or 128 (IPv6)";
        let cidr = parse_network;
        let contains = |network: &str, address: &str| {
            allowed(
                &[cidr(network).expect("CIDR")],
                address.parse().expect("address"),
            )
        };
        assert!(contains("0.0.0.0/0", "203.0.113.9"));
        assert!(!contains("0.0.0.0/0", "2001:db8::1"), "one family");
        assert!(contains("::/0", "2001:db8::1"));
        assert!(contains("192.0.2.7", "192.0.2.7"));
        assert!(!contains("192.0.2.7", "192.0.2.6"));
        assert!(contains("2001:db8::/127", "2001:db8::1"));
        assert!(!contains("2001:db8::/127", "2001:db8::2"));
        assert!(contains("10.0.0.0/8", "::ffff:10.9.9.9"), "IPv4-mapped");
        assert!(contains("::ffff:0:0/96", "::ffff:10.9.9.9"));
        assert_eq!(
            cidr("FD00::/8").expect("CIDR").to_string(),
            "fd00::/8",
            "displayed canonically"
        );
        for (text, expected) in [
            ("10.0.0.1/8", "write the network address, 10.0.0.0/8"),
            ("fd00::1/8", "write the network address, fd00::/8"),
            ("10.0.0.0/33", PREFIX),
            ("fd00::/129", PREFIX),
            ("10.0.0.0/999", PREFIX),
            ("10.0.0.0/", PREFIX),
            ("10.0.0.0/+8", PREFIX),
            ("10.0.0.0/ 8", PREFIX),
            ("10.0.0.0/0008", PREFIX),
            ("10.0.0.0/8/8", PREFIX),
            ("example.com/8", "is not an IPv4 or IPv6 address"),
            ("", "is not an IPv4 or IPv6 address"),
            ("10.0.0.0:53", "is not an IPv4 or IPv6 address"),
        ] {
            let error = cidr(text).expect_err(text).to_string();
            assert!(error.contains(expected), "{text:?}: {error:?}");
        }
    }

    #[test]
    fn an_unspecified_listen_address_needs_an_explicit_allow() {
        for (listen, key) in [
            ("[\"0.0.0.0:53\"]", "listen[0]: 0.0.0.0:53"),
            ("[\"127.0.0.1:53\", \"::\"]", "listen[1]: [::]:53"),
        ] {
            let text = format!("listen = {listen}\ndefault_servers = [\"9.9.9.9\"]\n");
            let message = parse_err(&text);
            assert!(
                message.contains(&format!("{key} listens on every interface"))
                    && message.contains("allow = ["),
                "{message:?}"
            );
            let config = CacheConfig::parse(&format!("{text}allow = [\"10.0.0.0/8\"]\n"))
                .expect("explicit allow");
            assert_eq!(config.allow.len(), 1);
        }
    }

    #[test]
    fn refusals_name_the_key() {
        let base = "listen = [\"127.0.0.1:53\"]\ndefault_servers = [\"9.9.9.9\"]\n";
        let cases: &[(&str, &str)] = &[
            ("listen = [\"127.0.0.1:53\"]\nbogus = 1\n", "bogus"),
            ("default_servers = [\"9.9.9.9\"]\n", "listen: no address"),
            (
                "listen = [\"127.0.0.1:53\", \"localhost:53\"]\ndefault_servers = [\"9.9.9.9\"]",
                "listen[1]: \"localhost:53\" is not an address",
            ),
            (
                "listen = [\"127.0.0.1:0\"]\ndefault_servers = [\"9.9.9.9\"]",
                "listen[0]: \"127.0.0.1:0\" has port 0",
            ),
            (
                "listen = [\"127.0.0.1\", \"127.0.0.1:53\"]\ndefault_servers = [\"9.9.9.9\"]",
                "listen[1]: 127.0.0.1:53 is already given as listen[0]",
            ),
            (
                "listen = [\"127.0.0.1:53\"]",
                "default_servers: empty and no [[zone]]",
            ),
            (
                &format!("{base}[[zone]]\nname = \"a..b\"\nservers = [\"10.0.0.1\"]\n"),
                "zone[0].name: \"a..b\" is not a DNS name",
            ),
            (
                &format!("{base}[[zone]]\nname = \".\"\nservers = [\"10.0.0.1\"]\n"),
                "zone[0].name: the root zone",
            ),
            (
                &format!(
                    "{base}[[zone]]\nname = \"cluster.local.\"\nservers = [\"10.0.0.1\"]\n\
                     [[zone]]\nname = \"CLUSTER.local\"\nservers = [\"10.0.0.2\"]\n"
                ),
                "zone[1].name: the zone cluster.local. is already configured as zone[0]",
            ),
            (
                &format!("{base}[[zone]]\nname = \"cluster.local.\"\n"),
                "zone[0].servers: no server given",
            ),
            (
                &format!("{base}[[zone]]\nname = \"x.\"\nservers = [\"10.0.0.1:0\"]\n"),
                "zone[0].servers[0]: \"10.0.0.1:0\" has port 0",
            ),
            (
                &format!("{base}[[zone]]\nname = \"x.\"\nservers = [\"10.0.0.1\"]\nport = 5\n"),
                "port",
            ),
            (
                &format!("{base}max_ttl_secs = 0\n"),
                "max_ttl_secs: 0 is out of range",
            ),
            (
                &format!("{base}max_negative_ttl_secs = 99999\n"),
                "max_negative_ttl_secs: 99999 is out of range",
            ),
            (
                &format!("{base}stale_for_secs = 999999999\n"),
                "stale_for_secs: 999999999 is out of range",
            ),
            (
                &format!("{base}max_entries = 0\n"),
                "max_entries: 0 is out of range",
            ),
            (
                &format!("{base}upstream_timeout_ms = 0\n"),
                "upstream_timeout_ms: 0 is out of range",
            ),
            (&format!("{base}max_ttl_secs = \"1h\"\n"), "max_ttl_secs"),
            (
                &format!("{base}max_bytes = 16777216\n"),
                "max_bytes: the cache no longer has a byte budget",
            ),
            (
                &format!("{base}allow = []\n"),
                "allow: empty, so every client would be refused",
            ),
            (
                &format!("{base}allow = [\"10.0.0.0/8\", \"10.0.0.1/8\"]\n"),
                "allow[1]: \"10.0.0.1/8\" is not a network like \"10.0.0.0/8\", \"fd00::/8\" or \
                 \"10.1.2.3\": bits are set beyond the prefix length; write the network address, \
                 10.0.0.0/8",
            ),
            (
                &format!("{base}allow = [\"10.0.0.0/40\"]\n"),
                "allow[0]: \"10.0.0.0/40\" is not a network",
            ),
            (
                &format!("{base}allow = [\"pods\"]\n"),
                "allow[0]: \"pods\" is not a network",
            ),
            (&format!("{base}allow = \"10.0.0.0/8\"\n"), "allow"),
        ];
        for (text, expected) in cases {
            let message = parse_err(text);
            assert!(
                message.contains(expected),
                "for {text:?}: {message:?} does not contain {expected:?}"
            );
        }
    }

    #[test]
    fn load_names_the_file() {
        let missing = Path::new("/nonexistent/redirector-cache.toml");
        let error = CacheConfig::load(missing).expect_err("no such file");
        assert!(matches!(&error, CacheConfigError::Read { path, .. } if path == missing));
        assert!(
            error
                .to_string()
                .contains("/nonexistent/redirector-cache.toml")
        );
    }

    #[test]
    fn longest_zone_wins() {
        let config = CacheConfig::parse(
            r#"
            listen = ["127.0.0.1:53"]
            default_servers = ["10.0.0.1"]
            [[zone]]
            name = "local."
            servers = ["10.0.0.2"]
            [[zone]]
            name = "svc.cluster.local."
            servers = ["10.0.0.4"]
            [[zone]]
            name = "cluster.local."
            servers = ["10.0.0.3"]
            "#,
        )
        .expect("valid");
        let upstream = |text: &str| config.upstreams_for(&name(text))[0].ip().to_string();
        assert_eq!(upstream("example.com."), "10.0.0.1");
        assert_eq!(upstream("local."), "10.0.0.2");
        assert_eq!(upstream("printer.local."), "10.0.0.2");
        // A label boundary, not a string suffix.
        assert_eq!(upstream("notcluster.local."), "10.0.0.2");
        assert_eq!(upstream("cluster.local."), "10.0.0.3");
        assert_eq!(upstream("Pod.Cluster.LOCAL."), "10.0.0.3");
        assert_eq!(
            upstream("kube-dns.kube-system.svc.cluster.local."),
            "10.0.0.4"
        );
        assert_eq!(upstream("com."), "10.0.0.1");
        assert_eq!(upstream("."), "10.0.0.1");
    }

    #[test]
    fn no_default_servers_means_none_outside_zones() {
        let config = CacheConfig::parse(
            r#"
            listen = ["127.0.0.1:53"]
            [[zone]]
            name = "cluster.local"
            servers = ["10.0.0.3"]
            "#,
        )
        .expect("valid");
        assert!(config.upstreams_for(&name("example.com.")).is_empty());
        assert_eq!(config.upstreams_for(&name("a.cluster.local.")).len(), 1);
    }
}
