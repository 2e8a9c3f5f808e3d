//! Typed handles on the maps, for the agent (freshly loaded) and the CLI (pinned by an agent):
//! the handles and how they are opened. What is read and written through them is in the modules
//! below, one a group of maps: the listeners (`listeners`), the kernel's side of each cache's
//! liveness (`liveness`), the counted cache sockets and binds (`cache_sockets`), the datapath-wide
//! settings (`settings`), what the programs counted (`counters`), each workload's DNS
//! (`workloads`), and what a start changed (`journal`).

use std::path::Path;

use aya::{
    Ebpf,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray},
};
use redirector_common::{
    activity::{CacheActivity, StallTiming},
    addr::NetAddr,
    binds::{BindKey, BindListeners, CacheSocket, CacheTask},
    counters::ListenerCounters,
    datapath::{DatapathConfig, SkipCgroup},
    listener::{
        CacheHealth, ListenerConfig, ListenerInfo, ListenerMode, MAX_LISTENERS, SocketCounts,
    },
    names,
    pool::Pool,
    reverse::{ReverseKey, ReverseValue},
    workloads::{ExemptCgroup, WorkloadCounters},
};

use super::{error::DatapathError, mmapped::MappedArray, pins::MAPS_DIR};

mod cache_sockets;
mod counters;
mod journal;
mod listeners;
mod liveness;
mod settings;
mod workloads;

pub use counters::ListenerTotals;
pub use journal::Journal;
pub use listeners::{ListenerEntry, target_of};
pub use settings::SkipEntry;
pub use workloads::{ExemptEntry, ExemptWrite};

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
    workloads: HashMap<MapData, u64, WorkloadCounters>,
    workload_exempt: HashMap<MapData, u64, ExemptCgroup>,
}

impl std::fmt::Debug for Maps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maps").finish_non_exhaustive()
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
            workloads: typed(open, names::MAP_WORKLOADS)?,
            workload_exempt: typed(open, names::MAP_WORKLOAD_EXEMPT)?,
        })
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

fn checked_id(id: u32) -> Result<u32, DatapathError> {
    if (id as usize) < MAX_LISTENERS {
        Ok(id)
    } else {
        Err(DatapathError::ListenerId { id })
    }
}
