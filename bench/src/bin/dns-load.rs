//! A DNS load generator for what dnsperf cannot do: connected UDP sockets. `--clients` threads,
//! each with one long-lived UDP socket connected to the server (as glibc's resolver and c-ares
//! keep theirs), keep `--outstanding` queries in flight each for `--seconds`, and print one JSON
//! line: queries per second answered, and queries lost (no answer within the timeout).
//!
//! A lost query is not replaced until its socket hears nothing for the timeout, so each loss
//! narrows that socket's window for the rest of the run: under a load that makes the server drop
//! datagrams, both sides of a comparison run with slightly fewer queries in flight than asked.

use std::{
    net::{SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bpf_tests::dns::{PROBE_NAME, query};
use clap::Parser;
use hickory_proto::rr::RecordType;

#[derive(Parser, Debug)]
struct Args {
    /// The server (ip:port).
    #[arg(long)]
    server: SocketAddr,
    /// Threads, one connected socket each.
    #[arg(long, default_value_t = 4)]
    clients: u16,
    /// Queries in flight per socket.
    #[arg(long, default_value_t = 64)]
    outstanding: u16,
    /// How long to send.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// How long a socket waits for any answer before it counts its queries in flight as lost.
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
}

/// What one client thread saw.
#[derive(Default)]
struct Tally {
    answered: u64,
    lost: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.seconds);
    let threads: Vec<_> = (0..args.clients)
        .map(|client| {
            let (server, outstanding, timeout) = (
                args.server,
                args.outstanding,
                Duration::from_millis(args.timeout_ms),
            );
            std::thread::spawn(move || run_client(client, server, outstanding, timeout, deadline))
        })
        .collect();
    let mut total = Tally::default();
    for thread in threads {
        let tally = thread
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        total.answered += tally.answered;
        total.lost += tally.lost;
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "{{\"qps\": {:.1}, \"answered\": {}, \"lost\": {}}}",
        total.answered as f64 / elapsed,
        total.answered,
        total.lost
    );
    Ok(())
}

/// One connected socket keeping `outstanding` queries in flight until `deadline`, then waiting
/// for the last answers.
fn run_client(
    client: u16,
    server: SocketAddr,
    outstanding: u16,
    timeout: Duration,
    deadline: Instant,
) -> anyhow::Result<Tally> {
    let local: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let socket = UdpSocket::bind(local).context("bind")?;
    socket.connect(server).context("connect")?;
    socket.set_read_timeout(Some(timeout)).context("timeout")?;
    // Ids are spread by client, so that a late answer cannot be taken for another client's.
    let mut next_id = client.wrapping_mul(4099);
    let mut in_flight = 0u64;
    let mut tally = Tally::default();
    let mut send = |in_flight: &mut u64| -> anyhow::Result<()> {
        socket
            .send(&query(next_id, PROBE_NAME, RecordType::A)?)
            .context("send")?;
        next_id = next_id.wrapping_add(1);
        *in_flight += 1;
        Ok(())
    };
    for _ in 0..outstanding {
        send(&mut in_flight)?;
    }
    let mut buffer = [0u8; 512];
    while in_flight > 0 {
        match socket.recv(&mut buffer) {
            Ok(_) => {
                tally.answered += 1;
                in_flight -= 1;
                if Instant::now() < deadline {
                    send(&mut in_flight)?;
                }
            }
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                tally.lost += in_flight;
                in_flight = 0;
                if Instant::now() < deadline {
                    for _ in 0..outstanding {
                        send(&mut in_flight)?;
                    }
                }
            }
            Err(error) => return Err(error).context("recv"),
        }
    }
    Ok(tally)
}
