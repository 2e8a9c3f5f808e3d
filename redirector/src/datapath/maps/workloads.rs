//! Each workload's DNS as the programs count it (`WORKLOADS`), and the cgroups they never count
//! (`WORKLOAD_EXEMPT`).

use std::collections::{BTreeMap, BTreeSet};

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

/// What `Maps::set_exempt_cgroups` wrote, and what it could not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct ExemptWrite {
    /// Exempt cgroups left out of `WORKLOAD_EXEMPT` for want of room (zero: none).
    pub left_out: usize,
    /// The cgroups whose entry the write added, removed or changed. The programs judge a cgroup's
    /// exemption when they enter it in `WORKLOADS`, from its ancestors' entries: a counted cgroup
    /// at or below one of these keeps the judgement of the set before until it is forgotten
    /// (`forget_workloads`) and entered again.
    pub changed: Vec<u64>,
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
    /// more than the wanted set), and says which changed. `WORKLOADS` is left as it is: its
    /// counts and rate stamps are the workloads', and the caller forgets only the cgroups a
    /// change concerns, once it has read their counts (`ExemptWrite::changed`).
    ///
    /// The map holds `MAX_EXEMPT_CGROUPS`: entries past it (the caller puts what must be exempt
    /// first), and any the map refuses for want of room (`post_bind` adds a cache's cgroup
    /// meanwhile), are left out and counted in the result. Never an error for that: a cgroup
    /// left out is counted as a workload, which no DNS depends on.
    pub fn set_exempt_cgroups(
        &mut self,
        exempt: &[ExemptEntry],
    ) -> Result<ExemptWrite, DatapathError> {
        let (exempt, past_capacity) = exempt.split_at(exempt.len().min(MAX_EXEMPT_CGROUPS));
        let mut written = ExemptWrite {
            left_out: past_capacity.len(),
            changed: Vec::new(),
        };
        let held: BTreeMap<u64, u32> = self
            .workload_exempt
            .iter()
            .filter_map(Result::ok)
            .map(|(id, entry)| (id, entry.exempt_from))
            .collect();
        let wanted: BTreeMap<u64, u32> = exempt
            .iter()
            .map(|entry| (entry.id, entry.exempt_from))
            .collect();
        for id in held.keys().filter(|id| !wanted.contains_key(id)) {
            match self.workload_exempt.remove(id) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(source) => return Err(write(names::MAP_WORKLOAD_EXEMPT)(source)),
            }
            written.changed.push(*id);
        }
        for entry in exempt {
            if held.get(&entry.id) == Some(&entry.exempt_from) {
                continue;
            }
            let value = ExemptCgroup {
                level: entry.level,
                exempt_from: entry.exempt_from,
            };
            match self.workload_exempt.insert(entry.id, value, 0) {
                Ok(()) => written.changed.push(entry.id),
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::E2BIG) =>
                {
                    written.left_out += 1;
                }
                Err(source) => return Err(write(names::MAP_WORKLOAD_EXEMPT)(source)),
            }
        }
        Ok(written)
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

    /// Every cgroup in `WORKLOADS`, the exempt ones too. One bounded walk, as
    /// `workload_counts`.
    pub fn counted_cgroups(&self) -> Vec<u64> {
        let ids: BTreeSet<u64> = self
            .workloads
            .keys()
            .take(WALK_LIMIT)
            .filter_map(Result::ok)
            .collect();
        ids.into_iter().collect()
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
