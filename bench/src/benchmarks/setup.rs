//! Setting up, and what the agent costs in memory.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Spread, rig::Rig};
use bpf_tests::{command::TestProcess, sandbox::Ns};

/// How long one way of setting up took.
#[derive(Clone, Debug, Serialize)]
pub struct SetupTime {
    /// What was set up.
    pub what: &'static str,
    /// Milliseconds.
    pub ms: Spread,
}

/// One phase of the agent's start, as it logs them with "redirector is steering".
#[derive(Clone, Debug, Serialize)]
pub struct StartPhase {
    /// The phase's name (`checks`, `load`, `attach`, ...).
    pub phase: String,
    /// Milliseconds, one figure per trial.
    pub ms: Spread,
}

/// `redirector run` from process start to "steering" (programs verified, loaded, attached, maps
/// filled, caches counted and probed), `trials` times, uninstalling in between; and the phases
/// the agent says that time went to (the rest is the process's own start and the log's way
/// out).
pub fn agent_start(rig: &Rig, trials: usize) -> anyhow::Result<(SetupTime, Vec<StartPhase>)> {
    let mut ms = Vec::new();
    let mut phases: Vec<(String, Vec<f64>)> = Vec::new();
    for _ in 0..trials {
        let started = Instant::now();
        let mut agent = rig.start_agent()?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
        let logged = agent.printed();
        let line = logged
            .iter()
            .find(|line| line.contains("redirector is steering"))
            .ok_or_else(|| anyhow::anyhow!("the agent did not log that it steers"))?;
        for (phase, took) in start_phases(line) {
            match phases.iter_mut().find(|(name, _)| *name == phase) {
                Some((_, trials)) => trials.push(took),
                None => phases.push((phase, vec![took])),
            }
        }
        rig.stop_and_uninstall(agent)?;
    }
    anyhow::ensure!(
        !phases.is_empty(),
        "the agent logged no start phases (startup_ms=name=ms,...) with \"redirector is steering\""
    );
    Ok((
        SetupTime {
            what: "redirector run: process start to steering (load, verify, attach, probe)",
            ms: Spread::of(ms),
        },
        phases
            .into_iter()
            .map(|(phase, trials)| StartPhase {
                phase,
                ms: Spread::of(trials),
            })
            .collect(),
    ))
}

/// The `startup_ms` phases (`name=ms` pairs) of the agent's "redirector is steering" line, in
/// either log format.
fn start_phases(line: &str) -> Vec<(String, f64)> {
    let Some((_, rest)) = line.split_once("startup_ms") else {
        return Vec::new();
    };
    let value = rest
        .trim_start_matches(['=', ':', '"'])
        .split(|c: char| c == '"' || c.is_whitespace())
        .next()
        .unwrap_or_default();
    value
        .split(',')
        .map_while(|pair| {
            let (name, ms) = pair.split_once('=')?;
            Some((name.to_owned(), ms.parse().ok()?))
        })
        .collect()
}

/// The incumbent's rules for two listeners (NodeLocal DNSCache's set: raw NOTRACK both ways and
/// filter ACCEPT, UDP and TCP) installed with one `iptables-restore --noflush` batch, then
/// removed.
pub fn iptables_restore(rig: &Rig, trials: usize) -> anyhow::Result<SetupTime> {
    let mut raw = String::from("*raw\n");
    let mut filter = String::from("*filter\n");
    for listener in ["169.254.10.10", "169.254.10.11"] {
        for protocol in ["udp", "tcp"] {
            raw.push_str(&format!("-A PREROUTING -d {listener}/32 -p {protocol} -m {protocol} --dport 53 -j NOTRACK\n-A OUTPUT -s {listener}/32 -p {protocol} -m {protocol} --sport 53 -j NOTRACK\n"));
            filter.push_str(&format!("-A INPUT -d {listener}/32 -p {protocol} -m {protocol} --dport 53 -j ACCEPT\n-A OUTPUT -s {listener}/32 -p {protocol} -m {protocol} --sport 53 -j ACCEPT\n"));
        }
    }
    let rules = format!("{raw}COMMIT\n{filter}COMMIT\n");
    let add = rig.sandbox.write_file("incumbent.rules", &rules)?;
    let remove = rig.sandbox.write_file(
        "incumbent.flush",
        "*raw\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n",
    )?;
    let node = rig.sandbox.netns(Ns::Node);
    let mut ms = Vec::new();
    for _ in 0..trials {
        let started = Instant::now();
        node.run(
            "iptables-restore",
            &["--noflush", &add.display().to_string()],
        )?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
        node.run("iptables-restore", &[&remove.display().to_string()])?;
    }
    Ok(SetupTime {
        what: "iptables-restore --noflush of the incumbent's 16 rules, one batch",
        ms: Spread::of(ms),
    })
}

/// The agent's and the maps' memory, and the agent's CPU.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Memory {
    /// The agent's resident set, KiB.
    pub agent_rss_kib: u64,
    /// The agent's CPU time over the wall time of the runs with it (probes every 500 ms,
    /// reconcile and nftables checks every 5 s, while the pod sent load), percent of one CPU.
    pub agent_cpu_percent: f64,
    /// Each pinned map's kernel memory (bpftool's `bytes_memlock`), bytes.
    pub maps: Vec<(String, u64)>,
    /// Their sum.
    pub maps_total_bytes: u64,
}

/// The agent's CPU time (user + system) and the wall clock, now.
pub fn cpu_sample(agent: &TestProcess) -> anyhow::Result<(f64, Instant)> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", agent.pid()))?;
    // Fields after the command name (which is in parentheses): utime and stime are the 12th and
    // 13th of them, in clock ticks.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .into_iter()
        .flatten()
        .filter_map(|field| field.parse::<f64>().ok())
        .sum();
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks / per_second.max(1.0), Instant::now()))
}

/// Reads the memory of `agent` and of the maps pinned by it, and its CPU share since `since`.
pub fn memory(rig: &Rig, agent: &TestProcess, since: (f64, Instant)) -> anyhow::Result<Memory> {
    let (cpu_now, _) = cpu_sample(agent)?;
    let agent_cpu_percent = (cpu_now - since.0) / since.1.elapsed().as_secs_f64() * 100.0;
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.pid()))?;
    let agent_rss_kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or_default();
    let maps = pinned_map_memory(rig)?;
    let maps_total_bytes = maps.iter().map(|(_, bytes)| bytes).sum();
    Ok(Memory {
        agent_rss_kib,
        agent_cpu_percent,
        maps,
        maps_total_bytes,
    })
}

/// Each pinned map's kernel memory (bpftool's `bytes_memlock`), bytes, in `ALL_MAPS`' order.
pub fn pinned_map_memory(rig: &Rig) -> anyhow::Result<Vec<(String, u64)>> {
    let mut maps = Vec::new();
    for name in redirector_common::names::ALL_MAPS {
        let pin = rig.sandbox.pin_dir().join("maps").join(name);
        let shown = bpf_tests::command::run(
            "bpftool",
            [
                "map",
                "show",
                "pinned",
                &pin.display().to_string(),
                "--json",
            ],
        )?;
        let info: serde_json::Value = serde_json::from_str(&shown)?;
        maps.push((
            name.to_owned(),
            info["bytes_memlock"].as_u64().unwrap_or_default(),
        ));
    }
    Ok(maps)
}

/// A pause that lets the agent settle (probes, first reconcile) before measuring.
pub const SETTLE: Duration = Duration::from_millis(1500);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_phases_are_read_from_either_log_format() {
        let text = "2026-12-01T13:00:00Z  INFO redirector::agent: redirector is steering cgroup=/x \
                    startup_ms=checks=0.4,load=41.2,attach=3.0 listeners=1";
        let json = r#"{"fields":{"message":"redirector is steering","startup_ms":"checks=0.4,load=41.2,attach=3.0","listeners":1}}"#;
        for line in [text, json] {
            assert_eq!(
                start_phases(line),
                [
                    ("checks".to_owned(), 0.4),
                    ("load".to_owned(), 41.2),
                    ("attach".to_owned(), 3.0)
                ],
                "{line}"
            );
        }
        assert!(start_phases("redirector is steering").is_empty());
    }
}
