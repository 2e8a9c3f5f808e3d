//! What operators see: `/metrics` agrees with the kernel and with what happened, `/readyz` waits
//! for every pool while systemd hears READY=1 as soon as the programs steer, `redirector status`
//! tells the truth
//! with the agent running and stopped, logs come as JSON on request, and mistakes an operator
//! can make get one sentence and the fix.

use std::{os::unix::net::UnixDatagram, time::Duration};

use bpf_tests::{
    cli::{logged_metrics_address, redirector, start_agent, start_agent_with},
    command::run,
    fake_kube::{FakeKube, endpoint_slice},
    harness::{Harness, NODE_ID, standard_listeners, write_standard_config},
    http::{get, sample},
    pace::pause,
    sandbox::{Ns, Query, Sandbox, Transport},
    tools,
    topology::{NODE_LISTENER, dns, who},
};
use nix::sys::signal::Signal;
use redirector_common::settings::Mode;

/// A sandbox with the standard servers, and an agent configuration for it.
fn standard_sandbox() -> anyhow::Result<(Sandbox, std::path::PathBuf)> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    Ok((sandbox, config))
}

fn queries(sandbox: &Sandbox, count: u16) -> anyhow::Result<Vec<&'static str>> {
    let outcomes = sandbox.queries_in(
        Ns::Pod,
        sandbox.cgroup(),
        Query::new(dns(NODE_LISTENER), Transport::Udp),
        count,
    )?;
    Ok(outcomes
        .iter()
        .map(|outcome| who(outcome.answer()))
        .collect())
}

#[test]
fn metrics_agree_with_the_kernel_and_with_what_happened() -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let address = harness.agent.metrics.expect("metrics are served");
    assert!(
        queries(&harness.sandbox, 5)?
            .iter()
            .all(|who| *who == "cache")
    );
    harness.set_mode(NODE_ID, Mode::Upstream)?;
    assert!(
        queries(&harness.sandbox, 3)?
            .iter()
            .all(|who| who.starts_with("upstream"))
    );
    // The override is seen by the control loop at its next turn.
    harness.wait_until("the override observed", Duration::from_secs(5), |harness| {
        Ok(!harness.agent.stats.transitions("node").is_empty())
    })?;
    pause(300);

    let response = get(address, "/metrics")?;
    assert_eq!(response.status, 200);
    let metrics = response.body;
    let node = |decision: &str| {
        sample(
            &metrics,
            &format!(
                "redirector_steering_decisions_total{{listener=\"node\",family=\"ipv4\",protocol=\"udp\",decision=\"{decision}\"}}"
            ),
        )
    };
    let kernel = harness.counters(NODE_ID)?;
    assert_eq!(node("cache"), Some(5.0), "{metrics}");
    assert_eq!(node("upstream"), Some(3.0), "{metrics}");
    assert_eq!(kernel.to_cache, 5);
    assert_eq!(kernel.to_upstream, 3);
    assert_eq!(
        sample(
            &metrics,
            "redirector_listener_route{listener=\"node\",route=\"upstream\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "redirector_listener_reason{listener=\"node\",reason=\"override\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "redirector_listener_reason{listener=\"node\",reason=\"healthy\"}"
        ),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "redirector_route_transitions_total{listener=\"node\",cause=\"override\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    let failover = sample(
        &metrics,
        "redirector_failover_seconds_total{listener=\"node\"}",
    );
    assert!(failover.is_some_and(|seconds| seconds > 0.2), "{metrics}");
    assert_eq!(
        sample(
            &metrics,
            "redirector_pool_backends{listener=\"node\",source=\"static\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &metrics,
            "redirector_pool_backends{listener=\"cluster\",source=\"static\"}"
        ),
        Some(0.0)
    );
    assert!(
        sample(
            &metrics,
            "redirector_cache_sockets{listener=\"node\",protocol=\"udp\"}"
        )
        .is_some_and(|count| count >= 1.0),
        "{metrics}"
    );
    assert!(
        sample(
            &metrics,
            "redirector_probes_total{listener=\"node\",result=\"success\"}"
        )
        .is_some_and(|count| count >= 1.0),
        "{metrics}"
    );
    assert!(
        sample(
            &metrics,
            "redirector_probe_duration_seconds_count{listener=\"node\"}"
        )
        .is_some_and(|count| count >= 1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "redirector_conntrack_bypass_active{status=\"active\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "redirector_errors_total{kind=\"pool_write\"}"),
        Some(0.0)
    );
    assert_eq!(
        sample(&metrics, "redirector_ready"),
        Some(1.0),
        "static pools: ready at once"
    );
    assert_eq!(
        sample(&metrics, "redirector_pool_syncs_total{source=\"static\"}"),
        None,
        "static pools are not synced from a source"
    );
    assert!(metrics.ends_with("# EOF\n"), "OpenMetrics text");
    assert_eq!(get(address, "/healthz")?.status, 200);
    assert_eq!(get(address, "/readyz")?.status, 200);
    assert_eq!(get(address, "/nothing")?.status, 404);
    Ok(())
}

#[test]
fn readyz_waits_for_every_pool_and_healthz_does_not() -> anyhow::Result<()> {
    let kube = FakeKube::start()?;
    kube.apply(endpoint_slice(
        "kube-dns-v4",
        "kube-dns",
        "IPv4",
        53,
        &[("10.244.0.5", true, false)],
    ));
    kube.set_down(true);
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let kubeconfig = sandbox.write_file("kubeconfig", &kube.kubeconfig())?;
    let listeners = "[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\nupstreams = [\"198.18.2.2\"]\n\n[[listener]]\nname = \"cluster\"\naddress = \"169.254.10.11\"\nkube_dns = \"kube-system/kube-dns\"\n";
    let tables = format!(
        "[interface]\nmanage = false\n\n[kubernetes]\nkubeconfig = {:?}\n",
        kubeconfig.display().to_string()
    );
    let text = sandbox.config_toml_with(listeners, &tables);
    let harness = Harness::with_config(sandbox, &text)?;
    let address = harness.agent.metrics.expect("metrics are served");

    // The API server is down: DNS works, the agent is alive, but not ready.
    pause(500);
    assert_eq!(queries(&harness.sandbox, 1)?, ["cache"]);
    assert_eq!(get(address, "/healthz")?.status, 200);
    let readyz = get(address, "/readyz")?;
    assert_eq!(readyz.status, 503, "{readyz:?}");
    assert!(
        readyz.body.contains("waiting for the first sync"),
        "{readyz:?}"
    );
    let metrics = get(address, "/metrics")?.body;
    assert_eq!(sample(&metrics, "redirector_ready"), Some(0.0), "{metrics}");

    kube.set_down(false);
    harness.wait_until(
        "ready once the cluster pool synced",
        Duration::from_secs(15),
        |_| Ok(get(address, "/readyz")?.status == 200),
    )?;
    let metrics = get(address, "/metrics")?.body;
    assert_eq!(
        sample(
            &metrics,
            "redirector_pool_backends{listener=\"cluster\",source=\"kubernetes\"}"
        ),
        Some(1.0)
    );
    assert!(
        sample(
            &metrics,
            "redirector_pool_syncs_total{source=\"kubernetes\"}"
        )
        .is_some_and(|count| count >= 1.0),
        "{metrics}"
    );
    assert!(
        sample(&metrics, "redirector_errors_total{kind=\"kube_api\"}")
            .is_some_and(|count| count >= 1.0),
        "the outage was counted: {metrics}"
    );
    assert!(
        sample(
            &metrics,
            "redirector_pool_last_sync_age_seconds{source=\"kubernetes\"}"
        )
        .is_some_and(|age| age < 15.0),
        "{metrics}"
    );
    Ok(())
}

#[test]
fn healthz_answers_through_a_flood_of_idle_and_slow_connections() -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let harness = Harness::standard(tools!())?;
    let address = harness.agent.metrics.expect("metrics are served");
    // Twice the agent's connection limit: half that never send a byte, half that send a
    // request head slowly (slowloris), all held open.
    let mut flood = Vec::new();
    for index in 0..256 {
        let mut stream = std::net::TcpStream::connect(address)?;
        if index % 2 == 1 {
            stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")?;
        }
        flood.push(stream);
    }
    for attempt in 0..5 {
        let healthz = get(address, "/healthz")?;
        assert_eq!(healthz.status, 200, "attempt {attempt}: {healthz:?}");
    }
    // The oldest gave way to the newcomers.
    let oldest = &mut flood[0];
    oldest.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut byte = [0u8; 1];
    let read = oldest.read(&mut byte);
    assert!(
        matches!(read, Ok(0))
            || read
                .as_ref()
                .is_err_and(|error| error.kind() == std::io::ErrorKind::ConnectionReset),
        "the oldest idle connection is closed by the agent: {read:?}"
    );
    let newest = flood.last_mut().expect("connections were opened");
    newest.set_nonblocking(true)?;
    assert!(
        newest
            .read(&mut byte)
            .is_err_and(|error| error.kind() == std::io::ErrorKind::WouldBlock),
        "the newest connection is still open"
    );
    Ok(())
}

#[test]
fn systemd_hears_ready_once_the_programs_steer_and_logs_can_be_json() -> anyhow::Result<()> {
    let (sandbox, config) = standard_sandbox()?;
    let socket_path = sandbox.lock_file().with_file_name("notify.sock");
    let notifications = UnixDatagram::bind(&socket_path)?;
    notifications.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut agent = start_agent_with(
        &config,
        &["--log-format", "json"],
        &[("NOTIFY_SOCKET", socket_path.as_os_str())],
    )?;
    let mut buffer = [0u8; 256];
    let mut next = || -> anyhow::Result<String> {
        let length = notifications.recv(&mut buffer)?;
        Ok(String::from_utf8_lossy(&buffer[..length]).into_owned())
    };
    let ready = next()?;
    assert!(ready.starts_with("READY=1\nSTATUS=steering"), "{ready:?}");
    let address = logged_metrics_address(&mut agent)?;
    // Static pools only: synced by the control loop's first turn, which says so to systemd;
    // from then on /readyz agrees (READY=1 itself comes before the pools, on purpose).
    assert_eq!(next()?, "STATUS=steering; every upstream pool synced");
    assert_eq!(get(address, "/readyz")?.status, 200);

    let steering = agent
        .printed()
        .iter()
        .find(|line| line.contains("redirector is steering"))
        .cloned()
        .expect("the agent logged that it steers");
    let record: serde_json::Value = serde_json::from_str(&steering)
        .map_err(|error| anyhow::anyhow!("not JSON: {steering}: {error}"))?;
    assert_eq!(record["message"], "redirector is steering", "{record}");
    assert_eq!(record["level"], "INFO", "{record}");

    agent.signal(Signal::SIGTERM)?;
    assert_eq!(next()?, "STOPPING=1");
    agent.wait_exit(Duration::from_secs(10))?;
    assert_eq!(
        redirector(&["uninstall", "--config", &config.display().to_string()])?.code,
        0
    );
    Ok(())
}

#[test]
fn status_tells_the_truth_with_the_agent_running_and_stopped() -> anyhow::Result<()> {
    let (sandbox, config) = standard_sandbox()?;
    let config_arg = config.display().to_string();
    let mut agent = start_agent(&config)?;
    assert_eq!(queries(&sandbox, 2)?, ["cache", "cache"]);

    let status = redirector(&["status", "--config", &config_arg])?;
    assert_eq!(status.code, 0, "{status:?}");
    let text = &status.stdout;
    // The agent runs the binary that runs `status`: the same release, said once.
    assert!(
        text.starts_with(&format!(
            "version:   redirector {}\nagent:     running (pid {}, this release)\n",
            redirector::release::describe(),
            agent.pid()
        )),
        "{text}"
    );
    let programs = redirector::datapath::ALL_PROGRAMS.len();
    assert!(
        text.contains(&format!("programs:  {programs} of {programs} attached")),
        "{text}"
    );
    assert!(
        text.contains("bypass table inet redirector present"),
        "{text}"
    );
    // Every kernel the tests run on has every feature (the degraded one is forced in steering).
    assert!(text.contains(": every feature redirector uses\n"), "{text}");
    let row = text
        .lines()
        .find(|line| line.starts_with("node "))
        .expect("a row for node");
    for cell in [
        "169.254.10.10",
        "auto",
        "cache",
        "the cache is healthy",
        "up",
        "198.18.2.2:53,198.18.2.3:53",
    ] {
        assert!(row.contains(cell), "{cell} in {row}");
    }

    let json = redirector(&["status", "--config", &config_arg, "--json"])?;
    let report: serde_json::Value = serde_json::from_str(&json.stdout)?;
    assert_eq!(report["agent"]["running"], true);
    assert_eq!(report["agent"]["binary"]["is"], "same");
    assert_eq!(report["version"]["release"], redirector::release::VERSION);
    assert_eq!(
        report["programs"]["attached"].as_array().map(Vec::len),
        Some(programs)
    );
    let node = &report["listeners"][0];
    assert_eq!(node["name"], "node");
    assert_eq!(node["route"], "cache");
    assert_eq!(node["counters"]["udp"]["to_cache"], 2, "{node}");
    assert!(
        node["cache_sockets"][0]
            .as_i64()
            .is_some_and(|udp| udp >= 1),
        "{node}"
    );

    assert_eq!(
        bpf_tests::cli::set_state(&sandbox, "node", "upstream")?.code,
        0
    );
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    let stopped = redirector(&["status", "--config", &config_arg])?;
    assert_eq!(stopped.code, 0, "{stopped:?}");
    assert!(
        stopped
            .stdout
            .lines()
            .nth(1)
            .is_some_and(|line| line.starts_with("agent:     NOT RUNNING")),
        "{}",
        stopped.stdout
    );
    let row = stopped
        .stdout
        .lines()
        .find(|line| line.starts_with("node "))
        .expect("a row for node");
    assert!(
        row.contains("upstream") && row.contains("operator override"),
        "{row}"
    );

    assert_eq!(redirector(&["uninstall", "--config", &config_arg])?.code, 0);
    let gone = redirector(&["status", "--config", &config_arg])?;
    assert_eq!(gone.code, 1);
    assert!(
        gone.stderr.starts_with("error: no redirector state under"),
        "{gone:?}"
    );
    Ok(())
}

#[test]
fn operator_mistakes_get_one_sentence_and_the_fix() -> anyhow::Result<()> {
    let (sandbox, config) = standard_sandbox()?;
    let agent = start_agent(&config)?;
    let pin_dir = sandbox.pin_dir().display().to_string();

    // Not root: status, and state.
    let binary = bpf_tests::sandbox::redirector_bin().display().to_string();
    for args in [
        vec!["status", "--pin-dir", &pin_dir],
        vec![
            "state",
            "--listener",
            "node",
            "--set",
            "cache",
            "--pin-dir",
            &pin_dir,
        ],
    ] {
        let mut full = vec!["--reuid=65534", "--regid=65534", "--clear-groups", &binary];
        full.extend(args.iter().copied());
        let error = run("setpriv", &full).expect_err("refused without root");
        let message = format!("{error:#}");
        assert!(
            message.contains("needs root") && message.contains("sudo"),
            "{message}"
        );
        assert!(
            !message.contains("backtrace") && !message.contains("panicked"),
            "{message}"
        );
    }
    // No state where it looks.
    let nowhere = sandbox.lock_file().with_file_name("no-pins-here");
    let missing = redirector(&["status", "--pin-dir", &nowhere.display().to_string()])?;
    assert_eq!(missing.code, 1);
    assert_eq!(missing.stderr.lines().count(), 1, "{missing:?}");
    assert!(missing.stderr.contains("(give --pin-dir)"), "{missing:?}");
    // A pin directory on no bpf filesystem.
    let not_bpffs = sandbox.write_file(
        "not-bpffs.toml",
        &sandbox
            .config_toml(&standard_listeners(&sandbox))
            .replace(&pin_dir, &nowhere.display().to_string()),
    )?;
    drop(agent);
    let refused = redirector(&["run", "--config", &not_bpffs.display().to_string()])?;
    assert_eq!(refused.code, 1);
    assert!(
        refused.stderr.contains("is not on a bpf filesystem")
            && refused.stderr.contains("mount -t bpf bpf"),
        "{refused:?}"
    );
    assert!(!refused.stderr.contains("backtrace"), "{refused:?}");
    Ok(())
}

/// The translated size of a loaded program, from bpftool.
fn xlated_bytes(id: u32) -> anyhow::Result<u64> {
    let shown = run("bpftool", ["prog", "show", "id", &id.to_string(), "--json"])?;
    let info: serde_json::Value = serde_json::from_str(&shown)?;
    info["bytes_xlated"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no bytes_xlated in {shown}"))
}

fn program_bytes(sandbox: &Sandbox, name: &str) -> anyhow::Result<u64> {
    let id = redirector::datapath::pinned_program_ids(&sandbox.pin_dir())
        .into_iter()
        .find(|(program, _)| *program == name)
        .map(|(_, id)| id)
        .ok_or_else(|| anyhow::anyhow!("{name} is not attached"))?;
    xlated_bytes(id)
}

#[test]
fn kernel_log_reports_decisions_and_costs_nothing_when_off() -> anyhow::Result<()> {
    let (mut sandbox, config) = standard_sandbox()?;
    let mut agent = start_agent(&config)?;
    let quiet = (
        program_bytes(&sandbox, "dns_connect4")?,
        program_bytes(&sandbox, "dns_release")?,
    );
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;

    let mut agent = start_agent_with(&config, &["--kernel-log"], &[])?;
    let logging = (
        program_bytes(&sandbox, "dns_connect4")?,
        program_bytes(&sandbox, "dns_release")?,
    );
    println!("xlated bytes (connect4, sock_release): kernel_log off {quiet:?}, on {logging:?}");
    assert!(
        quiet.0 < logging.0 && quiet.1 < logging.1,
        "off, the verifier removes the logging code: {quiet:?} vs {logging:?}"
    );

    sandbox.stop_server("cache")?;
    assert!(queries(&sandbox, 1)?[0].starts_with("upstream"));
    agent.wait_for_line("DNS to upstream", Duration::from_secs(5))?;
    let printed = agent.printed().join("\n");
    assert!(
        printed.contains("the cache's last UDP socket closed; DNS fails over"),
        "{printed}"
    );
    drop(agent);
    assert_eq!(
        redirector(&["uninstall", "--config", &config.display().to_string()])?.code,
        0
    );
    Ok(())
}
