//! The systemd boot (`cargo xtask vm-test`, xtask/src/vm/systemd-boot.sh): a VM that booted
//! with systemd as PID 1, `deploy/systemd/redirector.service` installed as shipped and enabled,
//! a stand-in cache, upstream and kubelet. Only such a guest can run these tests (`test = false`
//! keeps them out of cargo's own `cargo test`); they run one after the other, each taking the
//! node from where the last left it.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use bpf_tests::{dns::QueryOutcome, pace::paced, topology::who, vm_notes::note};

/// Runs `program args`, which must succeed; its standard output.
fn run(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("running {program}: {error}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `systemctl show UNIT -p KEY --value`.
fn property(unit: &str, key: &str) -> String {
    run("systemctl", &["show", unit, "-p", key, "--value"])
        .trim()
        .to_owned()
}

/// The agent's log as journald has it.
fn journal() -> String {
    run(
        "journalctl",
        &[
            "--unit",
            "redirector.service",
            "--output",
            "cat",
            "--no-pager",
        ],
    )
}

/// One query from the pod's namespace to the node listener, as the pod's resolver sends it.
fn ask() -> QueryOutcome {
    let line = run(
        "ip",
        &[
            "netns",
            "exec",
            "pod",
            env!("CARGO_BIN_EXE_dns-query"),
            "--server",
            "169.254.10.10:53",
            "--transport",
            "udp",
            "--timeout-ms",
            "3000",
        ],
    );
    serde_json::from_str(line.trim()).unwrap_or_else(|error| panic!("{line:?}: {error}"))
}

fn answered_by() -> &'static str {
    who(ask().answer())
}

/// Polls until the pod's queries are answered by `expected`.
fn wait_answered_by(expected: &str, limit: Duration) {
    let deadline = Instant::now() + paced(limit);
    loop {
        let now = answered_by();
        if now == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the pod's DNS is still answered by {now}, not {expected}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Polls until `unit` is active (running) with a main process other than `not_pid`.
fn wait_active(unit: &str, not_pid: &str, limit: Duration) -> String {
    let deadline = Instant::now() + paced(limit);
    loop {
        let pid = property(unit, "MainPID");
        if property(unit, "ActiveState") == "active" && pid != "0" && pid != not_pid {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "{unit} is {} ({}) after {limit:?}",
            property(unit, "ActiveState"),
            property(unit, "SubState")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn seconds(monotonic_us: &str) -> f64 {
    monotonic_us
        .parse::<f64>()
        .unwrap_or_else(|error| panic!("{monotonic_us:?}: {error}"))
        / 1e6
}

#[test]
fn a_at_boot_the_unit_is_ready_and_steers_the_kubelets_first_query() {
    // Type=notify: active means READY=1 came, with a status line.
    assert_eq!(property("redirector.service", "ActiveState"), "active");
    assert_eq!(property("redirector.service", "SubState"), "running");
    assert_eq!(property("redirector.service", "Type"), "notify");
    assert_eq!(property("redirector.service", "UnitFileState"), "enabled");
    let status = property("redirector.service", "StatusText");
    assert!(!status.is_empty(), "READY=1 came with STATUS=");
    let log = journal();
    assert!(
        log.contains("redirector is steering"),
        "journalctl -u redirector: {log}"
    );

    // The hardening let it do everything: pins, its dummy link and addresses, its nft table.
    // A bpffs at /sys/fs/bpf, whoever mounted it: the boot records what was there before the
    // shipped redirector-bpffs.service ran (empty: nothing, and the unit mounted it).
    let bpffs = run(
        "findmnt",
        &["--noheadings", "--output", "FSTYPE", "/sys/fs/bpf"],
    );
    assert_eq!(bpffs.trim(), "bpf", "a bpffs at /sys/fs/bpf");
    let before = std::fs::read_to_string("/run/vm-test-bpffs-before")
        .expect("the boot's record of /sys/fs/bpf before redirector-bpffs.service");
    note(&format!(
        "/sys/fs/bpf before redirector-bpffs.service: {}",
        if before.trim().is_empty() {
            "no mount (systemd mounted none; the unit did)"
        } else {
            before.trim()
        }
    ));
    assert!(
        std::path::Path::new("/sys/fs/bpf/redirector").is_dir(),
        "pinned below /sys/fs/bpf"
    );
    let link = run("ip", &["-o", "address", "show", "dev", "redirector0"]);
    assert!(link.contains("169.254.10.10"), "{link}");
    let details = run("ip", &["-d", "link", "show", "redirector0"]);
    assert!(details.contains("dummy"), "{details}");
    let table = run("nft", &["list", "table", "inet", "redirector"]);
    assert!(table.contains("notrack"), "{table}");

    // The stand-in kubelet started after the agent was ready, and its pod's first query was
    // steered: nothing listens on 169.254.10.10, so an answer came through the programs.
    let ready = seconds(&property(
        "redirector.service",
        "ActiveEnterTimestampMonotonic",
    ));
    let kubelet = seconds(&property(
        "kubelet.service",
        "ExecMainStartTimestampMonotonic",
    ));
    assert!(
        kubelet >= ready,
        "kubelet started at {kubelet} s, the agent ready at {ready} s"
    );
    let first = std::fs::read_to_string("/run/kubelet-first-query.json")
        .expect("the stand-in kubelet's first query");
    let first: QueryOutcome = serde_json::from_str(first.trim()).expect("its outcome");
    let by = who(first.answer());
    assert!(
        by == "cache" || by == "upstream A",
        "the first query was answered by {by}: {first:?}"
    );
    let started = seconds(&property(
        "redirector.service",
        "ExecMainStartTimestampMonotonic",
    ));
    let uptime = std::fs::read_to_string("/proc/uptime").expect("/proc/uptime");
    let now: f64 = uptime
        .split_whitespace()
        .next()
        .and_then(|seconds| seconds.parse().ok())
        .expect("seconds since boot");
    // (systemd-analyze time cannot tell yet: this test is part of the boot's last job.)
    let multi_user = seconds(&property(
        "multi-user.target",
        "ActiveEnterTimestampMonotonic",
    ));
    note(&format!(
        "systemd boot (seconds since the kernel started): redirector started at {started:.1}, \
         ready at {ready:.1} ({:.2} s later); the kubelet's first query at {kubelet:.1}, \
         answered by {by}; multi-user.target at {multi_user:.1}; now {now:.1}",
        ready - started,
    ));
    wait_answered_by("cache", Duration::from_secs(10));
}

#[test]
fn b_stop_start_and_kill_keep_dns_and_adopt_the_pins() {
    run("systemctl", &["stop", "redirector.service"]);
    assert_eq!(property("redirector.service", "ActiveState"), "inactive");
    assert_eq!(answered_by(), "cache", "steering stays without the agent");
    run("systemctl", &["start", "redirector.service"]);
    let before = wait_active("redirector.service", "0", Duration::from_secs(30));
    assert!(
        journal().contains("adopting the maps an earlier agent pinned"),
        "the next start adopted the pins"
    );

    // kill -9 through systemd: Restart=always brings it back; the pod's DNS never stops.
    let restarts: u32 = property("redirector.service", "NRestarts")
        .parse()
        .expect("NRestarts");
    let asking = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let stream = {
        let asking = asking.clone();
        std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            while asking.load(std::sync::atomic::Ordering::Relaxed) {
                outcomes.push(ask());
                std::thread::sleep(Duration::from_millis(100));
            }
            outcomes
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    run(
        "systemctl",
        &["kill", "--signal", "KILL", "redirector.service"],
    );
    let after = wait_active("redirector.service", &before, Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    asking.store(false, std::sync::atomic::Ordering::Relaxed);
    let outcomes = stream.join().expect("the query stream");
    let restarted: u32 = property("redirector.service", "NRestarts")
        .parse()
        .expect("NRestarts");
    assert_eq!(restarted, restarts + 1, "one restart by Restart=always");
    assert_ne!(after, before);
    let lost: Vec<&QueryOutcome> = outcomes.iter().filter(|outcome| !outcome.ok).collect();
    assert!(
        outcomes.len() >= 5 && lost.is_empty(),
        "{} queries through the kill and the restart, {} lost: {lost:?}",
        outcomes.len(),
        lost.len()
    );
    note(&format!(
        "systemctl kill -s KILL: {} queries through the kill and the restart, none lost",
        outcomes.len()
    ));
}

#[test]
fn c_the_cache_units_death_fails_over_and_its_return_fails_back() {
    wait_answered_by("cache", Duration::from_secs(10));
    let changes = || journal().matches("route changed").count();
    let before = changes();
    run(
        "systemctl",
        &["kill", "--signal", "KILL", "node-local-dns.service"],
    );
    wait_answered_by("upstream A", Duration::from_secs(5));
    run("systemctl", &["start", "node-local-dns.service"]);
    wait_answered_by("cache", Duration::from_secs(15));
    // The failover and the failback, each logged (the journal is the agent's log under
    // systemd); the control loop logs a change on its next turn.
    let deadline = Instant::now() + paced(Duration::from_secs(5));
    while changes() < before + 2 {
        assert!(
            Instant::now() < deadline,
            "the agent logged {} route changes, not the failover and the failback: {}",
            changes() - before,
            journal()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
