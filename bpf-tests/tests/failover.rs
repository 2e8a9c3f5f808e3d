//! Failover when the cache dies, hangs or restarts, with real caches (our test server, dnsmasq,
//! unbound, the embedded cache, CoreDNS with NodeLocal DNSCache's and AKS LocalDNS's Corefiles) and a continuous query stream from a pod: fresh sockets (as glibc uses) and one
//! long-lived unconnected socket. The tests assert who answered and that no answer is missing
//! after the flip; the timing figures they print belong to the benchmark, not to assertions.

use std::{os::unix::fs::MetadataExt as _, time::Duration};

use bpf_tests::{
    caches::{CacheKind, Corefile, start_cache, start_cache_in},
    cgroup::TestCgroup,
    cli::{set_state, start_agent, stop_agent},
    dns::now_ms,
    harness::{
        CLUSTER_ID, Harness, NODE_ID, V6_ID, answered_by, standard_listeners, wait_for_cache,
        write_standard_config,
    },
    pace::{paced, paced_ms, pause},
    sandbox::{CacheSpec, Ns, Sandbox},
    shipped,
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns},
};
use nix::sys::signal::Signal;
use redirector::datapath::Maps;
use redirector_common::{
    binds::{MARKED, UNMARKED},
    listener::{HEALTH_UP, Reason, Route},
    workloads::MAX_EXEMPT_CGROUPS,
};

/// A harness whose only cache is `kind` on the node listener, and both upstreams.
fn harness_with(kind: CacheKind) -> anyhow::Result<Harness> {
    Harness::start(
        tools!(),
        |sandbox| {
            start_cache(sandbox, kind, "cache")?;
            sandbox.start_upstreams()
        },
        standard_listeners,
    )
}

/// Who answers the node listener right now, from the pod.
/// A stream from the pod to the node listener for `seconds` (stretched by the machine's pace,
/// like every event timing here).
fn stream(harness: &Harness, seconds: u64) -> anyhow::Result<Stream> {
    Stream::start(
        &harness.sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_secs(seconds)),
    )
}

/// Asserts the failover shape around an event at `event_ms`, prints the figures, and returns the
/// moment by which the listener had surely flipped ([`StreamReport::flipped_by`]) and how many
/// queries were lost. Every lost query is explained: it began at most one query timeout before
/// the event (the cache had taken it in) and before the flip.
fn assert_failed_over(
    report: &StreamReport,
    started_ms: u64,
    event_ms: u64,
    what: &str,
) -> (u64, usize) {
    let before: Vec<_> = report
        .between(started_ms, event_ms.saturating_sub(paced_ms(350)))
        .collect();
    assert!(
        !before.is_empty(),
        "{what}: no queries before the event: {}",
        report.summary()
    );
    for record in &before {
        assert_eq!(
            StreamReport::answered_by(record),
            "cache",
            "{what}: before the event: {record:?}"
        );
    }
    let first_upstream = report
        .first_upstream_answer(event_ms)
        .unwrap_or_else(|| {
            panic!(
                "{what}: no upstream answered after the event: {}",
                report.summary()
            )
        })
        .begun_ms;
    let last_cache = report
        .last_cache_answer(first_upstream)
        .map_or(0, |record| record.begun_ms);
    let lost = report.failures_between(started_ms, first_upstream);
    println!(
        "{what}: last cache answer {} ms before the event, first upstream answer {} ms after it: \
         gap {} ms, {lost} queries failed ({})",
        event_ms.saturating_sub(last_cache),
        first_upstream.saturating_sub(event_ms),
        first_upstream.saturating_sub(last_cache),
        report.summary()
    );
    let flipped_by = report
        .flipped_by(event_ms)
        .expect("an upstream answered after the event");
    // The stream's per-query timeout: a query begun earlier than that before the event was
    // answered or failed before anything happened to the cache.
    let timeout = paced_ms(300);
    let unexplained: Vec<_> = report
        .between(started_ms, flipped_by + 1)
        .filter(|record| record.error.is_some() && record.begun_ms + timeout < event_ms)
        .collect();
    assert!(
        unexplained.is_empty(),
        "{what}: queries failed before the cache could have taken them in: {unexplained:?}"
    );
    (flipped_by, lost)
}

/// Socket kinds the stream queries from, one query in flight each: after a kill -9 at most
/// this many queries can have been inside the dead cache.
const STREAM_KINDS: usize = 2;

fn kill_9_fails_over_in_the_kernel(kind: CacheKind) -> anyhow::Result<()> {
    let mut harness = harness_with(kind)?;
    assert_eq!(answered_by(&harness.sandbox)?, "cache");
    let epoch = harness.sockets(NODE_ID)?.down_epoch;
    let started = now_ms();
    let stream = stream(&harness, 3)?;
    pause(1000);
    let killed = now_ms();
    harness.sandbox.stop_server("cache")?;
    let report = stream.finish()?;

    let (flipped_by, lost) =
        assert_failed_over(&report, started, killed, &format!("kill -9 of {kind:?}"));
    assert!(
        lost <= STREAM_KINDS,
        "{lost} queries lost: more than were in flight at the cache: {}",
        report.summary()
    );
    assert_eq!(
        report.failures_after_flip(flipped_by),
        0,
        "an answer went missing after the flip: {}",
        report.summary()
    );
    assert!(
        report
            .after_flip(flipped_by)
            .all(|record| StreamReport::answered_by(record).starts_with("upstream")),
        "a dead cache answered? {}",
        report.summary()
    );
    let sockets = harness.sockets(NODE_ID)?;
    assert!(sockets.udp <= 0, "{sockets:?}");
    // The cache is known to the signal program from the agent's start: its SIGKILL (delivered to
    // each of its threads, flipped once) and its last close each begin an epoch.
    let activity = harness.maps.cache_activity(NODE_ID)?;
    assert_eq!(activity.signalled, 1, "{activity:?}");
    assert_eq!(
        sockets.down_epoch,
        epoch + 2,
        "the kernel saw the cache go, once at its SIGKILL and once at its last close"
    );
    Ok(())
}

#[test]
fn kill_9_of_the_test_server_fails_over_in_the_kernel() -> anyhow::Result<()> {
    kill_9_fails_over_in_the_kernel(CacheKind::TestServer)
}

#[test]
fn kill_9_of_dnsmasq_fails_over_in_the_kernel() -> anyhow::Result<()> {
    kill_9_fails_over_in_the_kernel(CacheKind::Dnsmasq)
}

#[test]
fn kill_9_of_unbound_fails_over_in_the_kernel() -> anyhow::Result<()> {
    kill_9_fails_over_in_the_kernel(CacheKind::Unbound)
}

#[test]
fn kill_9_of_the_embedded_cache_fails_over_in_the_kernel() -> anyhow::Result<()> {
    kill_9_fails_over_in_the_kernel(CacheKind::Embedded)
}

#[test]
fn kill_9_of_coredns_fails_over_in_the_kernel() -> anyhow::Result<()> {
    kill_9_fails_over_in_the_kernel(CacheKind::CoreDns(Corefile::NodeLocal))
}

fn clean_stop_and_restart(kind: CacheKind) -> anyhow::Result<()> {
    let mut harness = harness_with(kind)?;
    let started = now_ms();
    let stream = stream(&harness, 5)?;
    pause(1000);
    let stopped = now_ms();
    harness.sandbox.process("cache")?.signal(Signal::SIGTERM)?;
    harness
        .sandbox
        .process("cache")?
        .wait_exit(Duration::from_secs(5))?;
    pause(800);
    harness.sandbox.stop_server("cache")?;
    let restarted = now_ms();
    start_cache(&mut harness.sandbox, kind, "cache")?;
    let report = stream.finish()?;

    let (flipped_by, _) =
        assert_failed_over(&report, started, stopped, &format!("SIGTERM of {kind:?}"));
    let back = report.first_cache_answer(restarted).unwrap_or_else(|| {
        panic!(
            "the restarted cache never got DNS back: {}",
            report.summary()
        )
    });
    println!(
        "{kind:?} restarted: cache answers again {} ms later",
        back.begun_ms - restarted
    );
    assert_eq!(
        report.failures_after_flip(flipped_by),
        0,
        "{}",
        report.summary()
    );
    // Moved by the kernel (the signal, or the last close; a cache in lameduck is seen by the
    // agent while it still holds its sockets), back on the cache only once the probes confirmed it.
    let transitions = harness.agent.stats.transitions("node");
    assert!(
        transitions.iter().any(|t| t.to == Route::Upstream
            && matches!(t.reason, Reason::NoSockets | Reason::Signalled)),
        "{transitions:?}"
    );
    assert_eq!(
        transitions.last().map(|t| (t.to, t.reason)),
        Some((Route::Cache, Reason::Healthy)),
        "{transitions:?}"
    );
    Ok(())
}

#[test]
fn sigterm_and_restart_of_the_test_server_fail_over_and_back() -> anyhow::Result<()> {
    clean_stop_and_restart(CacheKind::TestServer)
}

#[test]
fn sigterm_and_restart_of_dnsmasq_fail_over_and_back() -> anyhow::Result<()> {
    clean_stop_and_restart(CacheKind::Dnsmasq)
}

#[test]
fn sigterm_and_restart_of_unbound_fail_over_and_back() -> anyhow::Result<()> {
    clean_stop_and_restart(CacheKind::Unbound)
}

#[test]
fn clean_stop_and_restart_of_the_embedded_cache() -> anyhow::Result<()> {
    clean_stop_and_restart(CacheKind::Embedded)
}

/// AKS LocalDNS's CoreDNS goes on serving for its lameduck after SIGTERM, sockets open: the
/// signal moves the DNS at once, and its last close and the restart change nothing more.
#[test]
fn sigterm_and_restart_of_coredns_in_lameduck_fail_over_and_back() -> anyhow::Result<()> {
    clean_stop_and_restart(CacheKind::CoreDns(Corefile::LocalDns))
}

/// The first SIGTERM of a cache that was running before the agent started (every node at first
/// install), the cache run as its package runs it and the agent as shipped (`shipped`: it can
/// read neither the cache's descriptors nor its pid namespace's processes): under 1 query/ms
/// (fresh sockets and one kept socket), the programs know the cache from its first read after
/// the agent's start (its first probe), so the signal moves the listener before the cache closes
/// anything and no query sent after the signal is lost. An agent that had to find it in /proc
/// never knew it with these capabilities (its last close moved the DNS), and before that such a
/// cache lost 2 (dnsmasq) or 3-4 (unbound).
fn first_sigterm_of_a_cache_older_than_the_agent(kind: CacheKind) -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    start_cache(&mut sandbox, kind, "cache")?;
    sandbox.start_upstreams()?;
    let (config, mut agent) = shipped::start_agent_on(&sandbox, &standard_listeners(&sandbox))?;
    wait_for_cache(&sandbox, "the shipped agent confirms the cache")?;
    let stream = Stream::start_with(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_secs(4)),
        &["--kinds", "fresh,long", "--interval-ms", "2"],
    )?;
    pause(1000);
    sandbox.process("cache")?.signal(Signal::SIGTERM)?;
    let signalled = now_ms();
    sandbox
        .process("cache")?
        .wait_exit(Duration::from_secs(5))?;
    let report = stream.finish()?;
    let activity = Maps::open_pinned(&sandbox.pin_dir())?.cache_activity(NODE_ID)?;
    report.assert_signal_lost_nothing_after(signalled, &activity, &format!("{kind:?}"));
    stop_agent(&mut agent)?;
    shipped::uninstall(&sandbox, &config)?;
    Ok(())
}

#[test]
fn first_sigterm_of_dnsmasq_older_than_the_agent_loses_nothing_after_it() -> anyhow::Result<()> {
    first_sigterm_of_a_cache_older_than_the_agent(CacheKind::Dnsmasq)
}

#[test]
fn first_sigterm_of_unbound_older_than_the_agent_loses_nothing_after_it() -> anyhow::Result<()> {
    first_sigterm_of_a_cache_older_than_the_agent(CacheKind::Unbound)
}

#[test]
fn first_sigterm_of_coredns_in_lameduck_older_than_the_agent_loses_nothing_after_it()
-> anyhow::Result<()> {
    first_sigterm_of_a_cache_older_than_the_agent(CacheKind::CoreDns(Corefile::LocalDns))
}

fn hang_and_resume(kind: CacheKind) -> anyhow::Result<()> {
    let mut harness = harness_with(kind)?;
    let started = now_ms();
    let stream = stream(&harness, 6)?;
    pause(1000);
    let stopped = now_ms();
    harness.sandbox.process("cache")?.signal(Signal::SIGSTOP)?;
    pause(2500);
    let resumed = now_ms();
    harness.sandbox.process("cache")?.signal(Signal::SIGCONT)?;
    let report = stream.finish()?;

    let (flipped_by, _) =
        assert_failed_over(&report, started, stopped, &format!("SIGSTOP of {kind:?}"));
    assert!(
        flipped_by < resumed,
        "the hang was not noticed before SIGCONT: {}",
        report.summary()
    );
    let back = report
        .first_cache_answer(resumed)
        .unwrap_or_else(|| panic!("the resumed cache never got DNS back: {}", report.summary()));
    println!(
        "{kind:?} resumed: cache answers again {} ms later",
        back.begun_ms - resumed
    );
    assert_eq!(
        report.failures_after_flip(flipped_by),
        0,
        "{}",
        report.summary()
    );
    let transitions = harness.agent.stats.transitions("node");
    assert!(
        transitions.iter().any(|t| t.to == Route::Upstream
            && matches!(t.reason, Reason::Stalled | Reason::ProbesFailing)),
        "{transitions:?}"
    );
    // The hung cache kept its sockets: the kernel never saw it go.
    assert!(harness.sockets(NODE_ID)?.udp > 0);
    Ok(())
}

/// A probe is sent every interval whether or not the earlier ones have answered: with a timeout
/// ten intervals long, a hang of two timeouts sees about ten probes time out, where probing in
/// rounds (each waiting for the last) would see two.
#[test]
fn probes_keep_their_pace_while_a_hung_cache_leaves_earlier_ones_unanswered() -> anyhow::Result<()>
{
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = sandbox.config_toml_probing(
        &standard_listeners(&sandbox),
        bpf_tests::sandbox::UNMANAGED_INTERFACE,
        paced(Duration::from_millis(100)),
        paced(Duration::from_millis(1000)),
    );
    let mut harness = Harness::with_config(sandbox, &config)?;
    let failed = |harness: &Harness| {
        harness
            .agent
            .stats
            .probe_counts()
            .iter()
            .filter(|(listener, alive, _)| listener == "node" && !alive)
            .map(|(_, _, count)| count)
            .sum::<u64>()
    };
    let before = failed(&harness);
    harness.sandbox.process("cache")?.signal(Signal::SIGSTOP)?;
    pause(2000);
    let during = failed(&harness) - before;
    harness.sandbox.process("cache")?.signal(Signal::SIGCONT)?;
    assert!(
        during >= 5,
        "only {during} probes timed out in two timeouts' time: probes waited for each other"
    );
    harness.wait_until("failback", Duration::from_secs(10), |harness| {
        Ok(answered_by(&harness.sandbox)? == "cache")
    })?;
    Ok(())
}

#[test]
fn sigstop_of_the_test_server_fails_over_by_probes_and_sigcont_back() -> anyhow::Result<()> {
    hang_and_resume(CacheKind::TestServer)
}

#[test]
fn sigstop_of_dnsmasq_fails_over_by_probes_and_sigcont_back() -> anyhow::Result<()> {
    hang_and_resume(CacheKind::Dnsmasq)
}

#[test]
fn sigstop_of_unbound_fails_over_by_probes_and_sigcont_back() -> anyhow::Result<()> {
    hang_and_resume(CacheKind::Unbound)
}

#[test]
fn hang_and_resume_of_the_embedded_cache() -> anyhow::Result<()> {
    hang_and_resume(CacheKind::Embedded)
}

#[test]
fn sigstop_of_coredns_fails_over_by_probes_and_sigcont_back() -> anyhow::Result<()> {
    hang_and_resume(CacheKind::CoreDns(Corefile::NodeLocal))
}

#[test]
fn a_crash_loop_flaps_no_more_than_its_crashes_and_ends_on_the_cache() -> anyhow::Result<()> {
    let mut harness = harness_with(CacheKind::TestServer)?;
    let epoch = harness.sockets(NODE_ID)?.down_epoch;
    for _ in 0..10 {
        harness.sandbox.stop_server("cache")?;
        start_cache(&mut harness.sandbox, CacheKind::TestServer, "cache")?;
        pause(100);
    }
    harness.wait_until(
        "failback after the crash loop",
        Duration::from_secs(15),
        |harness| Ok(answered_by(&harness.sandbox)? == "cache"),
    )?;
    // Every crash is recorded: by the last close, and (the cache's process was told to stop with
    // SIGKILL, seen by the signal program on each of its threads) by the signal before it.
    let sockets = harness.sockets(NODE_ID)?;
    assert!(
        sockets.down_epoch >= epoch + 10,
        "an epoch per crash at least: {sockets:?}"
    );
    let transitions = harness.agent.stats.transitions("node");
    let to_upstream = transitions
        .iter()
        .filter(|t| t.to == Route::Upstream)
        .count();
    let to_cache = transitions.iter().filter(|t| t.to == Route::Cache).count();
    println!("crash loop: 10 crashes, {to_upstream} failovers and {to_cache} failbacks observed");
    // The agent sees routes between its turns, so it may see fewer flips than crashes, never
    // more; its first is a failover, its last a failback, and (routes alternate) as many of one
    // as of the other.
    assert!((1..=10).contains(&to_upstream), "{transitions:?}");
    assert_eq!(to_cache, to_upstream, "{transitions:?}");
    assert_eq!(
        transitions.first().map(|t| t.to),
        Some(Route::Upstream),
        "{transitions:?}"
    );
    assert_eq!(
        transitions.last().map(|t| t.to),
        Some(Route::Cache),
        "{transitions:?}"
    );
    Ok(())
}

#[test]
fn a_cache_that_binds_before_it_answers_gets_no_dns() -> anyhow::Result<()> {
    let mut harness = harness_with(CacheKind::TestServer)?;
    harness.sandbox.stop_server("cache")?;
    harness.wait_until("failover", Duration::from_secs(5), |harness| {
        Ok(answered_by(&harness.sandbox)?.starts_with("upstream"))
    })?;
    let started = now_ms();
    let stream = stream(&harness, 4)?;
    pause(300);
    let muted_ms = paced_ms(1500);
    let bound = now_ms();
    harness.sandbox.start_cache(
        "cache",
        &CacheSpec {
            listen: vec![dns(NODE_LISTENER)],
            mute_ms: muted_ms,
            ..CacheSpec::standard()
        },
    )?;
    let report = stream.finish()?;
    assert!(
        harness.sockets(NODE_ID)?.udp > 0,
        "the cache's socket is counted"
    );
    assert_eq!(
        report.failures_between(started, u64::MAX),
        0,
        "a query reached the muted cache: {}",
        report.summary()
    );
    let back = report
        .first_cache_answer(bound)
        .expect("the cache got DNS back once it answered");
    println!(
        "muted cache: DNS back {} ms after it bound (muted for {muted_ms} ms)",
        back.begun_ms - bound
    );
    assert!(
        back.begun_ms >= bound + muted_ms,
        "DNS reached the cache before it answered"
    );
    Ok(())
}

#[test]
fn wildcard_and_reuseport_sockets_are_counted_one_by_one() -> anyhow::Result<()> {
    let mut harness = Harness::start(
        tools!(),
        |sandbox| {
            sandbox.start_cache(
                "cache",
                &CacheSpec {
                    listen: vec!["0.0.0.0:53".parse()?],
                    udp_sockets: 4,
                    ..CacheSpec::standard()
                },
            )?;
            sandbox.start_upstreams()
        },
        standard_listeners,
    )?;
    // 0.0.0.0:53 serves both IPv4 listeners, not the IPv6 one.
    for id in [NODE_ID, CLUSTER_ID] {
        let sockets = harness.sockets(id)?;
        assert_eq!(
            (sockets.udp, sockets.tcp),
            (4, 1),
            "listener {id}: {sockets:?}"
        );
    }
    assert_eq!(harness.sockets(V6_ID)?.udp, 0);
    assert_eq!(answered_by(&harness.sandbox)?, "cache");
    harness.sandbox.stop_server("cache")?;
    // Its SIGKILL (once, however many threads it has) and its last close.
    for id in [NODE_ID, CLUSTER_ID] {
        let sockets = harness.sockets(id)?;
        assert_eq!(
            (sockets.udp, sockets.tcp, sockets.down_epoch),
            (0, 0, 2),
            "listener {id}: {sockets:?}"
        );
    }
    assert!(answered_by(&harness.sandbox)?.starts_with("upstream"));

    // A dual-stack [::]:53 socket serves every listener.
    harness.sandbox.start_cache(
        "cache",
        &CacheSpec {
            listen: vec!["[::]:53".parse()?],
            ..CacheSpec::standard()
        },
    )?;
    for id in [NODE_ID, CLUSTER_ID, V6_ID] {
        assert_eq!(harness.sockets(id)?.udp, 1, "listener {id}");
    }
    Ok(())
}

#[test]
fn a_dns_server_in_another_namespace_does_not_keep_the_listener_alive() -> anyhow::Result<()> {
    let mut harness = Harness::start(tools!(), Sandbox::start_upstreams, standard_listeners)?;
    // A pod runs its own DNS server on :53, in the cgroup the programs watch.
    let cgroup = harness.sandbox.cgroup().path().to_owned();
    let program = harness.sandbox.tools().dns_server.display().to_string();
    let args: Vec<String> = [
        "--listen",
        "0.0.0.0:53",
        "--a",
        "192.0.2.77",
        "--aaaa",
        "2001:db8::77",
    ]
    .iter()
    .map(|arg| (*arg).to_owned())
    .collect();
    harness.sandbox.start_process(
        "pod dns",
        Some(Ns::Pod),
        Some(&cgroup),
        &program,
        &args,
        "ready",
    )?;
    assert_eq!(harness.sockets(NODE_ID)?.udp, 0);
    assert!(answered_by(&harness.sandbox)?.starts_with("upstream"));
    Ok(())
}

#[test]
fn an_agent_started_after_the_cache_sees_it_alive_and_one_started_before_waits_for_it()
-> anyhow::Result<()> {
    // After: the standard harness starts the cache first.
    let mut harness = Harness::standard(tools!())?;
    let sockets = harness.sockets(NODE_ID)?;
    assert_eq!(
        (sockets.udp, sockets.tcp),
        (1, 1),
        "seeded from the socket tables"
    );
    assert_eq!(answered_by(&harness.sandbox)?, "cache");
    // Seeded sockets carry no mark, so every release in the caches' namespace is looked up by
    // cookie while they live.
    assert!(
        harness
            .maps
            .cache_sockets()
            .iter()
            .all(|(_, entry)| entry.marked == UNMARKED)
    );
    assert_ne!(harness.maps.datapath_config()?.unmarked_cache_sockets, 0);
    // The seeded socket is uncounted by the kernel when it closes.
    harness.sandbox.stop_server("cache")?;
    assert_eq!(harness.sockets(NODE_ID)?.udp, 0);
    assert!(answered_by(&harness.sandbox)?.starts_with("upstream"));
    // With no unmarked socket left, releases go back to the mark alone.
    harness.wait_until(
        "the unmarked sockets forgotten",
        Duration::from_secs(5),
        |harness| Ok(harness.maps.datapath_config()?.unmarked_cache_sockets == 0),
    )?;
    // A cache started now is marked at bind, and its death is seen through the mark.
    harness
        .sandbox
        .start_cache("cache", &CacheSpec::standard())?;
    harness.wait_until(
        "the restarted cache confirmed by probes",
        Duration::from_secs(5),
        |harness| Ok(answered_by(&harness.sandbox)? == "cache"),
    )?;
    let counted = harness.maps.cache_sockets();
    assert!(
        !counted.is_empty() && counted.iter().all(|(_, entry)| entry.marked == MARKED),
        "{counted:?}"
    );
    assert_eq!(harness.maps.datapath_config()?.unmarked_cache_sockets, 0);
    harness.sandbox.stop_server("cache")?;
    assert_eq!(harness.sockets(NODE_ID)?.udp, 0);
    assert!(answered_by(&harness.sandbox)?.starts_with("upstream"));

    // Before: no cache yet.
    let mut harness = Harness::start(tools!(), Sandbox::start_upstreams, standard_listeners)?;
    assert!(answered_by(&harness.sandbox)?.starts_with("upstream"));
    harness
        .sandbox
        .start_cache("cache", &CacheSpec::standard())?;
    harness.wait_until(
        "the new cache confirmed by probes",
        Duration::from_secs(5),
        |harness| Ok(answered_by(&harness.sandbox)? == "cache"),
    )?;
    Ok(())
}

#[test]
fn the_kernel_fails_over_alone_after_the_agent_is_killed() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let agent = start_agent(&config)?;
    assert_eq!(answered_by(&sandbox)?, "cache");
    drop(agent); // SIGKILL: no chance to detach
    assert!(
        !sandbox.attached_programs()?.is_empty(),
        "the pinned programs outlive the agent"
    );

    let started = now_ms();
    let stream = Stream::start(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_secs(3)),
    )?;
    pause(1000);
    let killed = now_ms();
    sandbox.stop_server("cache")?;
    let report = stream.finish()?;
    let (flipped_by, lost) =
        assert_failed_over(&report, started, killed, "kill -9 of the cache, agent dead");
    assert!(
        lost <= STREAM_KINDS,
        "{lost} queries lost: more than were in flight at the cache: {}",
        report.summary()
    );
    assert_eq!(
        report.failures_after_flip(flipped_by),
        0,
        "{}",
        report.summary()
    );
    Ok(())
}

#[test]
fn the_agents_probes_are_never_steered() -> anyhow::Result<()> {
    // The agent runs inside the cgroup the programs attach to (as on a node, where they attach to
    // the root): its own cgroup must be skipped, or its probes would follow the listener.
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    // No upstream runs: a steered probe would fail.
    let agent_cgroup = sandbox.cgroup().child("agent")?;
    let config = write_standard_config(&sandbox)?;
    let program = bpf_tests::sandbox::redirector_bin().display().to_string();
    let args = vec![
        "run".to_owned(),
        "--config".to_owned(),
        config.display().to_string(),
    ];
    // In the test's own namespace: `ip netns exec` would hide the cgroup hierarchy from it.
    sandbox.start_process(
        "agent",
        None,
        Some(agent_cgroup.path()),
        &program,
        &args,
        "redirector is steering",
    )?;
    assert_eq!(set_state(&sandbox, "node", "upstream")?.code, 0);
    pause(1500);
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    assert_eq!(
        maps.health(NODE_ID)?.verdict,
        HEALTH_UP,
        "the agent's probes reached the cache"
    );
    sandbox.stop_server("agent")?;
    drop(agent_cgroup);
    Ok(())
}

#[test]
fn a_miscount_heals_on_the_next_reconciles() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let counted = harness.maps.cache_sockets();
    let (cookie, _) = *counted
        .iter()
        .find(|(_, entry)| {
            entry.listeners & 1 != 0 && entry.protocol == redirector_common::counters::PROTOCOL_UDP
        })
        .expect("the cache's UDP socket is counted");

    // Lose the count of a live socket: the listener falls over, then the reconcile finds the
    // socket again and the probes bring the cache back.
    assert!(harness.maps.uncount_cache_socket(cookie, u64::MAX)?);
    assert_eq!(harness.sockets(NODE_ID)?.udp, 0);
    assert!(answered_by(&harness.sandbox)?.starts_with("upstream"));
    harness.wait_until(
        "the lost socket counted again",
        Duration::from_secs(5),
        |harness| Ok(harness.sockets(NODE_ID)?.udp == 1),
    )?;
    harness.wait_until("failback", Duration::from_secs(5), |harness| {
        Ok(answered_by(&harness.sandbox)? == "cache")
    })?;

    // Count a socket that does not exist: removed once absent on two passes.
    let phantom = redirector_common::binds::CacheSocket {
        listeners: 1,
        protocol: redirector_common::counters::PROTOCOL_UDP,
        marked: UNMARKED,
    };
    assert!(harness.maps.count_cache_socket(u64::MAX - 7, phantom)?);
    assert_eq!(harness.sockets(NODE_ID)?.udp, 2);
    harness.wait_until(
        "the phantom socket uncounted",
        Duration::from_secs(5),
        |harness| Ok(harness.sockets(NODE_ID)?.udp == 1),
    )?;
    assert_eq!(
        answered_by(&harness.sandbox)?,
        "cache",
        "the live cache kept DNS throughout"
    );
    Ok(())
}

#[test]
fn a_cache_answering_servfail_keeps_its_dns_and_one_answering_refused_loses_it()
-> anyhow::Result<()> {
    for (rcode, route) in [("servfail", "cache"), ("refused", "upstream")] {
        let harness = Harness::start(
            tools!(),
            |sandbox| {
                sandbox.start_cache(
                    "cache",
                    &CacheSpec {
                        listen: vec![dns(NODE_LISTENER)],
                        extra_args: vec!["--rcode".to_owned(), rcode.to_owned()],
                        ..CacheSpec::standard()
                    },
                )?;
                sandbox.start_upstreams()
            },
            standard_listeners,
        )?;
        // Ten probe rounds: twice the failures that fail over, more than the successes back.
        pause(2500);
        assert_eq!(harness.route(NODE_ID)?, route, "a cache answering {rcode}");
        let servfails = harness
            .agent
            .stats
            .probe_servfails()
            .into_iter()
            .find(|(listener, _)| listener == "node")
            .map_or(0, |(_, count)| count);
        if rcode == "servfail" {
            assert!(servfails >= 5, "SERVFAIL probes counted apart: {servfails}");
        } else {
            assert_eq!(servfails, 0);
        }
    }
    Ok(())
}

#[test]
fn a_restart_keeps_the_pinned_verdict_until_the_probes_turn_it() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    stop_agent(&mut start_agent(&config)?)?;

    // The cache hangs while no agent runs: the next agent's first probe fails. One failure is
    // not the two that fail over; the pinned verdict stands until the second.
    sandbox.process("cache")?.signal(Signal::SIGSTOP)?;
    let agent = start_agent(&config)?;
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    let health = maps.health(NODE_ID)?;
    assert_eq!(
        health.verdict, HEALTH_UP,
        "one failed probe at start decided the verdict"
    );
    let reason = |maps: &Maps| -> anyhow::Result<&'static str> {
        redirector::telemetry::snapshot::listeners(maps)?
            .into_iter()
            .find(|listener| listener.name == "node")
            .map(|listener| listener.reason_code)
            .ok_or_else(|| anyhow::anyhow!("no node listener"))
    };
    bpf_tests::pace::wait_until(
        "the probes fail the hung cache over",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || Ok(reason(&maps)? == "probes_failing"),
    )?;
    sandbox.process("cache")?.signal(Signal::SIGCONT)?;
    drop(agent);
    Ok(())
}

#[test]
fn an_answer_from_a_cache_that_died_meanwhile_does_not_vouch_for_its_successor()
-> anyhow::Result<()> {
    use bpf_tests::{
        cli::logged_metrics_address,
        http::{get, sample},
    };
    let mut sandbox = Sandbox::new(tools!())?;
    // A slow cache: it answers each query 300 ms after it came, and says when one comes.
    let delay = paced_ms(300);
    sandbox.start_cache(
        "cache",
        &CacheSpec {
            listen: vec![dns(NODE_LISTENER)],
            extra_args: vec![
                "--answer-delay-ms".to_owned(),
                delay.to_string(),
                "--log-queries".to_owned(),
            ],
            ..CacheSpec::standard()
        },
    )?;
    sandbox.start_upstreams()?;
    // One success confirms a new epoch, so the one answer from the dead cache would be enough;
    // the timeout outlasts everything below, so that answer is read, not timed out.
    let probe = format!(
        "interval_ms = {}\ntimeout_ms = {}\nfailures_to_fail_over = 2\nsuccesses_to_fail_back = 1\n",
        paced_ms(1000),
        paced_ms(3000)
    );
    let text = sandbox.config_toml_with_probe(
        &standard_listeners(&sandbox),
        bpf_tests::sandbox::UNMANAGED_INTERFACE,
        &probe,
    );
    let config = sandbox.write_file("config.toml", &text)?;
    let mut agent = start_agent(&config)?;
    let metrics = logged_metrics_address(&mut agent)?;
    let answered = || -> anyhow::Result<f64> {
        let body = get(metrics, "/metrics")?.body;
        Ok(sample(
            &body,
            "redirector_probes_total{listener=\"node\",result=\"success\"}",
        )
        .unwrap_or(0.0))
    };
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    let epoch = maps.socket_counts(NODE_ID)?.down_epoch;
    assert_eq!(maps.health(NODE_ID)?.confirmed_epoch, epoch);

    // A probe reaches the cache; the agent freezes before the answer comes back.
    let cache = sandbox.process("cache")?;
    cache.drain();
    cache.wait_for_line("query", Duration::from_secs(5))?;
    let before = answered()?;
    agent.signal(Signal::SIGSTOP)?;
    pause(400);
    // The answer waits in the probe's socket. The cache dies (a new epoch), and a successor
    // binds that answers nothing.
    sandbox.stop_server("cache")?;
    sandbox.start_cache(
        "successor",
        &CacheSpec {
            listen: vec![dns(NODE_LISTENER)],
            mute_ms: 60_000,
            ..CacheSpec::standard()
        },
    )?;
    let counts = maps.socket_counts(NODE_ID)?;
    // Its SIGKILL and its last close each began an epoch.
    assert_eq!(
        (counts.udp, counts.down_epoch),
        (1, epoch + 2),
        "{counts:?}"
    );
    agent.signal(Signal::SIGCONT)?;
    bpf_tests::pace::wait_until(
        "the agent reads the dead cache's answer",
        Duration::from_secs(2),
        Duration::from_millis(20),
        || Ok(answered()? > before),
    )?;
    assert_eq!(
        maps.health(NODE_ID)?.confirmed_epoch,
        epoch,
        "the dead cache's answer confirmed the successor"
    );
    assert!(
        answered_by(&sandbox)?.starts_with("upstream"),
        "DNS went to the successor that never answers"
    );
    Ok(())
}

/// The kernel's pool of the node listener, as its targets' addresses.
fn node_pool(harness: &Harness) -> anyhow::Result<Vec<std::net::IpAddr>> {
    let pool = harness.maps.pool(NODE_ID)?;
    Ok(pool.targets[..pool.len as usize]
        .iter()
        .map(|target| std::net::IpAddr::from(target.addr))
        .map(|address| address.to_canonical())
        .collect())
}

/// Upstream B dies while the node listener routes upstream (an operator's override here): its
/// checks take it out of the kernel's pool and every fresh socket goes to A; back, it returns at
/// its first answer; with both dead, the pool keeps both (an empty pool would fail DNS at once).
#[test]
fn a_dead_upstream_leaves_the_pool_and_returns_when_it_answers() -> anyhow::Result<()> {
    use bpf_tests::topology::{UPSTREAM_A_V4, UPSTREAM_B_V4};
    let mut harness = Harness::standard(tools!())?;
    let (a, b) = (
        std::net::IpAddr::V4(UPSTREAM_A_V4),
        std::net::IpAddr::V4(UPSTREAM_B_V4),
    );
    harness.set_mode(NODE_ID, redirector_common::settings::Mode::Upstream)?;
    harness.wait_for_route(NODE_ID, "upstream")?;
    assert_eq!(node_pool(&harness)?, [a, b]);

    harness.sandbox.stop_server("upstream B")?;
    let killed = now_ms();
    harness.wait_until("B leaves the pool", Duration::from_secs(5), |harness| {
        Ok(node_pool(harness)? == [a])
    })?;
    println!("B out of the pool {} ms after its death", now_ms() - killed);
    for _ in 0..20 {
        assert_eq!(answered_by(&harness.sandbox)?, "upstream A");
    }

    harness.sandbox.start_upstream_b()?;
    harness.wait_until("B returns to the pool", Duration::from_secs(5), |harness| {
        Ok(node_pool(harness)? == [a, b])
    })?;

    harness.sandbox.stop_server("upstream A")?;
    harness.sandbox.stop_server("upstream B")?;
    // Long enough for both to fail their checks several times over.
    pause(2000);
    assert_eq!(
        node_pool(&harness)?,
        [a, b],
        "a pool is never emptied for its checks"
    );
    harness.sandbox.start_upstream_a()?;
    harness.wait_until("the answering A alone", Duration::from_secs(5), |harness| {
        Ok(node_pool(harness)? == [a])
    })?;
    Ok(())
}

/// The node listener's checks of its upstream targets so far that were answered (`true`) or not.
fn node_checks(harness: &Harness, answered: bool) -> u64 {
    harness
        .agent
        .stats
        .upstream_checks()
        .into_iter()
        .filter(|(listener, ok, _)| listener == "node" && *ok == answered)
        .map(|(_, _, count)| count)
        .sum()
}

/// Slow is not dead: upstream B answers every query 300 ms late, later than the cache probe's
/// timeout (200 ms here), as a kube-dns pod slowed by a fleet's failover does, and stays in the
/// kernel's pool round after round; upstream A, bound but answering nothing (hung: no ICMP
/// refusal, each check waited out), leaves it.
#[test]
fn a_slow_upstream_stays_in_the_pool_while_a_hung_one_leaves() -> anyhow::Result<()> {
    use bpf_tests::topology::{UPSTREAM_A_V4, UPSTREAM_B_V4};
    let slow_ms = paced_ms(300).to_string();
    let mut harness = Harness::start(
        tools!(),
        |sandbox| {
            sandbox.start_cache("cache", &CacheSpec::standard())?;
            // Silent for far longer than the test.
            sandbox.start_upstream_a_with(&["--mute-ms", "600000"])?;
            // Each of four sockets answers late: checks from fresh sockets are spread over
            // them, not queued behind one another's delay.
            sandbox.start_upstream_b_with(&["--answer-delay-ms", &slow_ms, "--udp-sockets", "4"])
        },
        standard_listeners,
    )?;
    let (a, b) = (
        std::net::IpAddr::V4(UPSTREAM_A_V4),
        std::net::IpAddr::V4(UPSTREAM_B_V4),
    );
    assert_eq!(node_pool(&harness)?, [a, b]);
    harness.set_mode(NODE_ID, redirector_common::settings::Mode::Upstream)?;
    harness.wait_for_route(NODE_ID, "upstream")?;
    let failed_over = now_ms();
    // A pool whose every target failed would keep both: [B] alone says B passes its checks.
    harness.wait_until(
        "the hung A leaves the pool",
        Duration::from_secs(10),
        |harness| Ok(node_pool(harness)? == [b]),
    )?;
    println!(
        "A out of the pool {} ms after the failover",
        now_ms() - failed_over
    );

    let answered_before = node_checks(&harness, true);
    // Six rounds of checks on average, each of B's answered 300 ms late.
    for _ in 0..30 {
        pause(100);
        assert_eq!(
            node_pool(&harness)?,
            [b],
            "the slow B stays in the pool and the hung A stays out"
        );
    }
    let answered = node_checks(&harness, true) - answered_before;
    println!(
        "B answered {answered} checks in 3 s; {} checks unanswered in all",
        node_checks(&harness, false)
    );
    assert!(answered >= 3, "{answered} of B's checks answered in 3 s");
    let states = harness.agent.stats.upstream_states();
    let up = |target: std::net::IpAddr| {
        states
            .iter()
            .find(|(listener, address, _)| listener == "node" && address == &format!("{target}:53"))
            .map(|(_, _, up)| *up)
    };
    assert_eq!((up(a), up(b)), (Some(false), Some(true)), "{states:?}");
    assert_eq!(answered_by(&harness.sandbox)?, "upstream B");
    Ok(())
}

/// Restarts of a cache, each in a new cgroup (as a kubelet restarts a container), while no agent
/// runs: the programs record every life's process (`post_bind`), 300 of them, far more than the
/// kernel's exempt set holds. An agent started then, as shipped, forgets the lives whose cgroups
/// are gone (a process lives only in a cgroup that exists), writes an exempt set of the caches
/// that live, and so starts, steers to the cache, fails over at its kill -9 and fails back at its
/// next life. Before, every start failed writing `WORKLOAD_EXEMPT` (E2BIG).
#[test]
fn three_hundred_cache_restarts_in_new_cgroups_never_stop_an_agent_start() -> anyhow::Result<()> {
    const RESTARTS: usize = 300;
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_upstreams()?;
    // The programs attached and pinned; then no agent while the cache restarts.
    let (config, mut agent) = shipped::start_agent_on(&sandbox, &standard_listeners(&sandbox))?;
    stop_agent(&mut agent)?;
    let node = dns(NODE_LISTENER);
    let life = |sandbox: &mut Sandbox, index: usize| -> anyhow::Result<TestCgroup> {
        let cgroup = sandbox.skipped_cgroup().child(&format!("life-{index}"))?;
        start_cache_in(sandbox, CacheKind::Dnsmasq, "cache", node, cgroup.path())?;
        Ok(cgroup)
    };
    for index in 0..RESTARTS {
        let cgroup = life(&mut sandbox, index)?;
        sandbox.stop_server("cache")?;
        // Removed once its process is gone, as the runtime removes a container's.
        drop(cgroup);
    }
    let recorded = Maps::open_pinned(&sandbox.pin_dir())?.known_cache_tasks();
    assert!(
        recorded.len() >= MAX_EXEMPT_CGROUPS,
        "the programs recorded {} of the {RESTARTS} lives: no more than the exempt set holds",
        recorded.len()
    );

    let cgroup = life(&mut sandbox, RESTARTS)?;
    let mut agent = shipped::start_agent(&sandbox, &config)?;
    wait_for_cache(&sandbox, "the agent confirms the cache's latest life")?;
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    let live_cgroup = std::fs::metadata(cgroup.path())?.ino();
    let recorded = maps.known_cache_tasks();
    assert!(
        !recorded.is_empty()
            && recorded
                .iter()
                .all(|(_, task)| task.cgroup_id == live_cgroup),
        "the record holds only the live cache: {recorded:?}"
    );
    assert!(maps.exempt_cgroups().contains(&live_cgroup));
    sandbox.stop_server("cache")?;
    assert!(
        answered_by(&sandbox)?.starts_with("upstream"),
        "failed over in the kernel"
    );
    drop(cgroup);
    let _cgroup = life(&mut sandbox, RESTARTS + 1)?;
    wait_for_cache(
        &sandbox,
        "the agent gives the cache's next life its DNS back",
    )?;
    stop_agent(&mut agent)?;
    shipped::uninstall(&sandbox, &config)?;
    Ok(())
}
