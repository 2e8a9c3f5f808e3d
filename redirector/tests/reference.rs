//! The docs' reference tables and the changelog, checked against what the code defines, both
//! ways: a name the code has and its table lacks fails, and so does one a table names that the
//! code does not have.
//!
//! - README's command table: every subcommand and every flag its `-h` shows.
//! - docs/configuration.md's file: every key the configuration takes (`config::keys`).
//! - docs/observability.md's metrics table: every metric family the agent serves.
//! - docs/operations.md's alerts: a row of its table and a section per alert of the shipped rules,
//!   whose `runbook_url` names that section.
//! - CHANGELOG.md: every key, map, program, metric, alert and command in exactly one release,
//!   and a dated section for the workspace's version.
//! - ARCHITECTURE.md: every crate of the workspace and every module of the agent.

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
};

#[expect(
    dead_code,
    reason = "the shipped files' tests share it; this one only reads files"
)]
mod common;
mod markdown;
mod served;

use common::read;
use markdown::{code_spans, table};

/// What a set of names from the docs lacks and has too many of, against the code's.
fn compare(what: &str, code: &BTreeSet<String>, documented: &BTreeSet<String>) {
    let missing: Vec<&String> = code.difference(documented).collect();
    let unknown: Vec<&String> = documented.difference(code).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "{what}: not documented: {missing:?}; documented but not in the code: {unknown:?}"
    );
}

/// `redirector ARGS -h` (the short help: one line an option), printed.
fn help(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_redirector"))
        .args(args)
        .arg("-h")
        .output()
        .expect("the redirector binary runs");
    assert!(output.status.success(), "{args:?} -h: {output:?}");
    String::from_utf8(output.stdout).expect("UTF-8 help")
}

/// The lines of the `Commands:` or `Options:` section of a help text.
fn section<'a>(help: &'a str, title: &str) -> impl Iterator<Item = &'a str> {
    help.lines()
        .skip_while(move |line| *line != title)
        .skip(1)
        .take_while(|line| !line.is_empty())
}

/// Every subcommand the CLI takes (`help` aside).
fn subcommands() -> BTreeSet<String> {
    section(&help(&[]), "Commands:")
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// The long flags of a subcommand (`--help` aside): each option line's first column (`-h,
/// --help`, `--config <CONFIG>`), never its description.
fn flags(subcommand: &str) -> BTreeSet<String> {
    section(&help(&[subcommand]), "Options:")
        .flat_map(|line| {
            line.split_whitespace()
                .take_while(|word| word.starts_with('-') || word.starts_with('<'))
        })
        .map(|word| word.trim_end_matches(','))
        .filter(|word| word.starts_with("--") && *word != "--help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_command_table_names_every_subcommand_and_flag_and_only_those() {
    let readme = read("README.md");
    let mut documented: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for row in table(&readme, "| command | what it does |") {
        let usage = code_spans(&row[1]).into_iter().next().expect("a usage");
        let mut words = usage.split_whitespace();
        assert_eq!(words.next(), Some("redirector"), "{usage}");
        let subcommand = words.next().expect("a subcommand").to_owned();
        let flags = usage
            .split(|c: char| c.is_whitespace() || "[]|".contains(c))
            .filter(|word| word.starts_with("--"))
            .map(str::to_owned)
            .collect();
        assert!(
            documented.insert(subcommand.clone(), flags).is_none(),
            "two rows for {subcommand}"
        );
    }
    let subcommands = subcommands();
    compare(
        "README's commands",
        &subcommands,
        &documented.keys().cloned().collect(),
    );
    for subcommand in &subcommands {
        compare(
            &format!("README's `redirector {subcommand}` flags"),
            &flags(subcommand),
            &documented[subcommand],
        );
    }
}

/// The keys of docs/configuration.md's example file, commented ones too, as `section.key`.
fn documented_keys() -> BTreeSet<String> {
    let guide = read("docs/configuration.md");
    let block = guide
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the example file");
    let mut section = String::new();
    let mut keys = BTreeSet::new();
    for line in block.lines() {
        if let Some(name) = line.strip_prefix('[') {
            section = name
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or_default()
                .to_owned();
            continue;
        }
        let setting = line.strip_prefix("# ").unwrap_or(line);
        if let Some((key, _)) = setting.split_once(" = ")
            && !key.is_empty()
            && key
                .bytes()
                .all(|byte| byte.is_ascii_lowercase() || byte == b'_')
        {
            keys.insert(if section.is_empty() {
                key.to_owned()
            } else {
                format!("{section}.{key}")
            });
        }
    }
    keys
}

#[test]
fn the_configuration_guide_shows_every_key_and_only_keys_the_file_takes() {
    let keys: BTreeSet<String> = redirector::config::keys().into_iter().collect();
    compare("docs/configuration.md's keys", &keys, &documented_keys());
}

/// Every metric the agent serves, by its sample's name (`_total` on counters).
fn served_metrics() -> BTreeSet<String> {
    served::metrics_text()
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .map(|line| {
            let (name, kind) = line.split_once(' ').expect("# TYPE name kind");
            if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            }
        })
        .collect()
}

#[test]
fn the_metrics_table_names_every_metric_the_agent_serves_and_only_those() {
    let guide = read("docs/observability.md");
    let documented = table(&guide, "  | metric |")
        .iter()
        .flat_map(|row| code_spans(&row[1]))
        .collect();
    let served = served_metrics();
    assert!(served.len() > 20, "{served:?}");
    compare("docs/observability.md's metrics", &served, &documented);
}

/// Each alert of the shipped rules with its severity and `runbook_url`.
fn alerts() -> BTreeMap<String, (String, String)> {
    let rules: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/redirector.rules.yml")).expect("YAML");
    let mut alerts = BTreeMap::new();
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("an alert's name").to_owned();
            let field = |value: &serde_yaml::Value| {
                value
                    .as_str()
                    .unwrap_or_else(|| panic!("{name}: no {value:?}"))
                    .to_owned()
            };
            alerts.insert(
                name.clone(),
                (
                    field(&rule["labels"]["severity"]),
                    field(&rule["annotations"]["runbook_url"]),
                ),
            );
        }
    }
    alerts
}

/// The anchor GitHub gives a heading: lower case, spaces as `-`, punctuation but `-` and `_`
/// dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_alert_has_a_row_and_a_runbook_section_that_its_runbook_url_names() {
    let guide = read("docs/operations.md");
    let alerts = alerts();
    assert!(alerts.len() >= 14, "{alerts:?}");
    let rows: BTreeMap<String, String> = table(&guide, "| alert | severity | fires when |")
        .into_iter()
        .map(|row| {
            let name = code_spans(&row[1]).into_iter().next().expect("an alert");
            (name, row[2].clone())
        })
        .collect();
    compare(
        "docs/operations.md's alerts table",
        &alerts.keys().cloned().collect(),
        &rows.keys().cloned().collect(),
    );
    let anchors: BTreeSet<String> = guide
        .lines()
        .filter_map(|line| line.strip_prefix('#'))
        .map(|heading| anchor(heading.trim_start_matches('#')))
        .collect();
    for (name, (severity, runbook)) in &alerts {
        assert_eq!(&rows[name], severity, "{name}'s severity in the table");
        let section = runbook
            .strip_prefix("docs/operations.md#")
            .unwrap_or_else(|| panic!("{name}'s runbook_url {runbook} is not operations.md's"));
        assert!(
            anchors.contains(section),
            "{name}'s runbook_url names #{section}, which docs/operations.md has no heading for"
        );
        assert!(
            guide.contains(&format!("\n### {name}\n")),
            "{name} has no runbook section"
        );
    }
}

/// Per kind of name (`Configuration keys`, `Maps`, ...), the names each release of
/// CHANGELOG.md lists.
fn changelog() -> BTreeMap<String, Vec<(String, String)>> {
    let text = read("CHANGELOG.md");
    let mut lists: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut release = String::new();
    let mut kind: Option<String> = None;
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            release = heading.to_owned();
            kind = None;
            continue;
        }
        // A list's names follow its kind on an item's first line, and go on on the lines
        // indented under it.
        let names = if let Some(item) = line.strip_prefix("- ") {
            let (name, rest) = item.split_once(": ").unzip();
            kind = name.map(str::to_owned);
            rest.unwrap_or_default()
        } else if line.starts_with("  ") {
            line
        } else {
            kind = None;
            line
        };
        if let Some(kind) = &kind {
            for span in code_spans(names) {
                lists
                    .entry(kind.clone())
                    .or_default()
                    .push((release.clone(), span));
            }
        }
    }
    lists
}

/// Every program the embedded object defines.
fn programs() -> BTreeSet<String> {
    let object = aya_obj::Object::parse(redirector::datapath::OBJECT).expect("the object parses");
    object.programs.keys().cloned().collect()
}

#[test]
fn the_changelog_has_a_dated_section_for_this_release() {
    let text = read("CHANGELOG.md");
    let heading = format!("\n## [{}] - ", redirector::release::VERSION);
    let date = text
        .split_once(&heading)
        .map(|(_, rest)| rest.lines().next().unwrap_or_default())
        .unwrap_or_else(|| panic!("CHANGELOG.md has no section{heading}YYYY-MM-DD"));
    let parts: Vec<&str> = date.split('-').collect();
    assert!(
        parts.len() == 3 && parts.iter().all(|part| part.parse::<u32>().is_ok()),
        "the release's date: {date:?}"
    );
}

#[test]
fn the_changelog_lists_every_key_map_program_metric_alert_and_command_in_one_release() {
    let lists = changelog();
    let code: [(&str, BTreeSet<String>); 6] = [
        (
            "Configuration keys",
            redirector::config::keys().into_iter().collect(),
        ),
        (
            "Maps",
            redirector::datapath::layout::RELEASED
                .iter()
                .map(|row| row.name.to_owned())
                .collect(),
        ),
        ("Programs", programs()),
        ("Metrics", served_metrics()),
        ("Alerts", alerts().into_keys().collect()),
        (
            "Commands",
            subcommands()
                .into_iter()
                .map(|name| format!("redirector {name}"))
                .collect(),
        ),
    ];
    for (kind, names) in code {
        let listed = lists
            .get(kind)
            .unwrap_or_else(|| panic!("CHANGELOG.md lists no {kind}"));
        let mut releases: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (release, name) in listed {
            releases.entry(name).or_default().push(release);
        }
        for (name, in_releases) in &releases {
            assert_eq!(
                in_releases.len(),
                1,
                "CHANGELOG.md lists {kind} {name} in {in_releases:?}"
            );
        }
        compare(
            &format!("CHANGELOG.md's {kind}"),
            &names,
            &releases.keys().map(|name| (*name).to_owned()).collect(),
        );
    }
}

#[test]
fn the_architecture_names_every_crate_and_every_module_of_the_agent() {
    let architecture = read("ARCHITECTURE.md");
    let spans: BTreeSet<String> = code_spans(&architecture).into_iter().collect();
    let manifest: toml::Table = read("Cargo.toml")
        .parse()
        .expect("the workspace's Cargo.toml");
    let members = manifest["workspace"]["members"]
        .as_array()
        .expect("the workspace's members");
    for member in members {
        let crate_dir = format!("{}/", member.as_str().expect("a member's path"));
        assert!(
            spans.contains(&crate_dir),
            "ARCHITECTURE.md names no {crate_dir}"
        );
    }
    let source = common::repo().join("redirector/src");
    for entry in std::fs::read_dir(&source).expect("redirector/src") {
        let entry = entry.expect("an entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        let module = if entry.path().is_dir() {
            format!("{name}/")
        } else {
            name
        };
        assert!(
            spans.contains(&module),
            "ARCHITECTURE.md's module table names no redirector/src/{module}"
        );
    }
}
