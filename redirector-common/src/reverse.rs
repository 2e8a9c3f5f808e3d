//! Reverse translation: replies from a target are shown to the application as coming from the
//! listener it addressed.

use crate::addr::NetAddr;

/// Entries of the `REVERSE_NAT` LRU map unless configured otherwise. Each socket that moves from
/// one target to another (an unconnected socket asking two listeners at once) takes an entry for
/// the target it left, until evicted.
pub const REVERSE_NAT_DEFAULT_ENTRIES: usize = 65_536;

/// Key of `REVERSE_NAT`: this socket talked to this target.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct ReverseKey {
    /// `bpf_get_socket_cookie` of the client socket.
    pub socket_cookie: u64,
    /// The target the socket was steered to (IPv4 stored mapped).
    pub peer: NetAddr,
    /// The target's port, network byte order.
    pub peer_port_be: u16,
    /// Zero; keeps the key free of uninitialised bytes.
    pub _padding: [u8; 6],
}
const _: () = assert!(size_of::<ReverseKey>() == 32);

impl ReverseKey {
    /// The key for a socket and a target.
    #[inline(always)]
    #[must_use]
    pub const fn new(socket_cookie: u64, peer: NetAddr, peer_port_be: u16) -> Self {
        Self {
            socket_cookie,
            peer,
            peer_port_be,
            _padding: [0; 6],
        }
    }
}

/// Value of `REVERSE_NAT`: the listener the application addressed (its port is always 53).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ReverseValue {
    /// The listener address.
    pub listener: NetAddr,
    /// The listener's id, for counters.
    pub listener_id: u32,
}
const _: () = assert!(size_of::<ReverseValue>() == 20);

/// Words of the `REPLY_PORTS` array: one bit per port.
pub const REPLY_PORT_WORDS: usize = 1024;

/// The word of `REPLY_PORTS` and the bit in it for a port in network byte order (the map is
/// indexed by the network-order value, as the programs read it, so neither side converts).
#[inline(always)]
#[must_use]
pub const fn reply_port_bit(port_be: u16) -> (u32, u64) {
    ((port_be >> 6) as u32, 1 << (port_be & 63))
}

/// Value of the `STEERED_SOCKS` socket storage: present once a socket was steered to a target
/// other than the address it named, and the translation of its replies. `recvmsg` and
/// `getpeername` first check the peer's port against `REPLY_PORTS` (the ports of every target the
/// agent ever installed), so unrelated UDP returns after one inlined array lookup; sockets
/// without storage return after one storage lookup more. Replies from the target it holds are
/// rewritten from it alone: it lives as long as the socket, so a long-lived socket keeps its
/// translation however many other sockets churn through `REVERSE_NAT` (an LRU that evicts).
/// `REVERSE_NAT` serves the other targets of a socket that sent to several (an unconnected
/// socket asking two listeners at once, as musl does): it is written only when a socket that
/// holds one translation moves to another, with the translation it held, so a socket that only
/// ever talks to one target (nearly all of them) never writes it.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SteeredSocket {
    /// The listener the socket addressed last.
    pub listener_id: u32,
    /// The target it was steered to last, port in network byte order.
    pub peer_port_be: u16,
    /// Zero.
    pub _padding: u16,
    /// The target it was steered to last.
    pub peer: NetAddr,
    /// The listener address it addressed last: what replies from `peer` are shown as (port 53).
    pub listener: NetAddr,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) when `peer` was chosen: the egress program lets a
    /// socket connected moments before a failback finish on its upstream (`stale::standing`).
    pub steered_ns: u64,
}
const _: () = assert!(size_of::<SteeredSocket>() == 48);

impl SteeredSocket {
    /// Whether `self` and `other` translate the same replies the same way (their times aside).
    #[inline(always)]
    #[must_use]
    pub fn translates_like(&self, other: &Self) -> bool {
        self.listener_id == other.listener_id
            && self.peer_port_be == other.peer_port_be
            && self.peer == other.peer
            && self.listener == other.listener
    }

    /// Whether it holds a translation yet (a storage just created holds zeros, and no target
    /// has port 0).
    #[inline(always)]
    #[must_use]
    pub const fn holds_translation(&self) -> bool {
        self.peer_port_be != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_one_socket_differ_by_target_and_port() {
        let a = NetAddr::from_ipv4_be(1);
        let b = NetAddr::from_ipv4_be(2);
        let port = 53u16.to_be();
        assert_ne!(ReverseKey::new(7, a, port), ReverseKey::new(7, b, port));
        assert_ne!(ReverseKey::new(7, a, port), ReverseKey::new(8, a, port));
        assert_ne!(
            ReverseKey::new(7, a, port),
            ReverseKey::new(7, a, 5353u16.to_be())
        );
        assert_eq!(ReverseKey::new(7, a, port)._padding, [0; 6]);
    }

    #[test]
    fn every_port_has_its_own_bit_in_the_reply_ports() {
        let mut seen = [0u64; REPLY_PORT_WORDS];
        for port in 0..=u16::MAX {
            let (word, bit) = reply_port_bit(port);
            assert_eq!(bit.count_ones(), 1);
            let word = &mut seen[word as usize];
            assert_eq!(*word & bit, 0, "{port}");
            *word |= bit;
        }
        assert!(seen.iter().all(|word| *word == u64::MAX));
    }

    #[test]
    fn fresh_storage_holds_no_translation() {
        assert!(!SteeredSocket::default().holds_translation());
        assert!(
            SteeredSocket {
                peer_port_be: 53u16.to_be(),
                ..SteeredSocket::default()
            }
            .holds_translation()
        );
    }

    #[test]
    fn a_translation_is_the_same_whatever_its_time() {
        let one = SteeredSocket {
            listener_id: 1,
            peer_port_be: 53u16.to_be(),
            peer: NetAddr::from_ipv4_be(2),
            listener: NetAddr::from_ipv4_be(3),
            steered_ns: 10,
            ..SteeredSocket::default()
        };
        assert!(one.translates_like(&SteeredSocket {
            steered_ns: 20,
            ..one
        }));
        assert!(!one.translates_like(&SteeredSocket {
            peer: NetAddr::from_ipv4_be(4),
            ..one
        }));
    }
}
