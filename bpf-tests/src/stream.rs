//! A continuous query stream through a failover event, and what it shows: who answered when,
//! the gap between the last cache answer and the first upstream answer, and what was lost.

use std::{net::SocketAddr, os::unix::process::ExitStatusExt as _, time::Duration};

use anyhow::Context as _;
use redirector_common::activity::FLIP_SIGNALLED;

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
    ///
    /// `duration` is not stretched: it must outlast the caller's events, which the caller paces
    /// ([`crate::pace::pause`]), so stretch it with them ([`paced`]). A stream that
    /// [`Self::stop_once`] ends is given a ceiling (stretched as well), which it never reaches.
    pub fn start(
        sandbox: &Sandbox,
        ns: Ns,
        server: SocketAddr,
        duration: Duration,
    ) -> anyhow::Result<Self> {
        Self::start_with(sandbox, ns, server, duration, &[])
    }

    /// A stream from every socket kind (fresh, kept unconnected, kept connected), a query from
    /// each every `interval_ms`, none waiting for the earlier answers (`--open-loop`).
    pub fn open_loop(
        sandbox: &Sandbox,
        server: SocketAddr,
        duration: Duration,
        interval_ms: u64,
    ) -> anyhow::Result<Self> {
        let interval = interval_ms.to_string();
        Self::start_with(
            sandbox,
            Ns::Pod,
            server,
            duration,
            &[
                "--kinds",
                "fresh,connected,long",
                "--open-loop",
                "--interval-ms",
                &interval,
            ],
        )
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

    /// Waits for the stream to end (for at most 120 s past its duration's end, stretched by
    /// [`crate::pace`]) and returns its records (every one, polled or not).
    pub fn finish(mut self) -> anyhow::Result<StreamReport> {
        let status = self.process.wait_exit(Duration::from_secs(120))?;
        anyhow::ensure!(status.success(), "dns-stream failed: {status}");
        self.process.wait_output_closed(Duration::from_secs(5));
        self.report()
    }

    /// Waits until the records so far satisfy `done` (for at most `limit`, stretched by
    /// [`crate::pace`]: give the host's figure), then ends the stream early (SIGTERM: a query
    /// still in flight is not recorded) and returns its records. For streams whose events take
    /// as long as they take. Fails at once, and says so, when the stream's duration ran out
    /// first.
    pub fn stop_once(
        mut self,
        what: &str,
        limit: Duration,
        mut done: impl FnMut(&StreamReport) -> bool,
    ) -> anyhow::Result<StreamReport> {
        let limit = paced(limit);
        let deadline = std::time::Instant::now() + limit;
        loop {
            let report = self.report()?;
            if done(&report) {
                break;
            }
            if let Some(status) = self.process.exited()? {
                self.process.wait_output_closed(Duration::from_secs(5));
                let report = self.report()?;
                anyhow::ensure!(status.success(), "dns-stream failed: {status}");
                anyhow::ensure!(
                    done(&report),
                    "{what} did not happen before the stream's duration ran out (give it a \
                     longer one, stretched by the pace): {}",
                    report.summary()
                );
                return Ok(report);
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
        self.process.wait_output_closed(Duration::from_secs(5));
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

    /// Asserts that a cache told to stop was known to the signal program (`activity`, its
    /// listener's record, counts a signal flip; `cache` names it in messages) and that of the
    /// queries begun after the signal moved the DNS, more than 100, none was lost.
    ///
    /// `signalled_ms` is read once `kill` has returned. The signal program runs in the receiving
    /// task when it next runs (`signal_deliver`), which on the host is within microseconds and in
    /// a slower VM may be milliseconds later: a query sent in between still reaches the cache,
    /// which may exit without reading it. So the queries judged are those begun after both, the
    /// flip's time taken from its record (`flip_ns`, `bpf_ktime_get_ns`: CLOCK_MONOTONIC).
    /// Start times are whole milliseconds, so a query begun within that millisecond may have been
    /// sent before; only queries begun in a later millisecond were surely sent after it.
    pub fn assert_signal_lost_nothing_after(
        &self,
        signalled_ms: u64,
        activity: &redirector_common::activity::CacheActivity,
        cache: &str,
    ) {
        println!("{cache}: {}; {activity:?}", self.summary());
        assert!(
            activity.signalled >= 1 && activity.flip_reason == FLIP_SIGNALLED,
            "the signal program did not know {cache} as the cache: {activity:?}"
        );
        let flipped_ms =
            crate::dns::wall_ms_of_monotonic(activity.flip_ns).expect("CLOCK_MONOTONIC");
        println!(
            "{cache}: the signal program moved the DNS {} ms after kill returned",
            i128::from(flipped_ms) - i128::from(signalled_ms)
        );
        let after = signalled_ms.max(flipped_ms) + 1;
        assert!(
            self.between(after, u64::MAX).count() > 100,
            "too few queries after the signal: {}",
            self.summary()
        );
        assert_eq!(
            self.failures_between(after, u64::MAX),
            0,
            "queries sent after the signal were lost: {}",
            self.summary()
        );
    }

    /// Records begun in `[from, to)` (milliseconds since the epoch).
    pub fn between(&self, from: u64, to: u64) -> impl Iterator<Item = &StreamRecord> {
        self.records
            .iter()
            .filter(move |record| record.begun_ms >= from && record.begun_ms < to)
    }

    /// The last record answered by the cache begun before `before`.
    #[must_use]
    pub fn last_cache_answer(&self, before: u64) -> Option<&StreamRecord> {
        self.records
            .iter()
            .filter(|record| record.begun_ms < before && Self::answered_by(record) == "cache")
            .max_by_key(|record| record.begun_ms)
    }

    /// The first record answered by an upstream, begun at or after `after`.
    #[must_use]
    pub fn first_upstream_answer(&self, after: u64) -> Option<&StreamRecord> {
        self.records
            .iter()
            .filter(|record| record.begun_ms >= after && Self::is_upstream(record))
            .min_by_key(|record| record.begun_ms)
    }

    /// The first record answered by the cache, begun at or after `after`.
    #[must_use]
    pub fn first_cache_answer(&self, after: u64) -> Option<&StreamRecord> {
        self.records
            .iter()
            .filter(|record| record.begun_ms >= after && Self::answered_by(record) == "cache")
            .min_by_key(|record| record.begun_ms)
    }

    /// The moment by which the listener had surely left the cache after `event_ms`: the earliest
    /// return of a send that an upstream answered, among the queries begun at or after the event.
    /// The stream's threads note a query's start before its destination is chosen, so start
    /// times of different threads do not order their steering: a query of one thread may start
    /// later than another's and still be steered earlier, into a cache socket that was closing.
    /// Only a query begun after this moment was surely steered after the flip.
    #[must_use]
    pub fn flipped_by(&self, event_ms: u64) -> Option<u64> {
        self.records
            .iter()
            .filter(|record| record.begun_ms >= event_ms && Self::is_upstream(record))
            .map(|record| record.steered_ms)
            .min()
    }

    /// Records begun after `flipped_by` (see [`Self::flipped_by`]): surely steered after the flip.
    pub fn after_flip(&self, flipped_by: u64) -> impl Iterator<Item = &StreamRecord> {
        self.between(flipped_by + 1, u64::MAX)
    }

    /// How many queries begun after `flipped_by` (see [`Self::flipped_by`]) got no answer.
    #[must_use]
    pub fn failures_after_flip(&self, flipped_by: u64) -> usize {
        self.after_flip(flipped_by)
            .filter(|record| record.error.is_some())
            .count()
    }

    /// How many queries begun in `[from, to)` got no answer.
    #[must_use]
    pub fn failures_between(&self, from: u64, to: u64) -> usize {
        self.between(from, to)
            .filter(|record| record.error.is_some())
            .count()
    }

    /// A summary of who answered, for test output, followed by every failed query: when it began
    /// and when its send returned (relative to the first query), from which socket kind, and
    /// what went wrong.
    #[must_use]
    pub fn summary(&self) -> String {
        let mut counts = std::collections::BTreeMap::new();
        for record in &self.records {
            *counts.entry(Self::answered_by(record)).or_insert(0) += 1;
        }
        let start = self
            .records
            .iter()
            .map(|record| record.begun_ms)
            .min()
            .unwrap_or_default();
        let failures: String = self
            .records
            .iter()
            .filter_map(|record| {
                let error = record.error.as_ref()?;
                Some(format!(
                    "\n  failed: begun at +{} ms, sent by +{} ms ({}): {error}",
                    record.begun_ms.saturating_sub(start),
                    record.steered_ms.saturating_sub(start),
                    record.kind
                ))
            })
            .collect();
        format!("{} queries: {counts:?}{failures}", self.records.len())
    }

    /// When the first query began (milliseconds since the epoch).
    #[must_use]
    pub fn started_ms(&self) -> u64 {
        self.records
            .iter()
            .map(|record| record.begun_ms)
            .min()
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::topology::{CACHE, UPSTREAM_A};

    fn record(begun_ms: u64, steered_ms: u64, kind: &str, answer: Option<IpAddr>) -> StreamRecord {
        StreamRecord {
            seq: 0,
            begun_ms,
            steered_ms,
            done_ms: steered_ms,
            kind: kind.to_owned(),
            answer,
            error: answer
                .is_none()
                .then(|| "recv: Connection refused".to_owned()),
            reopened: false,
        }
    }

    /// The shape of a CI failure (6.12 VM, 2026-11-30): a fresh query refused although it began
    /// a millisecond or two after the first query an upstream answered. One interleaving that
    /// gives it: the long-lived socket's thread begins at 1002 and is descheduled until its
    /// sendto is steered upstream at 1006; the fresh socket's thread begins at 1003, is steered
    /// to the cache before the flip, and its datagram meets the closed socket.
    #[test]
    fn a_query_begun_before_the_flips_witness_was_sent_is_not_counted_after_it() {
        let report = StreamReport {
            records: vec![
                record(990, 990, "fresh", Some(IpAddr::V4(CACHE.a))),
                record(1002, 1006, "long", Some(IpAddr::V4(UPSTREAM_A.a))),
                record(1003, 1003, "fresh", None),
                record(1020, 1020, "fresh", Some(IpAddr::V4(UPSTREAM_A.a))),
            ],
        };
        let flipped_by = report.flipped_by(1000).expect("an upstream answered");
        assert_eq!(flipped_by, 1006);
        assert_eq!(report.failures_after_flip(flipped_by), 0);
    }

    #[test]
    fn a_query_begun_after_an_upstream_send_returned_counts_when_it_fails() {
        let report = StreamReport {
            records: vec![
                record(1002, 1003, "long", Some(IpAddr::V4(UPSTREAM_A.a))),
                record(1004, 1004, "fresh", None),
            ],
        };
        let flipped_by = report.flipped_by(1000).expect("an upstream answered");
        assert_eq!(report.failures_after_flip(flipped_by), 1);
        assert_eq!(
            report.flipped_by(1003),
            None,
            "no upstream answer began after 1003"
        );
    }
}
