//! Where upstream pools come from besides the configuration: the kube-dns EndpointSlices (the
//! cluster listener) and the node's upstream resolv.conf (the node listener). Each source sends
//! the whole desired pool of a listener whenever it may have changed; the agent's control loop
//! coalesces the updates and writes the kernel.

pub mod kubernetes;
pub mod plausible;
pub mod resolv_conf;
pub mod subset;

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
};

use redirector_common::{
    DNS_PORT,
    addr::{NetAddr, port_be},
    pool::Target,
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

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
    /// The pool entry the programs read.
    #[must_use]
    pub fn target(&self) -> Target {
        Target {
            addr: NetAddr::from(self.ip),
            udp_port_be: port_be(self.udp_port),
            tcp_port_be: port_be(self.tcp_port),
        }
    }

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

/// This node's name, which picks its subset of a pool too large for the kernel
/// ([`subset::for_node`]): `NODE_NAME` (the DaemonSet sets it from `spec.nodeName`), else the
/// hostname (kubelet's default node name), else empty (every node then picks alike).
#[must_use]
pub fn node_name() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|name| !name.is_empty())
        .or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|name| name.into_string().ok())
        })
        .unwrap_or_default()
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

/// The name of a static pool's source, the configuration, in logs and metrics.
pub const STATIC_SOURCE: &str = "static";

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
    /// The source reached what it follows: the API server answered a list or sent a change,
    /// the file was read. What the pools' age is measured from.
    Contact {
        /// Which source.
        source: SourceKind,
    },
    /// The source failed to reach what it follows (the pools stay as they are).
    Failed {
        /// Which source.
        source: SourceKind,
    },
    /// An address the source offered and redirector refused.
    Rejected {
        /// Where it came from.
        source: SourceKind,
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

/// What a source offers at one moment: the whole pool of every listener it feeds, and the
/// addresses it offered that were refused (as written, with the reason).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offer {
    /// Each fed listener's pool, by listener id; a listener with nothing usable has an empty one.
    pub pools: HashMap<u32, Vec<Upstream>>,
    /// The refused addresses.
    pub rejected: Vec<(String, Rejection)>,
}

/// The control loop is gone: the agent is shutting down.
#[derive(Clone, Copy, Debug)]
pub struct ControlLoopGone;

impl Offer {
    /// Sends the refusals, then every pool, to the control loop.
    pub async fn send(
        self,
        source: SourceKind,
        events: &mpsc::Sender<SourceEvent>,
    ) -> Result<(), ControlLoopGone> {
        for (address, reason) in self.rejected {
            warn!(source = source.name(), offered = %address, reason = reason.name(), "refused what the source offered as upstreams");
            events
                .send(SourceEvent::Rejected {
                    source,
                    address,
                    reason,
                })
                .await
                .map_err(|_closed| ControlLoopGone)?;
        }
        for (listener, upstreams) in self.pools {
            debug!(
                source = source.name(),
                listener_id = listener,
                upstreams = upstreams.len(),
                "offered a pool"
            );
            events
                .send(SourceEvent::Pool {
                    listener,
                    upstreams,
                    source,
                })
                .await
                .map_err(|_closed| ControlLoopGone)?;
        }
        Ok(())
    }
}
