//! What a client is answered, over UDP and TCP: sizes within what it can take, FORMERR for a
//! malformed query, and the answers given without forwarding (ANY, special-use names).

use std::net::{Ipv4Addr, SocketAddr};

use hickory_proto::{
    op::{Message, ResponseCode},
    rr::{RData, RecordType},
};
use tokio::net::UdpSocket;

use super::{
    LOOPBACK, Running, UPSTREAM_A, WAIT, config,
    fake_upstream::{Behaviour, FakeUpstream},
    wire::{
        addresses, name, tcp_ask, tcp_exchange, typed_query_bytes, udp_ask, udp_ask_with,
        udp_exchange,
    },
};
use crate::handler::ANY_TTL;

#[tokio::test]
async fn answers_over_tcp() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 60)).await;
    let cache = Running::start(config(vec![upstream.address])).await;
    let reply = tcp_ask(cache.address, 0xbeef, "www.example.com.").await;
    assert_eq!(addresses(&reply), vec![UPSTREAM_A]);
    // Forwarded over UDP, then cached for both transports.
    assert_eq!((upstream.udp_queries(), upstream.tcp_queries()), (1, 0));
    let again = tcp_ask(cache.address, 0xcafe, "www.example.com.").await;
    assert_eq!(addresses(&again), vec![UPSTREAM_A]);
    assert_eq!(upstream.udp_queries(), 1);
}

#[tokio::test]
async fn large_answers_are_truncated_for_small_udp_clients() {
    // 60 A records: about 1 KB, over 512 bytes but within the EDNS payload size.
    let upstream = FakeUpstream::start(Behaviour {
        records: 60,
        ..Behaviour::answer(UPSTREAM_A, 60)
    })
    .await;
    let cache = Running::start(config(vec![upstream.address])).await;

    let with_edns = udp_ask_with(cache.address, 1, "big.example.", true).await;
    assert!(!with_edns.truncated());
    assert_eq!(with_edns.answers().len(), 60);

    let without_edns = udp_ask_with(cache.address, 2, "big.example.", false).await;
    assert!(without_edns.truncated(), "more than 512 bytes: TC");
    assert!(without_edns.answers().is_empty());

    let over_tcp = tcp_ask(cache.address, 3, "big.example.").await;
    assert!(!over_tcp.truncated());
    assert_eq!(over_tcp.answers().len(), 60);
    assert_eq!(upstream.udp_queries(), 1);
}

#[tokio::test]
async fn malformed_queries_get_formerr() {
    let cache = Running::start(config(vec![SocketAddr::from((LOOPBACK, 9))])).await;
    let socket = UdpSocket::bind((LOOPBACK, 0)).await.expect("bind");
    // A header (ID 0x4242, one question) and a truncated question.
    let garbage = [
        0x42, 0x42, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 7, b'e', b'x',
    ];
    socket.send_to(&garbage, cache.address).await.expect("send");
    let mut buffer = vec![0; 512];
    let (length, _) = tokio::time::timeout(WAIT, socket.recv_from(&mut buffer))
        .await
        .expect("an answer in time")
        .expect("receive");
    let reply = Message::from_vec(&buffer[..length]).expect("a DNS message");
    assert_eq!(reply.id(), 0x4242);
    assert_eq!(reply.response_code(), ResponseCode::FormErr);
}

#[tokio::test]
async fn any_gets_the_rfc_8482_answer_without_forwarding() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 60)).await;
    let cache = Running::start(config(vec![upstream.address])).await;
    let request = typed_query_bytes(0x0a0a, "Www.Example.com.", RecordType::ANY, true);
    let over_udp = udp_exchange(cache.address, &request).await;
    let over_tcp = tcp_exchange(cache.address, &request).await;
    for reply in [over_udp, over_tcp] {
        let reply = Message::from_vec(&reply).expect("a DNS message");
        assert_eq!(reply.id(), 0x0a0a);
        assert_eq!(reply.response_code(), ResponseCode::NoError);
        assert_eq!(reply.queries()[0].name().to_ascii(), "Www.Example.com.");
        let [record] = reply.answers() else {
            panic!("one record: {:?}", reply.answers());
        };
        assert_eq!(record.name(), &name("www.example.com."));
        assert_eq!(record.record_type(), RecordType::HINFO);
        assert_eq!(record.ttl(), ANY_TTL);
        let RData::HINFO(hinfo) = record.data() else {
            panic!("HINFO: {record:?}");
        };
        assert_eq!((hinfo.cpu(), hinfo.os()), (&b"RFC8482"[..], &b""[..]));
    }
    assert_eq!(
        (upstream.udp_queries(), upstream.tcp_queries()),
        (0, 0),
        "ANY is not forwarded"
    );
}

#[tokio::test]
async fn special_use_names_are_answered_without_forwarding() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 60)).await;
    let cache = Running::start(config(vec![upstream.address])).await;
    let localhost = udp_ask(cache.address, 1, "localhost.").await;
    assert_eq!(addresses(&localhost), vec![Ipv4Addr::LOCALHOST]);
    for (id, invalid) in [(2, "x.invalid."), (3, "x.onion.")] {
        let reply = udp_ask(cache.address, id, invalid).await;
        assert_eq!(reply.response_code(), ResponseCode::NXDomain, "{invalid}");
    }
    assert_eq!(
        upstream.udp_queries(),
        0,
        "RFC 6761 names are not forwarded"
    );
}
