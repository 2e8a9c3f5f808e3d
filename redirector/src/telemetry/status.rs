//! `redirector status`: the node's redirector state from the pinned maps and links, the lock and
//! the nftables table, so it tells the truth whether or not the agent runs.

use std::{fmt::Write as _, path::Path};

use serde::Serialize;

use super::snapshot::{self, ListenerSnapshot};
use crate::{
    conntrack_bypass::{nft::Nft, ruleset::TABLE},
    datapath::{self, DatapathError, Maps},
    sys::{
        kernel_support::{self, KernelSupport, Need},
        lock,
        netns::NetnsError,
    },
    workloads::{
        self, ROUTE_LABELS,
        counts::{self, WorkloadCounts},
    },
};

/// Everything `status` reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StatusReport {
    /// This build of redirector (the command's own).
    pub version: VersionState,
    /// The agent process.
    pub agent: AgentState,
    /// The kernel programs.
    pub programs: ProgramState,
    /// The nftables table.
    pub conntrack_bypass: BypassState,
    /// The running kernel's features.
    pub kernel: KernelState,
    /// Every listener.
    pub listeners: Vec<ListenerSnapshot>,
    /// DNS per workload.
    pub workloads: WorkloadsState,
}

/// The workloads `status` shows: the busiest by queries since the kernel first counted them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkloadsState {
    /// Workloads the kernel counts now (their cgroups summed).
    pub counted: usize,
    /// The busiest [`STATUS_WORKLOADS`], busiest first.
    pub busiest: Vec<WorkloadCounts>,
}

/// Workloads `status` lists.
pub const STATUS_WORKLOADS: usize = 10;

/// The build that runs `status` (`release`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VersionState {
    /// Its release.
    pub release: &'static str,
    /// The commit it was built from.
    pub commit: &'static str,
    /// The layout of pins it reads.
    pub layout: u32,
}

impl VersionState {
    /// This build's.
    #[must_use]
    pub fn current() -> Self {
        Self {
            release: crate::release::VERSION,
            commit: crate::release::COMMIT,
            layout: crate::release::LAYOUT,
        }
    }
}

/// Whether an agent runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AgentState {
    /// An agent holds the lock.
    pub running: bool,
    /// Its pid, as it wrote it.
    pub pid: Option<String>,
    /// Which binary it runs, against the one running `status` (`None`: it could not be read).
    pub binary: Option<AgentBinary>,
}

/// The running agent's binary, as `/proc/PID/exe` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "is")]
pub enum AgentBinary {
    /// The file that runs `status`: the same release.
    Same,
    /// Another file (another release, or the same one installed elsewhere).
    Other {
        /// Its path.
        path: String,
    },
    /// A file deleted or replaced since the agent started (an upgrade installed, the agent not
    /// restarted yet).
    Replaced {
        /// The path it had.
        path: String,
    },
}

impl AgentBinary {
    /// What `/proc/PID/exe` of the agent `pid` is, against `/proc/self/exe`.
    fn of(pid: &str) -> Option<Self> {
        use std::os::unix::fs::MetadataExt as _;
        let exe = format!("/proc/{pid}/exe");
        let path = std::fs::read_link(&exe).ok()?.display().to_string();
        if let Some(path) = path.strip_suffix(" (deleted)") {
            return Some(Self::Replaced {
                path: path.to_owned(),
            });
        }
        let theirs = std::fs::metadata(&exe).ok()?;
        let ours = std::fs::metadata("/proc/self/exe").ok()?;
        Some(
            if (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino()) {
                Self::Same
            } else {
                Self::Other { path }
            },
        )
    }
}

/// The pinned programs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProgramState {
    /// Where they are pinned.
    pub pin_dir: String,
    /// Programs with a pinned attachment, with their kernel ids.
    pub attached: Vec<(String, u32)>,
    /// How many there are in all.
    pub expected: usize,
    /// Whether a pinned link attaches a program to a cgroup: read from the links themselves,
    /// so that what `status` says of steering is what is attached (a tracing link left behind,
    /// such as the signal program's, steers nothing).
    pub steering: bool,
    /// Other redirector pin sets on the same bpf filesystem whose programs are attached (a
    /// changed `pin_dir` leaves the old set steering on state no agent updates).
    pub other_sets: Vec<String>,
    /// The layout the pinning agent recorded (`None`: unreadable).
    pub layout: Option<u32>,
    /// The layout this build reads (`LAYOUT_VERSION`).
    pub reads_layout: u32,
}

/// The running kernel, as the agent's probes see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KernelState {
    /// `uname -r`.
    pub release: String,
    /// The optional features it lacks, which the agent runs without.
    pub degraded: Vec<DegradedFeature>,
    /// The required features it lacks (the agent refuses to start on it).
    pub missing: Vec<String>,
}

/// An optional feature the kernel lacks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DegradedFeature {
    /// The feature.
    pub feature: String,
    /// The release that brought it.
    pub since: String,
    /// What redirector does without it.
    pub without: String,
}

impl KernelState {
    /// What `kernel` found.
    #[must_use]
    pub fn of(kernel: &KernelSupport) -> Self {
        Self {
            release: kernel.release.clone(),
            degraded: kernel
                .degraded()
                .filter_map(|finding| match finding.feature.need {
                    Need::Optional { without, .. } => Some(DegradedFeature {
                        feature: finding.feature.name.replace('`', ""),
                        since: kernel_support::mainline(finding.feature.since),
                        without: without.replace('`', ""),
                    }),
                    Need::Required => None,
                })
                .collect(),
            missing: kernel
                .missing()
                .filter(|finding| finding.feature.need == Need::Required)
                .map(|finding| finding.feature.name.replace('`', ""))
                .collect(),
        }
    }
}

/// The nftables table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BypassState {
    /// `present`, `absent`, or `unknown` (nft could not be asked).
    pub table: &'static str,
    /// Why it is unknown.
    pub detail: Option<String>,
}

/// Gathers the report: `maps` (pinned under `pin_dir`), the lock at `lock_file`, the table
/// through `nft` (or why nft could not be run there), and what `kernel` found.
pub async fn gather(
    maps: &Maps,
    pin_dir: &Path,
    lock_file: &Path,
    nft: Result<&Nft, &NetnsError>,
    kernel: &KernelSupport,
) -> Result<StatusReport, DatapathError> {
    let listeners = snapshot::listeners(maps)?;
    // One walk of the hierarchy for the whole report: a cgroup gone is not looked for again.
    let mut resolver = workloads::cli_resolver(std::time::Duration::from_secs(3600), lock_file);
    let mut busiest = counts::by_workload(&maps.workload_counts()?, |cgroup| {
        workloads::name_of(resolver.as_mut(), cgroup)
    });
    let counted = busiest.len();
    busiest.truncate(STATUS_WORKLOADS);
    let pid = lock::holder(lock_file);
    let listed = match nft {
        Ok(nft) => nft
            .list_table(TABLE)
            .await
            .map_err(|error| crate::error_chain(&error)),
        Err(error) => Err(crate::error_chain(error)),
    };
    let conntrack_bypass = match listed {
        Ok(Some(_)) => BypassState {
            table: "present",
            detail: None,
        },
        Ok(None) => BypassState {
            table: "absent",
            detail: None,
        },
        Err(detail) => BypassState {
            table: "unknown",
            detail: Some(detail),
        },
    };
    Ok(StatusReport {
        version: VersionState::current(),
        agent: AgentState {
            running: pid.is_some(),
            binary: pid.as_deref().and_then(AgentBinary::of),
            pid,
        },
        programs: ProgramState {
            pin_dir: pin_dir.display().to_string(),
            attached: datapath::pinned_program_ids(pin_dir)
                .into_iter()
                .map(|(name, id)| (name.to_owned(), id))
                .collect(),
            expected: datapath::ALL_PROGRAMS.len(),
            steering: datapath::has_pinned_attachments(pin_dir),
            other_sets: datapath::other_attached_sets(pin_dir)
                .iter()
                .map(|dir| dir.display().to_string())
                .collect(),
            layout: datapath::pinned_layout(pin_dir),
            reads_layout: redirector_common::LAYOUT_VERSION,
        },
        conntrack_bypass,
        kernel: KernelState::of(kernel),
        listeners,
        workloads: WorkloadsState { counted, busiest },
    })
}

/// The kernel line(s): every feature there, or what is missing and what that costs.
fn render_kernel(text: &mut String, kernel: &KernelState) {
    if kernel.degraded.is_empty() && kernel.missing.is_empty() {
        let _ = writeln!(
            text,
            "kernel:    Linux {}: every feature redirector uses",
            kernel.release
        );
        return;
    }
    let _ = writeln!(text, "kernel:    Linux {}:", kernel.release);
    for missing in &kernel.missing {
        let _ = writeln!(
            text,
            "           MISSING {missing}: the agent cannot start here"
        );
    }
    for degraded in &kernel.degraded {
        let _ = writeln!(
            text,
            "           DEGRADED without {} ({}): {}",
            degraded.feature, degraded.since, degraded.without
        );
    }
}

/// The report as a table for people.
#[must_use]
pub fn render_table(report: &StatusReport) -> String {
    let mut text = String::new();
    let version = &report.version;
    let _ = writeln!(
        text,
        "version:   redirector {} (commit {}, layout {})",
        version.release, version.commit, version.layout
    );
    match (&report.agent.running, &report.agent.pid) {
        (true, Some(pid)) => {
            let binary = match &report.agent.binary {
                Some(AgentBinary::Same) => "this release".to_owned(),
                Some(AgentBinary::Other { path }) => format!(
                    "another binary, {path}: its release is on its redirector_build_info, or \
                     `{path} --version`"
                ),
                Some(AgentBinary::Replaced { path }) => format!(
                    "a binary since replaced at {path}: restart the agent to run the installed \
                     release"
                ),
                None => "its binary unreadable".to_owned(),
            };
            let _ = writeln!(text, "agent:     running (pid {pid}, {binary})");
        }
        _ if !report.programs.steering => {
            let _ = writeln!(
                text,
                "agent:     NOT RUNNING, and no program is attached to a cgroup: DNS to the \
                 listeners goes where it was sent, unsteered; start the agent"
            );
        }
        _ => {
            let _ = writeln!(
                text,
                "agent:     NOT RUNNING: the pinned programs keep steering and failing over in the \
                 kernel (a cache's last close, its stop signal, a stall they see), but a cache \
                 moved upstream stays there until an agent's probes confirm it, and a hung cache \
                 whose reads they cannot see is not detected"
            );
        }
    }
    let _ = writeln!(
        text,
        "programs:  {} of {} attached (pinned under {})",
        report.programs.attached.len(),
        report.programs.expected,
        report.programs.pin_dir
    );
    if let Some(pinned) = report.programs.layout
        && pinned > report.programs.reads_layout
    {
        // Releases keep every map they released as it was (the layout rule) and only add
        // maps: an older build reads the kept ones right and cannot see the added ones.
        let _ = writeln!(
            text,
            "           pinned by a newer release (layout {pinned}; this redirector reads layout \
             {}): what follows is what every release keeps, read right; the newer release's own \
             additions are not shown (its own `redirector status` shows them)",
            report.programs.reads_layout
        );
    }
    for other in &report.programs.other_sets {
        let _ = writeln!(
            text,
            "           ANOTHER SET attached from {other}: unless a second agent runs it on purpose, \
             it is stale (pin_dir changed?) and steers DNS on state no agent updates; remove its \
             pins to detach it: rm -r {other}"
        );
    }
    let _ = writeln!(
        text,
        "conntrack: bypass table {} {}",
        TABLE,
        match (
            report.conntrack_bypass.table,
            &report.conntrack_bypass.detail
        ) {
            ("present", _) => "present: DNS to the caches is not tracked".to_owned(),
            ("absent", _) => "absent: DNS to the caches is tracked".to_owned(),
            (_, detail) => format!("unknown ({})", detail.as_deref().unwrap_or("nft failed")),
        }
    );
    render_kernel(&mut text, &report.kernel);
    text.push('\n');

    let mut rows = vec![
        [
            "LISTENER", "ADDRESS", "CACHE", "MODE", "ROUTE", "WHY", "SOCKETS", "PROBE", "POOL",
        ]
        .map(str::to_owned),
    ];
    for listener in &report.listeners {
        let pool = if listener.pool.is_empty() {
            format!("(empty: {})", listener.empty_pool)
        } else {
            listener
                .pool
                .iter()
                .map(|target| {
                    let address = std::net::SocketAddr::new(target.address, target.udp_port);
                    if target.udp_port == target.tcp_port {
                        address.to_string()
                    } else {
                        format!("{address}/tcp:{}", target.tcp_port)
                    }
                })
                .collect::<Vec<_>>()
                .join(",")
        };
        rows.push([
            listener.name.clone(),
            listener.address.to_string(),
            listener.cache.to_string(),
            listener.mode.to_owned(),
            listener.route.to_owned(),
            listener.reason.to_owned(),
            listener.cache_sockets.map_or_else(
                || "-".to_owned(),
                |(udp, tcp)| format!("udp {udp}, tcp {tcp}"),
            ),
            listener.probe_verdict.to_owned(),
            pool,
        ]);
    }
    table(&mut text, &rows);

    text.push_str("\ncounters since the maps were created (syscalls, not packets):\n");
    let mut rows = vec![
        [
            "LISTENER",
            "PROTO",
            "CACHE",
            "UPSTREAM",
            "PASS",
            "FAIL",
            "SKIPPED",
            "REWRITTEN",
            "MISSES",
            "MOVED>CACHE",
            "MOVED>UPSTREAM",
        ]
        .map(str::to_owned),
    ];
    for listener in &report.listeners {
        for (protocol, counters) in [
            ("udp", listener.counters.udp),
            ("tcp", listener.counters.tcp),
        ] {
            rows.push([
                listener.name.clone(),
                protocol.to_owned(),
                counters.to_cache.to_string(),
                counters.to_upstream.to_string(),
                counters.passed_through.to_string(),
                counters.failed_empty_pool.to_string(),
                counters.skipped_cgroup.to_string(),
                counters.replies_rewritten.to_string(),
                counters.reply_misses.to_string(),
                counters.moved_to_cache.to_string(),
                counters.moved_to_upstream.to_string(),
            ]);
        }
    }
    table(&mut text, &rows);

    text.push_str(
        "
moves the kernel made itself, and drains, since the maps were created:
",
    );
    let mut rows = vec![["LISTENER", "SIGNALLED", "STALLED", "DRAINED"].map(str::to_owned)];
    for listener in &report.listeners {
        rows.push([
            listener.name.clone(),
            listener.flips.signalled.to_string(),
            listener.flips.stalled.to_string(),
            listener.flips.drained.to_string(),
        ]);
    }
    table(&mut text, &rows);
    render_workloads(&mut text, &report.workloads);
    text
}

/// The workloads' section: the busiest, their routes and what came back.
fn render_workloads(text: &mut String, workloads: &WorkloadsState) {
    if workloads.busiest.is_empty() {
        text.push_str(
            "\nDNS per workload: none counted (workloads.accounting is off, or no workload has \
             asked since the agent started counting)\n",
        );
        return;
    }
    let _ = write!(
        text,
        "\nDNS per workload since each was first counted, the {} busiest of {} (`redirector top` \
         shows rates):\n",
        workloads.busiest.len(),
        workloads.counted
    );
    let mut header = vec!["WORKLOAD".to_owned(), "QUERIES".to_owned()];
    header.extend(ROUTE_LABELS.iter().map(|route| route.to_uppercase()));
    header.extend(["REPLIES", "NXDOMAIN", "SERVFAIL"].map(str::to_owned));
    let mut rows = vec![header];
    for workload in &workloads.busiest {
        let total = workload.total_queries();
        let mut row = vec![workload.workload.clone(), total.to_string()];
        row.extend(
            workload
                .queries
                .iter()
                .map(|count| percent(counts::share(*count, total))),
        );
        row.extend([
            workload.total_replies().to_string(),
            percent(workload.nxdomain_share()),
            percent(workload.servfail_share()),
        ]);
        rows.push(row);
    }
    table(text, &rows);
}

/// A share as a whole percentage.
fn percent(share: f64) -> String {
    format!("{:.0}%", share * 100.0)
}

/// Writes `rows` as left-aligned columns.
pub(super) fn table<R: AsRef<[String]>>(text: &mut String, rows: &[R]) {
    let columns = rows.iter().map(|row| row.as_ref().len()).max().unwrap_or(0);
    let mut widths = vec![0usize; columns];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row.as_ref()) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in rows {
        let mut line = String::new();
        for (cell, width) in row.as_ref().iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::snapshot::{CounterSnapshot, FlipCounts, PoolTarget};

    fn report(running: bool) -> StatusReport {
        StatusReport {
            version: VersionState {
                release: "0.2.0",
                commit: "0123456789ab",
                layout: 5,
            },
            agent: AgentState {
                running,
                pid: running.then(|| "4242".to_owned()),
                binary: running.then_some(AgentBinary::Same),
            },
            programs: ProgramState {
                pin_dir: "/sys/fs/bpf/redirector".to_owned(),
                attached: vec![("dns_connect4".to_owned(), 17)],
                expected: 13,
                steering: true,
                other_sets: Vec::new(),
                layout: Some(redirector_common::LAYOUT_VERSION),
                reads_layout: redirector_common::LAYOUT_VERSION,
            },
            conntrack_bypass: BypassState {
                table: "present",
                detail: None,
            },
            kernel: KernelState::of(&KernelSupport::decide(
                "5.15.0-1064-azure",
                Some(aya::util::KernelVersion::new(5, 15, 0)),
                &[],
                |feature| Ok(feature.since <= kernel_support::FLOOR),
            )),
            listeners: vec![ListenerSnapshot {
                id: 0,
                name: "node".to_owned(),
                address: "169.254.10.10".parse().unwrap(),
                cache: "169.254.10.10:53".parse().unwrap(),
                mode: "auto",
                route: "upstream",
                reason: "the cache has no socket",
                reason_code: "no_sockets",
                cache_sockets: Some((0, 0)),
                probe_verdict: "down",
                pool: vec![PoolTarget {
                    address: "10.0.0.2".parse().unwrap(),
                    udp_port: 53,
                    tcp_port: 5353,
                }],
                empty_pool: "pass",
                counters: CounterSnapshot::default(),
                flips: FlipCounts::default(),
            }],
            workloads: WorkloadsState {
                counted: 3,
                busiest: vec![WorkloadCounts {
                    workload: "pod/default/web-0".to_owned(),
                    namespace: "default".to_owned(),
                    pod: "web-0".to_owned(),
                    cgroups: 2,
                    queries: [60, 30, 0, 5, 5],
                    replies: [70, 20, 0, 0, 10],
                }],
            },
        }
    }

    #[test]
    fn the_table_says_where_dns_goes_and_why_and_whether_an_agent_runs() {
        let text = render_table(&report(true));
        assert!(
            text.starts_with(
                "version:   redirector 0.2.0 (commit 0123456789ab, layout 5)\n\
                 agent:     running (pid 4242, this release)\n"
            ),
            "{text}"
        );
        assert!(text.contains("programs:  1 of 13 attached"), "{text}");
        let row = text.lines().find(|line| line.starts_with("node ")).unwrap();
        for cell in [
            "169.254.10.10:53",
            "upstream",
            "the cache has no socket",
            "udp 0, tcp 0",
            "down",
            "10.0.0.2:53/tcp:5353",
        ] {
            assert!(row.contains(cell), "{cell} in {row}");
        }
        assert!(
            text.contains(
                "kernel:    Linux 5.15.0-1064-azure:\n           DEGRADED without bpf_set_retval \
                 in sock_addr programs (6.1): the fail policy's syscalls fail with EPERM"
            ),
            "{text}"
        );
        let stopped = render_table(&report(false));
        assert!(
            stopped
                .lines()
                .nth(1)
                .unwrap()
                .starts_with("agent:     NOT RUNNING: the pinned programs keep steering"),
            "{stopped}"
        );
    }

    #[test]
    fn the_agents_binary_is_told_from_the_one_running_status() {
        assert_eq!(
            AgentBinary::of(&std::process::id().to_string()),
            Some(AgentBinary::Same)
        );
        let mut other = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let binary = AgentBinary::of(&other.id().to_string());
        other.kill().unwrap();
        other.wait().unwrap();
        assert!(
            matches!(&binary, Some(AgentBinary::Other { path }) if path.ends_with("/sleep")),
            "{binary:?}"
        );
        assert_eq!(AgentBinary::of("0"), None);
        // A binary deleted since it started (as `install` replaces one) is told apart.
        let dir = std::env::temp_dir().join(format!("redirector-status-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let copy = dir.join("sleep");
        std::fs::copy("/bin/sleep", &copy).unwrap();
        let mut replaced = std::process::Command::new(&copy).arg("10").spawn().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let binary = AgentBinary::of(&replaced.id().to_string());
        replaced.kill().unwrap();
        replaced.wait().unwrap();
        assert_eq!(
            binary,
            Some(AgentBinary::Replaced {
                path: copy.display().to_string()
            })
        );
    }

    #[test]
    fn the_json_names_every_field() {
        let json = serde_json::to_value(report(true)).unwrap();
        assert_eq!(json["agent"]["pid"], "4242");
        assert_eq!(json["agent"]["binary"]["is"], "same");
        assert_eq!(json["version"]["release"], "0.2.0");
        assert_eq!(json["version"]["layout"], 5);
        assert_eq!(json["listeners"][0]["route"], "upstream");
        assert_eq!(json["listeners"][0]["pool"][0]["tcp_port"], 5353);
        assert_eq!(json["conntrack_bypass"]["table"], "present");
        assert_eq!(json["kernel"]["degraded"][0]["since"], "6.1");
        assert_eq!(json["kernel"]["missing"], serde_json::json!([]));
        assert_eq!(json["workloads"]["busiest"][0]["pod"], "web-0");
        assert_eq!(json["workloads"]["busiest"][0]["queries"][1], 30);
    }

    #[test]
    fn the_workloads_section_gives_each_routes_and_what_came_back() {
        let text = render_table(&report(true));
        assert!(text.contains("the 1 busiest of 3"), "{text}");
        let header = text
            .lines()
            .find(|line| line.starts_with("WORKLOAD"))
            .unwrap();
        assert_eq!(
            header.split_whitespace().collect::<Vec<_>>(),
            [
                "WORKLOAD", "QUERIES", "CACHE", "UPSTREAM", "REFUSED", "DIRECT", "LIMITED",
                "REPLIES", "NXDOMAIN", "SERVFAIL"
            ]
        );
        let row = text
            .lines()
            .find(|line| line.starts_with("pod/default/web-0"))
            .unwrap();
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            [
                "pod/default/web-0",
                "100",
                "60%",
                "30%",
                "0%",
                "5%",
                "5%",
                "100",
                "20%",
                "0%"
            ]
        );
        let mut none = report(true);
        none.workloads.busiest.clear();
        assert!(render_table(&none).contains("DNS per workload: none counted"));
    }
}
