//! The real server on 127.0.0.1 (ephemeral ports) against fake upstreams spawned by each test.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, Query, ResponseCode},
    rr::{
        Name, RData, Record, RecordType,
        rdata::{A, SOA},
    },
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream, UdpSocket},
    sync::oneshot,
    task::JoinHandle,
};

use crate::{
    CacheConfig, CacheServer, DEFAULT_ALLOW, Zone, config::parse_network, handler::ANY_TTL, run,
    server::Limits, stale::STALE_TTL,
};

/// Bounds every wait on the network in these tests.
const WAIT: Duration = Duration::from_secs(5);
const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// What a fake upstream answers.
#[derive(Clone, Copy, Debug)]
struct Behaviour {
    /// The first A record's address; more records count up from it.
    address: Ipv4Addr,
    /// TTL of every record.
    ttl: u32,
    /// Number of A records.
    records: u16,
    /// NXDOMAIN with a SOA (minimum `ttl`) instead of records.
    nxdomain: bool,
    /// Over UDP, an empty reply with TC set.
    truncate_udp: bool,
    /// Never reply (over either transport).
    silent: bool,
    /// Reply with this code and nothing else (SERVFAIL, REFUSED, ...).
    failure: Option<ResponseCode>,
}

impl Behaviour {
    fn answer(address: Ipv4Addr, ttl: u32) -> Self {
        Self {
            address,
            ttl,
            records: 1,
            nxdomain: false,
            truncate_udp: false,
            silent: false,
            failure: None,
        }
    }
}

/// A DNS server on 127.0.0.1 (UDP and TCP, one port) that counts the queries it gets.
struct FakeUpstream {
    address: SocketAddr,
    udp_queries: Arc<AtomicUsize>,
    tcp_queries: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl FakeUpstream {
    async fn start(behaviour: Behaviour) -> Self {
        let (udp, tcp) = bind_udp_and_tcp().await;
        let address = udp.local_addr().expect("local address");
        let udp_queries = Arc::new(AtomicUsize::new(0));
        let tcp_queries = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(fake_serve(
            udp,
            tcp,
            behaviour,
            Arc::clone(&udp_queries),
            Arc::clone(&tcp_queries),
        ));
        Self {
            address,
            udp_queries,
            tcp_queries,
            task,
        }
    }

    fn udp_queries(&self) -> usize {
        self.udp_queries.load(Ordering::SeqCst)
    }

    fn tcp_queries(&self) -> usize {
        self.tcp_queries.load(Ordering::SeqCst)
    }

    /// Stops the server and waits until its sockets are closed.
    async fn stop(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn bind_udp_and_tcp() -> (UdpSocket, TcpListener) {
    for _ in 0..16 {
        let udp = UdpSocket::bind((LOOPBACK, 0)).await.expect("bind UDP");
        let port = udp.local_addr().expect("local address").port();
        if let Ok(tcp) = TcpListener::bind((LOOPBACK, port)).await {
            return (udp, tcp);
        }
    }
    panic!("no port free for both UDP and TCP on 127.0.0.1");
}

async fn fake_serve(
    udp: UdpSocket,
    tcp: TcpListener,
    behaviour: Behaviour,
    udp_queries: Arc<AtomicUsize>,
    tcp_queries: Arc<AtomicUsize>,
) {
    let tcp_loop = async {
        loop {
            let Ok((stream, _)) = tcp.accept().await else {
                continue;
            };
            let mut stream = stream;
            while let Some(request) = read_frame(&mut stream).await {
                tcp_queries.fetch_add(1, Ordering::SeqCst);
                if let Some(reply) = fake_reply(&request, behaviour, false) {
                    write_frame(&mut stream, &reply).await;
                }
            }
        }
    };
    let udp_loop = async {
        let mut buffer = vec![0; 65_535];
        loop {
            let Ok((length, client)) = udp.recv_from(&mut buffer).await else {
                continue;
            };
            udp_queries.fetch_add(1, Ordering::SeqCst);
            if let Some(reply) = fake_reply(&buffer[..length], behaviour, true) {
                let _ = udp.send_to(&reply, client).await;
            }
        }
    };
    tokio::join!(tcp_loop, udp_loop);
}

fn fake_reply(request: &[u8], behaviour: Behaviour, over_udp: bool) -> Option<Vec<u8>> {
    if behaviour.silent {
        return None;
    }
    let request = Message::from_vec(request).expect("the cache sends valid queries");
    let question = request.queries().first().expect("a question").clone();
    let mut reply = Message::new();
    reply
        .set_id(request.id())
        .set_message_type(MessageType::Response)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(request.recursion_desired())
        .set_recursion_available(true)
        .add_query(question.clone());
    if let Some(edns) = request.extensions() {
        reply.set_edns(edns.clone());
    }
    if let Some(code) = behaviour.failure {
        reply.set_response_code(code);
    } else if over_udp && behaviour.truncate_udp {
        reply.set_truncated(true);
    } else if behaviour.nxdomain {
        reply.set_response_code(ResponseCode::NXDomain);
        reply.add_name_server(Record::from_rdata(
            name("example."),
            behaviour.ttl,
            RData::SOA(SOA::new(
                name("ns.example."),
                name("hostmaster.example."),
                1,
                3600,
                600,
                86_400,
                behaviour.ttl,
            )),
        ));
    } else {
        let first = u32::from(behaviour.address);
        for index in 0..behaviour.records {
            reply.add_answer(Record::from_rdata(
                question.name().clone(),
                behaviour.ttl,
                RData::A(A(Ipv4Addr::from(first + u32::from(index)))),
            ));
        }
    }
    Some(reply.to_vec().expect("encode"))
}

fn name(text: &str) -> Name {
    Name::from_ascii(text).expect("a name")
}

/// Reads one DNS-over-TCP message (RFC 1035 section 4.2.2: a two-byte length first); `None` when
/// the peer closed the connection.
async fn read_frame(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let length = stream.read_u16().await.ok()?;
    let mut message = vec![0; usize::from(length)];
    stream.read_exact(&mut message).await.ok()?;
    Some(message)
}

/// Writes one DNS-over-TCP message.
async fn write_frame(stream: &mut TcpStream, message: &[u8]) {
    let length = u16::try_from(message.len()).expect("a DNS message fits in 64 KiB");
    let mut framed = length.to_be_bytes().to_vec();
    framed.extend_from_slice(message);
    stream.write_all(&framed).await.expect("send");
}

fn config(default_servers: Vec<SocketAddr>) -> CacheConfig {
    CacheConfig {
        listen: vec![SocketAddr::from((LOOPBACK, 0))],
        zones: Vec::new(),
        default_servers,
        max_ttl: Duration::from_secs(3600),
        max_negative_ttl: Duration::from_secs(300),
        stale_for: Duration::from_secs(30),
        max_entries: 1000,
        upstream_timeout: Duration::from_millis(500),
        allow: DEFAULT_ALLOW.to_vec(),
    }
}

/// The cache under test, serving until dropped.
struct Running {
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Running {
    async fn start(config: CacheConfig) -> Self {
        Self::start_with(config, Limits::DEFAULT).await
    }

    async fn start_with(config: CacheConfig, limits: Limits) -> Self {
        let server = CacheServer::bind_with(config, limits)
            .await
            .expect("bind the cache");
        let address = server.local_addrs()[0];
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(server.serve(async {
            let _ = stopped.await;
        }));
        Self {
            address,
            stop: Some(stop),
            task,
        }
    }
}

/// hickory-resolver's cache reads the real clock (it cannot be moved forward), so the tests
/// that watch answers age sleep, with TTLs of seconds.
async fn sleep(seconds: f64) {
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

fn query_bytes(id: u16, qname: &str, edns: bool) -> Vec<u8> {
    typed_query_bytes(id, qname, RecordType::A, edns)
}

fn typed_query_bytes(id: u16, qname: &str, record_type: RecordType, edns: bool) -> Vec<u8> {
    let mut message = Message::new();
    message
        .set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(name(qname), record_type));
    if edns {
        let mut options = Edns::new();
        options.set_max_payload(1232);
        message.set_edns(options);
    }
    message.to_vec().expect("encode")
}

async fn udp_ask_with(server: SocketAddr, id: u16, qname: &str, edns: bool) -> Message {
    let reply = udp_exchange(server, &query_bytes(id, qname, edns)).await;
    let reply = Message::from_vec(&reply).expect("a DNS message");
    assert_eq!(reply.id(), id, "the reply carries the query's ID");
    assert_eq!(reply.message_type(), MessageType::Response);
    reply
}

/// Sends `request` from a fresh socket on 127.0.0.1; returns the reply's bytes.
async fn udp_exchange(server: SocketAddr, request: &[u8]) -> Vec<u8> {
    let socket = UdpSocket::bind((LOOPBACK, 0)).await.expect("bind");
    socket.send_to(request, server).await.expect("send");
    let mut buffer = vec![0; 65_535];
    let (length, from) = tokio::time::timeout(WAIT, socket.recv_from(&mut buffer))
        .await
        .expect("an answer in time")
        .expect("receive");
    assert_eq!(from, server);
    buffer.truncate(length);
    buffer
}

/// Sends `request` over a fresh TCP connection; returns the reply's bytes.
async fn tcp_exchange(server: SocketAddr, request: &[u8]) -> Vec<u8> {
    let exchange = async {
        let mut stream = TcpStream::connect(server).await.expect("connect");
        write_frame(&mut stream, request).await;
        read_frame(&mut stream).await.expect("a reply")
    };
    tokio::time::timeout(WAIT, exchange)
        .await
        .expect("an answer in time")
}

async fn udp_ask(server: SocketAddr, id: u16, qname: &str) -> Message {
    udp_ask_with(server, id, qname, true).await
}

async fn tcp_ask(server: SocketAddr, id: u16, qname: &str) -> Message {
    let reply = tcp_exchange(server, &query_bytes(id, qname, false)).await;
    let reply = Message::from_vec(&reply).expect("a DNS message");
    assert_eq!(reply.id(), id, "the reply carries the query's ID");
    reply
}

fn addresses(reply: &Message) -> Vec<Ipv4Addr> {
    reply
        .answers()
        .iter()
        .filter_map(|record| match record.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

fn ttls(reply: &Message) -> Vec<u32> {
    reply.all_sections().map(Record::ttl).collect()
}

const UPSTREAM_A: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const UPSTREAM_B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

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
