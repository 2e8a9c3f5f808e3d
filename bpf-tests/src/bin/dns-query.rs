//! A test DNS client: sends one query the way a real client would (unconnected UDP, connected
//! UDP, or TCP; optionally from a dual-stack AF_INET6 socket to an IPv4-mapped address) and
//! prints what it saw as one JSON line: the answer, where the reply came from (`recvfrom`), and
//! the connected peer (`getpeername`). With `--count N`, it does so N times, each from a fresh
//! socket (as glibc does for every lookup), one line each. With `--hold` (UDP), the N queries
//! share one socket, as a long-lived resolver's do, and each after the first waits for a line on
//! standard input, so a test can change the world between them (with `--idle-first`, also between
//! the connect and the first query). With `--hold --reopen`, a send
//! that fails closes the held socket and the query is asked again at once from a new one, as
//! c-ares and glibc do on a socket error. With `--also ADDR` (unconnected UDP), each query goes
//! from one socket to the server and then to ADDR before either reply is read, as musl asks
//! every nameserver at once; one line per reply, in the order they arrive. With `--connected-to
//! ADDR` (unconnected UDP), the socket is connected to ADDR first and each query still sent to
//! the server with `sendto`, which the kernel sends there.

use std::{
    io::Write as _,
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{Context as _, bail};
use bpf_tests::{
    dns::{PROBE_NAME, QueryOutcome, parse_answer, query, read_tcp_message, write_tcp_message},
    pace::monotonic_ns,
};
use clap::{Parser, ValueEnum};
use hickory_proto::rr::RecordType;

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Transport {
    Udp,
    UdpConnected,
    Tcp,
}

#[derive(Parser, Debug)]
struct Args {
    /// The server (ip:port).
    #[arg(long)]
    server: SocketAddr,
    /// How to send the query.
    #[arg(long, value_enum)]
    transport: Transport,
    /// Use an AF_INET6 socket and the IPv4-mapped form of an IPv4 server address.
    #[arg(long)]
    mapped: bool,
    /// Ask for AAAA instead of A.
    #[arg(long)]
    aaaa: bool,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// How many queries to send, one after the other, each from a fresh socket.
    #[arg(long, default_value_t = 1)]
    count: u16,
    /// UDP: send every query from one socket (connected once, for `udp-connected`), and wait for
    /// a line on standard input before each query after the first.
    #[arg(long)]
    hold: bool,
    /// Unconnected UDP: send each query to this server too, from the same socket, before
    /// reading the replies (one line each).
    #[arg(long, conflicts_with = "hold")]
    also: Option<SocketAddr>,
    /// UDP: connect the socket to this address first, and send each query to the server with
    /// `sendto` all the same (no reply but the peer's reaches such a socket).
    #[arg(long, conflicts_with_all = ["hold", "also"])]
    connected_to: Option<SocketAddr>,
    /// With `--hold`: when a send fails, open a new socket and ask again at once (once).
    #[arg(long, requires = "hold")]
    reopen: bool,
    /// With `--hold`: open (and connect) the socket, print `{"opened":true}`, and wait for a line
    /// on standard input before the first query too.
    #[arg(long, requires = "hold")]
    idle_first: bool,
}

fn main() {
    let args = Args::parse();
    let first_id = u16::try_from(std::process::id() & 0xffff).unwrap_or(1);
    if args.hold {
        hold(&args, first_id);
        return;
    }
    for sequence in 0..args.count {
        let id = first_id.wrapping_add(sequence);
        if let Some(also) = args.also {
            match ask_both(&args, also, id) {
                Ok(outcomes) => outcomes.into_iter().for_each(|outcome| report(Ok(outcome))),
                Err(error) => report(Err(error)),
            }
            continue;
        }
        report(ask(&args, id));
    }
}

/// `--hold`: the queries of one UDP socket, each after the first once standard input says so.
fn hold(args: &Args, first_id: u16) {
    // Noted before the connect, so that a test's "since the connect" is never short.
    let opened_ns = monotonic_ns();
    let mut socket = match open_udp(args) {
        Ok(socket) => socket,
        Err(error) => return report(Err(error)),
    };
    let mut line = String::new();
    if args.idle_first {
        println!(r#"{{"opened":true,"monotonic_ns":{opened_ns}}}"#);
        let _ = std::io::stdout().flush();
    }
    for sequence in 0..args.count {
        if sequence > 0 || args.idle_first {
            line.clear();
            if std::io::stdin().read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
        }
        let id = first_id.wrapping_add(sequence);
        let mut outcome = exchange_udp(args, &socket, id, true);
        if args.reopen
            && let Some(errno) = send_errno(&outcome)
        {
            outcome = open_udp(args).and_then(|fresh| {
                socket = fresh;
                let mut retried = exchange_udp(args, &socket, id, true)?;
                retried.reopened_after_errno = Some(errno);
                Ok(retried)
            });
        }
        report(outcome);
        let _ = std::io::stdout().flush();
    }
}

/// Prints one query's outcome as a JSON line.
fn report(result: anyhow::Result<QueryOutcome>) {
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(error) => QueryOutcome {
            ok: false,
            errno: error
                .chain()
                .find_map(|cause| cause.downcast_ref::<std::io::Error>())
                .and_then(std::io::Error::raw_os_error),
            error: Some(format!("{error:#}")),
            ..QueryOutcome::default()
        },
    };
    println!(
        "{}",
        serde_json::to_string(&outcome).unwrap_or_else(|_| "{}".to_owned())
    );
}

/// The errno of a failed send (not of a failed receive: a timeout keeps the socket, as resolvers
/// do).
fn send_errno(outcome: &anyhow::Result<QueryOutcome>) -> Option<i32> {
    let error = outcome.as_ref().err()?;
    if !error.chain().any(|cause| {
        let text = cause.to_string();
        text == "send" || text == "sendto"
    }) {
        return None;
    }
    error
        .chain()
        .find_map(|cause| cause.downcast_ref::<std::io::Error>())
        .and_then(std::io::Error::raw_os_error)
}

/// The address to send to: the server, or its IPv4-mapped form with `--mapped`.
fn destination(args: &Args) -> anyhow::Result<SocketAddr> {
    if args.mapped {
        match args.server.ip() {
            IpAddr::V4(v4) => Ok(SocketAddr::new(
                IpAddr::V6(v4.to_ipv6_mapped()),
                args.server.port(),
            )),
            IpAddr::V6(_) => bail!("--mapped needs an IPv4 server"),
        }
    } else {
        Ok(args.server)
    }
}

fn request(args: &Args, id: u16) -> anyhow::Result<Vec<u8>> {
    let record_type = if args.aaaa {
        RecordType::AAAA
    } else {
        RecordType::A
    };
    query(id, PROBE_NAME, record_type)
}

/// A UDP socket of the destination's family; connected for `udp-connected`.
fn open_udp(args: &Args) -> anyhow::Result<UdpSocket> {
    let server = destination(args)?;
    let local: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
    };
    let socket = UdpSocket::bind(local).context("bind")?;
    socket
        .set_read_timeout(Some(Duration::from_millis(args.timeout_ms)))
        .context("timeout")?;
    if matches!(args.transport, Transport::UdpConnected) {
        socket.connect(server).context("connect")?;
    } else if let Some(peer) = args.connected_to {
        // A dual-stack socket takes an IPv4 peer IPv4-mapped, as its server.
        let peer = match peer.ip() {
            IpAddr::V4(v4) if args.mapped => {
                SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), peer.port())
            }
            _ => peer,
        };
        socket.connect(peer).context("connect")?;
    }
    Ok(socket)
}

/// One query on a UDP socket from `open_udp`. `reply_source` also reads a connected socket's
/// reply with `recvfrom`, so the reply's source is reported besides `getpeername`.
fn exchange_udp(
    args: &Args,
    socket: &UdpSocket,
    id: u16,
    reply_source: bool,
) -> anyhow::Result<QueryOutcome> {
    let request = request(args, id)?;
    let mut outcome = QueryOutcome::default();
    let mut buffer = [0u8; 4096];
    let len = if matches!(args.transport, Transport::UdpConnected) {
        outcome.peer = Some(socket.peer_addr().context("getpeername")?.to_string());
        socket.send(&request).context("send")?;
        if reply_source {
            let (len, from) = socket.recv_from(&mut buffer).context("recvfrom")?;
            outcome.reply_from = Some(from.to_string());
            len
        } else {
            socket.recv(&mut buffer).context("recv")?
        }
    } else {
        socket
            .send_to(&request, destination(args)?)
            .context("sendto")?;
        let (len, from) = socket.recv_from(&mut buffer).context("recvfrom")?;
        outcome.reply_from = Some(from.to_string());
        len
    };
    answered(outcome, id, &buffer[..len])
}

fn answered(mut outcome: QueryOutcome, id: u16, response: &[u8]) -> anyhow::Result<QueryOutcome> {
    let (rcode, answers) = parse_answer(id, response)?;
    outcome.ok = true;
    outcome.rcode = Some(rcode.to_string());
    outcome.answers = answers;
    Ok(outcome)
}

/// `--also`: the query to the server and to `also` from one unconnected socket, both sent before
/// either reply is read.
fn ask_both(args: &Args, also: SocketAddr, id: u16) -> anyhow::Result<Vec<QueryOutcome>> {
    if !matches!(args.transport, Transport::Udp) {
        bail!("--also needs --transport udp");
    }
    let socket = open_udp(args)?;
    let request = request(args, id)?;
    for server in [destination(args)?, also] {
        socket.send_to(&request, server).context("sendto")?;
    }
    let mut buffer = [0u8; 4096];
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let (len, from) = socket.recv_from(&mut buffer).context("recvfrom")?;
        let outcome = QueryOutcome {
            reply_from: Some(from.to_string()),
            ..QueryOutcome::default()
        };
        outcomes.push(answered(outcome, id, &buffer[..len])?);
    }
    Ok(outcomes)
}

fn ask(args: &Args, id: u16) -> anyhow::Result<QueryOutcome> {
    match args.transport {
        Transport::Udp | Transport::UdpConnected => exchange_udp(args, &open_udp(args)?, id, false),
        Transport::Tcp => {
            let server = destination(args)?;
            let request = request(args, id)?;
            let mut outcome = QueryOutcome::default();
            let mut stream =
                TcpStream::connect_timeout(&server, Duration::from_millis(args.timeout_ms))
                    .context("connect")?;
            stream
                .set_read_timeout(Some(Duration::from_millis(args.timeout_ms)))
                .context("timeout")?;
            outcome.peer = Some(stream.peer_addr().context("getpeername")?.to_string());
            write_tcp_message(&mut stream, &request)?;
            let reply = read_tcp_message(&mut stream)?
                .context("the server closed the connection without a reply")?;
            answered(outcome, id, &reply)
        }
    }
}
