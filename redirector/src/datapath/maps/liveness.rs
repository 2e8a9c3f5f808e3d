//! The kernel's side of each cache's liveness, as the agent reads and steers it: socket counts
//! and the route they make, the activity the programs stamp (reads, unread queries, flips), the
//! stall limit and its clock, drains, and the processes known as caches (for the signal program).

use aya::maps::MapError;
use redirector_common::{
    activity::{CacheActivity, StallTiming, explain_flip},
    addr::port_be,
    binds::CacheTask,
    datapath::listener_bit,
    listener::{MAX_LISTENERS, Reason, Route, SocketCounts, explain},
    names,
    reverse::reply_port_bit,
};

use super::{BPF_EXIST, Maps, checked_id};
use crate::datapath::{
    TickClock,
    error::{DatapathError, read, write},
};

impl Maps {
    /// The kernel's count of a listener's cache sockets.
    pub fn socket_counts(&self, id: u32) -> Result<SocketCounts, DatapathError> {
        Ok(self.socket_counts.get(checked_id(id)?))
    }

    /// The route the kernel takes for listener `id` now, and why (`listener::explain`, with the
    /// kernel's own flips told apart): the same truth table, on the same map values.
    pub fn route(&self, id: u32, liveness: u32) -> Result<(Route, Reason), DatapathError> {
        let counts = self.socket_counts(id)?;
        let (route, reason) = explain(liveness, &self.mode(id)?, &self.health(id)?, &counts);
        Ok((
            route,
            explain_flip(reason, &self.cache_activity(id)?, &counts),
        ))
    }

    /// What the programs saw a listener's cache read and leave unread, and their latest flip.
    pub fn cache_activity(&self, id: u32) -> Result<CacheActivity, DatapathError> {
        Ok(self.cache_activity.get(checked_id(id)?))
    }

    /// Clears every listener's stamp of a query left unread: a start's `CACHE_ACTIVITY` may hold
    /// one that no read of the programs it replaces will answer (copied by a migration, or kept
    /// in a map an older release reused across a rollback and back: `MappedArray::forget_unread`
    /// has why). A real stall stamps again at the next query.
    pub fn forget_unread_stamps(&self) {
        for id in 0..MAX_LISTENERS as u32 {
            self.cache_activity.forget_unread(id);
        }
    }

    /// Starts listener `id` clean where it is not the listener its id held before: `other`
    /// (another listener took the id) clears its activity, stamps, flip and tallies alike;
    /// `moved` (the same listener with another cache or another liveness) starts its stamps over.
    /// Either way no process stays known as its cache (`forget_cache_tasks`): the signal program
    /// must not move it when the old cache is told to stop.
    pub fn start_clean(&mut self, id: u32, other: bool, moved: bool) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        if other {
            self.cache_activity.clear(id);
        } else if moved {
            self.cache_activity.forget_reads(id);
        }
        if other || moved {
            self.forget_cache_tasks(listener_bit(id))?;
        }
        Ok(())
    }

    /// Records process `tgid` (in cgroup `cgroup_id`) as a cache of `listeners`, as `post_bind`
    /// records a binder: its bits are added to an entry of the same process, and replace one of
    /// another cgroup's (a reused pid). Returns whether the entry changed.
    pub fn know_cache_task(
        &mut self,
        tgid: u32,
        cgroup_id: u64,
        listeners: u64,
    ) -> Result<bool, DatapathError> {
        let known = match self.cache_tasks.get(&tgid, 0) {
            Ok(task) if task.cgroup_id == cgroup_id => task.listeners,
            Ok(_) | Err(MapError::KeyNotFound) => 0,
            Err(source) => return Err(read(names::MAP_CACHE_TASKS)(source)),
        };
        if known & listeners == listeners {
            return Ok(false);
        }
        let task = CacheTask {
            listeners: known | listeners,
            cgroup_id,
        };
        self.cache_tasks
            .insert(tgid, task, 0)
            .map_err(write(names::MAP_CACHE_TASKS))?;
        Ok(true)
    }

    /// Takes the listener bits `bits` off every process known as a cache (`CACHE_TASKS`), and
    /// removes the entries left with none. An entry is rewritten whole: a bind of that very
    /// process between the read and the write may lose its bit (its socket count still moves the
    /// listener at its last close), which only a start that moves listeners risks.
    pub fn forget_cache_tasks(&mut self, bits: u64) -> Result<(), DatapathError> {
        let tasks: Vec<(u32, CacheTask)> = self
            .cache_tasks
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, task)| task.listeners & bits != 0)
            .collect();
        for (tgid, task) in tasks {
            let left = CacheTask {
                listeners: task.listeners & !bits,
                ..task
            };
            let written = if left.listeners == 0 {
                self.cache_tasks.remove(&tgid)
            } else {
                self.cache_tasks.insert(tgid, left, BPF_EXIST)
            };
            match written {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(source) => return Err(write(names::MAP_CACHE_TASKS)(source)),
            }
        }
        Ok(())
    }

    /// Puts back the processes known as caches as `was` held them, into what the map holds now
    /// (a failed start's undoing of `forget_cache_tasks`): each process's listener bits are added
    /// to its entry, or its entry made again; an entry of a process in another cgroup now (a
    /// reused pid) stays as it is.
    pub fn merge_cache_tasks(&mut self, was: &[(u32, CacheTask)]) -> Result<(), DatapathError> {
        for (tgid, task) in was {
            let merged = match self.cache_tasks.get(tgid, 0) {
                Ok(now) if now.cgroup_id != task.cgroup_id => continue,
                Ok(now) if now.listeners & task.listeners == task.listeners => continue,
                Ok(now) => CacheTask {
                    listeners: now.listeners | task.listeners,
                    ..now
                },
                Err(MapError::KeyNotFound) => *task,
                Err(source) => return Err(read(names::MAP_CACHE_TASKS)(source)),
            };
            self.cache_tasks
                .insert(tgid, merged, 0)
                .map_err(write(names::MAP_CACHE_TASKS))?;
        }
        Ok(())
    }

    /// Asks the programs for every cache's next read (`CACHE_PENDING`): a stamp the programs of
    /// an earlier agent left unanswered is answered by it, as one they make themselves is.
    pub fn want_next_reads(&mut self) -> Result<(), DatapathError> {
        self.cache_pending
            .set(0, u64::MAX, 0)
            .map_err(write(names::MAP_CACHE_PENDING))
    }

    /// Listener `id`'s stall limit and the clock of its cache's activity stamps.
    pub fn stall_timing(&self, id: u32) -> Result<StallTiming, DatapathError> {
        self.stall_timing
            .get(&checked_id(id)?, 0)
            .map_err(read(names::MAP_STALL_TIMING))
    }

    /// Drains a listener at `now_ns` (monotonic): a new epoch, recorded as a drain, which the
    /// agent's probes do not confirm while the record stands. Returns the epoch.
    pub fn drain(&self, id: u32, now_ns: u64) -> Result<u64, DatapathError> {
        let id = checked_id(id)?;
        let epoch = self
            .socket_counts
            .new_epoch(id)
            .ok_or(DatapathError::ListenerId { id })?;
        self.cache_activity.record_drain(id, epoch, now_ns);
        Ok(epoch)
    }

    /// Ends the drain that began `epoch`, if it is still the listener's latest flip.
    pub fn end_drain(&self, id: u32, epoch: u64) -> Result<bool, DatapathError> {
        Ok(self.cache_activity.end_drain(checked_id(id)?, epoch))
    }

    /// How long listener `id`'s cache may leave a query unread (`None`: never stalled) on the
    /// stamps' clock (`tick`: `None` for the coarse clock helper), and the cache's port, so that
    /// the programs see its reads.
    pub fn set_stall_limit(
        &mut self,
        id: u32,
        limit: Option<std::time::Duration>,
        tick: Option<TickClock>,
        cache_port: u16,
    ) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        let (word, bit) = reply_port_bit(port_be(cache_port));
        let ports = self
            .cache_ports
            .get(&word, 0)
            .map_err(read(names::MAP_CACHE_PORTS))?;
        if ports & bit == 0 {
            self.cache_ports
                .set(word, ports | bit, 0)
                .map_err(write(names::MAP_CACHE_PORTS))?;
        }
        let stall_after_ns = limit.map_or(0, |limit| {
            u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX)
        });
        let wanted = TickClock::timing(tick, stall_after_ns);
        let current = self
            .stall_timing
            .get(&id, 0)
            .map_err(read(names::MAP_STALL_TIMING))?;
        if current == wanted {
            return Ok(());
        }
        // The programs read the element's fields while it is rewritten, and an update copies it
        // with no ordering between its words: a limit of one write read with the clock of
        // another could flip a serving cache. So the limit goes to 0 (no stall is decided, none
        // stamped) while the clock changes, the stamps made meanwhile start over, and the new
        // limit comes last: a torn read then mixes two states that agree.
        if current.stall_after_ns != 0 {
            let paused = StallTiming {
                stall_after_ns: 0,
                ..current
            };
            self.stall_timing
                .set(id, paused, 0)
                .map_err(write(names::MAP_STALL_TIMING))?;
        }
        let clock = StallTiming {
            stall_after_ns: 0,
            ..wanted
        };
        self.stall_timing
            .set(id, clock, 0)
            .map_err(write(names::MAP_STALL_TIMING))?;
        let clock_of = |timing: &StallTiming| (timing.tick_ns, timing.base_ticks, timing.base_ns);
        if clock_of(&wanted) != clock_of(&current) {
            self.cache_activity.forget_reads(id);
        }
        self.stall_timing
            .set(id, wanted, 0)
            .map_err(write(names::MAP_STALL_TIMING))
    }
}
