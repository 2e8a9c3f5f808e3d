//! Why a configuration was refused: each variant names its key and says what to give instead.

use std::{
    net::{AddrParseError, IpAddr, SocketAddr},
    path::PathBuf,
};

use redirector_common::listener::LISTENER_NAME_MAX;

/// Why a configuration was refused. In every variant `key` is the path of the offending key in
/// the file (`listener[1].upstreams[0]`), `value` the text given there, and `source` what the
/// parser or the OS said.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the configuration file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not TOML of the expected shape (unknown key, wrong type, ...).
    #[error("the configuration file {path} is not valid (see the cause below for the key)")]
    Parse {
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
        max: usize,
    },
    /// A name that is empty or does not fit the maps.
    #[error(
        "{key}: the name {name:?} must be 1 to {max} bytes long",
        max = LISTENER_NAME_MAX
    )]
    BadName { key: String, name: String },
    /// Two listeners with one name.
    #[error("{key}: the name {name:?} is already used by {first}; listener names must be unique")]
    DuplicateName {
        key: String,
        name: String,
        /// The key of the listener that has it first.
        first: String,
    },
    /// Two listeners with one address.
    #[error(
        "{key}: the address {address} is already the address of {first}; listener addresses must be unique"
    )]
    DuplicateAddress {
        key: String,
        address: IpAddr,
        /// The key of the listener that has it first.
        first: String,
    },
    /// A static upstream no query should be sent to: what the sources' addresses are refused
    /// for (`sources::plausible`).
    #[error("{key}: {address} cannot be an upstream: {why}")]
    ImplausibleUpstream {
        key: String,
        address: SocketAddr,
        /// Why, and what to give instead.
        why: &'static str,
    },
    /// Not an IP address (or `ip:port`).
    #[error("{key}: {value:?} is not {expected}")]
    BadAddress {
        key: String,
        value: String,
        /// What was expected there.
        expected: &'static str,
        #[source]
        source: AddrParseError,
    },
    /// A listener address with a port.
    #[error(
        "{key}: {value:?} has a port; a listener always listens on port 53, give the address alone"
    )]
    ListenerPort { key: String, value: String },
    /// Port 0.
    #[error(
        "{key}: {value:?} has port 0, which no DNS server listens on; give the server's port, or none for 53"
    )]
    PortZero { key: String, value: String },
    /// An address no client can send DNS to.
    #[error("{key}: {address} cannot be a listener address ({why})")]
    UnusableListener {
        key: String,
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
        key: String,
        target: SocketAddr,
        /// The listener's name.
        listener: String,
        /// The listener's address.
        address: IpAddr,
    },
    /// More upstreams than a pool holds.
    #[error("{key}: {count} upstreams given; a pool holds at most {max}")]
    TooManyUpstreams {
        key: String,
        /// How many were given.
        count: usize,
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
    BadService { key: String, value: String },
    /// An interface name the kernel would refuse.
    #[error(
        "interface.name: {name:?} is not a valid interface name (1 to 15 bytes, no '/', ':' or spaces)"
    )]
    BadInterfaceName { name: String },
    /// Probe or reconcile settings that cannot work.
    #[error("{key}: {problem}")]
    BadTiming {
        key: &'static str,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A probe name that is not a DNS name.
    #[error("{key}: {name:?} is not a DNS name (write it like localhost. or health.check.local.)")]
    BadProbeName { key: String, name: String },
    /// A metrics address that is no socket address.
    #[error(
        "metrics.address: {value:?} is not an address with a port (write it like 127.0.0.1:9353)"
    )]
    BadMetricsAddress {
        value: String,
        /// Why it does not parse.
        #[source]
        source: AddrParseError,
    },
    /// A `[workloads]` setting that cannot work.
    #[error("{key}: {problem}")]
    BadWorkloads {
        key: &'static str,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A reverse map that cannot work.
    #[error(
        "reverse_nat_entries: {value} is too small; give at least {min} (the default is {default})"
    )]
    ReverseNatTooSmall {
        value: u32,
        min: u32,
        default: usize,
    },
}

/// "IPv4" or "IPv6".
fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
}
