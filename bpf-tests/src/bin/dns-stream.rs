//! A continuous DNS client for failover tests: for `--duration-ms`, every `--interval-ms`, one
//! query from a fresh connected UDP socket (as glibc does) and one from a single long-lived
//! unconnected socket, each printed as a JSON line (`StreamRecord`) the moment it completes.

use std::{
    io::Write as _,
    net::{SocketAddr, UdpSocket},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bpf_tests::dns::{PROBE_NAME, StreamRecord, now_ms, parse_answer, query};
use clap::Parser;
use hickory_proto::rr::RecordType;

#[derive(Parser, Debug)]
struct Args {
    /// The server (ip:port).
    #[arg(long)]
    server: SocketAddr,
    /// How long to run.
    #[arg(long)]
    duration_ms: u64,
    /// Time between queries of each kind.
    #[arg(long, default_value_t = 20)]
    interval_ms: u64,
    /// How long one query waits for its answer.
    #[arg(long, default_value_t = 300)]
    timeout_ms: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let deadline = Instant::now() + Duration::from_millis(args.duration_ms);
    let timeout = Duration::from_millis(args.timeout_ms);
    let interval = Duration::from_millis(args.interval_ms);
    let server = args.server;
    println!("ready");
    let fresh = {
        let out = Arc::clone(&out);
        thread::spawn(move || {
            let mut id = 0u16;
            while Instant::now() < deadline {
                id = id.wrapping_add(1);
                let sent_ms = now_ms();
                let result = fresh_query(server, id, timeout);
                emit(&out, sent_ms, "fresh", result);
                thread::sleep(interval);
            }
        })
    };
    let socket = UdpSocket::bind(any_port(server)).context("binding the long-lived socket")?;
    socket.set_read_timeout(Some(timeout)).context("timeout")?;
    let mut id = 0x8000u16;
    while Instant::now() < deadline {
        id = id.wrapping_add(1);
        let sent_ms = now_ms();
        let result = long_query(&socket, server, id, timeout);
        emit(&out, sent_ms, "long", result);
        thread::sleep(interval);
    }
    let _ = fresh.join();
    Ok(())
}

fn emit(
    out: &Mutex<std::io::Stdout>,
    sent_ms: u64,
    kind: &str,
    result: anyhow::Result<std::net::IpAddr>,
) {
    let (answer, error) = match result {
        Ok(answer) => (Some(answer), None),
        Err(error) => (None, Some(format!("{error:#}"))),
    };
    let record = StreamRecord {
        sent_ms,
        kind: kind.to_owned(),
        answer,
        error,
    };
    if let (Ok(mut out), Ok(line)) = (out.lock(), serde_json::to_string(&record)) {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

fn fresh_query(server: SocketAddr, id: u16, timeout: Duration) -> anyhow::Result<std::net::IpAddr> {
    let socket = UdpSocket::bind(any_port(server)).context("bind")?;
    socket.set_read_timeout(Some(timeout)).context("timeout")?;
    socket.connect(server).context("connect")?;
    socket
        .send(&query(id, PROBE_NAME, RecordType::A)?)
        .context("send")?;
    let mut buffer = [0u8; 4096];
    let len = socket.recv(&mut buffer).context("recv")?;
    first_answer(id, &buffer[..len])
}

fn long_query(
    socket: &UdpSocket,
    server: SocketAddr,
    id: u16,
    timeout: Duration,
) -> anyhow::Result<std::net::IpAddr> {
    socket
        .send_to(&query(id, PROBE_NAME, RecordType::A)?, server)
        .context("sendto")?;
    let deadline = Instant::now() + timeout;
    let mut buffer = [0u8; 4096];
    loop {
        let (len, from) = socket.recv_from(&mut buffer).context("recvfrom")?;
        // Late answers to earlier queries are skipped; a reply must come from the server asked.
        if parse_answer(id, &buffer[..len]).is_ok() {
            anyhow::ensure!(from == server, "reply from {from}, not {server}");
            return first_answer(id, &buffer[..len]);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("no answer to query {id}");
        }
    }
}

/// Any local port of `server`'s family.
fn any_port(server: SocketAddr) -> SocketAddr {
    let unspecified = if server.is_ipv4() {
        std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
    } else {
        std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
    };
    SocketAddr::new(unspecified, 0)
}

fn first_answer(id: u16, reply: &[u8]) -> anyhow::Result<std::net::IpAddr> {
    let (rcode, answers) = parse_answer(id, reply)?;
    answers
        .first()
        .copied()
        .with_context(|| format!("no address in the answer ({rcode})"))
}
