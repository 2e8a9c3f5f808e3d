//! Which addresses may become upstream targets. A source that offers something implausible (a
//! malformed object, a resolv.conf pointing back at the listener) must never steer DNS there.

use std::{collections::HashSet, net::IpAddr};

/// Why an offered address was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rejection {
    /// Not an IP address at all.
    Unparseable,
    /// 127.0.0.0/8 or ::1: would be the client's own host (a pod's loopback).
    Loopback,
    /// 0.0.0.0 or ::.
    Unspecified,
    /// A multicast or broadcast address.
    Multicast,
    /// A link-local address, which no pod has.
    LinkLocal,
    /// One of the listener addresses: the listener would forward to itself.
    Listener,
    /// Of the other family than the listener.
    WrongFamily,
    /// An EndpointSlice with no port that tells where its endpoints serve DNS (none over UDP,
    /// or several and nothing to choose): its endpoints are not taken.
    NoDnsPort,
}

impl Rejection {
    /// Every reason, in the order of the variants.
    pub const ALL: [Self; 8] = [
        Self::Unparseable,
        Self::Loopback,
        Self::Unspecified,
        Self::Multicast,
        Self::LinkLocal,
        Self::Listener,
        Self::WrongFamily,
        Self::NoDnsPort,
    ];

    /// The name used in logs and metrics.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Unparseable => "unparseable",
            Self::Loopback => "loopback",
            Self::Unspecified => "unspecified",
            Self::Multicast => "multicast",
            Self::LinkLocal => "link-local",
            Self::Listener => "listener address",
            Self::WrongFamily => "wrong family",
            Self::NoDnsPort => "no DNS port",
        }
    }
}

/// What kind of address is expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A pod's address (kube-dns endpoints): link-local is refused too.
    PodAddress,
    /// A nameserver of the node: link-local is allowed (some clouds serve DNS there, e.g.
    /// 169.254.169.253).
    Nameserver,
}

/// Checks `ip` for a pool of the family of `listener`, given every listener address.
pub fn check(
    ip: IpAddr,
    listener: IpAddr,
    listeners: &HashSet<IpAddr>,
    expect: Expect,
) -> Result<IpAddr, Rejection> {
    let ip = ip.to_canonical();
    if ip.is_unspecified() {
        return Err(Rejection::Unspecified);
    }
    if ip.is_loopback() {
        return Err(Rejection::Loopback);
    }
    let multicast = match ip {
        IpAddr::V4(v4) => v4.is_multicast() || v4.is_broadcast(),
        IpAddr::V6(v6) => v6.is_multicast(),
    };
    if multicast {
        return Err(Rejection::Multicast);
    }
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    if listeners.contains(&ip) {
        return Err(Rejection::Listener);
    }
    if link_local && expect == Expect::PodAddress {
        return Err(Rejection::LinkLocal);
    }
    if ip.is_ipv4() != listener.to_canonical().is_ipv4() {
        return Err(Rejection::WrongFamily);
    }
    Ok(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listeners() -> HashSet<IpAddr> {
        ["169.254.10.10", "169.254.10.11", "fd00:53::10"]
            .iter()
            .map(|ip| ip.parse().unwrap())
            .collect()
    }

    fn verdict(ip: &str, listener: &str, expect: Expect) -> Result<IpAddr, Rejection> {
        check(
            ip.parse().unwrap(),
            listener.parse().unwrap(),
            &listeners(),
            expect,
        )
    }

    #[test]
    fn pod_addresses_of_the_right_family_pass() {
        assert!(verdict("10.244.1.5", "169.254.10.11", Expect::PodAddress).is_ok());
        assert!(verdict("fd00:10:244::5", "fd00:53::10", Expect::PodAddress).is_ok());
        assert_eq!(
            verdict("::ffff:10.244.1.5", "169.254.10.11", Expect::PodAddress),
            Ok("10.244.1.5".parse().unwrap())
        );
    }

    #[test]
    fn implausible_addresses_are_refused_with_their_reason() {
        for (ip, reason) in [
            ("127.0.0.53", Rejection::Loopback),
            ("::1", Rejection::Loopback),
            ("0.0.0.0", Rejection::Unspecified),
            ("224.0.0.251", Rejection::Multicast),
            ("255.255.255.255", Rejection::Multicast),
            ("169.254.20.10", Rejection::LinkLocal),
            ("169.254.10.10", Rejection::Listener),
            ("fd00::1", Rejection::WrongFamily),
        ] {
            assert_eq!(
                verdict(ip, "169.254.10.11", Expect::PodAddress),
                Err(reason),
                "{ip}"
            );
        }
        assert_eq!(
            verdict("fe80::1", "fd00:53::10", Expect::PodAddress),
            Err(Rejection::LinkLocal)
        );
    }

    #[test]
    fn nameservers_may_be_link_local_but_never_a_listener() {
        assert!(verdict("169.254.169.253", "169.254.10.10", Expect::Nameserver).is_ok());
        assert_eq!(
            verdict("169.254.10.10", "169.254.10.10", Expect::Nameserver),
            Err(Rejection::Listener)
        );
    }
}
