//! Where upstream pools come from besides the configuration: the kube-dns EndpointSlices (the
//! cluster listener) and the node's upstream resolv.conf (the node listener). Each source sends
//! the whole desired pool of a listener whenever it may have changed; the agent's control loop
//! coalesces the updates and writes the kernel.

pub mod kubernetes;
pub mod plausible;
pub mod resolv_conf;

use std::net::{IpAddr, SocketAddr};

use redirector_common::DNS_PORT;

use self::plausible::Rejection;

/// One upstream DNS server: an address and its UDP and TCP ports (kube-dns names them apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Upstream {
    /// The address.
    pub ip: IpAddr,
    /// The UDP port.
    pub udp_port: u16,
    /// The TCP port.
    pub tcp_port: u16,
}

impl From<SocketAddr> for Upstream {
    fn from(address: SocketAddr) -> Self {
        Self {
            ip: address.ip(),
            udp_port: address.port(),
            tcp_port: address.port(),
        }
    }
}

impl Upstream {
    /// Port 53 for both protocols.
    #[must_use]
    pub fn dns(ip: IpAddr) -> Self {
        Self {
            ip,
            udp_port: DNS_PORT,
            tcp_port: DNS_PORT,
        }
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let address = SocketAddr::new(self.ip, self.udp_port);
        if self.udp_port == self.tcp_port {
            write!(f, "{address}")
        } else {
            write!(f, "{address} (tcp {})", self.tcp_port)
        }
    }
}

/// Which source an update comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceKind {
    /// EndpointSlices.
    Kubernetes,
    /// resolv.conf.
    ResolvConf,
}

impl SourceKind {
    /// The name used in logs and metrics.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Kubernetes => "kubernetes",
            Self::ResolvConf => "resolv.conf",
        }
    }
}

/// What a source tells the control loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// The desired pool of a listener, complete.
    Pool {
        /// The listener's id.
        listener: u32,
        /// Its upstreams, sorted.
        upstreams: Vec<Upstream>,
        /// Where they come from.
        source: SourceKind,
    },
    /// An address the source offered and redirector refused.
    Rejected {
        /// Where it came from.
        source: SourceKind,
        /// The address as given.
        address: String,
        /// Why it was refused.
        reason: Rejection,
    },
}

/// A listener fed by a source: its id, address and family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FedListener {
    /// Its id.
    pub id: u32,
    /// Its address (its family is the pool's).
    pub address: IpAddr,
}
