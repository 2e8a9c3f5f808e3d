//! A test DNS server: answers every A and AAAA question with the addresses it is given, which
//! identify it, over UDP and TCP on every `--listen` address. Prints `ready` once all are bound.

use std::{
    io::Write as _,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use bpf_tests::dns::{Identity, answer, answer_with, read_tcp_message, write_tcp_message};
use clap::Parser;
use hickory_proto::op::ResponseCode;

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
    /// The response code of every UDP answer (a cache whose upstreams fail, or that refuses, or a
    /// name that does not exist).
    #[arg(long, value_enum, default_value_t = Rcode::Noerror)]
    rcode: Rcode,
    /// Wait this long before each UDP answer (a slow cache).
    #[arg(long, default_value_t = 0)]
    answer_delay_ms: u64,
    /// Print `query` when a UDP query arrives, before answering it.
    #[arg(long)]
    log_queries: bool,
    /// On SIGTERM, go on serving for this long, then exit (a cache that shuts down slowly, as
    /// unbound does under load or CoreDNS in its `lameduck` period). Without it SIGTERM has its
    /// default action.
    #[arg(long)]
    term_linger_ms: Option<u64>,
}

/// Set by the SIGTERM handler (`--term-linger-ms`).
static TERMINATING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigterm(_: libc::c_int) {
    TERMINATING.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Handles SIGTERM: serving goes on for `linger`, then the process exits (its sockets close).
fn linger_on_sigterm(linger: Duration) -> anyhow::Result<()> {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::Handler(on_sigterm),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe { sigaction(Signal::SIGTERM, &action) }.context("installing the SIGTERM handler")?;
    thread::spawn(move || {
        while !TERMINATING.load(std::sync::atomic::Ordering::SeqCst) {
            thread::sleep(Duration::from_millis(1));
        }
        thread::sleep(linger);
        std::process::exit(0);
    });
    Ok(())
}

/// `--rcode`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Rcode {
    Noerror,
    Nxdomain,
    Servfail,
    Refused,
}

impl From<Rcode> for ResponseCode {
    fn from(rcode: Rcode) -> Self {
        match rcode {
            Rcode::Noerror => Self::NoError,
            Rcode::Nxdomain => Self::NXDomain,
            Rcode::Servfail => Self::ServFail,
            Rcode::Refused => Self::Refused,
        }
    }
}

/// How the UDP side answers.
#[derive(Clone, Copy, Debug)]
struct Answering {
    identity: Identity,
    code: ResponseCode,
    delay: Duration,
    log_queries: bool,
    serve_from: Instant,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let identity = Identity {
        a: args.a,
        aaaa: args.aaaa,
    };
    let serve_from = Instant::now() + Duration::from_millis(args.mute_ms);
    let answering = Answering {
        identity,
        code: args.rcode.into(),
        delay: Duration::from_millis(args.answer_delay_ms),
        log_queries: args.log_queries,
        serve_from,
    };
    if let Some(linger) = args.term_linger_ms {
        linger_on_sigterm(Duration::from_millis(linger))?;
    }
    let mut workers = Vec::new();
    for address in &args.listen {
        for _ in 0..args.udp_sockets {
            let udp = bind_udp(*address, args.udp_sockets > 1)
                .with_context(|| format!("binding udp {address}"))?;
            workers.push(thread::spawn(move || serve_udp(&udp, &answering)));
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

fn serve_udp(socket: &UdpSocket, answering: &Answering) {
    wait_until(answering.serve_from);
    let mut buffer = [0u8; 4096];
    loop {
        let Ok((len, from)) = socket.recv_from(&mut buffer) else {
            continue;
        };
        if answering.log_queries {
            let mut stdout = std::io::stdout().lock();
            let _ = writeln!(stdout, "query");
            let _ = stdout.flush();
        }
        if !answering.delay.is_zero() {
            thread::sleep(answering.delay);
        }
        if let Ok(reply) = answer_with(&buffer[..len], &answering.identity, answering.code) {
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

/// Answers a connection's queries until the client closes it.
fn serve_tcp_connection(mut stream: TcpStream, identity: &Identity) -> anyhow::Result<()> {
    while let Some(request) = read_tcp_message(&mut stream)? {
        write_tcp_message(&mut stream, &answer(&request, identity)?)?;
    }
    Ok(())
}
