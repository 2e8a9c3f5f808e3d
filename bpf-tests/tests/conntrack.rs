//! The conntrack bypass: with conntrack on in the node namespace (a `ct state` rule, as every
//! node has), DNS between clients and the cache leaves no entry; failover traffic stays tracked
//! and its replies still arrive; other tables are never touched; a
//! flushed or deleted table is restored; uninstall removes it; a node without nftables still
//! steers and says so once.

use std::{net::IpAddr, time::Duration};

use bpf_tests::{
    cli::start_agent,
    conntrack,
    harness::{Harness, NODE_ID, V6_ID, standard_listeners},
    pace::pause,
    sandbox::{Ns, Query, Sandbox, Transport},
    tools,
    topology::{
        NODE_LISTENER, UPSTREAM_A_V4, UPSTREAM_A_V6, UPSTREAM_B_V4, UPSTREAM_B_V6, V6_LISTENER,
        dns, who,
    },
};
use redirector::conntrack_bypass::BypassStatus;
use redirector_common::settings::Mode;

/// Queries per client namespace, transport and family.
const QUERIES: u16 = 25;

/// A sandbox with the standard servers and conntrack on in the node namespace.
fn tracked_sandbox() -> anyhow::Result<Sandbox> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    conntrack::activate(sandbox.netns(Ns::Node))?;
    Ok(sandbox)
}

fn config(sandbox: &Sandbox, conntrack: &str) -> String {
    sandbox.config_toml_with(
        &standard_listeners(sandbox),
        &format!("[interface]\nmanage = false\n\n[conntrack]\n{conntrack}"),
    )
}

/// Sends `QUERIES` fresh-socket queries for every client namespace (pod, node), transport (UDP,
/// TCP) and family to the listeners; returns who answered each and how many were sent.
fn query_everything(sandbox: &Sandbox) -> anyhow::Result<(Vec<&'static str>, usize)> {
    let mut answered = Vec::new();
    for ns in [Ns::Pod, Ns::Node] {
        for transport in [Transport::Udp, Transport::Tcp] {
            for listener in [IpAddr::V4(NODE_LISTENER), IpAddr::V6(V6_LISTENER)] {
                let query = Query::new(dns(listener), transport);
                let outcomes = sandbox.queries_in(ns, sandbox.cgroup(), query, QUERIES)?;
                answered.extend(outcomes.iter().map(|outcome| who(outcome.answer())));
            }
        }
    }
    Ok((answered, usize::from(QUERIES) * 8))
}

fn entries_for(sandbox: &Sandbox, addresses: &[IpAddr]) -> anyhow::Result<Vec<String>> {
    let mut entries = Vec::new();
    for address in addresses {
        entries.extend(conntrack::entries(sandbox.netns(Ns::Node), *address)?);
    }
    Ok(entries)
}

const LISTENERS: [IpAddr; 2] = [IpAddr::V4(NODE_LISTENER), IpAddr::V6(V6_LISTENER)];
const UPSTREAMS: [IpAddr; 4] = [
    IpAddr::V4(UPSTREAM_A_V4),
    IpAddr::V4(UPSTREAM_B_V4),
    IpAddr::V6(UPSTREAM_A_V6),
    IpAddr::V6(UPSTREAM_B_V6),
];

#[test]
fn dns_to_the_cache_leaves_no_conntrack_entry() -> anyhow::Result<()> {
    let sandbox = tracked_sandbox()?;
    let node = sandbox.netns(Ns::Node);

    // Without the agent, the same queries reach the same cache and are tracked: the control
    // that shows conntrack is on and the count below can fail.
    let (answered, sent) = query_everything(&sandbox)?;
    assert!(answered.iter().all(|who| *who == "cache"), "{answered:?}");
    // About one entry per query: two fresh sockets that drew the same source port share one.
    let tracked = entries_for(&sandbox, &LISTENERS)?.len();
    assert!(
        tracked >= sent / 2,
        "conntrack is on: {sent} queries must leave entries, found {tracked}"
    );
    conntrack::flush(node)?;

    let text = config(&sandbox, "check_interval_ms = 500\n");
    let harness = Harness::with_config(sandbox, &text)?;
    assert_eq!(
        harness.agent.stats.conntrack_bypass(),
        (BypassStatus::Active, 0)
    );
    let (answered, sent) = query_everything(&harness.sandbox)?;
    assert_eq!(answered.len(), sent);
    assert!(answered.iter().all(|who| *who == "cache"), "{answered:?}");
    let untracked = entries_for(&harness.sandbox, &LISTENERS)?;
    println!(
        "conntrack entries for the listeners after {sent} fresh-socket queries (pod and node, UDP \
         and TCP, IPv4 and IPv6): {tracked} without the bypass, {} with it",
        untracked.len()
    );
    assert!(untracked.is_empty(), "{untracked:#?}");
    Ok(())
}

#[test]
fn failover_traffic_stays_tracked_and_its_replies_arrive() -> anyhow::Result<()> {
    let sandbox = tracked_sandbox()?;
    let text = config(&sandbox, "");
    let mut harness = Harness::with_config(sandbox, &text)?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    harness.set_mode(V6_ID, Mode::Upstream)?;
    let (answered, sent) = query_everything(&harness.sandbox)?;
    assert_eq!(answered.len(), sent);
    assert!(
        answered.iter().all(|who| who.starts_with("upstream")),
        "every reply reached its client from an upstream: {answered:?}"
    );
    let upstream_entries = entries_for(&harness.sandbox, &UPSTREAMS)?.len();
    let listener_entries = entries_for(&harness.sandbox, &LISTENERS)?;
    println!("{sent} failover queries left {upstream_entries} entries for the upstreams");
    assert!(listener_entries.is_empty(), "{listener_entries:#?}");
    assert!(
        upstream_entries >= sent / 2,
        "failover traffic stays tracked: {upstream_entries} entries for {sent} queries"
    );
    Ok(())
}

/// Rules a node has besides ours: iptables-nft (raw and nat), iptables-legacy, and a
/// kube-proxy-like nftables NAT table.
fn install_other_rules(sandbox: &Sandbox) -> anyhow::Result<()> {
    let node = sandbox.netns(Ns::Node);
    node.run(
        "iptables-nft",
        &[
            "-t",
            "raw",
            "-A",
            "PREROUTING",
            "-p",
            "udp",
            "--dport",
            "5300",
            "-j",
            "NOTRACK",
        ],
    )?;
    node.run(
        "iptables-nft",
        &[
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-s",
            "198.18.1.0/24",
            "-d",
            "198.18.9.0/24",
            "-j",
            "MASQUERADE",
        ],
    )?;
    node.run(
        "iptables-legacy",
        &[
            "-t", "raw", "-A", "OUTPUT", "-p", "tcp", "--dport", "5301", "-j", "NOTRACK",
        ],
    )?;
    node.run(
        "ip6tables-legacy",
        &[
            "-A", "INPUT", "-p", "tcp", "--dport", "5302", "-j", "ACCEPT",
        ],
    )?;
    node.run(
        "nft",
        &["add table ip kube-proxy-like; \
           add chain ip kube-proxy-like services { type nat hook prerouting priority dstnat; policy accept; }; \
           add rule ip kube-proxy-like services ip daddr 198.18.9.10 udp dport 53 dnat to 198.18.2.2"],
    )?;
    Ok(())
}

#[test]
fn other_rules_are_untouched_a_flushed_table_is_restored_and_uninstall_removes_it()
-> anyhow::Result<()> {
    let sandbox = tracked_sandbox()?;
    install_other_rules(&sandbox)?;
    let others = conntrack::other_rules(sandbox.netns(Ns::Node))?;
    assert!(
        others.contains("kube-proxy-like") && others.contains("5301") && others.contains("5302"),
        "{others}"
    );

    let text = config(&sandbox, "check_interval_ms = 200\n");
    let harness = Harness::with_config(sandbox, &text)?;
    let node = harness.sandbox.netns(Ns::Node);
    let installed = conntrack::bypass_table(node)?.expect("the agent installed its table");
    assert!(installed.contains("notrack"), "{installed}");
    assert_eq!(
        conntrack::other_rules(node)?,
        others,
        "installing touched other rules"
    );

    // Flushed (rules gone, table kept), then deleted: each restored at the next check.
    for (what, script) in [
        ("flushed", "flush table inet redirector"),
        ("deleted", "delete table inet redirector"),
    ] {
        let before = harness.agent.stats.conntrack_bypass().1;
        node.run("nft", &[script])?;
        harness.wait_until(what, Duration::from_secs(5), |harness| {
            Ok(harness.agent.stats.conntrack_bypass().1 > before)
        })?;
        assert_eq!(
            conntrack::bypass_table(node)?.as_deref(),
            Some(installed.as_str()),
            "the table {what} is restored as it was"
        );
    }
    // Restored, it works: no entry for the cache's DNS.
    conntrack::flush(node)?;
    let (answered, _) = query_everything(&harness.sandbox)?;
    assert!(answered.iter().all(|who| *who == "cache"), "{answered:?}");
    assert!(entries_for(&harness.sandbox, &LISTENERS)?.is_empty());
    assert_eq!(
        conntrack::other_rules(node)?,
        others,
        "restoring touched other rules"
    );

    let sandbox = harness.stop(); // uninstalls
    let node = sandbox.netns(Ns::Node);
    assert_eq!(
        conntrack::bypass_table(node)?,
        None,
        "uninstall removes the table"
    );
    assert_eq!(
        conntrack::other_rules(node)?,
        others,
        "uninstall touched other rules"
    );
    Ok(())
}

#[test]
fn a_node_without_nftables_still_steers_and_says_so_once() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    // What nft prints on a kernel built without nf_tables (the netlink subsystem is missing).
    let fake_nft = sandbox.write_executable(
        "nft-without-kernel-support",
        "#!/bin/sh\ncat >/dev/null\necho 'Error: Could not process rule: Operation not supported' >&2\nexit 1\n",
    )?;
    let text = sandbox.config_toml_with(
        &standard_listeners(&sandbox),
        &format!(
            "[interface]\nmanage = false\n\n[conntrack]\nnft = {:?}\ncheck_interval_ms = 100\n",
            fake_nft.display().to_string()
        ),
    );
    let config = sandbox.write_file("config.toml", &text)?;
    let mut agent = start_agent(&config)?;
    let outcome = sandbox.query(Ns::Pod, Query::new(dns(NODE_LISTENER), Transport::Udp))?;
    assert_eq!(who(outcome.answer()), "cache", "{outcome:?}");
    pause(1000); // about ten more checks
    let log = agent.printed().to_vec();
    let warnings: Vec<&String> = log
        .iter()
        .filter(|line| line.contains("TRACKED by conntrack"))
        .collect();
    assert_eq!(warnings.len(), 1, "said once: {log:#?}");
    assert!(
        warnings[0].contains("unavailable") && warnings[0].contains("does not support nftables"),
        "{}",
        warnings[0]
    );
    drop(agent);

    // The same in-process, where the state is visible.
    let harness = Harness::with_config(sandbox, &text)?;
    assert_eq!(
        harness.agent.stats.conntrack_bypass().0,
        BypassStatus::Unavailable
    );
    Ok(())
}
