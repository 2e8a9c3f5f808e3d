//! Answering one query: REFUSED to a client outside `allow`; SERVFAIL at once beyond the bound
//! on queries in flight; the RFC 8482 answer to ANY; else the resolver of the query's zone
//! (hickory-resolver: its cache, else the upstreams), else a stale answer, else SERVFAIL. The
//! reply carries the client's ID and question (in the client's case), EDNS only if the client
//! used it, and fits what the client can take over UDP.
//!
//! ANY queries are not forwarded: they get one synthesized `HINFO "RFC8482" ""` record with TTL
//! 3600. RFC 8482 prefers that to NOTIMP, which some clients take for a broken server and retry
//! elsewhere; the answer is small (no amplification through the cache), and its TTL lets clients
//! cache it.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use hickory_proto::{
    ProtoErrorKind,
    op::{Edns, Header, Message, OpCode, ResponseCode},
    rr::{DNSClass, Name, RData, Record, RecordType, rdata::HINFO},
    xfer::Protocol,
};
use hickory_resolver::ResolveError;
use hickory_server::{
    authority::MessageResponseBuilder,
    server::{Request, RequestHandler, ResponseHandler, ResponseInfo},
};
use ipnet::IpNet;
use tokio::sync::Semaphore;

use crate::{
    config::{CacheConfig, allowed},
    stale::{Answer, StaleAnswers},
    upstream::Upstreams,
};

/// The TTL of the answer to ANY (RFC 8482 section 4.2 suggests 3600 seconds).
pub(crate) const ANY_TTL: u32 = 3600;
/// The UDP payload every client may receive (RFC 1035).
const MIN_UDP_PAYLOAD: u16 = 512;
/// The EDNS payload size we announce and the most we send over UDP (the DNS flag day 2020 value).
const EDNS_PAYLOAD: u16 = 1232;

/// The handler every listener shares.
#[derive(Clone, Debug)]
pub(crate) struct CacheHandler {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    allow: Vec<IpNet>,
    max_ttl: u32,
    upstreams: Upstreams,
    stale: Mutex<StaleAnswers>,
    /// A permit per query being answered.
    in_flight: Semaphore,
}

impl CacheHandler {
    /// A handler for `config`, answering at most `max_in_flight` queries at once.
    pub(crate) fn new(config: &CacheConfig, max_in_flight: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                allow: config.allow.clone(),
                max_ttl: u32::try_from(config.max_ttl.as_secs()).unwrap_or(u32::MAX),
                upstreams: Upstreams::new(config),
                stale: Mutex::new(StaleAnswers::new(config.stale_for, config.max_entries)),
                in_flight: Semaphore::new(max_in_flight),
            }),
        }
    }
}

/// What to send.
enum Reply {
    /// A code and no records (the question echoed).
    Error(ResponseCode),
    /// An answer.
    Answer(Answer),
}

#[async_trait::async_trait]
impl RequestHandler for CacheHandler {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &Request,
        response_handle: R,
    ) -> ResponseInfo {
        if !allowed(&self.inner.allow, request.src().ip()) {
            tracing::debug!(client = %request.src(), "a client outside allow: REFUSED");
            return refuse(request, response_handle).await;
        }
        let reply = match self.inner.in_flight.try_acquire() {
            Ok(_permit) => self.inner.resolve(request).await,
            Err(_) => {
                tracing::debug!(client = %request.src(), "too many queries in flight: SERVFAIL");
                Reply::Error(ResponseCode::ServFail)
            }
        };
        send(request, reply, response_handle).await
    }
}

impl Inner {
    async fn resolve(&self, request: &Request) -> Reply {
        if request.op_code() != OpCode::Query {
            return Reply::Error(ResponseCode::NotImp);
        }
        let [query] = request.queries() else {
            return Reply::Error(ResponseCode::FormErr);
        };
        let record_type = query.query_type();
        if matches!(record_type, RecordType::AXFR | RecordType::IXFR) {
            return Reply::Error(ResponseCode::NotImp);
        }
        let name = Name::from(query.name());
        let Some(resolver) = self.upstreams.route(&name) else {
            return Reply::Error(ResponseCode::Refused);
        };
        if record_type == RecordType::ANY {
            return Reply::Answer(any_answer(name, query.original().query_class()));
        }
        let key = (query.name().clone(), record_type);
        let fresh = match resolver.lookup(name, record_type).await {
            Ok(lookup) => Ok((
                Answer {
                    code: ResponseCode::NoError,
                    answers: lookup.records().to_vec(),
                    authority: Vec::new(),
                },
                lookup.valid_until(),
            )),
            Err(error) => negative(&error).ok_or(error),
        };
        match fresh {
            Ok((mut answer, expires)) => {
                self.stale()
                    .remember(key, answer.clone(), expires, Instant::now());
                // The resolver caps how long it keeps an answer, not the TTLs of the one it
                // just fetched.
                for record in answer.answers.iter_mut().chain(&mut answer.authority) {
                    record.set_ttl(record.ttl().min(self.max_ttl));
                }
                Reply::Answer(answer)
            }
            Err(error) => {
                let error = &error as &dyn std::error::Error;
                if let Some(stale) = self.stale().get(&key, Instant::now()) {
                    tracing::debug!(query = %query, error, "upstreams failed: answered stale");
                    Reply::Answer(stale)
                } else {
                    tracing::warn!(query = %query, error, "upstreams failed, nothing stale kept: SERVFAIL");
                    Reply::Error(ResponseCode::ServFail)
                }
            }
        }
    }

    fn stale(&self) -> std::sync::MutexGuard<'_, StaleAnswers> {
        // The store is consistent between its methods, which do not panic midway.
        self.stale.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A negative answer (NXDOMAIN, or NOERROR without data) that hickory-resolver reports as an
/// error, with when it expires; `None` for a failure. An upstream's SERVFAIL or REFUSED comes as
/// "no records" too, with that code: a failure, never an empty answer.
fn negative(error: &ResolveError) -> Option<(Answer, Instant)> {
    let ProtoErrorKind::NoRecordsFound {
        soa,
        negative_ttl,
        response_code,
        ..
    } = error.proto()?.kind()
    else {
        return None;
    };
    if !matches!(
        response_code,
        ResponseCode::NoError | ResponseCode::NXDomain
    ) {
        return None;
    }
    let ttl = negative_ttl.unwrap_or(0);
    Some((
        Answer {
            code: *response_code,
            answers: Vec::new(),
            authority: soa
                .iter()
                .map(|soa| soa.as_ref().clone().into_record_of_rdata())
                .collect(),
        },
        Instant::now() + Duration::from_secs(ttl.into()),
    ))
}

/// The RFC 8482 answer to ANY: one `HINFO "RFC8482" ""` record for the name asked.
fn any_answer(name: Name, class: DNSClass) -> Answer {
    let mut record = Record::from_rdata(
        name,
        ANY_TTL,
        RData::HINFO(HINFO::new("RFC8482".to_owned(), String::new())),
    );
    record.set_dns_class(class);
    Answer {
        code: ResponseCode::NoError,
        answers: vec![record],
        authority: Vec::new(),
    }
}

/// REFUSED with the question echoed and nothing else (no EDNS, RA clear): never larger than the
/// query, so a spoofed query cannot use the cache as an amplifier.
async fn refuse<R: ResponseHandler>(request: &Request, mut response_handle: R) -> ResponseInfo {
    let response = MessageResponseBuilder::from_message_request(request)
        .error_msg(request.header(), ResponseCode::Refused);
    response_handle
        .send_response(response)
        .await
        .unwrap_or_else(|error| unsent(request, &error))
}

/// Sends `reply` to the client of `request`.
async fn send<R: ResponseHandler>(
    request: &Request,
    reply: Reply,
    mut response_handle: R,
) -> ResponseInfo {
    let mut header = Header::response_from_request(request.header());
    header.set_recursion_available(true);
    let mut builder = MessageResponseBuilder::from_message_request(request);
    // EDNS only to a client that used it (RFC 6891). hickory-server sends a UDP response of at
    // most the response's EDNS payload size, and of up to 4096 bytes without EDNS: the response
    // announces what the client can take, and a client without EDNS is held to 512 below.
    if let Some(client) = request.edns() {
        let mut edns = Edns::new();
        edns.set_max_payload(client.max_payload().clamp(MIN_UDP_PAYLOAD, EDNS_PAYLOAD));
        builder.edns(edns);
    }
    let mut answer = match reply {
        Reply::Error(code) => {
            header.set_response_code(code);
            None
        }
        Reply::Answer(answer) => {
            header.set_response_code(answer.code);
            Some(answer)
        }
    };
    if answer
        .as_ref()
        .is_some_and(|answer| over_plain_udp_limit(request, &header, answer))
    {
        header.set_truncated(true);
        answer = None;
    }
    let result = match &answer {
        Some(answer) => {
            let response = builder.build(
                header,
                answer.answers.iter(),
                answer.authority.iter(),
                std::iter::empty(),
                std::iter::empty(),
            );
            response_handle.send_response(response).await
        }
        None => {
            response_handle
                .send_response(builder.build_no_records(header))
                .await
        }
    };
    result.unwrap_or_else(|error| unsent(request, &error))
}

/// True when `answer` goes over UDP to a client without EDNS and does not fit in 512 bytes: it
/// gets TC and no records then, and asks again over TCP.
fn over_plain_udp_limit(request: &Request, header: &Header, answer: &Answer) -> bool {
    if request.protocol() != Protocol::Udp || request.edns().is_some() {
        return false;
    }
    let mut message = Message::new();
    message
        .set_header(*header)
        .add_queries(
            request
                .queries()
                .iter()
                .map(|query| query.original().clone()),
        )
        .add_answers(answer.answers.iter().cloned())
        .add_name_servers(answer.authority.iter().cloned());
    message
        .to_vec()
        .map_or(true, |bytes| bytes.len() > usize::from(MIN_UDP_PAYLOAD))
}

/// The [`ResponseInfo`] of a reply that could not be sent (the client is gone, or the socket
/// failed): SERVFAIL, as hickory-server's own handlers report it.
fn unsent(request: &Request, error: &std::io::Error) -> ResponseInfo {
    tracing::debug!(client = %request.src(), %error, "the reply could not be sent");
    let mut header = Header::response_from_request(request.header());
    header.set_response_code(ResponseCode::ServFail);
    header.into()
}
