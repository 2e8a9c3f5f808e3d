//! The pace of the machine the tests run on. The tests assert on behaviour, never on speed, but
//! they wait for states (a failover, a ready line) and give the agent's probes a timeout: on a
//! machine slower than the host, such as a VM under qemu's TCG, those limits and the event
//! timings around them are stretched by one factor, `REDIRECTOR_TEST_SLOWDOWN` (a whole number,
//! 1 by default; `cargo xtask vm-test` sets it for its guests).
//!
//! The shared waits stretch their own limits: [`wait_until`] (and `Harness::wait_until`,
//! `harness::wait_for_cache*` over it), `command::output_within`, `TestProcess::start`,
//! `wait_for_line` and `wait_exit` (and `cli::start_agent*`, `cli::stop_agent` over them) and
//! `Stream::stop_once`. Give them the host's figure, never a [`paced`] one. What they do not
//! stretch is the time a caller lets pass between its events ([`pause`]) and a stream's
//! duration, which must outlast them: stretch those with [`paced`]. A bound a test asserts (a
//! grace the kernel keeps on its own clock) is not a wait and is never stretched.

use std::{sync::OnceLock, time::Duration};

/// The variable holding the factor.
pub const SLOWDOWN_VARIABLE: &str = "REDIRECTOR_TEST_SLOWDOWN";

/// How many times slower than the host this machine is taken to be.
///
/// # Panics
/// When the variable holds anything but a whole number from 1 to 100: a test run with a
/// misspelled factor would pass or fail for the wrong reason.
#[must_use]
pub fn slowdown() -> u32 {
    static FACTOR: OnceLock<u32> = OnceLock::new();
    *FACTOR.get_or_init(|| {
        parse_slowdown(std::env::var(SLOWDOWN_VARIABLE)).unwrap_or_else(|error| panic!("{error}"))
    })
}

/// The factor the variable's value gives: 1 when it is unset.
fn parse_slowdown(value: Result<String, std::env::VarError>) -> Result<u32, String> {
    let text = match value {
        Err(std::env::VarError::NotPresent) => return Ok(1),
        Ok(text) => text,
        Err(std::env::VarError::NotUnicode(text)) => text.to_string_lossy().into_owned(),
    };
    match text.parse::<u32>() {
        Ok(factor @ 1..=100) => Ok(factor),
        _ => Err(format!(
            "{SLOWDOWN_VARIABLE}={text:?}: give a whole number from 1 to 100"
        )),
    }
}

/// `duration` stretched to this machine's pace.
#[must_use]
pub fn paced(duration: Duration) -> Duration {
    duration * slowdown()
}

/// `milliseconds` stretched to this machine's pace.
#[must_use]
pub fn paced_ms(milliseconds: u64) -> u64 {
    milliseconds * u64::from(slowdown())
}

/// Lets `milliseconds` pass, stretched to this machine's pace: the time between a test's events,
/// or a quiet period in which something must not happen.
pub fn pause(milliseconds: u64) {
    std::thread::sleep(paced(Duration::from_millis(milliseconds)));
}

/// Waits until `condition` holds, checking every `every`, for at most `limit` stretched to this
/// machine's pace; fails with `what` otherwise. For states the system must reach, not for timing
/// claims.
pub fn wait_until(
    what: &str,
    limit: Duration,
    every: Duration,
    mut condition: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let limit = paced(limit);
    let deadline = std::time::Instant::now() + limit;
    loop {
        if condition()? {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(every);
    }
}

/// The kernel's monotonic clock (`CLOCK_MONOTONIC`), in nanoseconds: the clock of
/// `bpf_ktime_get_ns`, so a time a test client notes compares with the programs' timestamps and
/// across processes.
///
/// # Panics
/// Never on Linux, where `CLOCK_MONOTONIC` always exists.
#[must_use]
pub fn monotonic_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC exists on Linux");
    u64::try_from(Duration::from(now).as_nanos()).unwrap_or(u64::MAX)
}

/// Runs the unit test `test` (its path below the crate, `pace::tests::NAME`) again in a child
/// process with the factor set to `factor`, since [`slowdown`] reads its variable once per
/// process; returns whether this process is that child, which runs the test's checks. The
/// parent fails unless the child passed.
#[cfg(test)]
pub(crate) fn rerun_with_slowdown(test: &str, factor: u32) -> bool {
    /// Marks the child, whatever factor the parent ran with.
    const CHILD: &str = "BPF_TESTS_PACE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        assert_eq!(
            slowdown(),
            factor,
            "the child runs with the factor it was given"
        );
        return true;
    }
    let output = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(SLOWDOWN_VARIABLE, factor.to_string())
        .output()
        .expect("the test binary runs");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success() && printed.contains("1 passed"),
        "{test} with {SLOWDOWN_VARIABLE}={factor} failed:\n{printed}"
    );
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_factor_is_a_whole_number_from_1_to_100_and_1_when_unset() {
        assert_eq!(parse_slowdown(Err(std::env::VarError::NotPresent)), Ok(1));
        assert_eq!(parse_slowdown(Ok("3".to_owned())), Ok(3));
        assert_eq!(parse_slowdown(Ok("100".to_owned())), Ok(100));
        for wrong in ["0", "101", "1.5", "", "three", "-2"] {
            let error = parse_slowdown(Ok(wrong.to_owned())).expect_err(wrong);
            assert!(error.contains(SLOWDOWN_VARIABLE), "{error}");
        }
    }

    /// With the factor at 4, every paced figure and the limit of a wait for a state are four
    /// times the host's: a wait that never holds gives up after the stretched limit and says so.
    #[test]
    fn the_waits_and_pauses_stretch_by_the_factor() {
        if !rerun_with_slowdown("pace::tests::the_waits_and_pauses_stretch_by_the_factor", 4) {
            return;
        }
        assert_eq!(paced(Duration::from_millis(250)), Duration::from_secs(1));
        assert_eq!(paced_ms(250), 1000);

        let begun = std::time::Instant::now();
        pause(10);
        assert!(
            begun.elapsed() >= Duration::from_millis(40),
            "{:?}",
            begun.elapsed()
        );

        let begun = std::time::Instant::now();
        let error = wait_until(
            "nothing",
            Duration::from_millis(10),
            Duration::from_millis(1),
            || Ok(false),
        )
        .expect_err("the condition never holds");
        assert!(
            begun.elapsed() >= Duration::from_millis(40),
            "{:?}",
            begun.elapsed()
        );
        assert_eq!(error.to_string(), "nothing did not happen within 40ms");
    }
}
