//! A pool larger than the kernel's (`MAX_POOL_TARGETS`) is cut to a subset chosen per node by
//! rendezvous (highest-random-weight) hashing: each node keeps the upstreams that score highest
//! for its name, so the nodes of a cluster spread their failover traffic over every kube-dns
//! endpoint instead of all sending it to the same lowest addresses. An endpoint coming or going
//! moves only the nodes that had it (or now pick it): the subsets are stable otherwise.

use super::Upstream;

/// `upstreams` (sorted) cut to at most `limit` for the node named `node`, in their sorted order,
/// and how many were left out.
#[must_use]
pub fn for_node(upstreams: &[Upstream], node: &str, limit: usize) -> (Vec<Upstream>, usize) {
    if upstreams.len() <= limit {
        return (upstreams.to_vec(), 0);
    }
    let node_hash = fnv1a(FNV_OFFSET, node.as_bytes());
    let mut scored: Vec<(u64, &Upstream)> = upstreams
        .iter()
        .map(|upstream| (score(node_hash, upstream), upstream))
        .collect();
    // Highest score first; ties (never in practice) broken by the upstream itself.
    scored.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    let mut chosen: Vec<Upstream> = scored
        .into_iter()
        .take(limit)
        .map(|(_, upstream)| *upstream)
        .collect();
    chosen.sort_unstable();
    (chosen, upstreams.len() - limit)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a: fixed, so every agent version and every node scores alike (std's hashers are
/// randomly keyed or may change between releases).
fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// The weight of `upstream` for the node whose name hashes to `node_hash`: FNV-1a of the
/// upstream's address and ports seeded with the node's hash, through SplitMix64's finalizer so
/// that nearby addresses get unrelated weights.
fn score(node_hash: u64, upstream: &Upstream) -> u64 {
    let address = match upstream.ip.to_canonical() {
        std::net::IpAddr::V4(ip) => ip.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(ip) => ip.octets(),
    };
    let mut hash = fnv1a(node_hash, &address);
    hash = fnv1a(hash, &upstream.udp_port.to_be_bytes());
    hash = fnv1a(hash, &upstream.tcp_port.to_be_bytes());
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, net::Ipv4Addr};

    use super::*;

    fn endpoints(count: u8) -> Vec<Upstream> {
        (1..=count)
            .map(|last| Upstream::dns(Ipv4Addr::new(10, 244, 0, last).into()))
            .collect()
    }

    #[test]
    fn a_pool_within_the_limit_is_kept_whole() {
        let pool = endpoints(32);
        assert_eq!(for_node(&pool, "node-1", 32), (pool, 0));
    }

    #[test]
    fn a_larger_pool_is_cut_to_the_limit_and_counted() {
        let pool = endpoints(100);
        let (chosen, dropped) = for_node(&pool, "node-1", 32);
        assert_eq!((chosen.len(), dropped), (32, 68));
        assert!(chosen.windows(2).all(|pair| pair[0] < pair[1]), "sorted");
        assert!(chosen.iter().all(|upstream| pool.contains(upstream)));
        assert_eq!(for_node(&pool, "node-1", 32).0, chosen, "stable per node");
    }

    #[test]
    fn nodes_spread_over_every_endpoint() {
        let pool = endpoints(100);
        let mut picked: HashMap<Upstream, usize> = HashMap::new();
        for node in 0..200 {
            for upstream in for_node(&pool, &format!("aks-nodepool1-{node}"), 32).0 {
                *picked.entry(upstream).or_default() += 1;
            }
        }
        // 200 nodes × 32 picks over 100 endpoints: 64 each on average.
        assert_eq!(picked.len(), 100, "every endpoint serves some node");
        let (fewest, most) = (
            picked.values().min().copied().unwrap_or(0),
            picked.values().max().copied().unwrap_or(0),
        );
        assert!(fewest >= 32 && most <= 100, "fewest {fewest}, most {most}");
    }

    #[test]
    fn an_endpoint_going_away_moves_only_its_own_place() {
        let pool = endpoints(100);
        let (before, _) = for_node(&pool, "node-7", 32);
        // Remove an endpoint this node had chosen: one replacement, the other 31 stay.
        let gone = before[0];
        let smaller: Vec<Upstream> = pool.iter().copied().filter(|u| *u != gone).collect();
        let (after, _) = for_node(&smaller, "node-7", 32);
        let kept = before
            .iter()
            .filter(|upstream| after.contains(upstream))
            .count();
        assert_eq!(kept, 31);
        // Remove one it had not chosen: nothing moves.
        let unchosen = *pool
            .iter()
            .find(|u| !before.contains(u))
            .expect("68 unchosen");
        let smaller: Vec<Upstream> = pool.iter().copied().filter(|u| *u != unchosen).collect();
        assert_eq!(for_node(&smaller, "node-7", 32).0, before);
    }
}
