//! Real resolver libraries in the tests, each asking one server a stream of unique names:
//! - c-ares, through pycares from PyPI (`cargo xtask setup` installs it into `target/test-python`
//!   for Debian's `/usr/bin/python3`), by `clients/cares-stream.py`;
//! - glibc (`getent ahosts`, and `res_query` on one resolver state) and musl (a static binary,
//!   `clients/musl-getaddrinfo.c`, which `build.rs` builds with musl-gcc), by
//!   `clients/libc-stream.py`. They ask the nameserver of the namespace's `/etc/resolv.conf`.

use std::{
    io::{BufRead as _, BufReader, Read as _},
    net::IpAddr,
    path::PathBuf,
    process::{ChildStdout, Stdio},
};

use anyhow::{Context as _, bail};
use serde::Deserialize;

use crate::{
    sandbox::{Ns, Sandbox},
    topology::who,
};

/// Debian's interpreter: the same binary on the host and in the VMs.
pub const PYTHON: &str = "/usr/bin/python3";

/// Where `cargo xtask setup` installs pycares (`pip install --target`).
#[must_use]
pub fn python_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-python")
}

fn client(script: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("clients")
        .join(script)
}

/// The static musl client `build.rs` built, or an error that says how to get it.
fn musl_client() -> anyhow::Result<PathBuf> {
    let built = env!("MUSL_GETADDRINFO");
    if built.is_empty() {
        bail!("{}", env!("MUSL_GETADDRINFO_MISSING"));
    }
    Ok(PathBuf::from(built))
}

/// What the glibc and musl clients read from `/etc/resolv.conf`, besides the nameserver: a 1 s
/// timeout (both default to 5 s) so that a query lost to a hung cache ends within the test, and
/// 2 attempts, both libraries' default.
pub const LIBC_OPTIONS: &str = "options timeout:1 attempts:2";

/// A resolver library, and how it keeps its sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolver {
    /// c-ares with `ARES_FLAG_STAYOPEN`: one connected socket for the channel's life (gRPC
    /// C-core's setting).
    CaresStayOpen,
    /// c-ares with its default flags: idle sockets are closed.
    CaresDefault,
    /// glibc's getaddrinfo (`getent ahosts`, a process per query): a connected socket per lookup,
    /// A and AAAA sent at once.
    GlibcGetaddrinfo,
    /// glibc's `res_query` in a loop on one resolver state with `RES_STAYOPEN`: one connected
    /// socket across queries, one query at a time.
    GlibcResQueryStayOpen,
    /// musl's getaddrinfo (a static binary, a process per query): an unconnected socket per
    /// lookup.
    MuslGetaddrinfo,
    /// A raw connected UDP socket kept across queries, reopened when a send fails and the query
    /// asked again at once (`dns-stream --kinds connected`).
    RawConnected,
    /// A raw unconnected UDP socket kept across queries (`dns-stream --kinds long`).
    RawUnconnected,
}

impl Resolver {
    /// The program and the arguments that run the client, asking `server`.
    fn command_line(
        self,
        sandbox: &Sandbox,
        server: IpAddr,
    ) -> anyhow::Result<(String, Vec<String>)> {
        let python = |script: &str, args: &[&str]| {
            let mut line = vec![client(script).display().to_string()];
            line.extend(args.iter().map(|arg| (*arg).to_owned()));
            (PYTHON.to_owned(), line)
        };
        let raw = |kind: &str| {
            (
                sandbox.tools().dns_stream.display().to_string(),
                [
                    "--until-eof",
                    "--kinds",
                    kind,
                    "--timeout-ms",
                    "1000",
                    "--server",
                    &std::net::SocketAddr::new(server, 53).to_string(),
                ]
                .map(str::to_owned)
                .to_vec(),
            )
        };
        let server = server.to_string();
        Ok(match self {
            Self::CaresStayOpen => python("cares-stream.py", &["--stayopen", "--server", &server]),
            Self::CaresDefault => python("cares-stream.py", &["--server", &server]),
            Self::GlibcGetaddrinfo => python("libc-stream.py", &["--client", "getent"]),
            Self::GlibcResQueryStayOpen => python("libc-stream.py", &["--client", "res-query"]),
            Self::MuslGetaddrinfo => {
                let musl = musl_client()?.display().to_string();
                python("libc-stream.py", &["--client", "musl", "--musl", &musl])
            }
            Self::RawConnected => raw("connected"),
            Self::RawUnconnected => raw("long"),
        })
    }

    fn is_cares(self) -> bool {
        matches!(self, Self::CaresStayOpen | Self::CaresDefault)
    }

    /// Whether the client reads the nameserver from `/etc/resolv.conf`.
    fn reads_resolv_conf(self) -> bool {
        matches!(
            self,
            Self::GlibcGetaddrinfo | Self::GlibcResQueryStayOpen | Self::MuslGetaddrinfo
        )
    }
}

/// One query of the stream.
#[derive(Clone, Debug, Deserialize)]
pub struct ResolverRecord {
    /// Its sequence number.
    pub seq: u64,
    /// When it was handed to the library, milliseconds since the Unix epoch.
    pub begun_ms: u64,
    /// When the library gave its answer or its error.
    pub done_ms: u64,
    /// The first A record, when answered.
    pub answer: Option<IpAddr>,
    /// The library's error (c-ares: `ARES_ETIMEOUT`, ...; glibc: `h_errno`; getent and musl:
    /// the exit code and message), when not.
    pub error: Option<String>,
}

impl ResolverRecord {
    /// Who answered: `cache`, `upstream A`, `upstream B`, or `failed`.
    #[must_use]
    pub fn answered_by(&self) -> &'static str {
        if self.error.is_some() {
            "failed"
        } else {
            who(self.answer)
        }
    }
}

/// A running stream from the test cgroup.
#[derive(Debug)]
pub struct ResolverStream {
    child: std::process::Child,
    stdout: BufReader<ChildStdout>,
    resolver: Resolver,
}

impl ResolverStream {
    /// Starts a stream of `resolver` from `ns` to `server`, one query every 20 ms until
    /// [`Self::finish`]; returns once it is up and its first query is on its way. For the glibc
    /// and musl clients it first points the namespace's `/etc/resolv.conf` at `server`, with
    /// [`LIBC_OPTIONS`].
    pub fn start(
        sandbox: &Sandbox,
        ns: Ns,
        server: IpAddr,
        resolver: Resolver,
    ) -> anyhow::Result<Self> {
        let deps = python_path();
        if resolver.is_cares() && !deps.join("pycares").is_dir() {
            bail!(
                "pycares is not installed in {}: run `cargo xtask setup`",
                deps.display()
            );
        }
        if resolver.reads_resolv_conf() {
            sandbox
                .netns(ns)
                .write_resolv_conf(&format!("nameserver {server}\n{LIBC_OPTIONS}\n"))?;
        }
        let (program, args) = resolver.command_line(sandbox, server)?;
        let (mut command, _procs) = sandbox.client_command(ns, sandbox.cgroup(), &program)?;
        command
            .args(&args)
            .env("PYTHONPATH", &deps)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {command:?}"))?;
        let mut stdout = BufReader::new(child.stdout.take().context("piped stdout")?);
        let mut first = String::new();
        stdout
            .read_line(&mut first)
            .with_context(|| format!("reading the {resolver:?} stream's first line"))?;
        if !first.contains("\"streaming\"") {
            let mut err = String::new();
            if let Some(mut stderr) = child.stderr.take() {
                let _ = stderr.read_to_string(&mut err);
            }
            bail!("the {resolver:?} stream did not start: {first:?} {err}");
        }
        Ok(Self {
            child,
            stdout,
            resolver,
        })
    }

    /// Ends the stream (its standard input closes), waits for its last queries and returns them
    /// in order; fails unless every query it asked ended (answered or failed).
    pub fn finish(mut self) -> anyhow::Result<ResolverReport> {
        drop(self.child.stdin.take());
        let mut out = String::new();
        let mut err = String::new();
        self.stdout
            .read_to_string(&mut out)
            .context("reading the resolver stream")?;
        self.child
            .stderr
            .take()
            .context("piped stderr")?
            .read_to_string(&mut err)
            .context("reading the resolver stream's errors")?;
        let status = self
            .child
            .wait()
            .context("waiting for the resolver stream")?;
        if !status.success() {
            bail!("the resolver stream failed ({status}): {err}");
        }
        let mut records = Vec::new();
        let mut totals = None;
        for line in out.lines() {
            if line.contains("\"asked\"") {
                let value: serde_json::Value = serde_json::from_str(line)?;
                totals = Some((value["asked"].as_u64(), value["ended"].as_u64()));
            } else {
                records.push(
                    serde_json::from_str::<ResolverRecord>(line)
                        .with_context(|| format!("the resolver stream printed {line:?}"))?,
                );
            }
        }
        match totals {
            Some((Some(asked), Some(ended))) if asked == ended => {}
            other => bail!("not every query of the resolver stream ended: {other:?}; {err}"),
        }
        Ok(ResolverReport {
            resolver: self.resolver,
            records,
        })
    }
}

impl Drop for ResolverStream {
    fn drop(&mut self) {
        // Our own child; a no-op once `finish` waited for it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a stream saw.
#[derive(Debug)]
pub struct ResolverReport {
    /// The library.
    pub resolver: Resolver,
    /// Every query, in order.
    pub records: Vec<ResolverRecord>,
}

impl ResolverReport {
    /// Queries begun in `[from, to)`.
    pub fn between(&self, from: u64, to: u64) -> impl Iterator<Item = &ResolverRecord> {
        self.records
            .iter()
            .filter(move |record| record.begun_ms >= from && record.begun_ms < to)
    }

    /// One line per kind of outcome, then the failures, for assertion messages.
    #[must_use]
    pub fn summary(&self) -> String {
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for record in &self.records {
            *counts.entry(record.answered_by()).or_default() += 1;
        }
        let mut text = format!(
            "{:?}: {} queries: {counts:?}",
            self.resolver,
            self.records.len()
        );
        for record in self.records.iter().filter(|record| record.error.is_some()) {
            text.push_str(&format!(
                "\n  failed: q{} begun {} ended {}: {:?}",
                record.seq, record.begun_ms, record.done_ms, record.error
            ));
        }
        text
    }
}
