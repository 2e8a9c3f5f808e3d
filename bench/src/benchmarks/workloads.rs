//! What DNS per workload costs (issue 42, `[workloads] accounting`): the bench's hook operations
//! with one agent binary, accounting off and on, interleaved trials, per run from the kernel's
//! accounting ([`compare`]); and the kernel memory of each tracked cgroup (`workloads.tracked`).
//!
//! The operations that count: a query sent to the listener from an unconnected socket (counted at
//! `sendmsg4`) and from a connected one (at egress), each answered by the cache, its reply counted
//! at `dns_ingress`; `connect()` to a listener (which counts nothing unless it refuses); and the
//! non-DNS exchange on loopback, every program's early return, `dns_ingress`'s among them.

use std::fmt::Write as _;

use serde::Serialize;

use super::{
    Spread,
    compare::{self, Comparison, Side},
    rig::Rig,
    sizing::{self, TrackedSize},
    steering::HOOK_OPERATIONS,
};

/// Interleaved trials by default.
pub const TRIALS: usize = 21;

/// The programs on the steering path: where a query is counted (`connect4` and `sendmsg4` where
/// the route is decided, egress for a connected socket's datagrams).
pub const STEERING_PROGRAMS: [&str; 3] = ["dns_connect4", "dns_sendmsg4", "dns_egress"];
/// The program that counts replies, and returns early for everything else.
pub const INGRESS_PROGRAM: &str = "dns_ingress";

/// What one operation costs more per operation with accounting on, trial by trial (on less off,
/// the two runs of a trial seconds apart), ns.
#[derive(Clone, Debug, Serialize)]
pub struct PerOperation {
    /// The operation (`HOOK_OPERATIONS`' name).
    pub operation: &'static str,
    /// The steering programs' ([`STEERING_PROGRAMS`]) time per operation, summed.
    pub steering_ns: Spread,
    /// `dns_ingress`'s.
    pub ingress_ns: Spread,
    /// Every program's that ran at least once per 100 operations.
    pub all_ns: Spread,
}

/// The benchmark's results.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadCost {
    /// Accounting off (first side) and on (second), program by program.
    pub comparison: Comparison,
    /// Per operation, the extra time of the programs.
    pub per_operation: Vec<PerOperation>,
    /// `dns_ingress`'s extra time per run on the loopback exchange (no DNS: its early return),
    /// trial by trial.
    pub ingress_early_return_ns: Spread,
    /// `WORKLOADS`' kernel memory at each measured `workloads.tracked`.
    pub memory: Vec<TrackedSize>,
    /// Bytes of kernel memory per tracked cgroup: the difference between the largest and the
    /// smallest size over the difference in entries.
    pub bytes_per_workload: f64,
}

/// Measures it on `rig`: `trials` interleaved trials of the agent (`REDIRECTOR_BIN`) with
/// `workloads.accounting` false and true, then its memory at each of [`sizing::TRACKED`].
pub fn measure(rig: &Rig, trials: usize) -> anyhow::Result<WorkloadCost> {
    let binary = bpf_tests::sandbox::redirector_bin();
    let side = |label: &str, accounting: &str| -> anyhow::Result<Side> {
        let config = compare::edited_config(
            rig,
            &format!("config-accounting-{accounting}.toml"),
            &[],
            &[("workloads.accounting".to_owned(), accounting.to_owned())],
        )?;
        Ok(Side {
            label: label.to_owned(),
            binary: binary.clone(),
            config,
        })
    };
    let sides = [
        side("accounting off", "false")?,
        side("accounting on", "true")?,
    ];
    let comparison = compare::measure(rig, &sides, trials)?;
    let memory = sizing::workloads_tracked(rig)?;
    Ok(summarize(comparison, memory))
}

/// The figures the issue asks for, from the comparison and the memory.
#[must_use]
pub fn summarize(comparison: Comparison, memory: Vec<TrackedSize>) -> WorkloadCost {
    let per_operation = HOOK_OPERATIONS
        .iter()
        .map(|(operation, ..)| {
            let sum = |pick: &dyn Fn(&str) -> bool| {
                paired_sum(
                    comparison
                        .rows
                        .iter()
                        .filter(|row| {
                            row.operation == *operation
                                && row.runs_per_operation >= 0.01
                                && pick(row.program)
                        })
                        .map(|row| &row.difference_per_operation.trials),
                )
            };
            PerOperation {
                operation,
                steering_ns: sum(&|program| STEERING_PROGRAMS.contains(&program)),
                ingress_ns: sum(&|program| program == INGRESS_PROGRAM),
                all_ns: sum(&|_| true),
            }
        })
        .collect();
    let loopback = HOOK_OPERATIONS
        .iter()
        .find(|(_, mode, ..)| *mode == "loopback")
        .map_or("", |(operation, ..)| *operation);
    let ingress_early_return_ns = comparison
        .row(loopback, INGRESS_PROGRAM)
        .map(|row| row.difference_per_run.clone())
        .unwrap_or_default();
    let bytes_per_workload = match (memory.first(), memory.last()) {
        (Some(small), Some(large)) if large.tracked > small.tracked => {
            (large.workloads_bytes as f64 - small.workloads_bytes as f64)
                / f64::from(large.tracked - small.tracked)
        }
        _ => 0.0,
    };
    WorkloadCost {
        comparison,
        per_operation,
        ingress_early_return_ns,
        memory,
        bytes_per_workload,
    }
}

/// The trial-by-trial sum of several programs' paired differences (each in every trial, in
/// order).
fn paired_sum<'a>(rows: impl Iterator<Item = &'a Vec<f64>>) -> Spread {
    let rows: Vec<&Vec<f64>> = rows.collect();
    let trials = rows.iter().map(|trials| trials.len()).min().unwrap_or(0);
    Spread::of(
        (0..trials)
            .map(|trial| rows.iter().map(|trials| trials[trial]).sum())
            .collect(),
    )
}

/// The Markdown report.
#[must_use]
pub fn markdown(cost: &WorkloadCost) -> String {
    let mut text = format!(
        "**DNS per workload: one agent binary, `workloads.accounting` false and true, {} interleaved trials** (ns from the kernel's accounting, medians (min–max); a paired difference is on less off within one trial)\n\n{}\n",
        cost.comparison.trials,
        cost.comparison.markdown()
    );
    let _ = write!(
        text,
        "**What accounting adds per operation** (ns, on less off, summed over the programs trial by trial; steering: {})\n\n\
         | operation | steering programs | `dns_ingress` | every program |\n| --- | ---: | ---: | ---: |\n",
        STEERING_PROGRAMS
            .iter()
            .map(|program| format!("`{program}`"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for row in &cost.per_operation {
        let _ = writeln!(
            text,
            "| {} | {} | {} | {} |",
            row.operation,
            Spread::show_signed(&row.steering_ns),
            Spread::show_signed(&row.ingress_ns),
            Spread::show_signed(&row.all_ns)
        );
    }
    let _ = write!(
        text,
        "\n`dns_ingress`'s early return for a packet that is no DNS (the loopback exchange), on less off: {} ns per run.\n\n\
         **The programs' sizes** (as the kernel holds them after the verifier)\n\n{}\n\
         **Kernel memory of `WORKLOADS`** (bpftool's `bytes_memlock`)\n\n| `workloads.tracked` | bytes |\n| ---: | ---: |\n",
        Spread::show_signed(&cost.ingress_early_return_ns),
        cost.comparison.sizes_markdown()
    );
    for row in &cost.memory {
        let _ = writeln!(text, "| {} | {} |", row.tracked, row.workloads_bytes);
    }
    let _ = writeln!(
        text,
        "\nPer tracked cgroup: {:.1} bytes.",
        cost.bytes_per_workload
    );
    text
}
