//! The steering datapath on the real kernel: real DNS servers in namespaces, real clients (our
//! `dns-query`, dig, glibc's `getent`), programs attached to a throwaway cgroup.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::Context as _;
use bpf_tests::{
    cli,
    harness::{
        CLUSTER_ID, Harness, NODE_ID, V6_ID, answered_by, mapped, socket_addr, wait_for_cache,
        write_standard_config,
    },
    pace::{paced, pause},
    sandbox::{Ns, Query, Sandbox, Transport},
    tools,
    topology::{
        CLUSTER_LISTENER, NODE_LISTENER, OTHER_PORT, UPSTREAM_A, UPSTREAM_A_V4, UPSTREAM_B,
        UPSTREAM_B_V4, V6_LISTENER, dns, who,
    },
};
use redirector::sys::kernel_support;
use redirector_common::{names, settings::Mode};

const TRANSPORTS: [Transport; 3] = [Transport::Udp, Transport::UdpConnected, Transport::Tcp];

/// Every (namespace, query) the transport tests send to `listener`: pod and node, each transport,
/// from a socket of the listener's family and from a dual-stack socket to the mapped address.
fn every_client(listener: std::net::Ipv4Addr) -> Vec<(Ns, Query)> {
    let mut all = Vec::new();
    for ns in [Ns::Pod, Ns::Node] {
        for transport in TRANSPORTS {
            let query = Query::new(dns(listener), transport);
            all.push((ns, query));
            all.push((ns, query.mapped()));
        }
    }
    all
}

/// What a client must see as its peer when it asked `listener`.
fn listener_as_seen_by(query: &Query, listener: std::net::Ipv4Addr) -> SocketAddr {
    if query.mapped {
        mapped(listener)
    } else {
        dns(listener)
    }
}

fn is_upstream(answer: Option<IpAddr>) -> bool {
    [
        IpAddr::V4(UPSTREAM_A.a),
        IpAddr::V4(UPSTREAM_B.a),
        IpAddr::V6(UPSTREAM_A.aaaa),
        IpAddr::V6(UPSTREAM_B.aaaa),
    ]
    .iter()
    .any(|upstream| Some(*upstream) == answer)
}

/// Where the client saw the answer come from: `recvfrom` for unconnected UDP, `getpeername` for
/// the others.
fn seen_peer(outcome: &bpf_tests::dns::QueryOutcome) -> Option<SocketAddr> {
    socket_addr(outcome.reply_from.as_ref()).or_else(|| socket_addr(outcome.peer.as_ref()))
}

#[test]
fn cache_answers_every_transport_while_it_serves() -> anyhow::Result<()> {
    let harness = Harness::standard(tools!())?;
    let mut decisions = 0;
    for (ns, query) in every_client(NODE_LISTENER) {
        let outcome = harness.sandbox.query(ns, query)?;
        assert!(outcome.ok, "{ns:?} {query:?}: {outcome:?}");
        assert_eq!(
            who(outcome.answer()),
            "cache",
            "{ns:?} {query:?}: {outcome:?}"
        );
        assert_eq!(
            seen_peer(&outcome),
            Some(listener_as_seen_by(&query, NODE_LISTENER)),
            "{ns:?} {query:?}: {outcome:?}"
        );
        // One decision at connect or sendto: a connected dual-stack socket's sends pass
        // sendmsg4 too, but a connected socket is left where it connected.
        decisions += 1;
    }
    let counters = harness.counters(NODE_ID)?;
    assert_eq!(
        counters.to_cache, decisions,
        "every decision was counted as sent to the cache"
    );
    assert_eq!(counters.to_upstream, 0);
    // The cache listens on the listener address itself: nothing was rewritten, nothing recorded.
    assert_eq!(counters.reverse_translated, 0);
    assert!(harness.reverse_entries().is_empty());
    Ok(())
}

#[test]
fn upstream_mode_steers_every_transport_and_rewrites_replies() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    let mut queries = 0;
    for (ns, query) in every_client(NODE_LISTENER) {
        let outcome = harness.sandbox.query(ns, query)?;
        assert!(outcome.ok, "{ns:?} {query:?}: {outcome:?}");
        assert!(
            is_upstream(outcome.answer()),
            "{ns:?} {query:?} answered by {}: {outcome:?}",
            who(outcome.answer())
        );
        assert_eq!(
            seen_peer(&outcome),
            Some(listener_as_seen_by(&query, NODE_LISTENER)),
            "the client must see the listener: {ns:?} {query:?}: {outcome:?}"
        );
        queries += 1;
    }
    let counters = harness.counters(NODE_ID)?;
    // One connect (connected UDP, TCP) or one sendmsg (unconnected UDP) per query.
    assert_eq!(counters.to_upstream, queries);
    assert_eq!(counters.to_cache, 0);
    // One recvmsg (unconnected UDP) or one getpeername (connected UDP, TCP) per query.
    assert_eq!(counters.reverse_translated, queries);
    assert_eq!(counters.reverse_missed, 0);
    // Every socket here talked to one target, which its own storage holds: the LRU map, for
    // sockets that move between targets, stays empty.
    let entries = harness.reverse_entries();
    assert!(entries.is_empty(), "{entries:?}");
    Ok(())
}

/// musl sends a query to every nameserver at once from one unconnected socket. Here the socket
/// asks both listeners before reading a reply, and each listener's pool puts it on a different
/// upstream: the second send moves the socket's storage to the second translation and pushes the
/// first into the LRU map, where the first reply, read after both sends, finds it.
#[test]
fn an_unconnected_socket_asking_two_listeners_at_once_sees_each_reply_from_its_listener()
-> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let a = dns(UPSTREAM_A_V4);
    let b = dns(UPSTREAM_B_V4);
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    harness.set_mode(CLUSTER_ID, Mode::Upstream)?;
    // The same index of the two pools is never the same upstream.
    harness.set_pool(CLUSTER_ID, &[b, a])?;
    let query = Query::new(dns(NODE_LISTENER), Transport::Udp).also(dns(CLUSTER_LISTENER));
    let outcomes = harness.sandbox.query_all(Ns::Pod, query)?;
    assert_eq!(outcomes.len(), 2, "{outcomes:?}");

    // The first translation (the node listener's) went to the LRU map: one entry, pointing from
    // the upstream the socket's cookie picks in the node's pool back to the node listener.
    let entries = harness.reverse_entries();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let (key, value) = entries[0];
    assert_eq!(IpAddr::from(value.listener), IpAddr::V4(NODE_LISTENER));
    assert_eq!(value.listener_id, NODE_ID);
    let pool = harness.maps.pool(NODE_ID)?;
    let index = redirector_common::pool::pick_index(key.socket_cookie, pool.len);
    assert_eq!(pool.targets()[index as usize].addr, key.peer);
    let node_upstream = IpAddr::from(key.peer);
    let (node_identity, cluster_identity) = if node_upstream == IpAddr::V4(UPSTREAM_A_V4) {
        (UPSTREAM_A, UPSTREAM_B)
    } else {
        (UPSTREAM_B, UPSTREAM_A)
    };

    for outcome in &outcomes {
        assert!(outcome.ok, "{outcome:?}");
        let expected = if outcome.answer() == Some(IpAddr::V4(node_identity.a)) {
            dns(NODE_LISTENER)
        } else {
            assert_eq!(outcome.answer(), Some(IpAddr::V4(cluster_identity.a)));
            dns(CLUSTER_LISTENER)
        };
        assert_eq!(seen_peer(outcome), Some(expected), "{outcome:?}");
    }
    for id in [NODE_ID, CLUSTER_ID] {
        let counters = harness.counters(id)?;
        assert_eq!(
            (counters.reverse_translated, counters.reverse_missed),
            (1, 0),
            "listener {id}: {counters:?}"
        );
    }
    Ok(())
}

#[test]
fn each_socket_keeps_one_upstream_and_sockets_spread_over_the_pool() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..16 {
        let outcome = harness
            .sandbox
            .query(Ns::Pod, Query::new(dns(NODE_LISTENER), Transport::Udp))?;
        *seen.entry(who(outcome.answer())).or_insert(0) += 1;
    }
    assert_eq!(
        seen.keys().copied().collect::<Vec<_>>(),
        ["upstream A", "upstream B"],
        "16 fresh sockets must reach both upstreams: {seen:?}"
    );
    // That each socket's target is the one `pick_index` gives its cookie is checked where a
    // translation reaches the LRU map (the socket asks two listeners at once).
    Ok(())
}

#[test]
fn flipping_the_mode_moves_answers_and_back() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let ask = |harness: &Harness| -> anyhow::Result<&'static str> {
        let outcome = harness
            .sandbox
            .query(Ns::Pod, Query::new(dns(NODE_LISTENER), Transport::Udp))?;
        assert_eq!(seen_peer(&outcome), Some(dns(NODE_LISTENER)), "{outcome:?}");
        Ok(if is_upstream(outcome.answer()) {
            "upstream"
        } else {
            who(outcome.answer())
        })
    };
    // The cache is alive (its sockets are counted, its probes pass): `auto` follows it.
    for (mode, expected) in [
        (Mode::Auto, "cache"),
        (Mode::Upstream, "upstream"),
        (Mode::Cache, "cache"),
        (Mode::Upstream, "upstream"),
        (Mode::Auto, "cache"),
    ] {
        harness.set_mode(NODE_ID, mode)?;
        assert_eq!(ask(&harness)?, expected, "mode {mode:?}");
    }
    Ok(())
}

#[test]
fn dig_and_glibc_resolve_through_the_listener() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    for mode in [Mode::Cache, Mode::Upstream] {
        harness.set_mode(NODE_ID, mode)?;
        for ns in [Ns::Pod, Ns::Node] {
            for tcp in [false, true] {
                let dig = harness
                    .sandbox
                    .dig(ns, IpAddr::V4(NODE_LISTENER), tcp, false)?;
                assert!(
                    !dig.output.contains("unexpected source"),
                    "dig saw the backend address: {}",
                    dig.output
                );
                let answered_by = who(dig.answer());
                if mode == Mode::Cache {
                    assert_eq!(answered_by, "cache", "{ns:?} tcp={tcp}: {}", dig.output);
                } else {
                    assert!(
                        is_upstream(dig.answer()),
                        "{ns:?} tcp={tcp}: {}",
                        dig.output
                    );
                }
            }
            // glibc: resolv.conf names the listener; ahosts asks A and AAAA on one socket.
            let addresses = harness.sandbox.getent(ns, "ahosts")?;
            for address in &addresses {
                if mode == Mode::Cache {
                    assert_eq!(who(Some(*address)), "cache", "{ns:?}: {addresses:?}");
                } else {
                    assert!(is_upstream(Some(*address)), "{ns:?}: {addresses:?}");
                }
            }
            assert!(
                addresses.iter().any(IpAddr::is_ipv4) && addresses.iter().any(IpAddr::is_ipv6),
                "{addresses:?}"
            );
        }
    }
    Ok(())
}

/// The reply hooks pass over datagrams from ports no target uses, without touching the socket:
/// a target on another port must have its port let through before any socket reaches it.
#[test]
fn replies_from_a_target_on_another_port_are_translated() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let elsewhere = SocketAddr::new(IpAddr::V4(UPSTREAM_A_V4), 5353);
    harness
        .sandbox
        .start_server("A on 5353", Ns::Upstream, &[elsewhere], UPSTREAM_A)?;
    let port_be = |port: u16| port.to_be();
    assert!(harness.maps.replies_allowed_from(port_be(53))?);
    assert!(!harness.maps.replies_allowed_from(port_be(5353))?);
    harness.set_pool(NODE_ID, &[elsewhere])?;
    assert!(harness.maps.replies_allowed_from(port_be(5353))?);
    assert!(!harness.maps.replies_allowed_from(port_be(5354))?);
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    for (ns, query) in every_client(NODE_LISTENER) {
        let outcome = harness.sandbox.query(ns, query)?;
        assert_eq!(
            who(outcome.answer()),
            "upstream A",
            "{query:?}: {outcome:?}"
        );
        assert_eq!(
            seen_peer(&outcome),
            Some(listener_as_seen_by(&query, NODE_LISTENER)),
            "{ns:?} {query:?}: {outcome:?}"
        );
    }
    assert_eq!(harness.counters(NODE_ID)?.reverse_missed, 0);
    Ok(())
}

#[test]
fn other_ports_other_addresses_and_unconfigured_servers_are_untouched() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    harness.sandbox.start_server(
        "other port",
        Ns::Node,
        &[SocketAddr::new(IpAddr::V4(NODE_LISTENER), 5353)],
        OTHER_PORT,
    )?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    for transport in TRANSPORTS {
        // The listener address, another port: not DNS for us.
        let outcome = harness.sandbox.query(
            Ns::Pod,
            Query::new(SocketAddr::new(IpAddr::V4(NODE_LISTENER), 5353), transport),
        )?;
        assert_eq!(
            who(outcome.answer()),
            "other port",
            "{transport:?}: {outcome:?}"
        );
        // An upstream addressed directly: not a listener, and its replies keep their source.
        let outcome = harness
            .sandbox
            .query(Ns::Pod, Query::new(dns(UPSTREAM_B_V4), transport))?;
        assert_eq!(
            who(outcome.answer()),
            "upstream B",
            "{transport:?}: {outcome:?}"
        );
        assert_eq!(
            seen_peer(&outcome),
            Some(dns(UPSTREAM_B_V4)),
            "{transport:?}: {outcome:?}"
        );
    }
    let counters = harness.counters(NODE_ID)?;
    assert_eq!(
        counters.to_upstream + counters.to_cache,
        0,
        "nothing was steered: {counters:?}"
    );
    assert!(harness.reverse_entries().is_empty());
    Ok(())
}

#[test]
fn sockets_of_a_skipped_cgroup_reach_the_listener_untouched() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    harness.set_mode(V6_ID, Mode::Upstream)?;
    let skipped = harness.sandbox.skipped_cgroup();
    for transport in TRANSPORTS {
        let outcome = harness.sandbox.query_in(
            Ns::Node,
            skipped,
            Query::new(dns(NODE_LISTENER), transport),
        )?;
        assert_eq!(
            who(outcome.answer()),
            "cache",
            "the cache's own query was steered: {transport:?} {outcome:?}"
        );
    }
    // The skip is per listener: `v6` does not skip this cgroup.
    let outcome = harness.sandbox.query_in(
        Ns::Node,
        skipped,
        Query::new(dns(V6_LISTENER), Transport::Udp),
    )?;
    assert!(is_upstream(outcome.answer()), "{outcome:?}");
    let counters = harness.counters(NODE_ID)?;
    assert_eq!(counters.skipped_cgroup, 3);
    assert_eq!(counters.to_upstream, 0);
    Ok(())
}

#[test]
fn an_empty_pool_obeys_its_policy() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    // `cluster` has no upstreams and policy `fail`: the syscall fails at once.
    harness.set_mode(CLUSTER_ID, Mode::Upstream)?;
    for transport in TRANSPORTS {
        let outcome = harness
            .sandbox
            .query(Ns::Pod, Query::new(dns(CLUSTER_LISTENER), transport))?;
        assert!(!outcome.ok, "{transport:?}: {outcome:?}");
        assert_eq!(
            outcome.errno,
            Some(libc::EHOSTUNREACH),
            "{transport:?}: {outcome:?}"
        );
    }
    let counters = harness.counters(CLUSTER_ID)?;
    assert_eq!(counters.failed_empty_pool, 3);
    // The probe found the helper on this kernel, so the call is in the verified program (the
    // degraded test below shows it gone when the probe says otherwise).
    assert!(set_retval_calls(&harness.sandbox, names::PROG_CONNECT4)? >= 1);
    // Likewise the fetching atomics, where the probe found the JIT compiles them.
    assert!(fetching_atomics(&harness.sandbox, names::PROG_SOCK_RELEASE)? >= 1);

    // `node` with its pool emptied and policy `pass`: DNS reaches the listener address as sent.
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    harness.set_pool(NODE_ID, &[])?;
    for transport in TRANSPORTS {
        let outcome = harness
            .sandbox
            .query(Ns::Pod, Query::new(dns(NODE_LISTENER), transport))?;
        assert_eq!(who(outcome.answer()), "cache", "{transport:?}: {outcome:?}");
    }
    let counters = harness.counters(NODE_ID)?;
    assert_eq!(counters.passed_through, 3);
    assert_eq!(counters.to_upstream, 0);
    Ok(())
}

#[test]
fn pool_updates_apply_to_the_next_socket() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    for (pool, expected) in [(UPSTREAM_B_V4, "upstream B"), (UPSTREAM_A_V4, "upstream A")] {
        harness.set_pool(NODE_ID, &[dns(pool)])?;
        for _ in 0..4 {
            let outcome = harness
                .sandbox
                .query(Ns::Pod, Query::new(dns(NODE_LISTENER), Transport::Udp))?;
            assert_eq!(who(outcome.answer()), expected, "{outcome:?}");
        }
    }
    Ok(())
}

#[test]
fn ipv6_listener_is_steered_and_translated() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    for (mode, upstream) in [(Mode::Cache, false), (Mode::Upstream, true)] {
        harness.set_mode(V6_ID, mode)?;
        for ns in [Ns::Pod, Ns::Node] {
            for transport in TRANSPORTS {
                for aaaa in [false, true] {
                    let query = Query {
                        aaaa,
                        ..Query::new(dns(V6_LISTENER), transport)
                    };
                    let outcome = harness.sandbox.query(ns, query)?;
                    assert!(outcome.ok, "{ns:?} {query:?}: {outcome:?}");
                    assert_eq!(
                        is_upstream(outcome.answer()),
                        upstream,
                        "{ns:?} {query:?}: {outcome:?}"
                    );
                    assert_eq!(
                        seen_peer(&outcome),
                        Some(dns(V6_LISTENER)),
                        "{ns:?} {query:?}: {outcome:?}"
                    );
                }
            }
            let dig = harness
                .sandbox
                .dig(ns, IpAddr::V6(V6_LISTENER), false, true)?;
            assert_eq!(is_upstream(dig.answer()), upstream, "{}", dig.output);
            assert!(!dig.output.contains("unexpected source"), "{}", dig.output);
        }
    }
    harness.sandbox.netns(Ns::Pod).write_resolv_conf(&format!(
        "nameserver {V6_LISTENER}\noptions timeout:2 attempts:1\n"
    ))?;
    let addresses = harness.sandbox.getent(Ns::Pod, "ahosts")?;
    assert!(
        addresses.iter().all(|address| is_upstream(Some(*address))),
        "{addresses:?}"
    );
    let counters = harness.counters(V6_ID)?;
    assert!(
        counters.to_upstream > 0 && counters.to_cache > 0,
        "{counters:?}"
    );
    assert_eq!(counters.reverse_missed, 0);
    Ok(())
}

#[test]
fn a_connected_dual_stack_socket_is_moved_never_redirected() -> anyhow::Result<()> {
    // An AF_INET6 socket connected to ::ffff:listener passes sendmsg4 on every send. Forcing the
    // listener upstream mid-stream must not redirect its datagrams: the connected socket would
    // drop the replies (they come from another address), and every query would time out.
    // Instead its first send after the flip is refused (the egress program), the client reopens
    // as c-ares does, and the new socket is steered at its connect.
    let mut harness = Harness::standard(tools!())?;
    let stream = bpf_tests::stream::Stream::start_with(
        &harness.sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_millis(1500)),
        &["--kinds", "connected", "--mapped"],
    )?;
    pause(500);
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    let report = stream.finish()?;
    assert!(report.records.len() > 20, "{}", report.summary());
    let answered: Vec<&str> = report
        .records
        .iter()
        .map(bpf_tests::stream::StreamReport::answered_by)
        .collect();
    let first_upstream = answered
        .iter()
        .position(|by| by.starts_with("upstream"))
        .unwrap_or_else(|| panic!("the socket never moved: {}", report.summary()));
    assert!(
        answered[..first_upstream].iter().all(|by| *by == "cache")
            && answered[first_upstream..]
                .iter()
                .all(|by| by.starts_with("upstream")),
        "every query answered, by the cache until the move and by an upstream after: {}",
        report.summary()
    );
    let reopened: Vec<usize> = report
        .records
        .iter()
        .enumerate()
        .filter(|(_, record)| record.reopened)
        .map(|(index, _)| index)
        .collect();
    assert_eq!(
        reopened,
        [first_upstream],
        "one refused send, the move: {}",
        report.summary()
    );
    assert_eq!(harness.counters(NODE_ID)?.moved_to_upstream, 1);
    // New sockets follow the listener.
    let outcome = harness.sandbox.query(
        Ns::Pod,
        Query::new(dns(NODE_LISTENER), Transport::UdpConnected).mapped(),
    )?;
    assert!(is_upstream(outcome.answer()), "{outcome:?}");
    Ok(())
}

/// A long-lived socket's replies are translated from the socket's own storage, which no other
/// socket can evict. Before, they came from the `REVERSE_NAT` LRU alone, and a socket whose
/// target had not changed never wrote its entry again: with 1024 entries in upstream mode, 3000
/// fresh-socket queries evicted the entries of a long-lived unconnected and a long-lived connected
/// socket, whose replies were then shown from the upstream's own address (and dropped by every
/// resolver: that socket's DNS was dead for its lifetime).
#[test]
fn long_lived_sockets_keep_their_translation_when_the_lru_churns() -> anyhow::Result<()> {
    const ENTRIES: usize = 1024;
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = format!(
        "reverse_nat_entries = {ENTRIES}\n{}",
        sandbox.config_toml(&bpf_tests::harness::standard_listeners(&sandbox))
    );
    let mut harness = Harness::with_config(sandbox, &config)?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    let listener = dns(NODE_LISTENER);
    let mut held = Vec::new();
    for transport in [Transport::Udp, Transport::UdpConnected] {
        let mut client = harness.sandbox.held_client(
            Ns::Pod,
            harness.sandbox.cgroup(),
            Query::new(listener, transport),
            2,
            false,
        )?;
        let first = client.ask()?;
        assert!(first.ok, "{transport:?}, first query: {first:?}");
        assert!(is_upstream(first.answer()), "{transport:?}: {first:?}");
        assert_eq!(
            seen_peer(&first),
            Some(listener),
            "{transport:?}: {first:?}"
        );
        held.push((transport, client));
    }

    // Twice the map's size in fresh sockets, each with an entry of its own: each asks both
    // listeners at once, and the cluster listener's pool puts it on the other upstream, so its
    // second send pushes its first translation into the map.
    harness.set_mode(CLUSTER_ID, Mode::Upstream)?;
    harness.set_pool(CLUSTER_ID, &[dns(UPSTREAM_B_V4), dns(UPSTREAM_A_V4)])?;
    let cluster = dns(CLUSTER_LISTENER);
    let churn = 2 * ENTRIES;
    let mut answered = 0;
    for _ in 0..2 {
        let outcomes = harness.sandbox.queries_in(
            Ns::Pod,
            harness.sandbox.cgroup(),
            Query::new(listener, Transport::Udp).also(cluster),
            u16::try_from(ENTRIES)?,
        )?;
        answered += outcomes
            .iter()
            .filter(|outcome| {
                outcome.ok && [Some(listener), Some(cluster)].contains(&seen_peer(outcome))
            })
            .count();
    }
    assert_eq!(
        answered,
        2 * churn,
        "every churning query was answered as the listener it asked"
    );
    let entries = harness.reverse_entries().len();
    assert!(
        entries <= ENTRIES,
        "the LRU holds at most {ENTRIES} entries, so most of the {} written were evicted: {entries}",
        churn + held.len()
    );

    let before = harness.counters(NODE_ID)?;
    for (transport, client) in &mut held {
        let second = client.ask()?;
        assert!(second.ok, "{transport:?}, second query: {second:?}");
        assert!(is_upstream(second.answer()), "{transport:?}: {second:?}");
        // Both what recvfrom reports and, for the connected socket, what getpeername reports.
        assert_eq!(
            socket_addr(second.reply_from.as_ref()),
            Some(listener),
            "{transport:?}: the reply must come from the listener: {second:?}"
        );
        if *transport == Transport::UdpConnected {
            assert_eq!(
                socket_addr(second.peer.as_ref()),
                Some(listener),
                "{transport:?}: getpeername must show the listener: {second:?}"
            );
        }
    }
    let after = harness.counters(NODE_ID)?;
    assert_eq!(
        after.reverse_missed, before.reverse_missed,
        "no reply of a steered socket went untranslated"
    );
    Ok(())
}

/// The calls to `bpf_set_retval` in the program `name` as the kernel holds it.
fn set_retval_calls(sandbox: &Sandbox, name: &str) -> anyhow::Result<usize> {
    Ok(xlated(sandbox, name)?
        .matches("call bpf_set_retval")
        .count())
}

/// The fetching atomic instructions (`BPF_FETCH`, `BPF_CMPXCHG`) in the program `name` as the
/// kernel holds it (`bpftool prog dump xlated`).
fn fetching_atomics(sandbox: &Sandbox, name: &str) -> anyhow::Result<usize> {
    let text = xlated(sandbox, name)?;
    Ok(text
        .lines()
        .filter(|line| line.contains("_fetch_") || line.contains("cmpxchg"))
        .count())
}

/// On a kernel whose JIT cannot compile the fetching atomics (arm64 before 5.18, with
/// `CONFIG_BPF_JIT_ALWAYS_ON`: its load would be refused), the agent loads with them switched
/// off and the verifier removes every one; the programs still steer, count the cache's sockets
/// and fail over at its last close and at its stop signal with no agent, and the agent, `status`
/// and the metrics say what runs degraded. The probe's answer is forced
/// (`REDIRECTOR_TEST_ABSENT_FEATURES`): every kernel the tests boot has them
/// (`an_empty_pool_obeys_its_policy` shows them there without the override).
#[test]
fn without_fetching_atomics_the_programs_load_count_and_fail_over_and_say_so() -> anyhow::Result<()>
{
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let absent = std::ffi::OsStr::new(kernel_support::ATOMIC_FETCH);
    let env = [(kernel_support::ABSENT_FOR_TESTS_VARIABLE, absent)];
    let mut agent = cli::start_agent_with(&config, &[], &env)?;
    assert!(
        agent
            .printed()
            .iter()
            .any(|line| line.contains("runs degraded") && line.contains("stalled cache")),
        "the agent logs what it runs without: {:?}",
        agent.printed()
    );
    for name in redirector::datapath::ALL_PROGRAMS {
        assert_eq!(
            fetching_atomics(&sandbox, name)?,
            0,
            "{name}: the verifier removed every switched-off fetching atomic:\n{}",
            xlated(&sandbox, name)?
        );
    }
    let metrics = bpf_tests::http::get(cli::logged_metrics_address(&mut agent)?, "/metrics")?;
    assert_eq!(
        bpf_tests::http::sample(
            &metrics.body,
            "redirector_kernel_degraded{feature=\"atomic_fetch\"}"
        ),
        Some(1.0),
        "{}",
        metrics.body
    );
    wait_for_cache(&sandbox, "the agent confirms the cache")?;
    let status = std::process::Command::new(bpf_tests::sandbox::redirector_bin())
        .args(["status", "--config", &config.display().to_string()])
        .env(kernel_support::ABSENT_FOR_TESTS_VARIABLE, absent)
        .output()?;
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success() && text.contains("DEGRADED without BPF_ATOMIC with BPF_FETCH"),
        "{status:?}"
    );
    cli::stop_agent(&mut agent)?;

    // With no agent: a cache's stop moves the listener (a plain add, then a read): its SIGKILL,
    // once for all its threads (the agent knew its process from its sockets), then its last
    // close.
    let pin_dir = sandbox.pin_dir();
    let epoch = || -> anyhow::Result<u64> {
        Ok(redirector::datapath::Maps::open_pinned(&pin_dir)?
            .socket_counts(NODE_ID)?
            .down_epoch)
    };
    let before = epoch()?;
    sandbox.stop_server("cache")?;
    let answered = answered_by(&sandbox)?;
    assert!(answered.starts_with("upstream"), "{answered}");
    assert_eq!(
        epoch()?,
        before + 2,
        "the SIGKILL and the last close recorded the death"
    );
    // Its next life binds under the programs, so its stop signal moves the listener too (a new
    // epoch while its sockets stand), and its last close once more.
    sandbox.start_cache("cache", &bpf_tests::sandbox::CacheSpec::standard())?;
    let restarted = epoch()?;
    sandbox
        .process("cache")?
        .signal(nix::sys::signal::Signal::SIGTERM)?;
    bpf_tests::pace::wait_until(
        "the cache's stop signal and last close move the listener",
        Duration::from_secs(5),
        Duration::from_millis(10),
        || Ok(epoch()? >= restarted + 2),
    )?;
    let activity = redirector::datapath::Maps::open_pinned(&pin_dir)?.cache_activity(NODE_ID)?;
    assert!(activity.signalled >= 1, "{activity:?}");
    let answered = answered_by(&sandbox)?;
    assert!(answered.starts_with("upstream"), "{answered}");
    cli::uninstall(&config)?;
    Ok(())
}

/// The program `name` as the kernel holds it (the verifier's output, `bpftool prog dump
/// xlated`).
fn xlated(sandbox: &Sandbox, name: &str) -> anyhow::Result<String> {
    let (_, id) = redirector::datapath::pinned_program_ids(&sandbox.pin_dir())
        .into_iter()
        .find(|(program, _)| *program == name)
        .with_context(|| format!("{name} is attached"))?;
    let output = std::process::Command::new("bpftool")
        .args(["prog", "dump", "xlated", "id", &id.to_string()])
        .output()
        .context("running bpftool (install it: apt-get install bpftool)")?;
    anyhow::ensure!(output.status.success(), "bpftool: {output:?}");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    anyhow::ensure!(text.contains("exit"), "not a program dump: {text}");
    Ok(text)
}

/// On a kernel whose sock_addr programs cannot call `bpf_set_retval` (before 6.1: the 5.15 LTS
/// the floor is for), the agent loads with the call switched off, the verifier removes it, the
/// `fail` policy's syscalls fail with the plain rejection's EPERM, and the agent and `status` say
/// so. The probe's answer is forced (`REDIRECTOR_TEST_ABSENT_FEATURES`): every kernel the tests
/// boot has the helper (`an_empty_pool_obeys_its_policy` shows the call there without the
/// override).
#[test]
fn without_bpf_set_retval_the_fail_policy_fails_with_eperm_and_says_so() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let config_arg = config.display().to_string();

    let absent = std::ffi::OsStr::new(kernel_support::SET_RETVAL);
    let mut agent = cli::start_agent_with(
        &config,
        &[],
        &[(kernel_support::ABSENT_FOR_TESTS_VARIABLE, absent)],
    )?;
    assert!(
        agent
            .printed()
            .iter()
            .any(|line| line.contains("runs degraded") && line.contains("EPERM")),
        "the agent logs what it runs without: {:?}",
        agent.printed()
    );
    for name in names::SOCK_ADDR_PROGRAMS {
        assert_eq!(
            set_retval_calls(&sandbox, name)?,
            0,
            "{name}: the verifier removed the switched-off call"
        );
    }
    assert_eq!(cli::set_state(&sandbox, "cluster", "upstream")?.code, 0);
    for transport in TRANSPORTS {
        let outcome = sandbox.query(Ns::Pod, Query::new(dns(CLUSTER_LISTENER), transport))?;
        assert!(!outcome.ok, "{transport:?}: {outcome:?}");
        assert_eq!(
            outcome.errno,
            Some(libc::EPERM),
            "{transport:?}: {outcome:?}"
        );
    }
    let maps = redirector::datapath::Maps::open_pinned(&sandbox.pin_dir())?;
    assert_eq!(maps.counters(CLUSTER_ID)?.total().failed_empty_pool, 3);

    // `status` probes the kernel too, under the same override.
    let status = std::process::Command::new(bpf_tests::sandbox::redirector_bin())
        .args(["status", "--config", &config_arg])
        .env(kernel_support::ABSENT_FOR_TESTS_VARIABLE, absent)
        .output()?;
    assert!(status.status.success(), "{status:?}");
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("DEGRADED without bpf_set_retval in sock_addr programs (6.1)"),
        "{text}"
    );
    cli::stop_agent(&mut agent)?;
    cli::uninstall(&config)?;
    Ok(())
}
