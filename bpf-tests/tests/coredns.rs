//! CoreDNS as the cache, as NodeLocal DNSCache and AKS LocalDNS run it, in the ways it differs
//! from every other cache here: Go's runtime signals its own threads all the time (SIGURG),
//! `multisocket` opens several reuseport sockets per address, and its reads go through Go's
//! netpoller under load. Its life's events (kill -9, a SIGTERM restart in lameduck, a hang, the
//! first SIGTERM of one older than the agent) run in `failover`, its drain in `drain`, an upgrade
//! under its load in `upgrade`.

use std::time::Duration;

use anyhow::Context as _;
use bpf_tests::{
    caches::{CacheKind, Corefile, start_cache},
    cli::stop_agent,
    dns::{coarse_ns, now_ms},
    harness::{Harness, NODE_ID, answered_by, standard_listeners, wait_for_cache},
    pace::{paced, paced_ms, pause},
    sandbox::{Ns, Sandbox},
    shipped,
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns},
};
use nix::sys::signal::Signal;
use redirector::datapath::Maps;
use redirector_common::{activity::FLIP_STALLED, listener::Reason, names::PROG_SIGNAL};

fn harness_with(corefile: Corefile) -> anyhow::Result<Harness> {
    Harness::start(
        tools!(),
        |sandbox| {
            start_cache(sandbox, CacheKind::CoreDns(corefile), "cache")?;
            sandbox.start_upstreams()
        },
        standard_listeners,
    )
}

/// `multisocket 4`: four UDP and four TCP reuseport sockets on the node listener's address, each
/// counted; its kill -9 flips the listener once at the SIGKILL (however many threads Go runs)
/// and once at the last UDP close. Its TCP listeners are MPTCP (Go's default since 1.24): their
/// close runs no program, and the agent's reconcile uncounts them a pass or two later.
#[test]
fn multisocket_reuseport_sockets_are_counted_one_by_one() -> anyhow::Result<()> {
    let mut harness = harness_with(Corefile::NodeLocalMultisocket(4))?;
    let sockets = harness.sockets(NODE_ID)?;
    assert_eq!((sockets.udp, sockets.tcp), (4, 4), "{sockets:?}");
    assert_eq!(answered_by(&harness.sandbox)?, "cache");
    let epoch = sockets.down_epoch;
    harness.sandbox.stop_server("cache")?;
    let sockets = harness.sockets(NODE_ID)?;
    assert_eq!(
        (sockets.udp, sockets.down_epoch),
        (0, epoch + 2),
        "{sockets:?}"
    );
    assert_eq!(harness.maps.cache_activity(NODE_ID)?.signalled, 1);
    assert!(answered_by(&harness.sandbox)?.starts_with("upstream"));
    harness.wait_until(
        "the agent uncounts the MPTCP listeners",
        Duration::from_secs(10),
        |harness| Ok(harness.sockets(NODE_ID)?.tcp == 0),
    )?;
    assert_eq!(harness.sockets(NODE_ID)?.down_epoch, epoch + 2);
    Ok(())
}

/// The signal program's runs for everything delivered on the node while it counts.
fn signal_program_runs(sandbox: &Sandbox) -> anyhow::Result<(u64, Duration)> {
    let id = redirector::datapath::pinned_program_ids(&sandbox.pin_dir())
        .into_iter()
        .find_map(|(name, id)| (name == PROG_SIGNAL).then_some(id))
        .context("the signal program is not attached")?;
    let info = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|info| info.id() == id)
        .with_context(|| format!("program {id} is not loaded"))?;
    Ok((info.run_count(), info.run_time()))
}

/// SIGURGs to CoreDNS, its own runtime's (preemption, under a query stream) and 500 more sent
/// to it, run the signal program and move nothing: every query is answered by the cache, no
/// epoch begins, no flip is recorded. The program's runs meanwhile are counted by the kernel
/// (`BPF_ENABLE_STATS`) and printed with their mean cost (docs/benchmarks.md records a run).
#[test]
fn sigurg_from_gos_runtime_moves_nothing() -> anyhow::Result<()> {
    const SENT: u64 = 500;
    let mut harness = harness_with(Corefile::NodeLocal)?;
    let epoch = harness.sockets(NODE_ID)?.down_epoch;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(harness.sandbox.process("cache")?.pid())?);
    let _accounting = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("BPF_ENABLE_STATS (kernel 5.8+)")?;
    let (runs_before, time_before) = signal_program_runs(&harness.sandbox)?;
    let stream = Stream::start_with(
        &harness.sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_secs(3)),
        &["--kinds", "fresh,connected,long", "--interval-ms", "1"],
    )?;
    for _ in 0..SENT {
        nix::sys::signal::kill(pid, Signal::SIGURG)?;
        std::thread::sleep(Duration::from_millis(4));
    }
    let report = stream.finish()?;
    let (runs_after, time_after) = signal_program_runs(&harness.sandbox)?;
    let runs = runs_after - runs_before;
    let per_run = (time_after - time_before).as_nanos() / u128::from(runs.max(1));
    println!(
        "{runs} runs of the signal program ({SENT} SIGURG sent, the rest Go's and the node's), \
         {per_run} ns each; {}",
        report.summary()
    );
    assert!(
        runs >= SENT,
        "the signal program ran {runs} times for {SENT} signals"
    );
    assert!(
        report
            .records
            .iter()
            .all(|record| StreamReport::answered_by(record) == "cache"),
        "a query did not reach CoreDNS: {}",
        report.summary()
    );
    let activity = harness.maps.cache_activity(NODE_ID)?;
    assert_eq!(activity.signalled, 0, "{activity:?}");
    assert_eq!(harness.sockets(NODE_ID)?.down_epoch, epoch);
    Ok(())
}

/// One dnsperf run from the pod to `server` for `seconds`, at `rate` queries per second (full
/// speed without), with up to 1000 queries outstanding so that a slow answer never holds the
/// offered load back: (queries per second answered, queries lost).
fn dnsperf(
    sandbox: &Sandbox,
    server: std::net::Ipv4Addr,
    seconds: u64,
    rate: Option<u64>,
) -> anyhow::Result<(f64, u64)> {
    let data = sandbox.write_file("dnsperf.txt", "probe.redirector.test A\n")?;
    let (mut command, _procs) = sandbox.client_command(Ns::Pod, sandbox.cgroup(), "dnsperf")?;
    command
        .args(["-s", &server.to_string(), "-d"])
        .arg(&data)
        .args([
            "-l",
            &seconds.to_string(),
            "-c",
            "4",
            "-q",
            "1000",
            "-t",
            "1",
        ]);
    if let Some(rate) = rate {
        command.args(["-Q", &rate.to_string()]);
    }
    let output = command.output().context("running dnsperf")?;
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    anyhow::ensure!(
        output.status.success(),
        "dnsperf failed: {printed}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let field = |label: &str| -> anyhow::Result<f64> {
        printed
            .lines()
            .find_map(|line| line.trim().strip_prefix(label))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no {label:?} in dnsperf's output:\n{printed}"))
    };
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "dnsperf prints a whole count"
    )]
    let lost = field("Queries lost:")? as u64;
    Ok((field("Queries per second:")?, lost))
}

/// CoreDNS through the listener at 100 % and at 150 % of what it answers at full speed (its queue
/// full, the kernel dropping what does not fit, its reads going on through Go's netpoller): the
/// kernel never calls it stalled, the probes never turn it down, the listener never moves.
#[test]
fn coredns_at_and_past_its_capacity_is_never_moved() -> anyhow::Result<()> {
    let harness = harness_with(Corefile::NodeLocal)?;
    let epoch = harness.sockets(NODE_ID)?.down_epoch;
    // Full speed to the listener, which CoreDNS serves itself: its capacity, through the path
    // the loads then take.
    let (capacity, _) = dnsperf(&harness.sandbox, NODE_LISTENER, 2, None)?;
    println!("CoreDNS answers {capacity:.0} queries/s at full speed");
    for share in [1.0, 1.5] {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a rate well inside u64"
        )]
        let rate = (capacity * share) as u64;
        let (answered, lost) = dnsperf(&harness.sandbox, NODE_LISTENER, 3, Some(rate))?;
        let activity = harness.maps.cache_activity(NODE_ID)?;
        println!(
            "at {:.0} % ({rate} queries/s asked): {answered:.0} answered a second, {lost} lost; \
             {activity:?}",
            share * 100.0
        );
        if share > 1.0 {
            #[expect(
                clippy::cast_precision_loss,
                reason = "a rate well inside f64's integers"
            )]
            let asked = rate as f64;
            assert!(
                lost > 0 || answered < asked * 0.95,
                "CoreDNS kept up with {rate} queries/s: the load was not past its capacity"
            );
        }
        assert_eq!(
            activity.stalled, 0,
            "a false stall at {share}: {activity:?}"
        );
        assert_eq!(
            harness.sockets(NODE_ID)?.down_epoch,
            epoch,
            "the listener moved at {share} of the capacity"
        );
    }
    pause(500);
    let transitions = harness.agent.stats.transitions("node");
    assert!(
        transitions.iter().all(|t| t.reason == Reason::Healthy),
        "the probes turned CoreDNS down under load: {transitions:?}"
    );
    assert_eq!(answered_by(&harness.sandbox)?, "cache");
    Ok(())
}

/// Rounds of [`a_serving_coredns_is_moved_only_at_its_hang_with_no_agent`].
const HANG_ROUNDS: usize = 5;

/// What one round saw.
#[derive(Debug)]
struct HangRound {
    /// A move while CoreDNS served (a stall flip, a new epoch, a query answered by an
    /// upstream or not at all before the hang): what it was.
    false_move: Option<String>,
    /// From the SIGSTOP to the kernel's stall flip, ns (negative: a flip stamped before it),
    /// when the hang flipped the listener.
    moved_after_ns: Option<i128>,
}

/// Issue 47, item 3: CoreDNS in NodeLocal's Corefile shape, in the attach cgroup, answering a
/// query every ms from fresh sockets and kept ones (unconnected and connected, none waiting for
/// the last answer), with the agent stopped after it confirmed the cache (an agent's upgrade, a
/// crash loop): the kernel alone judges it. Its reads, from whichever of Go's threads makes
/// them, must answer the stamps of the queries it is handed: for 1.5 s of load nothing moves
/// (no stall flip, no new epoch, every query done before the hang answered by CoreDNS); then
/// CoreDNS hangs (SIGSTOP), and the kernel moves the listener within 100 ms of the signal, on
/// its own clock (`flip_ns` against `CLOCK_MONOTONIC_COARSE` read just before the SIGSTOP; the
/// bound stretched with the machine's pace, as the stall limit is). SIGCONT, and the next
/// round's agent confirms the resumed cache. Every round runs; they are judged together.
#[test]
fn a_serving_coredns_is_moved_only_at_its_hang_with_no_agent() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    start_cache(
        &mut sandbox,
        CacheKind::CoreDns(Corefile::NodeLocal),
        "cache",
    )?;
    sandbox.start_upstreams()?;
    // The agent as shipped sets the node up (`shipped`), then stops: what follows is the kernel's.
    let (config, mut agent) = shipped::start_agent_on(&sandbox, &standard_listeners(&sandbox))?;
    let limit_ns = i128::from(paced_ms(100)) * 1_000_000;
    let mut rounds = Vec::new();
    for round in 0..HANG_ROUNDS {
        if round > 0 {
            agent = shipped::start_agent(&sandbox, &config)?;
        }
        wait_for_cache(&sandbox, "the agent confirms CoreDNS")?;
        stop_agent(&mut agent)?;
        let maps = Maps::open_pinned(&sandbox.pin_dir())?;
        let before = maps.cache_activity(NODE_ID)?;
        let epoch = maps.socket_counts(NODE_ID)?.down_epoch;

        let load_ns = coarse_ns()?;
        let stream = Stream::open_loop(
            &sandbox,
            dns(NODE_LISTENER),
            paced(Duration::from_millis(2500)),
            paced_ms(1),
        )?;
        pause(1500);
        let loaded = maps.cache_activity(NODE_ID)?;
        let loaded_epoch = maps.socket_counts(NODE_ID)?.down_epoch;
        let stopped_ms = now_ms();
        let stopped_ns = coarse_ns()?;
        sandbox.process("cache")?.signal(Signal::SIGSTOP)?;
        pause(500);
        let hung = maps.cache_activity(NODE_ID)?;
        let hung_epoch = maps.socket_counts(NODE_ID)?.down_epoch;
        sandbox.process("cache")?.signal(Signal::SIGCONT)?;
        let report = stream.finish()?;

        let false_move = if loaded.stalled != before.stalled || loaded_epoch != epoch {
            Some(format!(
                "moved under load (epoch {epoch} -> {loaded_epoch}), {} ms into it: {loaded:?}",
                (i128::from(loaded.flip_ns) - i128::from(load_ns)) / 1_000_000
            ))
        } else {
            report
                .records
                .iter()
                .find(|record| {
                    record.done_ms < stopped_ms && StreamReport::answered_by(record) != "cache"
                })
                .map(|record| format!("a query done before the hang: {record:?}"))
        };
        let moved_after_ns = (hung.stalled > loaded.stalled
            && hung_epoch > loaded_epoch
            && hung.flip_reason == FLIP_STALLED)
            .then(|| i128::from(hung.flip_ns) - i128::from(stopped_ns));
        println!(
            "round {round}: moved while serving: {false_move:?}; the hang moved {:?} ms after \
             the SIGSTOP; {}",
            moved_after_ns.map(|ns| ns / 1_000_000),
            report.summary().lines().next().unwrap_or_default()
        );
        rounds.push(HangRound {
            false_move,
            moved_after_ns,
        });
    }
    let mut agent = shipped::start_agent(&sandbox, &config)?;
    wait_for_cache(&sandbox, "the agent confirms CoreDNS")?;
    stop_agent(&mut agent)?;
    shipped::uninstall(&sandbox, &config)?;
    assert!(
        rounds.iter().all(|round| round.false_move.is_none()),
        "CoreDNS was moved while it served: {rounds:#?}"
    );
    assert!(
        rounds.iter().all(|round| round
            .moved_after_ns
            .is_some_and(|ns| (0..=limit_ns).contains(&ns))),
        "a hang not moved within {} ms of its SIGSTOP: {rounds:#?}",
        limit_ns / 1_000_000
    );
    Ok(())
}
