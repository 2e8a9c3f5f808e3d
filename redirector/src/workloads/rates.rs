//! From the kernel's counts to what operators read: each workload's rates between two readings,
//! the node's running totals, and the busiest workloads by query rate with the rest summed.
//!
//! The programs' counts live in an LRU: a cgroup evicted and counted again starts from zero with a
//! new `life` number, so an entry whose life differs from the last reading's (or, for one the
//! programs made before lives were drawn, whose count went down) is a new life, and all of it is
//! new.

use std::{collections::HashMap, time::Duration};

use redirector_common::workloads::{RCODE_CLASSES, ROUTES, WorkloadCounters};

/// One workload's rates over the last window, per second.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadRate {
    /// Its cgroup id.
    pub cgroup: u64,
    /// Queries per second by route (`ROUTE_*`).
    pub queries: [f64; ROUTES],
    /// Replies per second by rcode class (`RCODE_*`).
    pub replies: [f64; RCODE_CLASSES],
}

impl WorkloadRate {
    /// Queries per second, every route.
    #[must_use]
    pub fn query_rate(&self) -> f64 {
        self.queries.iter().sum()
    }

    /// Replies per second, every class.
    #[must_use]
    pub fn reply_rate(&self) -> f64 {
        self.replies.iter().sum()
    }

    fn add(&mut self, other: &Self) {
        for (sum, rate) in self.queries.iter_mut().zip(other.queries) {
            *sum += rate;
        }
        for (sum, rate) in self.replies.iter_mut().zip(other.replies) {
            *sum += rate;
        }
    }
}

/// The busiest workloads and the rest, over one window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Top {
    /// At most N workloads, busiest first.
    pub busiest: Vec<WorkloadRate>,
    /// Every other workload, summed (cgroup 0).
    pub rest: Option<WorkloadRate>,
}

/// The readings the rates are computed from, and the node's running totals.
#[derive(Debug, Default)]
pub struct Rates {
    last: HashMap<u64, WorkloadCounters>,
    /// Every query counted since the agent started, by route (monotonic).
    pub queries_total: [u64; ROUTES],
    /// Every reply counted since the agent started, by class (monotonic).
    pub replies_total: [u64; RCODE_CLASSES],
    /// Readings taken.
    pub readings: u64,
}

impl Rates {
    /// Takes a reading of every counted workload, `window` after the last one, and returns each
    /// workload's rates over it (none at the first reading, which only sets the baseline).
    pub fn read(
        &mut self,
        counts: Vec<(u64, WorkloadCounters)>,
        window: Duration,
    ) -> Vec<WorkloadRate> {
        let seconds = window.as_secs_f64();
        let first = self.readings == 0;
        self.readings += 1;
        let mut rates = Vec::new();
        let mut current = HashMap::with_capacity(counts.len());
        for (cgroup, counters) in counts {
            let delta = match self.last.get(&cgroup) {
                Some(before) => new_since(before, &counters),
                // Counted for the first time since the last reading (or since the agent
                // started: the baseline, not new).
                None if first => WorkloadCounters::default(),
                None => counters,
            };
            current.insert(cgroup, counters);
            for (total, new) in self.queries_total.iter_mut().zip(delta.queries) {
                *total += new;
            }
            for (total, new) in self.replies_total.iter_mut().zip(delta.replies) {
                *total += new;
            }
            if first || seconds <= 0.0 {
                continue;
            }
            if delta.total_queries() == 0 && delta.total_replies() == 0 {
                continue;
            }
            rates.push(WorkloadRate {
                cgroup,
                queries: delta.queries.map(|count| count as f64 / seconds),
                replies: delta.replies.map(|count| count as f64 / seconds),
            });
        }
        self.last = current;
        rates
    }
}

impl Rates {
    /// Forgets the last reading of `cgroups`, whose entries the agent removed: the programs count
    /// each afresh from zero, and all of that is new.
    pub fn forget(&mut self, cgroups: &[u64]) {
        for cgroup in cgroups {
            self.last.remove(cgroup);
        }
    }
}

/// What `after` counted since `before`: the difference, or all of `after` where it is another
/// life (the cgroup was evicted from the LRU and counted again).
fn new_since(before: &WorkloadCounters, after: &WorkloadCounters) -> WorkloadCounters {
    let restarted = after.life != before.life
        || after
            .queries
            .iter()
            .zip(before.queries)
            .chain(after.replies.iter().zip(before.replies))
            .any(|(after, before)| *after < before);
    if restarted {
        return *after;
    }
    WorkloadCounters {
        queries: std::array::from_fn(|route| after.queries[route] - before.queries[route]),
        replies: std::array::from_fn(|class| after.replies[class] - before.replies[class]),
        ..WorkloadCounters::default()
    }
}

/// `rates` of the cgroups that `name` gives one workload (a pod's containers, a unit's
/// sub-cgroups) summed into one, keyed by its lowest cgroup id, with the name of each.
pub fn by_workload(
    rates: Vec<WorkloadRate>,
    mut name: impl FnMut(u64) -> super::Name,
) -> (Vec<WorkloadRate>, HashMap<u64, super::Name>) {
    let mut merged: HashMap<String, (super::Name, WorkloadRate)> = HashMap::new();
    for rate in rates {
        let named = name(rate.cgroup);
        match merged.get_mut(&named.workload) {
            Some((_, sum)) => {
                sum.cgroup = sum.cgroup.min(rate.cgroup);
                sum.add(&rate);
            }
            None => {
                merged.insert(named.workload.clone(), (named, rate));
            }
        }
    }
    let mut names = HashMap::with_capacity(merged.len());
    let rates = merged
        .into_values()
        .map(|(named, rate)| {
            names.insert(rate.cgroup, named);
            rate
        })
        .collect();
    (rates, names)
}

/// The `n` busiest of `rates` by query rate (ties by cgroup id, so the choice is stable), and
/// the rest summed.
#[must_use]
pub fn top(mut rates: Vec<WorkloadRate>, n: usize) -> Top {
    rates.sort_by(|a, b| {
        b.query_rate()
            .total_cmp(&a.query_rate())
            .then(a.cgroup.cmp(&b.cgroup))
    });
    let rest_rates = rates.split_off(n.min(rates.len()));
    let rest = (!rest_rates.is_empty()).then(|| {
        let mut sum = WorkloadRate {
            cgroup: 0,
            queries: [0.0; ROUTES],
            replies: [0.0; RCODE_CLASSES],
        };
        for rate in &rest_rates {
            sum.add(rate);
        }
        sum
    });
    Top {
        busiest: rates,
        rest,
    }
}

#[cfg(test)]
mod tests {
    use redirector_common::workloads::{RCODE_NXDOMAIN, ROUTE_CACHE, ROUTE_UPSTREAM};

    use super::*;

    fn counts(cache: u64, upstream: u64, nxdomain: u64) -> WorkloadCounters {
        let mut counters = WorkloadCounters::default();
        counters.queries[ROUTE_CACHE] = cache;
        counters.queries[ROUTE_UPSTREAM] = upstream;
        counters.replies[RCODE_NXDOMAIN] = nxdomain;
        counters
    }

    #[test]
    fn the_first_reading_is_the_baseline_and_the_next_gives_rates() {
        let mut rates = Rates::default();
        let window = Duration::from_secs(10);
        assert!(rates.read(vec![(7, counts(100, 0, 5))], window).is_empty());
        assert_eq!(rates.queries_total, [0; ROUTES]);
        let read = rates.read(vec![(7, counts(150, 20, 15))], window);
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].queries[ROUTE_CACHE], 5.0);
        assert_eq!(read[0].queries[ROUTE_UPSTREAM], 2.0);
        assert_eq!(read[0].replies[RCODE_NXDOMAIN], 1.0);
        assert_eq!(rates.queries_total[ROUTE_CACHE], 50);
        assert_eq!(rates.replies_total[RCODE_NXDOMAIN], 10);
    }

    #[test]
    fn a_workload_counted_again_after_eviction_is_all_new() {
        let mut rates = Rates::default();
        let window = Duration::from_secs(1);
        rates.read(vec![(7, counts(100, 0, 0))], window);
        let read = rates.read(vec![(7, counts(3, 0, 0)), (8, counts(4, 0, 0))], window);
        let by_cgroup: HashMap<u64, f64> = read
            .iter()
            .map(|rate| (rate.cgroup, rate.query_rate()))
            .collect();
        assert_eq!(by_cgroup[&7], 3.0);
        assert_eq!(by_cgroup[&8], 4.0);
        assert_eq!(rates.queries_total[ROUTE_CACHE], 7);
    }

    /// An evicted workload that out-counts its old life before the next reading: its new life
    /// number says it is new, where its counts alone would have given the difference (50, under
    /// by the whole old life).
    #[test]
    fn a_new_life_that_out_counts_the_old_is_all_new() {
        let mut rates = Rates::default();
        let window = Duration::from_secs(1);
        let life = |count: u64, life: u32| WorkloadCounters {
            life,
            ..counts(count, 0, 0)
        };
        rates.read(vec![(7, life(100, 11))], window);
        rates.read(vec![(7, life(120, 11))], window);
        let read = rates.read(vec![(7, life(150, 12))], window);
        assert_eq!(read[0].query_rate(), 150.0);
        assert_eq!(rates.queries_total[ROUTE_CACHE], 20 + 150);
    }

    /// The agent forgot a workload's entry (its exemption changed): its next counts are all new.
    #[test]
    fn a_forgotten_workload_is_all_new() {
        let mut rates = Rates::default();
        let window = Duration::from_secs(1);
        rates.read(vec![(7, counts(100, 0, 0))], window);
        rates.forget(&[7]);
        let read = rates.read(vec![(7, counts(150, 0, 0))], window);
        assert_eq!(read[0].query_rate(), 150.0);
    }

    #[test]
    fn an_idle_workload_has_no_rate() {
        let mut rates = Rates::default();
        let window = Duration::from_secs(1);
        rates.read(vec![(7, counts(1, 0, 0))], window);
        assert!(rates.read(vec![(7, counts(1, 0, 0))], window).is_empty());
    }

    #[test]
    fn a_pods_containers_are_one_workload() {
        let rate = |cgroup, queries| WorkloadRate {
            cgroup,
            queries: [queries, 0.0, 0.0, 0.0, 0.0],
            replies: [0.0; RCODE_CLASSES],
        };
        let (merged, names) = by_workload(
            vec![rate(12, 1.0), rate(11, 2.0), rate(20, 4.0)],
            |cgroup| super::super::Name {
                workload: if cgroup < 20 {
                    "pod/a/web"
                } else {
                    "unit/x.service"
                }
                .to_owned(),
                ..super::super::Name::default()
            },
        );
        let mut merged: Vec<(u64, f64)> = merged
            .iter()
            .map(|rate| (rate.cgroup, rate.query_rate()))
            .collect();
        merged.sort_by_key(|(cgroup, _)| *cgroup);
        assert_eq!(merged, [(11, 3.0), (20, 4.0)]);
        assert_eq!(names[&11].workload, "pod/a/web");
        assert_eq!(names[&20].workload, "unit/x.service");
    }

    #[test]
    fn the_top_keeps_n_busiest_and_sums_the_rest_whatever_their_number() {
        let rates: Vec<WorkloadRate> = (1..=1000_u64)
            .map(|cgroup| WorkloadRate {
                cgroup,
                queries: [cgroup as f64, 0.0, 0.0, 0.0, 0.0],
                replies: [0.0, 1.0, 0.0, 0.0, 0.0],
            })
            .collect();
        let top = top(rates, 5);
        let chosen: Vec<u64> = top.busiest.iter().map(|rate| rate.cgroup).collect();
        assert_eq!(chosen, [1000, 999, 998, 997, 996]);
        let rest = top.rest.expect("the rest");
        assert_eq!(rest.query_rate(), (1..=995).sum::<u64>() as f64);
        assert_eq!(rest.replies[1], 995.0);
        let few = super::top(
            vec![WorkloadRate {
                cgroup: 1,
                queries: [1.0, 0.0, 0.0, 0.0, 0.0],
                replies: [0.0; RCODE_CLASSES],
            }],
            5,
        );
        assert_eq!(few.busiest.len(), 1);
        assert!(few.rest.is_none());
    }
}
