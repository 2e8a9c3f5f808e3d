//! Conntrack entries left by fresh-socket queries (as glibc sends them), per path.

use std::{collections::BTreeSet, net::IpAddr};

use serde::Serialize;

use super::{
    rig::{CACHE_ADDRESS, LISTENER, Rig, VIP},
    steering::Path,
};
use bpf_tests::{
    conntrack,
    sandbox::{Ns, Query, Transport},
    topology::dns,
};

/// Queries per measurement.
pub const QUERIES: u16 = 1000;

/// What one path left behind.
#[derive(Clone, Debug, Serialize)]
pub struct Entries {
    /// The path.
    pub path: Path,
    /// Queries sent.
    pub queries: u16,
    /// Of them answered.
    pub answered: usize,
    /// Conntrack entries for the listener, the cache or the VIP afterwards.
    pub entries: usize,
}

/// Flushes conntrack, sends `QUERIES` fresh-socket UDP queries along `path`, counts the entries.
pub fn measure(rig: &Rig, path: Path) -> anyhow::Result<Entries> {
    let node = rig.sandbox.netns(Ns::Node);
    conntrack::flush(node)?;
    let outcomes = rig.sandbox.queries_in(
        Ns::Pod,
        rig.sandbox.cgroup(),
        Query::new(dns(path.server()), Transport::Udp),
        QUERIES,
    )?;
    let mut lines = BTreeSet::new();
    for address in [LISTENER, CACHE_ADDRESS, VIP] {
        lines.extend(conntrack::entries(node, IpAddr::V4(address))?);
    }
    Ok(Entries {
        path,
        queries: QUERIES,
        answered: outcomes.iter().filter(|outcome| outcome.ok).count(),
        entries: lines.len(),
    })
}
