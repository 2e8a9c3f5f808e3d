//! DNS per workload: the programs count each cgroup's queries by route and its replies by rcode
//! class, exactly, for every way a resolver sends (unconnected UDP, connected UDP, TCP), and
//! count nothing for the caches' cgroups and the cgroups the operator exempts.

use std::{net::SocketAddr, os::unix::fs::MetadataExt as _, path::Path, time::Duration};

use anyhow::Context as _;
use bpf_tests::{
    caches::{CacheKind, start_cache},
    cgroup::{KubeletCgroups, TestCgroup},
    cli::{redirector, stop_agent},
    dns::QueryOutcome,
    harness::{CLUSTER_ID, Harness, standard_listeners, wait_for_cache},
    http::sample,
    pace::wait_until,
    sandbox::{Ns, Query, Sandbox, Transport, redirector_bin},
    shipped, tools,
    topology::{
        CLUSTER_LISTENER, NODE_LISTENER, UPSTREAM_A_V4, UPSTREAM_A_V6, V6_LISTENER, dns, who,
    },
};
use redirector::datapath::Maps;
use redirector_common::{
    settings::Mode,
    workloads::{
        RCODE_CLASSES, RCODE_NOERROR, RCODE_NXDOMAIN, ROUTE_CACHE, ROUTE_DIRECT, ROUTE_LIMITED,
        ROUTE_REFUSED, ROUTE_UPSTREAM, ROUTES, WorkloadCounters,
    },
};

/// The standard listeners, but no listener skips the cache's cgroup: as NodeLocal DNSCache's
/// layout has it, where the cache is a pod of its own.
fn unskipped_listeners(sandbox: &Sandbox) -> String {
    let skip = format!(
        "skip_cgroups = [{:?}]",
        sandbox.skipped_cgroup().path().display().to_string()
    );
    let listeners = standard_listeners(sandbox);
    assert!(listeners.contains(&skip), "{listeners}");
    listeners.replace(&skip, "")
}

/// The cgroup the configuration exempts, created after the agent starts.
const EXEMPT: &str = "exempt-pod";

/// Where the NXDOMAIN server listens: upstream A's address, another port (replies from it are
/// recognised by the port the pool's target uses).
fn nxdomain_server() -> SocketAddr {
    SocketAddr::new(UPSTREAM_A_V4.into(), 5353)
}

/// The id of a cgroup: its directory's inode number.
fn cgroup_id(path: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .ino())
}

/// What the programs counted for the cgroup at `path` (`None`: nothing, or exempt).
fn counted(harness: &Harness, path: &Path) -> anyhow::Result<Option<WorkloadCounters>> {
    let id = cgroup_id(path)?;
    Ok(harness
        .maps
        .workload_counts()?
        .into_iter()
        .find(|(counted, _)| *counted == id)
        .map(|(_, counters)| counters))
}

/// Queries by route and replies by class, for comparison.
fn expected(
    routes: &[(usize, u64)],
    classes: &[(usize, u64)],
) -> ([u64; ROUTES], [u64; RCODE_CLASSES]) {
    let mut queries = [0; ROUTES];
    for (route, count) in routes {
        queries[*route] = *count;
    }
    let mut replies = [0; RCODE_CLASSES];
    for (class, count) in classes {
        replies[*class] = *count;
    }
    (queries, replies)
}

/// Runs `count` queries of `query` from the pod's namespace in `cgroup` and returns who answered
/// each (or its error).
fn ask(
    sandbox: &Sandbox,
    cgroup: &TestCgroup,
    query: Query,
    count: u16,
) -> anyhow::Result<Vec<String>> {
    Ok(sandbox
        .queries_in(Ns::Pod, cgroup, query, count)?
        .into_iter()
        .map(|outcome| {
            if outcome.ok {
                format!(
                    "{} {}",
                    who(outcome.answer()),
                    outcome.rcode.unwrap_or_default()
                )
            } else {
                format!("error {:?}", outcome.error)
            }
        })
        .collect())
}

#[test]
fn two_pods_get_exact_counts_by_route_and_rcode_and_exempt_cgroups_none() -> anyhow::Result<()> {
    let mut harness = Harness::start(
        tools!(),
        |sandbox| {
            sandbox.start_standard_servers()?;
            let program = sandbox.tools().dns_server.display().to_string();
            sandbox.start_process(
                "nxdomain",
                Some(Ns::Upstream),
                None,
                &program,
                &[
                    "--listen".to_owned(),
                    nxdomain_server().to_string(),
                    "--a".to_owned(),
                    "192.0.2.77".to_owned(),
                    "--aaaa".to_owned(),
                    "2001:db8::77".to_owned(),
                    "--rcode".to_owned(),
                    "nxdomain".to_owned(),
                ],
                "ready",
            )
        },
        |sandbox| {
            // Listed before it exists, as a service's cgroup not started yet at boot.
            format!(
                "{}\n[workloads]\ninterval_ms = 1000\nexempt_cgroups = [{:?}]\n",
                unskipped_listeners(sandbox),
                sandbox.cgroup().path().join(EXEMPT).display().to_string()
            )
        },
    )?;
    let sandbox = &harness.sandbox;
    // Named as the kubelet names them: pod A's container under the systemd driver, pod B's
    // under the cgroupfs driver.
    let systemd = KubeletCgroups::systemd(sandbox.cgroup(), SYSTEMD_POD_UID)?;
    let cgroupfs = KubeletCgroups::cgroupfs(sandbox.cgroup(), CGROUPFS_POD_UID)?;
    let (pod_a, pod_b) = (systemd.container(), cgroupfs.container());
    let exempt = sandbox.cgroup().child(EXEMPT)?;
    // The agent sees it exist at a reading and forgets every count then (exemptions are decided
    // when a cgroup is first counted): waited for before anything is counted. (A cache's own
    // cgroup is exempt too: `a_cache_older_than_the_shipped_agent_is_no_workload` shows it with
    // the agent as shipped, which this in-process agent is not.)
    let exempt_id = cgroup_id(exempt.path())?;
    harness.wait_until(
        "the agent exempts the cgroup created after its start",
        Duration::from_secs(10),
        |harness| Ok(harness.maps.exempt_cgroups().contains(&exempt_id)),
    )?;

    // The agent's first reading is its baseline: its totals count what comes after.
    harness.wait_until(
        "the agent's first reading of the workloads",
        Duration::from_secs(10),
        |harness| Ok(harness.agent.stats.workloads().is_some()),
    )?;
    // Pod A asks the node listener, whose cache serves: every way a resolver sends.
    let node = dns(NODE_LISTENER);
    let mut answers = ask(sandbox, pod_a, Query::new(node, Transport::Udp), 3)?;
    answers.extend(ask(
        sandbox,
        pod_a,
        Query::new(node, Transport::UdpConnected),
        2,
    )?);
    answers.extend(ask(sandbox, pod_a, Query::new(node, Transport::Tcp), 1)?);
    assert!(
        answers.iter().all(|answer| answer.starts_with("cache")),
        "{answers:?}"
    );

    // Pod B: the cluster listener sent upstream with an empty pool (refused under `fail`), then
    // with a pool whose one target answers NXDOMAIN, and a server that is no listener, asked
    // directly.
    harness.set_mode(CLUSTER_ID, Mode::Upstream)?;
    let cluster = dns(CLUSTER_LISTENER);
    let refused = ask(
        &harness.sandbox,
        pod_b,
        Query::new(cluster, Transport::Udp),
        1,
    )?;
    assert!(refused[0].starts_with("error"), "{refused:?}");
    harness.set_pool(CLUSTER_ID, &[nxdomain_server()])?;
    let sandbox = &harness.sandbox;
    let mut answers = ask(sandbox, pod_b, Query::new(cluster, Transport::Udp), 4)?;
    answers.extend(ask(
        sandbox,
        pod_b,
        Query::new(cluster, Transport::UdpConnected),
        2,
    )?);
    assert!(
        answers
            .iter()
            .all(|answer| answer == "nobody Non-Existent Domain"),
        "{answers:?}"
    );
    let direct = Query::new(dns(UPSTREAM_A_V4), Transport::UdpConnected);
    let answers = ask(sandbox, pod_b, direct, 2)?;
    assert!(
        answers
            .iter()
            .all(|answer| answer.starts_with("upstream A")),
        "{answers:?}"
    );

    // The listed cgroup, once the agent has seen it exist.
    let sandbox = &harness.sandbox;
    let answers = ask(sandbox, &exempt, direct, 2)?;
    assert!(
        answers
            .iter()
            .all(|answer| answer.starts_with("upstream A")),
        "{answers:?}"
    );
    let answers = ask(sandbox, &exempt, Query::new(node, Transport::Udp), 1)?;
    assert!(answers[0].starts_with("cache"), "{answers:?}");

    let a = counted(&harness, pod_a.path())?.context("pod A was counted")?;
    assert_eq!(
        (a.queries, a.replies),
        expected(&[(ROUTE_CACHE, 6)], &[(RCODE_NOERROR, 6)]),
        "pod A: {a:?}"
    );
    let b = counted(&harness, pod_b.path())?.context("pod B was counted")?;
    assert_eq!(
        (b.queries, b.replies),
        expected(
            &[(ROUTE_UPSTREAM, 6), (ROUTE_REFUSED, 1), (ROUTE_DIRECT, 2)],
            &[(RCODE_NXDOMAIN, 6), (RCODE_NOERROR, 2)]
        ),
        "pod B: {b:?}"
    );
    assert_eq!(
        counted(&harness, exempt.path())?,
        None,
        "{} is exempt",
        exempt.path().display()
    );

    // The agent's node totals, from its readings since it started: every count above, nothing
    // of the exempt cgroups.
    harness.wait_until(
        "the agent's totals reach the kernel's counts",
        Duration::from_secs(10),
        |harness| {
            Ok(harness.agent.stats.workloads().is_some_and(|view| {
                view.queries_total == [6, 6, 1, 2, 0] && view.replies_total == [8, 6, 0, 0, 0]
            }))
        },
    )?;

    Ok(())
}

/// What operators read, from the same counts: `status` and the metrics name each pod by the UID
/// in its cgroup's name (both kubelet drivers), and `top` shows the busiest live in a terminal.
/// Userspace over the kernel paths the test above takes: left to the host by the VMs.
/// A cache that was running before the agent, run as its package runs it (dnsmasq drops to its
/// own user), in a cgroup no listener skips (NodeLocal DNSCache's layout: the cache is a pod of
/// its own), with the agent as shipped (`shipped`: it can read neither the cache's descriptors nor
/// another pid namespace's processes). The programs learn the cache at its first read after the
/// agent's start and exempt its cgroup, so its own DNS (a forwarding cache's queries to its
/// upstreams, their replies) is no workload's: before, such a cache was counted as a workload
/// (its forwarded queries as `direct`, their replies by rcode).
#[test]
fn a_cache_older_than_the_shipped_agent_is_no_workload() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    start_cache(&mut sandbox, CacheKind::Dnsmasq, "cache")?;
    sandbox.start_upstreams()?;
    let listeners = format!(
        "{}\n[workloads]\ninterval_ms = 1000\n",
        unskipped_listeners(&sandbox)
    );
    let (config, mut agent) = shipped::start_agent_on(&sandbox, &listeners)?;
    wait_for_cache(&sandbox, "the shipped agent confirms the cache")?;
    let cache = cgroup_id(sandbox.skipped_cgroup().path())?;
    let pin_dir = sandbox.pin_dir();
    wait_until(
        "the programs learn the cache at its reads and exempt its cgroup",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let maps = Maps::open_pinned(&pin_dir)?;
            Ok(maps.exempt_cgroups().contains(&cache)
                && maps
                    .known_cache_tasks()
                    .iter()
                    .any(|(_, task)| task.cgroup_id == cache))
        },
    )?;
    // The cache's own DNS: five queries from its cgroup straight to an upstream, as a forwarding
    // cache sends them.
    let direct = Query::new(dns(UPSTREAM_A_V4), Transport::UdpConnected);
    let answers = ask(&sandbox, sandbox.skipped_cgroup(), direct, 5)?;
    assert!(
        answers
            .iter()
            .all(|answer| answer.starts_with("upstream A")),
        "{answers:?}"
    );
    let counts = Maps::open_pinned(&pin_dir)?.workload_counts()?;
    assert!(
        counts.iter().all(|(id, _)| *id != cache),
        "the cache's cgroup was counted as a workload: {counts:?}"
    );
    stop_agent(&mut agent)?;
    shipped::uninstall(&sandbox, &config)?;
    Ok(())
}

#[test]
fn status_the_metrics_and_top_name_each_pod_by_its_cgroup() -> anyhow::Result<()> {
    let harness = Harness::start(tools!(), Sandbox::start_standard_servers, |sandbox| {
        format!(
            "{}\n[workloads]\ninterval_ms = 1000\n",
            standard_listeners(sandbox)
        )
    })?;
    let sandbox = &harness.sandbox;
    let systemd = KubeletCgroups::systemd(sandbox.cgroup(), SYSTEMD_POD_UID)?;
    let cgroupfs = KubeletCgroups::cgroupfs(sandbox.cgroup(), CGROUPFS_POD_UID)?;
    let (pod_a, pod_b) = (systemd.container(), cgroupfs.container());
    let node = dns(NODE_LISTENER);
    let answers = ask(sandbox, pod_a, Query::new(node, Transport::Udp), 6)?;
    assert!(
        answers.iter().all(|answer| answer.starts_with("cache")),
        "{answers:?}"
    );
    let direct = Query::new(dns(UPSTREAM_A_V4), Transport::UdpConnected);
    let answers = ask(sandbox, pod_b, direct, 3)?;
    assert!(
        answers
            .iter()
            .all(|answer| answer.starts_with("upstream A")),
        "{answers:?}"
    );

    // `status` names both pods by their UIDs, from their cgroups' names alone.
    let status = redirector(&[
        "status",
        "--config",
        "/nonexistent",
        "--pin-dir",
        &harness.sandbox.pin_dir().display().to_string(),
    ])?;
    assert_eq!(status.code, 0, "{status:?}");
    let row = |uid: &str| {
        status
            .stdout
            .lines()
            .find(|line| line.starts_with(&format!("pod/{uid} ")))
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
    };
    assert_eq!(
        row(SYSTEMD_POD_UID).context("pod A in status")?,
        [
            "pod/".to_owned() + SYSTEMD_POD_UID,
            "6".into(),
            "100%".into(),
            "0%".into(),
            "0%".into(),
            "0%".into(),
            "0%".into(),
            "6".into(),
            "0%".into(),
            "0%".into()
        ],
        "{}",
        status.stdout
    );
    assert_eq!(
        row(CGROUPFS_POD_UID).context("pod B in status")?,
        [
            "pod/".to_owned() + CGROUPFS_POD_UID,
            "3".into(),
            "0%".into(),
            "0%".into(),
            "0%".into(),
            "100%".into(),
            "0%".into(),
            "3".into(),
            "0%".into(),
            "0%".into()
        ],
        "{}",
        status.stdout
    );

    // The metrics name the busiest workload by its pod UID while it asks.
    let metrics = harness.agent.metrics.context("the agent serves metrics")?;
    let series = format!(
        "redirector_workload_query_rate{{workload=\"pod/{SYSTEMD_POD_UID}\",namespace=\"\",pod=\"\",route=\"cache\"}}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        ask(&harness.sandbox, pod_a, Query::new(node, Transport::Udp), 5)?;
        let body = bpf_tests::http::get(metrics, "/metrics")?.body;
        if sample(&body, &series).is_some_and(|rate| rate > 0.0) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "no {series} in the metrics:\n{body}"
        );
    }

    // `top` in a terminal: a frame, then one with pod A's queries of the window.
    let frames = top_in_terminal(&harness, || {
        ask(&harness.sandbox, pod_a, Query::new(node, Transport::Udp), 5).map(drop)
    })?;
    let last = frames
        .rsplit("DNS per workload over")
        .next()
        .unwrap_or_default();
    let line = last
        .lines()
        .find(|line| line.starts_with(&format!("pod/{SYSTEMD_POD_UID} ")))
        .with_context(|| format!("pod A in top's last frame:\n{frames}"))?;
    let cells: Vec<&str> = line.split_whitespace().collect();
    assert!(
        cells[1].parse::<f64>()? > 0.0 && cells[2] == "100%",
        "{line}\n{frames}"
    );
    assert!(
        frames.contains("\x1b[H\x1b[2J"),
        "top refreshes in place: {frames:?}"
    );
    Ok(())
}

/// The pod UID of the kubelet's cgroups under the systemd driver (`_` for `-` in the slice).
const SYSTEMD_POD_UID: &str = "1111aaaa-2222-3333-4444-555566667777";
/// The pod UID under the cgroupfs driver.
const CGROUPFS_POD_UID: &str = "9999bbbb-8888-7777-6666-555544443333";

/// Runs `redirector top --count 2` against the sandbox's pins with its output on a pseudo-
/// terminal, runs `between` once the first frame is shown, and returns everything it printed.
fn top_in_terminal(
    harness: &Harness,
    between: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<String> {
    use std::io::Read as _;
    let pty = nix::pty::openpty(None, None).context("opening a pseudo-terminal")?;
    let mut child = std::process::Command::new(redirector_bin())
        .args([
            "top",
            "--config",
            "/nonexistent",
            "--pin-dir",
            &harness.sandbox.pin_dir().display().to_string(),
            "--count",
            "2",
            "--interval-ms",
            "1500",
        ])
        .stdout(std::process::Stdio::from(pty.slave.try_clone()?))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting redirector top")?;
    drop(pty.slave);
    let mut master = std::fs::File::from(pty.master);
    let mut printed = Vec::new();
    let mut chunk = [0_u8; 4096];
    let mut between = Some(between);
    loop {
        match master.read(&mut chunk) {
            Ok(0) => break,
            Ok(read) => printed.extend_from_slice(&chunk[..read]),
            // EIO: the child closed the terminal's last writer (it exited).
            Err(error) if error.raw_os_error() == Some(libc::EIO) => break,
            Err(error) => return Err(error).context("reading the pseudo-terminal"),
        }
        if String::from_utf8_lossy(&printed).contains("DNS per workload over")
            && let Some(between) = between.take()
        {
            between()?;
        }
    }
    let status = child.wait()?;
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        pipe.read_to_string(&mut stderr)?;
    }
    anyhow::ensure!(status.success(), "redirector top failed: {stderr}");
    Ok(String::from_utf8_lossy(&printed).into_owned())
}

/// The flood's limit: queries per second, and the burst after a quiet moment.
const LIMIT_QPS: u64 = 50;
/// See [`LIMIT_QPS`].
const LIMIT_BURST: u64 = 10;

#[test]
fn a_flooding_pod_is_held_to_its_rate_and_a_quiet_pod_beside_it_loses_nothing() -> anyhow::Result<()>
{
    let harness = Harness::start(tools!(), Sandbox::start_standard_servers, |sandbox| {
        format!(
            "{}\n[workloads]\ninterval_ms = 1000\nrate_limit_qps = {LIMIT_QPS}\n\
             rate_limit_burst = {LIMIT_BURST}\nrate_limit_exempt_cgroups = [{:?}]\n",
            standard_listeners(sandbox),
            sandbox
                .cgroup()
                .path()
                .join(UNLIMITED)
                .display()
                .to_string()
        )
    })?;
    let sandbox = &harness.sandbox;
    let flooder = sandbox.cgroup().child("flooder")?;
    let quiet = sandbox.cgroup().child("quiet")?;
    let node = Query::new(dns(NODE_LISTENER), Transport::Udp);
    // Counted before the exempt set changes, and kept through the change: the agent forgets only
    // the counted cgroups a change concerns.
    let early = ask(sandbox, &quiet, node, 5)?;
    assert!(
        early.iter().all(|answer| answer.starts_with("cache")),
        "{early:?}"
    );
    let unlimited = sandbox.cgroup().child(UNLIMITED)?;
    let unlimited_id = cgroup_id(unlimited.path())?;
    harness.wait_until(
        "the agent exempts the cgroup created after its start from the limit",
        Duration::from_secs(10),
        |harness| Ok(harness.maps.exempt_cgroups().contains(&unlimited_id)),
    )?;
    let early_count = counted(&harness, quiet.path())?.map(|counts| counts.queries[ROUTE_CACHE]);
    assert_eq!(
        early_count,
        Some(5),
        "a change of the exempt set dropped another workload's counts"
    );
    // Another quiet pod, on one kept socket, whose round trips are timed without the flood and
    // beside it (printed, not asserted: timings are the bench's).
    let steady = sandbox.cgroup().child("steady")?;
    let mut kept = sandbox.held_client_idle(Ns::Pod, &steady, node_query(), 80, false)?;
    let mut alone = Vec::new();
    for _ in 0..40 {
        alone.push(timed_ask(&mut kept)?);
        std::thread::sleep(Duration::from_millis(25));
    }

    // The flood: one query after the other from fresh sockets, as fast as they are answered or
    // refused, until the quiet pod is done.
    let (mut command, _procs) = sandbox.client_command(
        Ns::Pod,
        &flooder,
        &sandbox.tools().dns_query.display().to_string(),
    )?;
    command
        .args(["--server", &node.server.to_string(), "--transport", "udp"])
        .args(["--count", "60000", "--timeout-ms", "1000"])
        .stdout(std::process::Stdio::piped());
    let started = std::time::Instant::now();
    let mut flood = command.spawn().context("starting the flood")?;
    // Read as it is printed: a full pipe would stop the flood.
    let mut stdout = flood.stdout.take().context("the flood's output")?;
    let printed = std::thread::spawn(move || {
        let mut printed = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut printed);
        printed
    });
    let mut quiet_answers = Vec::new();
    let mut beside = Vec::new();
    for _ in 0..40 {
        quiet_answers.extend(ask(sandbox, &quiet, node, 1)?);
        beside.push(timed_ask(&mut kept)?);
        std::thread::sleep(Duration::from_millis(25));
    }
    bpf_tests::command::kill_pid(flood.id());
    let _ = flood.wait();
    let elapsed = started.elapsed();
    let printed = printed
        .join()
        .map_err(|_| anyhow::anyhow!("reading the flood's output panicked"))?;
    // The last line may be cut off by the kill.
    let outcomes: Vec<QueryOutcome> = printed
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();

    // The quiet pod, at 40 queries/s beside the flood, lost nothing.
    assert!(
        quiet_answers
            .iter()
            .all(|answer| answer.starts_with("cache")),
        "{quiet_answers:?}"
    );
    let calm = counted(&harness, quiet.path())?.context("the quiet pod was counted")?;
    assert_eq!(
        (calm.queries[ROUTE_CACHE], calm.queries[ROUTE_LIMITED]),
        (45, 0),
        "{calm:?}"
    );
    let calm = counted(&harness, steady.path())?.context("the kept socket was counted")?;
    assert_eq!(
        (calm.queries[ROUTE_CACHE], calm.queries[ROUTE_LIMITED]),
        (80, 0),
        "{calm:?}"
    );
    drop(kept);
    eprintln!(
        "a quiet pod's round trips on a kept socket (the client's pipe included): median {:?}, \
         90th percentile {:?} alone; median {:?}, 90th percentile {:?} beside the flood",
        percentile(&mut alone, 50),
        percentile(&mut alone, 90),
        percentile(&mut beside, 50),
        percentile(&mut beside, 90)
    );

    // The flood got its burst and its rate, no more; the rest was refused at once, with the
    // errno resolvers take as "try again".
    let flood_counts = counted(&harness, flooder.path())?.context("the flood was counted")?;
    let admitted = flood_counts.queries[ROUTE_CACHE];
    let refused = flood_counts.queries[ROUTE_LIMITED];
    let allowed = LIMIT_BURST + (LIMIT_QPS as f64 * elapsed.as_secs_f64()).ceil() as u64 + 1;
    eprintln!(
        "the flood: {admitted} admitted, {refused} refused in {elapsed:?} (at most {allowed} allowed)"
    );
    assert!(
        (LIMIT_BURST..=allowed).contains(&admitted) && refused > 10 * admitted,
        "admitted {admitted} (at most {allowed} in {elapsed:?}), refused {refused}"
    );
    let expected_errno = if redirector::sys::kernel_support::KernelSupport::probe(&[])
        .has(redirector::sys::kernel_support::SET_RETVAL)
    {
        ECONNREFUSED
    } else {
        EPERM
    };
    let errnos: std::collections::BTreeSet<Option<i32>> = outcomes
        .iter()
        .filter(|outcome| !outcome.ok)
        .map(|outcome| outcome.errno)
        .collect();
    assert_eq!(
        errnos,
        [Some(expected_errno)].into(),
        "every refused query fails with one errno"
    );
    assert!(
        outcomes.iter().filter(|outcome| outcome.ok).count() as u64 <= admitted,
        "the flood saw more answers than the kernel admitted"
    );

    // A connected UDP socket's datagrams are held at egress (the send fails with EPERM), a TCP
    // connection at connect: each flooding workload gets its burst and its rate.
    let mut limited = refused;
    for (name, transport, errno) in [
        ("connected-flooder", Transport::UdpConnected, EPERM),
        ("tcp-flooder", Transport::Tcp, expected_errno),
    ] {
        let cgroup = harness.sandbox.cgroup().child(name)?;
        let started = std::time::Instant::now();
        let outcomes = harness.sandbox.queries_in(
            Ns::Pod,
            &cgroup,
            Query::new(dns(NODE_LISTENER), transport),
            300,
        )?;
        let elapsed = started.elapsed();
        let counts = counted(&harness, cgroup.path())?.context("the flood was counted")?;
        let (admitted, refused) = (counts.queries[ROUTE_CACHE], counts.queries[ROUTE_LIMITED]);
        limited += refused;
        let allowed = LIMIT_BURST + (LIMIT_QPS as f64 * elapsed.as_secs_f64()).ceil() as u64 + 1;
        eprintln!("{name}: {admitted} admitted, {refused} refused in {elapsed:?}");
        assert!(
            (LIMIT_BURST..=allowed).contains(&admitted) && admitted + refused == 300,
            "{name}: admitted {admitted} (at most {allowed} in {elapsed:?}), refused {refused}"
        );
        let errnos: std::collections::BTreeSet<Option<i32>> = outcomes
            .iter()
            .filter(|outcome| !outcome.ok)
            .map(|outcome| outcome.errno)
            .collect();
        assert_eq!(errnos, [Some(errno)].into(), "{name}");
    }

    // A UDP socket connected elsewhere that sends to the listener with `sendto`: the kernel sends
    // each datagram to the listener, and sendmsg counts it and holds it to the rate (left where
    // it is addressed, `direct`; the socket takes no reply but its peer's, so each admitted one
    // waits out the client's timeout, 1 ms). IPv4, IPv6, and a dual-stack socket's IPv4-mapped.
    let upstream_a = |address: std::net::IpAddr| SocketAddr::new(address, 53);
    for (name, query, sends) in [
        (
            "sendto-flooder",
            node.connected_to(upstream_a(UPSTREAM_A_V4.into())),
            300,
        ),
        (
            "sendto-flooder-v6",
            Query::new(dns(V6_LISTENER), Transport::Udp)
                .connected_to(upstream_a(UPSTREAM_A_V6.into())),
            100,
        ),
        (
            "sendto-flooder-mapped",
            node.mapped().connected_to(upstream_a(UPSTREAM_A_V4.into())),
            100,
        ),
    ] {
        let cgroup = harness.sandbox.cgroup().child(name)?;
        let (mut command, _procs) =
            harness
                .sandbox
                .dns_query_command(Ns::Pod, &cgroup, query, sends)?;
        command.args(["--timeout-ms", "1"]);
        let started = std::time::Instant::now();
        let output = bpf_tests::command::output_within(&mut command, Duration::from_secs(60))?;
        let elapsed = started.elapsed();
        let outcomes: Vec<QueryOutcome> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect();
        let counts = counted(&harness, cgroup.path())?.context("the sendto flood was counted")?;
        let (admitted, refused) = (counts.queries[ROUTE_DIRECT], counts.queries[ROUTE_LIMITED]);
        limited += refused;
        let allowed = LIMIT_BURST + (LIMIT_QPS as f64 * elapsed.as_secs_f64()).ceil() as u64 + 1;
        eprintln!("{name}: {admitted} admitted, {refused} refused in {elapsed:?}");
        assert!(
            (LIMIT_BURST..=allowed).contains(&admitted) && admitted + refused == u64::from(sends),
            "{name}: admitted {admitted} (at most {allowed} in {elapsed:?}), refused {refused}: \
             {counts:?}"
        );
        let refusals = outcomes
            .iter()
            .filter(|outcome| outcome.errno == Some(expected_errno))
            .count() as u64;
        assert_eq!(
            (outcomes.len(), refusals),
            (usize::from(sends), refused),
            "{name}: each query over the rate fails its sendto with one errno"
        );
    }

    // One workload flooding from every CPU at once shares one schedule: a query that loses the
    // stamp's compare-and-swap to another CPU is judged again on the stamp it lost to, so the
    // workload gets its burst and its rate, not one more a racing CPU.
    let everywhere = harness.sandbox.cgroup().child("every-cpu-flooder")?;
    let cpus = std::thread::available_parallelism()?.get();
    let started = std::time::Instant::now();
    let mut floods = Vec::new();
    for cpu in 0..cpus {
        let (mut command, procs) =
            harness
                .sandbox
                .client_command(Ns::Pod, &everywhere, "taskset")?;
        command
            .args(["--cpu-list", &cpu.to_string()])
            .arg(&harness.sandbox.tools().dns_query)
            .args(["--server", &node.server.to_string(), "--transport", "udp"])
            .args(["--count", "60000", "--timeout-ms", "1000"])
            .stdout(std::process::Stdio::null());
        floods.push((
            command.spawn().context("starting a flood on one CPU")?,
            procs,
        ));
    }
    std::thread::sleep(Duration::from_secs(2));
    for (flood, _) in &mut floods {
        bpf_tests::command::kill_pid(flood.id());
        let _ = flood.wait();
    }
    let elapsed = started.elapsed();
    let counts = counted(&harness, everywhere.path())?.context("the floods were counted")?;
    let (admitted, refused) = (counts.queries[ROUTE_CACHE], counts.queries[ROUTE_LIMITED]);
    limited += refused;
    let allowed = LIMIT_BURST + (LIMIT_QPS as f64 * elapsed.as_secs_f64()).ceil() as u64 + 1;
    eprintln!(
        "a flood from each of {cpus} CPUs: {admitted} admitted, {refused} refused in {elapsed:?} \
         (at most {allowed} allowed)"
    );
    assert!(
        (LIMIT_BURST..=allowed).contains(&admitted) && refused > 10 * admitted,
        "a flood from each of {cpus} CPUs: admitted {admitted} (at most {allowed} in \
         {elapsed:?}), refused {refused}"
    );

    // A cgroup exempt from the limit is counted, never held.
    let answers = ask(&harness.sandbox, &unlimited, node, 200)?;
    assert!(
        answers.iter().all(|answer| answer.starts_with("cache")),
        "{answers:?}"
    );
    let free = counted(&harness, unlimited.path())?.context("the exempt cgroup was counted")?;
    assert_eq!(
        (free.queries[ROUTE_CACHE], free.queries[ROUTE_LIMITED]),
        (200, 0),
        "{free:?}"
    );

    // The agent's node totals count the refusals under their own route.
    harness.wait_until(
        "the agent's totals count the limited queries",
        Duration::from_secs(10),
        |harness| {
            Ok(harness
                .agent
                .stats
                .workloads()
                .is_some_and(|view| view.queries_total[ROUTE_LIMITED] == limited))
        },
    )?;
    Ok(())
}

/// A UDP query to the node listener.
fn node_query() -> Query {
    Query::new(dns(NODE_LISTENER), Transport::Udp)
}

/// One query of a held client, asserted answered by the cache, and how long it took.
fn timed_ask(client: &mut bpf_tests::sandbox::HeldClient) -> anyhow::Result<Duration> {
    let started = std::time::Instant::now();
    let outcome = client.ask()?;
    let took = started.elapsed();
    anyhow::ensure!(
        outcome.ok && who(outcome.answer()) == "cache",
        "the kept socket's query: {outcome:?}"
    );
    Ok(took)
}

/// The `p`th percentile of `samples`.
fn percentile(samples: &mut [Duration], p: usize) -> Duration {
    samples.sort_unstable();
    samples
        .get((samples.len().saturating_sub(1)) * p / 100)
        .copied()
        .unwrap_or_default()
}

/// The cgroup the configuration exempts from the rate limit.
const UNLIMITED: &str = "unlimited";
/// `ECONNREFUSED`: a query over its workload's rate, where the kernel lets the programs say so.
const ECONNREFUSED: i32 = 111;
/// `EPERM`: the same before Linux 6.1.
const EPERM: i32 = 1;
