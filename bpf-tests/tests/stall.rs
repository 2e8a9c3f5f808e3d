//! A hung cache is seen in the kernel, from its own traffic (#28): the programs note every query
//! handed to the cache and every read it makes, and a cache that leaves a query unread past its
//! limit (`probe.stall_after_ms`) has its listener moved upstream by the next query, with no agent
//! running. A cache that keeps reading, however far behind, is never moved; nor is one whose
//! reads the programs cannot see.

use std::time::Duration;

use bpf_tests::{
    cli::{start_agent, start_agent_with, stop_agent, uninstall},
    dns::{coarse_ns, now_ms},
    harness::{
        NODE_ID, agent_serving_from_cache, node_reason, wait_for_cache, wait_for_cache_at,
        write_standard_config,
    },
    pace::{paced, paced_ms, pause},
    sandbox::{CacheSpec, Ns, Sandbox},
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns},
};
use nix::sys::signal::Signal;
use redirector::{datapath::Maps, sys::kernel_support};
use redirector_common::{
    activity::{CacheActivity, FLIP_STALLED},
    names,
};

/// The node listener's activity and epoch, and its reason as `status` gives it.
fn node_state(sandbox: &Sandbox) -> anyhow::Result<(CacheActivity, u64, &'static str)> {
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    Ok((
        maps.cache_activity(NODE_ID)?,
        maps.socket_counts(NODE_ID)?.down_epoch,
        node_reason(sandbox)?,
    ))
}

/// Starts the agent on the standard sandbox, waits for the cache to serve, and stops the agent:
/// what follows is the kernel's alone.
fn serving_without_agent(sandbox: &mut Sandbox) -> anyhow::Result<std::path::PathBuf> {
    let (config, mut agent) = agent_serving_from_cache(sandbox)?;
    stop_agent(&mut agent)?;
    Ok(config)
}

/// Starts a query every 2 ms from each socket kind to `listener` (stretched in a slower VM), none
/// waiting for the last one's answer, so a flip shows within a few ms of the query that made it;
/// hangs the cache (SIGSTOP) half a second in, and leaves it hung for 1.5 s. Returns the stream
/// and when the hang began.
fn stream_then_hang(
    sandbox: &mut Sandbox,
    listener: std::net::Ipv4Addr,
) -> anyhow::Result<(Stream, u64)> {
    let stream = Stream::open_loop(
        sandbox,
        dns(listener),
        paced(Duration::from_secs(120)),
        paced_ms(2),
    )?;
    pause(500);
    let stopped = now_ms();
    sandbox.process("cache")?.signal(Signal::SIGSTOP)?;
    pause(1500);
    Ok((stream, stopped))
}

#[test]
fn a_hung_cache_is_moved_upstream_by_the_kernel_with_no_agent() -> anyhow::Result<()> {
    hung_cache_moved_with_no_agent(&[])
}

/// Where the agent could not measure the kernel's tick, the programs stamp with the coarse clock
/// helper, and a hang is seen all the same. The measurement's absence is forced
/// (`REDIRECTOR_TEST_ABSENT_FEATURES`): every kernel the tests boot can run it.
#[test]
fn without_a_measured_tick_a_hung_cache_is_moved_on_the_coarse_clock() -> anyhow::Result<()> {
    hung_cache_moved_with_no_agent(&[kernel_support::TICK_TEST_RUN])
}

/// A cache hung (SIGSTOP) while no agent runs is moved upstream by the next query, stays
/// upstream after it resumes until an agent confirms it, and the flip's record is on the coarse
/// monotonic clock whichever way the programs read it (`absent`: the features the agent that set
/// the node up is told the kernel lacks).
fn hung_cache_moved_with_no_agent(absent: &[&str]) -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let absent = absent.join(",");
    let env = [(
        kernel_support::ABSENT_FOR_TESTS_VARIABLE,
        std::ffi::OsStr::new(&absent),
    )];
    let mut agent = start_agent_with(&config, &[], &env)?;
    wait_for_cache(&sandbox, "the agent confirms the cache")?;
    stop_agent(&mut agent)?;
    let timing = Maps::open_pinned(&sandbox.pin_dir())?.stall_timing(NODE_ID)?;
    let tick_lines: Vec<String> = agent
        .printed()
        .iter()
        .filter(|line| line.contains("tick"))
        .cloned()
        .collect();
    println!("stall timing: {timing:?}; the agent said: {tick_lines:?}");
    if absent.is_empty() {
        assert!(
            [1_000_000, 3_333_333, 4_000_000, 10_000_000].contains(&timing.tick_ns),
            "the agent measured no tick of any CONFIG_HZ: {timing:?}, {tick_lines:?}"
        );
        assert!(
            tick_lines
                .iter()
                .any(|line| line.contains("measured the kernel's tick")),
            "{tick_lines:?}"
        );
    } else {
        assert_eq!(timing.tick_ns, 0, "a tick was measured: {timing:?}");
    }
    let (_, epoch, _) = node_state(&sandbox)?;

    let before_hang = coarse_ns()?;
    let (stream, stopped) = stream_then_hang(&mut sandbox, NODE_LISTENER)?;
    let (activity, hung_epoch, hung_reason) = node_state(&sandbox)?;
    let after_flip = coarse_ns()?;
    let resumed = now_ms();
    sandbox.process("cache")?.signal(Signal::SIGCONT)?;
    let report = stream.stop_once("queries after SIGCONT", Duration::from_secs(20), |report| {
        report.between(resumed + 200, u64::MAX).count() > 100
    })?;

    let flipped_by = report
        .flipped_by(stopped)
        .unwrap_or_else(|| panic!("no upstream answer after the hang: {}", report.summary()));
    let last_cache = report
        .last_cache_answer(resumed)
        .map(|record| record.begun_ms);
    println!(
        "hang at +{} ms, flipped by +{} ms (last query the cache answered begun at +{:?} ms): {}",
        stopped - report.started_ms(),
        flipped_by - report.started_ms(),
        last_cache.map(|at| at.saturating_sub(report.started_ms())),
        report.summary()
    );
    assert!(
        flipped_by < resumed,
        "the kernel did not move the hung cache's DNS: {}",
        report.summary()
    );
    assert_eq!(
        report.failures_after_flip(flipped_by),
        0,
        "queries failed after the flip: {}",
        report.summary()
    );
    // With no agent, nothing confirms the resumed cache: its DNS stays upstream, and says why.
    for record in report.between(resumed, u64::MAX) {
        assert!(
            StreamReport::answered_by(record).starts_with("upstream"),
            "a query after SIGCONT went to the unconfirmed cache: {}",
            report.summary()
        );
    }
    assert!(hung_epoch > epoch, "no new epoch for the stall");
    assert_eq!(activity.flip_reason, FLIP_STALLED, "{activity:?}");
    assert_eq!(activity.flip_epoch, hung_epoch, "{activity:?}");
    assert!(activity.stalled >= 1, "{activity:?}");
    assert_eq!(hung_reason, "stalled");
    // The stamps mean coarse monotonic ns: the flip is recorded between the hang and now (to a
    // tick, 10 ms at the coarsest `CONFIG_HZ`).
    let tick = 10_000_000;
    assert!(
        (before_hang.saturating_sub(tick)..=after_flip + tick).contains(&activity.flip_ns),
        "the flip's time {} is not between {before_hang} and {after_flip}: {activity:?}",
        activity.flip_ns
    );

    // The next agent's probes confirm the cache and give it its DNS back. It keeps the tick the
    // first measured (once a boot: a start spends no 100 ms on it again), or measures it where
    // the first could not.
    let mut agent = start_agent(&config)?;
    wait_for_cache(&sandbox, "the agent fails back to the resumed cache")?;
    let measured = agent
        .printed()
        .iter()
        .any(|line| line.contains("measured the kernel's tick"));
    let later = Maps::open_pinned(&sandbox.pin_dir())?.stall_timing(NODE_ID)?;
    if absent.is_empty() {
        assert!(!measured, "a later start measured the tick again");
        assert_eq!(later, timing, "a later start changed the stamps' clock");
    } else {
        assert!(measured && later.tick_ns != 0, "{later:?}");
    }
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// A cache that answers each query 4 ms after reading it, one at a time, offered up to 3 queries a
/// ms (12 times what it can answer) from fresh, connected and long-lived sockets: its queue stays
/// full (the kernel drops what does not fit) for as long as the load lasts, and it never stops
/// reading. It is never moved. A slowed machine offers less (the client skips the sends it falls
/// behind on), so the test asks for what saturation means, not for a rate: more queries than the
/// cache can answer in the time, and some of them dropped.
#[test]
fn a_saturated_cache_that_keeps_reading_is_never_moved() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    const ANSWER_DELAY: Duration = Duration::from_millis(4);
    const LOAD: Duration = Duration::from_secs(3);
    let mut cache = CacheSpec::standard();
    cache.extra_args.extend([
        "--answer-delay-ms".to_owned(),
        ANSWER_DELAY.as_millis().to_string(),
    ]);
    sandbox.start_cache("cache", &cache)?;
    sandbox.start_upstreams()?;
    let config = serving_without_agent(&mut sandbox)?;
    let (_, epoch, _) = node_state(&sandbox)?;

    let stream = Stream::open_loop(&sandbox, dns(NODE_LISTENER), LOAD, 1)?;
    let report = stream.finish()?;
    let (activity, after, reason) = node_state(&sandbox)?;
    println!("{}", report.summary());
    // One answer per delay at best: 750 in the 3 s.
    let capacity = LOAD.as_millis() / ANSWER_DELAY.as_millis();
    assert!(
        report.records.len() as u128 > capacity,
        "too little load to saturate the cache (it can answer {capacity}): {}",
        report.summary()
    );
    assert!(activity.last_read_ns != 0, "the cache's reads went unseen");
    assert_eq!(activity.stalled, 0, "{activity:?}");
    assert_eq!(after, epoch, "the saturated cache was moved");
    assert_eq!(reason, "healthy");
    assert!(
        report
            .records
            .iter()
            .all(|record| !StreamReport::answered_by(record).starts_with("upstream")),
        "a query of the saturated cache went upstream: {}",
        report.summary()
    );
    assert!(
        report.records.iter().any(|record| record.error.is_some()),
        "the cache was not saturated (nothing was dropped): {}",
        report.summary()
    );
    uninstall(&config)?;
    Ok(())
}

/// A cache outside the attach cgroup (its reads never reach the programs) that hangs is left to
/// the probes: the kernel never calls it stalled on queries it cannot see read.
#[test]
fn a_cache_whose_reads_are_unseen_is_never_called_stalled() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    let cache = CacheSpec::standard();
    sandbox.start_cache_outside_attach("cache", &cache)?;
    sandbox.start_upstreams()?;
    let config = serving_without_agent(&mut sandbox)?;
    let (_, epoch, _) = node_state(&sandbox)?;

    let stream = Stream::start_with(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_secs(2)),
        &["--kinds", "fresh,long"],
    )?;
    pause(300);
    sandbox.process("cache")?.signal(Signal::SIGSTOP)?;
    pause(600);
    let (activity, after, reason) = node_state(&sandbox)?;
    sandbox.process("cache")?.signal(Signal::SIGCONT)?;
    let report = stream.finish()?;
    println!("{activity:?} {}", report.summary());
    assert_eq!(activity.last_read_ns, 0, "a read was seen: {activity:?}");
    assert_eq!(activity.stalled, 0, "{activity:?}");
    assert_eq!(
        after, epoch,
        "the kernel moved a cache whose reads it cannot see"
    );
    assert_eq!(reason, "healthy");
    uninstall(&config)?;
    Ok(())
}

/// A listener in the test's own range whose cache is the node listener's address.
const MOVED_LISTENER: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 18, 3, 10);

/// A new configuration gives the cache's socket to another listener (`moved`, with the cache at
/// the node listener's address; `node` now expects its cache on a port nothing serves). The
/// socket's reads were credited to `node` until then (its socket-local `CACHE_READERS` copy):
/// after the agent's start and its reconcile move the socket, they must be credited to `moved`,
/// or a hang of the cache would never be seen for it.
#[test]
fn a_cache_socket_given_to_another_listener_is_watched_for_it() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    serving_without_agent(&mut sandbox)?;
    let (before, _, _) = node_state(&sandbox)?;
    assert!(
        before.last_read_ns != 0,
        "the cache's reads went unseen: {before:?}"
    );

    let listeners = format!(
        r#"
[[listener]]
name = "node"
address = "{NODE_LISTENER}"
cache = "{NODE_LISTENER}:5353"
upstreams = ["198.18.2.2", "198.18.2.3:53"]
skip_cgroups = [{skipped:?}]

[[listener]]
name = "moved"
address = "{MOVED_LISTENER}"
cache = "{NODE_LISTENER}:53"
upstreams = ["198.18.2.2", "198.18.2.3:53"]
"#,
        skipped = sandbox.skipped_cgroup().path().display().to_string()
    );
    let config = sandbox.write_file("moved.toml", &sandbox.config_toml(&listeners))?;
    let mut agent = start_agent(&config)?;
    wait_for_cache_at(
        &sandbox,
        Ns::Pod,
        MOVED_LISTENER.into(),
        "the agent confirms the cache for the moved listener",
    )?;
    stop_agent(&mut agent)?;
    let moved_id = Maps::open_pinned(&sandbox.pin_dir())?
        .listener_named("moved")?
        .0;
    assert_ne!(moved_id, NODE_ID);

    let (stream, stopped) = stream_then_hang(&mut sandbox, MOVED_LISTENER)?;
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    let activity = maps.cache_activity(moved_id)?;
    let resumed = now_ms();
    sandbox.process("cache")?.signal(Signal::SIGCONT)?;
    let report = stream.stop_once("queries after SIGCONT", Duration::from_secs(20), |report| {
        report.between(resumed + 100, u64::MAX).count() > 20
    })?;
    println!("{activity:?} {}", report.summary());
    assert!(
        activity.last_read_ns != 0,
        "no read credited to the moved listener: {activity:?}"
    );
    assert_eq!(activity.flip_reason, FLIP_STALLED, "{activity:?}");
    assert!(activity.stalled >= 1, "{activity:?}");
    let flipped_by = report
        .flipped_by(stopped)
        .unwrap_or_else(|| panic!("no upstream answer after the hang: {}", report.summary()));
    assert!(
        flipped_by < resumed,
        "the kernel did not move the hung cache's DNS: {}",
        report.summary()
    );
    uninstall(&config)?;
    Ok(())
}

/// Programs of a release before `CACHE_PENDING` leave a stamp their cache has not read yet; the
/// next release's programs tell the cache's reads to look only where a bit asks them to. The
/// agent asks for every cache's next read at each start, so that stamp is answered by the
/// cache's next read (the agent's own first probes) and never taken for a stall. Here the
/// earlier programs' state is made by hand: a query stamped unread a second ago, no bit set.
#[test]
fn a_stamp_left_by_earlier_programs_is_answered_not_taken_for_a_stall() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = serving_without_agent(&mut sandbox)?;
    let mut activity = sandbox.pinned_array::<CacheActivity>(names::MAP_CACHE_ACTIVITY)?;
    let mut pending = sandbox.pinned_array::<u64>(names::MAP_CACHE_PENDING)?;
    let (_, epoch, _) = node_state(&sandbox)?;
    let now = coarse_ns()?;
    let mut left = activity.get(&NODE_ID, 0)?;
    left.last_read_ns = now - 2_000_000_000;
    left.first_unread_ns = now - 1_000_000_000;
    activity.set(NODE_ID, left, 0)?;
    pending.set(0, 0, 0)?;

    let mut agent = start_agent(&config)?;
    let stream = Stream::open_loop(&sandbox, dns(NODE_LISTENER), Duration::from_secs(1), 1)?;
    let report = stream.finish()?;
    let (after, after_epoch, reason) = node_state(&sandbox)?;
    println!("{after:?} {}", report.summary());
    assert_eq!(after.stalled, 0, "the earlier stamp was taken for a stall");
    assert_eq!(after_epoch, epoch, "the listener was moved");
    assert_eq!(reason, "healthy");
    assert!(
        after.last_read_ns > now,
        "the cache's reads since did not answer the stamp: {after:?}"
    );
    stop_agent(&mut agent)?;
    uninstall(&config)?;
    Ok(())
}

/// The node's firewall drops every DNS datagram from the pod on its way in (as a NetworkPolicy
/// that allows DNS only to the kube-dns pods drops the queries the programs steered to the
/// cache, or a host firewall does): in the node's namespace, made by the test, never the
/// machine's.
const DROP_POD_DNS: &str = r#"
table inet redirector_test_drop {
    chain input {
        type filter hook input priority -10; policy accept;
        ip saddr 198.18.1.2 udp dport 53 drop
        ip6 saddr fd00:1::2 udp dport 53 drop
    }
}
"#;

/// A pod whose queries to the cache are dropped before they reach it (`DROP_POD_DNS`) sends
/// from fresh and kept sockets every 5 ms, beside a host-network client that asks once every
/// 300 ms (more than the stall limit apart): the cache never had those queries to read, so they
/// never count as unread. First with no agent (an upgrade window, a crash loop), then with one
/// (whose probes every 250 ms would race the limit): the listener is never moved, and every
/// query of the quiet client is answered by the cache.
#[test]
fn queries_dropped_before_the_cache_never_count_as_unread() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = serving_without_agent(&mut sandbox)?;
    sandbox.netns(Ns::Node).run("nft", &[DROP_POD_DNS])?;

    quiet_client_beside_dropped_pod(&sandbox, "with no agent")?;
    let mut agent = start_agent(&config)?;
    // From the node: the pod's queries are dropped.
    wait_for_cache_at(
        &sandbox,
        Ns::Node,
        NODE_LISTENER.into(),
        "the agent confirms the cache",
    )?;
    quiet_client_beside_dropped_pod(&sandbox, "with the agent")?;
    stop_agent(&mut agent)?;
    uninstall(&config)?;
    Ok(())
}

/// Runs the dropped pod and the quiet client for 4 s (`when`, for messages), and asserts that
/// nothing was moved.
fn quiet_client_beside_dropped_pod(sandbox: &Sandbox, when: &str) -> anyhow::Result<()> {
    const LENGTH: Duration = Duration::from_secs(4);
    let (before, epoch, _) = node_state(sandbox)?;
    let dropped = Stream::start_with(
        sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        LENGTH,
        &[
            "--kinds",
            "fresh,long",
            "--open-loop",
            "--interval-ms",
            &paced_ms(5).to_string(),
        ],
    )?;
    let quiet = Stream::start_with(
        sandbox,
        Ns::Node,
        dns(NODE_LISTENER),
        LENGTH,
        &["--kinds", "fresh,long", "--interval-ms", "300"],
    )?;
    let quiet = quiet.finish()?;
    let dropped = dropped.finish()?;
    let (after, after_epoch, reason) = node_state(sandbox)?;
    let count = |who: &str| {
        dropped
            .records
            .iter()
            .filter(|record| StreamReport::answered_by(record).starts_with(who))
            .count()
    };
    let (answered, from_cache) = (dropped.records.len() - count("failed"), count("cache"));
    println!(
        "{when}: the dropped pod sent {} queries, {answered} answered; the quiet client: {}; {after:?}",
        dropped.records.len(),
        quiet.summary()
    );
    // The premise: none of the pod's queries reached the cache (after a false flip, they are
    // answered upstream).
    assert!(
        dropped.records.len() > 100 && from_cache == 0,
        "{when}: the pod's queries reached the cache: {} sent, {from_cache} answered by it",
        dropped.records.len()
    );
    assert!(
        quiet.records.len() >= 10,
        "{when}: too few quiet queries: {}",
        quiet.summary()
    );
    for record in &quiet.records {
        assert_eq!(
            StreamReport::answered_by(record),
            "cache",
            "{when}: a quiet query was not the healthy cache's: {}",
            quiet.summary()
        );
    }
    assert_eq!(
        answered, 0,
        "{when}: the pod's queries were moved off the cache"
    );
    assert_eq!(
        after.stalled, before.stalled,
        "{when}: dropped queries were taken for a stall: {after:?}"
    );
    assert_eq!(after_epoch, epoch, "{when}: the listener was moved");
    assert_eq!(reason, "healthy", "{when}");
    Ok(())
}
