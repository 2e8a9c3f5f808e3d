//! Why a cache configuration or an `allow` network was refused.

use std::{
    net::{AddrParseError, SocketAddr},
    path::PathBuf,
};

use hickory_proto::ProtoError;
use ipnet::IpNet;

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
