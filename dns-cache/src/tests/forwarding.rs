//! Which upstream is asked and what its failures become: zones, servers in order, names no
//! zone covers, an upstream's SERVFAIL or REFUSED, none answering, a truncated reply.

use std::time::Duration;

use hickory_proto::op::ResponseCode;

use super::{
    Running, UPSTREAM_A, UPSTREAM_B, config,
    fake_upstream::{Behaviour, FakeUpstream},
    wire::{addresses, name, udp_ask},
};
use crate::Zone;

#[tokio::test]
async fn zones_route_to_their_upstreams() {
    let cluster = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 30)).await;
    let internet = FakeUpstream::start(Behaviour::answer(UPSTREAM_B, 30)).await;
    let mut config = config(vec![internet.address]);
    config.zones = vec![Zone {
        name: name("cluster.local."),
        servers: vec![cluster.address],
    }];
    let cache = Running::start(config).await;

    let service = udp_ask(cache.address, 1, "kube-dns.kube-system.svc.Cluster.Local.").await;
    assert_eq!(addresses(&service), vec![UPSTREAM_A]);
    let outside = udp_ask(cache.address, 2, "example.com.").await;
    assert_eq!(addresses(&outside), vec![UPSTREAM_B]);
    let lookalike = udp_ask(cache.address, 3, "notcluster.local.").await;
    assert_eq!(addresses(&lookalike), vec![UPSTREAM_B]);
    assert_eq!(cluster.udp_queries(), 1);
    assert_eq!(internet.udp_queries(), 2);
}

#[tokio::test]
async fn names_outside_every_zone_are_refused_without_default_servers() {
    let cluster = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 30)).await;
    let mut config = config(Vec::new());
    config.zones = vec![Zone {
        name: name("cluster.local."),
        servers: vec![cluster.address],
    }];
    let cache = Running::start(config).await;
    let reply = udp_ask(cache.address, 1, "example.com.").await;
    assert_eq!(reply.response_code(), ResponseCode::Refused);
    assert_eq!(cluster.udp_queries(), 0);
}

#[tokio::test]
async fn servers_are_tried_in_order() {
    let silent = FakeUpstream::start(Behaviour {
        silent: true,
        ..Behaviour::answer(UPSTREAM_A, 30)
    })
    .await;
    let working = FakeUpstream::start(Behaviour::answer(UPSTREAM_B, 30)).await;
    let mut config = config(vec![silent.address, working.address]);
    config.upstream_timeout = Duration::from_millis(200);
    let cache = Running::start(config).await;
    let reply = udp_ask(cache.address, 1, "example.com.").await;
    assert_eq!(addresses(&reply), vec![UPSTREAM_B]);
    assert_eq!(silent.udp_queries(), 1, "the first server was asked first");
    assert_eq!(working.udp_queries(), 1);
}

#[tokio::test]
async fn an_upstreams_servfail_or_refused_is_a_failure_not_an_empty_answer() {
    for code in [ResponseCode::ServFail, ResponseCode::Refused] {
        let upstream = FakeUpstream::start(Behaviour {
            failure: Some(code),
            ..Behaviour::answer(UPSTREAM_A, 60)
        })
        .await;
        let cache = Running::start(config(vec![upstream.address])).await;
        let reply = udp_ask(cache.address, 1, "www.example.com.").await;
        assert_eq!(
            reply.response_code(),
            ResponseCode::ServFail,
            "upstream {code}"
        );
        assert!(reply.answers().is_empty());
    }
}

#[tokio::test]
async fn servfail_when_nothing_is_cached() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 10)).await;
    let address = upstream.address;
    upstream.stop().await;
    let cache = Running::start(config(vec![address])).await;
    let reply = udp_ask(cache.address, 7, "www.example.com.").await;
    assert_eq!(reply.response_code(), ResponseCode::ServFail);
    assert_eq!(reply.queries().len(), 1, "the question is echoed");
}

#[tokio::test]
async fn a_truncated_upstream_reply_is_retried_over_tcp() {
    let upstream = FakeUpstream::start(Behaviour {
        truncate_udp: true,
        ..Behaviour::answer(UPSTREAM_A, 60)
    })
    .await;
    let cache = Running::start(config(vec![upstream.address])).await;
    let reply = udp_ask(cache.address, 5, "www.example.com.").await;
    assert!(!reply.truncated());
    assert_eq!(addresses(&reply), vec![UPSTREAM_A]);
    assert_eq!((upstream.udp_queries(), upstream.tcp_queries()), (1, 1));
}
