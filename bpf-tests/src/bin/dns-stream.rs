//! A continuous DNS client for failover tests: for `--duration-ms`, every `--interval-ms`, one
//! query per socket kind, each printed as a JSON line (`StreamRecord`) the moment it completes.
//! Kinds: `fresh` (a new connected UDP socket per query, as glibc does), `long` (one long-lived
//! unconnected socket), `connected` (one long-lived connected socket, as c-ares does: reopened
//! when a send fails, and the query asked again from the new socket; with `--mapped`, an
//! AF_INET6 socket connected to the IPv4-mapped server address). With `--until-eof` it runs until
//! its standard input closes instead, and speaks the resolver clients' protocol
//! (`bpf_tests::resolvers`): a first line `{"streaming":true}`, the records, then the totals.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
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
    #[arg(long, required_unless_present = "until_eof")]
    duration_ms: Option<u64>,
    /// Run until standard input closes, then print the totals (`{"asked":N,"ended":N}`).
    #[arg(long, conflicts_with = "duration_ms")]
    until_eof: bool,
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
    /// Set once standard input closed (`--until-eof`).
    stop: AtomicBool,
    /// Records printed.
    printed: AtomicU64,
    out: Mutex<std::io::Stdout>,
}

impl Settings {
    fn running(&self) -> bool {
        Instant::now() < self.deadline && !self.stop.load(Ordering::Relaxed)
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Without a duration (`--until-eof`), a day: standard input ends it.
    let duration = Duration::from_millis(args.duration_ms.unwrap_or(86_400_000));
    let settings = Arc::new(Settings {
        server: args.server,
        deadline: Instant::now() + duration,
        interval: Duration::from_millis(args.interval_ms),
        timeout: Duration::from_millis(args.timeout_ms),
        mapped: args.mapped,
        stop: AtomicBool::new(false),
        printed: AtomicU64::new(0),
        out: Mutex::new(std::io::stdout()),
    });
    if args.until_eof {
        println!(r#"{{"streaming":true}}"#);
        let settings = Arc::clone(&settings);
        thread::spawn(move || {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            settings.stop.store(true, Ordering::Relaxed);
        });
    } else {
        println!("ready");
    }
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
    if args.until_eof {
        // Every query ends before its thread asks the next: as many ended as were asked.
        let printed = settings.printed.load(Ordering::Relaxed);
        println!(r#"{{"asked":{printed},"ended":{printed}}}"#);
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
    let mut seq = 0;
    while settings.running() {
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
            StreamRecord {
                seq,
                begun_ms,
                steered_ms,
                done_ms: now_ms(),
                kind: kind.name().to_owned(),
                answer: None,
                error: None,
                reopened,
            },
            result,
        );
        seq += 1;
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

/// Prints `record` with the query's `result`.
fn emit(settings: &Settings, mut record: StreamRecord, result: anyhow::Result<IpAddr>) {
    match result {
        Ok(answer) => record.answer = Some(answer),
        Err(error) => record.error = Some(format!("{error:#}")),
    }
    if let (Ok(mut out), Ok(line)) = (settings.out.lock(), serde_json::to_string(&record)) {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
        settings.printed.fetch_add(1, Ordering::Relaxed);
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
