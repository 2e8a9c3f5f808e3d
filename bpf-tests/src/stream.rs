//! A continuous query stream through a failover event, and what it shows: who answered when,
//! the gap between the last cache answer and the first upstream answer, and what was lost.

use std::{net::SocketAddr, os::unix::process::ExitStatusExt as _, time::Duration};

use anyhow::Context as _;

use crate::{
    command::TestProcess,
    dns::StreamRecord,
    pace::{paced, paced_ms},
    sandbox::{Ns, Sandbox},
    topology::who,
};

/// A running `dns-stream` (fresh sockets and one long-lived socket).
#[derive(Debug)]
pub struct Stream {
    process: TestProcess,
}

impl Stream {
    /// Starts a stream from `ns`, in the sandbox's cgroup, to `server`, for `duration`, from fresh
    /// sockets and one long-lived unconnected socket.
    pub fn start(
        sandbox: &Sandbox,
        ns: Ns,
        server: SocketAddr,
        duration: Duration,
    ) -> anyhow::Result<Self> {
        Self::start_with(sandbox, ns, server, duration, &[])
    }

    /// The same, with extra `dns-stream` arguments (`--kinds`, `--mapped`).
    pub fn start_with(
        sandbox: &Sandbox,
        ns: Ns,
        server: SocketAddr,
        duration: Duration,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let (mut command, procs) = sandbox.client_command(
            ns,
            sandbox.cgroup(),
            &sandbox.tools().dns_stream.display().to_string(),
        )?;
        // A query's timeout is stretched with the machine's pace; the stream's duration is the
        // caller's (stretched by the caller where its events are).
        command.args([
            "--server",
            &server.to_string(),
            "--duration-ms",
            &duration.as_millis().to_string(),
            "--timeout-ms",
            &paced_ms(300).to_string(),
        ]);
        command.args(extra);
        let process = TestProcess::start("dns-stream", command, "ready", Duration::from_secs(10))?;
        drop(procs);
        Ok(Self { process })
    }

    /// The records completed since the last call (for a live display).
    pub fn poll(&mut self) -> Vec<StreamRecord> {
        self.process
            .drain()
            .iter()
            .filter(|line| line.starts_with('{'))
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect()
    }

    /// Waits for the stream to end and returns its records (every one, polled or not).
    pub fn finish(mut self) -> anyhow::Result<StreamReport> {
        let status = self.process.wait_exit(Duration::from_secs(120))?;
        anyhow::ensure!(status.success(), "dns-stream failed: {status}");
        // The reader threads deliver the last lines right after the exit.
        std::thread::sleep(Duration::from_millis(50));
        self.report()
    }

    /// Waits until the records so far satisfy `done` (for at most `limit`, stretched by
    /// [`crate::pace`]), then ends the stream early (SIGTERM: a query still in flight is not
    /// recorded) and returns its records. For streams whose events take as long as they take.
    pub fn stop_once(
        mut self,
        what: &str,
        limit: Duration,
        mut done: impl FnMut(&StreamReport) -> bool,
    ) -> anyhow::Result<StreamReport> {
        let deadline = std::time::Instant::now() + paced(limit);
        loop {
            let report = self.report()?;
            if done(&report) {
                break;
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "{what} did not happen within {limit:?}: {}",
                report.summary()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.process.signal(nix::sys::signal::Signal::SIGTERM)?;
        let status = self.process.wait_exit(Duration::from_secs(10))?;
        anyhow::ensure!(
            status.success() || status.signal() == Some(libc::SIGTERM),
            "dns-stream failed: {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
        self.report()
    }

    /// Every record printed so far.
    fn report(&mut self) -> anyhow::Result<StreamReport> {
        let records = self
            .process
            .printed()
            .iter()
            .filter(|line| line.starts_with('{'))
            .map(|line| serde_json::from_str(line).with_context(|| format!("bad record {line:?}")))
            .collect::<anyhow::Result<Vec<StreamRecord>>>()?;
        Ok(StreamReport { records })
    }
}

/// The records of one stream.
#[derive(Clone, Debug)]
pub struct StreamReport {
    /// Every query, in completion order.
    pub records: Vec<StreamRecord>,
}

impl StreamReport {
    /// Who answered a record: "cache", "upstream A", ..., or "failed".
    #[must_use]
    pub fn answered_by(record: &StreamRecord) -> &'static str {
        if record.error.is_some() {
            "failed"
        } else {
            who(record.answer)
        }
    }

    fn is_upstream(record: &StreamRecord) -> bool {
        Self::answered_by(record).starts_with("upstream")
    }

    /// Records sent in `[from, to)` (milliseconds since the epoch).
    pub fn between(&self, from: u64, to: u64) -> impl Iterator<Item = &StreamRecord> {
        self.records
            .iter()
            .filter(move |record| record.sent_ms >= from && record.sent_ms < to)
    }

    /// The last record answered by the cache that was sent before `before`.
    #[must_use]
    pub fn last_cache_answer(&self, before: u64) -> Option<&StreamRecord> {
        self.records
            .iter()
            .filter(|record| record.sent_ms < before && Self::answered_by(record) == "cache")
            .max_by_key(|record| record.sent_ms)
    }

    /// The first record answered by an upstream sent at or after `after`.
    #[must_use]
    pub fn first_upstream_answer(&self, after: u64) -> Option<&StreamRecord> {
        self.records
            .iter()
            .filter(|record| record.sent_ms >= after && Self::is_upstream(record))
            .min_by_key(|record| record.sent_ms)
    }

    /// The first record answered by the cache sent at or after `after`.
    #[must_use]
    pub fn first_cache_answer(&self, after: u64) -> Option<&StreamRecord> {
        self.records
            .iter()
            .filter(|record| record.sent_ms >= after && Self::answered_by(record) == "cache")
            .min_by_key(|record| record.sent_ms)
    }

    /// How many queries sent after the flip whose first upstream answer was sent at
    /// `first_upstream_ms` got no answer. A query sent in that same millisecond may have left
    /// just before the flip, into a cache socket that was closing, so it does not count: send
    /// times have millisecond resolution, and only a later millisecond is surely after.
    #[must_use]
    pub fn failures_after_flip(&self, first_upstream_ms: u64) -> usize {
        self.failures_between(first_upstream_ms + 1, u64::MAX)
    }

    /// How many queries sent in `[from, to)` got no answer.
    #[must_use]
    pub fn failures_between(&self, from: u64, to: u64) -> usize {
        self.between(from, to)
            .filter(|record| record.error.is_some())
            .count()
    }

    /// A summary of who answered, for test output, followed by every failed query: when it was
    /// sent (relative to the first query), from which socket kind, and what went wrong.
    #[must_use]
    pub fn summary(&self) -> String {
        let mut counts = std::collections::BTreeMap::new();
        for record in &self.records {
            *counts.entry(Self::answered_by(record)).or_insert(0) += 1;
        }
        let start = self
            .records
            .iter()
            .map(|record| record.sent_ms)
            .min()
            .unwrap_or_default();
        let failures: String = self
            .records
            .iter()
            .filter_map(|record| {
                let error = record.error.as_ref()?;
                let offset = record.sent_ms.saturating_sub(start);
                Some(format!(
                    "\n  failed at +{offset} ms ({}): {error}",
                    record.kind
                ))
            })
            .collect();
        format!("{} queries: {counts:?}{failures}", self.records.len())
    }

    /// When the first query was sent (milliseconds since the epoch).
    #[must_use]
    pub fn started_ms(&self) -> u64 {
        self.records
            .iter()
            .map(|record| record.sent_ms)
            .min()
            .unwrap_or_default()
    }
}
