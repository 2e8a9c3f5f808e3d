//! DNS on the wire, for both ends: queries built and replies taken apart, TCP's framing (RFC 1035
//! section 4.2.2), and the exchanges a client makes with the cache over UDP and TCP.

use std::net::{Ipv4Addr, SocketAddr};

use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, Query},
    rr::{Name, RData, Record, RecordType},
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpStream, UdpSocket},
};

use super::{LOOPBACK, WAIT};

pub(super) fn name(text: &str) -> Name {
    Name::from_ascii(text).expect("a name")
}

/// Reads one DNS-over-TCP message (RFC 1035 section 4.2.2: a two-byte length first); `None` when
/// the peer closed the connection.
pub(super) async fn read_frame(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let length = stream.read_u16().await.ok()?;
    let mut message = vec![0; usize::from(length)];
    stream.read_exact(&mut message).await.ok()?;
    Some(message)
}

/// Writes one DNS-over-TCP message.
pub(super) async fn write_frame(stream: &mut TcpStream, message: &[u8]) {
    let length = u16::try_from(message.len()).expect("a DNS message fits in 64 KiB");
    let mut framed = length.to_be_bytes().to_vec();
    framed.extend_from_slice(message);
    stream.write_all(&framed).await.expect("send");
}

pub(super) fn query_bytes(id: u16, qname: &str, edns: bool) -> Vec<u8> {
    typed_query_bytes(id, qname, RecordType::A, edns)
}

pub(super) fn typed_query_bytes(
    id: u16,
    qname: &str,
    record_type: RecordType,
    edns: bool,
) -> Vec<u8> {
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

pub(super) async fn udp_ask_with(server: SocketAddr, id: u16, qname: &str, edns: bool) -> Message {
    let reply = udp_exchange(server, &query_bytes(id, qname, edns)).await;
    let reply = Message::from_vec(&reply).expect("a DNS message");
    assert_eq!(reply.id(), id, "the reply carries the query's ID");
    assert_eq!(reply.message_type(), MessageType::Response);
    reply
}

/// Sends `request` from a fresh socket on 127.0.0.1; returns the reply's bytes.
pub(super) async fn udp_exchange(server: SocketAddr, request: &[u8]) -> Vec<u8> {
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
pub(super) async fn tcp_exchange(server: SocketAddr, request: &[u8]) -> Vec<u8> {
    let exchange = async {
        let mut stream = TcpStream::connect(server).await.expect("connect");
        write_frame(&mut stream, request).await;
        read_frame(&mut stream).await.expect("a reply")
    };
    tokio::time::timeout(WAIT, exchange)
        .await
        .expect("an answer in time")
}

pub(super) async fn udp_ask(server: SocketAddr, id: u16, qname: &str) -> Message {
    udp_ask_with(server, id, qname, true).await
}

pub(super) async fn tcp_ask(server: SocketAddr, id: u16, qname: &str) -> Message {
    let reply = tcp_exchange(server, &query_bytes(id, qname, false)).await;
    let reply = Message::from_vec(&reply).expect("a DNS message");
    assert_eq!(reply.id(), id, "the reply carries the query's ID");
    reply
}

pub(super) fn addresses(reply: &Message) -> Vec<Ipv4Addr> {
    reply
        .answers()
        .iter()
        .filter_map(|record| match record.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

pub(super) fn ttls(reply: &Message) -> Vec<u32> {
    reply.all_sections().map(Record::ttl).collect()
}
