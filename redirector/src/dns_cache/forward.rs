//! Asking upstream servers: one question, the servers in order, each over UDP (a fresh connected
//! socket, so a closed port fails at once) and again over TCP when its reply is truncated.

use std::{
    fmt, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::atomic::{AtomicU16, Ordering},
    time::Duration,
};

use hickory_proto::{
    ProtoError,
    op::{Edns, Message, MessageType, Query, ResponseCode},
};
use tokio::net::{TcpStream, UdpSocket};

use super::framing::{read_frame, write_frame};
use crate::dns_query::recursive_query;

/// The UDP payload size advertised upstream (and to clients): the DNS flag day 2020 value, which
/// avoids IP fragmentation.
pub(crate) const EDNS_PAYLOAD: u16 = 1232;

/// Why no upstream gave an answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForwardError {
    /// There was no server to ask.
    #[error("no upstream server for this name; give default_servers or a [[zone]] that covers it")]
    NoServers,
    /// Every server was asked, and none answered. Each server is one attempt (over UDP, and
    /// over TCP too when the UDP reply was truncated).
    #[error(
        "{count} upstream attempt(s) failed ({servers}); check that they run and are reachable \
         from here, or raise upstream_timeout_ms if they time out; the cause is the last \
         failure",
        count = .earlier.len() + 1,
        servers = DisplayServers(.earlier, *.last_server),
    )]
    AllFailed {
        /// The servers asked before the last, in order, each with its failure.
        earlier: Vec<(SocketAddr, ExchangeError)>,
        /// The last server asked.
        last_server: SocketAddr,
        /// How it failed.
        #[source]
        last: ExchangeError,
    },
}

impl ForwardError {
    /// Every attempt in order: the server and how it failed.
    #[cfg(test)]
    pub(crate) fn attempts(&self) -> Vec<(SocketAddr, &ExchangeError)> {
        match self {
            Self::NoServers => Vec::new(),
            Self::AllFailed {
                earlier,
                last_server,
                last,
            } => earlier
                .iter()
                .map(|(server, error)| (*server, error))
                .chain([(*last_server, last)])
                .collect(),
        }
    }
}

/// "a, b and c".
struct DisplayServers<'a>(&'a [(SocketAddr, ExchangeError)], SocketAddr);

impl fmt::Display for DisplayServers<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, (server, _)) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{server}")?;
        }
        if !self.0.is_empty() {
            f.write_str(" and ")?;
        }
        write!(f, "{}", self.1)
    }
}

/// Why one exchange with one server failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    /// A socket error (a closed port shows as "connection refused").
    #[error("{transport} socket error")]
    Io {
        /// "UDP" or "TCP".
        transport: &'static str,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// No matching answer in time.
    #[error("{transport}: no answer within {timeout:?}")]
    Timeout {
        /// "UDP" or "TCP".
        transport: &'static str,
        /// The limit.
        timeout: Duration,
    },
    /// A TCP reply that is not a DNS message.
    #[error("TCP: the reply is not a DNS message; is this address a DNS server?")]
    Malformed {
        /// The decoder's complaint.
        #[source]
        source: ProtoError,
    },
    /// A TCP reply to another question.
    #[error("TCP: the reply does not answer the question")]
    Mismatch,
    /// The server answered with an error code.
    #[error("answered {code}")]
    ErrorCode {
        /// SERVFAIL, REFUSED, ...
        code: ResponseCode,
    },
    /// The query could not be encoded (a bug, or a name hickory cannot write).
    #[error("cannot encode the query (a bug: please report it with the name asked)")]
    Encode {
        /// The encoder's complaint.
        #[source]
        source: ProtoError,
    },
}

/// Asks `servers` in order for `query`, each given `timeout` per transport; returns the first
/// NOERROR or NXDOMAIN reply, else every failure.
pub(crate) async fn forward(
    servers: &[SocketAddr],
    query: &Query,
    timeout: Duration,
) -> Result<Message, ForwardError> {
    let mut earlier = Vec::new();
    let mut failed = None;
    for &server in servers {
        match exchange(server, query, timeout).await {
            Ok(reply) => return Ok(reply),
            Err(error) => {
                tracing::debug!(
                    %server,
                    error = &error as &dyn std::error::Error,
                    "upstream failed"
                );
                earlier.extend(failed.replace((server, error)));
            }
        }
    }
    match failed {
        None => Err(ForwardError::NoServers),
        Some((last_server, last)) => Err(ForwardError::AllFailed {
            earlier,
            last_server,
            last,
        }),
    }
}

/// One server: UDP, then TCP if the UDP reply is truncated.
async fn exchange(
    server: SocketAddr,
    query: &Query,
    timeout: Duration,
) -> Result<Message, ExchangeError> {
    let id = next_id();
    let request = upstream_request(id, query).map_err(|source| ExchangeError::Encode { source })?;
    let mut reply = tokio::time::timeout(timeout, udp_exchange(server, &request, id, query))
        .await
        .map_err(|_| ExchangeError::Timeout {
            transport: "UDP",
            timeout,
        })??;
    if reply.truncated() {
        reply = tokio::time::timeout(timeout, tcp_exchange(server, &request, id, query))
            .await
            .map_err(|_| ExchangeError::Timeout {
                transport: "TCP",
                timeout,
            })??;
    }
    match reply.response_code() {
        ResponseCode::NoError | ResponseCode::NXDomain => Ok(reply),
        code => Err(ExchangeError::ErrorCode { code }),
    }
}

/// The query sent upstream: our own ID, recursion desired, EDNS with our payload size, no DO bit.
fn upstream_request(id: u16, query: &Query) -> Result<Vec<u8>, ProtoError> {
    let mut edns = Edns::new();
    edns.set_max_payload(EDNS_PAYLOAD);
    recursive_query(id, query.clone()).set_edns(edns).to_vec()
}

async fn udp_exchange(
    server: SocketAddr,
    request: &[u8],
    id: u16,
    query: &Query,
) -> Result<Message, ExchangeError> {
    let io = |source| ExchangeError::Io {
        transport: "UDP",
        source,
    };
    let local = if server.is_ipv4() {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
    } else {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
    };
    let socket = UdpSocket::bind(local).await.map_err(io)?;
    socket.connect(server).await.map_err(io)?;
    socket.send(request).await.map_err(io)?;
    let mut buffer = vec![0; usize::from(u16::MAX)];
    loop {
        let length = socket.recv(&mut buffer).await.map_err(io)?;
        // Anything else (garbage, a late reply to another query) is ignored: the real answer may
        // still come, and the timeout bounds the wait.
        if let Ok(reply) = Message::from_vec(&buffer[..length])
            && answers(&reply, id, query)
        {
            return Ok(reply);
        }
    }
}

async fn tcp_exchange(
    server: SocketAddr,
    request: &[u8],
    id: u16,
    query: &Query,
) -> Result<Message, ExchangeError> {
    let io = |source| ExchangeError::Io {
        transport: "TCP",
        source,
    };
    let stream = TcpStream::connect(server).await.map_err(io)?;
    write_frame(&stream, request).await.map_err(io)?;
    let reply = read_frame(&stream)
        .await
        .map_err(io)?
        .ok_or_else(|| io(io::ErrorKind::UnexpectedEof.into()))?;
    let reply = Message::from_vec(&reply).map_err(|source| ExchangeError::Malformed { source })?;
    if answers(&reply, id, query) {
        Ok(reply)
    } else {
        Err(ExchangeError::Mismatch)
    }
}

/// True if `reply` is the response to our query `id` for `query`. A server may leave the question
/// out of an error reply (FORMERR, REFUSED, ...): that still counts, as the error it is.
fn answers(reply: &Message, id: u16, query: &Query) -> bool {
    if reply.id() != id || reply.message_type() != MessageType::Response {
        return false;
    }
    match reply.queries() {
        [] => reply.response_code() != ResponseCode::NoError,
        [question] => {
            question.query_type() == query.query_type()
                && question.query_class() == query.query_class()
                && question.name().to_lowercase() == query.name().to_lowercase()
        }
        _ => false,
    }
}

/// A query ID nobody can predict cheaply: a per-process random start (std's hasher keys are
/// random) plus a counter, hashed again. The fresh UDP source port of each exchange adds to it.
fn next_id() -> u16 {
    use std::hash::{BuildHasher as _, RandomState};
    static COUNTER: AtomicU16 = AtomicU16::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let hash = RandomState::new().hash_one(count).to_le_bytes();
    u16::from_le_bytes([hash[0], hash[1]])
}

#[cfg(test)]
mod tests {

    use hickory_proto::rr::{Name, RecordType};

    use super::*;

    fn query() -> Query {
        Query::query(
            Name::from_ascii("www.example.com.").expect("name"),
            RecordType::A,
        )
    }

    fn reply(id: u16, question: Option<Query>, code: ResponseCode) -> Message {
        let mut message = Message::new();
        message
            .set_id(id)
            .set_message_type(MessageType::Response)
            .set_response_code(code);
        if let Some(question) = question {
            message.add_query(question);
        }
        message
    }

    #[test]
    fn only_the_reply_to_our_question_counts() {
        let query = query();
        assert!(answers(
            &reply(9, Some(query.clone()), ResponseCode::NoError),
            9,
            &query
        ));
        let upper = Query::query(
            Name::from_ascii("WWW.example.COM.").expect("name"),
            RecordType::A,
        );
        assert!(
            answers(&reply(9, Some(upper), ResponseCode::NoError), 9, &query),
            "0x20 case changes are fine"
        );
        assert!(!answers(
            &reply(8, Some(query.clone()), ResponseCode::NoError),
            9,
            &query
        ));
        let aaaa = Query::query(query.name().clone(), RecordType::AAAA);
        assert!(!answers(
            &reply(9, Some(aaaa), ResponseCode::NoError),
            9,
            &query
        ));
        let other = Query::query(
            Name::from_ascii("evil.example.").expect("name"),
            RecordType::A,
        );
        assert!(!answers(
            &reply(9, Some(other), ResponseCode::NoError),
            9,
            &query
        ));
        assert!(answers(&reply(9, None, ResponseCode::FormErr), 9, &query));
        assert!(!answers(&reply(9, None, ResponseCode::NoError), 9, &query));
        let mut not_a_response = reply(9, Some(query.clone()), ResponseCode::NoError);
        not_a_response.set_message_type(MessageType::Query);
        assert!(!answers(&not_a_response, 9, &query));
    }

    #[test]
    fn the_upstream_query_asks_for_recursion_with_edns() {
        let encoded = upstream_request(42, &query()).expect("encodes");
        let decoded = Message::from_vec(&encoded).expect("decodes");
        assert_eq!(decoded.id(), 42);
        assert!(decoded.recursion_desired());
        assert_eq!(decoded.queries(), &[query()]);
        let edns = decoded.extensions().as_ref().expect("EDNS");
        assert_eq!(edns.max_payload(), EDNS_PAYLOAD);
        assert!(!edns.flags().dnssec_ok);
    }

    #[test]
    fn ids_vary() {
        let ids: std::collections::HashSet<u16> = (0..64).map(|_| next_id()).collect();
        assert!(ids.len() > 48, "{} distinct of 64", ids.len());
    }

    /// Every message in `error`'s chain, outermost first.
    fn chain(error: &dyn std::error::Error) -> Vec<String> {
        std::iter::successors(Some(error), |error| error.source())
            .map(ToString::to_string)
            .collect()
    }

    /// An address on 127.0.0.1 where nothing listens (UDP): bound, then released.
    async fn closed_port() -> SocketAddr {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind");
        socket.local_addr().expect("local address")
    }

    #[test]
    fn exchange_errors_do_not_repeat_their_cause() {
        let io = ExchangeError::Io {
            transport: "UDP",
            source: io::Error::new(io::ErrorKind::ConnectionRefused, "refused by the test"),
        };
        let malformed = ExchangeError::Malformed {
            source: Message::from_vec(&[1, 2, 3]).expect_err("not a message"),
        };
        let encode = ExchangeError::Encode {
            source: ProtoError::from("encoder says no"),
        };
        for error in [io, malformed, encode] {
            let messages = chain(&error);
            assert_eq!(messages.len(), 2, "{messages:?}");
            assert!(
                !messages[0].contains(&messages[1]),
                "the cause is not in the message: {messages:?}"
            );
        }
    }

    #[tokio::test]
    async fn all_attempts_are_kept_and_the_last_is_the_cause() {
        let (first, second) = (closed_port().await, closed_port().await);
        let timeout = Duration::from_secs(2);
        let error = tokio::time::timeout(
            Duration::from_secs(10),
            forward(&[first, second], &query(), timeout),
        )
        .await
        .expect("bounded")
        .expect_err("nothing listens");

        let attempts = error.attempts();
        assert_eq!(
            attempts
                .iter()
                .map(|(server, _)| *server)
                .collect::<Vec<_>>(),
            [first, second]
        );
        // A closed local UDP port answers with ICMP port unreachable at once.
        for (_, attempt) in &attempts {
            assert!(
                matches!(attempt, ExchangeError::Io { source, .. }
                    if source.kind() == io::ErrorKind::ConnectionRefused),
                "{attempt:?}"
            );
        }

        let messages = chain(&error);
        assert_eq!(messages.len(), 3, "{messages:?}");
        assert!(
            messages[0].starts_with(&format!(
                "2 upstream attempt(s) failed ({first} and {second});"
            )),
            "{messages:?}"
        );
        assert!(messages[0].contains("upstream_timeout_ms"), "{messages:?}");
        assert_eq!(messages[1], "UDP socket error");
        let os_message = &messages[2];
        assert_eq!(
            messages
                .iter()
                .filter(|m| m.contains(os_message.as_str()))
                .count(),
            1,
            "the OS error appears once: {messages:?}"
        );
        let source = std::error::Error::source(&error).expect("a source");
        assert!(
            std::ptr::eq(
                source as *const dyn std::error::Error as *const u8,
                attempts[1].1 as *const ExchangeError as *const u8
            ),
            "the source is the last attempt"
        );
    }

    #[tokio::test]
    async fn no_servers_is_its_own_error() {
        let error = forward(&[], &query(), Duration::from_millis(100))
            .await
            .expect_err("no server");
        assert!(matches!(error, ForwardError::NoServers));
        assert!(error.attempts().is_empty());
        assert!(error.to_string().contains("default_servers"), "{error}");
    }
}
