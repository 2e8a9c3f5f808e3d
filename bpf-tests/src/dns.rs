//! DNS messages for the test servers and clients (hickory-proto does the wire format).

use std::{
    io::{self, Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::{Context as _, bail};
use hickory_proto::{
    op::{Message, MessageType, OpCode, Query, ResponseCode},
    rr::{
        Name, RData, Record, RecordType,
        rdata::{A, AAAA},
    },
};
use serde::{Deserialize, Serialize};

/// The name the test clients ask for; the test servers answer any name.
pub const PROBE_NAME: &str = "probe.redirector.test.";

/// What a test server answers: an address that says which server it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The A record it returns.
    pub a: Ipv4Addr,
    /// The AAAA record it returns.
    pub aaaa: Ipv6Addr,
}

/// A query for `name` of type `record_type` with recursion desired.
pub fn query(id: u16, name: &str, record_type: RecordType) -> anyhow::Result<Vec<u8>> {
    redirector::dns_query::recursive_query(
        id,
        Query::query(
            Name::from_ascii(name).with_context(|| format!("{name:?} is not a DNS name"))?,
            record_type,
        ),
    )
    .to_vec()
    .context("encoding the query")
}

/// The answer of a server with `identity` to `request`: A and AAAA questions get the identity's
/// address (TTL 0, so nothing caches it), anything else an empty NOERROR.
pub fn answer(request: &[u8], identity: &Identity) -> anyhow::Result<Vec<u8>> {
    answer_with(request, identity, ResponseCode::NoError)
}

/// The response to `request` with `code`: `identity`'s addresses for NOERROR, no records for any
/// other code (a SERVFAIL or REFUSED as a cache sends it).
pub fn answer_with(
    request: &[u8],
    identity: &Identity,
    code: ResponseCode,
) -> anyhow::Result<Vec<u8>> {
    let request = Message::from_vec(request).context("decoding the query")?;
    let mut response = Message::new();
    response
        .set_id(request.id())
        .set_message_type(MessageType::Response)
        .set_op_code(OpCode::Query)
        .set_authoritative(true)
        .set_recursion_desired(request.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code);
    for question in request.queries() {
        response.add_query(question.clone());
        if code != ResponseCode::NoError {
            continue;
        }
        let rdata = match question.query_type() {
            RecordType::A => Some(RData::A(A(identity.a))),
            RecordType::AAAA => Some(RData::AAAA(AAAA(identity.aaaa))),
            _ => None,
        };
        if let Some(rdata) = rdata {
            response.add_answer(Record::from_rdata(question.name().clone(), 0, rdata));
        }
    }
    response.to_vec().context("encoding the answer")
}

/// The addresses in a response to query `id`.
pub fn parse_answer(id: u16, response: &[u8]) -> anyhow::Result<(ResponseCode, Vec<IpAddr>)> {
    let message = Message::from_vec(response).context("decoding the response")?;
    if message.id() != id {
        bail!("response id {} does not match query id {id}", message.id());
    }
    let addresses = message
        .answers()
        .iter()
        .filter_map(|record| match record.data() {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            RData::AAAA(aaaa) => Some(IpAddr::V6(aaaa.0)),
            _ => None,
        })
        .collect();
    Ok((message.response_code(), addresses))
}

/// What one `dns-query` run saw, printed by it as one JSON line.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryOutcome {
    /// The query was answered.
    pub ok: bool,
    /// The addresses in the answer.
    pub answers: Vec<IpAddr>,
    /// The response code, when answered.
    pub rcode: Option<String>,
    /// Where the reply came from as the socket reported it (`recvfrom`, unconnected UDP).
    pub reply_from: Option<String>,
    /// The connected peer as `getpeername` reported it (connected UDP, TCP).
    pub peer: Option<String>,
    /// What failed, when not answered.
    pub error: Option<String>,
    /// The errno of the failed syscall, when there was one.
    pub errno: Option<i32>,
    /// `--hold --reopen`: the errno of the send that failed on the held socket, after which the
    /// client opened a new socket and asked again (this outcome is the second attempt's).
    #[serde(default)]
    pub reopened_after_errno: Option<i32>,
}

impl QueryOutcome {
    /// The first answer, for assertions on who answered.
    #[must_use]
    pub fn answer(&self) -> Option<IpAddr> {
        self.answers.first().copied()
    }
}

/// One query of a `dns-stream` run, printed by it as one JSON line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamRecord {
    /// The query's number among its socket kind's, from 0.
    #[serde(default)]
    pub seq: u64,
    /// When the query began (before its socket was opened or its send called), milliseconds
    /// since the Unix epoch: its destination was chosen after this.
    pub begun_ms: u64,
    /// When its send returned: its destination was chosen before this (at connect, or at the
    /// long-lived socket's sendto).
    pub steered_ms: u64,
    /// When it was answered or failed.
    #[serde(default)]
    pub done_ms: u64,
    /// `fresh` (a new connected socket per query, as glibc does), `long` (one long-lived
    /// unconnected socket) or `connected` (one long-lived connected socket).
    pub kind: String,
    /// The first address answered, when answered.
    pub answer: Option<IpAddr>,
    /// What failed, when not answered.
    pub error: Option<String>,
    /// `connected`: the send on the long-lived socket failed, and the query was asked again at
    /// once from a new socket (as c-ares does); this record is the second attempt's.
    #[serde(default)]
    pub reopened: bool,
}

/// Writes one DNS-over-TCP message: its length in two bytes, network order, then the message
/// (RFC 1035 section 4.2.2), in one write.
pub fn write_tcp_message(stream: &mut impl Write, message: &[u8]) -> anyhow::Result<()> {
    let length =
        u16::try_from(message.len()).context("a DNS message over TCP is at most 64 KiB")?;
    let mut framed = Vec::with_capacity(2 + message.len());
    framed.extend_from_slice(&length.to_be_bytes());
    framed.extend_from_slice(message);
    stream
        .write_all(&framed)
        .context("sending a DNS message over TCP")
}

/// Reads one DNS-over-TCP message; `None` when the peer closed the connection before the next.
pub fn read_tcp_message(stream: &mut impl Read) -> anyhow::Result<Option<Vec<u8>>> {
    let mut length = [0u8; 2];
    match stream.read_exact(&mut length) {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error).context("receiving a DNS message's length over TCP"),
    }
    let mut message = vec![0u8; usize::from(u16::from_be_bytes(length))];
    stream
        .read_exact(&mut message)
        .context("receiving a DNS message over TCP")?;
    Ok(Some(message))
}

/// Milliseconds since the Unix epoch (the stream's and the tests' shared clock).
#[must_use]
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// `clock`, ns.
fn clock_ns(clock: nix::time::ClockId) -> anyhow::Result<u64> {
    let now = nix::time::clock_gettime(clock)?;
    Ok(u64::try_from(now.tv_sec())? * 1_000_000_000 + u64::try_from(now.tv_nsec())?)
}

/// `CLOCK_MONOTONIC_COARSE`, ns: the clock of the activity stamps (a stall's flip).
pub fn coarse_ns() -> anyhow::Result<u64> {
    clock_ns(nix::time::ClockId::CLOCK_MONOTONIC_COARSE)
}

/// The wall-clock time, in milliseconds since the epoch, of `monotonic_ns` on CLOCK_MONOTONIC
/// (what `bpf_ktime_get_ns` reads: a signal's flip), by the two clocks' offset now.
pub fn wall_ms_of_monotonic(monotonic_ns: u64) -> anyhow::Result<u64> {
    let now = clock_ns(nix::time::ClockId::CLOCK_MONOTONIC)?;
    Ok((now_ms() * 1_000_000).saturating_sub(now.saturating_sub(monotonic_ns)) / 1_000_000)
}
