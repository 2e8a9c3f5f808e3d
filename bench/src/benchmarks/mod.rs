//! `cargo xtask bench`: the project's claims measured against what a user would otherwise run,
//! side by side in one run (this machine is noisy: only ratios taken in the same run mean
//! something). Every figure is the median of repeated trials with its spread. Nothing here is
//! asserted: the tests assert correctness, the bench reports numbers.

pub mod compare;
pub mod conntrack;
pub mod failover;
pub mod layouts;
pub mod output;
pub mod rig;
pub mod setup;
pub mod sizing;
pub mod soak;
pub mod steering;
pub mod sync;
pub mod workloads;

use serde::Serialize;

/// Repeated measurements of one quantity.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Spread {
    /// The median.
    pub median: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
    /// Every trial, in order.
    pub trials: Vec<f64>,
}

impl Spread {
    /// The spread of `trials` (empty: all zero).
    #[must_use]
    pub fn of(trials: Vec<f64>) -> Self {
        let mut sorted = trials.clone();
        sorted.sort_by(f64::total_cmp);
        let median = match sorted.len() {
            0 => 0.0,
            n if n % 2 == 1 => sorted[n / 2],
            n => f64::midpoint(sorted[n / 2 - 1], sorted[n / 2]),
        };
        Self {
            median,
            min: sorted.first().copied().unwrap_or_default(),
            max: sorted.last().copied().unwrap_or_default(),
            trials,
        }
    }

    /// `median (min–max)` with `decimals`.
    #[must_use]
    pub fn show(&self, decimals: usize) -> String {
        format!(
            "{:.decimals$} ({:.decimals$}–{:.decimals$})",
            self.median, self.min, self.max
        )
    }

    /// `+median (+min–+max)` with signs and no decimals: a difference.
    #[must_use]
    pub fn show_signed(&self) -> String {
        format!("{:+.0} ({:+.0}–{:+.0})", self.median, self.min, self.max)
    }
}

/// The `p`-th percentile (0–100) of `values` (nearest rank; empty: 0).
#[must_use]
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Where the run happened.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// `uname -r`.
    pub kernel: String,
    /// Online CPUs.
    pub cpus: usize,
    /// The CPU model.
    pub cpu_model: String,
    /// When (UTC).
    pub date: String,
}

impl Machine {
    /// This machine, now.
    #[must_use]
    pub fn here() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find_map(|line| {
                line.strip_prefix("model name")?
                    .split_once(':')
                    .map(|(_, model)| model.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let date = bpf_tests::command::run("date", ["-u", "+%Y-%m-%d %H:%M UTC"])
            .unwrap_or_default()
            .trim()
            .to_owned();
        Self {
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            date,
        }
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Where and when.
    pub machine: Machine,
    /// dnsperf through each path.
    pub throughput: Vec<steering::Throughput>,
    /// The programs against none, by layout and socket kind.
    pub layouts: Vec<layouts::LayoutThroughput>,
    /// Per-run cost of each program under load, by layout.
    pub layout_program_cost: Vec<layouts::LayoutProgramCost>,
    /// Per-query latency at a fixed rate through each path.
    pub latency: Vec<steering::Latency>,
    /// Per-syscall cost of the hooks.
    pub hook_cost: Vec<steering::HookCost>,
    /// Per-run cost of each program during those syscalls, from the kernel's accounting.
    pub program_cost: Vec<steering::ProgramCost>,
    /// Conntrack entries left by fresh-socket queries.
    pub conntrack: Vec<conntrack::Entries>,
    /// Failover under load.
    pub failover: Vec<failover::FailoverTrials>,
    /// Setting up.
    pub setup: Vec<setup::SetupTime>,
    /// No false failovers under load.
    pub soak: soak::Soak,
    /// The same load at and past the cache's capacity, and under a CPU quota.
    pub overload: Vec<soak::Soak>,
    /// Where the agent's start went, phase by phase.
    pub start_phases: Vec<setup::StartPhase>,
    /// EndpointSlice event to kernel map.
    pub sync: sync::SyncLatency,
    /// The agent's and the maps' memory.
    pub memory: setup::Memory,
    /// The same per `reverse_nat_entries`.
    pub sizing: Vec<sizing::Sized>,
    /// What DNS per workload costs: per run with accounting off and on, and per tracked cgroup.
    pub workloads: workloads::WorkloadCost,
}
