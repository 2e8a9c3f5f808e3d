//! The cluster listener's pool follows kube-dns's EndpointSlices: a fake API server on loopback
//! speaks the real list/watch protocol to the real kube-rs client, and every step is checked in
//! the kernel's pool map.

use std::{net::IpAddr, time::Duration};

use anyhow::Context as _;

use bpf_tests::{
    fake_kube::{FakeKube, endpoint_slice},
    harness::{CLUSTER_ID, Harness, kube_dns_config},
    pace::pause,
    sandbox::Sandbox,
    tools,
};
use redirector_common::addr::port_from_be;

/// The kernel pool of a listener as (address, udp port, tcp port), sorted.
fn kernel_pool(harness: &Harness, id: u32) -> anyhow::Result<Vec<(IpAddr, u16, u16)>> {
    Ok(pool_rows(&harness.maps.pool(id)?))
}

/// A pool as (address, udp port, tcp port), sorted.
fn pool_rows(pool: &redirector_common::pool::Pool) -> Vec<(IpAddr, u16, u16)> {
    let mut pool: Vec<_> = pool
        .targets()
        .iter()
        .map(|target| {
            (
                IpAddr::from(target.addr),
                port_from_be(target.udp_port_be),
                port_from_be(target.tcp_port_be),
            )
        })
        .collect();
    pool.sort_unstable();
    pool
}

fn expect(addresses: &[&str], port: u16) -> Vec<(IpAddr, u16, u16)> {
    let mut pool: Vec<_> = addresses
        .iter()
        .map(|address| (address.parse().expect("address"), port, port))
        .collect();
    pool.sort_unstable();
    pool
}

fn wait_for_pool(
    harness: &Harness,
    id: u32,
    expected: &[(IpAddr, u16, u16)],
    step: &str,
) -> anyhow::Result<()> {
    harness
        .wait_until(step, Duration::from_secs(10), |harness| {
            Ok(kernel_pool(harness, id)? == expected)
        })
        .map_err(|error| {
            let now = kernel_pool(harness, id).unwrap_or_default();
            error.context(format!("kernel pool is {now:?}, expected {expected:?}"))
        })
}

/// A harness whose cluster (v4) and v6 listeners follow kube-system/kube-dns through `kube`.
fn harness(kube: &FakeKube) -> anyhow::Result<Harness> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let kubeconfig = sandbox.write_file("kubeconfig", &kube.kubeconfig())?;
    let text = kube_dns_config(&sandbox, &kubeconfig, true);
    Harness::with_config(sandbox, &text)
}

const V6_ID: u32 = 2;

/// A fake API server whose kube-dns has one ready IPv4 endpoint, `first`, and a harness whose
/// kernel pool already holds it.
fn started_with(first: &str) -> anyhow::Result<(FakeKube, Harness)> {
    let kube = FakeKube::start()?;
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[(first, true, false)],
    ));
    let harness = harness(&kube)?;
    wait_for_pool(&harness, CLUSTER_ID, &expect(&[first], 53), "initial list")?;
    Ok((kube, harness))
}

#[test]
fn the_cluster_pool_follows_endpoint_slices_through_every_kind_of_change() -> anyhow::Result<()> {
    let kube = FakeKube::start()?;
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[("10.244.0.5", true, false), ("10.244.1.7", true, false)],
    ));
    kube.apply(endpoint_slice(
        "kube-dns-v6",
        "kube-dns",
        "IPv6",
        53,
        &[("fd00:10:244::5", true, false)],
    ));
    // Another Service's slice, never the cluster listener's.
    kube.apply(endpoint_slice(
        "other",
        "other-service",
        "IPv4",
        53,
        &[("10.9.9.9", true, false)],
    ));
    let harness = harness(&kube)?;

    // Initial list: each family into its own pool.
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.0.5", "10.244.1.7"], 53),
        "initial list",
    )?;
    wait_for_pool(
        &harness,
        V6_ID,
        &expect(&["fd00:10:244::5"], 53),
        "initial list, IPv6",
    )?;

    // An endpoint added; named ports change.
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        1053,
        &[
            ("10.244.0.5", true, false),
            ("10.244.1.7", true, false),
            ("10.244.2.9", true, false),
        ],
    ));
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.0.5", "10.244.1.7", "10.244.2.9"], 1053),
        "endpoint added",
    )?;

    // Not ready, then terminating: out of the pool.
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        1053,
        &[
            ("10.244.0.5", false, false),
            ("10.244.1.7", true, true),
            ("10.244.2.9", true, false),
        ],
    ));
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.2.9"], 1053),
        "not ready and terminating",
    )?;

    // Flapping readiness ends where it ends.
    for round in 0..10 {
        let ready = round % 2 == 0;
        kube.apply(endpoint_slice(
            "kube-dns-v4",
            "kube-dns",
            "IPv4",
            1053,
            &[("10.244.0.5", ready, false), ("10.244.2.9", true, false)],
        ));
    }
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.2.9"], 1053),
        "after flapping",
    )?;

    // Implausible addresses are refused, counted, never written.
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[
            ("127.0.0.1", true, false),
            ("169.254.10.11", true, false),
            ("10.244.3.3", true, false),
        ],
    ));
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.3.3"], 53),
        "implausible addresses",
    )?;
    assert!(harness.agent.stats.rejections("kubernetes", "loopback") >= 1);
    assert!(
        harness
            .agent
            .stats
            .rejections("kubernetes", "listener address")
            >= 1
    );

    // A slice deleted: its endpoints leave.
    kube.delete("kube-dns-v6");
    wait_for_pool(&harness, V6_ID, &[], "slice deleted")?;

    // Bookmarks change nothing.
    kube.bookmark();
    pause(300);
    assert_eq!(
        kernel_pool(&harness, CLUSTER_ID)?,
        expect(&["10.244.3.3"], 53)
    );

    // A malformed object: the last good pool stays; fixed, it is taken.
    let mut broken = endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[("10.244.4.4", true, false)],
    );
    broken["endpoints"] = serde_json::json!("not a list");
    kube.apply(broken);
    pause(1500);
    assert_eq!(
        kernel_pool(&harness, CLUSTER_ID)?,
        expect(&["10.244.3.3"], 53),
        "a malformed object must not change the pool"
    );
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[("10.244.4.4", true, false)],
    ));
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.4.4"], 53),
        "malformed object fixed",
    )?;
    Ok(())
}

/// `redirector_pool_last_sync_age_seconds{source="kubernetes"}` and
/// `redirector_errors_total{kind="kube_api"}` (0 before the first error) on the agent's
/// `/metrics`.
fn kube_sync_age_and_errors(harness: &Harness) -> anyhow::Result<(f64, f64)> {
    let address = harness.agent.metrics.context("the agent serves /metrics")?;
    let body = bpf_tests::http::get(address, "/metrics")?.body;
    let age = bpf_tests::http::sample(
        &body,
        "redirector_pool_last_sync_age_seconds{source=\"kubernetes\"}",
    )
    .with_context(|| format!("no kubernetes sync age in /metrics:\n{body}"))?;
    let errors =
        bpf_tests::http::sample(&body, "redirector_errors_total{kind=\"kube_api\"}").unwrap_or(0.0);
    Ok((age, errors))
}

#[test]
fn an_api_outage_keeps_the_last_pool_and_history_loss_relists() -> anyhow::Result<()> {
    let (kube, harness) = started_with("10.244.0.5")?;

    // Down: requests fail, watches end; the pool stays as it was, through resyncs.
    kube.set_down(true);
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[("10.244.5.5", true, false)],
    ));
    std::thread::sleep(Duration::from_millis(4500));
    assert_eq!(
        kernel_pool(&harness, CLUSTER_ID)?,
        expect(&["10.244.0.5"], 53),
        "an outage must not change the pool"
    );
    // The pool's age counts from the API server's last answer, not from the agent's own
    // rewrites of the kernel's pool (every 2 s here, which succeed with the API server gone).
    let (age, errors) = kube_sync_age_and_errors(&harness)?;
    assert!(age > 3.0, "the pool's age hides a 4.5 s outage: {age} s");
    assert!(errors > 0.0, "no kube_api error counted during the outage");
    // Back: the watcher resumes from its last version and catches up with what changed.
    let (_, watches_before) = kube.requests();
    kube.set_down(false);
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.5.5"], 53),
        "after the outage",
    )?;
    assert!(kube.requests().1 > watches_before, "the watcher came back");
    let (age, _) = kube_sync_age_and_errors(&harness)?;
    assert!(
        age < 2.0,
        "the API server answers again, yet the age is {age} s"
    );

    // History gone (410 Gone on the resumed watch): relist, then follow again.
    let (lists_before, _) = kube.requests();
    kube.expire_history();
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[("10.244.6.6", true, false)],
    ));
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.6.6"], 53),
        "after 410 Gone",
    )?;
    assert!(
        kube.requests().0 > lists_before,
        "the watcher relisted after 410"
    );
    Ok(())
}

#[test]
fn a_burst_of_a_thousand_updates_is_coalesced() -> anyhow::Result<()> {
    let (kube, harness) = started_with("10.244.0.1")?;
    let writes_before = harness.agent.stats.pool_writes("cluster");
    for round in 0..1000u32 {
        let last = format!("10.244.{}.{}", 1 + round / 250, 1 + round % 250);
        kube.apply(endpoint_slice(
            "kube-dns-v4",
            "kube-dns",
            "IPv4",
            53,
            &[("10.244.0.1", true, false), (last.as_str(), true, false)],
        ));
    }
    wait_for_pool(
        &harness,
        CLUSTER_ID,
        &expect(&["10.244.0.1", "10.244.4.250"], 53),
        "after the burst",
    )?;
    let writes = harness.agent.stats.pool_writes("cluster") - writes_before;
    println!("1000 EndpointSlice updates became {writes} pool writes");
    assert!(writes < 200, "the burst was not coalesced: {writes} writes");
    Ok(())
}

#[test]
fn a_pool_larger_than_the_kernels_is_cut_per_node_and_counted() -> anyhow::Result<()> {
    use bpf_tests::{
        cli::{logged_metrics_address, start_agent_with, stop_agent, uninstall},
        http::{get, sample},
    };
    use redirector::sources::{Upstream, subset};
    use redirector_common::pool::MAX_POOL_TARGETS;

    let kube = FakeKube::start()?;
    let addresses: Vec<String> = (1..=40).map(|last| format!("10.244.0.{last}")).collect();
    let endpoints: Vec<(&str, bool, bool)> = addresses
        .iter()
        .map(|address| (address.as_str(), true, false))
        .collect();
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &endpoints,
    ));
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let kubeconfig = sandbox.write_file("kubeconfig", &kube.kubeconfig())?;
    let listeners = "[[listener]]\nname = \"cluster\"\naddress = \"169.254.10.11\"\nkube_dns = \"kube-system/kube-dns\"\n";
    let tables = format!(
        "[interface]\nmanage = false\n\n[kubernetes]\nkubeconfig = {:?}\n",
        kubeconfig.display().to_string()
    );
    let config = sandbox.write_file("agent.toml", &sandbox.config_toml_with(listeners, &tables))?;
    let mut offered: Vec<Upstream> = addresses
        .iter()
        .map(|address| Upstream::dns(address.parse().expect("an address")))
        .collect();
    offered.sort_unstable();

    let mut subsets = Vec::new();
    for node in ["aks-nodepool1-0", "aks-nodepool1-1"] {
        let mut agent = start_agent_with(&config, &[], &[("NODE_NAME", node.as_ref())])?;
        let address = logged_metrics_address(&mut agent)?;
        let (expected, left_out) = subset::for_node(&offered, node, MAX_POOL_TARGETS);
        assert_eq!((expected.len(), left_out), (32, 8));
        let expected: Vec<(IpAddr, u16, u16)> = expected
            .iter()
            .map(|upstream| (upstream.ip, upstream.udp_port, upstream.tcp_port))
            .collect();
        let pool = || -> anyhow::Result<Vec<(IpAddr, u16, u16)>> {
            Ok(pool_rows(
                &redirector::datapath::Maps::open_pinned(&sandbox.pin_dir())?.pool(0)?,
            ))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool()? != expected {
            assert!(
                std::time::Instant::now() < deadline,
                "{node}: kernel pool {:?}, expected this node's subset {expected:?}",
                pool()?
            );
            pause(100);
        }
        let metrics = get(address, "/metrics")?.body;
        assert_eq!(
            sample(
                &metrics,
                "redirector_pool_upstreams_left_out{listener=\"cluster\"}"
            ),
            Some(8.0),
            "{metrics}"
        );
        assert!(
            agent
                .printed()
                .iter()
                .any(|line| line.contains("this node keeps its own subset")),
            "the cut is logged"
        );
        stop_agent(&mut agent)?;
        subsets.push(expected);
    }
    assert_ne!(subsets[0], subsets[1], "two nodes keep different subsets");
    uninstall(&config)?;
    Ok(())
}

/// How many Events of `kube` have `reason`.
fn count_events(kube: &FakeKube, reason: &str) -> usize {
    kube.events()
        .iter()
        .filter(|event| event["reason"] == reason)
        .count()
}

/// The Events of `kube` with `reason` about the cluster listener.
fn cluster_events(kube: &FakeKube, reason: &str) -> Vec<serde_json::Value> {
    kube.events()
        .into_iter()
        .filter(|event| {
            event["reason"] == reason
                && event["note"]
                    .as_str()
                    .is_some_and(|note| note.starts_with("listener cluster (169.254.10.11): "))
        })
        .collect()
}

#[test]
fn a_failover_and_a_failback_are_events_on_the_node() -> anyhow::Result<()> {
    let (kube, mut harness) = started_with("198.18.2.2")?;
    assert!(
        kube.events().is_empty(),
        "nothing changed yet: {:?}",
        kube.events()
    );
    let node = redirector::sources::node_name();

    harness.sandbox.stop_server("cache")?;
    // One Event per listener: the three listeners' failovers are three Events.
    harness
        .wait_until(
            "a DNSFailover Event per listener",
            Duration::from_secs(10),
            |_| Ok(count_events(&kube, "DNSFailover") == 3),
        )
        .map_err(|error| {
            error.context(format!(
                "transitions {:?}, errors {:?}, events {:?}",
                harness.agent.stats.transitions("cluster"),
                harness.agent.stats.errors(),
                kube.events()
            ))
        })?;
    let failover = &cluster_events(&kube, "DNSFailover")[0];
    assert_eq!(failover["type"], "Warning", "{failover}");
    assert_eq!(failover["metadata"]["namespace"], "default", "{failover}");
    assert_eq!(failover["regarding"]["kind"], "Node", "{failover}");
    assert_eq!(failover["regarding"]["name"], node.as_str(), "{failover}");
    assert_eq!(failover["reportingController"], "redirector", "{failover}");
    assert_eq!(
        cluster_events(&kube, "DNSFailover").len(),
        1,
        "{:?}",
        kube.events()
    );
    assert!(
        failover["note"]
            .as_str()
            .is_some_and(|note| note.contains("DNS goes to the upstream pool (1 target): ")),
        "{failover}"
    );

    harness
        .sandbox
        .start_cache("cache", &bpf_tests::sandbox::CacheSpec::standard())?;
    harness.wait_until("a DNSFailback Event", Duration::from_secs(10), |_| {
        Ok(!cluster_events(&kube, "DNSFailback").is_empty())
    })?;
    let failback = &cluster_events(&kube, "DNSFailback")[0];
    assert_eq!(failback["type"], "Normal", "{failback}");
    assert_eq!(failback["regarding"]["name"], node.as_str(), "{failback}");

    // A second failover within minutes is a series on the first Event (a patch), not a new one.
    harness.sandbox.stop_server("cache")?;
    harness.wait_until("the DNSFailover series", Duration::from_secs(10), |_| {
        Ok(cluster_events(&kube, "DNSFailover")
            .first()
            .is_some_and(|event| event["series"]["count"] == 2))
    })?;
    assert_eq!(cluster_events(&kube, "DNSFailover").len(), 1);
    Ok(())
}
