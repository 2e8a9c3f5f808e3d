//! The agent as the project ships it, for the tests of what privilege changes: root with exactly
//! the capabilities the systemd unit grants (`CapabilityBoundingSet=` of
//! `deploy/systemd/redirector.service`; the DaemonSet adds the same, which
//! `redirector/tests/deploy.rs` checks), in the node's network namespace, where the unit and the
//! hostNetwork DaemonSet run it. So it may not read another process's `/proc/PID/fd` (no
//! `CAP_SYS_PTRACE`) nor enter another namespace (no `CAP_SYS_ADMIN`): what it knows of the caches
//! it knows from the kernel, as on a node. The runtime's part (dropping every other capability
//! before the exec) is `setpriv`'s, as the container tests' runtime does it.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::Context as _;

use crate::{
    command::{TestProcess, output_within},
    sandbox::{Sandbox, redirector_bin},
};

/// The capabilities the unit grants, as `setpriv` names them (`bpf`, `net_admin`, ...).
pub fn capabilities() -> anyhow::Result<Vec<String>> {
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/systemd/redirector.service"),
    )
    .context("reading the shipped unit")?;
    let granted: Vec<String> = unit
        .lines()
        .find_map(|line| line.strip_prefix("CapabilityBoundingSet="))
        .context("the unit has no CapabilityBoundingSet")?
        .split_whitespace()
        .map(|name| name.trim_start_matches("CAP_").to_lowercase())
        .collect();
    anyhow::ensure!(!granted.is_empty(), "the unit grants no capability");
    Ok(granted)
}

/// The `--bounding-set` argument of `setpriv` that leaves the unit's capabilities only.
pub fn bounding_set() -> anyhow::Result<String> {
    Ok(format!(
        "--bounding-set=-all,+{}",
        capabilities()?.join(",+")
    ))
}

/// `config` (one of the sandbox's configurations) for an agent that runs in the node's
/// namespace: without `cache_netns`, which only an agent with `CAP_SYS_ADMIN` may enter.
pub fn in_node(sandbox: &Sandbox, config: &str) -> anyhow::Result<String> {
    let node = sandbox.node_netns_path().display().to_string();
    let line = format!("cache_netns = {node:?}\n");
    anyhow::ensure!(config.contains(&line), "no cache_netns in {config}");
    Ok(config.replace(&line, ""))
}

/// A command that runs `redirector ARGS` in the node's namespace with the unit's capabilities.
pub fn command(sandbox: &Sandbox, args: &[&str]) -> anyhow::Result<Command> {
    let mut command = Command::new("nsenter");
    command
        .arg(format!("--net={}", sandbox.node_netns_path().display()))
        .arg("setpriv")
        .arg(bounding_set()?)
        .arg(redirector_bin())
        .args(args);
    Ok(command)
}

/// Starts `redirector run` as shipped on `config` (a file written by [`in_node`]'s text) and
/// waits until it steers.
pub fn start_agent(sandbox: &Sandbox, config: &Path) -> anyhow::Result<TestProcess> {
    let command = command(sandbox, &["run", "--config", &config.display().to_string()])?;
    TestProcess::start(
        "redirector run (the shipped capabilities)",
        command,
        "redirector is steering",
        Duration::from_secs(30),
    )
}

/// Writes the sandbox's configuration of `listeners` for the node's namespace ([`in_node`]) as
/// `config.toml`, and starts the agent as shipped on it: the file (for `uninstall`) and the agent.
pub fn start_agent_on(
    sandbox: &Sandbox,
    listeners: &str,
) -> anyhow::Result<(PathBuf, TestProcess)> {
    let config = in_node(sandbox, &sandbox.config_toml(listeners))?;
    let config = sandbox.write_file("config.toml", &config)?;
    let agent = start_agent(sandbox, &config)?;
    Ok((config, agent))
}

/// `redirector uninstall` as shipped on `config`, which must succeed (its nftables table is in
/// the node's namespace).
pub fn uninstall(sandbox: &Sandbox, config: &Path) -> anyhow::Result<()> {
    let mut command = command(
        sandbox,
        &["uninstall", "--config", &config.display().to_string()],
    )?;
    let output = output_within(&mut command, Duration::from_secs(30))?;
    anyhow::ensure!(output.status.success(), "uninstall failed: {output:?}");
    Ok(())
}

/// The effective capabilities of process `pid`, as a bit set (`CapEff`).
pub fn effective_capabilities(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .map(str::trim)
        .context("no CapEff")?;
    Ok(u64::from_str_radix(effective, 16)?)
}

/// The bit set of the unit's capabilities.
pub fn expected_capabilities() -> anyhow::Result<u64> {
    const BITS: [(&str, u32); 5] = [
        ("net_admin", 12),
        ("sys_ptrace", 19),
        ("sys_admin", 21),
        ("perfmon", 38),
        ("bpf", 39),
    ];
    capabilities()?.iter().try_fold(0u64, |bits, name| {
        let (_, bit) = BITS
            .iter()
            .find(|(known, _)| known == name)
            .with_context(|| format!("the unit grants {name}, which this helper does not know"))?;
        Ok(bits | 1 << bit)
    })
}
