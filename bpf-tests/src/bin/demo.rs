//! `cargo xtask demo`: a throwaway node in namespaces, the real agent, and DNS from a pod through
//! a listener: first flipped to the upstreams and back by hand, then with the cache killed mid-
//! stream and restarted. Prints who answered, the failover gap and the lost queries.

use std::time::Duration;

use anyhow::bail;
use bpf_tests::{
    bench::standard_listeners,
    cli::{set_state, start_agent},
    dns::now_ms,
    sandbox::{CacheSpec, Ns, Query, Sandbox, Tools, Transport},
    stream::{Stream, StreamReport},
    topology::{NODE_LISTENER, UPSTREAM_A_V4, UPSTREAM_B_V4, dns, who},
};

/// One row of the first act's table.
struct Step {
    mode: &'static str,
    client: &'static str,
    answered_by: String,
    reply_from: String,
}

fn main() -> anyhow::Result<()> {
    println!(
        "redirector demo: a node, a pod, a cache and two upstreams, in throwaway namespaces\n"
    );
    let mut sandbox = Sandbox::new(Tools::beside_current_exe()?)?;
    sandbox.start_standard_servers()?;
    println!("  cache       {NODE_LISTENER}:53 in the node namespace (answers 192.0.2.53)");
    println!("  upstream A  {UPSTREAM_A_V4}:53 (answers 192.0.2.1)");
    println!("  upstream B  {UPSTREAM_B_V4}:53 (answers 192.0.2.2)");

    let config = sandbox.write_file(
        "config.toml",
        &sandbox.config_toml(&standard_listeners(&sandbox)),
    )?;
    let mut agent = start_agent(&config)?;
    println!(
        "\nagent started: programs attached to {}",
        sandbox.cgroup().path().display()
    );
    for line in sandbox.attached_programs()?.lines().skip(1) {
        println!(
            "  {}",
            line.split_whitespace().collect::<Vec<_>>().join("  ")
        );
    }

    let steps = act_one_flips(&sandbox)?;
    let failover = act_two_kill_and_restart(&mut sandbox)?;

    agent.signal(nix::sys::signal::Signal::SIGTERM)?;
    let status = agent.wait_exit(Duration::from_secs(10))?;
    let left = if sandbox.attached_programs()?.is_empty() {
        "none"
    } else {
        "some (unexpected)"
    };
    println!("\nagent stopped ({status}); programs attached now: {left}");

    println!("\nact 1: redirector state --listener node --set MODE");
    println!("mode       client          answered by  client saw reply from");
    // dig and glibc drop replies from an address they did not ask, so their answers prove the
    // reply came back as the listener's; dns-query reports what recvfrom/getpeername returned.
    for step in &steps {
        println!(
            "{:<10} {:<15} {:<12} {}",
            step.mode, step.client, step.answered_by, step.reply_from
        );
    }
    println!("\nact 2: the cache killed with SIGKILL mid-stream, then restarted");
    println!("{failover}");
    drop(sandbox);
    println!("\nsandbox removed");

    let wrong = steps
        .iter()
        .filter(|step| (step.mode == "upstream") != step.answered_by.starts_with("upstream"))
        .count();
    if wrong > 0 {
        bail!("{wrong} step(s) of act 1 were answered by the wrong server");
    }
    Ok(())
}

/// Act 1: the listener forced to the upstreams and back; every kind of client asks.
fn act_one_flips(sandbox: &Sandbox) -> anyhow::Result<Vec<Step>> {
    let mut steps = Vec::new();
    for mode in ["auto", "upstream", "cache", "auto"] {
        let state = set_state(sandbox, "node", mode)?;
        if state.code != 0 {
            bail!("redirector state failed: {}", state.stderr);
        }
        println!("\nlistener node set to {mode}");
        for (client, transport) in [
            ("dns-query udp", Transport::Udp),
            ("dns-query tcp", Transport::Tcp),
        ] {
            let outcome = sandbox.query(Ns::Pod, Query::new(dns(NODE_LISTENER), transport))?;
            let step = Step {
                mode,
                client,
                answered_by: who(outcome.answer()).to_owned(),
                reply_from: outcome
                    .reply_from
                    .or(outcome.peer)
                    .unwrap_or_else(|| "-".to_owned()),
            };
            println!(
                "  pod {client:<14} → {:<11} (client sees {})",
                step.answered_by, step.reply_from
            );
            steps.push(step);
        }
        let dig = sandbox.dig(Ns::Pod, NODE_LISTENER.into(), false, false)?;
        println!("  pod dig            → {}", who(dig.answer()));
        steps.push(Step {
            mode,
            client: "dig",
            answered_by: who(dig.answer()).to_owned(),
            reply_from: "-".to_owned(),
        });
        let glibc = sandbox.getent(Ns::Pod, "ahostsv4")?;
        println!("  pod getent (glibc) → {}", who(glibc.first().copied()));
        steps.push(Step {
            mode,
            client: "getent",
            answered_by: who(glibc.first().copied()).to_owned(),
            reply_from: "-".to_owned(),
        });
    }
    Ok(steps)
}

/// Act 2: a stream of queries from the pod while the cache is killed and restarted; returns the
/// figures as text.
fn act_two_kill_and_restart(sandbox: &mut Sandbox) -> anyhow::Result<String> {
    println!("\nstreaming queries from the pod (fresh sockets and one long-lived socket) for 5 s:");
    let started = now_ms();
    let stream = Stream::start(sandbox, Ns::Pod, dns(NODE_LISTENER), Duration::from_secs(5))?;
    std::thread::sleep(Duration::from_millis(1500));
    let killed = now_ms();
    sandbox.stop_server("cache")?;
    println!(
        "  +{:.2} s  cache killed (SIGKILL)",
        seconds(killed - started)
    );
    std::thread::sleep(Duration::from_millis(1500));
    let restarted = now_ms();
    sandbox.start_cache("cache", &CacheSpec::standard())?;
    println!("  +{:.2} s  cache restarted", seconds(restarted - started));
    let report = stream.finish()?;

    println!("\n  time      cache  upstream  failed");
    let mut from = started;
    while from < started + 5000 {
        let to = from + 250;
        let count = |who: &str| {
            report
                .between(from, to)
                .filter(|record| StreamReport::answered_by(record).starts_with(who))
                .count()
        };
        println!(
            "  +{:.2} s  {:>5}  {:>8}  {:>6}",
            seconds(from - started),
            count("cache"),
            count("upstream"),
            count("failed")
        );
        from = to;
    }

    let first_upstream = report
        .first_upstream_answer(killed)
        .map(|record| record.sent_ms);
    let last_cache = first_upstream
        .and_then(|first| report.last_cache_answer(first))
        .map(|record| record.sent_ms);
    let back = report
        .first_cache_answer(restarted)
        .map(|record| record.sent_ms);
    let lost = report.failures_between(started, u64::MAX);
    Ok(match (first_upstream, last_cache, back) {
        (Some(first), Some(last), Some(back)) => format!(
            "  failover gap (last cache answer → first upstream answer): {} ms\n  \
             queries without an answer: {lost} of {}\n  \
             failback: the cache answered again {} ms after it restarted (once its probes passed)",
            first - last,
            report.records.len(),
            back - restarted
        ),
        _ => format!("  unexpected: {}", report.summary()),
    })
}

fn seconds(ms: u64) -> f64 {
    ms as f64 / 1000.0
}
