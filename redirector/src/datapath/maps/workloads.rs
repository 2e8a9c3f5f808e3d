//! Each workload's DNS as the programs count it (`WORKLOADS`), and the cgroups they never count
//! (`WORKLOAD_EXEMPT`).

use redirector_common::{
    names,
    workloads::{ExemptCgroup, WorkloadCounters},
};

use super::Maps;
use crate::datapath::error::{DatapathError, read, write};

/// The most entries one walk of `WORKLOADS` reads: twice the most `workloads.tracked` allows, for
/// walks that start again.
const WALK_LIMIT: usize = 2 << 20;

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
    /// Replaces the exempt cgroups (removing those no longer wanted). When that changes the set,
    /// forgets every counted cgroup, so that each is judged again against it at its next count
    /// (the programs decide a cgroup's exemption when they enter it, from its ancestors: a
    /// descendant of a newly exempt cgroup must be entered again). The counts start again from
    /// zero, which the agent's rates take as a new life. A start that finds the set it writes
    /// keeps every count.
    pub fn set_exempt_cgroups(&mut self, exempt: &[ExemptEntry]) -> Result<(), DatapathError> {
        let held: std::collections::BTreeSet<(u64, u32)> = self
            .workload_exempt
            .iter()
            .filter_map(Result::ok)
            .map(|(id, entry)| (id, entry.exempt_from))
            .collect();
        let wanted: std::collections::BTreeSet<(u64, u32)> = exempt
            .iter()
            .map(|entry| (entry.id, entry.exempt_from))
            .collect();
        if held == wanted {
            return Ok(());
        }
        for entry in exempt {
            self.workload_exempt
                .insert(
                    entry.id,
                    ExemptCgroup {
                        level: entry.level,
                        exempt_from: entry.exempt_from,
                    },
                    0,
                )
                .map_err(write(names::MAP_WORKLOAD_EXEMPT))?;
        }
        let stale: Vec<u64> = self
            .workload_exempt
            .keys()
            .filter_map(Result::ok)
            .filter(|id| !exempt.iter().any(|entry| entry.id == *id))
            .collect();
        for id in stale {
            self.workload_exempt
                .remove(&id)
                .map_err(write(names::MAP_WORKLOAD_EXEMPT))?;
        }
        let counted: Vec<u64> = self
            .workloads
            .keys()
            .take(WALK_LIMIT)
            .filter_map(Result::ok)
            .collect();
        self.forget_workloads(&counted)
    }

    /// Removes cgroups from `WORKLOADS` (one already gone is no error).
    pub fn forget_workloads(&mut self, ids: &[u64]) -> Result<(), DatapathError> {
        for id in ids {
            match self.workloads.remove(id) {
                Ok(()) => {}
                Err(aya::maps::MapError::KeyNotFound) => {}
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
                Err(aya::maps::MapError::KeyNotFound) => {}
                Err(error) => return Err(read(names::MAP_WORKLOADS)(error)),
            }
        }
        Ok(counts.into_iter().collect())
    }

    /// The cgroups of the processes known as caches (`CACHE_TASKS`, which `post_bind` and the
    /// agent's socket passes fill), by process id: `post_bind` exempts each, and the agent keeps
    /// those of the processes that live.
    pub fn cache_task_cgroups(&self) -> Vec<(u32, u64)> {
        self.cache_tasks
            .iter()
            .filter_map(Result::ok)
            .map(|(tgid, task)| (tgid, task.cgroup_id))
            .collect()
    }

    /// The exempt cgroups' ids.
    pub fn exempt_cgroups(&self) -> Vec<u64> {
        self.workload_exempt.keys().filter_map(Result::ok).collect()
    }
}
