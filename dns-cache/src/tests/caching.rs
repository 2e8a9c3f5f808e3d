//! What the cache keeps and for how long: answers counted down and asked again once expired,
//! TTLs capped, negative answers, stale answers when the upstream is gone, answers of any size.

use std::time::Duration;

use hickory_proto::op::ResponseCode;

use super::{
    Running, UPSTREAM_A, config,
    fake_upstream::{Behaviour, FakeUpstream},
    sleep,
    wire::{addresses, tcp_ask, ttls, udp_ask, udp_ask_with},
};
use crate::stale::STALE_TTL;

#[tokio::test]
async fn forwards_then_answers_from_the_cache() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 3)).await;
    let cache = Running::start(config(vec![upstream.address])).await;

    let first = udp_ask(cache.address, 0x1111, "www.example.com.").await;
    assert_eq!(first.response_code(), ResponseCode::NoError);
    assert_eq!(addresses(&first), vec![UPSTREAM_A]);
    assert_eq!(ttls(&first), vec![3]);
    assert!(first.recursion_available());
    assert!(first.extensions().is_some(), "EDNS back to an EDNS client");
    assert_eq!(upstream.udp_queries(), 1);

    // Another ID, another case: the same entry, the client's ID and question back.
    let second = udp_ask(cache.address, 0x2222, "WWW.Example.COM.").await;
    assert_eq!(addresses(&second), vec![UPSTREAM_A]);
    assert_eq!(second.queries()[0].name().to_ascii(), "WWW.Example.COM.");
    assert_eq!(upstream.udp_queries(), 1, "answered from the cache");

    // TTLs count down (whole seconds, rounded down).
    sleep(1.1).await;
    let third = udp_ask_with(cache.address, 0x3333, "www.example.com.", false).await;
    let [ttl] = ttls(&third)[..] else {
        panic!("one record: {third:?}");
    };
    assert!(ttl <= 1, "3 s, 1.1 s later: {ttl}");
    assert!(
        third.extensions().is_none(),
        "no EDNS to a client without it"
    );
    assert_eq!(upstream.udp_queries(), 1);

    // Expired: asked again.
    sleep(2.1).await;
    let fourth = udp_ask(cache.address, 0x4444, "www.example.com.").await;
    assert_eq!(ttls(&fourth), vec![3]);
    assert_eq!(upstream.udp_queries(), 2);
}

#[tokio::test]
async fn ttls_are_capped_at_max_ttl() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 300)).await;
    let mut config = config(vec![upstream.address]);
    config.max_ttl = Duration::from_secs(60);
    let cache = Running::start(config).await;
    let fetched = udp_ask(cache.address, 1, "www.example.com.").await;
    assert_eq!(ttls(&fetched), vec![60]);
    let cached = udp_ask(cache.address, 2, "www.example.com.").await;
    let [ttl] = ttls(&cached)[..] else {
        panic!("one record: {cached:?}");
    };
    assert!((58..=60).contains(&ttl), "{ttl}");
    assert_eq!(upstream.udp_queries(), 1);
}

#[tokio::test]
async fn negative_answers_are_cached() {
    let upstream = FakeUpstream::start(Behaviour {
        nxdomain: true,
        ..Behaviour::answer(UPSTREAM_A, 60)
    })
    .await;
    let cache = Running::start(config(vec![upstream.address])).await;
    for id in [1, 2] {
        let reply = udp_ask(cache.address, id, "gone.example.").await;
        assert_eq!(reply.response_code(), ResponseCode::NXDomain);
        assert!(reply.answers().is_empty());
        assert_eq!(reply.name_servers().len(), 1, "the SOA");
    }
    assert_eq!(upstream.udp_queries(), 1);
}

#[tokio::test]
async fn serves_stale_when_the_upstream_is_gone_then_servfail() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 1)).await;
    let mut config = config(vec![upstream.address]);
    config.stale_for = Duration::from_secs(2);
    let cache = Running::start(config).await;
    let fresh = udp_ask(cache.address, 1, "www.example.com.").await;
    assert_eq!(addresses(&fresh), vec![UPSTREAM_A]);

    upstream.stop().await;
    // Expired a moment ago, within stale_for: the stale answer, TTL 30.
    sleep(1.2).await;
    let stale = udp_ask(cache.address, 2, "www.example.com.").await;
    assert_eq!(stale.response_code(), ResponseCode::NoError);
    assert_eq!(addresses(&stale), vec![UPSTREAM_A]);
    assert_eq!(ttls(&stale), vec![STALE_TTL]);

    // Expired more than stale_for ago: nothing left to serve.
    sleep(2.0).await;
    let failed = udp_ask(cache.address, 3, "www.example.com.").await;
    assert_eq!(failed.response_code(), ResponseCode::ServFail);
    assert!(failed.answers().is_empty());
}

#[tokio::test]
async fn large_tcp_answers_are_forwarded_and_cached() {
    // 300 A records: about 4.8 KB; UDP truncated, so over TCP.
    let upstream = FakeUpstream::start(Behaviour {
        records: 300,
        truncate_udp: true,
        ..Behaviour::answer(UPSTREAM_A, 60)
    })
    .await;
    let cache = Running::start(config(vec![upstream.address])).await;
    for id in [1, 2] {
        let reply = tcp_ask(cache.address, id, "huge.example.").await;
        assert_eq!(reply.answers().len(), 300);
    }
    assert_eq!(
        (upstream.udp_queries(), upstream.tcp_queries()),
        (1, 1),
        "hickory-resolver's cache keeps answers of any size"
    );
}
