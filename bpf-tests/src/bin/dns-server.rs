//! A test DNS server: answers every A and AAAA question with the addresses it is given, which
//! identify it, over UDP and TCP on every `--listen` address. Prints `ready` once all are bound.

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bpf_tests::dns::{Identity, answer};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Address and port to serve on (UDP and TCP); repeat for more.
    #[arg(long, required = true)]
    listen: Vec<SocketAddr>,
    /// The A record to answer.
    #[arg(long)]
    a: Ipv4Addr,
    /// The AAAA record to answer.
    #[arg(long)]
    aaaa: Ipv6Addr,
    /// UDP sockets per address, in one SO_REUSEPORT group (as multi-threaded caches do).
    #[arg(long, default_value_t = 1)]
    udp_sockets: usize,
    /// Bind at once but answer nothing for this long (a cache that binds before it can serve).
    #[arg(long, default_value_t = 0)]
    mute_ms: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let identity = Identity {
        a: args.a,
        aaaa: args.aaaa,
    };
    let serve_from = Instant::now() + Duration::from_millis(args.mute_ms);
    let mut workers = Vec::new();
    for address in &args.listen {
        for _ in 0..args.udp_sockets {
            let udp = bind_udp(*address, args.udp_sockets > 1)
                .with_context(|| format!("binding udp {address}"))?;
            workers.push(thread::spawn(move || {
                serve_udp(&udp, &identity, serve_from)
            }));
        }
        let tcp = TcpListener::bind(address).with_context(|| format!("binding tcp {address}"))?;
        workers.push(thread::spawn(move || {
            serve_tcp(&tcp, &identity, serve_from)
        }));
    }
    println!(
        "ready {}",
        args.listen
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    for worker in workers {
        let _ = worker.join();
    }
    Ok(())
}

/// A UDP socket on `address`, in an SO_REUSEPORT group when `shared`.
fn bind_udp(address: SocketAddr, shared: bool) -> anyhow::Result<UdpSocket> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, setsockopt, socket, sockopt,
    };
    let family = if address.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Datagram, SockFlag::empty(), None).context("socket")?;
    if shared {
        setsockopt(&fd, sockopt::ReusePort, &true).context("SO_REUSEPORT")?;
    }
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(address),
    )
    .context("bind")?;
    Ok(UdpSocket::from(fd))
}

/// Waits until `serve_from` (a muted server reads nothing, so queries time out).
fn wait_until(serve_from: Instant) {
    let now = Instant::now();
    if serve_from > now {
        thread::sleep(serve_from - now);
    }
}

fn serve_udp(socket: &UdpSocket, identity: &Identity, serve_from: Instant) {
    wait_until(serve_from);
    let mut buffer = [0u8; 4096];
    loop {
        let Ok((len, from)) = socket.recv_from(&mut buffer) else {
            continue;
        };
        if let Ok(reply) = answer(&buffer[..len], identity) {
            let _ = socket.send_to(&reply, from);
        }
    }
}

fn serve_tcp(listener: &TcpListener, identity: &Identity, serve_from: Instant) {
    wait_until(serve_from);
    for stream in listener.incoming().flatten() {
        let identity = *identity;
        thread::spawn(move || {
            let _ = serve_tcp_connection(stream, &identity);
        });
    }
}

/// DNS over TCP: each message is preceded by its length (2 bytes, network order).
fn serve_tcp_connection(mut stream: TcpStream, identity: &Identity) -> anyhow::Result<()> {
    loop {
        let mut len = [0u8; 2];
        if stream.read_exact(&mut len).is_err() {
            return Ok(());
        }
        let mut request = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut request)?;
        let reply = answer(&request, identity)?;
        let reply_len = u16::try_from(reply.len())?.to_be_bytes();
        stream.write_all(&reply_len)?;
        stream.write_all(&reply)?;
    }
}
