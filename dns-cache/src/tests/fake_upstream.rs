//! A fake upstream on 127.0.0.1: a DNS server (UDP and TCP, one port) that answers as a test
//! tells it and counts the queries it gets.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use hickory_proto::{
    op::{Message, MessageType, OpCode, ResponseCode},
    rr::{
        RData, Record,
        rdata::{A, SOA},
    },
};
use tokio::{
    net::{TcpListener, UdpSocket},
    task::JoinHandle,
};

use super::{
    LOOPBACK,
    wire::{name, read_frame, write_frame},
};

/// What a fake upstream answers.
#[derive(Clone, Copy, Debug)]
pub(super) struct Behaviour {
    /// The first A record's address; more records count up from it.
    pub(super) address: Ipv4Addr,
    /// TTL of every record.
    pub(super) ttl: u32,
    /// Number of A records.
    pub(super) records: u16,
    /// NXDOMAIN with a SOA (minimum `ttl`) instead of records.
    pub(super) nxdomain: bool,
    /// Over UDP, an empty reply with TC set.
    pub(super) truncate_udp: bool,
    /// Never reply (over either transport).
    pub(super) silent: bool,
    /// Reply with this code and nothing else (SERVFAIL, REFUSED, ...).
    pub(super) failure: Option<ResponseCode>,
}

impl Behaviour {
    pub(super) fn answer(address: Ipv4Addr, ttl: u32) -> Self {
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
pub(super) struct FakeUpstream {
    pub(super) address: SocketAddr,
    udp_queries: Arc<AtomicUsize>,
    tcp_queries: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl FakeUpstream {
    pub(super) async fn start(behaviour: Behaviour) -> Self {
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

    pub(super) fn udp_queries(&self) -> usize {
        self.udp_queries.load(Ordering::SeqCst)
    }

    pub(super) fn tcp_queries(&self) -> usize {
        self.tcp_queries.load(Ordering::SeqCst)
    }

    /// Stops the server and waits until its sockets are closed.
    pub(super) async fn stop(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(super) async fn bind_udp_and_tcp() -> (UdpSocket, TcpListener) {
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
