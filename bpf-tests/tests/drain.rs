//! Drains for planned work on a cache (#28): `redirector drain --listener NAME --wait` moves the
//! listener upstream, waits until the cache has read what it was handed, and returns; the cache
//! can then be stopped without losing a query, and its next life, confirmed by the probes, gets
//! the DNS back. Without `--wait` it returns at once; `--cancel` ends a drain. A cache's pod asks
//! the agent over its drain socket; on the node the CLI uses the pins itself. A drain covers the
//! cache, not one of its listeners (issue 39): every listener whose `cache` is the same address,
//! or whose cache sockets the same process holds, goes with the one named.

use std::time::Duration;

use anyhow::Context as _;

use bpf_tests::{
    caches::{CacheKind, Corefile, start_cache},
    cli::{CliOutput, redirector, set_state, start_agent, uninstall},
    dns::now_ms,
    harness::{NODE_ID, agent_serving_from_cache, answered_by, node_reason, wait_for_cache},
    pace::{paced, paced_ms, pause, wait_until},
    sandbox::{CacheSpec, Ns, Sandbox},
    shipped,
    stream::{Stream, StreamReport},
    tools,
    topology::{CLUSTER_LISTENER, NODE_LISTENER, dns},
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

/// A planned restart of the cache: when it was drained, the drain's wait ended, the cache was
/// stopped, and its next life had the DNS back (ms since the epoch).
struct Restart {
    drained: u64,
    waited: u64,
    stopped: u64,
    back: u64,
}

impl Restart {
    /// Once the cache's next life has started: waits until the probes confirm it (`back`), ends
    /// `stream` once it has sent past that, and returns the restart with the stream's report.
    fn next_life(
        sandbox: &Sandbox,
        stream: Stream,
        drained: u64,
        waited: u64,
        stopped: u64,
    ) -> anyhow::Result<(Self, StreamReport)> {
        wait_for_cache(sandbox, "the probes confirm the cache's next life")?;
        let back = now_ms();
        let report = stream.stop_once(
            "queries after the failback",
            Duration::from_secs(20),
            |report| report.between(back, u64::MAX).count() > 30,
        )?;
        let restart = Self {
            drained,
            waited,
            stopped,
            back,
        };
        Ok((restart, report))
    }

    /// Asserts what a planned restart promises the stream `report` to listener `name`: the drain
    /// moved its DNS by the end of the wait; from then only the kept connected socket sent to
    /// the drained cache, within the drain's grace, which the wait outlasts (new sockets and
    /// unconnected sends leave at once); and nothing was lost from before the drain until the
    /// next life had the DNS back. `agent_log` says what the agent saw meanwhile (flips,
    /// upstream targets leaving the pool).
    fn assert_nothing_lost(&self, report: &StreamReport, name: &str, agent_log: &[String]) {
        let at = |ms: u64| ms - report.started_ms();
        let timeline = format!(
            "{name}: drain at +{} ms, waited until +{} ms, stopped at +{} ms, back at +{} ms",
            at(self.drained),
            at(self.waited),
            at(self.stopped),
            at(self.back),
        );
        println!("{timeline}: {}", report.summary());
        let flipped_by = report
            .flipped_by(self.drained)
            .unwrap_or_else(|| panic!("{name}: the drain moved nothing: {}", report.summary()));
        assert!(
            flipped_by <= self.waited,
            "{timeline}: {}",
            report.summary()
        );
        for record in report.between(flipped_by + 1, self.stopped) {
            let kept = record.kind == "connected" && record.begun_ms <= self.waited;
            assert!(
                kept || StreamReport::answered_by(record).starts_with("upstream"),
                "{name}: the drained cache answered a query ({record:?}): {}",
                report.summary()
            );
        }
        let lost = report.failures_between(0, self.back);
        assert_eq!(
            lost,
            0,
            "{name}: a planned restart lost {lost} queries ({timeline}); the agent's log:\n{}\n{}",
            agent_log.join("\n"),
            report.summary(),
        );
    }
}

/// The stream of a planned restart: a query every 2 ms from each socket kind to the node listener
/// (stretched in a slower VM, whose servers cannot answer as many), none waiting for the last
/// one's answer.
fn restart_stream(sandbox: &Sandbox) -> anyhow::Result<Stream> {
    Stream::open_loop(
        sandbox,
        dns(NODE_LISTENER),
        Duration::from_secs(120),
        paced_ms(2),
    )
}

/// The planned restart: drain and wait, stop the cache (SIGKILL: once drained, it may end any
/// way), start its next life. Nothing is lost, from before the drain to after the failback, and
/// the drained cache gets no query even though it answers its probes throughout.
#[test]
fn drain_and_wait_then_a_restart_loses_nothing() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let (config, mut agent) = agent_serving_from_cache(&sandbox)?;
    let stream = restart_stream(&sandbox)?;
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
    // The standard cluster listener shares the cache and has no upstreams: the drain says what
    // its queries meet meanwhile.
    assert!(
        output
            .stdout
            .contains("warning: listener cluster has no upstreams"),
        "{output:?}"
    );
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
    let (restart, report) = Restart::next_life(&sandbox, stream, drained, waited, stopped)?;
    restart.assert_nothing_lost(&report, "node", agent.printed());
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// The same planned restart of CoreDNS as AKS LocalDNS runs it: drained and waited for over the
/// agent's socket, then told to stop (SIGTERM: its lameduck keeps it serving, sockets open, for
/// seconds), its next life started once it has gone. Nothing is lost, and the drained CoreDNS
/// answers nothing but the kept socket's queries inside the drain's grace.
#[test]
fn a_drained_coredns_in_lameduck_restarts_losing_nothing() -> anyhow::Result<()> {
    let kind = CacheKind::CoreDns(Corefile::LocalDns);
    let mut sandbox = Sandbox::new(tools!())?;
    start_cache(&mut sandbox, kind, "cache")?;
    sandbox.start_upstreams()?;
    let (config, mut agent) = agent_serving_from_cache(&sandbox)?;
    let stream = restart_stream(&sandbox)?;
    pause(500);
    let drained = now_ms();
    drain(&Via::Socket(&sandbox.drain_socket()), &["--wait"])?;
    let waited = now_ms();
    let stopped = now_ms();
    sandbox.process("cache")?.signal(Signal::SIGTERM)?;
    sandbox
        .process("cache")?
        .wait_exit(Duration::from_secs(10))?;
    sandbox.stop_server("cache")?;
    start_cache(&mut sandbox, kind, "cache")?;
    let (restart, report) = Restart::next_life(&sandbox, stream, drained, waited, stopped)?;
    restart.assert_nothing_lost(&report, "node", agent.printed());
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
    let deadline = std::time::Instant::now() + paced(Duration::from_secs(20));
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

/// Two listeners with upstreams A and B, the cache's own queries skipped: `node`
/// (169.254.10.10) and `cluster` (169.254.10.11), whose cache is `cluster_cache`.
fn two_listeners(sandbox: &Sandbox, cluster_cache: &str) -> String {
    let skipped = sandbox.skipped_cgroup().path().display().to_string();
    format!(
        r#"
[[listener]]
name = "node"
address = "169.254.10.10"
upstreams = ["198.18.2.2", "198.18.2.3:53"]
skip_cgroups = [{skipped:?}]

[[listener]]
name = "cluster"
address = "169.254.10.11"
cache = "{cluster_cache}"
upstreams = ["198.18.2.2", "198.18.2.3:53"]
skip_cgroups = [{skipped:?}]
"#
    )
}

/// Who answered a UDP query from the pod to `listener`: `cache`, `upstream A`, ...
fn answered_at(sandbox: &Sandbox, listener: std::net::Ipv4Addr) -> anyhow::Result<&'static str> {
    bpf_tests::harness::answered_at(sandbox, Ns::Pod, listener.into())
}

/// Listener `id`'s reason, as `status` gives it.
fn reason(sandbox: &Sandbox, id: u32) -> anyhow::Result<&'static str> {
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    redirector::telemetry::snapshot::listeners(&maps)?
        .into_iter()
        .find(|listener| listener.id == id)
        .map(|listener| listener.reason_code)
        .with_context(|| format!("no listener {id} in the pinned maps"))
}

/// Waits until both listeners' DNS is answered by the cache.
fn wait_for_both(sandbox: &Sandbox, what: &str) -> anyhow::Result<()> {
    wait_until(
        what,
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            Ok(answered_at(sandbox, NODE_LISTENER)? == "cache"
                && answered_at(sandbox, CLUSTER_LISTENER)? == "cache")
        },
    )
}

/// AKS LocalDNS's layout: one cache process bound on the node's and the cluster's cache address
/// (each listener its own). `drain --listener node --wait`, over the agent's socket as a stop
/// hook asks it, moves both listeners upstream, since the process that holds the node's cache
/// sockets holds the cluster's too: queries to the cluster listener are answered upstream, not
/// by the cache, and the reply names the process. Streams to both, from every socket kind, lose
/// nothing from before the drain until the cache's next life, which gets both listeners back.
/// The agent runs as shipped (`shipped`): it cannot read the cache's descriptors, which was
/// running before it, and groups the listeners by the programs' record of the cache's reads.
#[test]
fn one_drain_moves_every_listener_of_the_cache_process_and_its_next_life_gets_both_back()
-> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    let cache = CacheSpec {
        listen: vec![dns(NODE_LISTENER), dns(CLUSTER_LISTENER)],
        ..CacheSpec::standard()
    };
    sandbox.start_cache("cache", &cache)?;
    sandbox.start_upstreams()?;
    let (config, mut agent) =
        shipped::start_agent_on(&sandbox, &two_listeners(&sandbox, "169.254.10.11:53"))?;
    wait_for_both(&sandbox, "the agent confirms the cache on both listeners")?;
    let pid = sandbox.process("cache")?.pid();
    // Two streams: a query every 10 ms from each socket kind of each (stretched in a slower
    // VM). Under TCG, twice the one-listener test's load made an upstream server fall silent for
    // a second and more while both listeners were drained: the loss of a slow upstream, not of
    // the drain, which this test is about.
    let open = |listener| {
        Stream::open_loop(
            &sandbox,
            dns(listener),
            paced(Duration::from_secs(120)),
            paced_ms(10),
        )
    };
    let streams = [
        ("node", open(NODE_LISTENER)?),
        ("cluster", open(CLUSTER_LISTENER)?),
    ];
    pause(500);
    let drained = now_ms();
    let output = drain(&Via::Socket(&sandbox.drain_socket()), &["--wait"])?;
    let waited = now_ms();
    println!("{}", output.stdout);
    assert!(
        output.stdout.contains(&format!(
            "cache 169.254.10.10:53, 169.254.10.11:53 (process {pid}): listeners node, cluster: \
             drained"
        )),
        "the drain did not take the cache process's other listener: {output:?}"
    );
    assert!(output.stdout.contains("it can be stopped"), "{output:?}");
    assert!(!output.stdout.contains("warning"), "{output:?}");
    assert!(
        !output.stdout.contains("by their cache address only"),
        "the drain did not see the cache's process: {output:?}"
    );
    // The cache still answers its probes, and the listener not named is drained all the same.
    pause(1000);
    assert_eq!(reason(&sandbox, NODE_ID)?, "drained");
    assert_eq!(reason(&sandbox, 1)?, "drained");
    let cluster_answer = answered_at(&sandbox, CLUSTER_LISTENER)?;
    assert!(
        cluster_answer.starts_with("upstream"),
        "the listener not named was left on the drained cache: answered by {cluster_answer}"
    );
    let stopped = now_ms();
    sandbox.stop_server("cache")?;
    sandbox.start_cache("cache", &cache)?;
    wait_for_both(
        &sandbox,
        "the probes confirm the cache's next life on both listeners",
    )?;
    let back = now_ms();
    for (name, stream) in streams {
        let report = stream.stop_once(
            "queries after the failback",
            Duration::from_secs(20),
            |report| {
                report
                    .between(back, u64::MAX)
                    .filter(|record| StreamReport::answered_by(record) == "cache")
                    .count()
                    > 30
            },
        )?;
        let restart = Restart {
            drained,
            waited,
            stopped,
            back,
        };
        restart.assert_nothing_lost(&report, name, agent.printed());
    }
    drop(agent);
    shipped::uninstall(&sandbox, &config)?;
    Ok(())
}

/// The same two listeners on two cache processes of their own: a drain of `node` leaves the
/// cluster listener's cache alone (what joins listeners is a process holding both caches'
/// sockets, not the drain); `--all` then drains both, and `--cancel --all` ends both.
#[test]
fn a_cache_process_of_its_own_is_not_drained_with_another() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    for (name, listener) in [
        ("cache-node", NODE_LISTENER),
        ("cache-cluster", CLUSTER_LISTENER),
    ] {
        let cache = CacheSpec {
            listen: vec![dns(listener)],
            ..CacheSpec::standard()
        };
        sandbox.start_cache(name, &cache)?;
    }
    sandbox.start_upstreams()?;
    let config = sandbox.write_file(
        "config.toml",
        &sandbox.config_toml(&two_listeners(&sandbox, "169.254.10.11:53")),
    )?;
    let agent = start_agent(&config)?;
    wait_for_both(&sandbox, "the agent confirms both caches")?;
    let output = drain(&Via::Pins(&config), &[])?;
    println!("{}", output.stdout);
    assert!(
        output.stdout.contains("listener node: drained") && !output.stdout.contains("cluster"),
        "{output:?}"
    );
    assert!(answered_at(&sandbox, NODE_LISTENER)?.starts_with("upstream"));
    assert_eq!(
        answered_at(&sandbox, CLUSTER_LISTENER)?,
        "cache",
        "the drain moved a listener whose cache is another process"
    );
    assert_eq!(reason(&sandbox, 1)?, "healthy");
    // With no name and two caches, the drain asks which.
    let output = redirector(&["drain", "--config", &config.display().to_string()])?;
    assert_ne!(output.code, 0, "{output:?}");
    assert!(
        output.stderr.contains("2 caches") && output.stderr.contains("--all"),
        "{output:?}"
    );
    let output = redirector(&["drain", "--all", "--config", &config.display().to_string()])?;
    assert_eq!(output.code, 0, "{output:?}");
    assert!(answered_at(&sandbox, CLUSTER_LISTENER)?.starts_with("upstream"));
    let output = redirector(&[
        "drain",
        "--all",
        "--cancel",
        "--config",
        &config.display().to_string(),
    ])?;
    assert_eq!(output.code, 0, "{output:?}");
    wait_for_both(
        &sandbox,
        "the cancelled drains give both caches their DNS back",
    )?;
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// NodeLocal DNSCache's layout: the cluster listener's cache is the node listener's address
/// (the kube-dns ClusterIP answered by the link-local cache). `drain --listener cluster` moves
/// both, and the cache's next life gets both back.
#[test]
fn a_drain_by_any_listener_of_a_cache_address_moves_them_all() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    let cache = CacheSpec {
        listen: vec![dns(NODE_LISTENER)],
        ..CacheSpec::standard()
    };
    sandbox.start_cache("cache", &cache)?;
    sandbox.start_upstreams()?;
    let config = sandbox.write_file(
        "config.toml",
        &sandbox.config_toml(&two_listeners(&sandbox, "169.254.10.10:53")),
    )?;
    let agent = start_agent(&config)?;
    wait_for_both(&sandbox, "the agent confirms the cache")?;
    let output = redirector(&[
        "drain",
        "--listener",
        "cluster",
        "--config",
        &config.display().to_string(),
    ])?;
    assert_eq!(output.code, 0, "{output:?}");
    assert!(
        output.stdout.contains("listeners node, cluster: drained"),
        "{output:?}"
    );
    assert!(answered_at(&sandbox, NODE_LISTENER)?.starts_with("upstream"));
    assert!(answered_at(&sandbox, CLUSTER_LISTENER)?.starts_with("upstream"));
    sandbox.stop_server("cache")?;
    sandbox.start_cache("cache", &cache)?;
    wait_for_both(&sandbox, "the cache's next life gets both listeners back")?;
    drop(agent);
    uninstall(&config)?;
    Ok(())
}
