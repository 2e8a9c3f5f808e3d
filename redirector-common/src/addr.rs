//! Addresses and ports as the kernel programs see them.

use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The third word of an IPv4-mapped IPv6 address (`::ffff:0:0/96`), as it lies in memory.
pub const V4_MAPPED_MARKER_BE: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// An IPv4 or IPv6 address in the layout of `bpf_sock_addr.user_ip6`: the 16 bytes of an IPv6
/// address in network byte order, read as four `__be32` words. IPv4 is stored IPv4-mapped
/// (`::ffff:a.b.c.d`), so its `user_ip4` is the last word. One representation for both families
/// lets a dual-stack socket's `::ffff:a.b.c.d` and a plain IPv4 socket's `a.b.c.d` hit the same
/// map entries.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Debug)]
pub struct NetAddr {
    /// Network byte order in memory (each word is a `__be32`).
    pub words_be: [u32; 4],
}
const _: () = assert!(size_of::<NetAddr>() == 16);

impl NetAddr {
    /// The IPv4-mapped form of `user_ip4` (already network byte order).
    #[inline(always)]
    #[must_use]
    pub const fn from_ipv4_be(ip4_be: u32) -> Self {
        Self {
            words_be: [0, 0, V4_MAPPED_MARKER_BE, ip4_be],
        }
    }

    /// True for IPv4 addresses (stored IPv4-mapped).
    #[inline(always)]
    #[must_use]
    pub const fn is_ipv4(&self) -> bool {
        self.words_be[0] == 0 && self.words_be[1] == 0 && self.words_be[2] == V4_MAPPED_MARKER_BE
    }

    /// The IPv4 address as `user_ip4` holds it (network byte order). Meaningful only when
    /// [`Self::is_ipv4`].
    #[inline(always)]
    #[must_use]
    pub const fn ipv4_be(&self) -> u32 {
        self.words_be[3]
    }

    /// The 16 network-order bytes.
    #[must_use]
    pub fn octets(&self) -> [u8; 16] {
        let mut octets = [0u8; 16];
        for (chunk, word) in octets.chunks_exact_mut(4).zip(self.words_be) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        octets
    }

    /// From 16 network-order bytes.
    #[must_use]
    pub fn from_octets(octets: [u8; 16]) -> Self {
        let mut words_be = [0u32; 4];
        for (word, chunk) in words_be.iter_mut().zip(octets.chunks_exact(4)) {
            *word = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        Self { words_be }
    }
}

impl From<IpAddr> for NetAddr {
    fn from(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::from(v4),
            IpAddr::V6(v6) => Self::from(v6),
        }
    }
}

impl From<Ipv4Addr> for NetAddr {
    fn from(ip: Ipv4Addr) -> Self {
        Self::from_ipv4_be(u32::from_ne_bytes(ip.octets()))
    }
}

impl From<Ipv6Addr> for NetAddr {
    /// Note: an IPv4-mapped IPv6 address becomes the IPv4 address it maps, by design.
    fn from(ip: Ipv6Addr) -> Self {
        Self::from_octets(ip.octets())
    }
}

impl From<NetAddr> for IpAddr {
    fn from(addr: NetAddr) -> Self {
        if addr.is_ipv4() {
            IpAddr::V4(Ipv4Addr::from(addr.ipv4_be().to_ne_bytes()))
        } else {
            IpAddr::V6(Ipv6Addr::from(addr.octets()))
        }
    }
}

/// A port in network byte order, as `bpf_sock_addr.user_port` holds it in its low 16 bits.
#[inline(always)]
#[must_use]
pub const fn port_be(port: u16) -> u16 {
    port.to_be()
}

/// The host-order port of a network-order one.
#[inline(always)]
#[must_use]
pub const fn port_from_be(port_be: u16) -> u16 {
    u16::from_be(port_be)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_is_stored_mapped_with_user_ip4_as_last_word() {
        let addr = NetAddr::from(Ipv4Addr::new(169, 254, 10, 11));
        assert!(addr.is_ipv4());
        assert_eq!(
            addr.octets(),
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 169, 254, 10, 11]
        );
        // user_ip4 is the in-memory network-order word.
        assert_eq!(addr.ipv4_be(), u32::from_ne_bytes([169, 254, 10, 11]));
        assert_eq!(
            IpAddr::from(addr),
            IpAddr::V4(Ipv4Addr::new(169, 254, 10, 11))
        );
    }

    #[test]
    fn mapped_ipv6_and_ipv4_are_the_same_key() {
        let v4 = NetAddr::from(Ipv4Addr::new(10, 0, 0, 10));
        let mapped = NetAddr::from("::ffff:10.0.0.10".parse::<Ipv6Addr>().unwrap());
        assert_eq!(v4, mapped);
    }

    #[test]
    fn ipv6_round_trips_and_is_not_ipv4() {
        let ip: Ipv6Addr = "fd00:53::a".parse().unwrap();
        let addr = NetAddr::from(ip);
        assert!(!addr.is_ipv4());
        assert_eq!(IpAddr::from(addr), IpAddr::V6(ip));
        assert_eq!(NetAddr::from_octets(addr.octets()), addr);
    }

    #[test]
    fn port_is_network_order() {
        assert_eq!(port_be(53).to_ne_bytes(), [0, 53]);
        assert_eq!(port_from_be(port_be(5353)), 5353);
    }
}
