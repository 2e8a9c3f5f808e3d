//! Drains for planned work on a cache (#28): `redirector drain --listener NAME --wait` moves the
//! listener upstream, waits until the cache has read what it was handed, and returns; the cache
//! can then be stopped without losing a query, and its next life, confirmed by the probes, gets
//! the DNS back. Without `--wait` it returns at once; `--cancel` ends a drain. A cache's pod asks
//! the agent over its drain socket; on the node the CLI uses the pins itself.

use std::time::Duration;

use anyhow::Context as _;

use bpf_tests::{
    cli::{CliOutput, redirector, set_state, uninstall},
    dns::now_ms,
    harness::{NODE_ID, agent_serving_from_cache, answered_by, node_reason, wait_for_cache},
    pace::{paced_ms, pause},
    sandbox::{CacheSpec, Sandbox},
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns},
};
use nix::sys::signal::Signal;
use redirector::datapath::Maps;
use redirector_common::{activity::FLIP_DRAINED, stale::DRAIN_GRACE_NS};

/// How `redirector drain` reaches the state.
enum Via<'a> {
    /// The pinned maps, as on the node (the configuration says where).
    Pins(&'a std::path::Path),
    /// The agent's drain socket, as from a cache's pod.
    Socket(&'a std::path::Path),
}

fn drain(via: &Via<'_>, extra: &[&str]) -> anyhow::Result<CliOutput> {
    let (flag, path) = match via {
        Via::Pins(config) => ("--config", config.display().to_string()),
        Via::Socket(socket) => ("--socket", socket.display().to_string()),
    };
    let mut args = vec!["drain", "--listener", "node", flag, &path];
    args.extend_from_slice(extra);
    let output = redirector(&args)?;
    anyhow::ensure!(output.code == 0, "drain failed: {output:?}");
    Ok(output)
}

/// The planned restart: drain and wait, stop the cache (SIGKILL: once drained, it may end any
/// way), start its next life. Nothing is lost, from before the drain to after the failback, and
/// the drained cache gets no query even though it answers its probes throughout.
#[test]
fn drain_and_wait_then_a_restart_loses_nothing() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let (config, mut agent) = agent_serving_from_cache(&sandbox)?;
    // A query every 2 ms from each socket kind (stretched in a slower VM, whose servers cannot
    // answer as many), none waiting for the last one's answer.
    let stream = Stream::open_loop(
        &sandbox,
        dns(NODE_LISTENER),
        Duration::from_secs(120),
        paced_ms(2),
    )?;
    pause(500);
    let drained = now_ms();
    // Asked over the agent's socket, as a cache's preStop hook does: a root-only socket.
    let socket = sandbox.drain_socket();
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&socket)?.permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the drain socket is open to others: {mode:o}");
    }
    let output = drain(&Via::Socket(&socket), &["--wait"])?;
    let waited = now_ms();
    println!("{}", output.stdout);
    // The wait outlasts the drain's grace, in which the kept socket may still send there.
    let quiet_after_ms: u64 = output
        .stdout
        .split("handed, seen after ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|ms| ms.parse().ok())
        .with_context(|| format!("no wait in the drain's output: {output:?}"))?;
    assert!(
        u128::from(quiet_after_ms) >= Duration::from_nanos(DRAIN_GRACE_NS).as_millis(),
        "the wait found the cache quiet inside the drain's grace: {output:?}"
    );
    // The probes answer, and still the drain holds.
    pause(1000);
    assert_eq!(node_reason(&sandbox)?, "drained");
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    let activity = maps.cache_activity(NODE_ID)?;
    assert_eq!(activity.flip_reason, FLIP_DRAINED, "{activity:?}");
    assert_eq!(activity.drained, 1, "{activity:?}");
    let stopped = now_ms();
    sandbox.stop_server("cache")?;
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    wait_for_cache(&sandbox, "the probes confirm the cache's next life")?;
    let back = now_ms();
    let report = stream.stop_once(
        "queries after the failback",
        Duration::from_secs(20),
        |report| report.between(back, u64::MAX).count() > 30,
    )?;
    let timeline = format!(
        "drain at +{} ms, waited until +{} ms, stopped at +{} ms, back at +{} ms",
        drained - report.started_ms(),
        waited - report.started_ms(),
        stopped - report.started_ms(),
        back - report.started_ms(),
    );
    println!("{timeline}: {}", report.summary());
    let flipped_by = report
        .flipped_by(drained)
        .unwrap_or_else(|| panic!("the drain moved nothing: {}", report.summary()));
    assert!(flipped_by <= waited, "{}", report.summary());
    // New sockets and unconnected sends leave the drained cache at once. The kept connected
    // socket may send there for the drain's grace, which the wait outlasts.
    for record in report.between(flipped_by + 1, stopped) {
        let kept = record.kind == "connected" && record.begun_ms <= waited;
        assert!(
            kept || StreamReport::answered_by(record).starts_with("upstream"),
            "the drained cache answered a query ({record:?}): {}",
            report.summary()
        );
    }
    // Nothing lost from before the drain until the cache's next life has its DNS back. The
    // agent's log says what it saw meanwhile (flips, upstream targets leaving the pool).
    let lost = report.failures_between(0, back);
    assert_eq!(
        lost,
        0,
        "a planned restart lost {lost} queries ({timeline}); the agent's log:\n{}\n{}",
        agent.printed().join("\n"),
        report.summary(),
    );
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// Without `--wait` the drain returns at once and the listener is upstream; `--cancel` ends it
/// and the probes give the cache, which never stopped, its DNS back.
#[test]
fn drain_without_wait_moves_at_once_and_cancel_gives_the_dns_back() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let (config, agent) = agent_serving_from_cache(&sandbox)?;
    drain(&Via::Pins(&config), &[])?;
    assert!(
        answered_by(&sandbox)?.starts_with("upstream"),
        "the drain did not move the next query"
    );
    pause(1000);
    assert!(answered_by(&sandbox)?.starts_with("upstream"));
    assert_eq!(node_reason(&sandbox)?, "drained");
    let output = drain(&Via::Pins(&config), &["--cancel"])?;
    assert!(output.stdout.contains("drain ended"), "{output:?}");
    wait_for_cache(&sandbox, "the probes give the cache its DNS back")?;
    // A drain ends with its cache's next life.
    drain(&Via::Pins(&config), &[])?;
    sandbox.stop_server("cache")?;
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    wait_for_cache(&sandbox, "the cache's next life ends the drain")?;
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// The sidecar beside a cache in its pod (`--on-sigterm`): it drains over the agent's socket
/// when Kubernetes stops the pod (SIGTERM), not before, and exits once the cache has read what
/// it was handed.
#[test]
fn a_sidecar_drains_at_its_sigterm_over_the_agents_socket() -> anyhow::Result<()> {
    use nix::{sys::signal, unistd::Pid};
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let (config, agent) = agent_serving_from_cache(&sandbox)?;
    let socket = sandbox.drain_socket().display().to_string();
    let mut sidecar = std::process::Command::new(bpf_tests::sandbox::redirector_bin())
        .args([
            "drain",
            "--listener",
            "node",
            "--wait",
            "--on-sigterm",
            "--socket",
            &socket,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    pause(500);
    assert_eq!(
        answered_by(&sandbox)?,
        "cache",
        "the sidecar drained before its SIGTERM"
    );
    assert_eq!(node_reason(&sandbox)?, "healthy");
    let pid = Pid::from_raw(i32::try_from(sidecar.id())?);
    signal::kill(pid, Signal::SIGTERM)?;
    let deadline = std::time::Instant::now() + bpf_tests::pace::paced(Duration::from_secs(20));
    while sidecar.try_wait()?.is_none() {
        if std::time::Instant::now() > deadline {
            sidecar.kill()?;
            anyhow::bail!("the sidecar did not exit after its SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = sidecar.wait_with_output()?;
    println!("{output:?}");
    assert!(output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("it can be stopped"),
        "{output:?}"
    );
    assert!(answered_by(&sandbox)?.starts_with("upstream"));
    assert_eq!(node_reason(&sandbox)?, "drained");
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// `redirector probe` asks the cache through the agent, whose sockets are never steered: while
/// the listener is forced upstream a query to the listener address (the cache's own address) is
/// answered upstream, yet the probe reaches the cache; a hung cache fails it with the reason; an
/// unknown listener is refused with the agent's listeners named.
#[test]
fn a_probe_asks_the_cache_itself_whatever_the_route() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let (config, agent) = agent_serving_from_cache(&sandbox)?;
    let socket = sandbox.drain_socket().display().to_string();
    let probe =
        |listener: &str| redirector(&["probe", "--listener", listener, "--socket", &socket]);
    let cache = format!("{NODE_LISTENER}:53");

    let output = probe("node")?;
    assert_eq!(output.code, 0, "{output:?}");
    assert!(
        output.stdout.contains(&cache) && output.stdout.contains("serves"),
        "{output:?}"
    );

    assert_eq!(set_state(&sandbox, "node", "upstream")?.code, 0);
    assert!(
        answered_by(&sandbox)?.starts_with("upstream"),
        "the override did not move the listener's DNS"
    );
    let output = probe("node")?;
    assert_eq!(
        output.code, 0,
        "the probe was steered with the listener: {output:?}"
    );
    assert!(output.stdout.contains("serves"), "{output:?}");

    sandbox.process("cache")?.signal(Signal::SIGSTOP)?;
    let output = probe("node")?;
    sandbox.process("cache")?.signal(Signal::SIGCONT)?;
    assert_ne!(output.code, 0, "a hung cache passed the probe: {output:?}");
    assert!(
        output.stderr.contains("does not serve: timeout"),
        "{output:?}"
    );

    let output = probe("nosuch")?;
    assert_ne!(output.code, 0, "{output:?}");
    assert!(
        output.stderr.contains("no listener \"nosuch\"") && output.stderr.contains("cluster"),
        "{output:?}"
    );
    assert_eq!(set_state(&sandbox, "node", "auto")?.code, 0);
    drop(agent);
    uninstall(&config)?;
    Ok(())
}
