//! `cargo xtask bench`: redirector against the incumbents, side by side in one run (see
//! `redirector_bench::benchmarks`). Writes results.json, results.md and SVG charts into `--out`.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use bpf_tests::caches::CacheKind;
use clap::{Parser, ValueEnum};
use redirector_bench::benchmarks::{
    Machine, Report, Spread, conntrack,
    failover::{self, Event, FailoverTrials},
    layouts, output,
    rig::Rig,
    setup, sizing, soak, steering,
    steering::{HOOK_OPERATIONS, Path, TRIALS},
    sync, workloads,
};

/// Failover trials of redirector per event (about 8 s each).
const FAILOVER_TRIALS: usize = 5;
/// Trials of the incumbent's NAT fallback (30 s each).
const NAT_FALLBACK_TRIALS: u64 = 3;

#[derive(Parser, Debug)]
struct Args {
    /// Where the results go.
    #[arg(long, default_value = "docs/bench")]
    out: PathBuf,
    /// EndpointSlice events to time.
    #[arg(long, default_value_t = 1000)]
    sync_events: usize,
    /// How long the soak runs dnsperf at 80 % of the cache's capacity, seconds.
    #[arg(long, default_value_t = 600)]
    soak_seconds: u64,
    /// How long each load at and past the cache's capacity runs, seconds.
    #[arg(long, default_value_t = 300)]
    load_seconds: u64,
    /// Interleaved trials of the per-workload accounting's cost (off and on).
    #[arg(long, default_value_t = workloads::TRIALS)]
    workload_trials: usize,
    /// Run only this benchmark; its results go to `--out` as `NAME.json` and `NAME.md`.
    #[arg(long, value_enum)]
    only: Option<Only>,
}

/// The benchmarks that run alone.
#[derive(ValueEnum, Clone, Copy, Debug)]
enum Only {
    /// What DNS per workload costs (`workloads.accounting` off and on, per run, and the memory
    /// per tracked cgroup).
    Workloads,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let machine = Machine::here();
    eprintln!(
        "bench: {} on {}, kernel {}",
        machine.date, machine.cpu_model, machine.kernel
    );
    let mut rig = Rig::new()?;
    if let Some(Only::Workloads) = args.only {
        eprintln!(
            "bench: DNS per workload, accounting off and on, {} interleaved trials",
            args.workload_trials
        );
        let cost = workloads::measure(&rig, args.workload_trials)?;
        drop(rig);
        let text = format!(
            "Run {} on {} ({} CPUs), kernel {}.\n\n{}",
            machine.date,
            machine.cpu_model,
            machine.cpus,
            machine.kernel,
            workloads::markdown(&cost)
        );
        output::write_one(&args.out, "workloads", &cost, &text)?;
        println!("{text}");
        eprintln!("bench: results in {}", args.out.display());
        return Ok(());
    }

    // Trials interleave the paths, attaching and detaching redirector between them, so that the
    // machine's drifts hit every path alike.
    eprintln!("bench: throughput, latency and hook cost, {TRIALS} interleaved trials");
    let mut runs: Vec<(Path, Vec<steering::Run>)> = Path::BASELINES
        .iter()
        .chain([&Path::Redirector])
        .map(|path| (*path, Vec::new()))
        .collect();
    let mut samples: Vec<(Path, Vec<f64>)> =
        runs.iter().map(|(path, _)| (*path, Vec::new())).collect();
    let mut without = vec![Vec::new(); HOOK_OPERATIONS.len()];
    let mut with = vec![Vec::new(); HOOK_OPERATIONS.len()];
    // (operation, program) → (ns per run of each trial, runs in the last trial).
    let mut per_run: BTreeMap<(usize, &'static str), (Vec<f64>, u64)> = BTreeMap::new();
    for trial in 0..TRIALS {
        for ((path, runs), (_, samples)) in runs.iter_mut().zip(samples.iter_mut()) {
            let agent = match path {
                Path::Redirector => {
                    let agent = rig.start_agent()?;
                    std::thread::sleep(setup::SETTLE);
                    Some(agent)
                }
                _ => None,
            };
            path.rules(&rig, "-A")?;
            let run = steering::dnsperf(&rig, *path);
            // Two latency runs per path, in the first two trials.
            let latency = (trial < 2)
                .then(|| steering::latencies(&rig, *path))
                .transpose();
            path.rules(&rig, "-D")?;
            runs.push(run?);
            samples.extend(latency?.unwrap_or_default());
            if let Some(agent) = agent {
                // The hooks alone: the agent stopped (SIGTERM leaves the programs attached),
                // then nothing attached; nothing else differs between the two.
                let stopped = rig.stop_agent(agent)?;
                for (operation, trials) in with.iter_mut().enumerate() {
                    trials.push(steering::hook_cost(&rig, operation, true)?);
                }
                for operation in 0..HOOK_OPERATIONS.len() {
                    for runs in steering::program_runs(&rig, operation)? {
                        let entry = per_run.entry((operation, runs.program)).or_default();
                        entry.0.push(runs.ns_per_run());
                        entry.1 = runs.count;
                    }
                }
                rig.uninstall(stopped)?;
                for (operation, trials) in without.iter_mut().enumerate() {
                    trials.push(steering::hook_cost(&rig, operation, false)?);
                }
            }
        }
    }
    // The cache's capacity: dnsperf at full speed straight to it, no rules.
    let capacity_qps = runs
        .iter()
        .find(|(path, _)| *path == Path::Direct)
        .map(|(_, runs)| Spread::of(runs.iter().map(|run| run.qps).collect()).median)
        .unwrap_or_default();
    let latency: Vec<steering::Latency> = samples
        .into_iter()
        .map(|(path, samples)| steering::latency(path, samples))
        .collect();

    eprintln!("bench: throughput by layout and socket kind, {TRIALS} interleaved trials");
    let (layouts, layout_program_cost) = layouts::measure(&mut rig)?;

    eprintln!("bench: conntrack, setup");
    let mut entries = vec![conntrack::measure(&rig, Path::Direct)?];
    Path::Dnat.rules(&rig, "-A")?;
    let dnat_entries = conntrack::measure(&rig, Path::Dnat);
    Path::Dnat.rules(&rig, "-D")?;
    entries.push(dnat_entries?);
    let (agent_start, start_phases) = setup::agent_start(&rig, 5)?;
    let setups = vec![setup::iptables_restore(&rig, 5)?, agent_start];

    eprintln!("bench: redirector with its agent: conntrack, memory, failover");
    let mut agent = rig.start_agent()?;
    std::thread::sleep(setup::SETTLE);
    let agent_cpu_since = setup::cpu_sample(&agent)?;
    entries.push(conntrack::measure(&rig, Path::Redirector)?);
    let mut failovers = Vec::new();
    // The agent's memory and CPU are read before the trials that stop it.
    let mut memory = None;
    for event in [
        Event::Kill,
        Event::Term,
        Event::Stop,
        Event::DrainThenTerm,
        Event::StopAlone,
    ] {
        if event == Event::StopAlone && memory.is_none() {
            memory = Some(setup::memory(&rig, &agent, agent_cpu_since)?);
        }
        let mut trials = Vec::new();
        for trial in 1..=FAILOVER_TRIALS {
            eprintln!(
                "bench: redirector failover, {}, trial {trial} of {FAILOVER_TRIALS}",
                event.name()
            );
            if event == Event::StopAlone {
                // The kernel alone: the agent stopped for the trial, and back to confirm the
                // resumed cache after it.
                let _stopped = rig.stop_agent(agent)?;
                trials.push(failover::redirector(&mut rig, event, CacheKind::Dnsmasq)?);
                agent = rig.start_agent()?;
            } else {
                trials.push(failover::redirector(&mut rig, event, CacheKind::Dnsmasq)?);
            }
            std::thread::sleep(Duration::from_secs(2));
        }
        failovers.push(FailoverTrials::of(trials));
    }
    // The restarts again with the other caches: each closes its sockets at its own pace after a
    // SIGTERM (unbound takes milliseconds under load, dnsmasq well under one).
    for cache in [CacheKind::Unbound, CacheKind::Embedded] {
        failover::restart_cache(&mut rig, cache)?;
        std::thread::sleep(setup::SETTLE);
        for event in [Event::Kill, Event::Term, Event::DrainThenTerm] {
            let mut trials = Vec::new();
            for trial in 1..=FAILOVER_TRIALS {
                eprintln!(
                    "bench: redirector failover, {}, {}, trial {trial} of {FAILOVER_TRIALS}",
                    cache.name(),
                    event.name()
                );
                trials.push(failover::redirector(&mut rig, event, cache)?);
                std::thread::sleep(Duration::from_secs(2));
            }
            failovers.push(FailoverTrials::of(trials));
        }
    }
    failover::restart_cache(&mut rig, CacheKind::Dnsmasq)?;
    let memory = match memory {
        Some(memory) => memory,
        None => setup::memory(&rig, &agent, agent_cpu_since)?,
    };
    rig.stop_and_uninstall(agent)?;
    eprintln!("bench: sizing, the agent with each reverse_nat_entries");
    let sizing = sizing::measure(&rig)?;
    eprintln!(
        "bench: DNS per workload, accounting off and on, {} interleaved trials",
        args.workload_trials
    );
    let workloads = workloads::measure(&rig, args.workload_trials)?;

    eprintln!(
        "bench: soak, {} s at {:.0} % of the cache's capacity ({capacity_qps:.0} queries/s)",
        args.soak_seconds,
        soak::LOAD_SHARE * 100.0
    );
    let soak = soak::measure(&rig, capacity_qps, soak::LOAD_SHARE, args.soak_seconds)?;
    let mut overload = Vec::new();
    for share in soak::OVERLOAD_SHARES {
        eprintln!(
            "bench: load, {} s at {:.0} % of the cache's capacity",
            args.load_seconds,
            share * 100.0
        );
        overload.push(soak::measure(&rig, capacity_qps, share, args.load_seconds)?);
    }
    eprintln!(
        "bench: load, {} s at {:.0} % of what the cache answers under a CPU quota of half a core",
        args.soak_seconds,
        soak::LOAD_SHARE * 100.0
    );
    overload.push(soak::measure_under_quota(
        &mut rig,
        soak::LOAD_SHARE,
        args.soak_seconds,
    )?);

    let mut trials = Vec::new();
    for trial in 1..=NAT_FALLBACK_TRIALS {
        eprintln!(
            "bench: the incumbent's NAT fallback, trial {trial} of {NAT_FALLBACK_TRIALS} (30 s)"
        );
        // The events fall at a different moment of the probe period in each trial.
        let phase_ms = (trial - 1) * failover::PROBE_EVERY_MS / NAT_FALLBACK_TRIALS;
        trials.push(failover::nat_fallback(&mut rig, phase_ms)?);
    }
    failovers.push(FailoverTrials::of(trials));
    drop(rig);

    eprintln!("bench: sync, {} EndpointSlice events", args.sync_events);
    let sync = sync::measure(args.sync_events)?;

    let throughput: Vec<steering::Throughput> = runs
        .into_iter()
        .map(|(path, runs)| steering::throughput(path, &runs))
        .collect();
    let hook_cost = HOOK_OPERATIONS
        .iter()
        .zip(without.into_iter().zip(with))
        .map(|((operation, ..), (without, with))| steering::HookCost {
            operation,
            without_ns: Spread::of(without),
            with_ns: Spread::of(with),
        })
        .collect();
    let program_cost = per_run
        .into_iter()
        .map(
            |((operation, program), (trials, runs_per_trial))| steering::ProgramCost {
                operation: HOOK_OPERATIONS[operation].0,
                program,
                runs_per_trial,
                ns_per_run: Spread::of(trials),
            },
        )
        .collect();
    let report = Report {
        machine,
        throughput,
        layouts,
        layout_program_cost,
        latency,
        hook_cost,
        program_cost,
        conntrack: entries,
        failover: failovers,
        setup: setups,
        soak,
        overload,
        start_phases,
        sync,
        memory,
        sizing,
        workloads,
    };
    output::write(&report, &args.out)?;
    println!("{}", output::markdown(&report));
    eprintln!("bench: results in {}", args.out.display());
    Ok(())
}
