//! `cargo xtask demo`: a throwaway node in namespaces, the real agent, a real cache (by default
//! redirector's embedded one) and DNS from a pod through a listener. Act 1 flips the listener by
//! hand; act 2 kills the cache mid-stream and restarts it, with a live count of who answers, then
//! a summary: the failover gap, the lost queries, the failback.

use std::{
    io::{IsTerminal as _, Write as _},
    time::Duration,
};

use anyhow::{Context as _, bail};
use bpf_tests::{
    caches::{CacheKind, start_cache},
    cli::{redirector, set_state, start_agent},
    dns::{StreamRecord, now_ms},
    sandbox::{Ns, Query, Sandbox, Tools, Transport},
    stream::{Stream, StreamReport},
    topology::{NODE_LISTENER, UPSTREAM_A_V4, UPSTREAM_B_V4, dns, who},
};
use clap::{Parser, ValueEnum};

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Cache {
    /// `redirector cache`, the embedded forwarder.
    Embedded,
    /// The test DNS server.
    TestServer,
    /// dnsmasq.
    Dnsmasq,
    /// unbound.
    Unbound,
}

#[derive(Parser, Debug)]
struct Args {
    /// Which program plays the node-local cache.
    #[arg(long, value_enum, default_value_t = Cache::Embedded)]
    cache: Cache,
}

impl Cache {
    fn kind(self) -> CacheKind {
        match self {
            Self::Embedded => CacheKind::Embedded,
            Self::TestServer => CacheKind::TestServer,
            Self::Dnsmasq => CacheKind::Dnsmasq,
            Self::Unbound => CacheKind::Unbound,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Embedded => {
                "redirector cache (embedded), forwarding to a server that answers 192.0.2.53"
            }
            Self::TestServer => "the test DNS server, answering 192.0.2.53",
            Self::Dnsmasq => "dnsmasq, answering 192.0.2.53",
            Self::Unbound => "unbound, answering 192.0.2.53",
        }
    }
}

/// The demo's single listener.
const LISTENERS: &str = "[[listener]]\nname = \"node\"\naddress = \"169.254.10.10\"\nupstreams = [\"198.18.2.2\", \"198.18.2.3\"]\n";

/// How long act 2 streams, and when the cache dies and comes back.
const STREAM: Duration = Duration::from_secs(6);
const KILL_AT_MS: u64 = 1500;
const RESTART_AT_MS: u64 = 3000;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!(
        "redirector demo: a node, a pod, a cache and two upstreams, in throwaway namespaces\n"
    );
    let mut sandbox = Sandbox::new(Tools::beside_current_exe()?)?;
    sandbox.start_upstreams()?;
    start_cache(&mut sandbox, args.cache.kind(), "cache")?;
    println!(
        "  cache       {NODE_LISTENER}:53  {}",
        args.cache.describe()
    );
    println!("  upstream A  {UPSTREAM_A_V4}:53   answers 192.0.2.1");
    println!("  upstream B  {UPSTREAM_B_V4}:53   answers 192.0.2.2");

    let config = sandbox.write_file("config.toml", &sandbox.config_toml(LISTENERS))?;
    let config_arg = config.display().to_string();
    let mut agent = start_agent(&config)?;
    println!(
        "\nagent started (pid {}), programs attached to {}; `redirector status` says:\n",
        agent.pid(),
        sandbox.cgroup().path().display()
    );
    let status = redirector(&["status", "--config", &config_arg])?;
    for line in status
        .stdout
        .lines()
        .take_while(|line| !line.starts_with("counters"))
    {
        println!("  {line}");
    }

    let wrong = act_one_flips(&sandbox)?;
    let summary = act_two_kill_and_restart(&mut sandbox, args.cache.kind())?;

    agent.signal(nix::sys::signal::Signal::SIGTERM)?;
    agent.wait_exit(Duration::from_secs(10))?;
    let attached = sandbox.attached_programs()?.lines().skip(1).count();
    println!(
        "\nagent stopped (SIGTERM): {attached} programs still attached, so DNS keeps its fast path \
         and its failover with no agent; now: redirector uninstall"
    );
    let uninstall = redirector(&["uninstall", "--config", &config_arg])?;
    println!("  {}", uninstall.stdout.trim());
    let left = sandbox.attached_programs()?.lines().skip(1).count();
    println!("  programs attached now: {left}");
    drop(sandbox);
    println!("\nsandbox removed");

    if wrong > 0 {
        bail!("{wrong} query(ies) of act 1 were answered by the wrong server");
    }
    if !summary.failed_over || !summary.failed_back {
        bail!("act 2 did not fail over and back as it should");
    }
    Ok(())
}

/// Act 1: the listener forced to the upstreams and back; every kind of client asks. Returns how
/// many were answered by the wrong server.
fn act_one_flips(sandbox: &Sandbox) -> anyhow::Result<usize> {
    println!(
        "\nact 1: redirector state --listener node --set MODE, then every kind of client asks"
    );
    println!("  mode      udp          tcp          dig          getent (glibc)");
    let mut wrong = 0;
    for mode in ["auto", "upstream", "cache", "auto"] {
        let state = set_state(sandbox, "node", mode)?;
        if state.code != 0 {
            bail!("redirector state failed: {}", state.stderr);
        }
        let mut answers = Vec::new();
        for transport in [Transport::Udp, Transport::Tcp] {
            let outcome = sandbox.query(Ns::Pod, Query::new(dns(NODE_LISTENER), transport))?;
            answers.push(who(outcome.answer()));
        }
        answers.push(who(sandbox
            .dig(Ns::Pod, NODE_LISTENER.into(), false, false)?
            .answer()));
        answers.push(who(sandbox.getent(Ns::Pod, "ahostsv4")?.first().copied()));
        wrong += answers
            .iter()
            .filter(|who| (mode == "upstream") != who.starts_with("upstream"))
            .count();
        println!(
            "  {mode:<9} {}",
            answers
                .iter()
                .map(|who| format!("{who:<12}"))
                .collect::<String>()
                .trim_end()
        );
    }
    println!("  (dig and glibc drop replies from an address they did not ask: the rewrite works)");
    Ok(wrong)
}

/// What act 2 showed.
struct Summary {
    failed_over: bool,
    failed_back: bool,
}

/// Act 2: a stream of queries from the pod while the cache is killed and restarted, counted
/// live, then summed up.
fn act_two_kill_and_restart(sandbox: &mut Sandbox, kind: CacheKind) -> anyhow::Result<Summary> {
    println!(
        "\nact 2: the pod queries every 20 ms from fresh sockets and one long-lived socket; the \
         cache is killed (SIGKILL) at +{:.1} s and restarted at +{:.1} s",
        seconds(KILL_AT_MS),
        seconds(RESTART_AT_MS)
    );
    let started = now_ms();
    let mut stream = Stream::start(sandbox, Ns::Pod, dns(NODE_LISTENER), STREAM)?;
    let mut live = Live::default();
    let (mut killed, mut restarted) = (None, None);
    while now_ms() < started + u64::try_from(STREAM.as_millis())? + 200 {
        std::thread::sleep(Duration::from_millis(100));
        let elapsed = now_ms() - started;
        if killed.is_none() && elapsed >= KILL_AT_MS {
            sandbox.stop_server("cache")?;
            killed = Some(now_ms());
            live.event = "cache killed";
        }
        if restarted.is_none() && elapsed >= RESTART_AT_MS {
            start_cache(sandbox, kind, "cache")?;
            restarted = Some(now_ms());
            live.event = "cache restarted";
        }
        live.add(&stream.poll());
        live.show(elapsed)?;
    }
    println!();
    let report = stream.finish()?;
    let (killed, restarted) = (
        killed.context("the cache was never killed")?,
        restarted.context("the cache was never restarted")?,
    );

    let first_upstream = report
        .first_upstream_answer(killed)
        .map(|record| record.begun_ms);
    let last_cache = first_upstream
        .and_then(|first| report.last_cache_answer(first))
        .map(|record| record.begun_ms);
    let back = report
        .first_cache_answer(restarted)
        .map(|record| record.begun_ms);

    println!("\n  phase                          queries  cache  upstream  failed");
    let failback_from = back.unwrap_or(u64::MAX);
    for (phase, from, to) in [
        ("cache serving", started, killed),
        ("cache dead, then restarting", killed, failback_from),
        ("failed back", failback_from, u64::MAX),
    ] {
        let records: Vec<&StreamRecord> = report.between(from, to).collect();
        let count = |who: &str| {
            records
                .iter()
                .filter(|record| StreamReport::answered_by(record).starts_with(who))
                .count()
        };
        println!(
            "  {phase:<30} {:>7}  {:>5}  {:>8}  {:>6}",
            records.len(),
            count("cache"),
            count("upstream"),
            count("failed")
        );
    }
    let lost = report.failures_between(0, u64::MAX);
    match (first_upstream, last_cache) {
        (Some(first), Some(last)) => println!(
            "\n  failover gap (last cache answer → first upstream answer): {} ms \
             (queries go out every 20 ms: that is the resolution)",
            first - last
        ),
        _ => println!("\n  no failover seen: {}", report.summary()),
    }
    println!(
        "  queries without an answer: {lost} of {}",
        report.records.len()
    );
    match back {
        Some(back) => println!(
            "  failback: the cache answered again {} ms after it restarted (once its probes passed)",
            back - restarted
        ),
        None => println!("  no failback seen"),
    }
    Ok(Summary {
        failed_over: first_upstream.is_some(),
        failed_back: back.is_some(),
    })
}

/// The live line of act 2.
#[derive(Default)]
struct Live {
    cache: usize,
    upstream: usize,
    failed: usize,
    event: &'static str,
}

impl Live {
    fn add(&mut self, records: &[StreamRecord]) {
        for record in records {
            match StreamReport::answered_by(record) {
                "cache" => self.cache += 1,
                "failed" => self.failed += 1,
                who if who.starts_with("upstream") => self.upstream += 1,
                _ => {}
            }
        }
    }

    /// A progress bar and the counts, rewritten in place on a terminal, a line each half second
    /// otherwise.
    fn show(&self, elapsed_ms: u64) -> anyhow::Result<()> {
        let total = u64::try_from(STREAM.as_millis())?;
        let done = usize::try_from((elapsed_ms.min(total) * 30) / total)?;
        let line = format!(
            "  [{}{}] +{:.1} s  cache {:>4}  upstream {:>4}  failed {:>3}  {}",
            "#".repeat(done),
            ".".repeat(30 - done),
            seconds(elapsed_ms),
            self.cache,
            self.upstream,
            self.failed,
            self.event
        );
        let mut out = std::io::stdout();
        if out.is_terminal() {
            write!(out, "\r{line:<100}")?;
            out.flush()?;
        } else if elapsed_ms % 500 < 100 {
            writeln!(out, "{line}")?;
        }
        Ok(())
    }
}

fn seconds(ms: u64) -> f64 {
    ms as f64 / 1000.0
}
