//! The pace of the machine the tests run on. The tests assert on behaviour, never on speed, but
//! they wait for states (a failover, a ready line) and give the agent's probes a timeout: on a
//! machine slower than the host, such as a VM under qemu's TCG, those limits and the event
//! timings around them are stretched by one factor, `REDIRECTOR_TEST_SLOWDOWN` (a whole number,
//! 1 by default; `cargo xtask vm-test` sets it for its guests).

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
    *FACTOR.get_or_init(|| match std::env::var(SLOWDOWN_VARIABLE) {
        Err(std::env::VarError::NotPresent) => 1,
        Ok(text) => match text.parse::<u32>() {
            Ok(factor @ 1..=100) => factor,
            _ => panic!("{SLOWDOWN_VARIABLE}={text:?}: give a whole number from 1 to 100"),
        },
        Err(std::env::VarError::NotUnicode(text)) => {
            panic!("{SLOWDOWN_VARIABLE}={text:?}: give a whole number from 1 to 100")
        }
    })
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
