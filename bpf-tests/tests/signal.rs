//! A cache told to stop moves its DNS before it closes a socket (#28): the `signal_deliver`
//! program fails its listeners over the moment the process that bound the cache's sockets is
//! delivered SIGTERM, with no agent running, so the queries sent while it shuts down (here it
//! keeps its sockets and answers for a while, as unbound under load or CoreDNS in `lameduck` do)
//! go upstream instead of into a cache that is going away.

use std::time::Duration;

use bpf_tests::{
    cli::{start_agent, stop_agent, uninstall},
    command::TestProcess,
    dns::now_ms,
    harness::{NODE_ID, answered_by, standard_listeners, wait_for_cache, write_standard_config},
    pace::{paced_ms, pause, wait_until},
    sandbox::{CacheSpec, Ns, Sandbox},
    shipped,
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns},
};
use nix::sys::signal::Signal;
use redirector::datapath::Maps;
use redirector_common::{binds::CacheTask, datapath::listener_bit, names};

#[test]
fn a_cache_told_to_stop_moves_dns_before_it_closes_its_sockets_with_no_agent() -> anyhow::Result<()>
{
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&config)?;
    // A cache that binds while the programs run (its process is recorded at its binds), and that
    // goes on serving for a while after SIGTERM.
    sandbox.stop_server("cache")?;
    sandbox.start_cache("cache", &lingering_cache())?;
    wait_for_cache(&sandbox, "the agent confirms the new cache")?;
    stop_agent(&mut agent)?;
    signal_moves_dns_with_nothing_lost(&mut sandbox)?;
    uninstall(&config)?;
    Ok(())
}

/// A cache that was running before the programs were attached (every node at first install, and
/// at an upgrade from a release before the signal program) is known as the cache from the
/// agent's start: its first SIGTERM moves DNS before it closes a socket, as a cache that bound
/// under the programs does.
#[test]
fn a_cache_running_before_the_agent_is_known_from_its_start() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_upstreams()?;
    sandbox.start_cache("cache", &lingering_cache())?;
    let config = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&config)?;
    wait_for_cache(&sandbox, "the agent confirms the cache")?;
    let pid = sandbox.process("cache")?.pid();
    let known = cache_task(&sandbox, pid)?;
    assert!(
        known.is_some_and(|task| task.listeners & listener_bit(NODE_ID) != 0),
        "the cache that predates the programs is not known as the node listener's: {known:?}"
    );
    stop_agent(&mut agent)?;
    signal_moves_dns_with_nothing_lost(&mut sandbox)?;
    uninstall(&config)?;
    Ok(())
}

/// The test cache, answering for a while after SIGTERM before it closes its sockets (as unbound
/// under load or CoreDNS in `lameduck` do).
fn lingering_cache() -> CacheSpec {
    let mut cache = CacheSpec::standard();
    cache
        .extra_args
        .extend(["--term-linger-ms".to_owned(), paced_ms(600).to_string()]);
    cache
}

/// `CACHE_TASKS`' entry for process `pid`.
fn cache_task(sandbox: &Sandbox, pid: u32) -> anyhow::Result<Option<CacheTask>> {
    let map = aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(
        sandbox.pin_dir().join("maps").join(names::MAP_CACHE_TASKS),
    )?)?;
    let map = aya::maps::HashMap::<_, u32, CacheTask>::try_from(map)?;
    Ok(map.get(&pid, 0).ok())
}

/// With no agent, under a stream of queries from fresh, kept connected and kept unconnected
/// sockets: SIGTERM to the lingering cache moves every query sent while it still holds its
/// sockets upstream, and none is lost after the signal.
fn signal_moves_dns_with_nothing_lost(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    let stream = Stream::start_with(
        sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        bpf_tests::pace::paced(Duration::from_secs(120)),
        &["--kinds", "fresh,connected,long"],
    )?;
    pause(500);
    sandbox.process("cache")?.signal(Signal::SIGTERM)?;
    // Read once the kill returned; a query begun within this millisecond may predate it.
    let signalled = now_ms();
    let exited = sandbox
        .process("cache")?
        .wait_exit(Duration::from_secs(30))?;
    let closed = now_ms();
    assert!(
        exited.success(),
        "the cache lingered and exited: {exited:?}"
    );
    let report = stream.stop_once(
        "queries after the cache exited",
        Duration::from_secs(20),
        |report| {
            report
                .records
                .iter()
                .filter(|record| record.begun_ms > closed)
                .count()
                > 20
        },
    )?;
    println!(
        "signal at +{} ms, cache gone at +{} ms: {}",
        signalled.saturating_sub(report.started_ms()),
        closed.saturating_sub(report.started_ms()),
        report.summary()
    );

    // While the cache still held its sockets (and answered), the queries sent went upstream:
    // before this program, every one of them went to the cache until its last close.
    let holding: Vec<_> = report
        .between(
            signalled + paced_ms(50),
            closed.saturating_sub(paced_ms(50)),
        )
        .collect();
    assert!(
        holding.len() > 10,
        "too few queries while the cache lingered: {}",
        report.summary()
    );
    for record in &holding {
        assert!(
            StreamReport::answered_by(record).starts_with("upstream"),
            "a query sent after the signal, while the cache still held its sockets, was \
             answered by {}: {}",
            StreamReport::answered_by(record),
            report.summary()
        );
    }
    // Nothing was lost: not while the cache lingered, not after it closed.
    assert_eq!(
        report.failures_between(signalled + 1, u64::MAX),
        0,
        "{}",
        report.summary()
    );
    Ok(())
}

/// The node listener's `down_epoch`.
fn node_epoch(sandbox: &Sandbox) -> anyhow::Result<u64> {
    Ok(Maps::open_pinned(&sandbox.pin_dir())?
        .socket_counts(NODE_ID)?
        .down_epoch)
}

/// A process recorded as the node listener's cache whose pid was reused by another process (in
/// another cgroup) is not taken for the cache: its SIGTERM moves nothing. The same process
/// recorded in its own cgroup moves the listener upstream at the signal, and since it survives
/// the signal (a false alarm), the agent's probes bring the cache back.
#[test]
fn a_signal_to_a_reused_pid_moves_nothing_and_a_false_alarm_fails_back() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let agent = start_agent(&config)?;
    let (mut command, procs) = sandbox.client_command(Ns::Pod, sandbox.cgroup(), "python3")?;
    command.args([
        "-c",
        // The handler writes with os.write: a signal that lands while `print('ready')` still
        // flushes would make a print in the handler a reentrant call, which Python refuses.
        "import os, signal, time\n\
         count = [0]\n\
         def survive(*_):\n    count[0] += 1\n    os.write(1, f'survived {count[0]}\\n'.encode())\n\
         signal.signal(signal.SIGTERM, survive)\n\
         print('ready', flush=True)\n\
         time.sleep(600)",
    ]);
    let mut survivor = TestProcess::start(
        "a process that survives SIGTERM",
        command,
        "ready",
        Duration::from_secs(10),
    )?;
    drop(procs);
    let own_cgroup = {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(sandbox.cgroup().path())?.ino()
    };
    let mut tasks: aya::maps::HashMap<aya::maps::MapData, u32, CacheTask> =
        aya::maps::HashMap::try_from(aya::maps::Map::from_map_data(
            aya::maps::MapData::from_pin(
                sandbox.pin_dir().join("maps").join(names::MAP_CACHE_TASKS),
            )?,
        )?)?;
    let pid = survivor.pid();
    let record = |tasks: &mut aya::maps::HashMap<aya::maps::MapData, u32, CacheTask>,
                  cgroup_id: u64|
     -> anyhow::Result<()> {
        let task = CacheTask {
            listeners: listener_bit(NODE_ID),
            cgroup_id,
        };
        tasks.insert(pid, task, 0)?;
        Ok(())
    };

    // Recorded from another cgroup: a cache's pid, reused.
    let epoch = node_epoch(&sandbox)?;
    record(&mut tasks, own_cgroup + 1)?;
    survivor.signal(Signal::SIGTERM)?;
    survivor.wait_for_line("survived 1", Duration::from_secs(10))?;
    pause(200);
    assert_eq!(
        node_epoch(&sandbox)?,
        epoch,
        "a reused pid's signal recorded a death"
    );
    assert_eq!(answered_by(&sandbox)?, "cache");

    // Recorded from its own cgroup: the signal moves the listener at once, with no close.
    record(&mut tasks, own_cgroup)?;
    survivor.signal(Signal::SIGTERM)?;
    survivor.wait_for_line("survived 2", Duration::from_secs(10))?;
    assert!(
        node_epoch(&sandbox)? > epoch,
        "the signal recorded no death"
    );
    // The probes confirm the cache that survived, and it gets its DNS back.
    wait_for_cache(&sandbox, "the agent fails back to the cache that survived")?;
    drop(survivor);
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// A cache of two threads that bound its socket while the programs ran (so it is recorded) and
/// that, on SIGUSR1, execs a new image of itself serving the same socket: the exec kills its other
/// thread with SIGKILL (a false alarm of the signal program), and its socket never closes.
const EXECING_CACHE: &str = r#"
import os, signal, socket, struct, sys, threading, time

def serve(sock):
    while True:
        try:
            data, peer = sock.recvfrom(512)
        except InterruptedError:
            continue
        if len(data) < 17:
            continue
        end = data.index(b"\x00", 12) + 5
        qtype = struct.unpack(">H", data[end - 4:end - 2])[0]
        answer = b""
        if qtype == 1:
            answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 30, 4) + bytes([192, 0, 2, 53])
        header = data[:2] + struct.pack(">HHHHH", 0x8180, 1, len(answer) and 1, 0, 0)
        sock.sendto(header + data[12:end] + answer, peer)

if sys.argv[1] == "bind":
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((sys.argv[2], 53))
    os.set_inheritable(sock.fileno(), True)
    threading.Thread(target=lambda: time.sleep(3600), daemon=True).start()
    def exec_self(*_):
        os.execv(sys.executable, [sys.executable, sys.argv[0], "fd", str(sock.fileno())])
    signal.signal(signal.SIGUSR1, exec_self)
    print("ready", flush=True)
    serve(sock)
else:
    print("execed", flush=True)
    serve(socket.socket(fileno=int(sys.argv[2])))
"#;

/// An `execve` in a multi-threaded cache shows SIGKILL on its other threads: the listener moves
/// upstream at it (a false alarm: the cache lives on, its socket never closed), says so, and is
/// back on the cache once the probes confirm it after the signal hold.
#[test]
fn an_exec_in_a_multithreaded_cache_moves_dns_until_the_probes_confirm_it() -> anyhow::Result<()> {
    use redirector_common::activity::FLIP_SIGNALLED;
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_upstreams()?;
    let config = write_standard_config(&sandbox)?;
    let agent = start_agent(&config)?;
    let script = sandbox.write_file("execing-cache.py", EXECING_CACHE)?;
    let cgroup = sandbox.skipped_cgroup().path().to_owned();
    sandbox.start_process(
        "cache",
        Some(Ns::Node),
        Some(&cgroup),
        "python3",
        &[
            script.display().to_string(),
            "bind".to_owned(),
            NODE_LISTENER.to_string(),
        ],
        "ready",
    )?;
    wait_for_cache(&sandbox, "the agent confirms the cache")?;
    let epoch = node_epoch(&sandbox)?;
    sandbox.process("cache")?.signal(Signal::SIGUSR1)?;
    sandbox
        .process("cache")?
        .wait_for_line("execed", Duration::from_secs(10))?;
    let maps = Maps::open_pinned(&sandbox.pin_dir())?;
    let activity = maps.cache_activity(NODE_ID)?;
    let counts = maps.socket_counts(NODE_ID)?;
    assert!(counts.down_epoch > epoch, "the exec moved nothing");
    assert_eq!(activity.flip_reason, FLIP_SIGNALLED, "{activity:?}");
    assert!(counts.udp > 0, "the cache's socket closed: {counts:?}");
    assert!(
        answered_by(&sandbox)?.starts_with("upstream"),
        "DNS stayed on the cache at the exec"
    );
    // The probes answer throughout; after the hold (1.5 s in the tests) they confirm it.
    wait_until(
        "the probes give the cache that survived its exec its DNS back",
        Duration::from_secs(15),
        Duration::from_millis(50),
        || Ok(answered_by(&sandbox)? == "cache"),
    )?;
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// A dnsmasq started after the agent that daemonizes and drops to its own user, as its package
/// runs it: the process that bound its sockets exits, and its grandchild serves them. The agent
/// runs as shipped (`shipped`: it cannot read the daemon's descriptors). The programs recorded
/// the binder at its binds and record the server at its first read (the agent's probe), so its
/// first SIGTERM, under a query every 2 ms from fresh and kept sockets, moves the DNS before it
/// closes a socket: nothing sent after the signal is lost.
#[test]
fn a_cache_that_daemonized_is_known_by_the_process_that_reads_its_sockets() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_upstreams()?;
    let (config, mut agent) = shipped::start_agent_on(&sandbox, &standard_listeners(&sandbox))?;

    let pid_file = sandbox.write_file("dnsmasq.pid", "")?;
    let mut command = sandbox.netns(Ns::Node).command("dnsmasq");
    command
        .args([
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--user=dnsmasq",
            "--log-facility=/dev/null",
            "--cache-size=0",
            &format!("--pid-file={}", pid_file.display()),
            &format!("--listen-address={NODE_LISTENER}"),
            "--port=53",
            &format!("--address=/#/{}", bpf_tests::topology::CACHE.a),
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // In the cache's cgroup, under the attach point: the sandbox's cgroups are removed with every
    // process left in them, the daemon too, should the test fail before it ends it.
    let procs = bpf_tests::cgroup::open_procs(sandbox.skipped_cgroup().path())?;
    bpf_tests::command::join_cgroup_before_exec(&mut command, &procs);
    let mut binder = command.spawn()?;
    let binder_pid = binder.id();
    anyhow::ensure!(
        binder.wait()?.success(),
        "dnsmasq did not daemonize (it exits 0 once its daemon serves)"
    );
    drop(procs);
    let mut server = 0;
    wait_until(
        "dnsmasq writes its daemon's pid",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            server = std::fs::read_to_string(&pid_file)?
                .trim()
                .parse()
                .unwrap_or(0);
            Ok(server != 0)
        },
    )?;
    assert_ne!(
        server, binder_pid,
        "dnsmasq served from the process that bound"
    );
    wait_for_cache(&sandbox, "the agent confirms the daemonized cache")?;
    wait_until(
        "the programs learn the process that reads the cache's sockets",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            Ok(cache_task(&sandbox, server)?
                .is_some_and(|task| task.listeners & listener_bit(NODE_ID) != 0))
        },
    )?;

    let stream = Stream::start_with(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        bpf_tests::pace::paced(Duration::from_secs(3)),
        &["--kinds", "fresh,long", "--interval-ms", "2"],
    )?;
    pause(1000);
    let server_pid = nix::unistd::Pid::from_raw(i32::try_from(server)?);
    nix::sys::signal::kill(server_pid, Signal::SIGTERM)?;
    let signalled = now_ms();
    wait_until(
        "the daemonized dnsmasq exits",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || Ok(!std::path::Path::new(&format!("/proc/{server}")).exists()),
    )?;
    let report = stream.finish()?;
    let activity = Maps::open_pinned(&sandbox.pin_dir())?.cache_activity(NODE_ID)?;
    report.assert_signal_lost_nothing_after(signalled, &activity, "the daemonized dnsmasq");
    assert_eq!(activity.signalled, 1, "{activity:?}");
    stop_agent(&mut agent)?;
    shipped::uninstall(&sandbox, &config)?;
    Ok(())
}
