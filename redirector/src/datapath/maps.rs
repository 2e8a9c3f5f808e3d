//! Typed handles on the maps, for the agent (freshly loaded) and the CLI (pinned by an agent).

use std::{
    collections::HashMap as StdHashMap,
    net::{IpAddr, SocketAddr},
    path::Path,
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray},
};
use redirector_common::{
    activity::{CacheActivity, StallTiming, explain_flip},
    addr::{NetAddr, port_be},
    binds::{BindKey, BindListeners, CacheSocket, CacheTask, UNMARKED},
    counters::{ListenerCounters, PROTOCOL_TCP, PROTOCOL_UDP, counter_index},
    datapath::listener_bit,
    datapath::{DatapathConfig, SkipCgroup, level_mask},
    listener::{
        CacheHealth, LISTENER_NAME_MAX, ListenerConfig, ListenerInfo, ListenerMode, MAX_LISTENERS,
        Reason, Route, SocketCounts, explain,
    },
    names,
    pool::{Pool, Target},
    reverse::{ReverseKey, ReverseValue, reply_port_bit},
    settings::{EmptyPoolPolicy, Liveness, Mode},
};

use super::{
    error::{DatapathError, read, write},
    mmapped::MappedArray,
    pins::MAPS_DIR,
};

mod journal;

pub use journal::Journal;

/// `BPF_NOEXIST`: insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;
/// `BPF_EXIST`: update only if the key is present.
const BPF_EXIST: u64 = 2;

/// Typed handles on every map userspace reads or writes.
pub struct Maps {
    listeners: HashMap<MapData, NetAddr, ListenerConfig>,
    listener_mode: Array<MapData, ListenerMode>,
    cache_health: Array<MapData, CacheHealth>,
    socket_counts: MappedArray<SocketCounts>,
    cache_activity: MappedArray<CacheActivity>,
    stall_timing: Array<MapData, StallTiming>,
    cache_pending: Array<MapData, u64>,
    cache_ports: Array<MapData, u64>,
    cache_binds: HashMap<MapData, BindKey, BindListeners>,
    cache_sockets: HashMap<MapData, u64, CacheSocket>,
    listener_info: Array<MapData, ListenerInfo>,
    pools: HashMap<MapData, u32, Pool>,
    reverse_nat: HashMap<MapData, ReverseKey, ReverseValue>,
    reply_ports: Array<MapData, u64>,
    counters: PerCpuArray<MapData, ListenerCounters>,
    skip_cgroups: HashMap<MapData, u64, SkipCgroup>,
    datapath_config: Array<MapData, DatapathConfig>,
    cache_tasks: HashMap<MapData, u32, CacheTask>,
}

impl std::fmt::Debug for Maps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maps").finish_non_exhaustive()
    }
}

/// What one listener is, for writing it into the maps.
#[derive(Clone, Debug)]
pub struct ListenerEntry<'a> {
    /// Its id (index in the per-listener maps).
    pub id: u32,
    /// Its name.
    pub name: &'a str,
    /// Its address.
    pub address: IpAddr,
    /// Its cache.
    pub cache: SocketAddr,
    /// Its empty-pool policy.
    pub empty_pool: EmptyPoolPolicy,
    /// What judges its cache alive.
    pub liveness: Liveness,
}

/// A skipped cgroup as the maps hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkipEntry {
    /// cgroup id.
    pub id: u64,
    /// cgroup level.
    pub level: u32,
    /// Listener bitmask (`listener_bit`).
    pub listeners: u64,
}

/// Counters of one listener, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListenerTotals {
    /// UDP row.
    pub udp: ListenerCounters,
    /// TCP row.
    pub tcp: ListenerCounters,
}

impl ListenerTotals {
    /// Both protocols together.
    #[must_use]
    pub fn total(&self) -> ListenerCounters {
        self.udp.add(&self.tcp)
    }
}

/// The kind of the first OS error among `error`'s causes.
fn io_kind(error: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut current = Some(error);
    while let Some(cause) = current {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        current = cause.source();
    }
    None
}

/// A `Target` for a socket address (one port for UDP and TCP).
#[must_use]
pub fn target_of(address: SocketAddr) -> Target {
    Target {
        addr: NetAddr::from(address.ip()),
        udp_port_be: port_be(address.port()),
        tcp_port_be: port_be(address.port()),
    }
}

impl Maps {
    /// Takes the maps out of a freshly loaded object.
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self, DatapathError> {
        Self::from_source(|name| {
            ebpf.take_map(name)
                .ok_or(DatapathError::MissingMap { name })
        })
    }

    /// Opens the maps a running agent pinned under `pin_dir`.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, DatapathError> {
        let dir = pin_dir.join(MAPS_DIR);
        match std::fs::metadata(&dir) {
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(DatapathError::PinsNeedRoot {
                    pin_dir: pin_dir.to_owned(),
                    source: error.into(),
                });
            }
            Err(_) => {
                return Err(DatapathError::NoPinnedState {
                    pin_dir: pin_dir.to_owned(),
                });
            }
        }
        let opened = Self::from_source(|name| {
            let path = dir.join(name);
            MapData::from_pin(&path)
                .and_then(Map::from_map_data)
                .map_err(|source| {
                    if io_kind(&source) == Some(std::io::ErrorKind::PermissionDenied) {
                        DatapathError::PinsNeedRoot {
                            pin_dir: pin_dir.to_owned(),
                            source: source.into(),
                        }
                    } else {
                        DatapathError::OpenPin { path, source }
                    }
                })
        });
        match opened {
            Err(DatapathError::OpenPin { path, source })
                if io_kind(&source) == Some(std::io::ErrorKind::NotFound) =>
            {
                // A map this build reads that the pins lack, where the pins say which layout
                // they are: an earlier release's (releases only add maps), said so with what to
                // run; pins that cannot say are incomplete.
                match super::pinned_layout(pin_dir) {
                    Some(pinned) if pinned <= redirector_common::LAYOUT_VERSION => {
                        Err(DatapathError::OlderPins {
                            pin_dir: pin_dir.to_owned(),
                            name: path
                                .file_name()
                                .map(|name| name.to_string_lossy().into_owned())
                                .unwrap_or_default(),
                            release: crate::release::VERSION,
                        })
                    }
                    _ => Err(DatapathError::OpenPin { path, source }),
                }
            }
            other => other,
        }
    }

    /// Types every map `source` yields by name.
    fn from_source(
        mut source: impl FnMut(&'static str) -> Result<Map, DatapathError>,
    ) -> Result<Self, DatapathError> {
        let open = &mut source;
        Ok(Self {
            listeners: typed(open, names::MAP_LISTENERS)?,
            listener_mode: typed(open, names::MAP_LISTENER_MODE)?,
            cache_health: typed(open, names::MAP_CACHE_HEALTH)?,
            socket_counts: MappedArray::new(
                open(names::MAP_SOCKET_COUNTS)?,
                names::MAP_SOCKET_COUNTS,
            )?,
            cache_activity: MappedArray::new(
                open(names::MAP_CACHE_ACTIVITY)?,
                names::MAP_CACHE_ACTIVITY,
            )?,
            stall_timing: typed(open, names::MAP_STALL_TIMING)?,
            cache_pending: typed(open, names::MAP_CACHE_PENDING)?,
            cache_ports: typed(open, names::MAP_CACHE_PORTS)?,
            cache_binds: typed(open, names::MAP_CACHE_BINDS)?,
            cache_sockets: typed(open, names::MAP_CACHE_SOCKETS)?,
            listener_info: typed(open, names::MAP_LISTENER_INFO)?,
            pools: typed(open, names::MAP_POOLS)?,
            reverse_nat: typed(open, names::MAP_REVERSE_NAT)?,
            reply_ports: typed(open, names::MAP_REPLY_PORTS)?,
            counters: typed(open, names::MAP_COUNTERS)?,
            skip_cgroups: typed(open, names::MAP_SKIP_CGROUPS)?,
            datapath_config: typed(open, names::MAP_DATAPATH_CONFIG)?,
            cache_tasks: typed(open, names::MAP_CACHE_TASKS)?,
        })
    }

    /// Writes everything the programs need to know about one listener, its address entry last:
    /// a listener becomes visible to the programs only once complete. An adopted listener (same
    /// id, same name) keeps the operator's mode; `pool: None` leaves its pool as it is (a dynamic
    /// source has not spoken yet, and an adopted pool is the last known good one).
    pub fn install_listener(
        &mut self,
        listener: &ListenerEntry<'_>,
        pool: Option<&[Target]>,
    ) -> Result<(), DatapathError> {
        let id = checked_id(listener.id)?;
        let mut name = [0u8; LISTENER_NAME_MAX];
        let bytes = listener.name.as_bytes();
        let len = bytes.len().min(LISTENER_NAME_MAX);
        name[..len].copy_from_slice(&bytes[..len]);
        let address = NetAddr::from(listener.address);
        let previous = self
            .listener_info
            .get(&id, 0)
            .map_err(read(names::MAP_LISTENER_INFO))?;
        let adopted = previous.in_use != 0 && previous.name == name;
        if adopted && previous.addr != address {
            // The listener moved: its old address is no listener any more.
            self.remove_listener_address(previous.addr)?;
        }
        self.listener_info
            .set(
                id,
                ListenerInfo {
                    name,
                    addr: address,
                    in_use: 1,
                },
                0,
            )
            .map_err(write(names::MAP_LISTENER_INFO))?;
        if !adopted {
            self.set_mode(id, Mode::default())?;
            self.set_pool(id, pool.unwrap_or_default())?;
        } else if let Some(pool) = pool {
            self.set_pool(id, pool)?;
        }
        let cache = target_of(listener.cache);
        self.allow_replies_from(&[cache])?;
        let config = ListenerConfig {
            id,
            empty_pool_policy: listener.empty_pool.value(),
            cache,
            liveness: listener.liveness.value(),
        };
        self.listeners
            .insert(address, config, 0)
            .map_err(write(names::MAP_LISTENERS))
    }

    /// Removes a listener no longer configured: its address stops being steered first, then its
    /// per-id state is cleared (the id may be given to a new listener).
    pub fn remove_listener(&mut self, id: u32) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        let info = self
            .listener_info
            .get(&id, 0)
            .map_err(read(names::MAP_LISTENER_INFO))?;
        if info.in_use != 0 {
            self.remove_listener_address(info.addr)?;
        }
        let unused = ListenerInfo {
            name: [0; LISTENER_NAME_MAX],
            addr: NetAddr::default(),
            in_use: 0,
        };
        self.listener_info
            .set(id, unused, 0)
            .map_err(write(names::MAP_LISTENER_INFO))?;
        self.set_mode(id, Mode::default())?;
        self.set_health(id, CacheHealth::default())?;
        self.cache_activity.clear(id);
        self.forget_cache_tasks(listener_bit(id))?;
        match self.pools.remove(&id) {
            Ok(()) => Ok(()),
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(source) => Err(write(names::MAP_POOLS)(source)),
        }
    }

    fn remove_listener_address(&mut self, address: NetAddr) -> Result<(), DatapathError> {
        match self.listeners.remove(&address) {
            Ok(()) => Ok(()),
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(source) => Err(write(names::MAP_LISTENERS)(source)),
        }
    }

    /// A listener's configuration as the programs see it.
    pub fn listener_config(
        &self,
        address: IpAddr,
    ) -> Result<Option<ListenerConfig>, DatapathError> {
        match self.listeners.get(&NetAddr::from(address), 0) {
            Ok(config) => Ok(Some(config)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(read(names::MAP_LISTENERS)(source)),
        }
    }

    /// Replaces a listener's upstream pool in one update. Returns false (and writes nothing)
    /// when the kernel already has exactly this pool.
    pub fn set_pool(&mut self, id: u32, targets: &[Target]) -> Result<bool, DatapathError> {
        let id = checked_id(id)?;
        let pool = Pool::from_targets(targets);
        if self.pool(id)? == pool && self.pools.get(&id, 0).is_ok() {
            return Ok(false);
        }
        self.allow_replies_from(targets)?;
        self.pools
            .insert(id, pool, 0)
            .map_err(write(names::MAP_POOLS))?;
        Ok(true)
    }

    /// Lets the reply hooks translate datagrams from the ports of `targets`, before any socket
    /// can be steered to them. Bits are never cleared: a socket steered long ago may still hear
    /// from its target, and a stale bit costs only a storage lookup.
    fn allow_replies_from(&mut self, targets: &[Target]) -> Result<(), DatapathError> {
        for port_be in targets
            .iter()
            .flat_map(|target| [target.udp_port_be, target.tcp_port_be])
        {
            let (word, bit) = reply_port_bit(port_be);
            let ports = self.reply_ports_word(word)?;
            if ports & bit == 0 {
                self.reply_ports
                    .set(word, ports | bit, 0)
                    .map_err(write(names::MAP_REPLY_PORTS))?;
            }
        }
        Ok(())
    }

    /// Whether the reply hooks translate datagrams from this port (network byte order).
    pub fn replies_allowed_from(&self, port_be: u16) -> Result<bool, DatapathError> {
        let (word, bit) = reply_port_bit(port_be);
        Ok(self.reply_ports_word(word)? & bit != 0)
    }

    fn reply_ports_word(&self, word: u32) -> Result<u64, DatapathError> {
        self.reply_ports
            .get(&word, 0)
            .map_err(read(names::MAP_REPLY_PORTS))
    }

    /// A listener's upstream pool.
    pub fn pool(&self, id: u32) -> Result<Pool, DatapathError> {
        let id = checked_id(id)?;
        match self.pools.get(&id, 0) {
            Ok(pool) => Ok(pool),
            Err(MapError::KeyNotFound) => Ok(Pool::EMPTY),
            Err(source) => Err(read(names::MAP_POOLS)(source)),
        }
    }

    /// Sets the operator's override of a listener.
    pub fn set_mode(&mut self, id: u32, mode: Mode) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        self.listener_mode
            .set(id, ListenerMode { mode: mode.value() }, 0)
            .map_err(write(names::MAP_LISTENER_MODE))
    }

    /// The operator's override of a listener.
    pub fn mode(&self, id: u32) -> Result<ListenerMode, DatapathError> {
        let id = checked_id(id)?;
        self.listener_mode
            .get(&id, 0)
            .map_err(read(names::MAP_LISTENER_MODE))
    }

    /// Sets the agent's verdict on a listener's cache.
    pub fn set_health(&mut self, id: u32, health: CacheHealth) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        self.cache_health
            .set(id, health, 0)
            .map_err(write(names::MAP_CACHE_HEALTH))
    }

    /// The agent's verdict on a listener's cache.
    pub fn health(&self, id: u32) -> Result<CacheHealth, DatapathError> {
        let id = checked_id(id)?;
        self.cache_health
            .get(&id, 0)
            .map_err(read(names::MAP_CACHE_HEALTH))
    }

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
        tick: Option<super::TickClock>,
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
        let wanted = super::TickClock::timing(tick, stall_after_ns);
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

    /// Every counted cache socket: (cookie, entry).
    #[must_use]
    pub fn cache_sockets(&self) -> Vec<(u64, CacheSocket)> {
        self.cache_sockets.iter().filter_map(Result::ok).collect()
    }

    /// Counts a cache socket the programs did not see bind (it existed before them): adds it to
    /// its listeners' counts, then inserts its entry, and takes the count back if the programs
    /// inserted it first. Counting before inserting keeps the count from ever falling below the
    /// entries, so a release racing this never sees a false zero. Returns whether it was counted
    /// here.
    pub fn count_cache_socket(
        &mut self,
        cookie: u64,
        entry: CacheSocket,
    ) -> Result<bool, DatapathError> {
        // The socket carries no mark: releases must look it up by cookie before it is counted.
        if entry.marked == UNMARKED {
            self.set_unmarked_cache_sockets(true)?;
        }
        self.add_to_counts(&entry, 1, false);
        match self.cache_sockets.insert(cookie, entry, BPF_NOEXIST) {
            Ok(()) => {
                self.renew_readers()?;
                Ok(true)
            }
            Err(error) => {
                // The programs counted it first. If the socket closed meanwhile and was the last,
                // this decrement is the one that reaches zero: it records the death, which the
                // release could not (this count still held the listener up).
                self.add_to_counts(&entry, -1, true);
                match error {
                    MapError::SyscallError(error)
                        if error.io_error.raw_os_error() == Some(libc::EEXIST) =>
                    {
                        Ok(false)
                    }
                    source => Err(write(names::MAP_CACHE_SOCKETS)(source)),
                }
            }
        }
    }

    /// Uncounts a cache socket that is gone without the programs seeing it close (or that is no
    /// cache's socket any more): removes its entry and, unless the programs removed it first,
    /// takes it off its listeners' counts (`take_off_counts`: a listener of `tracked` left
    /// without UDP sockets enters a new epoch, as in the kernel). Returns whether it was
    /// uncounted here.
    pub fn uncount_cache_socket(
        &mut self,
        cookie: u64,
        tracked: u64,
    ) -> Result<bool, DatapathError> {
        let entry = match self.cache_sockets.get(&cookie, 0) {
            Ok(entry) => entry,
            Err(MapError::KeyNotFound) => return Ok(false),
            Err(source) => return Err(read(names::MAP_CACHE_SOCKETS)(source)),
        };
        match self.cache_sockets.remove(&cookie) {
            Ok(()) => {
                self.take_off_counts(&entry, tracked);
                // A socket still open but no longer counted must stop noting reads.
                self.renew_readers()?;
                Ok(true)
            }
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(false)
            }
            Err(source) => Err(write(names::MAP_CACHE_SOCKETS)(source)),
        }
    }

    /// Moves a counted cache socket to other listeners (the configuration changed which caches a
    /// bind belongs to): rewrites its entry if it still exists, then moves the counts
    /// (`take_off_counts` for the old ones). Returns whether it was moved here.
    pub fn reassign_cache_socket(
        &mut self,
        cookie: u64,
        old: CacheSocket,
        new: CacheSocket,
        tracked: u64,
    ) -> Result<bool, DatapathError> {
        // The socket keeps whatever mark it carries.
        let new = CacheSocket {
            marked: old.marked,
            ..new
        };
        match self.cache_sockets.insert(cookie, new, BPF_EXIST) {
            Ok(()) => {
                self.add_to_counts(&new, 1, false);
                self.take_off_counts(&old, tracked);
                self.renew_readers()?;
                Ok(true)
            }
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(false)
            }
            Err(source) => Err(write(names::MAP_CACHE_SOCKETS)(source)),
        }
    }

    /// Keeps `DatapathConfig::unmarked_cache_sockets` true to the counted sockets: set while any
    /// is unmarked, cleared once none is (only the agent inserts unmarked entries, apart from a
    /// kernel that could not allocate a mark, so nothing adds one behind this check).
    pub fn settle_unmarked_cache_sockets(&mut self) -> Result<(), DatapathError> {
        let unmarked = self
            .cache_sockets()
            .iter()
            .any(|(_, entry)| entry.marked == UNMARKED);
        self.set_unmarked_cache_sockets(unmarked)
    }

    /// Sets `DatapathConfig::unmarked_cache_sockets`, leaving the other settings as they are.
    fn set_unmarked_cache_sockets(&mut self, unmarked: bool) -> Result<(), DatapathError> {
        let mut config = self.datapath_config()?;
        let value = u32::from(unmarked);
        if config.unmarked_cache_sockets == value {
            return Ok(());
        }
        config.unmarked_cache_sockets = value;
        self.datapath_config
            .set(0, config, 0)
            .map_err(write(names::MAP_DATAPATH_CONFIG))
    }

    /// Gives `DatapathConfig::readers_generation` a new value, after a change to the listeners
    /// of a live socket in `CACHE_SOCKETS`: its next read in `recvmsg` looks them up again.
    fn renew_readers(&mut self) -> Result<(), DatapathError> {
        let mut config = self.datapath_config()?;
        config.readers_generation = fresh_generation();
        self.datapath_config
            .set(0, config, 0)
            .map_err(write(names::MAP_DATAPATH_CONFIG))
    }

    /// The datapath-wide settings as the programs see them.
    pub fn datapath_config(&self) -> Result<DatapathConfig, DatapathError> {
        self.datapath_config
            .get(&0, 0)
            .map_err(read(names::MAP_DATAPATH_CONFIG))
    }

    /// Takes `entry` off its listeners' counts. A listener of `tracked` (the bits of the
    /// listeners whose caches the agent counts now) left with no UDP socket enters a new epoch,
    /// as in the kernel; one no longer tracked (removed, or no longer judged by its sockets) does
    /// not: its verdict is no longer the sockets', and a start that fails puts it back as it was.
    fn take_off_counts(&self, entry: &CacheSocket, tracked: u64) {
        let (still, gone) = (entry.listeners & tracked, entry.listeners & !tracked);
        self.add_to_counts(
            &CacheSocket {
                listeners: still,
                ..*entry
            },
            -1,
            true,
        );
        self.add_to_counts(
            &CacheSocket {
                listeners: gone,
                ..*entry
            },
            -1,
            false,
        );
    }

    /// Adds `delta` to the counts of `entry`'s listeners; with `record_death`, a listener left
    /// without UDP sockets enters a new epoch, as in the kernel.
    fn add_to_counts(&self, entry: &CacheSocket, delta: i64, record_death: bool) {
        for id in 0..MAX_LISTENERS as u32 {
            if entry.listeners & listener_bit(id) != 0 {
                self.socket_counts
                    .add(id, entry.protocol, delta, record_death);
            }
        }
    }

    /// Replaces the table of cache binds.
    pub fn set_cache_binds(
        &mut self,
        binds: &StdHashMap<BindKey, u64>,
    ) -> Result<(), DatapathError> {
        for (key, listeners) in binds {
            self.cache_binds
                .insert(
                    key,
                    BindListeners {
                        listeners: *listeners,
                    },
                    0,
                )
                .map_err(write(names::MAP_CACHE_BINDS))?;
        }
        let stale: Vec<BindKey> = self
            .cache_binds
            .keys()
            .filter_map(Result::ok)
            .filter(|key| !binds.contains_key(key))
            .collect();
        for key in stale {
            self.cache_binds
                .remove(&key)
                .map_err(write(names::MAP_CACHE_BINDS))?;
        }
        Ok(())
    }

    /// Every listener in use: id and what `LISTENER_INFO` says of it.
    pub fn listeners(&self) -> Result<Vec<(u32, ListenerInfo)>, DatapathError> {
        let mut found = Vec::new();
        for id in 0..MAX_LISTENERS as u32 {
            let info = self
                .listener_info
                .get(&id, 0)
                .map_err(read(names::MAP_LISTENER_INFO))?;
            if info.in_use != 0 {
                found.push((id, info));
            }
        }
        Ok(found)
    }

    /// The listener called `name`; an error naming the listeners there are when none is.
    pub fn listener_named(&self, name: &str) -> Result<(u32, ListenerInfo), DatapathError> {
        let listeners = self.listeners()?;
        if let Some(found) = listeners.iter().find(|(_, info)| info.name() == Some(name)) {
            return Ok(*found);
        }
        let known: Vec<&str> = listeners
            .iter()
            .filter_map(|(_, info)| info.name())
            .collect();
        Err(DatapathError::UnknownListener {
            name: name.to_owned(),
            known: known.join(", "),
        })
    }

    /// Replaces the skipped cgroups (removing those no longer configured) and the datapath-wide
    /// settings; `layout_version` is the layout the agent records (`LAYOUT_VERSION`).
    pub fn configure(
        &mut self,
        skips: &[SkipEntry],
        cache_netns_cookie: u64,
        layout_version: u32,
    ) -> Result<(), DatapathError> {
        for entry in skips {
            self.skip_cgroups
                .insert(
                    entry.id,
                    SkipCgroup {
                        listeners: entry.listeners,
                        level: entry.level,
                        _padding: 0,
                    },
                    0,
                )
                .map_err(write(names::MAP_SKIP_CGROUPS))?;
        }
        let stale: Vec<u64> = self
            .skip_cgroups
            .keys()
            .filter_map(Result::ok)
            .filter(|id| !skips.iter().any(|entry| entry.id == *id))
            .collect();
        for id in stale {
            self.skip_cgroups
                .remove(&id)
                .map_err(write(names::MAP_SKIP_CGROUPS))?;
        }
        let config = DatapathConfig {
            skip_cgroup_levels: level_mask(skips.iter().map(|entry| entry.level)),
            layout_version,
            cache_netns_cookie,
            // Owned by the reconciler (`settle_unmarked_cache_sockets`): kept as it is.
            unmarked_cache_sockets: self.datapath_config()?.unmarked_cache_sockets,
            // A start may follow any change to the counted sockets (another release's, a
            // rollback's): every socket's listeners are read again.
            readers_generation: fresh_generation(),
        };
        self.datapath_config
            .set(0, config, 0)
            .map_err(write(names::MAP_DATAPATH_CONFIG))
    }

    /// A listener's counters since the maps were created, summed over CPUs.
    pub fn counters(&self, id: u32) -> Result<ListenerTotals, DatapathError> {
        let id = checked_id(id)?;
        let row = |protocol| -> Result<ListenerCounters, DatapathError> {
            let values = self
                .counters
                .get(&counter_index(id, protocol), 0)
                .map_err(read(names::MAP_COUNTERS))?;
            Ok(values
                .iter()
                .fold(ListenerCounters::default(), ListenerCounters::add))
        };
        Ok(ListenerTotals {
            udp: row(PROTOCOL_UDP)?,
            tcp: row(PROTOCOL_TCP)?,
        })
    }

    /// Entries in the reverse-translation map (walks the whole map: for tests and status).
    #[must_use]
    pub fn reverse_entries(&self) -> Vec<(ReverseKey, ReverseValue)> {
        self.reverse_nat.iter().filter_map(Result::ok).collect()
    }
}

/// The map `name` from `source`, as the typed handle `T`.
fn typed<T>(
    source: &mut impl FnMut(&'static str) -> Result<Map, DatapathError>,
    name: &'static str,
) -> Result<T, DatapathError>
where
    T: TryFrom<Map, Error = MapError>,
{
    T::try_from(source(name)?).map_err(|source| DatapathError::MapLayout { name, source })
}

/// A `DatapathConfig::readers_generation` no storage is likely to hold: random, not the next of
/// a count, since a rollback writes zero and the release after it would count again from there,
/// meeting storages of its own earlier generations.
fn fresh_generation() -> u32 {
    use std::hash::BuildHasher as _;
    let random = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    // The low half: `hash_one` mixes every bit into it.
    random as u32
}

fn checked_id(id: u32) -> Result<u32, DatapathError> {
    if (id as usize) < MAX_LISTENERS {
        Ok(id)
    } else {
        Err(DatapathError::ListenerId { id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_carry_one_port_for_both_protocols() {
        let target = target_of("10.0.0.1:5353".parse().unwrap());
        assert_eq!(target.udp_port_be, 5353u16.to_be());
        assert_eq!(target.tcp_port_be, 5353u16.to_be());
        assert_eq!(
            IpAddr::from(target.addr),
            "10.0.0.1".parse::<IpAddr>().unwrap()
        );
    }
}
