//! The kernel's socket tables, read with netlink `sock_diag` (`NETLINK_SOCK_DIAG`, inet_diag):
//! the cache's sockets as they are, to seed and reconcile the kernel programs' counts.

use std::path::Path;

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NLMSG_ALIGNTO, NLMSG_DONE, NLMSG_ERROR, NetlinkBuffer,
    NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};
use redirector_common::{
    addr::NetAddr,
    counters::{PROTOCOL_TCP, PROTOCOL_UDP},
};

use crate::sys::netns::{self, NetnsError};

/// A socket bound to an address and port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoundSocket {
    /// `PROTOCOL_UDP` or `PROTOCOL_TCP`.
    pub protocol: u32,
    /// The bound address (IPv4 stored mapped).
    pub addr: NetAddr,
    /// The bound port.
    pub port: u16,
    /// The socket's cookie (what `bpf_get_socket_cookie` returns for it).
    pub cookie: u64,
    /// Bytes waiting in its receive queue (for UDP: datagrams not read yet).
    pub recv_queue: u32,
    /// Its inode (what a holder's `/proc/PID/fd` link names: `socket:[INODE]`).
    pub inode: u32,
}

/// Why the socket tables could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    /// The netlink socket could not be opened in the cache's namespace.
    #[error("cannot open a sock_diag netlink socket")]
    Open(#[source] NetnsError),
    /// A request or its answer failed.
    #[error("the sock_diag dump failed")]
    Dump(#[source] std::io::Error),
    /// The kernel answered something this agent cannot decode.
    #[error("the sock_diag answer could not be decoded")]
    Decode(#[source] netlink_packet_core::DecodeError),
}

/// How long one read of a dump's answer may wait.
const RECEIVE_TIMEOUT_SECS: i64 = 5;

/// A netlink socket in the caches' network namespace, reused for every dump. Each dump has a
/// sequence number of its own, and an answer of another is skipped: a dump that failed halfway
/// (a decode error, an error message) leaves the rest of its answer in the socket, which the next
/// dump must not take for its own.
#[derive(Debug)]
pub struct SocketTable {
    socket: Socket,
    sequence: u32,
    /// Where each datagram of answers is received.
    buffer: Vec<u8>,
}

impl SocketTable {
    /// Opens the table of the network namespace at `netns` (or the agent's own).
    pub fn open(netns: Option<&Path>) -> Result<Self, SockDiagError> {
        let socket = netns::run_in(netns, "opening a sock_diag socket", || {
            let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
            socket.bind_auto()?;
            socket.connect(&SocketAddr::new(0, 0))?;
            // A dump's answer that never ends (a message lost to a decode error, a kernel that
            // stops answering) fails the read instead of holding the reconcile for ever.
            let timeout = nix::sys::time::TimeVal::new(RECEIVE_TIMEOUT_SECS, 0);
            nix::sys::socket::setsockopt(
                &socket,
                nix::sys::socket::sockopt::ReceiveTimeout,
                &timeout,
            )?;
            Ok(socket)
        })
        .map_err(SockDiagError::Open)?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: vec![0u8; 65_536],
        })
    }

    /// Every UDP socket bound to a port, and every listening TCP socket, IPv4 and IPv6.
    pub fn bound_sockets(&mut self) -> Result<Vec<BoundSocket>, SockDiagError> {
        let mut sockets = Vec::new();
        for family in [AF_INET, AF_INET6] {
            self.dump(family, IPPROTO_UDP, StateFlags::all(), &mut sockets)?;
            self.dump(family, IPPROTO_TCP, StateFlags::LISTEN, &mut sockets)?;
        }
        Ok(sockets)
    }

    fn dump(
        &mut self,
        family: u8,
        protocol: u8,
        states: StateFlags,
        into: &mut Vec<BoundSocket>,
    ) -> Result<(), SockDiagError> {
        let mut sequence = self.request(family, protocol, states.clone())?;
        let mut received = self.receive(sequence, protocol, into);
        if let Err(SockDiagError::Dump(error)) = &received
            && error.raw_os_error() == Some(libc::EBUSY)
        {
            // An earlier dump was left unread (it failed halfway): the kernel runs one dump per
            // socket at a time and refused this one. That one is read to its end, and this one
            // asked again.
            self.drain(|other| other != sequence)?;
            sequence = self.request(family, protocol, states)?;
            received = self.receive(sequence, protocol, into);
        }
        if matches!(received, Err(SockDiagError::Decode(_))) {
            // The rest of this dump would block the next; what failed is reported all the same.
            let _ = self.drain(|other| other == sequence);
        }
        received
    }

    /// The next datagram of answers.
    fn next_datagram(&mut self) -> Result<&[u8], SockDiagError> {
        let size = self
            .socket
            .recv(&mut &mut self.buffer[..], 0)
            .map_err(SockDiagError::Dump)?;
        Ok(&self.buffer[..size])
    }

    /// Reads and drops messages up to the end (`NLMSG_DONE` or `NLMSG_ERROR`) of a dump whose
    /// sequence number is `ours`, by the headers alone: what could not be decoded once is not
    /// decoded again.
    fn drain(&mut self, ours: impl Fn(u32) -> bool) -> Result<(), SockDiagError> {
        loop {
            let datagram = self.next_datagram()?;
            let mut offset = 0;
            while offset < datagram.len() {
                let Ok(header) = NetlinkBuffer::new_checked(&datagram[offset..]) else {
                    // Nothing to walk further in this datagram.
                    break;
                };
                let length = header.length() as usize;
                if ours(header.sequence_number())
                    && matches!(header.message_type(), NLMSG_DONE | NLMSG_ERROR)
                {
                    return Ok(());
                }
                if length == 0 {
                    break;
                }
                offset += length.next_multiple_of(usize::from(NLMSG_ALIGNTO));
            }
        }
    }

    /// Asks for a dump; returns its sequence number.
    fn request(
        &mut self,
        family: u8,
        protocol: u8,
        states: StateFlags,
    ) -> Result<u32, SockDiagError> {
        self.sequence = self.sequence.wrapping_add(1);
        let sequence = self.sequence;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        header.sequence_number = sequence;
        let socket_id = if family == AF_INET {
            SocketId::new_v4()
        } else {
            SocketId::new_v6()
        };
        let mut request = NetlinkMessage::new(
            header,
            SockDiagMessage::InetRequest(InetRequest {
                family,
                protocol,
                extensions: ExtensionFlags::empty(),
                states,
                socket_id,
            })
            .into(),
        );
        request.finalize();
        let mut buffer = vec![0u8; request.buffer_len()];
        request.serialize(&mut buffer);
        self.socket.send(&buffer, 0).map_err(SockDiagError::Dump)?;
        Ok(sequence)
    }

    /// Reads the answer to dump `sequence` of `protocol` sockets into `into`, up to its end.
    fn receive(
        &mut self,
        sequence: u32,
        protocol: u8,
        into: &mut Vec<BoundSocket>,
    ) -> Result<(), SockDiagError> {
        let protocol = if protocol == IPPROTO_UDP {
            PROTOCOL_UDP
        } else {
            PROTOCOL_TCP
        };
        loop {
            let datagram = self.next_datagram()?;
            let mut offset = 0;
            while offset < datagram.len() {
                // The header first: the rest of an earlier dump's answer is skipped undecoded.
                let header = NetlinkBuffer::new_checked(&datagram[offset..])
                    .map_err(SockDiagError::Decode)?;
                let (length, ours) = (
                    header.length() as usize,
                    header.sequence_number() == sequence,
                );
                if length == 0 {
                    break;
                }
                let start = offset;
                offset += length.next_multiple_of(usize::from(NLMSG_ALIGNTO));
                if !ours {
                    continue;
                }
                let message = NetlinkMessage::<SockDiagMessage>::deserialize(&datagram[start..])
                    .map_err(SockDiagError::Decode)?;
                match message.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                        let id = &response.header.socket_id;
                        if id.source_port != 0 {
                            into.push(BoundSocket {
                                protocol,
                                addr: NetAddr::from(id.source_address),
                                port: id.source_port,
                                cookie: u64::from_ne_bytes(id.cookie),
                                recv_queue: response.header.recv_queue,
                                inode: response.header.inode,
                            });
                        }
                    }
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::Error(error) => {
                        return Err(SockDiagError::Dump(error.to_io()));
                    }
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_socket_this_test_bound() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = socket.local_addr().unwrap().port();
        let mut table = SocketTable::open(None).unwrap();
        let sockets = table.bound_sockets().unwrap();
        let found: Vec<&BoundSocket> = sockets
            .iter()
            .filter(|socket| {
                socket.protocol == PROTOCOL_UDP
                    && socket.addr == NetAddr::from(std::net::Ipv4Addr::LOCALHOST)
                    && socket.port == port
            })
            .collect();
        assert_eq!(found.len(), 1, "{port} among {} sockets", sockets.len());
        assert_ne!(found[0].cookie, 0, "sock_diag reports the socket cookie");
    }

    #[test]
    fn an_answer_an_earlier_dump_left_unread_is_not_taken_for_the_next() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = socket.local_addr().unwrap().port();
        let mut table = SocketTable::open(None).unwrap();
        // What a dump that failed halfway leaves: an answer in the socket that nobody reads.
        table
            .request(AF_INET, IPPROTO_UDP, StateFlags::all())
            .unwrap();
        let sockets = table.bound_sockets().unwrap();
        let found: Vec<&BoundSocket> = sockets
            .iter()
            .filter(|socket| {
                socket.addr == NetAddr::from(std::net::Ipv4Addr::LOCALHOST) && socket.port == port
            })
            .collect();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].protocol, PROTOCOL_UDP);
    }

    #[test]
    fn lists_listening_tcp_but_not_its_connections() {
        let listener = std::net::TcpListener::bind("[::1]:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // An established pair: the accepted socket shares the listener's port, the client has
        // one of its own; neither is a server socket.
        let client = std::net::TcpStream::connect(("::1", port)).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let client_port = client.local_addr().unwrap().port();
        let mut table = SocketTable::open(None).unwrap();
        let sockets = table.bound_sockets().unwrap();
        let tcp_on = |port: u16| {
            sockets
                .iter()
                .filter(|socket| {
                    socket.protocol == PROTOCOL_TCP
                        && socket.addr == NetAddr::from(std::net::Ipv6Addr::LOCALHOST)
                        && socket.port == port
                })
                .count()
        };
        assert_eq!(tcp_on(port), 1, "the listener, not the accepted socket");
        assert_eq!(tcp_on(client_port), 0, "not the client");
        drop((client, accepted));
    }
}
