//! A continuous DNS client for failover tests: for `--duration-ms`, every `--interval-ms`, one
//! query per socket kind, each printed as a JSON line (`StreamRecord`) the moment it completes.
//! Kinds: `fresh` (a new connected UDP socket per query, as glibc does, and as glibc a query whose
//! send is refused asked again at once from another), `long` (one long-lived
//! unconnected socket), `connected` (one long-lived connected socket, as c-ares does: reopened
//! when a send fails, and the query asked again from the new socket; with `--mapped`, an
//! AF_INET6 socket connected to the IPv4-mapped server address). With `--until-eof` it runs until
//! its standard input closes instead, and speaks the resolver clients' protocol
//! (`bpf_tests::resolvers`): a first line `{"streaming":true}`, the records, then the totals.
//! With `--open-loop`, each kind sends a query every interval whether or not the earlier ones
//! were answered (the long-lived sockets match answers by id), so a query lost to a dying cache
//! does not hold the next one back for its timeout: the stream sees a failover at the interval's
//! resolution. A kind that falls behind skips the queries it missed rather than sending them at
//! once.

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
    /// Send every interval without waiting for the earlier queries' answers.
    #[arg(long, conflicts_with = "until_eof")]
    open_loop: bool,
    /// Print an answered query only when its number is a multiple of this (a failed one
    /// always): a long run's log stays small, and still shows each kind alive and who answered.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "until_eof")]
    answered_every: u64,
}

/// What every query thread shares.
struct Settings {
    server: SocketAddr,
    deadline: Instant,
    interval: Duration,
    timeout: Duration,
    mapped: bool,
    answered_every: u64,
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
        answered_every: args.answered_every,
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
            let open_loop = args.open_loop;
            thread::spawn(move || {
                if open_loop {
                    run_open_loop(&settings, kind, (index as u16) << 13)
                } else {
                    run(&settings, kind, (index as u16) << 13)
                }
            })
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
        // A refused send is asked again at once from a new socket, as resolvers do: c-ares
        // closes its connected socket and opens another; glibc (a socket per query) closes it
        // and goes on to its next try (res_send.c: `send_dg` returns 0; 2 tries by default).
        // A receive timeout keeps the socket, and fails the query here.
        let reopened = kind != Kind::Long
            && result
                .as_ref()
                .is_err_and(|error| error.to_string() == SEND_FAILED);
        if reopened {
            match kind {
                Kind::Connected => match open(settings, true) {
                    Ok(socket) => {
                        long_lived = Some(socket);
                        (steered_ms, result) = query_once(settings, kind, long_lived.as_ref(), id);
                    }
                    Err(error) => result = Err(error),
                },
                _ => (steered_ms, result) = query_once(settings, kind, None, id),
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

/// A query of `--open-loop` waiting for its answer.
struct Pending {
    id: u16,
    seq: u64,
    begun_ms: u64,
    steered_ms: u64,
    reopened: bool,
    deadline: Instant,
    /// Its own socket (`fresh`), else the kind's long-lived one.
    socket: Option<UdpSocket>,
}

/// `--open-loop`: a query from `kind` every interval until the deadline, answers matched by id as
/// they come, each query failed once its timeout passes unanswered.
fn run_open_loop(settings: &Settings, kind: Kind, first_id: u16) -> anyhow::Result<()> {
    let mut long_lived = match kind {
        Kind::Fresh => None,
        Kind::Long => Some(nonblocking(open(settings, false)?)?),
        Kind::Connected => Some(nonblocking(open(settings, true)?)?),
    };
    let mut pending: Vec<Pending> = Vec::new();
    let (mut id, mut seq) = (first_id, 0);
    let mut next_send = Instant::now();
    let mut buffer = [0u8; 4096];
    while settings.running() || !pending.is_empty() {
        let now = Instant::now();
        if settings.running() && now >= next_send {
            // A thread that fell behind (descheduled on a busy machine) skips the queries it
            // missed instead of sending them in a burst: the offered load never exceeds the
            // rate, so a slow moment is not followed by a flood that the servers of a slowed VM
            // cannot answer within the timeout (seen: a hundred queries begun in the same ms).
            next_send = (next_send + settings.interval).max(now);
            id = id.wrapping_add(1);
            let begun_ms = now_ms();
            let mut reopened = false;
            let mut sent = send_open_loop(settings, kind, long_lived.as_ref(), id);
            let refused = sent
                .as_ref()
                .is_err_and(|error| error.to_string() == SEND_FAILED);
            if kind == Kind::Fresh && refused {
                // As glibc does (see `run`): the query asked again at once from a new socket.
                reopened = true;
                sent = send_open_loop(settings, kind, None, id);
            } else if kind == Kind::Connected && refused {
                // As c-ares does: a new socket, and the query asked again at once; the queries
                // still pending on the old socket, whose answers it can no longer hear, are
                // asked again on the new one (c-ares requeues a closed connection's queries).
                reopened = true;
                long_lived = Some(nonblocking(open(settings, true)?)?);
                for query in &mut pending {
                    query.reopened = true;
                    let _ = send_open_loop(settings, kind, long_lived.as_ref(), query.id);
                    query.steered_ms = now_ms();
                }
                sent = send_open_loop(settings, kind, long_lived.as_ref(), id);
            }
            let record = |error: Option<String>| StreamRecord {
                seq,
                begun_ms,
                steered_ms: now_ms(),
                done_ms: now_ms(),
                kind: kind.name().to_owned(),
                answer: None,
                error,
                reopened,
            };
            match sent {
                Ok(socket) => pending.push(Pending {
                    id,
                    seq,
                    begun_ms,
                    steered_ms: now_ms(),
                    reopened,
                    deadline: Instant::now() + settings.timeout,
                    socket,
                }),
                Err(error) => emit(settings, record(None), Err(error)),
            }
            seq += 1;
        }
        // Wait for an answer, at most until the next send is due, then read the sockets that
        // have one (the long-lived socket, or each query's own).
        let wait = next_send
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(1));
        let sockets: Vec<&UdpSocket> = match &long_lived {
            Some(socket) => vec![socket],
            None => pending
                .iter()
                .filter_map(|query| query.socket.as_ref())
                .collect(),
        };
        let mut answers: Vec<(u16, SocketAddr, anyhow::Result<IpAddr>)> = Vec::new();
        for socket in readable(&sockets, wait) {
            while let Ok((len, from)) = socket.recv_from(&mut buffer) {
                if let Some(answered) = answer_id(&buffer[..len]) {
                    answers.push((answered, from, first_answer(answered, &buffer[..len])));
                }
            }
        }
        for (answered, from, result) in answers {
            let Some(position) = pending.iter().position(|query| query.id == answered) else {
                continue;
            };
            let query = pending.swap_remove(position);
            // An unconnected socket's reply must come from the server asked.
            let result = match kind {
                Kind::Long if from != settings.server => Err(anyhow::anyhow!(
                    "reply from {from}, not {}",
                    settings.server
                )),
                _ => result,
            };
            emit(settings, open_loop_record(kind, &query), result);
        }
        let now = Instant::now();
        let mut index = 0;
        while index < pending.len() {
            if pending[index].deadline <= now {
                let query = pending.swap_remove(index);
                let error = anyhow::anyhow!("no answer to query {} within the timeout", query.id);
                emit(settings, open_loop_record(kind, &query), Err(error));
            } else {
                index += 1;
            }
        }
    }
    Ok(())
}

/// Sends query `id` of `--open-loop`: from `long_lived`, or from a fresh connected socket, which
/// is returned to wait on.
fn send_open_loop(
    settings: &Settings,
    kind: Kind,
    long_lived: Option<&UdpSocket>,
    id: u16,
) -> anyhow::Result<Option<UdpSocket>> {
    let message = query(id, PROBE_NAME, RecordType::A)?;
    match long_lived {
        Some(socket) if kind == Kind::Long => {
            socket
                .send_to(&message, settings.server)
                .context("sendto")?;
            Ok(None)
        }
        Some(socket) => {
            socket.send(&message).context(SEND_FAILED)?;
            Ok(None)
        }
        None => {
            let socket = nonblocking(open(settings, true)?)?;
            socket.send(&message).context(SEND_FAILED)?;
            Ok(Some(socket))
        }
    }
}

/// The record of an `--open-loop` query that ended now.
fn open_loop_record(kind: Kind, query: &Pending) -> StreamRecord {
    StreamRecord {
        seq: query.seq,
        begun_ms: query.begun_ms,
        steered_ms: query.steered_ms,
        done_ms: now_ms(),
        kind: kind.name().to_owned(),
        answer: None,
        error: None,
        reopened: query.reopened,
    }
}

fn nonblocking(socket: UdpSocket) -> anyhow::Result<UdpSocket> {
    socket.set_nonblocking(true).context("nonblocking")?;
    Ok(socket)
}

/// The sockets of `sockets` with a datagram waiting, after waiting at most `wait` for one.
fn readable<'a>(sockets: &[&'a UdpSocket], wait: Duration) -> Vec<&'a UdpSocket> {
    use std::os::fd::AsRawFd as _;
    if sockets.is_empty() {
        thread::sleep(wait);
        return Vec::new();
    }
    let mut fds: Vec<libc::pollfd> = sockets
        .iter()
        .map(|socket| libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let millis = libc::c_int::try_from(wait.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures for the call's duration.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
    if ready <= 0 {
        return Vec::new();
    }
    sockets
        .iter()
        .zip(&fds)
        .filter(|(_, fd)| fd.revents != 0)
        .map(|(socket, _)| *socket)
        .collect()
}

/// The id of a DNS response.
fn answer_id(message: &[u8]) -> Option<u16> {
    (message.len() >= 12).then(|| u16::from_be_bytes([message[0], message[1]]))
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
        Ok(_) if !record.seq.is_multiple_of(settings.answered_every) => return,
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
