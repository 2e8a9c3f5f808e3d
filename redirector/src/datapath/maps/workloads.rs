//! Each workload's DNS as the programs count it (`WORKLOADS`), and the cgroups they never count
//! (`WORKLOAD_EXEMPT`).

use std::collections::BTreeSet;

use aya::maps::MapError;
use redirector_common::{
    binds::CacheTask,
    names,
    workloads::{ExemptCgroup, MAX_EXEMPT_CGROUPS, WorkloadCounters},
};

use super::Maps;
use crate::datapath::error::{DatapathError, read, write};

/// The most entries one walk of `WORKLOADS` reads: twice the most `workloads.tracked` allows, for
/// walks that start again.
const WALK_LIMIT: usize = 2 << 20;

/// What `Maps::set_exempt_cgroups` could not write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct ExemptOverflow {
    /// Exempt cgroups left out of `WORKLOAD_EXEMPT` for want of room (zero: none).
    pub left_out: usize,
}

/// An exempt cgroup as the maps hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExemptEntry {
    /// cgroup id.
    pub id: u64,
    /// cgroup level.
    pub level: u32,
    /// What it is exempt from: `EXEMPT_ACCOUNTING` (nothing counted) and/or `EXEMPT_RATE_LIMIT`
    /// (counted, never limited).
    pub exempt_from: u32,
}

impl Maps {
    /// Replaces the exempt cgroups (removing those no longer wanted first, so the map never holds
    /// more than the wanted set). When that changes the set, forgets every counted cgroup, so
    /// that each is judged again against it at its next count (the programs decide a cgroup's
    /// exemption when they enter it, from its ancestors: a descendant of a newly exempt cgroup
    /// must be entered again). The counts start again from zero, which the agent's rates take as
    /// a new life. A start that finds the set it writes keeps every count.
    ///
    /// The map holds `MAX_EXEMPT_CGROUPS`: entries past it (the caller puts what must be exempt
    /// first), and any the map refuses for want of room (`post_bind` adds a cache's cgroup
    /// meanwhile), are left out and returned as the overflow. Never an error: a cgroup left out
    /// is counted as a workload, which no DNS depends on.
    pub fn set_exempt_cgroups(
        &mut self,
        exempt: &[ExemptEntry],
    ) -> Result<ExemptOverflow, DatapathError> {
        let (exempt, past_capacity) = exempt.split_at(exempt.len().min(MAX_EXEMPT_CGROUPS));
        let mut overflow = ExemptOverflow {
            left_out: past_capacity.len(),
        };
        let held: BTreeSet<(u64, u32)> = self
            .workload_exempt
            .iter()
            .filter_map(Result::ok)
            .map(|(id, entry)| (id, entry.exempt_from))
            .collect();
        let wanted: BTreeSet<(u64, u32)> = exempt
            .iter()
            .map(|entry| (entry.id, entry.exempt_from))
            .collect();
        if held == wanted {
            return Ok(overflow);
        }
        let stale: Vec<u64> = held
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !exempt.iter().any(|entry| entry.id == *id))
            .collect();
        for id in stale {
            match self.workload_exempt.remove(&id) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(source) => return Err(write(names::MAP_WORKLOAD_EXEMPT)(source)),
            }
        }
        for entry in exempt {
            let value = ExemptCgroup {
                level: entry.level,
                exempt_from: entry.exempt_from,
            };
            match self.workload_exempt.insert(entry.id, value, 0) {
                Ok(()) => {}
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::E2BIG) =>
                {
                    overflow.left_out += 1;
                }
                Err(source) => return Err(write(names::MAP_WORKLOAD_EXEMPT)(source)),
            }
        }
        let counted: Vec<u64> = self
            .workloads
            .keys()
            .take(WALK_LIMIT)
            .filter_map(Result::ok)
            .collect();
        self.forget_workloads(&counted)?;
        Ok(overflow)
    }

    /// Removes cgroups from `WORKLOADS` (one already gone is no error).
    pub fn forget_workloads(&mut self, ids: &[u64]) -> Result<(), DatapathError> {
        for id in ids {
            match self.workloads.remove(id) {
                Ok(()) => {}
                Err(MapError::KeyNotFound) => {}
                Err(error) => return Err(write(names::MAP_WORKLOADS)(error)),
            }
        }
        Ok(())
    }

    /// Every counted workload's counts, by cgroup id (exempt entries left out). One walk of the
    /// LRU: a cgroup the programs enter meanwhile is read at the next walk.
    pub fn workload_counts(&self) -> Result<Vec<(u64, WorkloadCounters)>, DatapathError> {
        // A walk whose current key is evicted starts again from the first (the kernel's
        // `get_next_key` of a missing key): each cgroup is kept once, and the walk is bounded.
        let mut counts = std::collections::HashMap::new();
        for entry in self.workloads.iter().take(WALK_LIMIT) {
            match entry {
                Ok((id, counters)) if !counters.is_exempt() => {
                    counts.insert(id, counters);
                }
                Ok(_) => {}
                // Evicted between the walk's key and its lookup.
                Err(MapError::KeyNotFound) => {}
                Err(error) => return Err(read(names::MAP_WORKLOADS)(error)),
            }
        }
        Ok(counts.into_iter().collect())
    }

    /// The cgroups of the processes known as caches (`CACHE_TASKS`, which `post_bind` and the
    /// caches' reads fill), by process id: the programs exempt each, and the agent keeps those
    /// of the processes that live.
    pub fn cache_task_cgroups(&self) -> Vec<(u32, u64)> {
        self.known_cache_tasks()
            .into_iter()
            .map(|(tgid, task)| (tgid, task.cgroup_id))
            .collect()
    }

    /// The processes known as caches (`CACHE_TASKS`), by process id.
    pub fn known_cache_tasks(&self) -> Vec<(u32, CacheTask)> {
        self.cache_tasks.iter().filter_map(Result::ok).collect()
    }

    /// Removes the processes `gone` (pid, and the cgroup `cache_task_cgroups` gave it) from
    /// those known as caches, each only while its entry still names that cgroup (a bind or a
    /// read of a new process with the same pid replaced it meanwhile). Returns how many went.
    pub fn forget_cache_tasks_of(&mut self, gone: &[(u32, u64)]) -> Result<usize, DatapathError> {
        let mut forgotten = 0;
        for (tgid, cgroup) in gone {
            match self.cache_tasks.get(tgid, 0) {
                Ok(task) if task.cgroup_id == *cgroup => {}
                Ok(_) | Err(MapError::KeyNotFound) => continue,
                Err(source) => return Err(read(names::MAP_CACHE_TASKS)(source)),
            }
            match self.cache_tasks.remove(tgid) {
                Ok(()) => forgotten += 1,
                Err(MapError::KeyNotFound) => {}
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(source) => return Err(write(names::MAP_CACHE_TASKS)(source)),
            }
        }
        Ok(forgotten)
    }

    /// The exempt cgroups' ids.
    pub fn exempt_cgroups(&self) -> Vec<u64> {
        self.workload_exempt.keys().filter_map(Result::ok).collect()
    }
}
