//! What each attached program costs per run, from the kernel's own accounting: with
//! `BPF_ENABLE_STATS` (5.8; aya's `enable_stats`, on while its file descriptor is open) the kernel
//! adds every run's time and count to the program's info. A figure includes the accounting's own
//! two clock reads (about 20 to 30 ns a run here).

use std::{os::fd::OwnedFd, path::Path};

use anyhow::Context as _;
use serde::Serialize;

/// The kernel's run-time accounting, on until this is dropped.
#[derive(Debug)]
pub struct Accounting {
    _enabled: OwnedFd,
}

impl Accounting {
    /// Turns the accounting on (for every program of the machine, as the sysctl
    /// `kernel.bpf_stats_enabled` would, but only while this lives).
    pub fn enable() -> anyhow::Result<Self> {
        let enabled = aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .context("BPF_ENABLE_STATS (kernel 5.8+, root)")?;
        Ok(Self { _enabled: enabled })
    }

    /// The run time and count of every program redirector attached from `pin_dir`.
    pub fn snapshot(&self, pin_dir: &Path) -> anyhow::Result<Snapshot> {
        let ids = redirector::datapath::pinned_program_ids(pin_dir);
        anyhow::ensure!(
            !ids.is_empty(),
            "no program is attached from {}",
            pin_dir.display()
        );
        let loaded: Vec<aya::programs::ProgramInfo> = aya::programs::loaded_programs()
            .collect::<Result<_, _>>()
            .context("listing the loaded programs")?;
        let programs = ids
            .into_iter()
            .map(|(program, id)| {
                let info = loaded
                    .iter()
                    .find(|info| info.id() == id)
                    .with_context(|| format!("program {program} (id {id}) is not loaded"))?;
                Ok(Runs {
                    program,
                    time_ns: u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX),
                    count: info.run_count(),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Snapshot { programs })
    }
}

/// One attached program's size as the kernel holds it (`bpftool prog show`'s `xlated` and
/// `jited`): what the verifier left of it, and the machine code of that.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProgramSize {
    /// The program's name (`redirector_common::names`).
    pub program: &'static str,
    /// Bytes of translated instructions (8 each).
    pub translated_bytes: u32,
    /// Bytes of JIT-compiled code.
    pub jited_bytes: u32,
}

/// The size of every program redirector attached from `pin_dir`, in `ALL_PROGRAMS` order.
pub fn sizes(pin_dir: &Path) -> anyhow::Result<Vec<ProgramSize>> {
    let loaded: Vec<aya::programs::ProgramInfo> = aya::programs::loaded_programs()
        .collect::<Result<_, _>>()
        .context("listing the loaded programs")?;
    let mut sizes: Vec<ProgramSize> = Vec::new();
    for (program, id) in redirector::datapath::pinned_program_ids(pin_dir) {
        if sizes.iter().any(|size| size.program == program) {
            continue;
        }
        let info = loaded
            .iter()
            .find(|info| info.id() == id)
            .with_context(|| format!("program {program} (id {id}) is not loaded"))?;
        sizes.push(ProgramSize {
            program,
            translated_bytes: info.size_translated().unwrap_or_default(),
            jited_bytes: info.size_jitted(),
        });
    }
    Ok(sizes)
}

/// One program's accumulated runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Runs {
    /// The program's name (`redirector_common::names`).
    pub program: &'static str,
    /// Nanoseconds spent in it.
    pub time_ns: u64,
    /// Times it ran.
    pub count: u64,
}

impl Runs {
    /// Nanoseconds per run (0 without runs).
    #[must_use]
    pub fn ns_per_run(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.time_ns as f64 / self.count as f64
        }
    }
}

/// Every program's runs at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// By program, in `ALL_PROGRAMS` order.
    pub programs: Vec<Runs>,
}

impl Snapshot {
    /// The runs between `earlier` and `self` of every program that ran meanwhile.
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Vec<Runs> {
        self.programs
            .iter()
            .filter_map(|now| {
                let before = earlier
                    .programs
                    .iter()
                    .find(|before| before.program == now.program)?;
                let count = now.count.checked_sub(before.count)?;
                (count > 0).then(|| Runs {
                    program: now.program,
                    time_ns: now.time_ns.saturating_sub(before.time_ns),
                    count,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_programs_that_ran_meanwhile_count() {
        let runs = |program, time_ns, count| Runs {
            program,
            time_ns,
            count,
        };
        let before = Snapshot {
            programs: vec![runs("a", 1_000, 10), runs("b", 500, 5)],
        };
        let after = Snapshot {
            programs: vec![runs("a", 3_000, 30), runs("b", 500, 5)],
        };
        let since = after.since(&before);
        assert_eq!(since, vec![runs("a", 2_000, 20)]);
        assert!((since[0].ns_per_run() - 100.0).abs() < f64::EPSILON);
    }
}
