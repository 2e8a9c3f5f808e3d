//! Who may ask: clients outside `allow` refused with a reply no larger than their query, and
//! nothing forwarded for them; clients inside answered.

use hickory_proto::op::{Message, MessageType, ResponseCode};

use super::{
    Running, UPSTREAM_A, config,
    fake_upstream::{Behaviour, FakeUpstream},
    wire::{addresses, query_bytes, tcp_exchange, udp_ask, udp_exchange},
};
use crate::config::parse_network;

#[tokio::test]
async fn clients_outside_allow_are_refused_with_a_small_reply() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 60)).await;
    let mut config = config(vec![upstream.address]);
    // The tests' client is 127.0.0.1: outside these.
    config.allow = vec![
        parse_network("10.0.0.0/8").expect("CIDR"),
        parse_network("::1/128").expect("CIDR"),
    ];
    let cache = Running::start(config).await;

    for edns in [true, false] {
        let request = query_bytes(0x5151, "www.example.com.", edns);
        let reply = udp_exchange(cache.address, &request).await;
        assert!(
            reply.len() <= request.len(),
            "no amplification: {} bytes for a {}-byte query",
            reply.len(),
            request.len()
        );
        let reply = Message::from_vec(&reply).expect("a DNS message");
        assert_eq!(reply.id(), 0x5151);
        assert_eq!(reply.message_type(), MessageType::Response);
        assert_eq!(reply.response_code(), ResponseCode::Refused);
        assert!(reply.answers().is_empty() && reply.additionals().is_empty());
        assert!(reply.extensions().is_none(), "no OPT record");
        assert!(!reply.recursion_available());
    }
    // A question that does not decode gets FORMERR before anyone looks at the client (from
    // hickory-server), still no larger than the query.
    let garbage = [
        0x42, 0x42, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 7, b'e', b'x',
    ];
    let reply = udp_exchange(cache.address, &garbage).await;
    assert!(reply.len() <= garbage.len(), "{reply:?}");
    let reply = Message::from_vec(&reply).expect("a DNS message");
    assert_eq!(
        (reply.id(), reply.response_code()),
        (0x4242, ResponseCode::FormErr)
    );

    let over_tcp = tcp_exchange(cache.address, &query_bytes(7, "www.example.com.", false)).await;
    let over_tcp = Message::from_vec(&over_tcp).expect("a DNS message");
    assert_eq!(over_tcp.response_code(), ResponseCode::Refused);
    assert_eq!(over_tcp.queries().len(), 1, "the question is echoed");

    assert_eq!(
        (upstream.udp_queries(), upstream.tcp_queries()),
        (0, 0),
        "nothing forwarded for a refused client"
    );
}

#[tokio::test]
async fn clients_inside_allow_are_answered() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 60)).await;
    let mut config = config(vec![upstream.address]);
    config.allow = vec![parse_network("127.0.0.1").expect("CIDR")];
    let cache = Running::start(config).await;
    let reply = udp_ask(cache.address, 1, "www.example.com.").await;
    assert_eq!(reply.response_code(), ResponseCode::NoError);
    assert_eq!(addresses(&reply), vec![UPSTREAM_A]);
}
