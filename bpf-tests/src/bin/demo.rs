//! `cargo xtask demo`: a throwaway node in namespaces, the real agent, and DNS from a pod through
//! a listener while it is flipped to the upstreams and back. Prints who answered each step.

use std::time::Duration;

use anyhow::bail;
use bpf_tests::{
    bench::standard_listeners,
    cli::{set_state, start_agent},
    sandbox::{Ns, Query, Sandbox, Tools, Transport},
    topology::{NODE_LISTENER, UPSTREAM_A_V4, UPSTREAM_B_V4, dns, who},
};

struct Step {
    mode: &'static str,
    client: &'static str,
    answered_by: String,
    reply_from: String,
}

fn main() -> anyhow::Result<()> {
    println!(
        "redirector demo: a node, a pod, a cache and two upstreams, all in throwaway namespaces\n"
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

    let mut steps = Vec::new();
    for mode in ["auto", "upstream", "cache", "auto"] {
        set_mode(&sandbox, mode)?;
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
            // dig drops replies from an address it did not ask: an answer means the listener's.
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

    agent.signal(nix::sys::signal::Signal::SIGTERM)?;
    let status = agent.wait_exit(Duration::from_secs(10))?;
    println!(
        "\nagent stopped ({status}); programs attached now: {}",
        if sandbox.attached_programs()?.is_empty() {
            "none"
        } else {
            "some (unexpected)"
        }
    );

    println!("\nmode       client          answered by  client saw reply from");
    // dig and glibc drop replies from an address they did not ask, so their answers prove the
    // reply came back as the listener's; dns-query reports what recvfrom/getpeername returned.
    for step in &steps {
        println!(
            "{:<10} {:<15} {:<12} {}",
            step.mode, step.client, step.answered_by, step.reply_from
        );
    }
    let wrong: Vec<&Step> = steps
        .iter()
        .filter(|step| {
            let upstream = step.answered_by.starts_with("upstream");
            (step.mode == "upstream") != upstream
        })
        .collect();
    drop(sandbox);
    println!("\nsandbox removed");
    if !wrong.is_empty() {
        bail!("{} step(s) were answered by the wrong server", wrong.len());
    }
    Ok(())
}

fn set_mode(sandbox: &Sandbox, mode: &str) -> anyhow::Result<()> {
    let state = set_state(sandbox, "node", mode)?;
    if state.code != 0 {
        bail!("redirector state failed: {}", state.stderr);
    }
    Ok(())
}
