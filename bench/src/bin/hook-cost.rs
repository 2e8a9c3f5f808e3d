//! Per-syscall cost of the hooks: a tight loop of one kind of socket call, timed, printed as
//! nanoseconds per operation (one line of JSON). Run with and without the programs attached; the
//! difference is what the programs cost each call.
//! - `connect`: socket, connect (UDP, no packet), close: the connect hook's full path for a
//!   listener address, its early return for anything else.
//! - `roundtrip`: sendto and recvfrom on one unconnected UDP socket: a DNS query and its reply,
//!   through the sendmsg and recvmsg hooks.
//! - `fresh-roundtrip`: the same from a fresh socket per query (socket, sendto, recvfrom, close),
//!   so every send is the socket's first, as for a resolver that opens a socket per lookup.
//! - `connected-roundtrip`: send and recv on one UDP socket connected once (steered at its
//!   connect): a kept socket's queries (c-ares, nginx), each through the egress program's whole
//!   check of a connected DNS socket against its listener's route.
//! - `loopback`: a datagram back and forth between two UDP sockets on the target address (port
//!   ignored): traffic that is no DNS, through every hook's early return.

use std::{
    net::{SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bpf_tests::dns::{PROBE_NAME, query};
use clap::{Parser, ValueEnum};
use hickory_proto::rr::RecordType;

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Mode {
    Connect,
    Roundtrip,
    FreshRoundtrip,
    ConnectedRoundtrip,
    Loopback,
}

#[derive(Parser, Debug)]
struct Args {
    /// What to time.
    #[arg(long, value_enum)]
    mode: Mode,
    /// The destination.
    #[arg(long)]
    target: SocketAddr,
    /// How many operations.
    #[arg(long, default_value_t = 20_000)]
    count: u32,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let local: SocketAddr = if args.target.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let started;
    match args.mode {
        Mode::Connect => {
            started = Instant::now();
            for _ in 0..args.count {
                let socket = UdpSocket::bind(local).context("bind")?;
                socket.connect(args.target).context("connect")?;
            }
        }
        Mode::Roundtrip => {
            let socket = UdpSocket::bind(local).context("bind")?;
            socket.set_read_timeout(Some(Duration::from_secs(2)))?;
            let request = query(0x4242, PROBE_NAME, RecordType::A)?;
            let mut reply = [0u8; 512];
            started = Instant::now();
            for _ in 0..args.count {
                socket.send_to(&request, args.target).context("sendto")?;
                socket.recv_from(&mut reply).context("recvfrom")?;
            }
        }
        Mode::FreshRoundtrip => {
            let request = query(0x4242, PROBE_NAME, RecordType::A)?;
            let mut reply = [0u8; 512];
            started = Instant::now();
            for _ in 0..args.count {
                let socket = UdpSocket::bind(local).context("bind")?;
                socket.set_read_timeout(Some(Duration::from_secs(2)))?;
                socket.send_to(&request, args.target).context("sendto")?;
                socket.recv_from(&mut reply).context("recvfrom")?;
            }
        }
        Mode::ConnectedRoundtrip => {
            let socket = UdpSocket::bind(local).context("bind")?;
            socket.set_read_timeout(Some(Duration::from_secs(2)))?;
            socket.connect(args.target).context("connect")?;
            let request = query(0x4242, PROBE_NAME, RecordType::A)?;
            let mut reply = [0u8; 512];
            started = Instant::now();
            for _ in 0..args.count {
                socket.send(&request).context("send")?;
                socket.recv(&mut reply).context("recv")?;
            }
        }
        Mode::Loopback => {
            let here = SocketAddr::new(args.target.ip(), 0);
            let (one, other) = (
                UdpSocket::bind(here).context("bind")?,
                UdpSocket::bind(here).context("bind")?,
            );
            let (one_addr, other_addr) = (one.local_addr()?, other.local_addr()?);
            for socket in [&one, &other] {
                socket.set_read_timeout(Some(Duration::from_secs(2)))?;
            }
            let mut buffer = [0u8; 64];
            started = Instant::now();
            for _ in 0..args.count {
                one.send_to(b"ping", other_addr).context("sendto")?;
                other.recv_from(&mut buffer).context("recvfrom")?;
                other.send_to(b"pong", one_addr).context("sendto")?;
                one.recv_from(&mut buffer).context("recvfrom")?;
            }
        }
    }
    let elapsed = started.elapsed();
    println!(
        "{{\"ns_per_op\": {:.1}}}",
        elapsed.as_nanos() as f64 / f64::from(args.count)
    );
    Ok(())
}
