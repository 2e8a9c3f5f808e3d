//! Answering one query: REFUSED to a client outside `allow`; else from the cache, else from the
//! upstreams (caching the reply), else a stale answer, else SERVFAIL; then the reply is shaped for
//! the client (its ID, its question's case, EDNS only if it asked with EDNS, truncated to what it
//! can take over UDP).
//!
//! ANY queries are not forwarded: they get the RFC 8482 answer, one synthesized
//! `HINFO "RFC8482" ""` record with TTL 3600. RFC 8482 prefers that to NOTIMP, which some clients
//! take for a broken server and retry elsewhere; the answer is small (no amplification through
//! the cache), and its TTL lets clients cache it.

use std::{
    net::IpAddr,
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, Query, ResponseCode},
    rr::{RData, Record, RecordType, rdata::HINFO},
};

use super::{
    cache::{Cache, CacheKey, CachePolicy},
    config::CacheConfig,
    forward::{EDNS_PAYLOAD, forward},
};

/// The UDP payload every client may receive (RFC 1035).
const MIN_UDP_PAYLOAD: u16 = 512;
/// The TTL of the answer to ANY (RFC 8482 section 4.2 suggests 3600 seconds).
pub(crate) const ANY_TTL: u32 = 3600;
/// The QR bit of a DNS header's third byte: set in responses.
const QR_BIT: u8 = 0x80;

/// How the query came, which bounds the reply's size.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Transport {
    /// UDP: 512 bytes, or the client's EDNS payload size up to ours.
    Udp,
    /// TCP: up to 65535 bytes.
    Tcp,
}

/// The time the cache sees: the monotonic clock, plus an offset tests move forward.
#[derive(Debug, Default)]
pub(crate) struct Clock {
    offset_millis: AtomicU64,
}

impl Clock {
    /// Now.
    pub(crate) fn now(&self) -> Instant {
        Instant::now() + Duration::from_millis(self.offset_millis.load(Ordering::Relaxed))
    }

    /// Moves the cache's time forward by `by`.
    #[cfg(test)]
    pub(crate) fn advance(&self, by: Duration) {
        let millis = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.offset_millis.fetch_add(millis, Ordering::Relaxed);
    }
}

/// Everything the listeners share: the configuration, the cache and its clock.
#[derive(Debug)]
pub(crate) struct Resolver {
    config: CacheConfig,
    cache: Mutex<Cache>,
    /// The cache's time.
    pub(crate) clock: Clock,
}

impl Resolver {
    /// A resolver with an empty cache.
    pub(crate) fn new(config: CacheConfig) -> Self {
        let cache = Cache::new(CachePolicy {
            max_ttl: config.max_ttl,
            max_negative_ttl: config.max_negative_ttl,
            stale_for: config.stale_for,
            max_entries: config.max_entries,
            max_bytes: config.max_bytes,
        });
        Self {
            config,
            cache: Mutex::new(cache),
            clock: Clock::default(),
        }
    }

    /// The reply to the wire-format `request` from `client`, or `None` when it deserves none (it
    /// is itself a response, or too short to carry an ID).
    pub(crate) async fn answer(
        &self,
        request: &[u8],
        transport: Transport,
        client: IpAddr,
    ) -> Option<Vec<u8>> {
        if !self.config.allow.iter().any(|cidr| cidr.contains(client)) {
            tracing::debug!(%client, "a client outside allow: REFUSED");
            return refused(request);
        }
        let Ok(request) = Message::from_vec(request) else {
            return format_error(request);
        };
        if request.message_type() != MessageType::Query {
            return None;
        }
        let reply = self.resolve(&request).await;
        encode(&request, reply, transport)
    }

    async fn resolve(&self, request: &Message) -> Message {
        if request.op_code() != OpCode::Query {
            return error_reply(ResponseCode::NotImp);
        }
        let [query] = request.queries() else {
            return error_reply(ResponseCode::FormErr);
        };
        if matches!(query.query_type(), RecordType::AXFR | RecordType::IXFR) {
            return error_reply(ResponseCode::NotImp);
        }
        if query.query_type() == RecordType::ANY {
            if self.config.upstreams_for(query.name()).is_empty() {
                return error_reply(ResponseCode::Refused);
            }
            return any_reply(query);
        }
        let key = CacheKey::new(query);
        if let Some(cached) = self.cache().get(&key, self.clock.now()) {
            tracing::trace!(%query, "answered from the cache");
            return cached;
        }
        let servers = self.config.upstreams_for(query.name());
        if servers.is_empty() {
            return error_reply(ResponseCode::Refused);
        }
        match forward(servers, query, self.config.upstream_timeout).await {
            Ok(reply) => {
                let lifetime = self.cache().insert(key, &reply, self.clock.now());
                tracing::trace!(%query, ?lifetime, "answered by an upstream");
                reply
            }
            Err(error) => {
                let error = &error as &dyn std::error::Error;
                if let Some(stale) = self.cache().get_stale(&key, self.clock.now()) {
                    tracing::debug!(%query, error, "upstreams failed: answered stale");
                    stale
                } else {
                    tracing::warn!(%query, error, "upstreams failed, nothing stale cached: SERVFAIL");
                    error_reply(ResponseCode::ServFail)
                }
            }
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        // The cache is consistent between its methods, which do not panic midway.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A reply with `code` and nothing else.
fn error_reply(code: ResponseCode) -> Message {
    let mut reply = Message::new();
    reply
        .set_message_type(MessageType::Response)
        .set_response_code(code);
    reply
}

/// The RFC 8482 answer to ANY: one `HINFO "RFC8482" ""` record for the name asked.
fn any_reply(query: &Query) -> Message {
    let mut record = Record::from_rdata(
        query.name().clone(),
        ANY_TTL,
        RData::HINFO(HINFO::new("RFC8482".to_owned(), String::new())),
    );
    record.set_dns_class(query.query_class());
    let mut reply = error_reply(ResponseCode::NoError);
    reply.add_answer(record);
    reply
}

/// REFUSED for a client outside `allow`, never larger than its request, so that a spoofed query
/// cannot use the cache as an amplifier: the question echoed if the request decodes and the reply
/// fits, else the header alone. `None` for what deserves no reply (as [`format_error`]).
fn refused(request: &[u8]) -> Option<Vec<u8>> {
    if request.len() < 12 || request[2] & QR_BIT != 0 {
        return None;
    }
    if let Ok(query) = Message::from_vec(request)
        && query.queries().len() <= 1
    {
        let mut reply = error_reply(ResponseCode::Refused);
        reply
            .set_id(query.id())
            .set_op_code(query.op_code())
            .set_recursion_desired(query.recursion_desired())
            .add_queries(query.queries().to_vec());
        if let Ok(bytes) = reply.to_vec()
            && bytes.len() <= request.len()
        {
            return Some(bytes);
        }
    }
    // The header: the ID, QR set, the opcode and RD kept, RCODE 5 (REFUSED), every count 0.
    let mut reply = request[..12].to_vec();
    reply[2] = QR_BIT | (request[2] & 0x79);
    reply[3] = ResponseCode::Refused.low();
    reply[4..].fill(0);
    Some(reply)
}

/// FORMERR for a request hickory cannot decode, if it has a header and is not itself a response
/// (never answer a response: two servers could bounce errors forever).
fn format_error(request: &[u8]) -> Option<Vec<u8>> {
    if request.len() < 12 || request[2] & QR_BIT != 0 {
        return None;
    }
    let mut reply = error_reply(ResponseCode::FormErr);
    reply.set_id(u16::from_be_bytes([request[0], request[1]]));
    reply.to_vec().ok()
}

/// `reply` (cached, upstream's or an error) as the answer to the client's `request`; `None` only
/// if not even SERVFAIL can be encoded.
fn encode(request: &Message, mut reply: Message, transport: Transport) -> Option<Vec<u8>> {
    reply
        .set_id(request.id())
        .set_message_type(MessageType::Response)
        .set_op_code(request.op_code())
        .set_authoritative(false)
        .set_truncated(false)
        .set_recursion_desired(request.recursion_desired())
        .set_recursion_available(true)
        .set_authentic_data(false)
        .set_checking_disabled(request.checking_disabled());
    // The client's question, in the client's case (resolvers using 0x20 check it).
    *reply.queries_mut() = request.queries().to_vec();
    // EDNS only to a client that used it (RFC 6891), with our own options, not the upstream's.
    *reply.extensions_mut() = request.extensions().as_ref().map(|_| {
        let mut edns = Edns::new();
        edns.set_max_payload(EDNS_PAYLOAD);
        edns
    });
    let limit = match transport {
        Transport::Tcp => usize::from(u16::MAX),
        Transport::Udp => usize::from(
            request
                .extensions()
                .as_ref()
                .map_or(MIN_UDP_PAYLOAD, |edns| {
                    edns.max_payload().clamp(MIN_UDP_PAYLOAD, EDNS_PAYLOAD)
                }),
        ),
    };
    match reply.to_vec() {
        Ok(bytes) if bytes.len() <= limit => Some(bytes),
        Ok(_) => reply.truncate().to_vec().ok(),
        Err(error) => {
            tracing::warn!(%error, "cannot encode a reply; SERVFAIL instead");
            let mut failure = error_reply(ResponseCode::ServFail);
            failure
                .set_id(request.id())
                .set_recursion_desired(request.recursion_desired())
                .set_recursion_available(true)
                .add_queries(request.queries().to_vec());
            failure.to_vec().ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use hickory_proto::rr::Name;

    use super::*;

    fn query(edns: bool) -> Vec<u8> {
        let mut message = Message::new();
        message
            .set_id(0x1234)
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(true)
            .add_query(Query::query(
                Name::from_ascii("www.example.com.").expect("name"),
                RecordType::A,
            ));
        if edns {
            message.set_edns(Edns::new());
        }
        message.to_vec().expect("encode")
    }

    #[test]
    fn refused_is_never_larger_than_the_query() {
        for edns in [false, true] {
            let request = query(edns);
            let reply = refused(&request).expect("a reply");
            assert!(
                reply.len() <= request.len(),
                "{} > {}",
                reply.len(),
                request.len()
            );
            let reply = Message::from_vec(&reply).expect("decodes");
            assert_eq!(reply.id(), 0x1234);
            assert_eq!(reply.message_type(), MessageType::Response);
            assert_eq!(reply.response_code(), ResponseCode::Refused);
            assert!(reply.recursion_desired());
            assert_eq!(reply.queries().len(), 1);
            assert!(reply.extensions().is_none());
        }
    }

    #[test]
    fn refused_falls_back_to_the_header() {
        // Two questions announced, none there: does not decode.
        let mut request = query(false)[..12].to_vec();
        request[5] = 2;
        let reply = refused(&request).expect("a reply");
        assert_eq!(reply, [0x12, 0x34, 0x81, 0x05, 0, 0, 0, 0, 0, 0, 0, 0]);
        // A NOTIFY (opcode 4) keeps its opcode.
        request[2] = 4 << 3;
        assert_eq!(refused(&request).expect("a reply")[2], 0x80 | (4 << 3));
    }

    #[test]
    fn refused_ignores_responses_and_scraps() {
        let mut response = query(false);
        response[2] |= QR_BIT;
        assert_eq!(refused(&response), None);
        assert_eq!(refused(&[0x12, 0x34, 0x01]), None);
    }
}
