//! Which caches a drain moves: the listeners grouped into caches, by their cache address and by
//! the processes holding the caches' sockets, and the caches a request's selection names.

use std::{fmt, net::SocketAddr};

use redirector_common::datapath::listener_bit;

use crate::liveness::cache_tasks::Holder;

/// Which caches a drain moves, as asked (`redirector drain`'s `--listener` and `--all`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// Listeners named: each brings its cache, and so every listener that cache serves (see
    /// [`group`]).
    pub listeners: Vec<String>,
    /// Every cache.
    pub all: bool,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.all {
            f.write_str("every listener")
        } else if self.listeners.is_empty() {
            f.write_str("the one cache")
        } else {
            write!(f, "the cache of {}", listeners_text(&self.listeners))
        }
    }
}

/// A listener as a drain sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its id in the per-listener maps.
    pub id: u32,
    /// Its name.
    pub name: String,
    /// Its cache's address.
    pub cache: SocketAddr,
}

/// One cache a drain moves, and every listener it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheDrain {
    /// The cache's addresses (its listeners' `cache`), in the order of their first listener.
    pub addresses: Vec<SocketAddr>,
    /// Its listeners, in id order.
    pub listeners: Vec<Member>,
    /// The processes seen holding its sockets (none when they were not looked for).
    pub processes: Vec<u32>,
}

impl CacheDrain {
    /// Its listeners' bits (`listener_bit`).
    fn mask(&self) -> u64 {
        self.listeners
            .iter()
            .fold(0, |mask, member| mask | listener_bit(member.id))
    }
}

/// Why a [`Selection`] names no cache.
#[derive(Debug, thiserror::Error)]
pub enum SelectionError {
    /// A listener named is not there.
    #[error(
        "there is no listener {name:?} (the listeners are: {known}); name one of those, and \
         every listener its cache serves is drained with it"
    )]
    UnknownListener {
        /// The name asked for.
        name: String,
        /// The names there are, comma-separated.
        known: String,
    },
    /// Nothing was named, and the listeners have more than one cache.
    #[error(
        "the listeners have {count} caches ({caches}): name the one to drain with --listener \
         NAME (every listener it serves is drained with it), or drain them all with --all"
    )]
    SeveralCaches {
        /// How many.
        count: usize,
        /// Each cache and its listeners.
        caches: String,
    },
    /// There are no listeners.
    #[error("there are no listeners to drain (has the agent started on this node?)")]
    NoListeners,
}

/// The caches of `listeners`, each with every listener it serves, in the order of their first
/// listener. A cache is what stops: two listeners are one cache's when their `cache` is the same
/// address (NodeLocal DNSCache: the link-local address and the kube-dns ClusterIP), or when one
/// process holds cache sockets of both (`holders`: AKS LocalDNS's CoreDNS, bound on the node's
/// and the cluster's cache address), and so on transitively.
#[must_use]
pub fn group(listeners: &[Member], holders: &[Holder]) -> Vec<CacheDrain> {
    let mut sorted = listeners.to_vec();
    sorted.sort_by_key(|member| member.id);
    let mut caches: Vec<CacheDrain> = Vec::new();
    for member in sorted {
        let address = canonical(member.cache);
        let bit = listener_bit(member.id);
        let shares_a_process = |mask: u64| {
            holders
                .iter()
                .any(|holder| holder.listeners & bit != 0 && holder.listeners & mask != 0)
        };
        // Every cache this listener joins becomes one, at the place of the first.
        let joined: Vec<usize> = caches
            .iter()
            .enumerate()
            .filter(|(_, cache)| {
                cache.addresses.contains(&address) || shares_a_process(cache.mask())
            })
            .map(|(at, _)| at)
            .collect();
        let Some((&first, others)) = joined.split_first() else {
            caches.push(CacheDrain {
                addresses: vec![address],
                listeners: vec![member],
                processes: Vec::new(),
            });
            continue;
        };
        for &at in others.iter().rev() {
            let other = caches.remove(at);
            let cache = &mut caches[first];
            cache.listeners.extend(other.listeners);
            for address in other.addresses {
                if !cache.addresses.contains(&address) {
                    cache.addresses.push(address);
                }
            }
        }
        let cache = &mut caches[first];
        cache.listeners.push(member);
        cache.listeners.sort_by_key(|member| member.id);
        if !cache.addresses.contains(&address) {
            cache.addresses.push(address);
        }
    }
    for cache in &mut caches {
        let mask = cache.mask();
        let mut processes: Vec<u32> = holders
            .iter()
            .filter(|holder| holder.listeners & mask != 0)
            .map(|holder| holder.tgid)
            .collect();
        processes.sort_unstable();
        processes.dedup();
        cache.processes = processes;
    }
    caches
}

impl Selection {
    /// The caches this selection names among `listeners`, grouped as [`group`] does with
    /// `holders`, each with every listener it serves.
    ///
    /// # Errors
    ///
    /// [`SelectionError`] for a name that is not there, or no name where the listeners have
    /// several caches.
    pub fn resolve(
        &self,
        listeners: &[Member],
        holders: &[Holder],
    ) -> Result<Vec<CacheDrain>, SelectionError> {
        let mut caches = group(listeners, holders);
        if caches.is_empty() {
            return Err(SelectionError::NoListeners);
        }
        if self.all {
            return Ok(caches);
        }
        if self.listeners.is_empty() {
            if caches.len() == 1 {
                return Ok(caches);
            }
            return Err(SelectionError::SeveralCaches {
                count: caches.len(),
                caches: caches
                    .iter()
                    .map(CacheDrain::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        let mut wanted = 0;
        for name in &self.listeners {
            let member = listeners
                .iter()
                .find(|member| &member.name == name)
                .ok_or_else(|| SelectionError::UnknownListener {
                    name: name.clone(),
                    known: listeners
                        .iter()
                        .map(|member| member.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            wanted |= listener_bit(member.id);
        }
        caches.retain(|cache| cache.mask() & wanted != 0);
        Ok(caches)
    }
}

impl fmt::Display for CacheDrain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addresses: Vec<String> = self.addresses.iter().map(ToString::to_string).collect();
        write!(f, "cache {}", addresses.join(", "))?;
        match self.processes.as_slice() {
            [] => {}
            [process] => write!(f, " (process {process})")?,
            processes => {
                let pids: Vec<String> = processes.iter().map(ToString::to_string).collect();
                write!(f, " (processes {})", pids.join(", "))?;
            }
        }
        let names: Vec<&str> = self
            .listeners
            .iter()
            .map(|member| member.name.as_str())
            .collect();
        write!(f, ": {}", listeners_text(&names))
    }
}

/// `listener a` or `listeners a, b`.
pub(super) fn listeners_text(names: &[impl AsRef<str>]) -> String {
    let joined = names
        .iter()
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() == 1 {
        format!("listener {joined}")
    } else {
        format!("listeners {joined}")
    }
}

/// One form per address: `[::ffff:a.b.c.d]:53` is the cache `a.b.c.d:53`.
fn canonical(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(address.ip().to_canonical(), address.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u32, name: &str, cache: &str) -> Member {
        Member {
            id,
            name: name.to_owned(),
            cache: cache.parse().expect("an address"),
        }
    }

    /// NodeLocal DNSCache's two listeners on one cache, and a third on a cache of its own.
    fn listeners() -> Vec<Member> {
        vec![
            member(0, "local", "169.254.20.10:53"),
            member(1, "other", "169.254.10.10:53"),
            member(2, "cluster-ip", "[::ffff:169.254.20.10]:53"),
        ]
    }

    fn names(caches: &[CacheDrain]) -> Vec<Vec<&str>> {
        caches
            .iter()
            .map(|drain| {
                drain
                    .listeners
                    .iter()
                    .map(|member| member.name.as_str())
                    .collect()
            })
            .collect()
    }

    fn named(names: &[&str]) -> Selection {
        Selection {
            listeners: names.iter().map(|name| (*name).to_owned()).collect(),
            all: false,
        }
    }

    #[test]
    fn a_listener_named_brings_every_listener_of_its_cache() {
        let listeners = listeners();
        let caches = named(&["cluster-ip"]).resolve(&listeners, &[]).unwrap();
        assert_eq!(names(&caches), [["local", "cluster-ip"]]);
        assert_eq!(caches[0].addresses, ["169.254.20.10:53".parse().unwrap()]);
        assert_eq!(
            caches[0].to_string(),
            "cache 169.254.20.10:53: listeners local, cluster-ip"
        );
        let caches = named(&["other"]).resolve(&listeners, &[]).unwrap();
        assert_eq!(names(&caches), [["other"]]);
        assert_eq!(
            caches[0].to_string(),
            "cache 169.254.10.10:53: listener other"
        );
        // Two names of one cache drain it once; names of two caches drain both.
        let caches = named(&["local", "cluster-ip"])
            .resolve(&listeners, &[])
            .unwrap();
        assert_eq!(names(&caches), [["local", "cluster-ip"]]);
        let caches = named(&["other", "local"]).resolve(&listeners, &[]).unwrap();
        assert_eq!(names(&caches), [vec!["local", "cluster-ip"], vec!["other"]]);
    }

    #[test]
    fn no_name_drains_the_one_cache_or_asks_which() {
        let one: Vec<Member> = listeners()
            .into_iter()
            .filter(|member| member.name != "other")
            .collect();
        let caches = Selection::default().resolve(&one, &[]).unwrap();
        assert_eq!(names(&caches), [["local", "cluster-ip"]]);
        let error = Selection::default().resolve(&listeners(), &[]).unwrap_err();
        let said = error.to_string();
        assert!(
            matches!(error, SelectionError::SeveralCaches { count: 2, .. }),
            "{said}"
        );
        assert!(
            said.contains("cache 169.254.20.10:53: listeners local, cluster-ip")
                && said.contains("--all"),
            "{said}"
        );
        let all = Selection {
            listeners: Vec::new(),
            all: true,
        };
        assert_eq!(
            names(&all.resolve(&listeners(), &[]).unwrap()),
            [vec!["local", "cluster-ip"], vec!["other"]]
        );
        assert!(matches!(
            Selection::default().resolve(&[], &[]),
            Err(SelectionError::NoListeners)
        ));
    }

    fn holder(tgid: u32, ids: &[u32]) -> Holder {
        Holder {
            tgid,
            cgroup_id: 1,
            listeners: ids.iter().fold(0, |mask, id| mask | listener_bit(*id)),
        }
    }

    /// AKS LocalDNS: each listener its own cache address, and one CoreDNS bound on both.
    fn aks() -> Vec<Member> {
        vec![
            member(0, "node", "169.254.10.10:53"),
            member(1, "cluster", "169.254.10.11:53"),
        ]
    }

    #[test]
    fn one_process_holding_both_addresses_is_one_cache() {
        // By address alone, two caches: naming one leaves the other on a process about to stop.
        let caches = named(&["node"]).resolve(&aks(), &[]).unwrap();
        assert_eq!(names(&caches), [["node"]]);
        // With the process that holds both, one cache, whichever is named.
        let coredns = [holder(4242, &[0, 1])];
        for name in ["node", "cluster"] {
            let caches = named(&[name]).resolve(&aks(), &coredns).unwrap();
            assert_eq!(names(&caches), [["node", "cluster"]], "{name}");
            assert_eq!(
                caches[0].to_string(),
                "cache 169.254.10.10:53, 169.254.10.11:53 (process 4242): listeners node, cluster"
            );
        }
        // And so a drain with no name finds the one cache.
        let caches = Selection::default().resolve(&aks(), &coredns).unwrap();
        assert_eq!(names(&caches), [["node", "cluster"]]);
        // Workers of one cache (several processes holding its sockets) are all named.
        let workers = [holder(7, &[0, 1]), holder(5, &[0]), holder(9, &[1])];
        let caches = named(&["node"]).resolve(&aks(), &workers).unwrap();
        assert_eq!(caches[0].processes, [5, 7, 9]);
    }

    #[test]
    fn processes_of_their_own_keep_their_caches_apart() {
        let apart = [holder(10, &[0]), holder(11, &[1])];
        let caches = named(&["node"]).resolve(&aks(), &apart).unwrap();
        assert_eq!(names(&caches), [["node"]]);
        assert_eq!(
            caches[0].to_string(),
            "cache 169.254.10.10:53 (process 10): listener node"
        );
        let error = Selection::default().resolve(&aks(), &apart).unwrap_err();
        assert!(
            matches!(error, SelectionError::SeveralCaches { count: 2, .. }),
            "{error}"
        );
    }

    #[test]
    fn addresses_and_processes_join_transitively() {
        // 0 and 2 share an address; a process holds 2's and 3's; 1 stands alone.
        let listeners = vec![
            member(0, "a", "169.254.20.10:53"),
            member(1, "b", "169.254.10.10:53"),
            member(2, "c", "169.254.20.10:53"),
            member(3, "d", "[fd00:53::10]:53"),
        ];
        let holders = [holder(3, &[2, 3])];
        let caches = group(&listeners, &holders);
        assert_eq!(names(&caches), [vec!["a", "c", "d"], vec!["b"]]);
        // The process joins the first and the last listener, through the second.
        let holders = [holder(3, &[3, 1])];
        let caches = group(&listeners, &holders);
        assert_eq!(names(&caches), [vec!["a", "c"], vec!["b", "d"]]);
        let holders = [holder(3, &[3, 1]), holder(4, &[1, 0])];
        let caches = group(&listeners, &holders);
        assert_eq!(names(&caches), [["a", "b", "c", "d"]]);
        assert_eq!(caches[0].processes, [3, 4]);
        assert_eq!(caches[0].addresses.len(), 3, "{}", caches[0]);
    }

    #[test]
    fn an_unknown_name_is_refused_with_the_names_there_are() {
        let error = named(&["local", "cluster"])
            .resolve(&listeners(), &[])
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "there is no listener \"cluster\" (the listeners are: local, other, cluster-ip); name \
             one of those, and every listener its cache serves is drained with it"
        );
    }
}
