//! Which bound sockets are a listener's cache: the `CACHE_BINDS` table the kernel programs look
//! sockets up in, and the same matching for sockets read from the socket tables.

use std::{collections::HashMap, net::SocketAddr};

use redirector_common::{
    addr::{NetAddr, port_be},
    binds::{BindKey, IPV4_UNSPECIFIED, IPV6_UNSPECIFIED},
    counters::{PROTOCOL_TCP, PROTOCOL_UDP},
    datapath::listener_bit,
};

/// A listener whose cache is tracked by its sockets.
#[derive(Clone, Copy, Debug)]
pub struct TrackedCache {
    /// The listener's id.
    pub id: u32,
    /// The cache's address and port.
    pub cache: SocketAddr,
}

/// The `CACHE_BINDS` table: for each tracked cache, a socket bound to its address and port, or to
/// the wildcard address of its family and its port, is the cache's. An IPv6 wildcard socket also
/// serves IPv4 (dual-stack, the Linux default), so it counts for IPv4 caches too.
#[must_use]
pub fn cache_binds(caches: &[TrackedCache]) -> HashMap<BindKey, u64> {
    let mut binds: HashMap<BindKey, u64> = HashMap::new();
    for cache in caches {
        let addr = NetAddr::from(cache.cache.ip());
        let mut addresses = vec![addr];
        if addr.is_ipv4() {
            addresses.extend([IPV4_UNSPECIFIED, IPV6_UNSPECIFIED]);
        } else {
            addresses.push(IPV6_UNSPECIFIED);
        }
        for address in addresses {
            for protocol in [PROTOCOL_UDP, PROTOCOL_TCP] {
                let key = BindKey::new(address, port_be(cache.cache.port()), protocol);
                *binds.entry(key).or_default() |= listener_bit(cache.id);
            }
        }
    }
    binds
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The listeners a socket bound to `address` with `protocol` counts for.
    fn listeners(binds: &HashMap<BindKey, u64>, protocol: u32, address: &str) -> u64 {
        let address: SocketAddr = address.parse().unwrap();
        let key = BindKey::new(
            NetAddr::from(address.ip()),
            port_be(address.port()),
            protocol,
        );
        binds.get(&key).copied().unwrap_or(0)
    }

    #[test]
    fn specific_wildcard_and_dual_stack_binds_count() {
        let binds = cache_binds(&[
            TrackedCache {
                id: 0,
                cache: "169.254.10.10:53".parse().unwrap(),
            },
            TrackedCache {
                id: 1,
                cache: "[fd00::10]:53".parse().unwrap(),
            },
        ]);
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "169.254.10.10:53"), 0b01);
        assert_eq!(listeners(&binds, PROTOCOL_TCP, "169.254.10.10:53"), 0b01);
        // The mapped form of the v4 cache is the same key.
        assert_eq!(
            listeners(&binds, PROTOCOL_UDP, "[::ffff:169.254.10.10]:53"),
            0b01
        );
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "0.0.0.0:53"), 0b01);
        // A dual-stack [::] socket serves both caches.
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "[::]:53"), 0b11);
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "[fd00::10]:53"), 0b10);
        // Another address or port is no cache.
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "169.254.10.11:53"), 0);
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "169.254.10.10:5353"), 0);
    }

    #[test]
    fn two_listeners_on_one_cache_share_its_sockets() {
        let binds = cache_binds(&[
            TrackedCache {
                id: 3,
                cache: "169.254.20.10:53".parse().unwrap(),
            },
            TrackedCache {
                id: 5,
                cache: "169.254.20.10:53".parse().unwrap(),
            },
        ]);
        assert_eq!(
            listeners(&binds, PROTOCOL_UDP, "169.254.20.10:53"),
            (1 << 3) | (1 << 5)
        );
    }

    #[test]
    fn the_cache_port_decides() {
        let binds = cache_binds(&[TrackedCache {
            id: 0,
            cache: "127.0.0.1:5353".parse().unwrap(),
        }]);
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "127.0.0.1:53"), 0);
        assert_eq!(listeners(&binds, PROTOCOL_UDP, "127.0.0.1:5353"), 1);
    }
}
