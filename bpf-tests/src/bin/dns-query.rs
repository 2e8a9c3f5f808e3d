//! A test DNS client: sends one query the way a real client would (unconnected UDP, connected
//! UDP, or TCP; optionally from a dual-stack AF_INET6 socket to an IPv4-mapped address) and
//! prints what it saw as one JSON line: the answer, where the reply came from (`recvfrom`), and
//! the connected peer (`getpeername`). With `--count N`, it does so N times, each from a fresh
//! socket (as glibc does for every lookup), one line each.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{Context as _, bail};
use bpf_tests::dns::{PROBE_NAME, QueryOutcome, parse_answer, query};
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
}

fn main() {
    let args = Args::parse();
    let first_id = u16::try_from(std::process::id() & 0xffff).unwrap_or(1);
    for sequence in 0..args.count {
        report(ask(&args, first_id.wrapping_add(sequence)));
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

fn ask(args: &Args, id: u16) -> anyhow::Result<QueryOutcome> {
    let server = if args.mapped {
        match args.server.ip() {
            IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), args.server.port()),
            IpAddr::V6(_) => bail!("--mapped needs an IPv4 server"),
        }
    } else {
        args.server
    };
    let record_type = if args.aaaa {
        RecordType::AAAA
    } else {
        RecordType::A
    };
    let request = query(id, PROBE_NAME, record_type)?;
    let timeout = Some(Duration::from_millis(args.timeout_ms));
    let mut outcome = QueryOutcome::default();

    let response = match args.transport {
        Transport::Udp | Transport::UdpConnected => {
            let local: SocketAddr = if server.is_ipv4() {
                "0.0.0.0:0".parse()?
            } else {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
            };
            let socket = UdpSocket::bind(local).context("bind")?;
            socket.set_read_timeout(timeout).context("timeout")?;
            let mut buffer = [0u8; 4096];
            if matches!(args.transport, Transport::UdpConnected) {
                socket.connect(server).context("connect")?;
                outcome.peer = Some(socket.peer_addr().context("getpeername")?.to_string());
                socket.send(&request).context("send")?;
                let len = socket.recv(&mut buffer).context("recv")?;
                buffer[..len].to_vec()
            } else {
                socket.send_to(&request, server).context("sendto")?;
                let (len, from) = socket.recv_from(&mut buffer).context("recvfrom")?;
                outcome.reply_from = Some(from.to_string());
                buffer[..len].to_vec()
            }
        }
        Transport::Tcp => {
            let mut stream =
                TcpStream::connect_timeout(&server, Duration::from_millis(args.timeout_ms))
                    .context("connect")?;
            stream.set_read_timeout(timeout).context("timeout")?;
            outcome.peer = Some(stream.peer_addr().context("getpeername")?.to_string());
            let len = u16::try_from(request.len())?.to_be_bytes();
            stream.write_all(&len).context("send")?;
            stream.write_all(&request).context("send")?;
            let mut reply_len = [0u8; 2];
            stream.read_exact(&mut reply_len).context("recv")?;
            let mut reply = vec![0u8; usize::from(u16::from_be_bytes(reply_len))];
            stream.read_exact(&mut reply).context("recv")?;
            reply
        }
    };
    let (rcode, answers) = parse_answer(id, &response)?;
    outcome.ok = true;
    outcome.rcode = Some(rcode.to_string());
    outcome.answers = answers;
    Ok(outcome)
}
