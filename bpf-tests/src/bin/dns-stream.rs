//! A continuous DNS client for failover tests: for `--duration-ms`, every `--interval-ms`, one
//! query per socket kind, each printed as a JSON line (`StreamRecord`) the moment it completes.
//! Kinds: `fresh` (a new connected UDP socket per query, as glibc does), `long` (one long-lived
//! unconnected socket), `connected` (one long-lived connected socket, as c-ares does: reopened
//! when a send fails, and the query asked again from the new socket; with `--mapped`, an
//! AF_INET6 socket connected to the IPv4-mapped server address).

use std::{
    io::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bpf_tests::dns::{PROBE_NAME, StreamRecord, now_ms, parse_answer, query};
use clap::{Parser, ValueEnum};
use hickory_proto::rr::RecordType;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Fresh,
    Long,
    Connected,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Fresh => "fresh",
            Self::Long => "long",
            Self::Connected => "connected",
        }
    }
}

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
    /// The socket kinds to query from, each on its own thread.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fresh,long")]
    kinds: Vec<Kind>,
    /// For `connected`: an AF_INET6 socket connected to the IPv4-mapped server address.
    #[arg(long)]
    mapped: bool,
}

/// What every query thread shares.
struct Settings {
    server: SocketAddr,
    deadline: Instant,
    interval: Duration,
    timeout: Duration,
    mapped: bool,
    out: Mutex<std::io::Stdout>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = Arc::new(Settings {
        server: args.server,
        deadline: Instant::now() + Duration::from_millis(args.duration_ms),
        interval: Duration::from_millis(args.interval_ms),
        timeout: Duration::from_millis(args.timeout_ms),
        mapped: args.mapped,
        out: Mutex::new(std::io::stdout()),
    });
    println!("ready");
    let threads: Vec<_> = args
        .kinds
        .iter()
        .enumerate()
        .map(|(index, kind)| {
            let settings = Arc::clone(&settings);
            let kind = *kind;
            thread::spawn(move || run(&settings, kind, (index as u16) << 13))
        })
        .collect();
    for thread in threads {
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("a query thread panicked"))??;
    }
    Ok(())
}

/// Queries from one kind of socket until the deadline; ids start at `first_id`.
fn run(settings: &Settings, kind: Kind, first_id: u16) -> anyhow::Result<()> {
    let mut long_lived = match kind {
        Kind::Fresh => None,
        Kind::Long => Some(open(settings, false)?),
        Kind::Connected => Some(open(settings, true)?),
    };
    let mut id = first_id;
    while Instant::now() < settings.deadline {
        id = id.wrapping_add(1);
        let begun_ms = now_ms();
        let (mut steered_ms, mut result) = query_once(settings, kind, long_lived.as_ref(), id);
        // c-ares closes a connected socket whose send fails and asks again at once from a new
        // one; a receive timeout keeps the socket.
        let reopened = kind == Kind::Connected
            && result
                .as_ref()
                .is_err_and(|error| error.to_string() == SEND_FAILED);
        if reopened {
            match open(settings, true) {
                Ok(socket) => {
                    long_lived = Some(socket);
                    (steered_ms, result) = query_once(settings, kind, long_lived.as_ref(), id);
                }
                Err(error) => result = Err(error),
            }
        }
        emit(
            settings,
            begun_ms,
            steered_ms,
            kind.name(),
            result,
            reopened,
        );
        thread::sleep(settings.interval);
    }
    Ok(())
}

/// The context of a failed send on a connected socket.
const SEND_FAILED: &str = "send";

/// One query from `long_lived`, or from a fresh socket when there is none: when its send returned
/// (its destination was chosen by then: at connect, or at this sendto), and its answer.
fn query_once(
    settings: &Settings,
    kind: Kind,
    long_lived: Option<&UdpSocket>,
    id: u16,
) -> (u64, anyhow::Result<IpAddr>) {
    let fresh;
    let socket = match long_lived {
        Some(socket) => socket,
        None => match open(settings, true) {
            Ok(socket) => {
                fresh = socket;
                &fresh
            }
            Err(error) => return (now_ms(), Err(error)),
        },
    };
    let sent = query(id, PROBE_NAME, RecordType::A).and_then(|message| {
        if kind == Kind::Long {
            socket.send_to(&message, settings.server).context("sendto")
        } else {
            socket.send(&message).context(SEND_FAILED)
        }
    });
    let steered_ms = now_ms();
    let answer = sent.and_then(|_| {
        if kind == Kind::Long {
            unconnected_answer(socket, settings, id)
        } else {
            connected_answer(socket, id)
        }
    });
    (steered_ms, answer)
}

/// A UDP socket for the server's family (AF_INET6 and the mapped address with `--mapped`),
/// connected when asked.
fn open(settings: &Settings, connect: bool) -> anyhow::Result<UdpSocket> {
    let (local, remote) = match (settings.server.ip(), settings.mapped && connect) {
        (IpAddr::V4(v4), true) => (
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
            SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), settings.server.port()),
        ),
        (IpAddr::V4(_), false) => (
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            settings.server,
        ),
        (IpAddr::V6(_), _) => (
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
            settings.server,
        ),
    };
    let socket = UdpSocket::bind(local).context("bind")?;
    socket
        .set_read_timeout(Some(settings.timeout))
        .context("timeout")?;
    if connect {
        socket.connect(remote).context("connect")?;
    }
    Ok(socket)
}

fn emit(
    settings: &Settings,
    begun_ms: u64,
    steered_ms: u64,
    kind: &str,
    result: anyhow::Result<IpAddr>,
    reopened: bool,
) {
    let (answer, error) = match result {
        Ok(answer) => (Some(answer), None),
        Err(error) => (None, Some(format!("{error:#}"))),
    };
    let record = StreamRecord {
        begun_ms,
        steered_ms,
        kind: kind.to_owned(),
        answer,
        error,
        reopened,
    };
    if let (Ok(mut out), Ok(line)) = (settings.out.lock(), serde_json::to_string(&record)) {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// The answer to query `id` on a connected socket.
fn connected_answer(socket: &UdpSocket, id: u16) -> anyhow::Result<IpAddr> {
    let mut buffer = [0u8; 4096];
    loop {
        let len = socket.recv(&mut buffer).context("recv")?;
        // Late answers to earlier queries on a long-lived socket are skipped.
        if parse_answer(id, &buffer[..len]).is_ok() {
            return first_answer(id, &buffer[..len]);
        }
    }
}

/// The answer to query `id` on the unconnected socket, which must come from the server asked.
fn unconnected_answer(socket: &UdpSocket, settings: &Settings, id: u16) -> anyhow::Result<IpAddr> {
    let deadline = Instant::now() + settings.timeout;
    let mut buffer = [0u8; 4096];
    loop {
        let (len, from) = socket.recv_from(&mut buffer).context("recvfrom")?;
        // Late answers to earlier queries are skipped; a reply must come from the server asked.
        if parse_answer(id, &buffer[..len]).is_ok() {
            anyhow::ensure!(
                from == settings.server,
                "reply from {from}, not {}",
                settings.server
            );
            return first_answer(id, &buffer[..len]);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("no answer to query {id}");
        }
    }
}

fn first_answer(id: u16, reply: &[u8]) -> anyhow::Result<IpAddr> {
    let (rcode, answers) = parse_answer(id, reply)?;
    answers
        .first()
        .copied()
        .with_context(|| format!("no address in the answer ({rcode})"))
}
