//! A test DNS server: answers every A and AAAA question with the addresses it is given, which
//! identify it, over UDP and TCP on every `--listen` address. Prints `ready` once all are bound.

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread,
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
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let identity = Identity {
        a: args.a,
        aaaa: args.aaaa,
    };
    let mut workers = Vec::new();
    for address in &args.listen {
        let udp = UdpSocket::bind(address).with_context(|| format!("binding udp {address}"))?;
        let tcp = TcpListener::bind(address).with_context(|| format!("binding tcp {address}"))?;
        workers.push(thread::spawn(move || serve_udp(&udp, &identity)));
        workers.push(thread::spawn(move || serve_tcp(&tcp, &identity)));
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

fn serve_udp(socket: &UdpSocket, identity: &Identity) {
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

fn serve_tcp(listener: &TcpListener, identity: &Identity) {
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
