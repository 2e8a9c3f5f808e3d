//! What a start changes in the maps the running programs read, kept so that a start that fails
//! after its first write can put them back: the running set then steers on the state it had,
//! not on half of the new configuration with no agent to finish it.
//!
//! Kept here: the maps the agent writes whole from its configuration (listeners, their ids,
//! overrides, verdicts and pools, the cache binds and ports, the skipped cgroups, the exempt
//! cgroups, the datapath settings, the stall limits), and what a start clears of the kernel's own
//! record for a listener it removes or starts clean (its cache's activity and flips, drains
//! included, and the processes known as its caches). The rest of the kernel's state (socket
//! counts, epochs, translations, counters, the workloads' counts) a start never rewrites: it is
//! the truth the programs made, and a failed start re-counts the sockets under the restored
//! binds (`Reconciler::restore_binds`). What was cleared is put back only where the programs
//! made nothing newer meanwhile (`MappedArray::<CacheActivity>::put_back`, `merge_cache_tasks`).

use aya::maps::{Array, HashMap, MapData, MapError};
use redirector_common::{
    activity::{CacheActivity, StallTiming},
    addr::NetAddr,
    binds::{BindKey, BindListeners, CacheTask},
    datapath::{DatapathConfig, SkipCgroup},
    listener::{CacheHealth, ListenerConfig, ListenerInfo, ListenerMode},
    names,
    pool::Pool,
    workloads::{EXEMPT_ACCOUNTING, ExemptCgroup},
};

use super::Maps;
use crate::datapath::error::{DatapathError, read, write};

/// The configuration-written maps as a start found them.
#[derive(Debug, Clone)]
pub struct Journal {
    listeners: Vec<(NetAddr, ListenerConfig)>,
    listener_info: Vec<ListenerInfo>,
    listener_mode: Vec<ListenerMode>,
    cache_health: Vec<CacheHealth>,
    stall_timing: Vec<StallTiming>,
    pools: Vec<(u32, Pool)>,
    cache_binds: Vec<(BindKey, BindListeners)>,
    skip_cgroups: Vec<(u64, SkipCgroup)>,
    cache_ports: Vec<u64>,
    cache_pending: u64,
    datapath_config: DatapathConfig,
    activity: Vec<CacheActivity>,
    cache_tasks: Vec<(u32, CacheTask)>,
    workload_exempt: Vec<(u64, ExemptCgroup)>,
}

/// Every entry of a hash map, or the error naming it.
fn entries<K, V>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<Vec<(K, V)>, DatapathError>
where
    K: aya::Pod,
    V: aya::Pod,
{
    let mut found = Vec::new();
    for key in map.keys() {
        let key = key.map_err(read(name))?;
        match map.get(&key, 0) {
            Ok(value) => found.push((key, value)),
            // Removed by the programs between the walk and the read: not there to restore.
            Err(MapError::KeyNotFound) => {}
            Err(source) => return Err(read(name)(source)),
        }
    }
    Ok(found)
}

/// Removes `key` from a hash map, absent or not.
fn remove_absent_ok(result: Result<(), MapError>, name: &'static str) -> Result<(), DatapathError> {
    match result {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(error))
            if error.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        Err(source) => Err(write(name)(source)),
    }
}

/// Every element of an array map, or the error naming it.
fn elements<V: aya::Pod>(
    map: &Array<MapData, V>,
    name: &'static str,
) -> Result<Vec<V>, DatapathError> {
    (0..map.len())
        .map(|index| map.get(&index, 0).map_err(read(name)))
        .collect()
}

impl Journal {
    /// What id `id` held when the start began: its name and configuration, if a listener.
    #[must_use]
    pub fn listener(&self, id: u32) -> Option<(&ListenerInfo, &ListenerConfig)> {
        let info = self
            .listener_info
            .get(usize::try_from(id).ok()?)
            .filter(|info| info.in_use != 0)?;
        let (_, config) = self.listeners.iter().find(|(_, config)| config.id == id)?;
        Some((info, config))
    }

    /// The cache binds as they were: what the socket counts must follow again after a restore.
    #[must_use]
    pub fn cache_binds(&self) -> std::collections::HashMap<BindKey, u64> {
        self.cache_binds
            .iter()
            .map(|(key, value)| (*key, value.listeners))
            .collect()
    }
}

impl Maps {
    /// Reads what a start may change in the configuration-written maps.
    pub fn journal(&self) -> Result<Journal, DatapathError> {
        Ok(Journal {
            listeners: entries(&self.listeners, names::MAP_LISTENERS)?,
            listener_info: elements(&self.listener_info, names::MAP_LISTENER_INFO)?,
            listener_mode: elements(&self.listener_mode, names::MAP_LISTENER_MODE)?,
            cache_health: elements(&self.cache_health, names::MAP_CACHE_HEALTH)?,
            stall_timing: elements(&self.stall_timing, names::MAP_STALL_TIMING)?,
            pools: entries(&self.pools, names::MAP_POOLS)?,
            cache_binds: entries(&self.cache_binds, names::MAP_CACHE_BINDS)?,
            skip_cgroups: entries(&self.skip_cgroups, names::MAP_SKIP_CGROUPS)?,
            cache_ports: elements(&self.cache_ports, names::MAP_CACHE_PORTS)?,
            cache_pending: self
                .cache_pending
                .get(&0, 0)
                .map_err(read(names::MAP_CACHE_PENDING))?,
            datapath_config: self.datapath_config()?,
            activity: (0..self.listener_info.len())
                .map(|id| self.cache_activity.get(id))
                .collect(),
            cache_tasks: entries(&self.cache_tasks, names::MAP_CACHE_TASKS)?,
            workload_exempt: entries(&self.workload_exempt, names::MAP_WORKLOAD_EXEMPT)?,
        })
    }

    /// Puts back what `journal` read. A listener's address entry goes last, as in
    /// `install_listener`: the programs see a listener only once the rest of it is back. The
    /// socket counting's own setting (`unmarked_cache_sockets`) is left as the reconciler keeps
    /// it. The processes known as caches are merged back (`merge_cache_tasks`): a caller may then
    /// forget those whose cgroups went meanwhile (`cache_tasks::forget_gone`).
    pub fn restore(&mut self, journal: &Journal) -> Result<(), DatapathError> {
        restore_array(
            &mut self.listener_info,
            &journal.listener_info,
            names::MAP_LISTENER_INFO,
        )?;
        restore_array(
            &mut self.listener_mode,
            &journal.listener_mode,
            names::MAP_LISTENER_MODE,
        )?;
        restore_array(
            &mut self.cache_health,
            &journal.cache_health,
            names::MAP_CACHE_HEALTH,
        )?;
        restore_array(
            &mut self.stall_timing,
            &journal.stall_timing,
            names::MAP_STALL_TIMING,
        )?;
        restore_hash(&mut self.pools, &journal.pools, names::MAP_POOLS)?;
        restore_hash(
            &mut self.cache_binds,
            &journal.cache_binds,
            names::MAP_CACHE_BINDS,
        )?;
        restore_hash(
            &mut self.skip_cgroups,
            &journal.skip_cgroups,
            names::MAP_SKIP_CGROUPS,
        )?;
        restore_array(
            &mut self.cache_ports,
            &journal.cache_ports,
            names::MAP_CACHE_PORTS,
        )?;
        self.cache_pending
            .set(0, journal.cache_pending, 0)
            .map_err(write(names::MAP_CACHE_PENDING))?;
        let config = DatapathConfig {
            unmarked_cache_sockets: self.datapath_config()?.unmarked_cache_sockets,
            ..journal.datapath_config
        };
        self.datapath_config
            .set(0, config, 0)
            .map_err(write(names::MAP_DATAPATH_CONFIG))?;
        for (id, was) in (0..).zip(&journal.activity) {
            self.cache_activity.put_back(id, was);
        }
        self.merge_cache_tasks(&journal.cache_tasks)?;
        // The exempt set as it was, and the caches' cgroups the programs exempted meanwhile (a
        // cache that bound during the start: `exempt_cache`, level 0).
        let mut exempt = journal.workload_exempt.clone();
        exempt.extend(
            entries(&self.workload_exempt, names::MAP_WORKLOAD_EXEMPT)?
                .into_iter()
                .filter(|(id, entry)| {
                    entry.level == 0
                        && entry.exempt_from == EXEMPT_ACCOUNTING
                        && !journal.workload_exempt.iter().any(|(kept, _)| kept == id)
                }),
        );
        restore_hash(
            &mut self.workload_exempt,
            &exempt,
            names::MAP_WORKLOAD_EXEMPT,
        )?;
        restore_hash(
            &mut self.listeners,
            &journal.listeners,
            names::MAP_LISTENERS,
        )
    }
}

/// Writes every element of an array map back.
fn restore_array<V: aya::Pod>(
    map: &mut Array<MapData, V>,
    elements: &[V],
    name: &'static str,
) -> Result<(), DatapathError> {
    for (index, value) in (0..).zip(elements) {
        map.set(index, *value, 0).map_err(write(name))?;
    }
    Ok(())
}

/// Makes a hash map hold exactly `entries`.
fn restore_hash<K, V>(
    map: &mut HashMap<MapData, K, V>,
    entries: &[(K, V)],
    name: &'static str,
) -> Result<(), DatapathError>
where
    K: aya::Pod + PartialEq,
    V: aya::Pod,
{
    for (key, value) in entries {
        map.insert(key, value, 0).map_err(write(name))?;
    }
    let extra: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|key| !entries.iter().any(|(kept, _)| kept == key))
        .collect();
    for key in extra {
        remove_absent_ok(map.remove(&key), name)?;
    }
    Ok(())
}
