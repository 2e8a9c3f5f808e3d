//! Upstream pools and the choice of a target for a socket.

use crate::addr::NetAddr;

/// Most targets in one listener's upstream pool.
pub const MAX_POOL_TARGETS: usize = 32;

/// A DNS server: one address, its UDP and TCP ports (kube-dns endpoints name them apart).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Target {
    /// The server's address (IPv4 stored mapped).
    pub addr: NetAddr,
    /// UDP port, network byte order.
    pub udp_port_be: u16,
    /// TCP port, network byte order.
    pub tcp_port_be: u16,
}
const _: () = assert!(size_of::<Target>() == 20);

impl Target {
    /// The port for `protocol` (`PROTOCOL_UDP` or `PROTOCOL_TCP`), network byte order.
    #[inline(always)]
    #[must_use]
    pub const fn port_be(&self, protocol: u32) -> u16 {
        if protocol == crate::protocol::PROTOCOL_TCP {
            self.tcp_port_be
        } else {
            self.udp_port_be
        }
    }
}

/// Value of `POOLS`, keyed by listener id. The agent replaces the whole value in one map update
/// (the map is created with `BPF_F_NO_PREALLOC`, so the kernel swaps in a new element under RCU):
/// a reader sees either the old pool or the new one, never a half-written one, and the length is
/// always published together with the targets it counts.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Pool {
    /// Number of valid entries at the front of `targets`.
    pub len: u32,
    /// The targets; entries at `len..` are zero.
    pub targets: [Target; MAX_POOL_TARGETS],
}
const _: () = assert!(size_of::<Pool>() == 4 + 20 * MAX_POOL_TARGETS);

impl Pool {
    /// An empty pool.
    pub const EMPTY: Self = Self {
        len: 0,
        targets: [Target {
            addr: NetAddr { words_be: [0; 4] },
            udp_port_be: 0,
            tcp_port_be: 0,
        }; MAX_POOL_TARGETS],
    };

    /// A pool of `targets` (at most `MAX_POOL_TARGETS`; the rest are ignored).
    #[must_use]
    pub fn from_targets(targets: &[Target]) -> Self {
        let mut pool = Self::EMPTY;
        for (slot, target) in pool.targets.iter_mut().zip(targets) {
            *slot = *target;
        }
        pool.len = targets.len().min(MAX_POOL_TARGETS) as u32;
        pool
    }

    /// The valid targets.
    #[must_use]
    pub fn targets(&self) -> &[Target] {
        &self.targets[..(self.len as usize).min(MAX_POOL_TARGETS)]
    }
}

/// Index of the target for the socket with `socket_cookie` in a pool of `len` targets (`len > 0`).
///
/// The same socket always gets the same target while the pool is unchanged, so the A and AAAA
/// queries of one lookup, and every datagram of a long-lived socket, reach one server. Socket
/// cookies are handed out sequentially, so they are first spread by Fibonacci hashing (multiply by
/// 2^64/φ, keep the high half); the 32-bit hash is then mapped onto `0..len` by multiply-shift,
/// which needs no division.
#[inline(always)]
#[must_use]
pub const fn pick_index(socket_cookie: u64, len: u32) -> u32 {
    let hash = (socket_cookie.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32;
    ((hash as u64 * len as u64) >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_is_always_in_range() {
        for len in 1..=MAX_POOL_TARGETS as u32 {
            for cookie in (0..5_000u64).chain([u64::MAX, u64::MAX - 1, 1 << 63]) {
                assert!(pick_index(cookie, len) < len);
            }
        }
    }

    #[test]
    fn pick_is_pinned_to_known_targets() {
        // A socket's target must not change while its pool does not, also across an agent
        // upgrade that replaces the programs: these values pin the hash. Changing them moves
        // every long-lived socket on every node at the upgrade.
        for (cookie, expected) in [
            (1u64, [1, 4, 19]),
            (4096, [1, 3, 14]),
            (123_456_789, [2, 5, 23]),
            (u64::MAX, [1, 2, 12]),
        ] {
            assert_eq!(
                [3, 7, 32].map(|len| pick_index(cookie, len)),
                expected,
                "cookie {cookie}"
            );
        }
    }

    #[test]
    fn sequential_cookies_spread_evenly() {
        // Cookies of consecutive sockets are consecutive numbers.
        for len in [2u32, 3, 5, 7] {
            let mut hits = [0u32; 8];
            let sockets = 30_000u64;
            for cookie in 10_000..10_000 + sockets {
                hits[pick_index(cookie, len) as usize] += 1;
            }
            let fair = sockets as f64 / f64::from(len);
            for (index, count) in hits[..len as usize].iter().enumerate() {
                let skew = (f64::from(*count) - fair).abs() / fair;
                assert!(
                    skew < 0.05,
                    "len {len}: target {index} got {count}, fair {fair}"
                );
            }
        }
    }

    #[test]
    fn single_target_takes_everything() {
        for cookie in 0..1000 {
            assert_eq!(pick_index(cookie, 1), 0);
        }
    }

    #[test]
    fn pool_keeps_order_and_length() {
        let targets: [Target; 3] = core::array::from_fn(|i| Target {
            addr: NetAddr::from_ipv4_be(i as u32 + 1),
            udp_port_be: 53u16.to_be(),
            tcp_port_be: 53u16.to_be(),
        });
        let pool = Pool::from_targets(&targets);
        assert_eq!(pool.len, 3);
        assert_eq!(pool.targets(), &targets);
        assert_eq!(pool.targets[3], Target::default());
    }
}
