//! A hung cache is seen in the kernel, from its own traffic (#28): the programs note every query
//! handed to the cache and every read it makes, and a cache that leaves a query unread past its
//! limit (`probe.stall_after_ms`) has its listener moved upstream by the next query, with no agent
//! running. A cache that keeps reading, however far behind, is never moved; nor is one whose
//! reads the programs cannot see.

use std::time::Duration;

use bpf_tests::{
    cli::{start_agent, stop_agent, uninstall},
    dns::now_ms,
    harness::{NODE_ID, agent_serving_from_cache, node_reason, wait_for_cache},
    pace::{paced_ms, pause},
    sandbox::{CacheSpec, Ns, Query, Sandbox, Transport},
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns, who},
};
use nix::sys::signal::Signal;
use redirector::datapath::Maps;
use redirector_common::activity::{CacheActivity, FLIP_STALLED};

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
        Duration::from_secs(120),
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
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = serving_without_agent(&mut sandbox)?;
    let (_, epoch, _) = node_state(&sandbox)?;

    let (stream, stopped) = stream_then_hang(&mut sandbox, NODE_LISTENER)?;
    let (activity, hung_epoch, hung_reason) = node_state(&sandbox)?;
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

    // The next agent's probes confirm the cache and give it its DNS back.
    let agent = start_agent(&config)?;
    wait_for_cache(&sandbox, "the agent fails back to the resumed cache")?;
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// A cache that answers each query 4 ms after reading it, one at a time, sent 3 queries a ms (12
/// times what it can answer) from fresh, connected and long-lived sockets: its queue stays full
/// (the kernel drops what does not fit) for as long as the load lasts, and it never stops
/// reading. It is never moved.
#[test]
fn a_saturated_cache_that_keeps_reading_is_never_moved() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    let mut cache = CacheSpec::standard();
    cache
        .extra_args
        .extend(["--answer-delay-ms".to_owned(), "4".to_owned()]);
    sandbox.start_cache("cache", &cache)?;
    sandbox.start_upstreams()?;
    let config = serving_without_agent(&mut sandbox)?;
    let (_, epoch, _) = node_state(&sandbox)?;

    let stream = Stream::open_loop(&sandbox, dns(NODE_LISTENER), Duration::from_secs(3), 1)?;
    let report = stream.finish()?;
    let (activity, after, reason) = node_state(&sandbox)?;
    println!("{}", report.summary());
    assert!(
        report.records.len() > 2000,
        "too little load to saturate the cache: {}",
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
        Duration::from_secs(2),
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
    bpf_tests::pace::wait_until(
        "the agent confirms the cache for the moved listener",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let query = Query::new(dns(MOVED_LISTENER), Transport::Udp);
            Ok(who(sandbox.query(Ns::Pod, query)?.answer()) == "cache")
        },
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
