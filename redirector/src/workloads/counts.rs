//! Each workload's counts as the kernel holds them, its cgroups summed (a pod's containers are
//! one workload): what `status` shows, busiest first.

use std::collections::HashMap;

use redirector_common::workloads::{
    RCODE_CLASSES, RCODE_NXDOMAIN, RCODE_SERVFAIL, ROUTES, WorkloadCounters,
};
use serde::Serialize;

use super::Name;

/// One workload's counts since the kernel first counted each of its cgroups.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkloadCounts {
    /// Its name in one label (`pod/NAMESPACE/NAME`, `pod/UID`, `unit/NAME`, a path).
    pub workload: String,
    /// A pod's namespace, when known.
    pub namespace: String,
    /// A pod's name, when known.
    pub pod: String,
    /// Its cgroups the kernel counts.
    pub cgroups: usize,
    /// Queries by route (`workloads::ROUTE_LABELS` order).
    pub queries: [u64; ROUTES],
    /// Replies by rcode class (`workloads::RCODE_LABELS` order).
    pub replies: [u64; RCODE_CLASSES],
}

impl WorkloadCounts {
    /// Every query.
    #[must_use]
    pub fn total_queries(&self) -> u64 {
        self.queries.iter().sum()
    }

    /// Every reply.
    #[must_use]
    pub fn total_replies(&self) -> u64 {
        self.replies.iter().sum()
    }

    /// The share of its replies that were NXDOMAIN (0 without replies).
    #[must_use]
    pub fn nxdomain_share(&self) -> f64 {
        share(self.replies[RCODE_NXDOMAIN], self.total_replies())
    }

    /// The share of its replies that were SERVFAIL (0 without replies).
    #[must_use]
    pub fn servfail_share(&self) -> f64 {
        share(self.replies[RCODE_SERVFAIL], self.total_replies())
    }
}

/// `part` of `whole`, 0 for nothing.
#[must_use]
pub fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// `counts` by workload (the cgroups `name` gives one name summed), busiest first (ties by
/// name, so the order is stable).
pub fn by_workload(
    counts: &[(u64, WorkloadCounters)],
    mut name: impl FnMut(u64) -> Name,
) -> Vec<WorkloadCounts> {
    let mut merged: HashMap<String, WorkloadCounts> = HashMap::new();
    for (cgroup, counters) in counts {
        let named = name(*cgroup);
        let entry = merged
            .entry(named.workload.clone())
            .or_insert_with(|| WorkloadCounts {
                workload: named.workload,
                namespace: named.namespace,
                pod: named.pod,
                cgroups: 0,
                queries: [0; ROUTES],
                replies: [0; RCODE_CLASSES],
            });
        entry.cgroups += 1;
        for (sum, count) in entry.queries.iter_mut().zip(counters.queries) {
            *sum += count;
        }
        for (sum, count) in entry.replies.iter_mut().zip(counters.replies) {
            *sum += count;
        }
    }
    let mut list: Vec<WorkloadCounts> = merged.into_values().collect();
    list.sort_by(|a, b| {
        b.total_queries()
            .cmp(&a.total_queries())
            .then_with(|| a.workload.cmp(&b.workload))
    });
    list
}

#[cfg(test)]
mod tests {
    use redirector_common::workloads::{RCODE_NOERROR, ROUTE_CACHE, ROUTE_UPSTREAM};

    use super::*;

    #[test]
    fn a_workloads_cgroups_are_summed_and_the_busiest_comes_first() {
        let counters = |cache, nxdomain| {
            let mut counters = WorkloadCounters::default();
            counters.queries[ROUTE_CACHE] = cache;
            counters.queries[ROUTE_UPSTREAM] = 1;
            counters.replies[RCODE_NOERROR] = cache;
            counters.replies[RCODE_NXDOMAIN] = nxdomain;
            counters
        };
        let list = by_workload(
            &[
                (1, counters(3, 1)),
                (2, counters(5, 3)),
                (3, counters(20, 0)),
            ],
            |cgroup| Name {
                workload: if cgroup == 3 {
                    "unit/a.service"
                } else {
                    "pod/ns/web"
                }
                .to_owned(),
                namespace: if cgroup == 3 { "" } else { "ns" }.to_owned(),
                pod: if cgroup == 3 { "" } else { "web" }.to_owned(),
            },
        );
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].workload, "unit/a.service");
        assert_eq!(list[1].workload, "pod/ns/web");
        assert_eq!(list[1].cgroups, 2);
        assert_eq!(list[1].queries[ROUTE_CACHE], 8);
        assert_eq!(list[1].total_queries(), 10);
        assert_eq!(list[1].nxdomain_share(), 4.0 / 12.0);
        assert_eq!(list[0].servfail_share(), 0.0);
    }
}
