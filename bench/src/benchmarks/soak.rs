//! No false failovers under load: dnsperf through the listener at a fixed share of the cache's
//! capacity for minutes (80 %, and at and past its capacity, where its queue stays full), with
//! the agent at its default settings, while nothing happens to the cache; and at 80 % of what
//! the cache answers under a CPU quota of half a core, which holds it off the CPU in bursts. Every verdict the agent
//! turned down, and every move the kernel made itself (a stall), is a false alarm.

use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;

use super::{
    Spread,
    rig::Rig,
    setup::SETTLE,
    steering::{Path, dnsperf, parse_run, run_dnsperf_to},
};
use bpf_tests::{cgroup::CpuQuota, cli::logged_metrics_address, http};

/// What one soak saw.
#[derive(Clone, Debug, Serialize)]
pub struct Soak {
    /// How long dnsperf ran, seconds.
    pub seconds: u64,
    /// The cache's capacity the rate is a share of: dnsperf's median at full speed straight to
    /// the cache, queries per second.
    pub capacity_qps: f64,
    /// The rate asked of dnsperf (`-Q`).
    pub rate_qps: u64,
    /// What dnsperf achieved.
    pub achieved_qps: f64,
    /// Queries dnsperf lost.
    pub lost: u64,
    /// Probes that the cache answered.
    pub probes_answered: u64,
    /// Probes that failed (timed out, refused, SERVFAIL, ...).
    pub probes_failed: u64,
    /// Times the probes failed the listener over: false failovers, as the cache never failed.
    pub verdicts_down: u64,
    /// Times the kernel found the cache stalled and moved its listener: false flips, as the
    /// cache kept reading.
    pub stalls: u64,
    /// The CPU quota the cache ran under, if any.
    pub cpu_quota: Option<String>,
    /// How often that quota held the cache off the CPU during the run.
    pub throttled: Option<u64>,
}

/// The share of the capacity the soak asks for.
pub const LOAD_SHARE: f64 = 0.8;

/// The shares of the capacity the load runs ask for, past the soak's: at the capacity, and half
/// again more than the cache can answer.
pub const OVERLOAD_SHARES: [f64; 2] = [1.0, 1.5];

/// The quota of a cache given half a core, in Kubernetes' default period: 50 ms of CPU in every
/// 100 ms, so a busy cache can be held off the CPU for up to 50 ms at a time.
pub const HALF_A_CORE: (u64, u64) = (50_000, 100_000);

/// The soak with the cache under [`HALF_A_CORE`]: its capacity measured under the quota (dnsperf
/// at full speed straight to it, the median of three), then `share` of that for `seconds`.
pub fn measure_under_quota(rig: &mut Rig, share: f64, seconds: u64) -> anyhow::Result<Soak> {
    let (quota_us, period_us) = HALF_A_CORE;
    let quota = CpuQuota::create(
        &format!("redirector-bench-{}", std::process::id()),
        quota_us,
        period_us,
    )?;
    quota.add(rig.sandbox.process("cache")?.pid())?;
    let mut capacities = Vec::new();
    for _ in 0..3 {
        capacities.push(dnsperf(rig, Path::Direct)?.qps);
    }
    let capacity_qps = Spread::of(capacities).median;
    let before = quota.throttled()?;
    let mut soak = measure(rig, capacity_qps, share, seconds)?;
    soak.throttled = Some(quota.throttled()? - before);
    soak.cpu_quota = Some(quota.how.clone());
    Ok(soak)
}

/// dnsperf along the redirector path at `share` of `capacity_qps` for `seconds`, the agent
/// running with its default probes and stall limit.
pub fn measure(rig: &Rig, capacity_qps: f64, share: f64, seconds: u64) -> anyhow::Result<Soak> {
    let mut agent = rig.start_agent()?;
    std::thread::sleep(SETTLE);
    let metrics = logged_metrics_address(&mut agent)?;
    let rate_qps = (capacity_qps * share).round() as u64;
    let (duration, rate) = (seconds.to_string(), rate_qps.to_string());
    let output = run_dnsperf_to(
        rig,
        Path::Redirector.server(),
        &[
            "-l", &duration, "-Q", &rate, "-c", "4", "-q", "64", "-T", "1", "-t", "2",
        ],
        Duration::from_secs(seconds + 60),
    )?;
    let run = parse_run(&output)?;
    let body = http::get(metrics, "/metrics")?.body;
    // A series appears with its first count.
    let sample = |series: &str| http::sample(&body, series).map(|count| count as u64);
    let probes_answered = sample("redirector_probes_total{listener=\"node\",result=\"success\"}")
        .with_context(|| format!("no probe count in /metrics:\n{body}"))?;
    let probes_failed =
        sample("redirector_probes_total{listener=\"node\",result=\"failure\"}").unwrap_or(0);
    let verdicts_down =
        sample("redirector_route_transitions_total{listener=\"node\",cause=\"probes_failing\"}")
            .unwrap_or(0);
    let stalls = sample("redirector_kernel_flips_total{listener=\"node\",reason=\"stalled\"}")
        .with_context(|| format!("no kernel flip count in /metrics:\n{body}"))?;
    rig.stop_and_uninstall(agent)?;
    Ok(Soak {
        seconds,
        capacity_qps,
        rate_qps,
        achieved_qps: run.qps,
        lost: run.lost,
        probes_answered,
        probes_failed,
        verdicts_down,
        stalls,
        cpu_quota: None,
        throttled: None,
    })
}
