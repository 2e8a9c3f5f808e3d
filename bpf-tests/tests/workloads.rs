//! DNS per workload: the programs count each cgroup's queries by route and its replies by rcode
//! class, exactly, for every way a resolver sends (unconnected UDP, connected UDP, TCP), and
//! count nothing for the caches' cgroups and the cgroups the operator exempts.

use std::{net::SocketAddr, os::unix::fs::MetadataExt as _, path::Path, time::Duration};

use anyhow::Context as _;
use bpf_tests::{
    cgroup::TestCgroup,
    harness::{CLUSTER_ID, Harness, standard_listeners},
    sandbox::{Ns, Query, Sandbox, Transport},
    tools,
    topology::{CLUSTER_LISTENER, NODE_LISTENER, UPSTREAM_A_V4, dns, who},
};
use redirector_common::{
    settings::Mode,
    workloads::{
        RCODE_CLASSES, RCODE_NOERROR, RCODE_NXDOMAIN, ROUTE_CACHE, ROUTE_DIRECT, ROUTE_REFUSED,
        ROUTE_UPSTREAM, ROUTES, WorkloadCounters,
    },
};

/// The cgroup the configuration exempts, created after the agent starts.
const EXEMPT: &str = "exempt-pod";

/// Where the NXDOMAIN server listens: upstream A's address, another port (replies from it are
/// recognised by the port the pool's target uses).
fn nxdomain_server() -> SocketAddr {
    SocketAddr::new(UPSTREAM_A_V4.into(), 5353)
}

/// The id of a cgroup: its directory's inode number.
fn cgroup_id(path: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .ino())
}

/// What the programs counted for the cgroup at `path` (`None`: nothing, or exempt).
fn counted(harness: &Harness, path: &Path) -> anyhow::Result<Option<WorkloadCounters>> {
    let id = cgroup_id(path)?;
    Ok(harness
        .maps
        .workload_counts()?
        .into_iter()
        .find(|(counted, _)| *counted == id)
        .map(|(_, counters)| counters))
}

/// Queries by route and replies by class, for comparison.
fn expected(
    routes: &[(usize, u64)],
    classes: &[(usize, u64)],
) -> ([u64; ROUTES], [u64; RCODE_CLASSES]) {
    let mut queries = [0; ROUTES];
    for (route, count) in routes {
        queries[*route] = *count;
    }
    let mut replies = [0; RCODE_CLASSES];
    for (class, count) in classes {
        replies[*class] = *count;
    }
    (queries, replies)
}

/// Runs `count` queries of `query` from the pod's namespace in `cgroup` and returns who answered
/// each (or its error).
fn ask(
    sandbox: &Sandbox,
    cgroup: &TestCgroup,
    query: Query,
    count: u16,
) -> anyhow::Result<Vec<String>> {
    Ok(sandbox
        .queries_in(Ns::Pod, cgroup, query, count)?
        .into_iter()
        .map(|outcome| {
            if outcome.ok {
                format!(
                    "{} {}",
                    who(outcome.answer()),
                    outcome.rcode.unwrap_or_default()
                )
            } else {
                format!("error {:?}", outcome.error)
            }
        })
        .collect())
}

#[test]
fn two_pods_get_exact_counts_by_route_and_rcode_and_exempt_cgroups_none() -> anyhow::Result<()> {
    let mut harness = Harness::start(
        tools!(),
        |sandbox| {
            sandbox.start_standard_servers()?;
            let program = sandbox.tools().dns_server.display().to_string();
            sandbox.start_process(
                "nxdomain",
                Some(Ns::Upstream),
                None,
                &program,
                &[
                    "--listen".to_owned(),
                    nxdomain_server().to_string(),
                    "--a".to_owned(),
                    "192.0.2.77".to_owned(),
                    "--aaaa".to_owned(),
                    "2001:db8::77".to_owned(),
                    "--rcode".to_owned(),
                    "nxdomain".to_owned(),
                ],
                "ready",
            )
        },
        |sandbox| {
            // Listed before it exists, as a service's cgroup not started yet at boot.
            format!(
                "{}\n[workloads]\ninterval_ms = 1000\nexempt_cgroups = [{:?}]\n",
                standard_listeners(sandbox),
                sandbox.cgroup().path().join(EXEMPT).display().to_string()
            )
        },
    )?;
    let sandbox = &harness.sandbox;
    let pod_a = sandbox.cgroup().child("pod-a")?;
    let pod_b = sandbox.cgroup().child("pod-b")?;
    let exempt = sandbox.cgroup().child(EXEMPT)?;

    // Pod A asks the node listener, whose cache serves: every way a resolver sends.
    let node = dns(NODE_LISTENER);
    let mut answers = ask(sandbox, &pod_a, Query::new(node, Transport::Udp), 3)?;
    answers.extend(ask(
        sandbox,
        &pod_a,
        Query::new(node, Transport::UdpConnected),
        2,
    )?);
    answers.extend(ask(sandbox, &pod_a, Query::new(node, Transport::Tcp), 1)?);
    assert!(
        answers.iter().all(|answer| answer.starts_with("cache")),
        "{answers:?}"
    );

    // Pod B: the cluster listener sent upstream with an empty pool (refused under `fail`), then
    // with a pool whose one target answers NXDOMAIN, and a server that is no listener, asked
    // directly.
    harness.set_mode(CLUSTER_ID, Mode::Upstream)?;
    let cluster = dns(CLUSTER_LISTENER);
    let refused = ask(
        &harness.sandbox,
        &pod_b,
        Query::new(cluster, Transport::Udp),
        1,
    )?;
    assert!(refused[0].starts_with("error"), "{refused:?}");
    harness.set_pool(CLUSTER_ID, &[nxdomain_server()])?;
    let sandbox = &harness.sandbox;
    let mut answers = ask(sandbox, &pod_b, Query::new(cluster, Transport::Udp), 4)?;
    answers.extend(ask(
        sandbox,
        &pod_b,
        Query::new(cluster, Transport::UdpConnected),
        2,
    )?);
    assert!(
        answers
            .iter()
            .all(|answer| answer == "nobody Non-Existent Domain"),
        "{answers:?}"
    );
    let direct = Query::new(dns(UPSTREAM_A_V4), Transport::UdpConnected);
    let answers = ask(sandbox, &pod_b, direct, 2)?;
    assert!(
        answers
            .iter()
            .all(|answer| answer.starts_with("upstream A")),
        "{answers:?}"
    );

    // The cache's cgroup (skipped) and the listed one, once the agent has seen it exist.
    let exempt_id = cgroup_id(exempt.path())?;
    harness.wait_until(
        "the agent exempts the cgroup created after its start",
        Duration::from_secs(10),
        |harness| Ok(harness.maps.exempt_cgroups().contains(&exempt_id)),
    )?;
    let sandbox = &harness.sandbox;
    for cgroup in [sandbox.skipped_cgroup(), &exempt] {
        let answers = ask(sandbox, cgroup, direct, 2)?;
        assert!(
            answers
                .iter()
                .all(|answer| answer.starts_with("upstream A")),
            "{answers:?}"
        );
        let answers = ask(sandbox, cgroup, Query::new(node, Transport::Udp), 1)?;
        assert!(answers[0].starts_with("cache"), "{answers:?}");
    }

    let a = counted(&harness, pod_a.path())?.context("pod A was counted")?;
    assert_eq!(
        (a.queries, a.replies),
        expected(&[(ROUTE_CACHE, 6)], &[(RCODE_NOERROR, 6)]),
        "pod A: {a:?}"
    );
    let b = counted(&harness, pod_b.path())?.context("pod B was counted")?;
    assert_eq!(
        (b.queries, b.replies),
        expected(
            &[(ROUTE_UPSTREAM, 6), (ROUTE_REFUSED, 1), (ROUTE_DIRECT, 2)],
            &[(RCODE_NXDOMAIN, 6), (RCODE_NOERROR, 2)]
        ),
        "pod B: {b:?}"
    );
    for cgroup in [harness.sandbox.skipped_cgroup(), &exempt] {
        assert_eq!(
            counted(&harness, cgroup.path())?,
            None,
            "{} is exempt",
            cgroup.path().display()
        );
    }
    Ok(())
}
