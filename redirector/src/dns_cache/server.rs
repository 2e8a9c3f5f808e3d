//! The listeners: per listen address one UDP socket and one TCP listener on the same port, each
//! served by one task that also owns the queries and connections it took in. Stopping aborts
//! those tasks, which drops everything they own: no socket outlives [`CacheServer::serve`].

use std::{future::Future, io, net::SocketAddr, sync::Arc, time::Duration};

use futures::{StreamExt as _, stream::FuturesUnordered};
use tokio::{
    net::{TcpListener, TcpStream, UdpSocket},
    task::JoinSet,
};

use super::{
    CacheError,
    config::CacheConfig,
    framing::{read_frame, write_frame},
    resolver::{Resolver, Transport},
};

/// Queries one UDP socket works on at once; beyond that it stops reading until one is answered.
const MAX_UDP_IN_FLIGHT: usize = 1024;
/// TCP connections one listener keeps at once; beyond that it stops accepting.
const MAX_TCP_CONNECTIONS: usize = 256;
/// A TCP connection idle this long (no complete query, or a reply that cannot be written) is
/// closed (RFC 7766 suggests seconds).
const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Tries at finding a port free on both UDP and TCP for a listen address with port 0.
const EPHEMERAL_BIND_TRIES: usize = 16;

/// The cache with its sockets bound; it answers once [`Self::serve`] runs.
#[derive(Debug)]
pub struct CacheServer {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
    local_addrs: Vec<SocketAddr>,
    pub(super) resolver: Arc<Resolver>,
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
            resolver: Arc::new(Resolver::new(config)),
        })
    }

    /// The bound addresses, in the order of `listen`; each serves UDP and TCP.
    #[must_use]
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    /// Answers DNS until `shutdown` completes, then closes every socket and returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let mut tasks = JoinSet::new();
        for socket in self.udp {
            tasks.spawn(serve_udp(socket, Arc::clone(&self.resolver)));
        }
        for listener in self.tcp {
            tasks.spawn(serve_tcp(listener, Arc::clone(&self.resolver)));
        }
        tracing::info!(addresses = ?self.local_addrs, "DNS cache serving (UDP and TCP)");
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(ended) = tasks.join_next() => {
                    // The loops never return; one that panicked takes the server down with it
                    // rather than leaving it half deaf.
                    if let Err(error) = ended
                        && error.is_panic()
                    {
                        tasks.shutdown().await;
                        std::panic::resume_unwind(error.into_panic());
                    }
                }
            }
        }
        tasks.shutdown().await;
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

/// Reads queries from `socket` and sends each reply when it is ready.
async fn serve_udp(socket: UdpSocket, resolver: Arc<Resolver>) {
    let mut buffer = vec![0; usize::from(u16::MAX)];
    let mut in_flight = FuturesUnordered::new();
    loop {
        tokio::select! {
            received = socket.recv_from(&mut buffer), if in_flight.len() < MAX_UDP_IN_FLIGHT => {
                match received {
                    Ok((length, client)) => {
                        let request = buffer[..length].to_vec();
                        let resolver = Arc::clone(&resolver);
                        in_flight.push(async move {
                            let reply = resolver.answer(&request, Transport::Udp, client.ip()).await;
                            (client, reply)
                        });
                    }
                    Err(error) => {
                        tracing::debug!(%error, "receiving a UDP query");
                        // Never a busy loop on an error that persists.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            Some((client, reply)) = in_flight.next() => {
                if let Some(reply) = reply
                    && let Err(error) = socket.send_to(&reply, client).await
                {
                    tracing::debug!(%client, %error, "sending a UDP reply");
                }
            }
        }
    }
}

/// Accepts connections on `listener` and serves them.
async fn serve_tcp(listener: TcpListener, resolver: Arc<Resolver>) {
    let mut connections = FuturesUnordered::new();
    loop {
        tokio::select! {
            accepted = listener.accept(), if connections.len() < MAX_TCP_CONNECTIONS => {
                match accepted {
                    Ok((stream, client)) => {
                        connections.push(serve_connection(stream, client, Arc::clone(&resolver)));
                    }
                    Err(error) => {
                        // Out of file descriptors, most likely: wait for some to close.
                        tracing::warn!(%error, "accepting a TCP connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            Some(()) = connections.next() => {}
        }
    }
}

/// Answers the queries of one connection in turn until the client closes it or idles.
async fn serve_connection(stream: TcpStream, client: SocketAddr, resolver: Arc<Resolver>) {
    loop {
        let request = match tokio::time::timeout(TCP_IDLE_TIMEOUT, read_frame(&stream)).await {
            Ok(Ok(Some(request))) => request,
            Ok(Ok(None)) | Err(_) => return,
            Ok(Err(error)) => {
                tracing::debug!(%client, %error, "reading a TCP query");
                return;
            }
        };
        let Some(reply) = resolver.answer(&request, Transport::Tcp, client.ip()).await else {
            continue;
        };
        match tokio::time::timeout(TCP_IDLE_TIMEOUT, write_frame(&stream, &reply)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::debug!(%client, %error, "sending a TCP reply");
                return;
            }
            Err(_) => return,
        }
    }
}
