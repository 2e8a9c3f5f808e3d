//! Reads the guest's results port (the `@@vm-test` markers of stage 2 around each test
//! binary's libtest output) into per-test results, line by line as they arrive.

use std::time::Duration;

/// One test's result, as libtest printed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// `ok`.
    Passed,
    /// `FAILED`.
    Failed,
    /// `ignored`.
    Ignored,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Self::Passed => "ok",
            Self::Failed => "FAILED",
            Self::Ignored => "ignored",
        }
    }
}

/// One test binary's run in the guest.
#[derive(Debug, Default)]
pub struct BinaryRun {
    /// The test target's name.
    pub name: String,
    /// Its tests, in the order they finished.
    pub tests: Vec<(String, Status)>,
    /// Its exit code (`None`: the guest never reported its end).
    pub exit: Option<i32>,
    /// How long it ran in the guest.
    pub elapsed: Option<Duration>,
    /// Everything it printed.
    pub output: Vec<String>,
    /// A test whose line libtest began and has not ended: under `--nocapture` the test's own
    /// output comes between `test NAME ... ` and its status, alone on a line.
    pending: Option<String>,
}

impl BinaryRun {
    fn count(&self, status: Status) -> usize {
        self.tests
            .iter()
            .filter(|(_, seen)| *seen == status)
            .count()
    }

    /// True when it ended with exit code 0 and no test failed.
    pub fn passed(&self) -> bool {
        self.exit == Some(0) && self.count(Status::Failed) == 0
    }

    /// Why it failed, in a few words, for a binary that did not pass.
    fn failure(&self) -> String {
        match self.exit {
            None => "never finished (the guest stopped or timed out while it ran)".to_owned(),
            // coreutils timeout's codes for "timed out" and "killed after the grace period".
            Some(124 | 137) => "hit its time limit in the guest and was killed".to_owned(),
            Some(0) => "exit code 0 but a test FAILED".to_owned(),
            Some(code) if self.count(Status::Failed) == 0 => {
                format!("exit code {code} without a FAILED test (it crashed or could not start)")
            }
            Some(code) => format!("exit code {code}"),
        }
    }

    /// libtest's failure section (each failed test's output), else the last lines printed.
    fn details(&self) -> Vec<&str> {
        let start = self.output.iter().position(|line| line == "failures:");
        let end = self
            .output
            .iter()
            .rposition(|line| line.starts_with("test result:"));
        match (start, end) {
            (Some(start), Some(end)) if start < end => {
                self.output[start..end].iter().map(String::as_str).collect()
            }
            _ => {
                let tail = self.output.len().saturating_sub(40);
                self.output[tail..].iter().map(String::as_str).collect()
            }
        }
    }
}

/// What one boot reported.
#[derive(Debug, Default)]
pub struct KernelRun {
    /// `uname -r` in the guest, once stage 2 was ready.
    pub release: Option<String>,
    /// A stage's fatal error.
    pub fatal: Option<String>,
    /// The test binaries, in the order they ran.
    pub binaries: Vec<BinaryRun>,
    /// True once stage 2 said every binary had run.
    pub done: bool,
    /// What the tests measured and left for the report (`@@vm-test note TEXT`).
    pub notes: Vec<String>,
    /// The tests passed and asked for a reboot (`@@vm-test reboot`): the host boots the node
    /// again.
    pub reboot: bool,
}

/// A line worth showing while the guest runs.
pub enum Progress {
    /// Stage 2 is ready on this kernel.
    Ready(String),
    /// A test finished.
    Test {
        /// Its binary.
        binary: String,
        /// Its name.
        test: String,
        /// Its result.
        status: Status,
    },
    /// A test binary ended.
    End {
        /// Its name.
        binary: String,
        /// Its exit code.
        exit: i32,
        /// How long it ran.
        elapsed: Duration,
    },
    /// A stage failed.
    Fatal(String),
    /// A figure the tests measured.
    Note(String),
    /// The guest reboots, as its tests asked.
    Reboot,
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ready(release) => write!(f, "booted {release}"),
            Self::Note(note) => write!(f, "measured: {note}"),
            Self::Reboot => write!(f, "the tests asked for a reboot: the guest reboots"),
            Self::Test {
                binary,
                test,
                status,
            } => write!(f, "{binary}::{test} ... {}", status.label()),
            Self::End {
                binary,
                exit,
                elapsed,
            } => write!(
                f,
                "{binary}: exit code {exit} after {:.1} s",
                elapsed.as_secs_f64()
            ),
            Self::Fatal(message) => write!(f, "FATAL: {message}"),
        }
    }
}

const MARKER: &str = "@@vm-test ";

/// `test NAME ... STATUS` anywhere in `line` (the output of a process a test started can
/// precede it on the same line).
fn test_line(line: &str) -> Option<(&str, Status)> {
    let at = line.find("test ")?;
    let rest = &line[at + "test ".len()..];
    let (name, status) = rest.split_once(" ... ")?;
    if name.is_empty() || name.contains(' ') {
        return None;
    }
    Some((name, status_word(status.split([',', ' ']).next()?)?))
}

/// libtest's word for a test's end.
fn status_word(word: &str) -> Option<Status> {
    match word {
        "ok" => Some(Status::Passed),
        "FAILED" => Some(Status::Failed),
        "ignored" => Some(Status::Ignored),
        _ => None,
    }
}

/// The test of a `test NAME ... ` line whose status is still to come (the test's own output
/// follows on the same line under `--nocapture`).
fn begun_test(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("test ")?;
    let (name, _) = rest.split_once(" ... ")?;
    (!name.is_empty() && !name.contains(' ')).then_some(name)
}

/// `key=value` among `words`.
fn field<'a>(words: &'a str, key: &str) -> Option<&'a str> {
    words
        .split_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
}

impl KernelRun {
    /// Takes one line of the results port; returns what to show.
    pub fn feed(&mut self, line: &str) -> Option<Progress> {
        if let Some(marker) = line.strip_prefix(MARKER) {
            let (word, rest) = marker.split_once(' ').unwrap_or((marker, ""));
            return match word {
                "ready" => {
                    let release = field(rest, "kernel").unwrap_or_default().to_owned();
                    self.release = Some(release.clone());
                    Some(Progress::Ready(release))
                }
                "begin" => {
                    self.binaries.push(BinaryRun {
                        name: rest.trim().to_owned(),
                        ..BinaryRun::default()
                    });
                    None
                }
                "end" => {
                    let binary = self.binaries.last_mut()?;
                    let exit = field(rest, "exit")?.parse().ok()?;
                    let elapsed = Duration::from_millis(field(rest, "ms")?.parse().ok()?);
                    binary.exit = Some(exit);
                    binary.elapsed = Some(elapsed);
                    Some(Progress::End {
                        binary: binary.name.clone(),
                        exit,
                        elapsed,
                    })
                }
                "done" => {
                    self.done = true;
                    None
                }
                "fatal" => {
                    self.fatal = Some(rest.to_owned());
                    Some(Progress::Fatal(rest.to_owned()))
                }
                "note" => {
                    self.notes.push(rest.to_owned());
                    Some(Progress::Note(rest.to_owned()))
                }
                "reboot" => {
                    self.reboot = true;
                    Some(Progress::Reboot)
                }
                _ => None,
            };
        }
        // Lines outside a running binary are only stage 2's own, which has nothing else to say
        // there.
        let binary = self
            .binaries
            .last_mut()
            .filter(|binary| binary.exit.is_none())?;
        binary.output.push(line.to_owned());
        let (test, status) = match (test_line(line), binary.pending.take()) {
            (Some((test, status)), _) => (test.to_owned(), status),
            (None, Some(pending)) => match status_word(line.trim()) {
                Some(status) => (pending, status),
                None => {
                    binary.pending = Some(pending);
                    return None;
                }
            },
            (None, None) => {
                binary.pending = begun_test(line).map(ToOwned::to_owned);
                return None;
            }
        };
        binary.tests.push((test.clone(), status));
        Some(Progress::Test {
            binary: binary.name.clone(),
            test,
            status,
        })
    }

    /// True when the boot proved everything it was asked to: every binary ran and passed.
    pub fn passed(&self, expected_binaries: usize) -> bool {
        self.fatal.is_none()
            && self.done
            && self.binaries.len() == expected_binaries
            && self.binaries.iter().all(BinaryRun::passed)
    }

    /// Counts of passed, failed and ignored tests.
    pub fn counts(&self) -> (usize, usize, usize) {
        let sum = |status| {
            self.binaries
                .iter()
                .map(|binary| binary.count(status))
                .sum()
        };
        (
            sum(Status::Passed),
            sum(Status::Failed),
            sum(Status::Ignored),
        )
    }

    /// The per-binary table and, for each binary that did not pass, why and its output.
    pub fn describe(&self) -> String {
        use std::fmt::Write as _;
        let mut text = String::new();
        let _ = writeln!(
            text,
            "  {:<16} {:>6} {:>7} {:>7} {:>8} {:>10}",
            "binary", "tests", "passed", "failed", "ignored", "time"
        );
        for binary in &self.binaries {
            let _ = writeln!(
                text,
                "  {:<16} {:>6} {:>7} {:>7} {:>8} {:>10}",
                binary.name,
                binary.tests.len(),
                binary.count(Status::Passed),
                binary.count(Status::Failed),
                binary.count(Status::Ignored),
                binary.elapsed.map_or_else(
                    || "-".to_owned(),
                    |elapsed| format!("{:.1} s", elapsed.as_secs_f64())
                ),
            );
        }
        for binary in self.binaries.iter().filter(|binary| !binary.passed()) {
            let _ = writeln!(text, "\n  {} {}:", binary.name, binary.failure());
            for (test, status) in &binary.tests {
                if *status == Status::Failed {
                    let _ = writeln!(text, "    FAILED {test}");
                }
            }
            for line in binary.details() {
                let _ = writeln!(text, "    | {line}");
            }
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_markers_and_libtest_lines() {
        let mut run = KernelRun::default();
        let lines = [
            "@@vm-test ready kernel=6.1.0-57-cloud-amd64",
            "@@vm-test begin steering",
            "",
            "running 3 tests",
            "test a_b ... ok",
            "some child output test c_d ... FAILED",
            "test e_f ... ignored, needs a dummy link",
            "test g has been running for over 60 seconds",
            "failures:",
            "",
            "---- c_d stdout ----",
            "Error: boom",
            "",
            "failures:",
            "    c_d",
            "",
            "test result: FAILED. 1 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out",
            "@@vm-test end steering exit=101 ms=1500",
            "@@vm-test done binaries=1 failed=1 ms=1600",
        ];
        for line in lines {
            run.feed(line);
        }
        assert_eq!(run.release.as_deref(), Some("6.1.0-57-cloud-amd64"));
        assert!(run.done);
        assert_eq!(run.counts(), (1, 1, 1));
        let binary = &run.binaries[0];
        assert_eq!(binary.exit, Some(101));
        assert_eq!(binary.elapsed, Some(Duration::from_millis(1500)));
        assert!(!run.passed(1));
        let text = run.describe();
        assert!(text.contains("FAILED c_d"), "{text}");
        assert!(text.contains("| Error: boom"), "{text}");
        assert!(!text.contains("test result"), "{text}");
    }

    /// Under `--nocapture` (the node's test) the test's output comes between its name and its
    /// status, which ends alone on a line.
    #[test]
    fn a_test_with_its_output_between_its_name_and_its_status_is_counted() {
        let mut run = KernelRun::default();
        let lines = [
            "@@vm-test begin node",
            "running 1 test",
            "test a_real_node ... node: stage 1 (5 s)",
            "node: the table",
            "ok",
            "",
            "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out",
            "@@vm-test end node exit=0 ms=1500",
            "@@vm-test done binaries=1 failed=0 ms=1600",
        ];
        for line in lines {
            run.feed(line);
        }
        assert_eq!(run.counts(), (1, 0, 0));
        assert!(run.passed(1));
        assert!(!run.reboot, "no test asked for a reboot");
        run.feed("@@vm-test reboot");
        assert!(run.reboot);
    }

    #[test]
    fn a_fatal_stage_or_a_missing_binary_fails_the_boot() {
        let mut run = KernelRun::default();
        run.feed("@@vm-test fatal stage 1: mounting the overlay root");
        assert!(run.fatal.is_some());
        assert!(!run.passed(0));
        let mut run = KernelRun::default();
        run.feed("@@vm-test begin steering");
        run.feed("test a ... ok");
        run.feed("@@vm-test end steering exit=0 ms=10");
        run.feed("@@vm-test done binaries=1 failed=0 ms=10");
        assert!(run.passed(1));
        assert!(!run.passed(2));
    }
}
