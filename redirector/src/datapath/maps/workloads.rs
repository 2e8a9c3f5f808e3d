//! Each workload's DNS as the programs count it (`WORKLOADS`), and the cgroups they never count
//! (`WORKLOAD_EXEMPT`).

use redirector_common::{
    names,
    workloads::{ExemptCgroup, WorkloadCounters},
};

use super::Maps;
use crate::datapath::error::{DatapathError, read, write};

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
    /// Replaces the exempt cgroups (removing those no longer wanted), then forgets every cgroup
    /// the programs entered with an exemption and every cgroup of the set, so that each is
    /// judged again against this set at its next count (a cgroup entered without one and not in
    /// the set keeps its counts; a descendant of a newly exempt cgroup is judged again when the
    /// LRU evicts it, or at the agent's next start, which forgets it too if the caller names
    /// it).
    pub fn set_exempt_cgroups(&mut self, exempt: &[ExemptEntry]) -> Result<(), DatapathError> {
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
        let judged: Vec<u64> = self
            .workloads
            .iter()
            .filter_map(Result::ok)
            .filter(|(id, counters)| {
                counters.flags != 0 || exempt.iter().any(|entry| entry.id == *id)
            })
            .map(|(id, _)| id)
            .collect();
        self.forget_workloads(&judged)
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
        let mut counts = Vec::new();
        for entry in self.workloads.iter() {
            match entry {
                Ok((id, counters)) if !counters.is_exempt() => counts.push((id, counters)),
                Ok(_) => {}
                // Evicted between the walk's key and its lookup.
                Err(aya::maps::MapError::KeyNotFound) => {}
                Err(error) => return Err(read(names::MAP_WORKLOADS)(error)),
            }
        }
        Ok(counts)
    }

    /// The exempt cgroups' ids.
    pub fn exempt_cgroups(&self) -> Vec<u64> {
        self.workload_exempt.keys().filter_map(Result::ok).collect()
    }
}
