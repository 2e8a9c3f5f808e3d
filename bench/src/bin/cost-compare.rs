//! Per-run costs of this build's programs against another build's, side by side in one run: the
//! bench's hook operations (`steering::HOOK_OPERATIONS`), each agent attached in turn, trials
//! interleaved (their order alternated) so that the machine's drifts hit both alike; from the
//! kernel's accounting (`BPF_ENABLE_STATS`); `benchmarks::compare` does it. For a change to a hot
//! path: build the release before it, then
//!
//!   cargo build --release -p redirector -p bpf-tests -p redirector-bench --bins
//!   target/release/cost-compare --baseline OLD/redirector --current target/release/redirector \
//!       --drop-key drain_socket --drop-key stall_after_ms --drop-key signal_hold_ms
//!
//! (`--drop-key` leaves a key the baseline does not know out of its configuration.) What a setting
//! costs, one binary on both sides:
//!
//!   target/release/cost-compare --baseline target/release/redirector \
//!       --current target/release/redirector --baseline-set stall_after_ms=0
//!
//! A key of a table is named with it, `--baseline-set workloads.accounting=false`, and lands in
//! that table (appended at the end of the file when the configuration has none).

use std::path::PathBuf;

use clap::Parser;
use redirector_bench::benchmarks::{
    compare::{self, Side},
    rig::Rig,
};

#[derive(Parser, Debug)]
struct Args {
    /// The agent binary of the build to compare against.
    #[arg(long)]
    baseline: PathBuf,
    /// This build's agent binary.
    #[arg(long)]
    current: PathBuf,
    /// A configuration key the baseline does not know, left out of its configuration (repeat;
    /// `TABLE.KEY` for a key of a table).
    #[arg(long)]
    drop_key: Vec<String>,
    /// `KEY=VALUE`: the baseline's configuration sets KEY to VALUE instead (repeat). With the
    /// same binary on both sides this measures a setting: `--baseline-set stall_after_ms=0` is
    /// what the stall detection costs. `TABLE.KEY=VALUE` sets a key of a table, adding it (and
    /// the table) if the configuration lacks it.
    #[arg(long, value_parser = compare::parse_setting)]
    baseline_set: Vec<(String, String)>,
    /// `KEY=VALUE`: the current build's configuration sets KEY to VALUE (repeat), as
    /// `--baseline-set` does for the baseline.
    #[arg(long, value_parser = compare::parse_setting)]
    current_set: Vec<(String, String)>,
    /// Interleaved trials.
    #[arg(long, default_value_t = 5)]
    trials: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rig = Rig::new()?;
    let sides = [
        Side {
            label: args.baseline.display().to_string(),
            binary: args.baseline.clone(),
            config: compare::edited_config(
                &rig,
                "config-baseline.toml",
                &args.drop_key,
                &args.baseline_set,
            )?,
        },
        Side {
            label: args.current.display().to_string(),
            binary: args.current.clone(),
            config: compare::edited_config(&rig, "config-current.toml", &[], &args.current_set)?,
        },
    ];
    let comparison = compare::measure(&rig, &sides, args.trials)?;
    println!("{}", comparison.markdown());
    println!("{}", comparison.sizes_markdown());
    Ok(())
}
