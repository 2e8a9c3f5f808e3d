//! A real resolver library in the tests: c-ares, through pycares from PyPI (`cargo xtask setup`
//! installs it into `target/test-python` for Debian's `/usr/bin/python3`, which the VMs share).
//! `clients/cares-stream.py` asks one server a stream of unique names from one channel.

use std::{
    io::{BufRead as _, BufReader, Read as _},
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

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/cares-stream.py")
}

/// How the channel keeps its socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flags {
    /// `ARES_FLAG_STAYOPEN`: one socket for the channel's life (gRPC C-core's setting).
    StayOpen,
    /// c-ares's default: idle sockets are closed.
    Default,
}

/// One query of the stream.
#[derive(Clone, Debug, Deserialize)]
pub struct CaresRecord {
    /// Its sequence number.
    pub seq: u64,
    /// When it was handed to c-ares, milliseconds since the Unix epoch.
    pub begun_ms: u64,
    /// When c-ares called back.
    pub done_ms: u64,
    /// The first A record, when answered.
    pub answer: Option<std::net::IpAddr>,
    /// The c-ares error (`ARES_ETIMEOUT`, ...), when not.
    pub error: Option<String>,
}

impl CaresRecord {
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
pub struct CaresStream {
    child: std::process::Child,
    stdout: BufReader<ChildStdout>,
    flags: Flags,
}

impl CaresStream {
    /// Starts a stream from `ns` to `server`, one query every 20 ms until [`Self::finish`];
    /// returns once its channel is up and its first query is on its way.
    pub fn start(
        sandbox: &Sandbox,
        ns: Ns,
        server: std::net::IpAddr,
        flags: Flags,
    ) -> anyhow::Result<Self> {
        let deps = python_path();
        if !deps.join("pycares").is_dir() {
            bail!(
                "pycares is not installed in {}: run `cargo xtask setup`",
                deps.display()
            );
        }
        let (mut command, _procs) = sandbox.client_command(ns, sandbox.cgroup(), PYTHON)?;
        command
            .arg(script())
            .args(["--server", &server.to_string()])
            .env("PYTHONPATH", &deps)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if flags == Flags::StayOpen {
            command.arg("--stayopen");
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {command:?}"))?;
        let mut stdout = BufReader::new(child.stdout.take().context("piped stdout")?);
        let mut first = String::new();
        stdout
            .read_line(&mut first)
            .context("reading the c-ares stream's first line")?;
        if !first.contains("\"streaming\"") {
            let mut err = String::new();
            if let Some(mut stderr) = child.stderr.take() {
                let _ = stderr.read_to_string(&mut err);
            }
            bail!("the c-ares stream did not start: {first:?} {err}");
        }
        Ok(Self {
            child,
            stdout,
            flags,
        })
    }

    /// Ends the stream (its standard input closes), waits for its last queries and returns them
    /// in order; fails unless every query it asked ended (answered or failed).
    pub fn finish(mut self) -> anyhow::Result<CaresReport> {
        drop(self.child.stdin.take());
        let mut out = String::new();
        let mut err = String::new();
        self.stdout
            .read_to_string(&mut out)
            .context("reading the c-ares stream")?;
        self.child
            .stderr
            .take()
            .context("piped stderr")?
            .read_to_string(&mut err)
            .context("reading the c-ares stream's errors")?;
        let status = self.child.wait().context("waiting for the c-ares stream")?;
        if !status.success() {
            bail!("the c-ares stream failed ({status}): {err}");
        }
        let mut records = Vec::new();
        let mut totals = None;
        for line in out.lines() {
            if line.contains("\"asked\"") {
                let value: serde_json::Value = serde_json::from_str(line)?;
                totals = Some((value["asked"].as_u64(), value["ended"].as_u64()));
            } else {
                records.push(
                    serde_json::from_str::<CaresRecord>(line)
                        .with_context(|| format!("the c-ares stream printed {line:?}"))?,
                );
            }
        }
        match totals {
            Some((Some(asked), Some(ended))) if asked == ended => {}
            other => bail!("not every query of the c-ares stream ended: {other:?}; {err}"),
        }
        Ok(CaresReport {
            flags: self.flags,
            records,
        })
    }
}

impl Drop for CaresStream {
    fn drop(&mut self) {
        // Our own child; a no-op once `finish` waited for it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a stream saw.
#[derive(Debug)]
pub struct CaresReport {
    /// The channel's flags.
    pub flags: Flags,
    /// Every query, in order.
    pub records: Vec<CaresRecord>,
}

impl CaresReport {
    /// Queries begun in `[from, to)`.
    pub fn between(&self, from: u64, to: u64) -> impl Iterator<Item = &CaresRecord> {
        self.records
            .iter()
            .filter(move |record| record.begun_ms >= from && record.begun_ms < to)
    }

    /// The first query begun at or after `from` that `by` answered (`cache`, or `upstream`
    /// for either upstream).
    #[must_use]
    pub fn first_answered_by(&self, by: &str, from: u64) -> Option<&CaresRecord> {
        self.records
            .iter()
            .find(|record| record.begun_ms >= from && record.answered_by().starts_with(by))
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
            self.flags,
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
