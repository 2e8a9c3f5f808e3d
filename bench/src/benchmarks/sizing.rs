//! Sizing a node: the agent's memory and each map's kernel memory for each value of
//! `reverse_nat_entries`; and the kernel memory of `WORKLOADS` for values of `workloads.tracked`,
//! the two settings that size a map (every other map's size is fixed by the build:
//! `docs/datapath.md` lists them).

use std::time::Duration;

use bpf_tests::cli::{start_agent, stop_agent, uninstall};
use serde::Serialize;

use super::{compare, rig::Rig, setup};

/// The values measured: the smallest accepted, the default, and two larger ones.
pub const REVERSE_NAT_ENTRIES: [u32; 4] = [1024, 65_536, 262_144, 1_048_576];

/// The values of `workloads.tracked` measured: the difference over the difference in entries is
/// the memory of one tracked cgroup.
pub const TRACKED: [u32; 2] = [4096, 65_536];

/// `WORKLOADS` with one `workloads.tracked`.
#[derive(Clone, Debug, Serialize)]
pub struct TrackedSize {
    /// The setting.
    pub tracked: u32,
    /// `WORKLOADS`' kernel memory (bpftool's `bytes_memlock`), bytes.
    pub workloads_bytes: u64,
    /// Every pinned map's, bytes.
    pub maps_total_bytes: u64,
}

/// Starts the agent once per value of [`TRACKED`] (accounting on), reads the pinned maps' kernel
/// memory, and uninstalls after each.
pub fn workloads_tracked(rig: &Rig) -> anyhow::Result<Vec<TrackedSize>> {
    let mut rows = Vec::new();
    for tracked in TRACKED {
        let config = compare::edited_config(
            rig,
            &format!("tracked-{tracked}.toml"),
            &[],
            &[
                ("workloads.accounting".to_owned(), "true".to_owned()),
                ("workloads.tracked".to_owned(), tracked.to_string()),
            ],
        )?;
        let mut agent = start_agent(&config)?;
        std::thread::sleep(setup::SETTLE);
        let maps = setup::pinned_map_memory(rig);
        let stopped = stop_agent(&mut agent);
        uninstall(&config)?;
        stopped?;
        let maps = maps?;
        let workloads_bytes = maps
            .iter()
            .find(|(name, _)| name == redirector_common::names::MAP_WORKLOADS)
            .map(|(_, bytes)| *bytes)
            .ok_or_else(|| anyhow::anyhow!("no WORKLOADS map is pinned"))?;
        rows.push(TrackedSize {
            tracked,
            workloads_bytes,
            maps_total_bytes: maps.iter().map(|(_, bytes)| bytes).sum(),
        });
    }
    Ok(rows)
}

/// One agent started with one `reverse_nat_entries`.
#[derive(Clone, Debug, Serialize)]
pub struct Sized {
    /// The setting.
    pub reverse_nat_entries: u32,
    /// The agent's resident set after its start and a settle, KiB.
    pub agent_rss_kib: u64,
    /// Its peak resident set (VmHWM), KiB: the start's verifier logs and object included.
    pub agent_peak_rss_kib: u64,
    /// Each pinned map's kernel memory (bpftool's `bytes_memlock`), bytes.
    pub maps: Vec<(String, u64)>,
    /// Their sum.
    pub maps_total_bytes: u64,
}

/// A `/proc/PID/status` field in KiB.
fn status_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no {field} in /proc/{pid}/status"))
}

/// Starts the agent once per value of [`REVERSE_NAT_ENTRIES`] on the rig's pins (each start
/// migrates the translation map to its new size) and measures it; uninstalls at the end.
pub fn measure(rig: &Rig) -> anyhow::Result<Vec<Sized>> {
    let base = std::fs::read_to_string(&rig.config)?;
    let mut rows = Vec::new();
    for entries in REVERSE_NAT_ENTRIES {
        let config = rig.sandbox.write_file(
            &format!("sizing-{entries}.toml"),
            &format!("reverse_nat_entries = {entries}\n{base}"),
        )?;
        let mut agent = start_agent(&config)?;
        std::thread::sleep(setup::SETTLE + Duration::from_secs(1));
        let agent_rss_kib = status_kib(agent.pid(), "VmRSS:")?;
        let agent_peak_rss_kib = status_kib(agent.pid(), "VmHWM:")?;
        let maps = setup::pinned_map_memory(rig)?;
        stop_agent(&mut agent)?;
        rows.push(Sized {
            reverse_nat_entries: entries,
            agent_rss_kib,
            agent_peak_rss_kib,
            maps_total_bytes: maps.iter().map(|(_, bytes)| bytes).sum(),
            maps,
        });
    }
    uninstall(&rig.config)?;
    Ok(rows)
}

/// The rows as a Markdown table: the settings as columns, the agent and the maps that change
/// with it or hold more than 64 KiB as rows.
#[must_use]
pub fn markdown(rows: &[Sized]) -> String {
    let mib = |bytes: u64| format!("{:.2}", bytes as f64 / (1024.0 * 1024.0));
    let mut text = String::from("| `reverse_nat_entries` |");
    for row in rows {
        text.push_str(&format!(" {} |", row.reverse_nat_entries));
    }
    text.push_str("\n| --- |");
    text.push_str(&" ---: |".repeat(rows.len()));
    text.push('\n');
    let mut line = |label: String, cells: Vec<String>| {
        text.push_str(&format!("| {label} | {} |\n", cells.join(" | ")));
    };
    line(
        "agent RSS after start, MiB".to_owned(),
        rows.iter()
            .map(|row| mib(row.agent_rss_kib * 1024))
            .collect(),
    );
    line(
        "agent peak RSS (VmHWM), MiB".to_owned(),
        rows.iter()
            .map(|row| mib(row.agent_peak_rss_kib * 1024))
            .collect(),
    );
    let names: Vec<&String> = rows
        .first()
        .map(|row| row.maps.iter().map(|(name, _)| name).collect())
        .unwrap_or_default();
    let mut small = Vec::new();
    for (index, name) in names.iter().enumerate() {
        let sizes: Vec<u64> = rows.iter().map(|row| row.maps[index].1).collect();
        let changes = sizes.iter().any(|size| *size != sizes[0]);
        if changes || sizes[0] >= 64 * 1024 {
            line(
                format!("`{name}`, MiB"),
                sizes.iter().map(|size| mib(*size)).collect(),
            );
        } else {
            small.push((*name).clone());
        }
    }
    line(
        format!("the other {} maps together, MiB", small.len()),
        rows.iter()
            .map(|row| {
                mib(row
                    .maps
                    .iter()
                    .filter(|(name, _)| small.contains(name))
                    .map(|(_, bytes)| bytes)
                    .sum())
            })
            .collect(),
    );
    line(
        "every map, MiB".to_owned(),
        rows.iter().map(|row| mib(row.maps_total_bytes)).collect(),
    );
    text
}
