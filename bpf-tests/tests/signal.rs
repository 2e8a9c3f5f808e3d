//! A cache told to stop moves its DNS before it closes a socket (#28): the `signal_deliver`
//! program fails its listeners over the moment the process that bound the cache's sockets is
//! delivered SIGTERM, with no agent running, so the queries sent while it shuts down (here it
//! keeps its sockets and answers for a while, as unbound under load or CoreDNS in `lameduck` do)
//! go upstream instead of into a cache that is going away.

use std::time::Duration;

use bpf_tests::{
    cli::{start_agent, stop_agent, uninstall},
    dns::now_ms,
    harness::write_standard_config,
    pace::{paced_ms, pause, wait_until},
    sandbox::{CacheSpec, Ns, Query, Sandbox, Transport},
    stream::{Stream, StreamReport},
    tools,
    topology::{NODE_LISTENER, dns, who},
};
use nix::sys::signal::Signal;

fn answered_by(sandbox: &Sandbox) -> anyhow::Result<&'static str> {
    let outcome = sandbox.query(Ns::Pod, Query::new(dns(NODE_LISTENER), Transport::Udp))?;
    Ok(who(outcome.answer()))
}

#[test]
fn a_cache_told_to_stop_moves_dns_before_it_closes_its_sockets_with_no_agent() -> anyhow::Result<()>
{
    let mut sandbox = Sandbox::new(tools!())?;
    sandbox.start_standard_servers()?;
    let config = write_standard_config(&sandbox)?;
    let mut agent = start_agent(&config)?;
    // A cache that binds while the programs run (its process is recorded at its binds), and that
    // goes on serving for a while after SIGTERM.
    let linger_ms = paced_ms(600);
    sandbox.stop_server("cache")?;
    let mut cache = CacheSpec::standard();
    cache
        .extra_args
        .extend(["--term-linger-ms".to_owned(), linger_ms.to_string()]);
    sandbox.start_cache("cache", &cache)?;
    wait_until(
        "the agent confirms the new cache",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || Ok(answered_by(&sandbox)? == "cache"),
    )?;
    stop_agent(&mut agent)?;

    let stream = Stream::start_with(
        &sandbox,
        Ns::Pod,
        dns(NODE_LISTENER),
        Duration::from_secs(120),
        &["--kinds", "fresh,connected,long"],
    )?;
    pause(500);
    let signalled = now_ms();
    sandbox.process("cache")?.signal(Signal::SIGTERM)?;
    let exited = sandbox
        .process("cache")?
        .wait_exit(Duration::from_secs(30))?;
    let closed = now_ms();
    assert!(
        exited.success(),
        "the cache lingered and exited: {exited:?}"
    );
    let report = stream.stop_once(
        "queries after the cache exited",
        Duration::from_secs(20),
        |report| {
            report
                .records
                .iter()
                .filter(|record| record.begun_ms > closed)
                .count()
                > 20
        },
    )?;
    println!(
        "signal at +{} ms, cache gone at +{} ms: {}",
        signalled.saturating_sub(report.started_ms()),
        closed.saturating_sub(report.started_ms()),
        report.summary()
    );

    // While the cache still held its sockets (and answered), the queries sent went upstream:
    // before this program, every one of them went to the cache until its last close.
    let holding: Vec<_> = report
        .between(
            signalled + paced_ms(50),
            closed.saturating_sub(paced_ms(50)),
        )
        .collect();
    assert!(
        holding.len() > 10,
        "too few queries while the cache lingered: {}",
        report.summary()
    );
    for record in &holding {
        assert!(
            StreamReport::answered_by(record).starts_with("upstream"),
            "a query sent after the signal, while the cache still held its sockets, was \
             answered by {}: {}",
            StreamReport::answered_by(record),
            report.summary()
        );
    }
    // Nothing was lost: not while the cache lingered, not after it closed.
    assert_eq!(
        report.failures_between(signalled, u64::MAX),
        0,
        "{}",
        report.summary()
    );
    uninstall(&config)?;
    Ok(())
}
