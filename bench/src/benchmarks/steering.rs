//! What steering costs: dnsperf throughput and latency through each path to the same cache, and
//! the per-syscall cost of the hooks.

use std::{net::Ipv4Addr, time::Duration};

use anyhow::Context as _;
use serde::Serialize;

use super::{
    Spread, percentile,
    rig::{CACHE_ADDRESS, LISTENER, Rig, VIP},
};

/// A way from the pod to the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Path {
    /// The cache's address, no rules at all (conntrack tracks every query).
    Direct,
    /// The cache's address with the incumbent's raw-table NOTRACK rules.
    Notrack,
    /// A VIP DNATed to the cache (the NAT way).
    Dnat,
    /// The listener, steered to the cache by redirector (with its conntrack bypass).
    Redirector,
}

impl Path {
    /// The name in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "cache address, no rules",
            Self::Notrack => "cache address, iptables raw NOTRACK",
            Self::Dnat => "VIP, iptables DNAT",
            Self::Redirector => "listener, redirector",
        }
    }

    /// Where the pod sends its queries.
    #[must_use]
    pub fn server(self) -> Ipv4Addr {
        match self {
            Self::Direct | Self::Notrack => CACHE_ADDRESS,
            Self::Dnat => VIP,
            Self::Redirector => LISTENER,
        }
    }

    /// The baselines, measured without the agent.
    pub const BASELINES: [Self; 3] = [Self::Direct, Self::Notrack, Self::Dnat];

    /// Sets the path's rules up (`-A`) or takes them down (`-D`).
    pub fn rules(self, rig: &Rig, action: &str) -> anyhow::Result<()> {
        match self {
            Self::Notrack => rig.notrack(action),
            Self::Dnat => rig.dnat(action, VIP, CACHE_ADDRESS),
            Self::Direct | Self::Redirector => Ok(()),
        }
    }
}

/// dnsperf through one path.
#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    /// The path.
    pub path: Path,
    /// Queries per second.
    pub qps: Spread,
    /// Average latency under that load, microseconds.
    pub average_latency_us: Spread,
    /// Queries lost, summed over trials.
    pub lost: u64,
}

/// Per-query latency at a fixed rate through one path.
#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    /// The path.
    pub path: Path,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Samples taken.
    pub samples: usize,
    /// Every sample, microseconds (for the distribution chart).
    #[serde(skip)]
    pub samples_us: Vec<f64>,
}

/// How long dnsperf runs per trial.
const DNSPERF_SECONDS: &str = "3";
/// Trials per measurement.
pub const TRIALS: usize = 5;

/// One dnsperf run at full speed.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    /// Queries per second.
    pub qps: f64,
    /// Average latency, µs.
    pub average_latency_us: f64,
    /// Queries lost.
    pub lost: u64,
}

/// The throughput of `runs` along `path`.
#[must_use]
pub fn throughput(path: Path, runs: &[Run]) -> Throughput {
    Throughput {
        path,
        qps: Spread::of(runs.iter().map(|run| run.qps).collect()),
        average_latency_us: Spread::of(runs.iter().map(|run| run.average_latency_us).collect()),
        lost: runs.iter().map(|run| run.lost).sum(),
    }
}

/// dnsperf from the pod along `path`, asking for `probe.redirector.test A` over and over, with
/// `load` (its duration and rate arguments); returns what it printed.
fn run_dnsperf(rig: &Rig, path: Path, load: &[&str]) -> anyhow::Result<String> {
    run_dnsperf_to(rig, path.server(), load, Duration::from_secs(30))
}

/// dnsperf from the pod to `server`, as [`run_dnsperf`], given `limit` to finish.
pub(super) fn run_dnsperf_to(
    rig: &Rig,
    server: Ipv4Addr,
    load: &[&str],
    limit: Duration,
) -> anyhow::Result<String> {
    let data = rig
        .sandbox
        .write_file("dnsperf.txt", "probe.redirector.test A\n")?;
    let (server, data) = (server.to_string(), data.display().to_string());
    let mut args = vec!["-s", server.as_str(), "-d", data.as_str()];
    args.extend_from_slice(load);
    rig.in_pod("dnsperf", &args, limit)
}

/// dnsperf at full speed along `path`.
pub fn dnsperf(rig: &Rig, path: Path) -> anyhow::Result<Run> {
    dnsperf_to(rig, path.server())
}

/// dnsperf at full speed to `server` (unconnected UDP sockets: `sendto`, and `recvfrom` without
/// an address, so no recvmsg hook runs).
pub fn dnsperf_to(rig: &Rig, server: Ipv4Addr) -> anyhow::Result<Run> {
    let output = run_dnsperf_to(
        rig,
        server,
        &[
            "-l",
            DNSPERF_SECONDS,
            "-c",
            "4",
            "-q",
            "64",
            "-T",
            "1",
            "-t",
            "2",
        ],
        Duration::from_secs(30),
    )?;
    parse_run(&output)
}

/// The figures of one dnsperf run from what it printed.
pub(super) fn parse_run(output: &str) -> anyhow::Result<Run> {
    let field = |label: &str| -> anyhow::Result<f64> {
        output
            .lines()
            .find_map(|line| line.trim().strip_prefix(label))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no {label:?} in dnsperf's output:\n{output}"))
    };
    Ok(Run {
        qps: field("Queries per second:")?,
        average_latency_us: field("Average Latency (s):")? * 1e6,
        lost: field("Queries lost:")? as u64,
    })
}

/// Per-query latencies (µs) at 2000 queries per second for 3 s, from dnsperf's verbose output.
pub fn latencies(rig: &Rig, path: Path) -> anyhow::Result<Vec<f64>> {
    let output = run_dnsperf(
        rig,
        path,
        &["-l", "3", "-Q", "2000", "-c", "1", "-T", "1", "-v"],
    )?;
    // Verbose lines: "> NOERROR probe.redirector.test A 0.000123" (the last field, seconds).
    let samples: Vec<f64> = output
        .lines()
        .filter(|line| line.starts_with('>'))
        .filter_map(|line| line.split_whitespace().last()?.parse::<f64>().ok())
        .map(|seconds| seconds * 1e6)
        .collect();
    anyhow::ensure!(
        !samples.is_empty(),
        "no per-query latency in dnsperf -v output: {}",
        output.lines().take(5).collect::<Vec<_>>().join("\n")
    );
    Ok(samples)
}

/// The latency summary of `samples`.
#[must_use]
pub fn latency(path: Path, samples_us: Vec<f64>) -> Latency {
    Latency {
        path,
        p50_us: percentile(&samples_us, 50.0),
        p90_us: percentile(&samples_us, 90.0),
        p99_us: percentile(&samples_us, 99.0),
        samples: samples_us.len(),
        samples_us,
    }
}

/// A per-syscall cost with and without the programs attached.
#[derive(Clone, Debug, Serialize)]
pub struct HookCost {
    /// What was timed.
    pub operation: &'static str,
    /// Nanoseconds per operation without the programs.
    pub without_ns: Spread,
    /// With them.
    pub with_ns: Spread,
}

/// What each program costs per run during one of [`HOOK_OPERATIONS`], from the kernel's
/// accounting.
#[derive(Clone, Debug, Serialize)]
pub struct ProgramCost {
    /// The operation run.
    pub operation: &'static str,
    /// The program.
    pub program: &'static str,
    /// How often it ran in one trial's run of the operation.
    pub runs_per_trial: u64,
    /// Nanoseconds per run, one figure per trial.
    pub ns_per_run: Spread,
}

/// Runs `operation` once more with the programs attached and the kernel's accounting on, and
/// returns the runs of every program meanwhile. Apart from the timed runs: the accounting adds
/// its clock reads to every run, which would count against the programs in [`hook_cost`].
pub fn program_runs(rig: &Rig, operation: usize) -> anyhow::Result<Vec<crate::program_cost::Runs>> {
    let accounting = crate::program_cost::Accounting::enable()?;
    let pin_dir = rig.sandbox.pin_dir();
    let before = accounting.snapshot(&pin_dir)?;
    hook_cost(rig, operation, true)?;
    let after = accounting.snapshot(&pin_dir)?;
    Ok(after.since(&before))
}

/// The timed operations: (name, mode, target, count).
pub const HOOK_OPERATIONS: [(&str, &str, &str, &str); 6] = [
    (
        "connect() of a UDP socket to a listener (steered to the cache)",
        "connect",
        "169.254.10.10:53",
        "20000",
    ),
    (
        "connect() of a UDP socket to anything else (the early return every connect pays)",
        "connect",
        "198.18.2.2:80",
        "20000",
    ),
    (
        "sendto() + recvfrom() of a DNS query to the cache (unsteered) / the listener (steered)",
        "roundtrip",
        "",
        "5000",
    ),
    (
        "the same from a fresh socket per query (each send the socket's first)",
        "fresh-roundtrip",
        "",
        "5000",
    ),
    (
        "send() + recv() of a DNS query on a socket connected once (a kept socket, checked at egress)",
        "connected-roundtrip",
        "",
        "5000",
    ),
    (
        "UDP back and forth between two sockets on loopback (no DNS: every early return)",
        "loopback",
        "127.0.0.1:0",
        "5000",
    ),
];

/// ns per operation of one `hook-cost` run. `steered` picks the listener as the round trip's
/// target (the programs are attached), else the cache's own address.
pub fn hook_cost(rig: &Rig, operation: usize, steered: bool) -> anyhow::Result<f64> {
    let (_, mode, target, count) = HOOK_OPERATIONS[operation];
    let target = if target.is_empty() {
        let address = if steered { LISTENER } else { CACHE_ADDRESS };
        format!("{address}:53")
    } else {
        target.to_owned()
    };
    let output = rig.in_pod(
        &rig.hook_cost.display().to_string(),
        &["--mode", mode, "--target", &target, "--count", count],
        Duration::from_secs(60),
    )?;
    let value: serde_json::Value = serde_json::from_str(output.trim())?;
    value["ns_per_op"]
        .as_f64()
        .with_context(|| format!("hook-cost printed {output}"))
}
