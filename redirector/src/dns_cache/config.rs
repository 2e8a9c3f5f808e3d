//! The cache's configuration file (TOML): parsing and validation. Each refusal names the key
//! (`zone[1].servers[0]`) and says what to give instead.
//!
//! ```toml
//! listen = ["127.0.0.1:53", "[::1]:53"]   # "ip:port", "[ipv6]:port", or an address alone for 53
//! default_servers = ["1.1.1.1", "9.9.9.9:53"]  # for names outside every zone; may be empty
//! max_ttl_secs = 3600              # positive answers are cached at most this long
//! max_negative_ttl_secs = 300      # NXDOMAIN / NODATA at most this long (0: not cached)
//! stale_for_secs = 30              # expired answers served while upstreams fail (0: never)
//! max_entries = 10000              # the earliest-expiring entry makes room for a new one
//! upstream_timeout_ms = 2000       # per upstream server and transport
//!
//! [[zone]]
//! name = "cluster.local."          # this name and every name below it; the longest zone wins
//! servers = ["10.96.0.10:53"]      # tried in order
//! ```

use std::{
    net::{AddrParseError, IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use hickory_proto::{ProtoError, rr::Name};
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

/// The port upstreams and listen addresses given without one use.
const DNS_PORT: u16 = 53;
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
    /// an ephemeral port, the same for both; [`crate::dns_cache::CacheServer::local_addrs`]
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
    /// Most cache entries.
    pub max_entries: usize,
    /// How long one upstream server gets per transport (UDP, then TCP after a truncated reply).
    pub upstream_timeout: Duration,
}

/// A zone forwarded to its own upstream servers.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Zone {
    /// The zone apex, lowercase and fully qualified: it covers itself and every name below.
    pub name: Name,
    /// Tried in order; never empty.
    pub servers: Vec<SocketAddr>,
}

/// Why a cache configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum CacheConfigError {
    /// The file could not be read.
    #[error("cannot read the cache configuration file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
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
        /// The offending key.
        key: String,
        /// The text given.
        value: String,
        /// The parser's complaint.
        #[source]
        source: AddrParseError,
    },
    /// Port 0.
    #[error("{key}: {value:?} has port 0; give a real port, or none for 53")]
    PortZero {
        /// The offending key.
        key: String,
        /// The text given.
        value: String,
    },
    /// The same address twice in one list.
    #[error("{key}: {address} is already given as {first}")]
    DuplicateAddress {
        /// The offending key.
        key: String,
        /// The address.
        address: SocketAddr,
        /// The key that has it first.
        first: String,
    },
    /// A zone name that is not a DNS name.
    #[error("{key}: {value:?} is not a DNS name")]
    BadZoneName {
        /// The offending key.
        key: String,
        /// The text given.
        value: String,
        /// The parser's complaint.
        #[source]
        source: ProtoError,
    },
    /// A zone for the root.
    #[error("{key}: the root zone \".\" is configured with default_servers, not as a [[zone]]")]
    RootZone {
        /// The offending key.
        key: String,
    },
    /// The same zone twice.
    #[error("{key}: the zone {name} is already configured as {first}")]
    DuplicateZone {
        /// The offending key.
        key: String,
        /// The zone.
        name: String,
        /// The key of the zone that has it first.
        first: String,
    },
    /// A zone without servers.
    #[error("{key}: no server given; give at least one, e.g. servers = [\"10.96.0.10:53\"]")]
    NoServers {
        /// The offending key.
        key: String,
    },
    /// Neither zones nor default servers.
    #[error(
        "default_servers: empty and no [[zone]] is configured, so every query would be refused; \
         give default_servers = [\"ip:port\", ...] or a [[zone]]"
    )]
    NothingToForwardTo,
    /// A number out of range.
    #[error("{key}: {value} is out of range; give {allowed}")]
    OutOfRange {
        /// The offending key.
        key: &'static str,
        /// The value given.
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
    upstream_timeout_ms: Option<u64>,
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
        })
    }

    /// The upstream servers for `name`: those of the longest zone containing it, else
    /// `default_servers` (possibly empty).
    #[must_use]
    pub fn upstreams_for(&self, name: &Name) -> &[SocketAddr] {
        let name = name.to_lowercase();
        self.zones
            .iter()
            .filter(|zone| zone.name.zone_of_case(&name))
            .max_by_key(|zone| zone.name.iter().len())
            .map_or(&self.default_servers, |zone| &zone.servers)
    }
}

/// Parses `values` (the list at `key`) as socket addresses, port 53 when none is given.
fn parse_addresses(key: &str, values: &[String]) -> Result<Vec<SocketAddr>, CacheConfigError> {
    let mut addresses: Vec<SocketAddr> = Vec::with_capacity(values.len());
    for (index, value) in values.iter().enumerate() {
        let item_key = format!("{key}[{index}]");
        let address = match value.parse::<SocketAddr>() {
            Ok(address) => address,
            Err(source) => match value.parse::<IpAddr>() {
                Ok(ip) => SocketAddr::new(ip, DNS_PORT),
                Err(_) => {
                    return Err(CacheConfigError::BadAddress {
                        key: item_key,
                        value: value.clone(),
                        source,
                    });
                }
            },
        };
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
