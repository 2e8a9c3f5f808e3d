//! The agent's lifecycle: restarts (kill -9, SIGTERM, a new binary) under a continuous query
//! stream lose no query, state survives them, one agent runs per node, pins of another version
//! are refused, uninstall leaves nothing behind, the node pool follows resolv.conf, and after a
//! reboot (no pins) DNS is steered from the agent's first start.

use std::{net::IpAddr, time::Duration};

use anyhow::Context as _;
use bpf_tests::{
    cli::{redirector, redirector_with_env, set_state, start_agent, stop_agent, uninstall},
    command::{output_within, run},
    dns::now_ms,
    harness::{
        CLUSTER_ID, Harness, NODE_ID, answered_at, answered_by, node_reason, standard_listeners,
        wait_for_cache, write_standard_config,
    },
    pace::{paced, paced_ms, pause, wait_until},
    sandbox::{CacheSpec, Ns, Query, Sandbox, Transport},
    shipped,
    stream::Stream,
    tools,
    topology::{CLUSTER_LISTENER, NODE_LISTENER, UPSTREAM_A_V4, UPSTREAM_B_V4, dns, who},
};
use nix::sys::signal::Signal;
use redirector::datapath::Maps;
use redirector::datapath::layout::MIN_ADOPTABLE_LAYOUT;
use redirector_common::{
    LAYOUT_VERSION, activity::CacheActivity, addr::port_from_be, binds::CacheTask, names,
};

#[test]
fn restarts_under_a_query_stream_lose_no_query_and_keep_state() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&config)?;
    assert_eq!(set_state(&sandbox, "cluster", "upstream")?.code, 0);

    // Ended once the last agent has failed back: an agent's start takes as long as the machine
    // makes it (20 times longer under qemu's TCG than on the host), so the ceiling is stretched
    // with the pace, as the waits are.
    let stream = Stream::start(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_secs(120)),
    )?;
    let mut events = Vec::new();
    pause(800);
    drop(agent); // kill -9
    events.push(("agent killed (SIGKILL)", now_ms()));
    pause(600);
    agent = start_agent(&config)?; // adopts the pins
    events.push(("agent started, adopting", now_ms()));
    pause(800);
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    events.push(("agent stopped (SIGTERM)", now_ms()));
    pause(600);
    agent = start_agent(&config)?; // the same binary again: what an upgrade does
    events.push(("agent started again", now_ms()));
    pause(800);
    // A kill while the cache dies: the kernel alone fails over, the next agent fails back.
    drop(agent);
    events.push(("agent killed (SIGKILL)", now_ms()));
    let cache_killed = now_ms();
    sandbox.stop_server("cache")?;
    events.push(("cache killed (SIGKILL)", cache_killed));
    pause(500);
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    events.push(("cache restarted", now_ms()));
    let agent = start_agent(&config)?;
    let last_start = now_ms();
    events.push(("agent started", last_start));
    let report = stream.stop_once(
        "failback by the last agent",
        Duration::from_secs(10),
        |report| report.first_cache_answer(last_start).is_some(),
    )?;

    let start = report.started_ms();
    for (event, at) in &events {
        println!("  +{} ms  {event}", at.saturating_sub(start));
    }
    println!("restarts: {}", report.summary());
    assert!(report.records.len() > 300, "{}", report.summary());
    // The agent's restarts lose nothing. A query the cache had taken in when it was killed (one
    // per socket kind at most, each waits up to its 300 ms timeout, paced) is the cache's loss,
    // not the agent's; after the flip, nothing is lost again.
    let in_flight_since = cache_killed.saturating_sub(paced_ms(300));
    assert_eq!(
        report.failures_between(0, in_flight_since),
        0,
        "a query failed across the agent's restarts: {}",
        report.summary()
    );
    let flipped_by = report.flipped_by(cache_killed).unwrap_or_else(|| {
        panic!(
            "the kernel failed over without an agent: {}",
            report.summary()
        )
    });
    assert!(
        report.failures_between(in_flight_since, flipped_by + 1) <= 2,
        "more queries failed than were in flight at the cache's kill: {}",
        report.summary()
    );
    assert_eq!(
        report.failures_after_flip(flipped_by),
        0,
        "a query failed after the flip: {}",
        report.summary()
    );
    let back = report
        .last_cache_answer(u64::MAX)
        .map(|record| record.begun_ms);
    assert!(
        back.is_some_and(|back| back > flipped_by),
        "the new agent failed back: {}",
        report.summary()
    );

    // The operator's override survived every restart.
    let state = set_state(&sandbox, "cluster", "upstream")?;
    assert!(state.stdout.contains("(was upstream)"), "{state:?}");
    drop(agent);
    let uninstall = redirector(&["uninstall", "--config", &config.display().to_string()])?;
    assert_eq!(uninstall.code, 0, "{uninstall:?}");
    Ok(())
}

#[test]
fn one_agent_per_node_and_only_pins_from_before_the_layout_rule_are_refused() -> anyhow::Result<()>
{
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let config_arg = config.display().to_string();
    let mut first = start_agent(&config)?;

    let second = redirector(&["run", "--config", &config_arg])?;
    assert_eq!(second.code, 1, "{second:?}");
    assert!(
        second
            .stderr
            .contains(&format!("another redirector agent (pid {})", first.pid())),
        "{second:?}"
    );
    let refused = redirector(&["uninstall", "--config", &config_arg])?;
    assert_eq!(
        refused.code, 1,
        "uninstall must refuse while the agent runs: {refused:?}"
    );

    first.signal(Signal::SIGTERM)?;
    first.wait_exit(Duration::from_secs(10))?;
    let set_layout = |layout: u32| -> anyhow::Result<()> {
        let mut map = sandbox.pinned_array::<redirector_common::datapath::DatapathConfig>(
            names::MAP_DATAPATH_CONFIG,
        )?;
        let mut value = map.get(&0, 0)?;
        value.layout_version = layout;
        map.set(0, value, 0)?;
        Ok(())
    };
    // Pins of a newer release are adopted (the layout rule keeps them readable): a rollback.
    set_layout(LAYOUT_VERSION + 97)?;
    let mut adopted = start_agent(&config)?;
    assert!(
        adopted
            .printed()
            .iter()
            .any(|line| line.contains("adopting the maps an earlier agent pinned")),
        "{:?}",
        adopted.printed()
    );
    assert_eq!(answered_by(&sandbox)?, "cache");
    adopted.signal(Signal::SIGTERM)?;
    adopted.wait_exit(Duration::from_secs(10))?;

    // Pins of a layout from before the rule are refused, and the programs on them keep steering.
    set_layout(MIN_ADOPTABLE_LAYOUT - 1)?;
    let refused = redirector(&["run", "--config", &config_arg])?;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains(&format!(
            "holds the maps of a redirector release this one cannot adopt (layout {}",
            MIN_ADOPTABLE_LAYOUT - 1
        )),
        "{refused:?}"
    );
    assert!(
        refused.stderr.contains("DNS is still steered"),
        "{refused:?}"
    );
    assert!(refused.stderr.contains("--replace"), "{refused:?}");
    assert_eq!(
        answered_by(&sandbox)?,
        "cache",
        "the old programs still steer"
    );

    // --replace is the operator's reset.
    let mut command = std::process::Command::new(bpf_tests::sandbox::redirector_bin());
    command.args(["run", "--replace", "--config", &config_arg]);
    let replaced = bpf_tests::command::TestProcess::start(
        "redirector run --replace",
        command,
        "redirector is steering",
        Duration::from_secs(30),
    )?;
    assert_eq!(answered_by(&sandbox)?, "cache");
    drop(replaced);
    assert_eq!(redirector(&["uninstall", "--config", &config_arg])?.code, 0);
    Ok(())
}

#[test]
fn uninstall_leaves_no_program_map_pin_address_or_lock_behind() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    // A link of the sandbox's own for the listener addresses (the kernel has no dummy driver).
    let link = sandbox.add_listener_link()?;
    let listeners = "[[listener]]\nname = \"owned\"\naddress = \"169.254.20.10\"\nupstreams = [\"198.18.2.2\"]\n\n[[listener]]\nname = \"owned6\"\naddress = \"fd00:53::20\"\nupstreams = [\"fd00:2::2\"]\n";
    let tables = format!("[interface]\nname = {link:?}\nkind = \"existing\"\n");
    let config =
        sandbox.write_file("config.toml", &sandbox.config_toml_with(listeners, &tables))?;
    let config_arg = config.display().to_string();
    let mut agent = start_agent(&config)?;

    let node = sandbox.netns(Ns::Node).name().to_owned();
    let addresses = run("ip", ["-n", &node, "addr", "show", "dev", &link])?;
    assert!(addresses.contains("169.254.20.10/32"), "{addresses}");
    assert!(addresses.contains("fd00:53::20/128"), "{addresses}");
    assert!(
        !addresses.contains("tentative"),
        "IPv6 must be usable at once: {addresses}"
    );
    // Usable at once: a cache binds the IPv6 listener address right away.
    sandbox.start_cache(
        "cache",
        &CacheSpec {
            listen: vec![
                dns("169.254.20.10".parse::<IpAddr>()?),
                dns("fd00:53::20".parse::<IpAddr>()?),
            ],
            ..CacheSpec::standard()
        },
    )?;

    // A restart adopts the link and its addresses.
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    let agent = start_agent(&config)?;
    let programs = redirector::datapath::pinned_program_ids(&sandbox.pin_dir());
    assert_eq!(programs.len(), redirector::datapath::ALL_PROGRAMS.len());
    let maps = run(
        "bpftool",
        [
            "map",
            "show",
            "pinned",
            &sandbox
                .pin_dir()
                .join("maps/LISTENERS")
                .display()
                .to_string(),
        ],
    )?;
    let map_id: String = maps.chars().take_while(char::is_ascii_digit).collect();
    drop(agent);

    let uninstall = redirector(&["uninstall", "--config", &config_arg])?;
    assert_eq!(uninstall.code, 0, "{uninstall:?}");
    assert!(
        uninstall
            .stdout
            .contains(&format!("listener addresses removed from {link}")),
        "{uninstall:?}"
    );
    for (name, id) in programs {
        assert!(
            run("bpftool", ["prog", "show", "id", &id.to_string()]).is_err(),
            "program {name} ({id}) still loaded"
        );
    }
    assert!(
        run("bpftool", ["map", "show", "id", &map_id]).is_err(),
        "map {map_id} still exists"
    );
    assert_eq!(sandbox.attached_programs()?, "");
    assert!(!sandbox.pin_dir().exists());
    let addresses = run("ip", ["-n", &node, "addr", "show", "dev", &link])?;
    assert!(
        !addresses.contains("169.254.20.10") && !addresses.contains("fd00:53::20"),
        "{addresses}"
    );
    assert!(!sandbox.lock_file().exists(), "the lock file is gone");
    assert!(!sandbox.drain_socket().exists(), "the drain socket is gone");
    Ok(())
}

#[test]
fn listener_ids_and_modes_survive_a_changed_configuration() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let listeners = |names: &[&str]| -> String {
        names
            .iter()
            .map(|name| match *name {
                "node" => "[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\nupstreams = [\"198.18.2.2\"]\n",
                "cluster" => "[[listener]]\nname = \"cluster\"\naddress = \"169.254.10.11\"\nupstreams = [\"198.18.2.3\"]\n",
                _ => "[[listener]]\nname = \"v6\"\naddress = \"fd00:53::10\"\nupstreams = [\"fd00:2::2\"]\n",
            })
            .collect()
    };
    let write =
        |names: &[&str]| sandbox.write_file("config.toml", &sandbox.config_toml(&listeners(names)));
    let config = write(&["node", "cluster"])?;
    let mut agent = start_agent(&config)?;
    assert_eq!(set_state(&sandbox, "cluster", "upstream")?.code, 0);
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;

    // Reordered, with a new listener: `cluster` keeps its id and its mode.
    write(&["v6", "cluster", "node"])?;
    let mut agent = start_agent(&config)?;
    let cluster = sandbox.query(Ns::Pod, Query::new(dns(CLUSTER_LISTENER), Transport::Udp))?;
    assert_eq!(who(cluster.answer()), "upstream B", "{cluster:?}");
    assert_eq!(answered_by(&sandbox)?, "cache");
    let state = set_state(&sandbox, "v6", "auto")?;
    assert_eq!(state.code, 0, "{state:?}");
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;

    // `cluster` removed: its address is no listener any more (DNS there reaches the cache as sent).
    write(&["node"])?;
    let agent = start_agent(&config)?;
    let cluster = sandbox.query(Ns::Pod, Query::new(dns(CLUSTER_LISTENER), Transport::Udp))?;
    assert_eq!(who(cluster.answer()), "cache", "{cluster:?}");
    let gone = set_state(&sandbox, "cluster", "cache")?;
    assert!(
        gone.stderr
            .contains("there is no listener \"cluster\"; the running agent has: node"),
        "{gone:?}"
    );
    drop(agent);
    assert_eq!(
        redirector(&["uninstall", "--config", &config.display().to_string()])?.code,
        0
    );
    Ok(())
}

#[test]
fn the_node_pool_follows_its_resolv_conf() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let resolv = sandbox.write_file("resolv.conf", &format!("nameserver {UPSTREAM_A_V4}\n"))?;
    let listeners = format!(
        "[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\nresolv_conf = {:?}\n",
        resolv.display().to_string()
    );
    let text = sandbox.config_toml(&listeners);
    let harness = Harness::with_config(sandbox, &text)?;
    let pool = |harness: &Harness| -> anyhow::Result<Vec<(IpAddr, u16)>> {
        Ok(harness
            .maps
            .pool(NODE_ID)?
            .targets()
            .iter()
            .map(|target| (IpAddr::from(target.addr), port_from_be(target.udp_port_be)))
            .collect())
    };
    let wait_for = |harness: &Harness, expected: Vec<(IpAddr, u16)>, step: &str| {
        harness.wait_until(step, Duration::from_secs(5), |harness| {
            Ok(pool(harness)? == expected)
        })
    };
    let a = (IpAddr::V4(UPSTREAM_A_V4), 53);
    let b = (IpAddr::V4(UPSTREAM_B_V4), 53);
    wait_for(&harness, vec![a], "initial file")?;

    // Atomic rename (how resolved writes it), IPv6 first, comments and options, the listener
    // itself and the stub resolver among the nameservers.
    let staged = resolv.with_file_name("resolv.conf.new");
    std::fs::write(
        &staged,
        format!(
            "# written by a test\nnameserver fd00:2::2\nnameserver 169.254.10.10\nnameserver 127.0.0.53\nnameserver {UPSTREAM_B_V4}\nsearch cluster.local\noptions edns0 trust-ad\n"
        ),
    )?;
    std::fs::rename(&staged, &resolv)?;
    wait_for(&harness, vec![b], "after an atomic rename")?;
    assert!(
        harness
            .agent
            .stats
            .rejections("resolv.conf", "listener address")
            >= 1
    );

    // Deleted: no usable upstream, an empty pool (the policy, `pass`, applies).
    std::fs::remove_file(&resolv)?;
    wait_for(&harness, vec![], "after deletion")?;
    // Recreated in place.
    std::fs::write(
        &resolv,
        format!("nameserver {UPSTREAM_A_V4}\nnameserver {UPSTREAM_B_V4}\n"),
    )?;
    wait_for(&harness, vec![a, b], "after re-creation")?;
    Ok(())
}

#[test]
fn an_agent_in_a_cgroup_namespace_of_its_own_finds_its_cgroup_and_probes_unsteered()
-> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    // The agent inside the attach cgroup, in a cgroup namespace rooted at its own cgroup (a
    // container's, by default): /proc/self/cgroup says "/".
    let own = sandbox.cgroup().child("agent")?;
    let procs = own.procs()?;
    let mut command = std::process::Command::new("unshare");
    command.args([
        "--cgroup",
        &bpf_tests::sandbox::redirector_bin().display().to_string(),
    ]);
    command.args(["run", "--config", &config.display().to_string()]);
    bpf_tests::command::join_cgroup_before_exec(&mut command, &procs);
    let mut agent = bpf_tests::command::TestProcess::start(
        "redirector run (own cgroup namespace)",
        command,
        "redirector is steering",
        Duration::from_secs(30),
    )?;
    drop(procs);
    let skipped = agent
        .printed()
        .iter()
        .find(|line| line.contains("the agent's own cgroup is skipped"))
        .cloned()
        .unwrap_or_default();
    assert!(
        skipped.contains(&own.path().display().to_string()),
        "{:#?}",
        agent.printed()
    );

    // The cache dies: the kernel fails over, and the agent's probes, not steered, fail too. A
    // steered probe would reach an upstream and find the dead cache "alive".
    sandbox.stop_server("cache")?;
    let status = || -> anyhow::Result<serde_json::Value> {
        let printed = redirector(&[
            "status",
            "--config",
            &config.display().to_string(),
            "--json",
        ])?;
        Ok(serde_json::from_str(&printed.stdout)?)
    };
    let result = wait_until(
        "the probes' verdict on the dead cache",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || Ok(status()?["listeners"][0]["probe_verdict"] == "down"),
    );
    let report = status()?;
    assert_eq!(report["listeners"][0]["name"], "node");
    assert!(result.is_ok(), "{result:?}: {report}");
    drop(agent);
    drop(own);
    assert_eq!(
        redirector(&["uninstall", "--config", &config.display().to_string()])?.code,
        0
    );
    Ok(())
}

#[test]
fn a_failed_start_leaves_nothing_that_locks_the_next_one_out() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let listeners = standard_listeners(&sandbox);
    // A listener interface that cannot be set up fails the start after the maps were created.
    let broken = sandbox.write_file(
        "broken.toml",
        &sandbox.config_toml_with(
            &listeners,
            "[interface]\nkind = \"existing\"\nname = \"nosuchlink0\"\n",
        ),
    )?;
    let refused = redirector(&["run", "--config", &broken.display().to_string()])?;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains("there is no link nosuchlink0"),
        "{refused:?}"
    );
    assert!(
        refused
            .stderr
            .contains("removed the pins of this failed start"),
        "{refused:?}"
    );
    assert!(
        !sandbox.pin_dir().join("maps").exists(),
        "the failed start left maps pinned"
    );
    assert_eq!(sandbox.attached_programs()?, "");

    // The cause fixed, the next start steers.
    let config = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&config)?;
    assert_eq!(answered_by(&sandbox)?, "cache");
    stop_agent(&mut agent)?;
    uninstall(&config)?;

    // A start killed before it attached (here: of a build whose config map has another shape)
    // left maps that no program uses: the next start removes them, with no --replace.
    let maps = sandbox.pin_dir().join("maps");
    std::fs::create_dir_all(&maps)?;
    run(
        "bpftool",
        [
            "map",
            "create",
            &maps.join("DATAPATH_CONFIG").display().to_string(),
            "type",
            "array",
            "key",
            "4",
            "value",
            "4",
            "entries",
            "1",
            "name",
            "DATAPATH_CONFIG",
        ],
    )?;
    let mut agent = start_agent(&config)?;
    assert!(
        agent
            .printed()
            .iter()
            .any(|line| line.contains("removing maps no program uses")),
        "{:?}",
        agent.printed()
    );
    assert_eq!(answered_by(&sandbox)?, "cache");
    stop_agent(&mut agent)?;
    uninstall(&config)?;
    Ok(())
}

#[test]
fn a_resized_translation_map_is_migrated_with_no_flag() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&config)?;
    // A translation in the old map: a socket steered upstream.
    assert_eq!(set_state(&sandbox, "node", "upstream")?.code, 0);
    assert!(answered_by(&sandbox)?.starts_with("upstream"));
    stop_agent(&mut agent)?;

    let text = format!(
        "reverse_nat_entries = 4096\n{}",
        sandbox.config_toml(&standard_listeners(&sandbox))
    );
    let resized = sandbox.write_file("resized.toml", &text)?;
    let mut agent = start_agent(&resized)?;
    let printed = agent.printed().join("\n");
    assert!(
        printed.contains(&format!(
            "why=max entries {} where 4096 is needed",
            redirector_common::reverse::REVERSE_NAT_DEFAULT_ENTRIES
        )),
        "{printed}"
    );
    assert!(answered_by(&sandbox)?.starts_with("upstream"));
    let maps = run(
        "bpftool",
        [
            "map",
            "show",
            "pinned",
            &sandbox
                .pin_dir()
                .join("maps/REVERSE_NAT")
                .display()
                .to_string(),
        ],
    )?;
    assert!(maps.contains("max_entries 4096"), "{maps}");
    let state = set_state(&sandbox, "node", "auto")?;
    assert!(state.stdout.contains("(was upstream)"), "{state:?}");
    stop_agent(&mut agent)?;
    uninstall(&resized)?;
    Ok(())
}

#[test]
fn uninstall_removes_only_what_the_agent_added_to_a_link_it_adopted() -> anyhow::Result<()> {
    let sandbox = Sandbox::new(tools!())?;
    let link = sandbox.add_listener_link()?;
    let node = sandbox.netns(Ns::Node).name().to_owned();
    // There before the agent: one listener's address (as NodeLocal DNSCache leaves its link) and
    // one of someone else's.
    for address in ["169.254.20.10/32", "192.0.2.200/32"] {
        run("ip", ["-n", &node, "addr", "add", address, "dev", &link])?;
    }
    let listeners = "[[listener]]\nname = \"kept\"\naddress = \"169.254.20.10\"\nupstreams = [\"198.18.2.2\"]\n\n[[listener]]\nname = \"added\"\naddress = \"169.254.20.11\"\nupstreams = [\"198.18.2.2\"]\n";
    // kind "dummy" names a link the agent would create, but one of that name is there.
    let tables = format!("[interface]\nname = {link:?}\nkind = \"dummy\"\n");
    let config =
        sandbox.write_file("config.toml", &sandbox.config_toml_with(listeners, &tables))?;
    for _ in 0..2 {
        // The second start adopts what the first recorded.
        let mut agent = start_agent(&config)?;
        let addresses = run("ip", ["-n", &node, "addr", "show", "dev", &link])?;
        assert!(addresses.contains("169.254.20.11/32"), "{addresses}");
        stop_agent(&mut agent)?;
    }
    let record = sandbox.lock_file().with_file_name("interface.json");
    let owned: redirector::sys::interface::Ownership =
        serde_json::from_str(&std::fs::read_to_string(&record)?)?;
    assert_eq!(owned.created, None, "the link was there before");
    assert_eq!(owned.added, ["169.254.20.11".parse::<IpAddr>()?]);

    // A listener removed from the configuration: its address goes at the next start, not at
    // uninstall; what was there before stays.
    let kept_only = "[[listener]]\nname = \"kept\"\naddress = \"169.254.20.10\"\nupstreams = [\"198.18.2.2\"]\n";
    let config =
        sandbox.write_file("config.toml", &sandbox.config_toml_with(kept_only, &tables))?;
    let mut agent = start_agent(&config)?;
    let addresses = run("ip", ["-n", &node, "addr", "show", "dev", &link])?;
    stop_agent(&mut agent)?;
    assert!(
        !addresses.contains("169.254.20.11"),
        "the removed listener's address stayed: {addresses}"
    );
    assert!(
        addresses.contains("169.254.20.10/32") && addresses.contains("192.0.2.200/32"),
        "{addresses}"
    );
    let owned: redirector::sys::interface::Ownership =
        serde_json::from_str(&std::fs::read_to_string(&record)?)?;
    assert!(owned.added.is_empty(), "{owned:?}");

    uninstall(&config)?;
    let addresses = run("ip", ["-n", &node, "addr", "show", "dev", &link])
        .map_err(|error| error.context("uninstall deleted a link it did not create"))?;
    assert!(
        addresses.contains("169.254.20.10/32") && addresses.contains("192.0.2.200/32"),
        "the addresses that were there stay: {addresses}"
    );
    assert!(
        !addresses.contains("169.254.20.11"),
        "the address the agent added is gone: {addresses}"
    );
    assert!(!record.exists(), "the record is gone with what it recorded");
    Ok(())
}

/// The pin directory changed between two runs: the first run's programs stay attached from the
/// old directory. The new agent and `status` name that set and how to detach it; removing its
/// pins does.
#[test]
fn a_set_left_attached_by_a_changed_pin_dir_is_named() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let old = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&old)?;
    stop_agent(&mut agent)?;
    let old_dir = sandbox.pin_dir().display().to_string();
    let new_dir = format!("{old_dir}-moved");
    let text = std::fs::read_to_string(&old)?.replace(
        &format!("pin_dir = {old_dir:?}"),
        &format!("pin_dir = {new_dir:?}"),
    );
    assert!(text.contains(&new_dir), "{text}");
    let moved = sandbox.write_file("moved.toml", &text)?;
    let mut agent = start_agent(&moved)?;
    let status = redirector(&["status", "--config", &moved.display().to_string()])?;
    assert!(
        status
            .stdout
            .contains(&format!("ANOTHER SET attached from {old_dir}")),
        "{status:?}"
    );
    stop_agent(&mut agent)?;
    assert!(
        agent
            .printed()
            .iter()
            .any(|line| line.contains("ANOTHER redirector set") && line.contains(&old_dir)),
        "{:?}",
        agent.printed()
    );
    std::fs::remove_dir_all(&old_dir)?;
    let status = redirector(&["status", "--config", &moved.display().to_string()])?;
    assert!(!status.stdout.contains("ANOTHER SET"), "{status:?}");
    uninstall(&moved)?;
    Ok(())
}

/// A first start that fails after it set up the listener addresses and the conntrack bypass
/// table (here: its metrics port is taken) takes both back: nothing steers through them, and a
/// node whose agent never starts must not keep them.
#[test]
fn a_failed_first_start_takes_back_its_table_and_addresses() -> anyhow::Result<()> {
    let sandbox = Sandbox::new(tools!())?;
    let link = sandbox.add_listener_link()?;
    let node = sandbox.netns(Ns::Node).name().to_owned();
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port();
    let listeners = "[[listener]]\nname = \"owned\"\naddress = \"169.254.20.10\"\nupstreams = [\"198.18.2.2\"]\n";
    let tables = format!("[interface]\nname = {link:?}\nkind = \"dummy\"\n");
    let text = sandbox.config_toml_with(listeners, &tables).replace(
        "address = \"127.0.0.1:0\"",
        &format!("address = \"127.0.0.1:{port}\""),
    );
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    let config = sandbox.write_file("config.toml", &text)?;
    let refused = redirector(&["run", "--config", &config.display().to_string()])?;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused
            .stderr
            .contains("removed the conntrack bypass table of this failed start")
            && refused.stderr.contains("of this failed start"),
        "{refused:?}"
    );
    let addresses = run("ip", ["-n", &node, "addr", "show", "dev", &link])?;
    assert!(
        !addresses.contains("169.254.20.10"),
        "the failed start left its listener address: {addresses}"
    );
    assert_eq!(
        bpf_tests::conntrack::bypass_table(sandbox.netns(Ns::Node))?,
        None,
        "the failed start left its nftables table"
    );
    assert_eq!(sandbox.attached_programs()?, "");
    drop(taken);
    Ok(())
}

/// A start that fails (here: on its metrics port) after it planned to drop a listener changes
/// nothing the running programs read: with no agent, the dropped listener is still steered as
/// before, so when its cache dies its DNS moves upstream instead of being refused.
#[test]
fn a_failed_start_changes_nothing_the_running_programs_read() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = sandbox.write_file(
        "config.toml",
        &sandbox.config_toml(&listeners(&["node", "cluster"])),
    )?;
    let mut agent = start_agent(&config)?;
    wait_for_cache(&sandbox, "the agent confirms the cache")?;
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    let before = redirector(&["status", "--config", &config.display().to_string()])?;

    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port();
    let text = sandbox.config_toml(&listeners(&["node"])).replace(
        "address = \"127.0.0.1:0\"",
        &format!("address = \"127.0.0.1:{port}\""),
    );
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    let failing = sandbox.write_file("failing.toml", &text)?;
    let refused = redirector(&["run", "--config", &failing.display().to_string()])?;
    assert_eq!(refused.code, 1, "{refused:?}");
    drop(taken);
    let unchanged = |start: &bpf_tests::cli::CliOutput| -> anyhow::Result<()> {
        let after = redirector(&["status", "--config", &config.display().to_string()])?;
        assert_eq!(
            (after.code, status_listeners(&after.stdout)),
            (0, status_listeners(&before.stdout)),
            "the failed start changed what the programs read:\nbefore: {before:?}\nafter: {after:?}\nthe start: {start:?}"
        );
        Ok(())
    };
    unchanged(&refused)?;

    // A start that fails after it wrote the shared maps puts back what it found.
    let late = sandbox.write_file("late.toml", &sandbox.config_toml(&listeners(&["node"])))?;
    let refused = redirector_with_env(
        &["run", "--config", &late.display().to_string()],
        &[("REDIRECTOR_TEST_FAIL_BEFORE_ATTACH", "1")],
    )?;
    assert!(
        refused.code == 1
            && refused
                .stderr
                .contains("put back the listeners, pools, verdicts"),
        "{refused:?}"
    );
    unchanged(&refused)?;
    let cluster = |sandbox: &Sandbox| -> anyhow::Result<&'static str> {
        let query = Query::new(dns(CLUSTER_LISTENER), Transport::Udp);
        Ok(who(sandbox.query(Ns::Pod, query)?.answer()))
    };
    assert_eq!(
        cluster(&sandbox)?,
        "cache",
        "{:?}",
        redirector(&["status", "--config", &config.display().to_string()])?
    );
    sandbox.stop_server("cache")?;
    assert_eq!(
        (answered_by(&sandbox)?, cluster(&sandbox)?),
        ("upstream A", "upstream B"),
        "with no agent after the failed start, the dead cache's listeners must fail over as before; the start: {refused:?}"
    );
    uninstall(&config)?;
    Ok(())
}

/// The `[[listener]]` tables of `names`: `node` on 169.254.10.10 with upstream A, any other name
/// as `cluster` on 169.254.10.11 with upstream B, both served by the standard cache.
fn listeners(names: &[&str]) -> String {
    names
        .iter()
        .map(|name| match *name {
            "node" => "[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\nupstreams = [\"198.18.2.2\"]\n",
            _ => "[[listener]]\nname = \"cluster\"\naddress = \"169.254.10.11\"\nupstreams = [\"198.18.2.3\"]\n",
        })
        .collect()
}

/// A start that fails after it wrote the shared maps, while the cache is drained for planned
/// work, keeps the drain. The failing start drops the cluster listener, which clears that
/// listener's record of the kernel's flips (the drain with them) and the processes known as its
/// cache, then fails before its swap: what it puts back includes that record, so the next agent's
/// probes, which confirm a healthy cache, do not steer the cluster listener's DNS back onto the
/// cache being taken down while its drain stands. The agents run as shipped.
#[test]
fn a_failed_start_during_a_drain_keeps_the_drain() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let (config, mut agent) = shipped::start_agent_on(&sandbox, &listeners(&["node", "cluster"]))?;
    wait_for_cache(&sandbox, "the agent confirms the cache")?;
    let path = config.display().to_string();
    let drained = output_within(
        &mut shipped::command(&sandbox, &["drain", "--all", "--config", &path])?,
        Duration::from_secs(30),
    )?;
    anyhow::ensure!(drained.status.success(), "drain --all failed: {drained:?}");
    let cluster = |sandbox: &Sandbox| -> anyhow::Result<&'static str> {
        answered_at(sandbox, Ns::Pod, CLUSTER_LISTENER.into())
    };
    let reasons = |sandbox: &Sandbox| -> anyhow::Result<Vec<(u32, &'static str)>> {
        let maps = Maps::open_pinned(&sandbox.pin_dir())?;
        Ok(redirector::telemetry::snapshot::listeners(&maps)?
            .into_iter()
            .map(|listener| (listener.id, listener.reason_code))
            .collect())
    };
    assert_eq!(
        (answered_by(&sandbox)?, cluster(&sandbox)?),
        ("upstream A", "upstream B"),
        "the drain moves both listeners"
    );
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    let before = reasons(&sandbox)?;
    assert_eq!(
        before,
        vec![(NODE_ID, "drained"), (CLUSTER_ID, "drained")],
        "the drain outlives the agent"
    );

    let late = sandbox.write_file(
        "late.toml",
        &shipped::in_node(&sandbox, &sandbox.config_toml(&listeners(&["node"])))?,
    )?;
    let mut failing =
        shipped::command(&sandbox, &["run", "--config", &late.display().to_string()])?;
    failing.env("REDIRECTOR_TEST_FAIL_BEFORE_ATTACH", "1");
    let refused = output_within(&mut failing, Duration::from_secs(60))?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        refused.status.code() == Some(1) && stderr.contains("put back the listeners"),
        "{refused:?}"
    );
    assert_eq!(
        reasons(&sandbox)?,
        before,
        "the failed start put back each listener's drain; the start: {stderr}"
    );

    // The next agent, on the configuration before: its probes find the cache healthy, and the
    // drain holds it back on every listener until the cache's next life.
    let mut agent = shipped::start_agent(&sandbox, &config)?;
    pause(2000);
    assert_eq!(
        (answered_by(&sandbox)?, cluster(&sandbox)?),
        ("upstream A", "upstream B"),
        "DNS went back onto the drained cache: {:?}",
        reasons(&sandbox)?
    );
    assert_eq!(reasons(&sandbox)?, before);
    agent.signal(Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    shipped::uninstall(&sandbox, &config)?;
    Ok(())
}

/// The listener lines of `status` (name, address, route and reason), without counters that
/// change with every query.
fn status_listeners(status: &str) -> Vec<String> {
    status
        .lines()
        .filter(|line| line.contains("169.254.10."))
        .map(|line| {
            line.split_whitespace()
                .take(4)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

#[test]
fn an_agent_whose_cache_namespace_is_replaced_exits_to_follow_it() -> anyhow::Result<()> {
    let sandbox = Sandbox::new(tools!())?;
    // The caches' namespace of its own, which a cache's pod would bring (and a new pod replace).
    let name = format!("{}{}-caches", bpf_tests::sandbox::PREFIX, sandbox.tag());
    let caches = bpf_tests::netns::NetNs::create(&name)?;
    let path = format!("/run/netns/{name}");
    let text = sandbox
        .config_toml("[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\nupstreams = [\"198.18.2.2\"]\n")
        .replace(
            &format!("cache_netns = {:?}", sandbox.node_netns_path().display().to_string()),
            &format!("cache_netns = {path:?}"),
        );
    assert!(text.contains(&path), "{text}");
    let config = sandbox.write_file("config.toml", &text)?;
    let mut agent = start_agent(&config)?;

    // Deleted and created again: the same path, another namespace.
    drop(caches);
    let caches = bpf_tests::netns::NetNs::create(&name)?;
    let status = agent
        .wait_exit(Duration::from_secs(10))
        .map_err(|error| error.context("the agent went on in the namespace that is gone"))?;
    assert_eq!(status.code(), Some(1), "{:?}", agent.printed());
    assert!(
        agent
            .printed()
            .iter()
            .any(|line| line.contains("is now another network namespace")),
        "{:?}",
        agent.printed()
    );
    // Started again, it follows: it steers from the new namespace.
    let agent = start_agent(&config)?;
    drop(agent);
    uninstall(&config)?;
    drop(caches);
    Ok(())
}

/// A node's reboot under the DaemonSet (docs/operations.md, "At a node's reboot"): the pins went
/// with the bpffs, and kubelet starts pods in no order. Until the agent's first start nothing
/// steers, so a pod's DNS to the listener reaches only what listens there: with the cache not up
/// yet, nothing, and every query fails as it would without redirector. The agent's start with no
/// pins steers the next queries to the upstreams (the cache has no socket), loses none after
/// that, and fails back when the cache comes.
#[test]
fn after_a_reboot_dns_fails_only_until_the_agents_first_start() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_upstreams()?;
    let config = write_standard_config(&sandbox)?;
    assert!(
        !sandbox.pin_dir().exists(),
        "a fresh bpffs holds no pins, as after a reboot"
    );
    let stream = Stream::start(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        paced(Duration::from_secs(120)),
    )?;
    pause(1000);
    let spawned = now_ms();
    let agent = start_agent(&config)?;
    let steering = now_ms();
    pause(1000);
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    let cache_started = now_ms();
    let report = stream.stop_once(
        "failback to the cache that came after the agent",
        Duration::from_secs(10),
        |report| report.first_cache_answer(cache_started).is_some(),
    )?;

    let start = report.started_ms();
    let before: Vec<_> = report.between(0, spawned).collect();
    assert!(
        !before.is_empty(),
        "no query before the agent: {}",
        report.summary()
    );
    assert!(
        before.iter().all(|record| record.error.is_some()),
        "a query was answered before the agent started, with no cache: {}",
        report.summary()
    );
    let flipped_by = report.flipped_by(spawned).unwrap_or_else(|| {
        panic!(
            "the agent's first start steered nothing upstream: {}",
            report.summary()
        )
    });
    assert_eq!(
        report.failures_after_flip(flipped_by),
        0,
        "a query failed once the agent steered: {}",
        report.summary()
    );
    let mut errors = std::collections::BTreeMap::new();
    for record in &before {
        let error = record.error.as_deref().unwrap_or_default();
        let kind = error.split(':').next().unwrap_or(error).trim().to_owned();
        *errors.entry((record.kind.clone(), kind)).or_insert(0) += 1;
    }
    println!(
        "reboot: {} queries before the agent, all failed ({errors:?}); agent spawned at +{} ms, \
         steering (its log) at +{} ms, the first upstream answer sent by +{} ms; the cache \
         started at +{} ms; {}",
        before.len(),
        spawned - start,
        steering - start,
        flipped_by - start,
        cache_started - start,
        report.summary()
    );
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// `CACHE_SOCKETS` full (docs/operations.md, "Sizing"): 16384 sockets bound to one listener's
/// cache address fill it, and a cache started meanwhile cannot be counted. Its listener then
/// has no counted socket and its DNS goes upstream, answered; once the sockets that filled the
/// map close, the agent's recount counts the cache's and gives it its DNS back.
#[test]
fn with_the_cache_socket_table_full_a_restarted_cache_is_served_upstream_until_entries_free()
-> anyhow::Result<()> {
    const FILLER: &str = "169.254.10.12";
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    sandbox
        .netns(Ns::Node)
        .ip(&["addr", "add", &format!("{FILLER}/32"), "dev", "lo"])?;
    let listeners = format!(
        "{}\n[[listener]]\nname = \"filler\"\naddress = \"{FILLER}\"\nupstreams = [\"198.18.2.2\"]\n",
        standard_listeners(&sandbox)
    );
    let config = sandbox.write_file("config.toml", &sandbox.config_toml(&listeners))?;
    let agent = start_agent(&config)?;
    wait_until(
        "the cache serves",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || Ok(answered_by(&sandbox)? == "cache"),
    )?;

    // The cache stops; one process binds a socket more than the table holds to the filler
    // listener's address and the DNS port, as a cache would.
    let total = redirector_common::binds::MAX_CACHE_SOCKETS + 1;
    let script = format!(
        "import resource, socket, sys, time\n\
         resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))\n\
         held = []\n\
         for _ in range({total}):\n\
         \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         \x20   s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n\
         \x20   s.bind(('{FILLER}', 53))\n\
         \x20   held.append(s)\n\
         print('ready', flush=True)\n\
         time.sleep(600)\n",
        limit = total + 64,
    );
    let cgroup = sandbox.skipped_cgroup().path().to_owned();
    sandbox.stop_server("cache")?;
    sandbox.start_process(
        "filler",
        Some(Ns::Node),
        Some(&cgroup),
        "python3",
        &["-c".to_owned(), script],
        "ready",
    )?;
    let pin_dir = sandbox.pin_dir();
    let counted = |name: &str| -> anyhow::Result<i64> {
        let maps = Maps::open_pinned(&pin_dir)?;
        let listener = redirector::telemetry::snapshot::listeners(&maps)?
            .into_iter()
            .find(|listener| listener.name == name)
            .context("no such listener")?;
        let (udp, tcp) = listener.cache_sockets.unwrap_or_default();
        Ok(udp + tcp)
    };
    let filled = counted("filler")?;
    assert!(
        filled > 16_000 && filled < i64::try_from(total)?,
        "the filler's sockets counted: {filled} of {total}"
    );

    // The cache starts again while the table is full: none of its sockets is counted.
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    pause(2000);
    assert_eq!(counted("node")?, 0, "a socket was counted in a full table");
    let by = answered_by(&sandbox)?;
    assert!(
        by.starts_with("upstream"),
        "with its sockets uncounted: {by}"
    );
    assert_eq!(node_reason(&sandbox)?, "no_sockets");

    // The filler exits: its entries go, and the agent's recount counts the cache's sockets.
    sandbox.stop_server("filler")?;
    let freed = now_ms();
    wait_until(
        "the recount gives the cache its DNS back",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || Ok(answered_by(&sandbox)? == "cache"),
    )?;
    println!(
        "CACHE_SOCKETS full: {filled} filler sockets counted of {total}; the restarted cache \
         served upstream (no_sockets) while full; back on the cache {} ms after the filler exited",
        now_ms() - freed
    );
    assert!(counted("node")? > 0);
    drop(agent);
    uninstall(&config)?;
    Ok(())
}

/// A listener that is not what its id held starts clean, and so does every unread stamp: the id
/// of a removed listener keeps no activity or flip tallies and no process as its cache; a
/// listener whose liveness changed starts its stamps over and is no process's cache any more;
/// an unchanged listener keeps its tallies, and a stamp no read of the new programs would
/// answer (one carried across a rollback in a reused map) is forgotten.
#[test]
fn a_listener_that_is_not_what_its_id_held_starts_clean() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_upstreams()?;
    let config = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&config)?;
    // The cache starts under the programs, so its binder is known as the cache of all three.
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    wait_for_cache(&sandbox, "the agent confirms the cache")?;
    stop_agent(&mut agent)?;
    let pinned = Maps::open_pinned(&sandbox.pin_dir())?;
    let id = |name: &str| -> anyhow::Result<u32> { Ok(pinned.listener_named(name)?.0) };
    let (node, cluster, v6) = (id("node")?, id("cluster")?, id("v6")?);
    let tasks = || -> anyhow::Result<u64> {
        let map = aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(
            sandbox.pin_dir().join("maps").join(names::MAP_CACHE_TASKS),
        )?)?;
        let map = aya::maps::HashMap::<_, u32, CacheTask>::try_from(map)?;
        Ok(map
            .iter()
            .filter_map(Result::ok)
            .fold(0, |bits, (_, task)| bits | task.listeners))
    };
    let bit = |id: u32| 1u64 << id;
    assert_eq!(
        tasks()? & (bit(node) | bit(cluster) | bit(v6)),
        bit(node) | bit(cluster) | bit(v6),
        "the premise: the cache's binder is known as the cache of every listener"
    );
    // What the programs (or a release before a rollback) left: an unread stamp and tallies.
    let mut activity = sandbox.pinned_array::<CacheActivity>(names::MAP_CACHE_ACTIVITY)?;
    for id in [node, cluster, v6] {
        let left = CacheActivity {
            first_unread_ns: 2_000,
            last_read_ns: 1_000,
            signalled: 5,
            stalled: 5,
            ..CacheActivity::default()
        };
        activity.set(id, left, 0)?;
    }
    drop(pinned);

    // `cluster` removed, `v6` judged by probes alone.
    let text = sandbox
        .config_toml(&standard_listeners(&sandbox))
        .replace(
            "name = \"cluster\"\naddress = \"169.254.10.11\"\nempty_pool = \"fail\"\n",
            "name = \"gone\"\naddress = \"198.18.3.11\"\nempty_pool = \"fail\"\n",
        )
        .replace("name = \"v6\"\n", "name = \"v6\"\nliveness = \"probes\"\n");
    assert!(
        text.contains("\"gone\"") && text.contains("\"probes\""),
        "{text}"
    );
    let changed = sandbox.write_file("changed.toml", &text)?;
    let mut agent = start_agent(&changed)?;
    let now = |id: u32| -> anyhow::Result<CacheActivity> {
        Ok(Maps::open_pinned(&sandbox.pin_dir())?.cache_activity(id)?)
    };
    let (node_now, cluster_now, v6_now) = (now(node)?, now(cluster)?, now(v6)?);
    assert_eq!(
        (
            node_now.first_unread_ns,
            node_now.signalled,
            node_now.stalled
        ),
        (0, 5, 5),
        "the unchanged listener keeps its tallies, not its unread stamp: {node_now:?}"
    );
    assert_eq!(
        (
            cluster_now.signalled,
            cluster_now.stalled,
            cluster_now.first_unread_ns
        ),
        (0, 0, 0),
        "the removed listener's id starts clean: {cluster_now:?}"
    );
    assert_eq!(
        (v6_now.first_unread_ns, v6_now.signalled),
        (0, 5),
        "the listener whose liveness changed starts its stamps over: {v6_now:?}"
    );
    let known = tasks()?;
    assert_eq!(
        (known & bit(node), known & (bit(cluster) | bit(v6))),
        (bit(node), 0),
        "only the unchanged listener keeps its cache's process"
    );
    stop_agent(&mut agent)?;
    uninstall(&changed)?;
    Ok(())
}
