//! Per-run costs of this build's programs against another build's, side by side in one run: the
//! bench's hook operations (`steering::HOOK_OPERATIONS`), each agent attached in turn, trials
//! interleaved so that the machine's drifts hit both alike; from the kernel's accounting
//! (`BPF_ENABLE_STATS`). For a change to a hot path: build the release before it, then
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

use std::{collections::BTreeMap, path::PathBuf};

use clap::Parser;
use redirector_bench::benchmarks::{
    Spread,
    rig::Rig,
    setup::SETTLE,
    steering::{self, HOOK_OPERATIONS},
};

#[derive(Parser, Debug)]
struct Args {
    /// The agent binary of the build to compare against.
    #[arg(long)]
    baseline: PathBuf,
    /// This build's agent binary.
    #[arg(long)]
    current: PathBuf,
    /// A configuration key the baseline does not know, left out of its configuration (repeat).
    #[arg(long)]
    drop_key: Vec<String>,
    /// `KEY=VALUE`: the baseline's configuration sets KEY to VALUE instead (repeat). With the
    /// same binary on both sides this measures a setting: `--baseline-set stall_after_ms=0` is
    /// what the stall detection costs.
    #[arg(long, value_parser = parse_setting)]
    baseline_set: Vec<(String, String)>,
    /// Interleaved trials.
    #[arg(long, default_value_t = 5)]
    trials: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rig = Rig::new()?;
    let text = std::fs::read_to_string(&rig.config)?;
    let key_of = |line: &str| line.split('=').next().unwrap_or_default().trim().to_owned();
    let mut unset: Vec<&String> = args.baseline_set.iter().map(|(key, _)| key).collect();
    let kept: Vec<String> = text
        .lines()
        .filter(|line| !args.drop_key.contains(&key_of(line)))
        .map(|line| {
            let key = key_of(line);
            match args.baseline_set.iter().find(|(set, _)| *set == key) {
                Some((_, value)) => {
                    unset.retain(|set| **set != key);
                    format!("{key} = {value}")
                }
                None => line.to_owned(),
            }
        })
        .collect();
    anyhow::ensure!(
        unset.is_empty(),
        "--baseline-set names keys the configuration does not have: {unset:?}"
    );
    let baseline_config = rig.config.with_file_name("config-baseline.toml");
    std::fs::write(&baseline_config, kept.join("\n") + "\n")?;
    let configs = [baseline_config, rig.config.clone()];
    // (operation, program) → ns per run of each trial, per build (0: baseline, 1: current).
    let mut per_run: BTreeMap<(usize, &'static str), [Vec<f64>; 2]> = BTreeMap::new();
    for trial in 1..=args.trials {
        for (build, binary) in [&args.baseline, &args.current].into_iter().enumerate() {
            eprintln!(
                "cost-compare: trial {trial} of {}, {}",
                args.trials,
                binary.display()
            );
            // SAFETY: this program is single-threaded here; the variable is read by the helpers
            // that start the agent and run its CLI.
            unsafe { std::env::set_var("REDIRECTOR_BIN", binary) };
            let agent = bpf_tests::cli::start_agent(&configs[build])?;
            std::thread::sleep(SETTLE);
            let _stopped = rig.stop_agent(agent)?;
            for operation in 0..HOOK_OPERATIONS.len() {
                for runs in steering::program_runs(&rig, operation)? {
                    per_run.entry((operation, runs.program)).or_default()[build]
                        .push(runs.ns_per_run());
                }
            }
            let uninstall = bpf_tests::cli::redirector(&[
                "uninstall",
                "--config",
                &configs[build].display().to_string(),
            ])?;
            anyhow::ensure!(
                uninstall.code == 0,
                "uninstall failed: {}",
                uninstall.stderr
            );
        }
    }
    println!(
        "| operation | program | {} ns per run | {} ns per run | difference (medians) |",
        args.baseline.display(),
        args.current.display()
    );
    println!("| --- | --- | --- | --- | --- |");
    for ((operation, program), [baseline, current]) in per_run {
        let (baseline, current) = (Spread::of(baseline), Spread::of(current));
        println!(
            "| {} | `{program}` | {} | {} | {:+.0} |",
            HOOK_OPERATIONS[operation].0,
            baseline.show(0),
            current.show(0),
            current.median - baseline.median
        );
    }
    Ok(())
}

/// `KEY=VALUE` of `--baseline-set`.
fn parse_setting(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))?;
    Ok((key.trim().to_owned(), value.trim().to_owned()))
}
