//! The server's life and bounds: `run` until shutdown (its sockets closed after), bind errors
//! naming the address, the queries in flight and the TCP connections it takes at once.

use std::{net::SocketAddr, time::Duration};

use hickory_proto::op::{Message, ResponseCode};
use tokio::{
    net::{TcpListener, TcpStream, UdpSocket},
    sync::oneshot,
};

use super::{
    LOOPBACK, Running, UPSTREAM_A, WAIT, config,
    fake_upstream::{Behaviour, FakeUpstream, bind_udp_and_tcp},
    sleep,
    wire::{addresses, query_bytes, read_frame, udp_ask, write_frame},
};
use crate::{run, server::Limits};

#[tokio::test]
async fn run_returns_on_shutdown_and_closes_its_sockets() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 60)).await;
    // Find a port free on both protocols, then give it to the cache by number.
    let (udp, tcp) = bind_udp_and_tcp().await;
    let address = udp.local_addr().expect("local address");
    drop((udp, tcp));
    let mut config = config(vec![upstream.address]);
    config.listen = vec![address];

    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(run(config, async {
        let _ = stopped.await;
    }));
    // Serving: wait for the first answer (the sockets are bound before run awaits anything else,
    // but the spawned task may not have run yet).
    let mut answered = None;
    for attempt in 0..50 {
        let socket = UdpSocket::bind((LOOPBACK, 0)).await.expect("bind");
        socket
            .send_to(&query_bytes(attempt, "www.example.com.", false), address)
            .await
            .expect("send");
        let mut buffer = vec![0; 512];
        if let Ok(Ok((length, _))) =
            tokio::time::timeout(Duration::from_millis(100), socket.recv_from(&mut buffer)).await
        {
            answered = Some(Message::from_vec(&buffer[..length]).expect("a DNS message"));
            break;
        }
    }
    let answered = answered.expect("the cache answered");
    assert_eq!(addresses(&answered), vec![UPSTREAM_A]);

    stop.send(()).expect("the server is running");
    tokio::time::timeout(WAIT, server)
        .await
        .expect("run returns promptly")
        .expect("no panic")
        .expect("no error");
    // Both sockets are closed: the port can be bound again.
    UdpSocket::bind(address).await.expect("UDP port released");
    TcpListener::bind(address).await.expect("TCP port released");
}

#[tokio::test]
async fn bind_errors_name_the_address() {
    let taken = UdpSocket::bind((LOOPBACK, 0)).await.expect("bind");
    let address = taken.local_addr().expect("local address");
    let mut config = config(vec![SocketAddr::from((LOOPBACK, 9))]);
    config.listen = vec![address];
    let error = run(config, async {}).await.expect_err("the port is taken");
    assert!(error.to_string().contains(&address.to_string()), "{error}");
    assert!(error.to_string().contains("UDP"), "{error}");
}

#[tokio::test]
async fn beyond_the_queries_in_flight_the_cache_answers_servfail_at_once() {
    let silent = FakeUpstream::start(Behaviour {
        silent: true,
        ..Behaviour::answer(UPSTREAM_A, 60)
    })
    .await;
    let limits = Limits {
        in_flight: 1,
        ..Limits::DEFAULT
    };
    let cache = Running::start_with(config(vec![silent.address]), limits).await;
    let address = cache.address;
    let waiting = tokio::spawn(async move { udp_ask(address, 1, "slow.example.").await });
    // Until the first query reaches the upstream, the permit may still be free.
    while silent.udp_queries() == 0 {
        sleep(0.01).await;
    }
    let refused = udp_ask(cache.address, 2, "other.example.").await;
    assert_eq!(refused.response_code(), ResponseCode::ServFail);
    assert!(
        !waiting.is_finished(),
        "the second query was answered while the first still waited"
    );
    assert_eq!(
        silent.udp_queries(),
        1,
        "the second query was not forwarded"
    );
    let first = waiting.await.expect("no panic");
    assert_eq!(first.response_code(), ResponseCode::ServFail, "timed out");
}

#[tokio::test]
async fn beyond_its_tcp_connections_the_cache_accepts_when_one_closes() {
    let upstream = FakeUpstream::start(Behaviour::answer(UPSTREAM_A, 60)).await;
    let limits = Limits {
        tcp_connections: 1,
        ..Limits::DEFAULT
    };
    let cache = Running::start_with(config(vec![upstream.address]), limits).await;
    let mut first = TcpStream::connect(cache.address).await.expect("connect");
    write_frame(&mut first, &query_bytes(1, "one.example.", false)).await;
    read_frame(&mut first)
        .await
        .expect("the first connection is served");

    // Connected by the kernel (the backlog), but not accepted: no answer while the first is open.
    let mut second = TcpStream::connect(cache.address).await.expect("connect");
    write_frame(&mut second, &query_bytes(2, "two.example.", false)).await;
    let early = tokio::time::timeout(Duration::from_millis(300), read_frame(&mut second)).await;
    assert!(early.is_err(), "answered beyond the bound: {early:?}");
    assert_eq!(upstream.udp_queries(), 1);

    drop(first);
    let reply = tokio::time::timeout(WAIT, read_frame(&mut second))
        .await
        .expect("served once the first closed")
        .expect("a reply");
    let reply = Message::from_vec(&reply).expect("a DNS message");
    assert_eq!(addresses(&reply), vec![UPSTREAM_A]);
}
