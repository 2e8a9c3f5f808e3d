//! The kernel side seen from userspace: load the embedded object, attach its programs to a cgroup,
//! and read and write its maps (freshly loaded, or pinned by a running agent).

use std::{
    fs::File,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfError, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray},
    pin::PinError,
    programs::{CgroupAttachMode, CgroupSockAddr, ProgramError},
};
use redirector_common::{
    addr::{NetAddr, port_be},
    counters::{ListenerCounters, PROTOCOL_TCP, PROTOCOL_UDP, counter_index},
    datapath::{DatapathConfig, SkipCgroup, level_mask},
    listener::{
        CacheHealth, EMPTY_POOL_FAIL, EMPTY_POOL_PASS, LISTENER_NAME_MAX, ListenerConfig,
        ListenerInfo, ListenerMode, MAX_LISTENERS,
    },
    names,
    pool::{Pool, Target},
    reverse::{ReverseKey, ReverseValue},
};

use crate::config::EmptyPoolPolicy;

/// The eBPF object built from `redirector-ebpf` by `build.rs`.
pub static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/redirector-ebpf"));

/// Sub-directory of the pin directory holding the maps.
const PINNED_MAPS_DIR: &str = "maps";

/// Why the datapath could not be set up or used.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The object could not be loaded (maps created); usually missing privileges or BTF.
    #[error(
        "loading the eBPF object failed; redirector needs root (CAP_BPF, CAP_NET_ADMIN and \
         CAP_SYS_ADMIN) and a kernel with BTF and cgroup v2 BPF support"
    )]
    Load {
        /// What aya reported.
        #[source]
        source: EbpfError,
    },
    /// The object lacks a program this build expects: a build mismatch.
    #[error("the embedded eBPF object has no program {name}; rebuild redirector")]
    MissingProgram {
        /// The program.
        name: &'static str,
    },
    /// The object lacks a map this build expects: a build mismatch.
    #[error("the eBPF object has no map {name}; rebuild redirector")]
    MissingMap {
        /// The map.
        name: &'static str,
    },
    /// A program is not of the expected type.
    #[error("the eBPF program {name} is not a cgroup sock_addr program; rebuild redirector")]
    ProgramType {
        /// The program.
        name: &'static str,
        /// What aya reported.
        #[source]
        source: ProgramError,
    },
    /// The verifier refused a program.
    #[error("the kernel refused the eBPF program {name} (the cause holds the verifier's log)")]
    Verify {
        /// The program.
        name: &'static str,
        /// What aya reported, with the verifier log.
        #[source]
        source: ProgramError,
    },
    /// The attach cgroup could not be opened.
    #[error("cannot open the cgroup directory {path}")]
    OpenCgroup {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Attaching a program failed.
    #[error("attaching the eBPF program {name} to the cgroup {path} failed")]
    Attach {
        /// The program.
        name: &'static str,
        /// The cgroup.
        path: PathBuf,
        /// What aya reported.
        #[source]
        source: ProgramError,
    },
    /// A map is of an unexpected type or size.
    #[error(
        "the map {name} does not have the layout this build expects; rebuild redirector or remove stale pins"
    )]
    MapLayout {
        /// The map.
        name: &'static str,
        /// What aya reported.
        #[source]
        source: MapError,
    },
    /// A map read or write failed.
    #[error("{action} the map {name} failed")]
    MapAccess {
        /// What was being done.
        action: &'static str,
        /// The map.
        name: &'static str,
        /// What aya reported.
        #[source]
        source: MapError,
    },
    /// A pinned map could not be opened.
    #[error(
        "cannot open the pinned map {path}; is the agent running with this pin directory? \
         (start it with `redirector run`, or pass the agent's --pin-dir)"
    )]
    OpenPin {
        /// The pin.
        path: PathBuf,
        /// What aya reported.
        #[source]
        source: MapError,
    },
    /// A map could not be pinned.
    #[error("pinning the map {name} at {path} failed; is {dir} on a bpf filesystem?", dir = path.parent().map(Path::display).map(|d| d.to_string()).unwrap_or_default())]
    Pin {
        /// The map.
        name: &'static str,
        /// The pin.
        path: PathBuf,
        /// What aya reported.
        #[source]
        source: PinError,
    },
    /// The pin directory could not be prepared.
    #[error("cannot prepare the pin directory {path}")]
    PinDir {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A listener id past the maps' size.
    #[error("listener id {id} is out of range (at most {max} listeners)", max = MAX_LISTENERS)]
    ListenerId {
        /// The id.
        id: u32,
    },
}

/// The loaded object and its programs. Dropping it detaches every program it attached.
#[derive(Debug)]
pub struct Datapath {
    ebpf: Ebpf,
    attached_to: Option<PathBuf>,
}

impl Datapath {
    /// Loads the object (creating its maps) and every program (running the verifier), without
    /// attaching anything; pins the maps under `pin_dir/maps/` when given, replacing pins of an
    /// earlier run. Returns the typed map handles next to it.
    pub fn load(
        reverse_nat_entries: u32,
        pin_dir: Option<&Path>,
    ) -> Result<(Self, Maps), DatapathError> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(names::MAP_REVERSE_NAT, reverse_nat_entries)
            .load(OBJECT)
            .map_err(|source| DatapathError::Load { source })?;
        for name in names::SOCK_ADDR_PROGRAMS {
            sock_addr_program(&mut ebpf, name)?
                .load()
                .map_err(|source| DatapathError::Verify { name, source })?;
        }
        if let Some(pin_dir) = pin_dir {
            pin_maps(&ebpf, pin_dir)?;
        }
        let maps = Maps::take(&mut ebpf)?;
        Ok((
            Self {
                ebpf,
                attached_to: None,
            },
            maps,
        ))
    }

    /// Attaches every program to the cgroup v2 directory `cgroup`. aya attaches through bpf_link
    /// on 5.7+, and a link attachment is always "multi": programs of other owners on the same
    /// cgroup (Cilium's socket LB, for one) keep running. The kernel refuses attach flags on
    /// links, hence `Single`, which passes none.
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), DatapathError> {
        let cgroup_dir = File::open(cgroup).map_err(|source| DatapathError::OpenCgroup {
            path: cgroup.to_owned(),
            source,
        })?;
        for name in names::SOCK_ADDR_PROGRAMS {
            sock_addr_program(&mut self.ebpf, name)?
                .attach(&cgroup_dir, CgroupAttachMode::Single)
                .map_err(|source| DatapathError::Attach {
                    name,
                    path: cgroup.to_owned(),
                    source,
                })?;
        }
        self.attached_to = Some(cgroup.to_owned());
        Ok(())
    }

    /// The cgroup the programs are attached to.
    #[must_use]
    pub fn attached_to(&self) -> Option<&Path> {
        self.attached_to.as_deref()
    }
}

fn sock_addr_program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut CgroupSockAddr, DatapathError> {
    ebpf.program_mut(name)
        .ok_or(DatapathError::MissingProgram { name })?
        .try_into()
        .map_err(|source| DatapathError::ProgramType { name, source })
}

/// Typed handles on every map userspace reads or writes.
pub struct Maps {
    listeners: HashMap<MapData, NetAddr, ListenerConfig>,
    listener_mode: Array<MapData, ListenerMode>,
    cache_health: Array<MapData, CacheHealth>,
    listener_info: Array<MapData, ListenerInfo>,
    pools: HashMap<MapData, u32, Pool>,
    reverse_nat: HashMap<MapData, ReverseKey, ReverseValue>,
    counters: PerCpuArray<MapData, ListenerCounters>,
    skip_cgroups: HashMap<MapData, u64, SkipCgroup>,
    datapath_config: Array<MapData, DatapathConfig>,
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
    pub address: std::net::IpAddr,
    /// Its cache.
    pub cache: SocketAddr,
    /// Its empty-pool policy.
    pub empty_pool: EmptyPoolPolicy,
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
    fn take(ebpf: &mut Ebpf) -> Result<Self, DatapathError> {
        Self::from_source(|name| {
            ebpf.take_map(name)
                .ok_or(DatapathError::MissingMap { name })
        })
    }

    /// Opens the maps a running agent pinned under `pin_dir`.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, DatapathError> {
        let dir = pin_dir.join(PINNED_MAPS_DIR);
        Self::from_source(|name| {
            let path = dir.join(name);
            MapData::from_pin(&path)
                .and_then(Map::from_map_data)
                .map_err(|source| DatapathError::OpenPin { path, source })
        })
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
            listener_info: typed(open, names::MAP_LISTENER_INFO)?,
            pools: typed(open, names::MAP_POOLS)?,
            reverse_nat: typed(open, names::MAP_REVERSE_NAT)?,
            counters: typed(open, names::MAP_COUNTERS)?,
            skip_cgroups: typed(open, names::MAP_SKIP_CGROUPS)?,
            datapath_config: typed(open, names::MAP_DATAPATH_CONFIG)?,
        })
    }

    /// Removes the pins `Datapath::load` made (the maps live on while anything holds them).
    pub fn unpin(pin_dir: &Path) -> Result<(), DatapathError> {
        let dir = pin_dir.join(PINNED_MAPS_DIR);
        for name in names::ALL_MAPS {
            remove_stale(&dir.join(name))?;
        }
        for path in [dir.as_path(), pin_dir] {
            match std::fs::remove_dir(path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                // Someone else's files share the directory: leave it.
                Err(error) if error.raw_os_error() == Some(libc::ENOTEMPTY) => {}
                Err(source) => {
                    return Err(DatapathError::PinDir {
                        path: path.to_owned(),
                        source,
                    });
                }
            }
        }
        Ok(())
    }

    /// Writes everything the programs need to know about one listener, pool last but one and
    /// its address entry last: a listener becomes visible to the programs only once complete.
    pub fn install_listener(
        &mut self,
        listener: &ListenerEntry<'_>,
        upstreams: &[SocketAddr],
    ) -> Result<(), DatapathError> {
        let id = checked_id(listener.id)?;
        let mut name = [0u8; LISTENER_NAME_MAX];
        let bytes = listener.name.as_bytes();
        let len = bytes.len().min(LISTENER_NAME_MAX);
        name[..len].copy_from_slice(&bytes[..len]);
        let address = NetAddr::from(listener.address);
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
        self.set_mode(id, ListenerMode::default().mode)?;
        self.set_health(id, CacheHealth::default().verdict)?;
        self.set_pool(id, upstreams)?;
        let config = ListenerConfig {
            id,
            empty_pool_policy: match listener.empty_pool {
                EmptyPoolPolicy::Pass => EMPTY_POOL_PASS,
                EmptyPoolPolicy::Fail => EMPTY_POOL_FAIL,
            },
            cache: target_of(listener.cache),
        };
        self.listeners
            .insert(address, config, 0)
            .map_err(write(names::MAP_LISTENERS))
    }

    /// Replaces a listener's upstream pool in one update.
    pub fn set_pool(&mut self, id: u32, upstreams: &[SocketAddr]) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        let targets: Vec<Target> = upstreams.iter().copied().map(target_of).collect();
        self.pools
            .insert(id, Pool::from_targets(&targets), 0)
            .map_err(write(names::MAP_POOLS))
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

    /// Sets the operator's override of a listener (`MODE_*`).
    pub fn set_mode(&mut self, id: u32, mode: u32) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        self.listener_mode
            .set(id, ListenerMode { mode }, 0)
            .map_err(write(names::MAP_LISTENER_MODE))
    }

    /// The operator's override of a listener.
    pub fn mode(&self, id: u32) -> Result<ListenerMode, DatapathError> {
        let id = checked_id(id)?;
        self.listener_mode
            .get(&id, 0)
            .map_err(read(names::MAP_LISTENER_MODE))
    }

    /// Sets the agent's verdict on a listener's cache (`HEALTH_*`).
    pub fn set_health(&mut self, id: u32, verdict: u32) -> Result<(), DatapathError> {
        let id = checked_id(id)?;
        self.cache_health
            .set(id, CacheHealth { verdict }, 0)
            .map_err(write(names::MAP_CACHE_HEALTH))
    }

    /// The agent's verdict on a listener's cache.
    pub fn health(&self, id: u32) -> Result<CacheHealth, DatapathError> {
        let id = checked_id(id)?;
        self.cache_health
            .get(&id, 0)
            .map_err(read(names::MAP_CACHE_HEALTH))
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

    /// The listener called `name`.
    pub fn listener_by_name(
        &self,
        name: &str,
    ) -> Result<Option<(u32, ListenerInfo)>, DatapathError> {
        Ok(self
            .listeners()?
            .into_iter()
            .find(|(_, info)| info.name() == Some(name)))
    }

    /// Replaces the skipped cgroups (removing those no longer configured).
    pub fn set_skip_cgroups(&mut self, entries: &[SkipEntry]) -> Result<(), DatapathError> {
        for entry in entries {
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
            .filter(|id| !entries.iter().any(|entry| entry.id == *id))
            .collect();
        for id in stale {
            self.skip_cgroups
                .remove(&id)
                .map_err(write(names::MAP_SKIP_CGROUPS))?;
        }
        let config = DatapathConfig {
            skip_cgroup_levels: level_mask(entries.iter().map(|entry| entry.level)),
            layout_version: redirector_common::LAYOUT_VERSION,
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

/// Pins every map of the object under `pin_dir/maps/`, replacing pins left by an earlier run.
fn pin_maps(ebpf: &Ebpf, pin_dir: &Path) -> Result<(), DatapathError> {
    let dir = pin_dir.join(PINNED_MAPS_DIR);
    std::fs::create_dir_all(&dir).map_err(|source| DatapathError::PinDir {
        path: dir.clone(),
        source,
    })?;
    for name in names::ALL_MAPS {
        let map = ebpf.map(name).ok_or(DatapathError::MissingMap { name })?;
        let path = dir.join(name);
        remove_stale(&path)?;
        map.pin(&path)
            .map_err(|source| DatapathError::Pin { name, path, source })?;
    }
    Ok(())
}

fn remove_stale(path: &Path) -> Result<(), DatapathError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DatapathError::PinDir {
            path: path.to_owned(),
            source,
        }),
    }
}

fn checked_id(id: u32) -> Result<u32, DatapathError> {
    if (id as usize) < MAX_LISTENERS {
        Ok(id)
    } else {
        Err(DatapathError::ListenerId { id })
    }
}

fn write(name: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::MapAccess {
        action: "writing",
        name,
        source,
    }
}

fn read(name: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::MapAccess {
        action: "reading",
        name,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_defines_exactly_the_shared_names() {
        let object = aya_obj::Object::parse(OBJECT).expect("the embedded object parses");
        let mut maps: Vec<&str> = object.maps.keys().map(String::as_str).collect();
        maps.sort_unstable();
        let mut expected = names::ALL_MAPS.to_vec();
        expected.sort_unstable();
        assert_eq!(maps, expected);
        let mut programs: Vec<&str> = object.programs.keys().map(String::as_str).collect();
        programs.sort_unstable();
        let mut expected = names::SOCK_ADDR_PROGRAMS.to_vec();
        expected.sort_unstable();
        assert_eq!(programs, expected);
    }

    #[test]
    fn targets_carry_one_port_for_both_protocols() {
        let target = target_of("10.0.0.1:5353".parse().unwrap());
        assert_eq!(target.udp_port_be, 5353u16.to_be());
        assert_eq!(target.tcp_port_be, 5353u16.to_be());
        assert_eq!(
            std::net::IpAddr::from(target.addr),
            "10.0.0.1".parse::<std::net::IpAddr>().unwrap()
        );
    }
}
