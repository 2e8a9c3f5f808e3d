//! Long-lived sockets, as resolvers that keep theirs use them (c-ares with `ARES_FLAG_STAYOPEN`,
//! nginx): a connected UDP socket is steered once, at connect, so after every route change its
//! next send is refused (EPERM, from the egress program) and the client, which reopens on a send
//! error as c-ares and glibc do, is steered to the current route by its new socket's connect. An
//! unconnected socket is steered at every send and is never refused.

use anyhow::Context as _;
use bpf_tests::{
    dns::QueryOutcome,
    harness::{CacheEvent, Harness, NODE_ID, V6_ID, socket_addr},
    pace,
    sandbox::{HeldClient, Ns, Query, Transport},
    tools,
    topology::{NODE_LISTENER, V6_LISTENER, dns, who},
};
use std::time::{Duration, Instant};

use redirector::liveness::drain;
use redirector_common::{
    counters::ListenerCounters,
    settings::Mode,
    stale::{DRAIN_GRACE_NS, FAILBACK_GRACE_NS},
};

/// `EPERM`: what a send dropped at cgroup egress fails with.
const EPERM: i32 = 1;

/// A reopening client in the pod on one long-lived socket to `query`, and its first answer
/// (asserted to come from `first`, shown as `query.server`).
fn held(
    harness: &Harness,
    query: Query,
    count: u16,
    first: &str,
) -> anyhow::Result<(HeldClient, QueryOutcome)> {
    let mut client =
        harness
            .sandbox
            .held_client(Ns::Pod, harness.sandbox.cgroup(), query, count, true)?;
    let outcome = client.ask()?;
    assert_answered(&outcome, &query, first, None);
    Ok((client, outcome))
}

/// Asserts that `outcome` was answered by `by`, shown as coming from the address `query` asked,
/// after a reopen for `reopened` (an errno) or without one.
fn assert_answered(outcome: &QueryOutcome, query: &Query, by: &str, reopened: Option<i32>) {
    assert!(outcome.ok, "{query:?}: {outcome:?}");
    let answerer = who(outcome.answer());
    let matches = match by {
        "upstream" => answerer.starts_with("upstream"),
        name => answerer == name,
    };
    assert!(
        matches,
        "{query:?}: answered by {answerer}, not {by}: {outcome:?}"
    );
    let shown = if query.mapped {
        match query.server.ip() {
            std::net::IpAddr::V4(v4) => {
                std::net::SocketAddr::new(v4.to_ipv6_mapped().into(), query.server.port())
            }
            std::net::IpAddr::V6(_) => query.server,
        }
    } else {
        query.server
    };
    assert_eq!(
        socket_addr(outcome.reply_from.as_ref()),
        Some(shown),
        "{query:?}: the reply must come from the listener: {outcome:?}"
    );
    if query.transport == Transport::UdpConnected {
        assert_eq!(
            socket_addr(outcome.peer.as_ref()),
            Some(shown),
            "{query:?}: getpeername must show the listener: {outcome:?}"
        );
    }
    assert_eq!(
        outcome.reopened_after_errno, reopened,
        "{query:?}: reopened after which send error: {outcome:?}"
    );
}

/// Waits until a socket steered at `steered` is past the failback grace, so that a failback moves
/// it at its next send (`redirector_common::stale::FAILBACK_GRACE_NS`: the kernel's clock, not
/// stretched in the VMs).
fn outlast_failback_grace(steered: Instant) {
    let grace = Duration::from_nanos(FAILBACK_GRACE_NS) + Duration::from_millis(50);
    std::thread::sleep(grace.saturating_sub(steered.elapsed()));
}

/// The moves counted for listener `id` (UDP and TCP together).
fn moves(harness: &Harness, id: u32) -> anyhow::Result<(u64, u64)> {
    let ListenerCounters {
        moved_to_cache,
        moved_to_upstream,
        ..
    } = harness.counters(id)?;
    Ok((moved_to_cache, moved_to_upstream))
}

#[test]
fn a_connected_socket_follows_every_route_change_at_its_next_send() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let cases = [
        (
            NODE_ID,
            Query::new(dns(NODE_LISTENER), Transport::UdpConnected),
        ),
        (
            NODE_ID,
            Query::new(dns(NODE_LISTENER), Transport::UdpConnected).mapped(),
        ),
        (V6_ID, Query::new(dns(V6_LISTENER), Transport::UdpConnected)),
    ];
    for (id, query) in cases {
        let before = moves(&harness, id)?;
        let (mut client, _) = held(&harness, query, 4, "cache")?;
        harness.set_mode(id, Mode::Upstream)?;
        assert_answered(&client.ask()?, &query, "upstream", Some(EPERM));
        let reopened = Instant::now();
        // Nothing changed: the socket stays where it is.
        assert_answered(&client.ask()?, &query, "upstream", None);
        outlast_failback_grace(reopened);
        harness.set_mode(id, Mode::Cache)?;
        assert_answered(&client.ask()?, &query, "cache", Some(EPERM));
        let after = moves(&harness, id)?;
        assert_eq!(
            (after.0 - before.0, after.1 - before.1),
            (1, 1),
            "{query:?}: one move each way, counted"
        );
    }
    Ok(())
}

/// A socket connected to an upstream moments before a failback (within the grace) keeps it: the
/// upstream answers, and a resolver with a socket per query that connected the instant before
/// must not have its query refused. Once past the grace, its next send moves it. Towards the
/// upstream pool nothing is spared: a socket connected to the cache moments before it died or
/// hung is refused at its first send, which the cache would lose.
#[test]
fn a_socket_connected_just_before_a_failback_finishes_on_its_upstream() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let query = Query::new(dns(NODE_LISTENER), Transport::UdpConnected);

    harness.set_mode(NODE_ID, Mode::Upstream)?;
    let mut on_upstream =
        harness
            .sandbox
            .held_client_idle(Ns::Pod, harness.sandbox.cgroup(), query, 2, true)?;
    harness.set_mode(NODE_ID, Mode::Cache)?;
    let first = on_upstream.ask()?;
    // Timed from the connect (the client's clock, the kernel's monotonic one), not from the
    // client's start: a slow VM may take over a second to start a process in the pod.
    let grace = Duration::from_nanos(FAILBACK_GRACE_NS);
    let since_connected = on_upstream
        .since_connected()
        .context("a client held idle reports its connect")?;
    anyhow::ensure!(
        since_connected < grace,
        "{since_connected:?} passed from the client's connect to its first answer, more than the \
         {grace:?} grace: this test cannot tell the grace from a refusal"
    );
    assert_answered(&first, &query, "upstream", None);
    outlast_failback_grace(Instant::now());
    assert_answered(&on_upstream.ask()?, &query, "cache", Some(EPERM));
    assert_eq!(moves(&harness, NODE_ID)?, (1, 0));

    let mut on_cache =
        harness
            .sandbox
            .held_client_idle(Ns::Pod, harness.sandbox.cgroup(), query, 1, true)?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    assert_answered(&on_cache.ask()?, &query, "upstream", Some(EPERM));
    assert_eq!(moves(&harness, NODE_ID)?, (1, 1));
    Ok(())
}

/// A socket connected to the cache moments before a drain sends its query there: the drained
/// cache still serves and answers it, so a resolver with a socket per query and a single try
/// (glibc with `options attempts:1`) that connected the instant before the drain does not lose
/// it. Once past the grace, the socket's next send moves it upstream. A cache that died, hung or
/// was told to stop is never spared (`leaves_and_returns`, and the failback test above).
#[test]
fn a_socket_connected_just_before_a_drain_finishes_on_the_drained_cache() -> anyhow::Result<()> {
    let harness = Harness::standard(tools!())?;
    harness.wait_for_route(NODE_ID, "cache")?;
    let query = Query::new(dns(NODE_LISTENER), Transport::UdpConnected);
    let mut on_cache =
        harness
            .sandbox
            .held_client_idle(Ns::Pod, harness.sandbox.cgroup(), query, 2, true)?;
    drain::begin(&harness.maps, NODE_ID)?;
    assert_eq!(
        harness.route(NODE_ID)?,
        "upstream",
        "the drain moved nothing"
    );
    let first = on_cache.ask()?;
    // Timed from the drain's own record, on the clock the egress program reads.
    let drained_ns = harness.maps.cache_activity(NODE_ID)?.flip_ns;
    let grace = Duration::from_nanos(DRAIN_GRACE_NS);
    let since_drained = Duration::from_nanos(pace::monotonic_ns().saturating_sub(drained_ns));
    anyhow::ensure!(
        since_drained < grace,
        "{since_drained:?} passed from the drain to the client's answer, more than the {grace:?} \
         grace: this test cannot tell the grace from a refusal"
    );
    assert_answered(&first, &query, "cache", None);
    std::thread::sleep((grace + Duration::from_millis(50)).saturating_sub(since_drained));
    assert_answered(&on_cache.ask()?, &query, "upstream", Some(EPERM));
    assert_eq!(moves(&harness, NODE_ID)?, (0, 1));
    Ok(())
}

#[test]
fn an_unconnected_socket_follows_the_route_and_is_never_refused() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let query = Query::new(dns(NODE_LISTENER), Transport::Udp);
    let (mut client, _) = held(&harness, query, 3, "cache")?;
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    assert_answered(&client.ask()?, &query, "upstream", None);
    harness.set_mode(NODE_ID, Mode::Cache)?;
    assert_answered(&client.ask()?, &query, "cache", None);
    assert_eq!(moves(&harness, NODE_ID)?, (0, 0));
    Ok(())
}

/// The cache's own queries (a skipped cgroup) must never be refused: in the NodeLocal layout the
/// cache forwards to the very address it serves, over a socket the programs leave alone.
#[test]
fn a_connected_socket_of_a_skipped_cgroup_is_never_refused() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let query = Query::new(dns(NODE_LISTENER), Transport::UdpConnected);
    let mut client =
        harness
            .sandbox
            .held_client(Ns::Pod, harness.sandbox.skipped_cgroup(), query, 2, true)?;
    assert_answered(&client.ask()?, &query, "cache", None);
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    assert_answered(&client.ask()?, &query, "cache", None);
    assert_eq!(moves(&harness, NODE_ID)?, (0, 0));
    Ok(())
}

/// A connected socket on the cache moves at its next send once the listener routes upstream
/// (a hung cache: the probes flip it; a killed one: the kernel does, instead of the socket
/// sending into a closed port and waiting for the ICMP error), and moves back once the cache is
/// confirmed again.
fn leaves_and_returns(event: CacheEvent) -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let query = Query::new(dns(NODE_LISTENER), Transport::UdpConnected);
    let (mut client, _) = held(&harness, query, 3, "cache")?;
    event.strike(&mut harness.sandbox)?;
    harness.wait_for_route(NODE_ID, "upstream")?;
    assert_answered(&client.ask()?, &query, "upstream", Some(EPERM));
    let reopened = Instant::now();
    event.restore(&mut harness.sandbox)?;
    harness.wait_for_route(NODE_ID, "cache")?;
    outlast_failback_grace(reopened);
    assert_answered(&client.ask()?, &query, "cache", Some(EPERM));
    assert_eq!(moves(&harness, NODE_ID)?, (1, 1), "{event:?}");
    Ok(())
}

#[test]
fn a_connected_socket_leaves_a_hung_cache_and_returns_when_it_resumes() -> anyhow::Result<()> {
    leaves_and_returns(CacheEvent::Hang)
}

#[test]
fn a_connected_socket_leaves_a_killed_cache_and_returns_after_a_restart() -> anyhow::Result<()> {
    leaves_and_returns(CacheEvent::Kill)
}
