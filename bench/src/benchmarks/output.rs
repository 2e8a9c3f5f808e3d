//! The run's results as JSON, a Markdown table and SVG charts.

use std::{fmt::Write as _, path::Path};

use anyhow::Context as _;
use plotters::prelude::*;

use super::{
    Report, Spread,
    failover::{Failover, FailoverTrials},
    steering::Latency,
};

/// Writes `results.json`, `results.md`, `failover.svg` and `latency.svg` into `dir`.
pub fn write(report: &Report, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(report)?,
    )?;
    std::fs::write(dir.join("results.md"), markdown(report))?;
    failover_chart(&report.failover, &dir.join("failover.svg"))?;
    latency_chart(&report.latency, &dir.join("latency.svg"))?;
    Ok(())
}

/// Writes one benchmark's results alone (`bench --only`): `NAME.json` and `NAME.md` (`text`) into
/// `dir`.
pub fn write_one(
    dir: &Path,
    name: &str,
    results: &impl serde::Serialize,
    text: &str,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_string_pretty(results)?,
    )?;
    std::fs::write(dir.join(format!("{name}.md")), text)?;
    Ok(())
}

fn ratio(value: f64, baseline: f64) -> String {
    if baseline == 0.0 {
        "-".to_owned()
    } else {
        format!("{:.2}×", value / baseline)
    }
}

/// `median (min–max)` over the trials that had a value, and how many had none.
fn with_misses(spread: &Spread, misses: usize, what: &str) -> String {
    match (spread.trials.is_empty(), misses) {
        (true, _) => what.to_owned(),
        (false, 0) => spread.show(0),
        (false, misses) => format!("{}; {misses} {what}", spread.show(0)),
    }
}

/// Appends a Markdown table under the bold `title`, then a blank line.
fn table(
    text: &mut String,
    title: &str,
    header: &[&str],
    rows: impl IntoIterator<Item = Vec<String>>,
) {
    let _ = writeln!(
        text,
        "**{title}**\n\n| {} |\n|{}",
        header.join(" | "),
        " --- |".repeat(header.len())
    );
    for row in rows {
        let _ = writeln!(text, "| {} |", row.join(" | "));
    }
    text.push('\n');
}

/// The Markdown report.
#[must_use]
pub fn markdown(report: &Report) -> String {
    let machine = &report.machine;
    let mut text = format!(
        "Run {} on {} ({} CPUs, {}), kernel {}. Medians of repeated trials, (min–max); ratios \
         against the first row, taken in the same run.\n\n",
        machine.date,
        machine.cpu_model,
        machine.cpus,
        if cfg!(debug_assertions) {
            "debug build of the agent"
        } else {
            "optimized build of the agent"
        },
        machine.kernel
    );

    let base_qps = report.throughput.first().map_or(0.0, |row| row.qps.median);
    table(
        &mut text,
        "Steering cost: dnsperf from a pod to dnsmasq (4 clients, 64 outstanding, 3 s × 5 trials, paths interleaved)",
        &[
            "path",
            "queries/s",
            "vs no rules",
            "average latency (µs)",
            "lost",
        ],
        report.throughput.iter().map(|row| {
            vec![
                row.path.name().to_owned(),
                row.qps.show(0),
                ratio(row.qps.median, base_qps),
                row.average_latency_us.show(0),
                row.lost.to_string(),
            ]
        }),
    );
    table(
        &mut text,
        "Latency at 2000 queries/s (per query, µs; two 3 s runs per path)",
        &["path", "p50", "p90", "p99", "samples"],
        report.latency.iter().map(|row| {
            vec![
                row.path.name().to_owned(),
                format!("{:.0}", row.p50_us),
                format!("{:.0}", row.p90_us),
                format!("{:.0}", row.p99_us),
                row.samples.to_string(),
            ]
        }),
    );
    table(
        &mut text,
        "Per-syscall cost of the hooks (ns per operation, from a pod; with: the programs attached, the agent stopped)",
        &[
            "operation",
            "without programs",
            "with programs",
            "difference",
        ],
        report.hook_cost.iter().map(|row| {
            vec![
                row.operation.to_owned(),
                row.without_ns.show(0),
                row.with_ns.show(0),
                format!("{:+.0}", row.with_ns.median - row.without_ns.median),
            ]
        }),
    );
    table(
        &mut text,
        "Per-run cost of each program during those operations (ns per run, from the kernel's accounting, BPF_ENABLE_STATS, in a run apart from the timed ones; a figure includes the accounting's own clock reads, about 20-30 ns; programs that ran fewer than 100 times a trial are in results.json only)",
        &["operation", "program", "runs per trial", "ns per run"],
        report
            .program_cost
            .iter()
            .filter(|row| row.runs_per_trial >= 100)
            .map(|row| {
                vec![
                    row.operation.to_owned(),
                    format!("`{}`", row.program),
                    row.runs_per_trial.to_string(),
                    row.ns_per_run.show(0),
                ]
            }),
    );
    table(
        &mut text,
        "The programs against none, by layout and socket kind (the same dnsmasq, 4 sockets, 64 queries in flight each, 3 s × 5 trials, interleaved)",
        &[
            "cache",
            "pod's sockets",
            "without programs, queries/s",
            "with",
            "with / without",
            "lost with",
        ],
        report.layouts.iter().map(|row| {
            vec![
                row.layout.name().to_owned(),
                row.sockets.name().to_owned(),
                row.without_qps.show(0),
                row.with_qps.show(0),
                format!("{:.2}×", row.ratio),
                row.lost_with.to_string(),
            ]
        }),
    );
    table(
        &mut text,
        "Per-run cost of each program under those loads, by layout (ns per run, kernel accounting, one run apart from the timed ones; programs that ran fewer than 100 times are in results.json only)",
        &["cache", "load", "program", "runs", "ns per run"],
        report
            .layout_program_cost
            .iter()
            .filter(|row| row.runs >= 100)
            .map(|row| {
                vec![
                    row.layout.name().to_owned(),
                    row.load.to_owned(),
                    format!("`{}`", row.program),
                    row.runs.to_string(),
                    format!("{:.0}", row.ns_per_run),
                ]
            }),
    );
    table(
        &mut text,
        "Conntrack entries left by 1000 fresh-socket queries (conntrack on, as on a node)",
        &["path", "answered", "entries"],
        report.conntrack.iter().map(|row| {
            vec![
                row.path.name().to_owned(),
                row.answered.to_string(),
                row.entries.to_string(),
            ]
        }),
    );
    table(
        &mut text,
        "Failover under load (redirector: a query every 1 ms from fresh sockets, a long-lived unconnected and a long-lived connected socket; the incumbent: every 20 ms, fresh and long-lived unconnected; per trial)",
        &[
            "who",
            "cache",
            "event",
            "trials",
            "gap (last cache → first upstream answer), ms",
            "queries lost",
            "of them from long-lived sockets",
            "of them begun after the flip",
            "of them begun after the event",
            "every socket back on the cache after its return, ms",
        ],
        report.failover.iter().map(|row| {
            vec![
                row.who.to_owned(),
                row.cache.to_owned(),
                row.event.name().to_owned(),
                row.runs.len().to_string(),
                with_misses(&row.gap_ms, row.never_failed_over, "never failed over"),
                format!("{} of {}", row.lost.show(0), row.total.median),
                row.lost_long.show(0),
                row.lost_after_flip.show(0),
                row.lost_after_event.show(0),
                with_misses(&row.failback_ms, row.never_failed_back, "never failed back"),
            ]
        }),
    );
    table(
        &mut text,
        "Setup",
        &["what", "ms"],
        report
            .setup
            .iter()
            .map(|row| vec![row.what.to_owned(), row.ms.show(1)]),
    );
    table(
        &mut text,
        "No false alarms under load: dnsperf through the listener at a share of the cache's capacity, the agent at its defaults (probes, stall limit), nothing done to the cache (a verdict turned down or a stall is a false alarm)",
        &[
            "share of capacity",
            "queries/s asked",
            "achieved",
            "lost",
            "seconds",
            "probes answered",
            "probes failed",
            "verdicts down",
            "stalls (kernel)",
            "cache's CPU quota (times it held the cache off)",
        ],
        std::iter::once(&report.soak)
            .chain(&report.overload)
            .map(|soak| {
                vec![
                    format!(
                        "{:.0} % (of {:.0})",
                        soak.rate_qps as f64 / soak.capacity_qps.max(1.0) * 100.0,
                        soak.capacity_qps
                    ),
                    soak.rate_qps.to_string(),
                    format!("{:.0}", soak.achieved_qps),
                    soak.lost.to_string(),
                    soak.seconds.to_string(),
                    soak.probes_answered.to_string(),
                    soak.probes_failed.to_string(),
                    soak.verdicts_down.to_string(),
                    soak.stalls.to_string(),
                    soak.cpu_quota.as_ref().map_or_else(
                        || "none".to_owned(),
                        |quota| format!("{quota} ({})", soak.throttled.unwrap_or_default()),
                    ),
                ]
            }),
    );
    table(
        &mut text,
        "Where the agent's start goes (its own account, phase by phase, in order; `object` and `verify` ran on another thread alongside `conntrack_bypass`, and `load` is what the start then still waited for; the rest of the total above is the process's own start and the log line's way out)",
        &["phase", "ms"],
        report
            .start_phases
            .iter()
            .map(|row| vec![format!("`{}`", row.phase), row.ms.show(1)]),
    );
    let sync = &report.sync;
    let _ = writeln!(
        text,
        "**Sync**: EndpointSlice written at the API server → kernel pool updated, {} events one after the other: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (10 ms of it is the deliberate coalescing window).",
        sync.events, sync.p50_ms, sync.p99_ms, sync.max_ms
    );
    let memory = &report.memory;
    let _ = write!(
        text,
        "\n**Agent**: RSS {} KiB, CPU {:.1} % of one core while the pod sent load; the maps {:.1} MiB of kernel memory ({}).\n",
        memory.agent_rss_kib,
        memory.agent_cpu_percent,
        memory.maps_total_bytes as f64 / (1024.0 * 1024.0),
        memory
            .maps
            .iter()
            .filter(|(_, bytes)| *bytes >= 64 * 1024)
            .map(|(name, bytes)| format!("{name} {:.1} MiB", *bytes as f64 / (1024.0 * 1024.0)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = write!(
        text,
        "\n**Sizing**: the agent started with each `reverse_nat_entries` (the one setting that sizes a map), on pins migrated to it:\n\n{}",
        super::sizing::markdown(&report.sizing)
    );
    let _ = write!(text, "\n{}", super::workloads::markdown(&report.workloads));
    text
}

/// Answers per 100 ms around dnsmasq's death: redirector's kill -9 against the NAT fallback's,
/// one panel per `who`, each the trial with the median gap.
fn failover_chart(rows: &[FailoverTrials], path: &Path) -> anyhow::Result<()> {
    let picked: Vec<&Failover> = rows
        .iter()
        .filter(|row| row.event == super::failover::Event::Kill && row.cache == "dnsmasq")
        .filter_map(FailoverTrials::typical)
        .collect();
    let root = SVGBackend::new(path, (900, 250 * picked.len().max(1) as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let panels = root.split_evenly((picked.len().max(1), 1));
    for (panel, run) in panels.iter().zip(picked) {
        let end = run.timeline.last().map_or(1, |point| point.0) as f64 / 1000.0;
        let start = run.timeline.first().map_or(0, |point| point.0) as f64 / 1000.0;
        let top = run
            .timeline
            .iter()
            .map(|point| point.1.max(point.2).max(point.3))
            .max()
            .unwrap_or(1) as f64
            + 1.0;
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!(
                    "{}: cache killed at 0 s (answers per 100 ms; the trial with the median gap)",
                    run.who
                ),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d(start..end, 0.0..top)
            .map_err(chart_error)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the kill")
            .draw()
            .map_err(chart_error)?;
        for (label, color, pick) in [
            ("cache", BLUE, 1usize),
            ("upstream", GREEN, 2),
            ("failed", RED, 3),
        ] {
            let series = run.timeline.iter().map(|point| {
                let value = match pick {
                    1 => point.1,
                    2 => point.2,
                    _ => point.3,
                };
                (point.0 as f64 / 1000.0, value as f64)
            });
            chart
                .draw_series(LineSeries::new(series, color.stroke_width(2)))
                .map_err(chart_error)?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(chart_error)?;
    }
    root.present().map_err(chart_error)?;
    Ok(())
}

/// The distribution (CDF) of per-query latency through each path.
fn latency_chart(rows: &[Latency], path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (900, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let top = rows
        .iter()
        .map(|row| super::percentile(&row.samples_us, 99.5))
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "per-query latency at 2000 queries/s (CDF)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(40)
        .build_cartesian_2d(0.0..top, 0.0..1.0)
        .map_err(chart_error)?;
    chart
        .configure_mesh()
        .x_desc("µs")
        .y_desc("fraction of queries")
        .draw()
        .map_err(chart_error)?;
    let colors = [BLUE, MAGENTA, RED, GREEN];
    for (row, color) in rows.iter().zip(colors) {
        let mut sorted = row.samples_us.clone();
        sorted.sort_by(f64::total_cmp);
        let count = sorted.len().max(1) as f64;
        let series = sorted
            .iter()
            .enumerate()
            .map(move |(index, value)| (*value, (index + 1) as f64 / count));
        chart
            .draw_series(LineSeries::new(series, color.stroke_width(2)))
            .map_err(chart_error)?
            .label(row.path.name())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(chart_error)?;
    root.present().map_err(chart_error)?;
    Ok(())
}

fn chart_error<E: std::fmt::Debug>(error: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a chart: {error:?}")
}
