//! The kernel's tick, measured once a boot, for the clock of the cache's activity stamps
//! (`redirector_common::activity::StallTiming` has why the programs count ticks).
//!
//! The tick's length is `CONFIG_HZ`'s, which userspace cannot read everywhere (no
//! `/proc/config.gz` on most distributions' kernels, no `/boot` in a pod, no `/proc/schedstat`
//! without `CONFIG_SCHEDSTATS`), and the tick count itself is visible to programs only. So the
//! agent runs `dns_ticks` (`BPF_PROG_TEST_RUN` of a raw tracepoint program, 5.10), which returns
//! the count half by half, beside `CLOCK_MONOTONIC_COARSE`, which the kernel advances in the same
//! tick: two such readings a tenth of a second apart give the tick's length, rounded to the one
//! `CONFIG_HZ` allows that is nearest, and the later reading the base the programs convert from.
//! The pinned `STALL_TIMING` keeps the result for the boot (bpffs does not outlive it), so later
//! starts reuse it and pay nothing.

use std::time::Duration;

use aya::programs::{ProgramError, RawTracePoint, RawTracePointRunOptions, TestRun as _};
use redirector_common::activity::StallTiming;

/// The `CONFIG_HZ` choices of the kernel's `Kconfig.hz`.
const HZ_CHOICES: [u64; 4] = [100, 250, 300, 1000];
/// How far apart the two readings are: at least ten ticks at every choice, so that a reading's
/// coarse time a tick behind its count (the kernel advances the count first) errs by a tenth
/// at most, which the choices' spacing (250 and 300 are 20 % apart) absorbs.
const SPAN: Duration = Duration::from_millis(100);
/// Readings retried when the count moved under one (it does once a tick, for microseconds).
const ATTEMPTS: usize = 16;
const NS_PER_SECOND: u64 = 1_000_000_000;

/// Why the tick could not be measured: never fatal, the programs then read
/// `bpf_ktime_get_coarse_ns` (a few ns more per query handed to a cache).
#[derive(Debug, thiserror::Error)]
pub enum TickError {
    /// The kernel refused to run the program.
    #[error("running dns_ticks (BPF_PROG_TEST_RUN) failed")]
    Run {
        /// What aya reported.
        #[source]
        source: ProgramError,
    },
    /// The count moved during every reading (it should once a tick, for microseconds).
    #[error("the tick count moved during each of {ATTEMPTS} readings")]
    Unsteady,
    /// The readings fit no `CONFIG_HZ` choice.
    #[error(
        "{ticks} ticks in {elapsed_ns} ns fit no CONFIG_HZ the kernel allows (100, 250, 300, 1000)"
    )]
    Unknown {
        /// Ticks counted.
        ticks: u64,
        /// Coarse monotonic time elapsed meanwhile.
        elapsed_ns: u64,
    },
    /// `CLOCK_MONOTONIC_COARSE` could not be read.
    #[error("cannot read CLOCK_MONOTONIC_COARSE")]
    Clock {
        /// What the kernel said.
        #[source]
        source: nix::errno::Errno,
    },
}

/// The kernel's tick and a base to count from: what the programs convert tick counts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TickClock {
    /// `TICK_NSEC`, ns.
    pub tick_ns: u64,
    /// A tick count.
    pub base_ticks: u64,
    /// `CLOCK_MONOTONIC_COARSE` in that tick, ns.
    pub base_ns: u64,
}

impl TickClock {
    /// The clock a `STALL_TIMING` element holds, if the agent that wrote it had measured one.
    #[must_use]
    pub const fn of(timing: &StallTiming) -> Option<Self> {
        if timing.tick_ns == 0 {
            return None;
        }
        Some(Self {
            tick_ns: timing.tick_ns,
            base_ticks: timing.base_ticks,
            base_ns: timing.base_ns,
        })
    }

    /// `CONFIG_HZ`.
    #[must_use]
    pub const fn hz(&self) -> u64 {
        NS_PER_SECOND / self.tick_ns
    }

    /// The `STALL_TIMING` element for a limit of `stall_after_ns` on this clock (`None`: the
    /// programs read `bpf_ktime_get_coarse_ns`).
    #[must_use]
    pub const fn timing(clock: Option<Self>, stall_after_ns: u64) -> StallTiming {
        match clock {
            Some(clock) => StallTiming {
                stall_after_ns,
                tick_ns: clock.tick_ns,
                base_ticks: clock.base_ticks,
                base_ns: clock.base_ns,
            },
            None => StallTiming {
                stall_after_ns,
                tick_ns: 0,
                base_ticks: 0,
                base_ns: 0,
            },
        }
    }
}

/// Measures the tick with the loaded `dns_ticks` program (about [`SPAN`]).
pub fn measure(program: &RawTracePoint) -> Result<TickClock, TickError> {
    let (first_ticks, first_ns) = reading(program)?;
    std::thread::sleep(SPAN);
    let (ticks, ns) = reading(program)?;
    let tick_ns = tick_length(
        ticks.saturating_sub(first_ticks),
        ns.saturating_sub(first_ns),
    )
    .ok_or(TickError::Unknown {
        ticks: ticks.saturating_sub(first_ticks),
        elapsed_ns: ns.saturating_sub(first_ns),
    })?;
    Ok(TickClock {
        tick_ns,
        base_ticks: ticks,
        base_ns: ns,
    })
}

/// `TICK_NSEC` of the `CONFIG_HZ` choice nearest to `ticks` counted in `elapsed_ns`, if within
/// a tenth of it.
#[must_use]
pub fn tick_length(ticks: u64, elapsed_ns: u64) -> Option<u64> {
    if ticks == 0 {
        return None;
    }
    let measured = u128::from(ticks) * u128::from(NS_PER_SECOND) / u128::from(elapsed_ns.max(1));
    let hz = HZ_CHOICES
        .into_iter()
        .min_by_key(|hz| u128::from(*hz).abs_diff(measured))?;
    (u128::from(hz).abs_diff(measured) * 10 <= u128::from(hz))
        // The kernel's rounding (`TICK_NSEC`).
        .then(|| (NS_PER_SECOND + hz / 2) / hz)
}

/// A tick count and `CLOCK_MONOTONIC_COARSE` read in the same tick.
fn reading(program: &RawTracePoint) -> Result<(u64, u64), TickError> {
    for _ in 0..ATTEMPTS {
        let before = ticks(program)?;
        let ns = coarse_ns()?;
        if ticks(program)? == before {
            return Ok((before, ns));
        }
    }
    Err(TickError::Unsteady)
}

/// The tick count (`jiffies_64`), from its two halves.
fn ticks(program: &RawTracePoint) -> Result<u64, TickError> {
    let half = |high: u64| {
        let mut options = RawTracePointRunOptions::new();
        options.args[0] = high;
        program
            .test_run(options)
            .map(|result| u64::from(result.return_value))
            .map_err(|source| TickError::Run { source })
    };
    for _ in 0..ATTEMPTS {
        let high = half(1)?;
        let low = half(0)?;
        if half(1)? == high {
            return Ok(high << 32 | low);
        }
    }
    Err(TickError::Unsteady)
}

/// `CLOCK_MONOTONIC_COARSE`, ns: the clock `bpf_ktime_get_coarse_ns` reads.
fn coarse_ns() -> Result<u64, TickError> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC_COARSE)
        .map_err(|source| TickError::Clock { source })?;
    let seconds = u64::try_from(now.tv_sec()).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec()).unwrap_or(0);
    Ok(seconds * NS_PER_SECOND + nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_hz_choice_gives_the_kernels_tick() {
        // 25 ticks of 250 Hz in 100 ms, and a reading a tick late either way.
        assert_eq!(tick_length(25, 100_000_000), Some(4_000_000));
        assert_eq!(tick_length(24, 100_000_000), Some(4_000_000));
        assert_eq!(tick_length(26, 100_000_000), Some(4_000_000));
        assert_eq!(tick_length(30, 100_000_000), Some(3_333_333));
        assert_eq!(tick_length(10, 100_000_000), Some(10_000_000));
        assert_eq!(tick_length(101, 100_000_000), Some(1_000_000));
    }

    #[test]
    fn no_tick_or_none_the_kernel_allows_is_refused() {
        assert_eq!(tick_length(0, 100_000_000), None);
        // 500 Hz is no choice (the nearest, 300 Hz, is two thirds off).
        assert_eq!(tick_length(50, 100_000_000), None);
    }

    #[test]
    fn a_stored_clock_is_reused_and_none_is_the_helpers() {
        let clock = TickClock {
            tick_ns: 4_000_000,
            base_ticks: 7,
            base_ns: 9,
        };
        let timing = TickClock::timing(Some(clock), 80_000_000);
        assert_eq!(TickClock::of(&timing), Some(clock));
        assert_eq!(clock.hz(), 250);
        assert_eq!(TickClock::of(&TickClock::timing(None, 80_000_000)), None);
    }
}
