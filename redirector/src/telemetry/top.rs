//! `redirector top`: the busiest workloads' DNS over the last window, as a table that refreshes
//! like `top`, or one JSON object per window.

use std::{collections::HashMap, fmt::Write as _, time::Duration};

use redirector_common::workloads::{
    RCODE_NXDOMAIN, RCODE_SERVFAIL, ROUTE_DIRECT, ROUTE_LIMITED, ROUTE_REFUSED, ROUTE_UPSTREAM,
};
use serde::Serialize;

use crate::workloads::{Name, RCODE_LABELS, ROUTE_LABELS, rates::WorkloadRate};

/// What the rows are sorted by, busiest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SortKey {
    /// Queries per second.
    Qps,
    /// Queries per second that went to an upstream (around the cache).
    Upstream,
    /// Queries per second to servers that are no listener.
    Direct,
    /// Queries per second refused (the `fail` policy with an empty pool).
    Refused,
    /// Queries per second refused over the workload's rate.
    Limited,
    /// NXDOMAIN replies per second.
    Nxdomain,
    /// SERVFAIL replies per second.
    Servfail,
}

impl SortKey {
    fn of(self, rate: &WorkloadRate) -> f64 {
        match self {
            Self::Qps => rate.query_rate(),
            Self::Upstream => rate.queries[ROUTE_UPSTREAM],
            Self::Direct => rate.queries[ROUTE_DIRECT],
            Self::Refused => rate.queries[ROUTE_REFUSED],
            Self::Limited => rate.queries[ROUTE_LIMITED],
            Self::Nxdomain => rate.replies[RCODE_NXDOMAIN],
            Self::Servfail => rate.replies[RCODE_SERVFAIL],
        }
    }
}

/// One workload's line.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopRow {
    /// Its name in one label.
    pub workload: String,
    /// A pod's namespace, when known.
    pub namespace: String,
    /// A pod's name, when known.
    pub pod: String,
    /// Queries per second.
    pub qps: f64,
    /// Queries per second by route.
    pub routes: HashMap<&'static str, f64>,
    /// Replies per second by rcode class.
    pub replies: HashMap<&'static str, f64>,
    /// The share of its replies that were NXDOMAIN.
    pub nxdomain_ratio: f64,
    /// The share of its replies that were SERVFAIL.
    pub servfail_ratio: f64,
}

/// One refresh.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Frame {
    /// The window the rates are over, milliseconds.
    pub window_ms: u64,
    /// Workloads that asked in the window.
    pub active: usize,
    /// The node's queries per second, every workload.
    pub qps: f64,
    /// What the rows are sorted by.
    #[serde(skip)]
    pub sort: Option<SortKey>,
    /// The busiest, sorted.
    pub rows: Vec<TopRow>,
}

/// The frame of `rates` (one per workload, named by `names`), sorted by `sort`, at most `limit`
/// rows.
#[must_use]
pub fn frame(
    mut rates: Vec<WorkloadRate>,
    names: &HashMap<u64, Name>,
    window: Duration,
    sort: SortKey,
    limit: usize,
) -> Frame {
    let qps = rates.iter().map(WorkloadRate::query_rate).sum();
    let active = rates.len();
    rates.sort_by(|a, b| {
        sort.of(b)
            .total_cmp(&sort.of(a))
            .then_with(|| b.query_rate().total_cmp(&a.query_rate()))
            .then(a.cgroup.cmp(&b.cgroup))
    });
    rates.truncate(limit);
    let unnamed = Name::default();
    let rows = rates
        .iter()
        .map(|rate| {
            let name = names.get(&rate.cgroup).unwrap_or(&unnamed);
            let replies = rate.reply_rate();
            TopRow {
                workload: name.workload.clone(),
                namespace: name.namespace.clone(),
                pod: name.pod.clone(),
                qps: rate.query_rate(),
                routes: ROUTE_LABELS.iter().copied().zip(rate.queries).collect(),
                replies: RCODE_LABELS.iter().copied().zip(rate.replies).collect(),
                nxdomain_ratio: ratio(rate.replies[RCODE_NXDOMAIN], replies),
                servfail_ratio: ratio(rate.replies[RCODE_SERVFAIL], replies),
            }
        })
        .collect();
    Frame {
        window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
        active,
        qps,
        sort: Some(sort),
        rows,
    }
}

/// `part` of `whole` for rates (0 without any).
fn ratio(part: f64, whole: f64) -> f64 {
    if whole > 0.0 { part / whole } else { 0.0 }
}

/// The frame as a table: a summary line, then one line per workload with its qps, the share of
/// each route and its NXDOMAIN and SERVFAIL ratios.
#[must_use]
pub fn render(frame: &Frame) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "DNS per workload over {:.1} s: {:.1} queries/s from {} workloads{}",
        frame.window_ms as f64 / 1000.0,
        frame.qps,
        frame.active,
        frame
            .sort
            .map(|sort| format!(", sorted by {sort:?}").to_lowercase())
            .unwrap_or_default()
    );
    text.push('\n');
    let mut header = vec!["WORKLOAD".to_owned(), "QPS".to_owned()];
    header.extend(ROUTE_LABELS.iter().map(|route| route.to_uppercase()));
    header.extend(["NXDOMAIN", "SERVFAIL"].map(str::to_owned));
    let mut rows = vec![header];
    for row in &frame.rows {
        let mut line = vec![row.workload.clone(), format!("{:.1}", row.qps)];
        line.extend(ROUTE_LABELS.iter().map(|route| {
            let per_second = row.routes.get(route).copied().unwrap_or_default();
            format!("{:.0}%", 100.0 * ratio(per_second, row.qps))
        }));
        line.push(format!("{:.0}%", 100.0 * row.nxdomain_ratio));
        line.push(format!("{:.0}%", 100.0 * row.servfail_ratio));
        rows.push(line);
    }
    if frame.rows.is_empty() {
        rows.push(vec!["(no workload asked in this window)".to_owned()]);
    }
    super::status::table(&mut text, &rows);
    text
}

#[cfg(test)]
mod tests {
    use redirector_common::workloads::{RCODE_CLASSES, RCODE_NOERROR, ROUTE_CACHE, ROUTES};

    use super::*;

    fn rate(cgroup: u64, cache: f64, upstream: f64, noerror: f64, nxdomain: f64) -> WorkloadRate {
        let mut queries = [0.0; ROUTES];
        queries[ROUTE_CACHE] = cache;
        queries[ROUTE_UPSTREAM] = upstream;
        let mut replies = [0.0; RCODE_CLASSES];
        replies[RCODE_NOERROR] = noerror;
        replies[RCODE_NXDOMAIN] = nxdomain;
        WorkloadRate {
            cgroup,
            queries,
            replies,
        }
    }

    fn names() -> HashMap<u64, Name> {
        [
            (1, "pod/ns/quiet"),
            (2, "pod/ns/loud"),
            (3, "unit/cron.service"),
        ]
        .into_iter()
        .map(|(cgroup, workload)| {
            (
                cgroup,
                Name {
                    workload: workload.to_owned(),
                    ..Name::default()
                },
            )
        })
        .collect()
    }

    #[test]
    fn rows_are_sorted_by_the_chosen_key_and_limited() {
        let rates = vec![
            rate(1, 1.0, 0.0, 1.0, 0.0),
            rate(2, 50.0, 50.0, 20.0, 80.0),
            rate(3, 0.0, 10.0, 10.0, 0.0),
        ];
        let by_qps = frame(
            rates.clone(),
            &names(),
            Duration::from_secs(2),
            SortKey::Qps,
            2,
        );
        let order: Vec<&str> = by_qps
            .rows
            .iter()
            .map(|row| row.workload.as_str())
            .collect();
        assert_eq!(order, ["pod/ns/loud", "unit/cron.service"]);
        assert_eq!(by_qps.active, 3);
        assert_eq!(by_qps.qps, 111.0);
        assert_eq!(by_qps.rows[0].nxdomain_ratio, 0.8);
        let by_upstream = frame(
            rates,
            &names(),
            Duration::from_secs(2),
            SortKey::Upstream,
            3,
        );
        assert_eq!(by_upstream.rows[0].workload, "pod/ns/loud");
        assert_eq!(by_upstream.rows[1].workload, "unit/cron.service");
    }

    #[test]
    fn the_table_gives_route_shares_and_ratios() {
        let shown = frame(
            vec![rate(2, 50.0, 50.0, 20.0, 80.0)],
            &names(),
            Duration::from_millis(2000),
            SortKey::Qps,
            20,
        );
        let text = render(&shown);
        assert!(
            text.starts_with(
                "DNS per workload over 2.0 s: 100.0 queries/s from 1 workloads, sorted by qps\n"
            ),
            "{text}"
        );
        let row = text
            .lines()
            .find(|line| line.starts_with("pod/ns/loud"))
            .unwrap();
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            [
                "pod/ns/loud",
                "100.0",
                "50%",
                "50%",
                "0%",
                "0%",
                "0%",
                "80%",
                "0%"
            ]
        );
        let json = serde_json::to_value(&shown).unwrap();
        assert_eq!(json["rows"][0]["routes"]["upstream"], 50.0);
        assert_eq!(json["rows"][0]["replies"]["nxdomain"], 80.0);
        let empty = frame(
            Vec::new(),
            &names(),
            Duration::from_secs(1),
            SortKey::Qps,
            20,
        );
        assert!(render(&empty).contains("(no workload asked in this window)"));
    }
}
