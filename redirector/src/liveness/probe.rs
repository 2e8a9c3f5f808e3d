//! Health probes: a real DNS query to the cache, from the cache's network namespace. A probe
//! asks whether the cache *serves*, not whether the name resolves:
//!
//! | answer | verdict | why |
//! |---|---|---|
//! | NOERROR, NXDOMAIN | alive | the cache resolved the name, or knows it does not exist |
//! | SERVFAIL | alive (counted apart) | the cache serves but cannot resolve: its upstreams fail. Failing over would send every client to those same upstreams, without the cache's stale answers (RFC 8767) or its caching |
//! | REFUSED | failed | the cache declines to serve (access control, not ready): clients would be refused too |
//! | any other code (FORMERR, NOTIMP, ...) | failed | a cache that cannot answer a plain A query does not serve |
//! | timeout, ICMP unreachable, socket error | failed | nothing serves |

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::{Duration, Instant},
};

use hickory_proto::{
    op::{Message, MessageType, Query, ResponseCode},
    rr::{Name, RecordType},
};

use crate::{dns_query::recursive_query, sys::netns::NetnsWorker};

/// What one probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// The cache answered (NOERROR, NXDOMAIN or SERVFAIL) after this long.
    Alive {
        /// Time to the answer.
        latency: Duration,
        /// It answered SERVFAIL: it serves, but its own upstreams fail.
        servfail: bool,
    },
    /// The cache did not serve.
    Failed {
        /// Why: "timeout", "refused", "SERVFAIL", ...
        reason: String,
    },
}

impl ProbeOutcome {
    /// True for `Alive`.
    #[must_use]
    pub fn is_alive(&self) -> bool {
        matches!(self, Self::Alive { .. })
    }
}

/// `redirector probe`'s request on the agent's drain socket: probe listener `probe`'s cache now,
/// from the agent (whose sockets the programs never steer), and say what answered. A request of
/// its own shape, so that an agent of a release without it refuses it as no drain request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    /// The listener's name.
    pub probe: String,
}

/// What an asked-for probe found, for people: whether the cache served, and the answer's source.
#[must_use]
pub fn describe(listener: &str, target: SocketAddr, outcome: &ProbeOutcome) -> String {
    let asked = "asked from the agent, whose sockets the programs never steer: this is the \
                 cache's own answer, whatever the listener's route";
    match outcome {
        ProbeOutcome::Alive {
            latency,
            servfail: false,
        } => format!(
            "the cache of listener {listener} at {target} serves: it answered in {:.1} ms ({asked})",
            latency.as_secs_f64() * 1000.0
        ),
        ProbeOutcome::Alive {
            latency,
            servfail: true,
        } => format!(
            "the cache of listener {listener} at {target} serves but answered SERVFAIL in {:.1} ms: \
             its own upstreams fail ({asked})",
            latency.as_secs_f64() * 1000.0
        ),
        ProbeOutcome::Failed { reason } => format!(
            "the cache of listener {listener} at {target} does not serve: {reason} ({asked})"
        ),
    }
}

/// Probes one cache.
#[derive(Clone, Debug)]
pub struct Prober {
    target: SocketAddr,
    query_name: Name,
    timeout: Duration,
    netns: NetnsWorker,
}

impl Prober {
    /// A prober of `target`, asking for `name` (A), waiting `timeout`, from the network namespace
    /// of `netns`.
    pub fn new(
        target: SocketAddr,
        name: &str,
        timeout: Duration,
        netns: NetnsWorker,
    ) -> Result<Self, hickory_proto::ProtoError> {
        Ok(Self {
            target,
            query_name: Name::from_ascii(name)?,
            timeout,
            netns,
        })
    }

    /// The probed cache.
    #[must_use]
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// A prober of another server (an upstream target) asking the same name from the same
    /// namespace, waiting `timeout` for each answer (an upstream's own, not the cache's: see
    /// `liveness::upstreams`).
    #[must_use]
    pub fn of(&self, target: SocketAddr, timeout: Duration) -> Self {
        Self {
            target,
            timeout,
            ..self.clone()
        }
    }

    /// Sends one query and judges the answer.
    pub async fn probe(&self) -> ProbeOutcome {
        match self.exchange().await {
            Err(reason) => ProbeOutcome::Failed { reason },
            Ok((code, latency))
                if code == ResponseCode::NoError
                    || code == ResponseCode::NXDomain
                    || code == ResponseCode::ServFail =>
            {
                ProbeOutcome::Alive {
                    latency,
                    servfail: code == ResponseCode::ServFail,
                }
            }
            Ok((code, _)) => ProbeOutcome::Failed {
                reason: code.to_string(),
            },
        }
    }

    /// Sends one query: the response's code and the time to it, whatever the code; why there was
    /// none within the timeout ("timeout", "refused (nothing listens)", a socket error).
    pub async fn exchange(&self) -> Result<(ResponseCode, Duration), String> {
        let started = Instant::now();
        match tokio::time::timeout(self.timeout, self.ask()).await {
            Err(_) => Err("timeout".to_owned()),
            Ok(Err(reason)) => Err(reason),
            Ok(Ok(code)) => Ok((code, started.elapsed())),
        }
    }

    async fn ask(&self) -> Result<ResponseCode, String> {
        let id: u16 = rand_id();
        let request = recursive_query(id, Query::query(self.query_name.clone(), RecordType::A))
            .to_vec()
            .map_err(|error| error.to_string())?;

        let local = if self.target.is_ipv4() {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
        } else {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
        };
        let target = self.target;
        // A fresh socket per probe, created in the caches' namespace, connected so that an ICMP
        // "port unreachable" from a dead cache fails the probe at once.
        let socket = self
            .netns
            .run("creating a probe socket", move || {
                let socket = std::net::UdpSocket::bind(local)?;
                socket.connect(target)?;
                socket.set_nonblocking(true)?;
                Ok(socket)
            })
            .await
            .map_err(|error| format!("{error:#}"))?;
        let socket = tokio::net::UdpSocket::from_std(socket).map_err(|error| error.to_string())?;
        socket.send(&request).await.map_err(io_reason)?;
        let mut buffer = [0u8; 4096];
        loop {
            let len = socket.recv(&mut buffer).await.map_err(io_reason)?;
            let Ok(response) = Message::from_vec(&buffer[..len]) else {
                continue;
            };
            if response.id() == id && response.message_type() == MessageType::Response {
                return Ok(response.response_code());
            }
        }
    }
}

fn io_reason(error: std::io::Error) -> String {
    if error.kind() == std::io::ErrorKind::ConnectionRefused {
        "refused (nothing listens)".to_owned()
    } else {
        error.to_string()
    }
}

/// A query id that differs between probes (uniqueness is all that matters here).
fn rand_id() -> u16 {
    use std::hash::{BuildHasher as _, RandomState};
    (RandomState::new().hash_one(Instant::now()) & 0xffff) as u16
}
