//! The listeners: per listen address one UDP socket and one TCP listener on the same port.
//! hickory-server's `ServerFuture` serves the UDP sockets. TCP connections are accepted here, up
//! to a bound (hickory-server 0.25 accepts without one), and their queries go to the same handler
//! through hickory's own framing, idle timeout and response handle.

use std::{future::Future, io, net::SocketAddr, sync::Arc, time::Duration};

use futures::StreamExt as _;
use hickory_proto::{
    op::{Header, MessageType, ResponseCode},
    runtime::iocompat::AsyncIoTokioAsStd,
    serialize::binary::{BinDecodable as _, BinEncodable as _},
    tcp::TcpStream,
    xfer::{DnsStreamHandle as _, Protocol, SerialMessage},
};
use hickory_server::{
    ServerFuture,
    authority::MessageRequest,
    server::{Request, RequestHandler as _, ResponseHandle, TimeoutStream},
};
use tokio::{
    net::{TcpListener, UdpSocket},
    sync::Semaphore,
    task::JoinSet,
};

use crate::{CacheError, config::CacheConfig, handler::CacheHandler};

/// How much the cache takes on at once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Queries answered at once, over every listener; beyond, SERVFAIL at once.
    pub(crate) in_flight: usize,
    /// TCP connections open at once per listener; beyond, the next waits to be accepted.
    pub(crate) tcp_connections: usize,
    /// A TCP connection without a query for this long is closed (RFC 7766 suggests seconds).
    pub(crate) tcp_idle: Duration,
}

impl Limits {
    pub(crate) const DEFAULT: Self = Self {
        in_flight: 1024,
        tcp_connections: 256,
        tcp_idle: Duration::from_secs(10),
    };
}

/// Tries at finding a port free on both UDP and TCP for a listen address with port 0.
const EPHEMERAL_BIND_TRIES: usize = 16;

/// The cache with its sockets bound; it answers once [`Self::serve`] runs.
#[derive(Debug)]
pub struct CacheServer {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
    local_addrs: Vec<SocketAddr>,
    handler: CacheHandler,
    limits: Limits,
}

impl CacheServer {
    /// Binds every address of `config.listen` on UDP and on TCP. A port 0 address gets an
    /// ephemeral port, the same for both protocols.
    ///
    /// # Errors
    ///
    /// [`CacheError::Bind`] for the first address that cannot be bound; what was bound before is
    /// closed again.
    pub async fn bind(config: CacheConfig) -> Result<Self, CacheError> {
        Self::bind_with(config, Limits::DEFAULT).await
    }

    pub(crate) async fn bind_with(config: CacheConfig, limits: Limits) -> Result<Self, CacheError> {
        let mut udp = Vec::with_capacity(config.listen.len());
        let mut tcp = Vec::with_capacity(config.listen.len());
        let mut local_addrs = Vec::with_capacity(config.listen.len());
        for &address in &config.listen {
            let (socket, listener) = bind_pair(address).await?;
            let local = socket.local_addr().map_err(|source| CacheError::Bind {
                address,
                protocol: "UDP",
                source,
            })?;
            udp.push(socket);
            tcp.push(listener);
            local_addrs.push(local);
        }
        Ok(Self {
            udp,
            tcp,
            local_addrs,
            handler: CacheHandler::new(&config, limits.in_flight),
            limits,
        })
    }

    /// The bound addresses, in the order of `listen`; each serves UDP and TCP.
    #[must_use]
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    /// Answers DNS until `shutdown` completes, then closes every socket and returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let mut udp = ServerFuture::new(self.handler.clone());
        for socket in self.udp {
            udp.register_socket(socket);
        }
        let mut tcp = JoinSet::new();
        for listener in self.tcp {
            tcp.spawn(serve_tcp(listener, self.handler.clone(), self.limits));
        }
        tracing::info!(addresses = ?self.local_addrs, "DNS cache serving (UDP and TCP)");
        tokio::select! {
            () = shutdown => {}
            ended = udp.block_until_done() => {
                // The UDP loops end only on an error the socket cannot recover from.
                tracing::error!(?ended, "the UDP listeners stopped; the cache stops too");
            }
        }
        tcp.shutdown().await;
        if let Err(error) = udp.shutdown_gracefully().await {
            tracing::debug!(%error, "a UDP listener had failed");
        }
        tracing::info!(addresses = ?self.local_addrs, "DNS cache stopped");
    }
}

/// A UDP socket and a TCP listener on `address`; for port 0, on one port free for both.
async fn bind_pair(address: SocketAddr) -> Result<(UdpSocket, TcpListener), CacheError> {
    let udp_error = |source| CacheError::Bind {
        address,
        protocol: "UDP",
        source,
    };
    let tcp_error = |source| CacheError::Bind {
        address,
        protocol: "TCP",
        source,
    };
    if address.port() != 0 {
        let socket = UdpSocket::bind(address).await.map_err(udp_error)?;
        let listener = TcpListener::bind(address).await.map_err(tcp_error)?;
        return Ok((socket, listener));
    }
    let mut tries = 0;
    loop {
        tries += 1;
        let socket = UdpSocket::bind(address).await.map_err(udp_error)?;
        let port = socket.local_addr().map_err(udp_error)?.port();
        match TcpListener::bind(SocketAddr::new(address.ip(), port)).await {
            Ok(listener) => return Ok((socket, listener)),
            Err(error)
                if error.kind() == io::ErrorKind::AddrInUse && tries < EPHEMERAL_BIND_TRIES => {}
            Err(error) => return Err(tcp_error(error)),
        }
    }
}

/// Accepts connections on `listener`, at most `limits.tcp_connections` open at once.
async fn serve_tcp(listener: TcpListener, handler: CacheHandler, limits: Limits) {
    let open = Arc::new(Semaphore::new(limits.tcp_connections));
    let mut connections = JoinSet::new();
    loop {
        // Reap the connections that ended.
        while connections.try_join_next().is_some() {}
        let Ok(permit) = Arc::clone(&open).acquire_owned().await else {
            return;
        };
        match listener.accept().await {
            Ok((stream, client)) => {
                connections.spawn(serve_connection(
                    stream,
                    client,
                    handler.clone(),
                    limits.tcp_idle,
                    permit,
                ));
            }
            Err(error) => {
                // Out of file descriptors, most likely: wait for some to close.
                tracing::warn!(%error, "accepting a TCP connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Answers the queries of one connection in turn until the client closes it or idles.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    client: SocketAddr,
    handler: CacheHandler,
    idle: Duration,
    _open: tokio::sync::OwnedSemaphorePermit,
) {
    let (messages, mut replies) = TcpStream::from_stream(AsyncIoTokioAsStd(stream), client);
    let mut messages = TimeoutStream::new(messages, idle);
    while let Some(Ok(message)) = messages.next().await {
        match MessageRequest::from_bytes(message.bytes()) {
            Ok(request) if request.message_type() == MessageType::Query => {
                let request = Request::new(request, client, Protocol::Tcp);
                let response = ResponseHandle::new(client, replies.clone(), Protocol::Tcp);
                handler.handle_request(&request, response).await;
            }
            // Never answer a response: two servers could bounce errors forever.
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%client, %error, "a TCP query that does not decode: FORMERR");
                if let Some(reply) = format_error(message.bytes())
                    && replies.send(SerialMessage::new(reply, client)).is_err()
                {
                    return;
                }
            }
        }
    }
}

/// FORMERR (the header alone) for a query hickory cannot decode, if it has a header and is not
/// itself a response; hickory-server answers UDP ones with FORMERR too.
fn format_error(request: &[u8]) -> Option<Vec<u8>> {
    let header = Header::from_bytes(request.get(..Header::len())?).ok()?;
    if header.message_type() == MessageType::Response {
        return None;
    }
    let mut reply = Header::response_from_request(&header);
    reply.set_response_code(ResponseCode::FormErr);
    reply.to_bytes().ok()
}
