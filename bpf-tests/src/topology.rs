//! The addresses of the sandbox. Every one of them lives only inside the namespaces a sandbox
//! creates: nothing here is routed anywhere else.
//!
//! ```text
//!  pod netns                 node netns ("host network")                   upstream netns
//!  198.18.1.2  ── veth ──  198.18.1.1 | lo: listeners 169.254.10.10/.11,  198.18.2.1 ── veth ── 198.18.2.2 (A)
//!  fd00:1::2                fd00:1::1  |     fd00:53::10 (cache there)    fd00:2::1               198.18.2.3 (B)
//!                                                                                                  fd00:2::2, ::3
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::dns::Identity;

/// The node listener (AKS layout: `dnsPolicy: Default` and hostNetwork pods).
pub const NODE_LISTENER: Ipv4Addr = Ipv4Addr::new(169, 254, 10, 10);
/// The cluster listener (AKS layout: `dnsPolicy: ClusterFirst` pods).
pub const CLUSTER_LISTENER: Ipv4Addr = Ipv4Addr::new(169, 254, 10, 11);
/// An IPv6 listener.
pub const V6_LISTENER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x53, 0, 0, 0, 0, 0, 0x10);

/// The pod's address.
pub const POD_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
/// The node's address towards the pod (the pod's gateway).
pub const NODE_POD_SIDE_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);
/// The node's address towards the upstreams (their gateway).
pub const NODE_UPSTREAM_SIDE_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 1);
/// Upstream server A.
pub const UPSTREAM_A_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
/// Upstream server B.
pub const UPSTREAM_B_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 3);

/// The pod's IPv6 address.
pub const POD_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 2);
/// The node's IPv6 address towards the pod.
pub const NODE_POD_SIDE_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 1);
/// The node's IPv6 address towards the upstreams.
pub const NODE_UPSTREAM_SIDE_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 2, 0, 0, 0, 0, 0, 1);
/// Upstream server A, IPv6.
pub const UPSTREAM_A_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 2, 0, 0, 0, 0, 0, 2);
/// Upstream server B, IPv6.
pub const UPSTREAM_B_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 2, 0, 0, 0, 0, 0, 3);

/// What the cache answers.
pub const CACHE: Identity = Identity {
    a: Ipv4Addr::new(192, 0, 2, 53),
    aaaa: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x53),
};
/// What upstream A answers.
pub const UPSTREAM_A: Identity = Identity {
    a: Ipv4Addr::new(192, 0, 2, 1),
    aaaa: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
};
/// What upstream B answers.
pub const UPSTREAM_B: Identity = Identity {
    a: Ipv4Addr::new(192, 0, 2, 2),
    aaaa: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2),
};
/// What a server on the listener address but another port answers (non-DNS-port checks).
pub const OTHER_PORT: Identity = Identity {
    a: Ipv4Addr::new(192, 0, 2, 99),
    aaaa: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x99),
};

/// `address:53`.
#[must_use]
pub fn dns(address: impl Into<IpAddr>) -> SocketAddr {
    SocketAddr::new(address.into(), 53)
}

/// Which server an answer address identifies.
#[must_use]
pub fn who(answer: Option<IpAddr>) -> &'static str {
    let Some(answer) = answer else {
        return "nobody";
    };
    for (name, identity) in [
        ("cache", CACHE),
        ("upstream A", UPSTREAM_A),
        ("upstream B", UPSTREAM_B),
        ("other port", OTHER_PORT),
    ] {
        if answer == IpAddr::V4(identity.a) || answer == IpAddr::V6(identity.aaaa) {
            return name;
        }
    }
    "unknown"
}
