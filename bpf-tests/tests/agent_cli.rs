//! The `redirector` binary: `run` steers until SIGTERM and cleans up, `state` flips a listener
//! through the pinned maps, and a bad configuration or missing privileges are refused before
//! anything is attached.

use std::{os::unix::process::CommandExt as _, process::Command, time::Duration};

use bpf_tests::{
    cli::{redirector, set_state, start_agent},
    command::output_within,
    harness::write_standard_config,
    sandbox::{Ns, Query, Sandbox, Transport, redirector_bin},
    shipped, tools,
    topology::{NODE_LISTENER, dns, who},
};

fn answered_by(sandbox: &Sandbox) -> anyhow::Result<&'static str> {
    let outcome = sandbox.query(Ns::Pod, Query::new(dns(NODE_LISTENER), Transport::Udp))?;
    Ok(match who(outcome.answer()) {
        "upstream A" | "upstream B" => "upstream",
        other => other,
    })
}

#[test]
fn run_steers_until_sigterm_and_state_flips_listeners() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;

    let check = redirector(&["check-config", "--config", &config.display().to_string()])?;
    assert_eq!(check.code, 0, "{check:?}");
    assert!(
        check.stdout.contains(
            "valid, 3 listener(s): node (169.254.10.10), cluster (169.254.10.11), v6 (fd00:53::10)"
        ),
        "{check:?}"
    );

    let mut agent = start_agent(&config)?;
    assert!(!sandbox.attached_programs()?.is_empty());
    assert_eq!(answered_by(&sandbox)?, "cache");

    let state = set_state(&sandbox, "node", "upstream")?;
    assert_eq!(state.code, 0, "{state:?}");
    assert_eq!(
        state.stdout.trim(),
        "listener node (169.254.10.10): mode upstream (was auto); DNS goes to the upstream pool (operator override)"
    );
    assert_eq!(answered_by(&sandbox)?, "upstream");

    let state = set_state(&sandbox, "node", "auto")?;
    assert_eq!(state.code, 0, "{state:?}");
    assert!(
        state
            .stdout
            .contains("mode auto (was upstream); DNS goes to the cache"),
        "{state:?}"
    );
    assert_eq!(answered_by(&sandbox)?, "cache");

    let state = set_state(&sandbox, "nope", "cache")?;
    assert_eq!(state.code, 1);
    assert!(
        state
            .stderr
            .contains("there is no listener \"nope\"; the running agent has: node, cluster, v6"),
        "{state:?}"
    );

    // Leave the listener forced upstream, then stop the agent: the programs stay, and so does
    // the operator's mode.
    assert_eq!(set_state(&sandbox, "node", "upstream")?.code, 0);
    assert_eq!(answered_by(&sandbox)?, "upstream");
    agent.signal(nix::sys::signal::Signal::SIGTERM)?;
    let status = agent.wait_exit(Duration::from_secs(10))?;
    assert!(status.success(), "{status:?}: {:?}", agent.drain());
    assert!(
        !sandbox.attached_programs()?.is_empty(),
        "stopping must not detach"
    );
    assert_eq!(answered_by(&sandbox)?, "upstream");

    // Uninstall removes everything: DNS reaches the listener address untouched again.
    let uninstall = redirector(&["uninstall", "--config", &config.display().to_string()])?;
    assert_eq!(uninstall.code, 0, "{uninstall:?}");
    assert!(
        uninstall.stdout.contains("programs detached"),
        "{uninstall:?}"
    );
    assert_eq!(sandbox.attached_programs()?, "", "programs left attached");
    assert!(!sandbox.pin_dir().exists(), "pins left behind");
    assert_eq!(answered_by(&sandbox)?, "cache");

    let state = set_state(&sandbox, "node", "cache")?;
    assert_eq!(state.code, 1);
    assert!(
        state.stderr.starts_with("error: no redirector state under"),
        "{state:?}"
    );
    Ok(())
}

#[test]
fn a_bad_configuration_is_refused_before_anything_is_attached() -> anyhow::Result<()> {
    let sandbox = Sandbox::new(tools!())?;
    let cgroup = sandbox.cgroup().path().display().to_string();
    let pin_dir = sandbox.pin_dir().display().to_string();
    let listener = "[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\n";
    let cases = [
        (
            format!(
                "cgroup = {cgroup:?}\npin_dir = {pin_dir:?}\n{listener}skip_cgroups = [\"{cgroup}/no-such-cgroup\"]\n"
            ),
            "listener[0] (\"node\").skip_cgroups[0]: the cgroup directory",
        ),
        (
            format!("cgroup = \"/tmp\"\npin_dir = {pin_dir:?}\n{listener}"),
            "cgroup: /tmp is not a cgroup v2 directory",
        ),
        (
            format!(
                "cgroup = {:?}\npin_dir = {pin_dir:?}\n{listener}",
                format!("{cgroup}/missing")
            ),
            "cgroup: the cgroup directory",
        ),
        (
            format!(
                "cgroup = {cgroup:?}\npin_dir = \"/tmp/{}-not-bpffs\"\n{listener}",
                sandbox.tag()
            ),
            "is not on a bpf filesystem",
        ),
        (
            format!(
                "cgroup = {cgroup:?}\npin_dir = {pin_dir:?}\n{listener}upstreams = [\"198.18.2.2:0\"]\n"
            ),
            "listener[0] (\"node\").upstreams[0]: \"198.18.2.2:0\" has port 0",
        ),
    ];
    for (index, (text, expected)) in cases.iter().enumerate() {
        let config = sandbox.write_file(&format!("bad-{index}.toml"), text)?;
        let run = redirector(&["run", "--config", &config.display().to_string()])?;
        assert_eq!(run.code, 1, "case {index} must be refused: {run:?}");
        assert!(
            run.stderr.contains(expected),
            "case {index}: expected {expected:?} in {run:?}"
        );
        assert!(!run.stderr.contains("panicked"), "{run:?}");
        assert_eq!(
            sandbox.attached_programs()?,
            "",
            "case {index} attached programs"
        );
    }
    Ok(())
}

#[test]
fn run_without_root_says_so() -> anyhow::Result<()> {
    let sandbox = Sandbox::new(tools!())?;
    let config = sandbox.write_file(
        "config.toml",
        &sandbox.config_toml("[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\n"),
    )?;
    // The binary as root would run it, from where user nobody can reach it.
    let binary = sandbox.copy_executable(&redirector_bin(), "redirector")?;
    let mut command = Command::new(binary);
    command.args(["run", "--config", &config.display().to_string()]);
    command.uid(65_534).gid(65_534);
    let output = output_within(&mut command, Duration::from_secs(10))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("redirector run needs root"), "{stderr}");
    assert_eq!(sandbox.attached_programs()?, "");
    Ok(())
}

#[test]
fn a_start_without_a_needed_capability_names_it() -> anyhow::Result<()> {
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let node = sandbox.node_netns_path().display().to_string();
    let standard = sandbox.config_toml(&bpf_tests::harness::standard_listeners(&sandbox));
    // Without cache_netns (nsenter puts the agent in the node's namespace, changing nothing
    // else) it needs no CAP_SYS_ADMIN, but CAP_PERFMON; with it, CAP_SYS_ADMIN.
    let in_node = standard.replace(&format!("cache_netns = {node:?}\n"), "");
    assert!(!in_node.contains("cache_netns"), "{in_node}");
    let cases = [
        (
            in_node,
            "-sys_admin,-perfmon",
            "the agent lacks CAP_PERFMON (",
            true,
        ),
        (
            standard,
            "-sys_admin",
            "the agent lacks CAP_SYS_ADMIN (to enter cache_netns)",
            false,
        ),
    ];
    for (index, (text, dropped, expected, enter)) in cases.into_iter().enumerate() {
        let config = sandbox.write_file(&format!("config-{index}.toml"), &text)?;
        let mut command = if enter {
            let mut command = Command::new("nsenter");
            command.arg(format!("--net={node}")).arg("setpriv");
            command
        } else {
            Command::new("setpriv")
        };
        command
            .arg(format!("--bounding-set={dropped}"))
            .arg(redirector_bin())
            .args(["run", "--config", &config.display().to_string()]);
        let output = output_within(&mut command, Duration::from_secs(30))?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "case {index}: {stderr}");
        assert!(stderr.contains(expected), "case {index}: {stderr}");
        assert!(
            stderr.contains("CapabilityBoundingSet="),
            "case {index} says what to do: {stderr}"
        );
        assert_eq!(sandbox.attached_programs()?, "", "case {index}");
        assert!(
            !sandbox.pin_dir().join("maps").exists(),
            "case {index} left maps pinned"
        );
    }
    Ok(())
}

#[test]
fn the_capabilities_the_unit_grants_steer_and_fail_over() -> anyhow::Result<()> {
    // What deploy/systemd/redirector.service grants (the DaemonSet adds the same, which
    // redirector/tests/deploy.rs checks), and nothing else in the bounding set.
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    // The unit's agent runs in the node's namespace, with no cache_netns to enter (that would
    // need CAP_SYS_ADMIN, which the unit leaves out).
    let (config, mut agent) =
        shipped::start_agent_on(&sandbox, &bpf_tests::harness::standard_listeners(&sandbox))?;
    assert_eq!(
        shipped::effective_capabilities(agent.pid())?,
        shipped::expected_capabilities()?,
        "the agent runs with exactly {:?}",
        shipped::capabilities()?
    );
    assert_eq!(answered_by(&sandbox)?, "cache");
    sandbox.stop_server("cache")?;
    assert_eq!(
        answered_by(&sandbox)?,
        "upstream",
        "failed over in the kernel"
    );
    bpf_tests::cli::stop_agent(&mut agent)?;
    shipped::uninstall(&sandbox, &config)?;
    assert_eq!(sandbox.attached_programs()?, "");
    Ok(())
}
