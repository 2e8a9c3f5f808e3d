//! Real resolver libraries through a hung and a killed cache, one query every 20 ms from the pod,
//! each for a name of its own (c-ares caches answers itself):
//! - c-ares (pycares from PyPI), with `ARES_FLAG_STAYOPEN` (one socket for the channel's life, as
//!   gRPC C-core sets it) and with its default flags;
//! - glibc: getaddrinfo (`getent ahosts`, a socket per lookup) and `res_query` on one resolver
//!   state with `RES_STAYOPEN` (one connected socket for every query);
//! - musl: getaddrinfo from a static binary (an unconnected socket per lookup);
//! - raw sockets: one connected UDP socket kept and reopened when a send fails, and one
//!   unconnected UDP socket kept (`dns-stream`).
//!
//! Asserted: no query begun after the listener's route changed fails, and within 2 s of each
//! failback at least 95 % of the queries reach the cache. Before the egress program, the
//! STAYOPEN channel's connected socket stayed on an upstream after every failover: 0 % of its
//! queries reached the cache once it was back.
//!
//! These run on the host kernel only (`xtask/src/vm/scope.rs`): how a library answers the
//! refused send is userspace; `long_lived.rs` shows the kernel's side on every kernel.

use bpf_tests::{
    dns::now_ms,
    harness::{CacheEvent, Harness, NODE_ID},
    pace::{paced_ms, pause},
    resolvers::{Resolver, ResolverReport, ResolverStream},
    sandbox::Ns,
    tools,
    topology::NODE_LISTENER,
};

fn through(resolver: Resolver, event: CacheEvent) -> anyhow::Result<()> {
    let mut harness = Harness::standard(tools!())?;
    let started = now_ms();
    let stream = ResolverStream::start(&harness.sandbox, Ns::Pod, NODE_LISTENER.into(), resolver)?;
    pause(1500);
    let struck = now_ms();
    event.strike(&mut harness.sandbox)?;
    harness.wait_for_route(NODE_ID, "upstream")?;
    let flipped = now_ms();
    // Longer than the failback grace (1 s, which a socket reconnected at the flip would still be
    // in at the failback otherwise), as every real outage is.
    pause(1500);
    let restored = now_ms();
    event.restore(&mut harness.sandbox)?;
    harness.wait_for_route(NODE_ID, "cache")?;
    let failed_back = now_ms();
    let window = paced_ms(2000);
    pause(2000 + 300);
    let report = stream.finish()?;
    let what = format!("{resolver:?} through {event:?}");
    println!("{what}: {}", report.summary());
    let counters = harness.counters(NODE_ID)?;
    println!(
        "{what}: moved to upstream {}, to the cache {}; route upstream within {} ms, back {} ms \
         after the cache was restored",
        counters.moved_to_upstream,
        counters.moved_to_cache,
        flipped - struck,
        failed_back - restored
    );

    assert_all(
        &report,
        started,
        struck.saturating_sub(paced_ms(50)),
        "cache",
        &what,
    );
    // The route had changed by `flipped`: nothing begun after it may fail, before or after
    // the failback.
    let late_failures: Vec<_> = report
        .between(flipped, u64::MAX)
        .filter(|record| record.error.is_some())
        .collect();
    assert!(
        late_failures.is_empty(),
        "{what}: queries begun after the route changed failed: {}",
        report.summary()
    );
    assert_all(&report, flipped, restored, "upstream", &what);
    let after: Vec<_> = report.between(failed_back, failed_back + window).collect();
    assert!(
        after.len() >= 20,
        "{what}: too few queries after the failback to judge: {}",
        report.summary()
    );
    let cached = after
        .iter()
        .filter(|record| record.answered_by() == "cache")
        .count();
    println!(
        "{what}: {cached} of {} queries reached the cache within 2 s of the failback",
        after.len()
    );
    assert!(
        cached * 100 >= after.len() * 95,
        "{what}: only {cached} of {} queries reached the cache within 2 s of the failback: {}",
        after.len(),
        report.summary()
    );
    Ok(())
}

/// Asserts that every query begun in `[from, to)` was answered by `by` (`cache`, or `upstream`
/// for either upstream).
fn assert_all(report: &ResolverReport, from: u64, to: u64, by: &str, what: &str) {
    let records: Vec<_> = report.between(from, to).collect();
    assert!(!records.is_empty(), "{what}: no query in [{from}, {to})");
    for record in records {
        assert!(
            record.answered_by().starts_with(by),
            "{what}: q{} begun {} was answered by {}, not {by}: {}",
            record.seq,
            record.begun_ms,
            record.answered_by(),
            report.summary()
        );
    }
}

#[test]
fn cares_stayopen_through_a_hung_cache_and_back() -> anyhow::Result<()> {
    through(Resolver::CaresStayOpen, CacheEvent::Hang)
}

#[test]
fn cares_stayopen_through_a_killed_cache_and_a_restart() -> anyhow::Result<()> {
    through(Resolver::CaresStayOpen, CacheEvent::Kill)
}

#[test]
fn cares_default_through_a_hung_cache_and_back() -> anyhow::Result<()> {
    through(Resolver::CaresDefault, CacheEvent::Hang)
}

#[test]
fn cares_default_through_a_killed_cache_and_a_restart() -> anyhow::Result<()> {
    through(Resolver::CaresDefault, CacheEvent::Kill)
}

#[test]
fn glibc_getaddrinfo_through_a_hung_cache_and_back() -> anyhow::Result<()> {
    through(Resolver::GlibcGetaddrinfo, CacheEvent::Hang)
}

#[test]
fn glibc_getaddrinfo_through_a_killed_cache_and_a_restart() -> anyhow::Result<()> {
    through(Resolver::GlibcGetaddrinfo, CacheEvent::Kill)
}

#[test]
fn glibc_res_query_stayopen_through_a_hung_cache_and_back() -> anyhow::Result<()> {
    through(Resolver::GlibcResQueryStayOpen, CacheEvent::Hang)
}

#[test]
fn glibc_res_query_stayopen_through_a_killed_cache_and_a_restart() -> anyhow::Result<()> {
    through(Resolver::GlibcResQueryStayOpen, CacheEvent::Kill)
}

#[test]
fn musl_getaddrinfo_through_a_hung_cache_and_back() -> anyhow::Result<()> {
    through(Resolver::MuslGetaddrinfo, CacheEvent::Hang)
}

#[test]
fn musl_getaddrinfo_through_a_killed_cache_and_a_restart() -> anyhow::Result<()> {
    through(Resolver::MuslGetaddrinfo, CacheEvent::Kill)
}

#[test]
fn a_raw_connected_socket_through_a_hung_cache_and_back() -> anyhow::Result<()> {
    through(Resolver::RawConnected, CacheEvent::Hang)
}

#[test]
fn a_raw_connected_socket_through_a_killed_cache_and_a_restart() -> anyhow::Result<()> {
    through(Resolver::RawConnected, CacheEvent::Kill)
}

#[test]
fn a_raw_unconnected_socket_through_a_hung_cache_and_back() -> anyhow::Result<()> {
    through(Resolver::RawUnconnected, CacheEvent::Hang)
}

#[test]
fn a_raw_unconnected_socket_through_a_killed_cache_and_a_restart() -> anyhow::Result<()> {
    through(Resolver::RawUnconnected, CacheEvent::Kill)
}
