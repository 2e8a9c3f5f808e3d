//! The real `redirector` binary, run against a sandbox.

use std::{process::Command, time::Duration};

use crate::{
    command::{TestProcess, output_within},
    sandbox::{Sandbox, redirector_bin},
};

/// What one `redirector` command printed.
#[derive(Debug)]
pub struct CliOutput {
    /// Exit code (-1 when killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `redirector ARGS` to completion (for at most 30 s, stretched by [`crate::pace`]).
pub fn redirector(args: &[&str]) -> anyhow::Result<CliOutput> {
    redirector_with_env(args, &[])
}

/// The same with environment variables (the test-only switches, `REDIRECTOR_TEST_*`).
pub fn redirector_with_env(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<CliOutput> {
    let mut command = Command::new(redirector_bin());
    command.args(args);
    command.envs(env.iter().copied());
    let output = output_within(&mut command, Duration::from_secs(30))?;
    Ok(CliOutput {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// `redirector state --listener LISTENER --set MODE` against the sandbox's pins.
pub fn set_state(sandbox: &Sandbox, listener: &str, mode: &str) -> anyhow::Result<CliOutput> {
    let pin_dir = sandbox.pin_dir().display().to_string();
    redirector(&[
        "state",
        "--listener",
        listener,
        "--set",
        mode,
        "--pin-dir",
        &pin_dir,
    ])
}

/// Starts `redirector run --config CONFIG` and waits until it steers (for at most 30 s,
/// stretched by [`crate::pace`]: an agent's start takes about 20 times longer under qemu's TCG).
pub fn start_agent(config: &std::path::Path) -> anyhow::Result<TestProcess> {
    start_agent_with(config, &[], &[])
}

/// The same with extra arguments and environment variables.
pub fn start_agent_with(
    config: &std::path::Path,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> anyhow::Result<TestProcess> {
    start_agent_of(&redirector_bin(), config, args, env)
}

/// `redirector run` of the agent binary `bin` (another release's), as [`start_agent_with`].
pub fn start_agent_of(
    bin: &std::path::Path,
    config: &std::path::Path,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> anyhow::Result<TestProcess> {
    let mut command = Command::new(bin);
    command.args(["run", "--config", &config.display().to_string()]);
    command.args(args);
    command.envs(env.iter().map(|(key, value)| (*key, *value)));
    TestProcess::start(
        "redirector run",
        command,
        "redirector is steering",
        Duration::from_secs(30),
    )
}

/// Stops an agent with SIGTERM (it leaves its pins) and waits until it has exited (for at most
/// 10 s, stretched by [`crate::pace`]).
pub fn stop_agent(agent: &mut TestProcess) -> anyhow::Result<()> {
    agent.signal(nix::sys::signal::Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    Ok(())
}

/// `redirector uninstall --config CONFIG`, which must succeed.
pub fn uninstall(config: &std::path::Path) -> anyhow::Result<CliOutput> {
    let output = redirector(&["uninstall", "--config", &config.display().to_string()])?;
    anyhow::ensure!(output.code == 0, "uninstall failed: {output:?}");
    Ok(output)
}

/// The metrics address a `redirector run` logged (`serving /metrics ... address=...`), from
/// either log format.
pub fn logged_metrics_address(agent: &mut TestProcess) -> anyhow::Result<std::net::SocketAddr> {
    let line = agent
        .printed()
        .iter()
        .find(|line| line.contains("serving /metrics"))
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("the agent did not log its metrics address"))?;
    let after = line
        .split("address")
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no address in {line:?}"))?;
    let address: String = after
        .trim_start_matches(['=', '"', ':'])
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
        .collect();
    address
        .parse()
        .map_err(|error| anyhow::anyhow!("{address:?} in {line:?}: {error}"))
}
