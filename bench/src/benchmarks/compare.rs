//! Two agents' programs side by side, per run, in one run: the bench's hook operations
//! (`steering::HOOK_OPERATIONS`) with each agent attached in turn, trials interleaved (and their
//! order alternated) so that the machine's drifts hit both alike; from the kernel's accounting
//! (`BPF_ENABLE_STATS`). Two builds (`cost-compare --baseline`), or one build with a setting
//! changed (`cost-compare --baseline-set`, the per-workload accounting of `workloads`).

use std::{
    collections::BTreeMap, fmt::Write as _, path::PathBuf, process::Command, time::Duration,
};

use anyhow::Context as _;
use serde::Serialize;

use super::{
    Spread,
    rig::Rig,
    setup::SETTLE,
    steering::{self, HOOK_OPERATIONS},
};
use crate::program_cost::{self, ProgramSize};

/// One side of a comparison: an agent binary and its configuration.
#[derive(Clone, Debug)]
pub struct Side {
    /// Its name in tables.
    pub label: String,
    /// `redirector`.
    pub binary: PathBuf,
    /// The configuration it runs with.
    pub config: PathBuf,
}

/// One program during one operation, both sides.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// The operation (`HOOK_OPERATIONS`' name).
    pub operation: &'static str,
    /// The program.
    pub program: &'static str,
    /// How often it ran per operation (the first side's last trial it ran in).
    pub runs_per_operation: f64,
    /// Nanoseconds per run, each side's trials.
    pub ns_per_run: [Spread; 2],
    /// Nanoseconds per operation (its time over the operation's count: what it adds to one
    /// query), each side's trials.
    pub ns_per_operation: [Spread; 2],
    /// Per run, the second side less the first, trial by trial (the two runs of a trial are
    /// seconds apart), in the trials it ran on both sides.
    pub difference_per_run: Spread,
    /// The same per operation, in every trial in order (a program that did not run in a trial
    /// took no time in it).
    pub difference_per_operation: Spread,
}

/// What a comparison measured.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// The sides' names.
    pub sides: [String; 2],
    /// Interleaved trials.
    pub trials: usize,
    /// By operation, then program.
    pub rows: Vec<Row>,
    /// Each side's programs' sizes, as the kernel holds them (after its first start).
    pub sizes: [Vec<ProgramSize>; 2],
}

/// One program's figures in one trial.
#[derive(Clone, Copy, Debug)]
struct Sample {
    ns_per_run: f64,
    ns_per_operation: f64,
    runs_per_operation: f64,
}

/// Runs the comparison: per trial, each side's agent started, settled and stopped (its programs
/// stay attached), every hook operation run once under the kernel's accounting, the agent's pins
/// uninstalled; the sides' order alternates from trial to trial.
pub fn measure(rig: &Rig, sides: &[Side; 2], trials: usize) -> anyhow::Result<Comparison> {
    // (operation, program) → per side, per trial.
    let mut samples: BTreeMap<(usize, &'static str), [Vec<Option<Sample>>; 2]> = BTreeMap::new();
    let mut sizes: [Vec<ProgramSize>; 2] = [Vec::new(), Vec::new()];
    for trial in 0..trials {
        let order = if trial % 2 == 0 { [0, 1] } else { [1, 0] };
        for index in order {
            let side = &sides[index];
            eprintln!("compare: trial {} of {trials}, {}", trial + 1, side.label);
            let agent = bpf_tests::cli::start_agent_of(&side.binary, &side.config, &[], &[])?;
            std::thread::sleep(SETTLE);
            let _stopped = rig.stop_agent(agent)?;
            let measured = measure_side(rig, trial, index, &mut samples).and_then(|()| {
                if sizes[index].is_empty() {
                    sizes[index] = program_cost::sizes(&rig.sandbox.pin_dir())?;
                }
                Ok(())
            });
            // Uninstalled whatever the operations did, so that the next side starts clean.
            let uninstalled = uninstall(side);
            measured?;
            uninstalled?;
        }
    }
    let rows = samples
        .into_iter()
        .map(|((operation, program), [first, second])| {
            let pairs: Vec<(Sample, Sample)> = first
                .iter()
                .zip(&second)
                .filter_map(|(one, other)| Some(((*one)?, (*other)?)))
                .collect();
            let all = |side: &[Option<Sample>], pick: fn(&Sample) -> f64| {
                Spread::of(side.iter().flatten().map(pick).collect())
            };
            Row {
                operation: HOOK_OPERATIONS[operation].0,
                program,
                runs_per_operation: first
                    .iter()
                    .flatten()
                    .next_back()
                    .or_else(|| second.iter().flatten().next_back())
                    .map_or(0.0, |sample| sample.runs_per_operation),
                ns_per_run: [
                    all(&first, |sample| sample.ns_per_run),
                    all(&second, |sample| sample.ns_per_run),
                ],
                ns_per_operation: [
                    all(&first, |sample| sample.ns_per_operation),
                    all(&second, |sample| sample.ns_per_operation),
                ],
                difference_per_run: Spread::of(
                    pairs
                        .iter()
                        .map(|(one, other)| other.ns_per_run - one.ns_per_run)
                        .collect(),
                ),
                difference_per_operation: Spread::of(
                    (0..trials)
                        .map(|trial| {
                            let time = |side: &[Option<Sample>]| {
                                side.get(trial)
                                    .copied()
                                    .flatten()
                                    .map_or(0.0, |sample| sample.ns_per_operation)
                            };
                            time(&second) - time(&first)
                        })
                        .collect(),
                ),
            }
        })
        .collect();
    Ok(Comparison {
        sides: [sides[0].label.clone(), sides[1].label.clone()],
        trials,
        rows,
        sizes,
    })
}

/// Every hook operation once, with the programs of side `index` attached, into `samples`.
fn measure_side(
    rig: &Rig,
    trial: usize,
    index: usize,
    samples: &mut BTreeMap<(usize, &'static str), [Vec<Option<Sample>>; 2]>,
) -> anyhow::Result<()> {
    for (operation, (.., count)) in HOOK_OPERATIONS.iter().enumerate() {
        let count: f64 = count.parse().context("an operation's count")?;
        for runs in steering::program_runs(rig, operation)? {
            let sides = samples.entry((operation, runs.program)).or_default();
            let side = &mut sides[index];
            side.resize(trial + 1, None);
            side[trial] = Some(Sample {
                ns_per_run: runs.ns_per_run(),
                ns_per_operation: runs.time_ns as f64 / count,
                runs_per_operation: runs.count as f64 / count,
            });
        }
    }
    Ok(())
}

/// `BINARY uninstall --config CONFIG` of `side`, which must succeed.
fn uninstall(side: &Side) -> anyhow::Result<()> {
    let output = bpf_tests::command::output_within(
        Command::new(&side.binary).args([
            "uninstall",
            "--config",
            &side.config.display().to_string(),
        ]),
        Duration::from_secs(30),
    )?;
    anyhow::ensure!(
        output.status.success(),
        "uninstall by {} failed: {}",
        side.binary.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

impl Comparison {
    /// The row of `program` during the operation named `operation`.
    #[must_use]
    pub fn row(&self, operation: &str, program: &str) -> Option<&Row> {
        self.rows
            .iter()
            .find(|row| row.operation == operation && row.program == program)
    }

    /// The table of every row that ran at least once per 100 operations: each side's ns per
    /// run, the difference of the medians, and the trials' paired differences, per run and per
    /// operation.
    #[must_use]
    pub fn markdown(&self) -> String {
        let [first, second] = &self.sides;
        let mut text = format!(
            "| operation | program | runs per operation | {first}, ns per run | {second}, ns per run | difference of medians | paired difference per run | paired difference per operation |\n\
             | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
        );
        for row in self
            .rows
            .iter()
            .filter(|row| row.runs_per_operation >= 0.01)
        {
            let _ = writeln!(
                text,
                "| {} | `{}` | {:.2} | {} | {} | {:+.0} | {} | {} |",
                row.operation,
                row.program,
                row.runs_per_operation,
                row.ns_per_run[0].show(0),
                row.ns_per_run[1].show(0),
                row.ns_per_run[1].median - row.ns_per_run[0].median,
                Spread::show_signed(&row.difference_per_run),
                Spread::show_signed(&row.difference_per_operation),
            );
        }
        text
    }

    /// The programs' sizes on both sides (bytes of translated instructions and of JIT code, as
    /// `bpftool prog show` says), the programs whose size differs first.
    #[must_use]
    pub fn sizes_markdown(&self) -> String {
        let [first, second] = &self.sides;
        let mut text = format!(
            "| program | {first}: translated, JIT bytes | {second}: translated, JIT bytes | difference |\n\
             | --- | ---: | ---: | ---: |\n"
        );
        let mut rows: Vec<(&ProgramSize, Option<&ProgramSize>)> = self.sizes[0]
            .iter()
            .map(|one| {
                let other = self.sizes[1]
                    .iter()
                    .find(|other| other.program == one.program);
                (one, other)
            })
            .collect();
        rows.sort_by_key(|(one, other)| other.is_some_and(|other| other == *one));
        for (one, other) in rows {
            let (shown, difference) = other.map_or_else(
                || ("-".to_owned(), "-".to_owned()),
                |other| {
                    (
                        format!("{}, {}", other.translated_bytes, other.jited_bytes),
                        format!(
                            "{:+}, {:+}",
                            i64::from(other.translated_bytes) - i64::from(one.translated_bytes),
                            i64::from(other.jited_bytes) - i64::from(one.jited_bytes)
                        ),
                    )
                },
            );
            let _ = writeln!(
                text,
                "| `{}` | {}, {} | {shown} | {difference} |",
                one.program, one.translated_bytes, one.jited_bytes
            );
        }
        text
    }
}

/// A configuration edit: `KEY=VALUE` for `--baseline-set`, where KEY is a key of any table
/// (`stall_after_ms`, every line that sets it) or `TABLE.KEY` (`workloads.accounting`: inside
/// `[TABLE]`, which is appended at the end of the file if there is none).
pub fn parse_setting(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))?;
    Ok((key.trim().to_owned(), value.trim().to_owned()))
}

/// `text` (a configuration) without the lines that set a key of `drop` and with each of `set`
/// applied (see [`parse_setting`]). A plain key must be in the file; a dotted one is added to its
/// table, or to a table appended at the end (after the last `[[listener]]`, which the table's
/// header closes).
pub fn edit_config(
    text: &str,
    drop: &[String],
    set: &[(String, String)],
) -> anyhow::Result<String> {
    let mut table = String::new();
    // (table, line) of each kept line.
    let mut lines: Vec<(String, String)> = Vec::new();
    let mut unset: Vec<&(String, String)> = set.iter().collect();
    for line in text.lines() {
        let trimmed = line.trim();
        if let Some(header) = trimmed.strip_prefix('[') {
            table = header.trim_matches(['[', ']', ' ']).to_owned();
            lines.push((table.clone(), line.to_owned()));
            continue;
        }
        let key = match trimmed.split_once('=') {
            Some((key, _)) if !trimmed.starts_with('#') => key.trim(),
            _ => {
                lines.push((table.clone(), line.to_owned()));
                continue;
            }
        };
        let names = |wanted: &str| match wanted.rsplit_once('.') {
            Some((wanted_table, wanted_key)) => wanted_table == table && wanted_key == key,
            None => wanted == key,
        };
        if drop.iter().any(|dropped| names(dropped)) {
            continue;
        }
        match set.iter().find(|(wanted, _)| names(wanted)) {
            Some(setting) => {
                unset.retain(|left| *left != setting);
                lines.push((table.clone(), format!("{key} = {}", setting.1)));
            }
            None => lines.push((table.clone(), line.to_owned())),
        }
    }
    let mut appended = String::new();
    for (wanted, value) in unset {
        let Some((wanted_table, key)) = wanted.rsplit_once('.') else {
            anyhow::bail!("the configuration sets no key {wanted:?} to change");
        };
        let line = format!("{key} = {value}");
        match lines
            .iter()
            .position(|(table, line)| table == wanted_table && line.trim().starts_with('['))
        {
            Some(header) if !lines[header].1.trim().starts_with("[[") => {
                lines.insert(header + 1, (wanted_table.to_owned(), line));
            }
            Some(_) => anyhow::bail!("{wanted_table} is an array of tables: name a plain table"),
            None if appended.contains(&format!("[{wanted_table}]\n")) => {
                appended = appended.replace(
                    &format!("[{wanted_table}]\n"),
                    &format!("[{wanted_table}]\n{line}\n"),
                );
            }
            None => {
                let _ = write!(appended, "\n[{wanted_table}]\n{line}\n");
            }
        }
    }
    let mut edited: String = lines.into_iter().map(|(_, line)| line + "\n").collect();
    edited.push_str(&appended);
    Ok(edited)
}

/// Writes `rig`'s configuration, edited as [`edit_config`] does, beside it as `name`.
pub fn edited_config(
    rig: &Rig,
    name: &str,
    drop: &[String],
    set: &[(String, String)],
) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(&rig.config)?;
    let edited = rig.config.with_file_name(name);
    std::fs::write(&edited, edit_config(&text, drop, set)?)?;
    Ok(edited)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "cgroup = \"/x\"\n\n[probe]\ninterval_ms = 100\nstall_after_ms = 80\n\n[metrics]\naddress = \"127.0.0.1:0\"\n\n[[listener]]\nname = \"node\"\naddress = \"169.254.20.10\"\n";

    fn setting(text: &str) -> (String, String) {
        parse_setting(text).unwrap()
    }

    #[test]
    fn a_plain_key_is_changed_where_it_is() {
        let edited = edit_config(CONFIG, &[], &[setting("stall_after_ms=0")]).unwrap();
        assert_eq!(
            edited,
            CONFIG.replace("stall_after_ms = 80", "stall_after_ms = 0")
        );
        assert!(edit_config(CONFIG, &[], &[setting("nowhere=1")]).is_err());
    }

    #[test]
    fn a_dotted_key_lands_in_its_table_never_in_the_last_listener() {
        let edited = edit_config(
            CONFIG,
            &[],
            &[
                setting("workloads.accounting=false"),
                setting("workloads.tracked = 4096"),
            ],
        )
        .unwrap();
        assert_eq!(
            edited,
            format!("{CONFIG}\n[workloads]\ntracked = 4096\naccounting = false\n")
        );
        let edited = edit_config(CONFIG, &[], &[setting("probe.timeout_ms=250")]).unwrap();
        assert!(edited.contains("[probe]\ntimeout_ms = 250\ninterval_ms = 100\n"));
        let edited = edit_config(CONFIG, &[], &[setting("probe.interval_ms=500")]).unwrap();
        assert_eq!(
            edited,
            CONFIG.replace("interval_ms = 100", "interval_ms = 500")
        );
        assert!(edit_config(CONFIG, &[], &[setting("listener.cache=x")]).is_err());
    }

    #[test]
    fn a_dropped_key_leaves_its_line_out() {
        let edited = edit_config(
            CONFIG,
            &["stall_after_ms".to_owned(), "metrics.address".to_owned()],
            &[],
        )
        .unwrap();
        assert!(!edited.contains("stall_after_ms"));
        assert!(!edited.contains("127.0.0.1:0"));
        assert!(edited.contains("address = \"169.254.20.10\""));
    }
}
