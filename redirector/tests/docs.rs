//! What the docs tell operators to query and to type, checked against what the agent serves and
//! what its command line takes (issue 30).
//!
//! - Every PromQL query of docs/operations.md's table is evaluated by promtool on series made of
//!   the agent's own `/metrics` text, scraped each minute from a node that runs into the trouble
//!   the query asks about, and from one that stays healthy: a query that watches for trouble must
//!   find it in the first and nothing in the second, a query that reads a value must find it.
//! - Every label a doc names on a metric (`metric{label="value"}`, the values of
//!   docs/observability.md's table) is one the agent serves with that value.
//! - Every `redirector ...` command the docs and the shipped files show is taken by the CLI.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    process::Command,
    time::{Duration, SystemTime},
};

use redirector::{
    conntrack_bypass::BypassStatus,
    sources::{STATIC_SOURCE, SourceKind, plausible::Rejection},
    telemetry::{
        metrics,
        snapshot::{ListenerSnapshot, reason_label},
        stats::{AgentStats, ErrorKind, Transition},
    },
    workloads::rates::WorkloadRate,
};
use redirector_common::{
    listener::{Reason, Route},
    workloads::{
        RCODE_CLASSES, RCODE_NOERROR, RCODE_NXDOMAIN, ROUTE_CACHE, ROUTE_DIRECT, ROUTE_LIMITED,
        ROUTES,
    },
};

mod common;
mod markdown;
mod served;

use common::{read, repo};
use markdown::{code_spans, table};

/// The one listener of the node.
const LISTENER: &str = "node";
/// Its upstream target.
const TARGET: &str = "10.96.0.10:53";
/// The node the agent runs on, and where Prometheus scrapes it.
const NODE: &str = "node-a";
const INSTANCE: &str = "10.0.0.1:9353";
/// Scrapes, a minute apart; the trouble starts at `TROUBLE_FROM` and lasts to the last one,
/// where the queries are evaluated.
const SCRAPES: usize = 40;
const TROUBLE_FROM: usize = 20;

/// A node as Prometheus sees it: the agent's state, whether it serves, kube-state-metrics'
/// inventory of nodes.
struct Node {
    listener: ListenerSnapshot,
    stats: AgentStats,
    /// What the node's clock is ahead of the test's (a source silent that long).
    ahead: Duration,
    /// False while the agent is down: its scrapes fail (`up` 0) and it serves nothing.
    serving: bool,
    /// The probes of the cache succeed.
    probes_answer: bool,
    /// The pool's source answers.
    source_answers: bool,
    /// Every node kube-state-metrics lists.
    inventory: Vec<&'static str>,
    /// The busiest workload's DNS per second, by route and rcode class (the rest ask 100
    /// queries a second through the cache, all answered).
    workload: WorkloadRate,
    /// The agent's totals of every workload's queries and replies since it started.
    workload_totals: ([u64; ROUTES], [u64; RCODE_CLASSES]),
}

impl Node {
    /// A healthy node: DNS to its cache, probes answered, a pool from Kubernetes, the bypass
    /// table in place, the agent ready.
    fn healthy() -> Self {
        let listener = served::healthy_listener(LISTENER, IpAddr::from([10, 96, 0, 10]));
        let stats = AgentStats::for_node(NODE.to_owned());
        ready(&stats);
        Self {
            listener,
            stats,
            ahead: Duration::ZERO,
            serving: true,
            probes_answer: true,
            source_answers: true,
            inventory: vec![NODE],
            workload: {
                let mut pod = WorkloadRate {
                    cgroup: 1,
                    queries: [0.0; ROUTES],
                    replies: [0.0; RCODE_CLASSES],
                };
                pod.queries[ROUTE_CACHE] = 40.0;
                pod.replies[RCODE_NOERROR] = 40.0;
                pod
            },
            workload_totals: ([0; ROUTES], [0; RCODE_CLASSES]),
        }
    }

    /// A minute of the node's life: probes, DNS, the source's answers.
    fn minute(&mut self) {
        let stats = &self.stats;
        stats.record_probe(LISTENER, self.probes_answer, Duration::from_millis(1));
        let udp = &mut self.listener.counters.udp;
        if self.listener.route == "cache" {
            udp.to_cache += 600;
        } else {
            udp.to_upstream += 600;
        }
        udp.replies_rewritten += 600;
        if self.source_answers {
            stats.record_source_sync("kubernetes", Duration::from_millis(1));
            stats.record_source_contact("kubernetes");
        }
        // The agent's readings of the workloads: the busiest pod and the rest's 100 a second.
        let (queries, replies) = &mut self.workload_totals;
        queries[ROUTE_CACHE] += 100 * 60;
        replies[RCODE_NOERROR] += 100 * 60;
        for (total, rate) in queries.iter_mut().zip(self.workload.queries) {
            *total += (rate * 60.0) as u64;
        }
        for (total, rate) in replies.iter_mut().zip(self.workload.replies) {
            *total += (rate * 60.0) as u64;
        }
        stats.record_workloads(served::workloads_view(
            self.workload.clone(),
            *queries,
            *replies,
        ));
    }

    /// What one scrape of the node stores, by series (`name{labels}`), the target's labels added.
    fn scrape(&self) -> Vec<(String, String)> {
        let mut samples = Vec::new();
        let target = format!("instance=\"{INSTANCE}\",job=\"redirector\"");
        samples.push((
            format!("up{{{target}}}"),
            if self.serving { "1" } else { "0" }.to_owned(),
        ));
        for node in &self.inventory {
            samples.push((
                format!(
                    "kube_node_info{{instance=\"ksm:8080\",job=\"kube-state-metrics\",node=\"{node}\"}}"
                ),
                "1".to_owned(),
            ));
        }
        if self.serving {
            samples.extend(samples_of(&self.render(), &target));
        }
        samples
    }

    fn render(&self) -> String {
        metrics::render(
            std::slice::from_ref(&self.listener),
            &self.stats,
            SystemTime::now() + self.ahead,
        )
    }
}

/// What a node's agent sets at its start once its programs are attached and its pools synced.
fn ready(stats: &AgentStats) {
    stats.record_pool_source(LISTENER, "kubernetes");
    stats.record_upstream_state(LISTENER, TARGET, true);
    stats.record_conntrack_bypass(BypassStatus::Active, 0);
    stats.set_ready();
}

/// The samples of a `/metrics` text, `labels` added to each series.
fn samples_of(text: &str, labels: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("SERIES VALUE");
            let series = match series.split_once('{') {
                Some((name, rest)) => format!("{name}{{{labels},{rest}"),
                None => format!("{series}{{{labels}}}"),
            };
            (series, value.to_owned())
        })
        .collect()
}

/// What a query of the table is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Watches for trouble: finds series in it, and none on a healthy node.
    Watch,
    /// Reads a value: finds series.
    Read,
}

/// One query of the table, and the trouble it is shown in (applied at each scrape from
/// `TROUBLE_FROM` on; `first` at the first).
struct Case {
    query: &'static str,
    kind: Kind,
    trouble: fn(&mut Node, bool),
}

/// The listener moves upstream for `reason` (once; the agent records the transition).
fn routed_upstream(node: &mut Node, reason: Reason) {
    if node.listener.route == "upstream" {
        return;
    }
    node.listener.route = "upstream";
    node.listener.reason_code = reason_label(reason);
    node.stats.record_transition(Transition {
        listener: LISTENER.to_owned(),
        from: Route::Cache,
        to: Route::Upstream,
        reason,
        at: SystemTime::now(),
    });
}

/// Every query docs/operations.md's table shows.
const CASES: &[Case] = &[
    Case {
        query: r#"redirector_listener_route{route="upstream"} == 1"#,
        kind: Kind::Watch,
        trouble: |node, _| routed_upstream(node, Reason::NoSockets),
    },
    Case {
        query: "redirector_listener_reason == 1",
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: r#"increase(redirector_probes_total{result="failure"}[2m]) > 0 unless on (instance, listener) increase(redirector_probes_total{result="success"}[2m]) > 0"#,
        kind: Kind::Watch,
        trouble: |node, _| node.probes_answer = false,
    },
    Case {
        query: r#"redirector_listener_reason{reason="override"}"#,
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: r#"redirector_listener_route{route="cache"}"#,
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: r#"increase(redirector_kernel_flips_total{reason="stalled"}[15m]) > 0"#,
        kind: Kind::Watch,
        trouble: |node, _| node.listener.flips.stalled += 1,
    },
    Case {
        query: r#"redirector_listener_reason{reason="drained"} == 1"#,
        kind: Kind::Watch,
        trouble: |node, _| routed_upstream(node, Reason::Drained),
    },
    Case {
        query: "rate(redirector_probe_servfails_total[5m]) > 0",
        kind: Kind::Watch,
        trouble: |node, _| node.stats.record_probe_servfail(LISTENER),
    },
    Case {
        query: "redirector_upstream_up == 0",
        kind: Kind::Watch,
        trouble: |node, _| node.stats.record_upstream_state(LISTENER, TARGET, false),
    },
    Case {
        query: "redirector_pool_upstreams_left_out > 0",
        kind: Kind::Watch,
        trouble: |node, _| node.stats.record_pool_left_out(LISTENER, 3),
    },
    Case {
        query: "increase(redirector_failover_seconds_total[1h])",
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: "sum by (listener, decision) (rate(redirector_steering_decisions_total[5m]))",
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: r#"rate(redirector_steering_decisions_total{decision="fail"}[5m]) > 0"#,
        kind: Kind::Watch,
        trouble: |node, _| {
            routed_upstream(node, Reason::NoSockets);
            node.listener.pool.clear();
            node.listener.empty_pool = "fail";
            node.listener.counters.udp.failed_empty_pool += 600;
        },
    },
    Case {
        query: r#"redirector_pool_backends{source!="static"} == 0"#,
        kind: Kind::Watch,
        trouble: |node, _| node.listener.pool.clear(),
    },
    Case {
        query: r#"redirector_pool_last_sync_age_seconds{source!="static"} > 300"#,
        kind: Kind::Watch,
        trouble: |node, _| {
            node.source_answers = false;
            node.ahead += Duration::from_secs(60);
        },
    },
    Case {
        query: r#"increase(redirector_errors_total{kind="kube_api"}[5m]) > 0"#,
        kind: Kind::Watch,
        trouble: |node, _| node.stats.record_error(ErrorKind::KubeApi),
    },
    Case {
        query: "rate(redirector_reply_rewrite_misses_total[5m]) > 0",
        kind: Kind::Watch,
        trouble: |node, _| node.listener.counters.udp.reply_misses += 10,
    },
    Case {
        query: r#"redirector_conntrack_bypass_active{status=~"unavailable|failing"}"#,
        kind: Kind::Watch,
        trouble: |node, _| {
            node.stats
                .record_conntrack_bypass(BypassStatus::Unavailable, 0);
        },
    },
    Case {
        query: "increase(redirector_conntrack_bypass_restorations_total[1h])",
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: "min_over_time(up[5m]) == 0 and on (instance, job) max_over_time(redirector_build_info[1h])",
        kind: Kind::Watch,
        trouble: |node, _| node.serving = false,
    },
    Case {
        query: "count by (node) (kube_node_info) unless on (node) count by (node) (redirector_build_info)",
        kind: Kind::Watch,
        trouble: |node, first| {
            if first {
                node.inventory.push("node-b");
            }
        },
    },
    Case {
        query: "redirector_ready == 0",
        kind: Kind::Watch,
        // The agent restarted and is not ready yet: its counters start again.
        trouble: |node, first| {
            if first {
                node.stats = AgentStats::for_node(NODE.to_owned());
            }
        },
    },
    Case {
        query: "increase(redirector_errors_total[15m])",
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: "sum by (instance, workload, route) (redirector_workload_query_rate)",
        kind: Kind::Read,
        trouble: |_, _| {},
    },
    Case {
        query: r#"redirector_workload_query_rate{route="direct",workload!="other"} > 0"#,
        kind: Kind::Watch,
        // The pod asks a server that is no listener (kube-dns's Service, say) for some of it.
        trouble: |node, _| node.workload.queries[ROUTE_DIRECT] = 10.0,
    },
    Case {
        query: r#"redirector_workload_reply_rate{rcode="nxdomain",workload!="other"} >= 20 and ignoring (rcode) redirector_workload_reply_rate{rcode="nxdomain",workload!="other"} / ignoring (rcode) sum without (rcode) (redirector_workload_reply_rate) >= 0.5"#,
        kind: Kind::Watch,
        // Its search path: three names that do not exist before the one that does.
        trouble: |node, _| {
            node.workload.queries[ROUTE_CACHE] = 160.0;
            node.workload.replies[RCODE_NXDOMAIN] = 120.0;
        },
    },
    Case {
        query: r#"rate(redirector_workload_queries_total{route="limited"}[5m]) > 0"#,
        kind: Kind::Watch,
        trouble: |node, _| node.workload.queries[ROUTE_LIMITED] = 500.0,
    },
];

/// The node's scrapes, with `trouble` from `TROUBLE_FROM` on; and its last `/metrics` text.
fn run(trouble: Option<fn(&mut Node, bool)>) -> (BTreeMap<String, Vec<Option<String>>>, String) {
    let mut node = Node::healthy();
    let mut series: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
    for scrape in 0..SCRAPES {
        if let Some(trouble) = trouble
            && scrape >= TROUBLE_FROM
        {
            trouble(&mut node, scrape == TROUBLE_FROM);
        }
        node.minute();
        for (name, value) in node.scrape() {
            series.entry(name).or_insert_with(|| vec![None; SCRAPES])[scrape] = Some(value);
        }
    }
    (series, node.render())
}

/// promtool's `input_series` of `series`.
fn input_series(series: &BTreeMap<String, Vec<Option<String>>>) -> serde_json::Value {
    series
        .iter()
        .map(|(name, values)| {
            let values: Vec<&str> = values
                .iter()
                .map(|value| value.as_deref().unwrap_or("_"))
                .collect();
            serde_json::json!({ "series": name, "values": values.join(" ") })
        })
        .collect()
}

/// True for a span of the query column that is a query, not a metric, label or value it names.
fn is_query(span: &str) -> bool {
    let bare_metric = span.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    !bare_metric
        && ["redirector_", "up[", "kube_node_info"]
            .iter()
            .any(|mark| span.contains(mark))
}

/// What the agent serves in every state the tests make, and with every value of the labels
/// whose values come from a fixed list (bypass status, rejection reason, check result).
fn every_label_value() -> String {
    let mut text: String = CASES.iter().map(|case| run(Some(case.trouble)).1).collect();
    text.push_str(&served::metrics_text());
    let sources = [
        SourceKind::Kubernetes.name(),
        SourceKind::ResolvConf.name(),
        STATIC_SOURCE,
        STATIC_SOURCE,
    ];
    for (status, source) in [
        BypassStatus::Disabled,
        BypassStatus::Active,
        BypassStatus::Unavailable,
        BypassStatus::Failing,
    ]
    .into_iter()
    .zip(sources)
    {
        let node = Node::healthy();
        node.stats.record_conntrack_bypass(status, 1);
        node.stats.record_pool_source(LISTENER, source);
        node.stats.record_source_contact(source);
        for reason in Rejection::ALL {
            node.stats.record_rejection("kubernetes", reason.name());
        }
        node.stats.record_upstream_check(LISTENER, true);
        node.stats.record_upstream_check(LISTENER, false);
        text.push_str(&node.render());
    }
    text
}

/// The label values a metric is served with, by label; `None` when it is not served.
fn served_labels(served: &str, family: &str) -> Option<BTreeMap<String, BTreeSet<String>>> {
    if !served.contains(&format!("# TYPE {} ", family.trim_end_matches("_total"))) {
        return None;
    }
    let mut labels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in served.lines().filter(|line| !line.starts_with('#')) {
        let Some((name, rest)) = line.split_once('{') else {
            continue;
        };
        let base = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(name);
        if name != family && base != family.trim_end_matches("_total") {
            continue;
        }
        let inner = rest.rsplit_once('}').expect("labels end with }").0;
        for pair in inner.split("\",") {
            let (label, value) = pair.split_once("=\"").expect("label=\"value\"");
            labels
                .entry(label.to_owned())
                .or_default()
                .insert(value.trim_end_matches('"').to_owned());
        }
    }
    Some(labels)
}

#[test]
fn every_query_of_the_operations_table_finds_what_it_asks_for_in_what_the_agent_serves() {
    let guide = read("docs/operations.md");
    let rows = table(&guide, "| question | query |");
    let mut documented = BTreeSet::new();
    let mut named_values = BTreeSet::new();
    for row in &rows {
        for span in code_spans(&row[2]) {
            if is_query(&span) {
                documented.insert(span);
            } else {
                named_values.insert(span);
            }
        }
    }
    let tested: BTreeSet<String> = CASES.iter().map(|case| case.query.to_owned()).collect();
    assert_eq!(
        documented.difference(&tested).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "queries of docs/operations.md with no case here: add one that shows them the trouble"
    );
    assert_eq!(
        tested.difference(&documented).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "cases here for queries the table no longer shows"
    );

    let eval_time = format!("{}m", SCRAPES - 1);
    let found = |query: &str| {
        serde_json::json!({
            "expr": format!("clamp_max(count({query}), 1)"),
            "eval_time": eval_time,
            "exp_samples": [{ "labels": "{}", "value": 1 }],
        })
    };
    let mut groups = Vec::new();
    for case in CASES {
        groups.push(serde_json::json!({
            "interval": "1m",
            "input_series": input_series(&run(Some(case.trouble)).0),
            "promql_expr_test": [found(case.query)],
        }));
    }
    let watches: Vec<serde_json::Value> = CASES
        .iter()
        .map(|case| match case.kind {
            Kind::Watch => serde_json::json!({
                "expr": format!("count({})", case.query),
                "eval_time": eval_time,
                "exp_samples": [],
            }),
            Kind::Read => found(case.query),
        })
        .collect();
    groups.push(serde_json::json!({
        "interval": "1m",
        "input_series": input_series(&run(None).0),
        "promql_expr_test": watches,
    }));
    let dir = common::scratch("docs", "queries");
    std::fs::write(dir.join("none.yml"), "groups: []\n").expect("writing the rules");
    // JSON is YAML.
    let tests = serde_json::json!({
        "rule_files": ["none.yml"],
        "evaluation_interval": "1m",
        "tests": groups,
    });
    std::fs::write(dir.join("queries.test.yml"), tests.to_string()).expect("writing the tests");
    let said = common::promtool(&dir, &["test", "rules", "queries.test.yml"]);
    assert!(said.contains("SUCCESS"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);

    // The metrics, labels and values the table names beside its queries (the reasons) are ones
    // the agent serves.
    let served = every_label_value();
    for name in &named_values {
        assert!(
            served.contains(&format!("# TYPE {name} "))
                || (name.contains("=\"") && served.contains(name.as_str()))
                || served.contains(&format!("{{{name}=\""))
                || served.contains(&format!(",{name}=\""))
                || served.contains(&format!("=\"{name}\"")),
            "docs/operations.md names `{name}`, which is no metric, label or label value the \
             agent serves"
        );
    }
}

/// The queries are tested on the agent's real text: a query written with a label value the agent
/// never serves (the bypass's `status="active"` while it is down) finds nothing in the trouble.
#[test]
fn a_query_for_a_status_the_series_does_not_carry_in_the_trouble_finds_nothing() {
    let (series, _) = run(Some(|node, _| {
        node.stats
            .record_conntrack_bypass(BypassStatus::Unavailable, 0);
    }));
    let dir = common::scratch("docs", "wrong-query");
    std::fs::write(dir.join("none.yml"), "groups: []\n").expect("writing the rules");
    let tests = serde_json::json!({
        "rule_files": ["none.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": input_series(&series),
            "promql_expr_test": [{
                "expr": r#"count(redirector_conntrack_bypass_active{status="active"} == 0)"#,
                "eval_time": format!("{}m", SCRAPES - 1),
                "exp_samples": [],
            }],
        }],
    });
    std::fs::write(dir.join("wrong.test.yml"), tests.to_string()).expect("writing the tests");
    common::promtool(&dir, &["test", "rules", "wrong.test.yml"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A label matcher of a selector: the label, and the values it names.
type Matcher = (String, Vec<String>);

/// The metric and matchers of a selector `metric{a, b="v", c=~"x|y", d!="z"}`.
fn matchers(selector: &str) -> Option<(String, Vec<Matcher>)> {
    let (metric, rest) = selector.split_once('{')?;
    if !metric.starts_with("redirector_")
        || !metric.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
    {
        return None;
    }
    let inner = rest.strip_suffix('}')?;
    let mut found = Vec::new();
    for matcher in inner.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        // A bare label, and `!=`, name no value the agent must serve.
        let (label, values) = if let Some((label, _)) = matcher.split_once("!=") {
            (label, Vec::new())
        } else if let Some((label, value)) =
            matcher.split_once("=~").or_else(|| matcher.split_once('='))
        {
            let alternatives = value.trim_matches('"').split('|');
            (label, alternatives.map(str::to_owned).collect())
        } else {
            (matcher, Vec::new())
        };
        found.push((label.trim().to_owned(), values));
    }
    Some((metric.to_owned(), found))
}

/// The Markdown files operators read.
fn docs() -> Vec<(String, String)> {
    let mut files = vec![("README.md".to_owned(), read("README.md"))];
    let mut names: Vec<_> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|entry| {
            entry
                .expect("an entry")
                .file_name()
                .into_string()
                .expect("UTF-8")
        })
        .filter(|name| name.ends_with(".md"))
        .collect();
    names.sort();
    for name in names {
        let path = format!("docs/{name}");
        let text = read(&path);
        files.push((path, text));
    }
    files
}

#[test]
fn every_label_the_docs_name_on_a_metric_is_served_with_that_value() {
    let served = every_label_value();
    let mut checked = 0;
    for (path, text) in docs() {
        for span in code_spans(&text) {
            let Some((metric, matchers)) = matchers(&span) else {
                continue;
            };
            let Some(labels) = served_labels(&served, &metric) else {
                panic!("{path}: `{span}`: the agent serves no {metric}");
            };
            for (label, values) in matchers {
                let Some(served_values) = labels.get(&label) else {
                    panic!("{path}: `{span}`: {metric} has no label {label}: {labels:?}");
                };
                for value in values {
                    assert!(
                        served_values.contains(&value),
                        "{path}: `{span}`: {metric} is never served with {label}=\"{value}\" \
                         (it is with {served_values:?})"
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "{checked} matchers checked");

    // docs/observability.md's table: the values listed with a row's labels are the values its
    // metrics are served with.
    let observability = read("docs/observability.md");
    let mut values_checked = 0;
    for row in table(&observability, "  | metric |") {
        let metrics: Vec<String> = code_spans(&row[1]);
        let per_metric: Vec<_> = metrics
            .iter()
            .map(|metric| {
                served_labels(&served, metric)
                    .unwrap_or_else(|| panic!("the agent serves no {metric}"))
            })
            .collect();
        // Environment variables (`NODE_NAME`) say where a value comes from.
        let values = code_spans(&row[2])
            .into_iter()
            .filter(|span| !span.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'));
        for value in values {
            assert!(
                per_metric
                    .iter()
                    .any(|labels| labels.values().any(|values| values.contains(&value))),
                "docs/observability.md lists `{value}` for {metrics:?}, which no label of theirs \
                 is served with"
            );
            values_checked += 1;
        }
    }
    assert!(values_checked >= 20, "{values_checked} values checked");
}

/// Stand-ins for the placeholders the docs write in commands.
const PLACEHOLDERS: &[(&str, &str)] = &[
    ("{{ $labels.listener }}", "node"),
    ("NAME", "node"),
    ("THIS", "/etc/redirector/config.toml"),
    ("PATH", "/run/redirector/drain.sock"),
];

/// A documented command line made concrete: optional parts (`[--wait]`) kept, the first of
/// alternatives (`cache|upstream|auto`) taken, placeholders filled in.
fn concrete(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut text = command.replace(r"\|", "|");
    for (placeholder, value) in PLACEHOLDERS {
        text = text.replace(placeholder, value);
    }
    let tokens: Vec<&str> = text.split_whitespace().collect();
    for (index, token) in tokens.iter().enumerate() {
        let token = token.trim_matches(|c| c == '[' || c == ']');
        let token = token.split('|').next().unwrap_or(token);
        // Short placeholders: F (a file), D (a directory), S (a socket), MS (milliseconds), N (a
        // number).
        let value = match token {
            "MS" => "1000",
            "N" => "1",
            "F" => "/etc/redirector/config.toml",
            "D" => "/sys/fs/bpf/redirector",
            "S" => "/run/redirector/drain.sock",
            _ => token,
        };
        if index > 0 || value != "redirector" {
            words.push(value.to_owned());
        }
    }
    words
}

/// Every `redirector ...` command line in the docs, the shipped files' comments and the alert
/// annotations: code spans that start with `redirector `, and command lines of code blocks (also
/// after `kubectl exec ... --`).
fn documented_commands() -> Vec<(String, String)> {
    let mut files = docs();
    for path in [
        "deploy/prometheus/redirector.rules.yml",
        "deploy/examples/aks.toml",
        "deploy/examples/nodelocal-dnscache.toml",
        "deploy/kubernetes/base/config.toml",
    ] {
        files.push((path.to_owned(), read(path)));
    }
    let mut commands = Vec::new();
    for (path, text) in files {
        for span in code_spans(&text) {
            if span.starts_with("redirector ")
                && span.as_bytes().get(11).is_some_and(u8::is_ascii_lowercase)
            {
                commands.push((path.clone(), span));
            }
        }
        let mut in_block = false;
        for line in text.lines() {
            if line.trim_start().starts_with("```") {
                in_block = !in_block;
                continue;
            }
            if !in_block {
                continue;
            }
            let line = line.split(" #").next().unwrap_or(line).trim();
            let command = line
                .strip_prefix("redirector ")
                .or_else(|| line.split_once("-- redirector ").map(|(_, rest)| rest));
            if let Some(rest) = command
                && rest.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
            {
                commands.push((path.clone(), format!("redirector {rest}")));
            }
        }
    }
    commands
}

#[test]
fn every_command_the_docs_show_is_one_the_cli_takes() {
    let commands = documented_commands();
    assert!(commands.len() >= 40, "{} commands found", commands.len());
    let mut subcommands = BTreeSet::new();
    for (path, command) in &commands {
        let mut words = concrete(command);
        subcommands.insert(words[0].clone());
        // `--help` last: clap checks every argument before it (names, values, subcommand) and
        // then prints the help instead of running anything.
        words.push("--help".to_owned());
        let output = Command::new(env!("CARGO_BIN_EXE_redirector"))
            .args(&words)
            .output()
            .expect("the redirector binary runs");
        assert!(
            output.status.success(),
            "{path}: `{command}` (run as {words:?}) is refused: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    // The check can fail: an option the CLI does not have is refused.
    let refused = Command::new(env!("CARGO_BIN_EXE_redirector"))
        .args(["state", "--listener", "node", "--to", "cache", "--help"])
        .output()
        .expect("the redirector binary runs");
    assert!(!refused.status.success());
    for subcommand in [
        "run",
        "status",
        "state",
        "drain",
        "probe",
        "uninstall",
        "check-config",
        "cache",
    ] {
        assert!(
            subcommands.contains(subcommand),
            "no documented `redirector {subcommand}`: {subcommands:?}"
        );
    }
}
