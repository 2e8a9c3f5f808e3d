//! The compatibility rule between releases, and the table that keeps it.
//!
//! Every release must adopt the pins of the release before it (an upgrade) and of the release
//! after it (a rollback), with no flag and no moment of unsteered DNS. A newer release's code can
//! migrate an older layout; an older release cannot know a newer one. So the layout is kept
//! forward-compatible by construction:
//!
//! - **A map's name is its layout.** Once released, a name keeps its type, key size, value size
//!   and flags, and the meaning of every byte, for good ([`RELEASED`]). A change of shape or
//!   meaning is a new map under a new name. Only the number of entries may change (the agent
//!   creates the resized map beside the pinned one and copies what it holds).
//! - **Kept state never moves.** A map whose entries no agent could rebuild from its
//!   configuration and sources ([`Kind::Kept`]: the operator's modes, verdicts and their epochs,
//!   socket counts, pools, translations, counters) stays in every later release under its name.
//!   State a release adds goes into a new map beside it. Maps the agent writes whole from its
//!   configuration at every start ([`Kind::Config`]) may be retired; the release that adopts pins
//!   without one creates it and fills it.
//!
//! So an agent adopts any pins of layout [`MIN_ADOPTABLE_LAYOUT`] or later, of an older release or
//! a newer one: a map it knows with the same shape is reused as it is (the running programs and
//! the new ones share it), one of another size is created beside and migrated, a missing one is
//! created, and a pinned map it does not know (a newer release's state) is unpinned once its own
//! programs run. The unit test below fails a build that breaks the rule.

use redirector_common::names;

/// The oldest layout whose pins follow the rule: layout 5 (the release before the rule) already
/// had every name and shape in [`RELEASED`]. Pins of an older layout are refused.
pub const MIN_ADOPTABLE_LAYOUT: u32 = 5;

/// What a map holds, for the rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Written whole from the configuration at every start: may be retired in a later release.
    Config,
    /// State no agent could rebuild: kept, under its name and shape, in every later release.
    Kept,
}

/// A map's shape as the kernel defines it: what must never change under a released name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// `bpf_map_type`.
    pub map_type: u32,
    /// Key size, bytes.
    pub key_size: u32,
    /// Value size, bytes.
    pub value_size: u32,
    /// `map_flags`.
    pub flags: u32,
}

/// A released map: its name, shape and kind.
#[derive(Clone, Copy, Debug)]
pub struct Released {
    /// The map's name in the object and under `maps/`.
    pub name: &'static str,
    /// Its shape, for good.
    pub shape: Shape,
    /// What it holds.
    pub kind: Kind,
}

/// `BPF_MAP_TYPE_HASH`.
const HASH: u32 = 1;
/// `BPF_MAP_TYPE_ARRAY`.
const ARRAY: u32 = 2;
/// `BPF_MAP_TYPE_PERCPU_ARRAY`.
const PERCPU_ARRAY: u32 = 6;
/// `BPF_MAP_TYPE_LRU_HASH`.
const LRU_HASH: u32 = 9;
/// `BPF_MAP_TYPE_SK_STORAGE`: socket-local storage, which userspace cannot walk or re-key.
pub const SK_STORAGE: u32 = 24;
/// `BPF_F_NO_PREALLOC`.
const NO_PREALLOC: u32 = 1;
/// `BPF_F_MMAPABLE`.
const MMAPABLE: u32 = 1 << 10;

const fn released(
    name: &'static str,
    map_type: u32,
    key_size: u32,
    value_size: u32,
    flags: u32,
    kind: Kind,
) -> Released {
    Released {
        name,
        shape: Shape {
            map_type,
            key_size,
            value_size,
            flags,
        },
        kind,
    }
}

/// Every map ever released, with the shape it was released with. Append only: a row is never
/// edited or removed (a retired `Config` map keeps its row, so its name is never reused).
pub const RELEASED: [Released; 24] = [
    released(names::MAP_LISTENERS, HASH, 16, 32, 0, Kind::Config),
    released(names::MAP_LISTENER_MODE, ARRAY, 4, 4, 0, Kind::Kept),
    released(names::MAP_CACHE_HEALTH, ARRAY, 4, 16, 0, Kind::Kept),
    released(names::MAP_SOCKET_COUNTS, ARRAY, 4, 24, MMAPABLE, Kind::Kept),
    released(names::MAP_CACHE_BINDS, HASH, 20, 8, 0, Kind::Config),
    released(names::MAP_CACHE_SOCKETS, HASH, 8, 16, 0, Kind::Kept),
    released(
        names::MAP_CACHE_MARKS,
        SK_STORAGE,
        4,
        4,
        NO_PREALLOC,
        Kind::Kept,
    ),
    released(names::MAP_LISTENER_INFO, ARRAY, 4, 52, 0, Kind::Config),
    released(names::MAP_POOLS, HASH, 4, 644, NO_PREALLOC, Kind::Kept),
    released(names::MAP_REVERSE_NAT, LRU_HASH, 32, 20, 0, Kind::Kept),
    released(
        names::MAP_STEERED_SOCKS,
        SK_STORAGE,
        4,
        48,
        NO_PREALLOC,
        Kind::Kept,
    ),
    released(names::MAP_REPLY_PORTS, ARRAY, 4, 8, 0, Kind::Kept),
    released(names::MAP_COUNTERS, PERCPU_ARRAY, 4, 72, 0, Kind::Kept),
    released(names::MAP_SKIP_CGROUPS, HASH, 8, 16, 0, Kind::Config),
    released(names::MAP_DATAPATH_CONFIG, ARRAY, 4, 24, 0, Kind::Kept),
    // #28: the processes that bound a cache socket, for the signal program.
    released(names::MAP_CACHE_TASKS, LRU_HASH, 4, 16, 0, Kind::Kept),
    // #28: what the caches read and leave unread, the kernel's flips and the drains.
    released(
        names::MAP_CACHE_ACTIVITY,
        ARRAY,
        4,
        64,
        MMAPABLE,
        Kind::Kept,
    ),
    released(names::MAP_STALL_LIMITS, ARRAY, 4, 8, 0, Kind::Config),
    released(names::MAP_CACHE_PORTS, ARRAY, 4, 8, 0, Kind::Config),
    // #28: a cache socket's listeners, where `recvmsg` finds them in one lookup. Kept: a
    // storage of another generation is refreshed by the programs, never rebuilt by the agent
    // (`DATAPATH_CONFIG`'s last four bytes, padding written zero before, now carry that
    // generation; zero stays a valid one).
    released(
        names::MAP_CACHE_READERS,
        SK_STORAGE,
        4,
        16,
        NO_PREALLOC,
        Kind::Kept,
    ),
    // #28: the stall limit with the clock of the activity stamps, in place of `STALL_LIMITS`
    // (retired: the limit alone), which a rollback's agent creates again.
    released(names::MAP_STALL_TIMING, ARRAY, 4, 32, 0, Kind::Config),
    // #28: the listeners whose cache's next read is wanted; every bit set by the agent at each
    // start.
    released(names::MAP_CACHE_PENDING, ARRAY, 4, 8, 0, Kind::Config),
    // #42: each workload's DNS, by cgroup id (an LRU, sized by `workloads.tracked`).
    released(names::MAP_WORKLOADS, LRU_HASH, 8, 96, 0, Kind::Kept),
    // #42: the cgroups whose DNS is not counted, written whole at every start.
    released(names::MAP_WORKLOAD_EXEMPT, HASH, 8, 8, 0, Kind::Config),
];

/// The released row of `name`.
#[must_use]
pub fn released_map(name: &str) -> Option<&'static Released> {
    RELEASED.iter().find(|row| row.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes the embedded object defines, by name.
    fn object_shapes() -> Vec<(String, Shape)> {
        let object = aya_obj::Object::parse(crate::datapath::OBJECT).expect("the object parses");
        object
            .maps
            .iter()
            .filter(|(name, _)| names::ALL_MAPS.contains(&name.as_str()))
            .map(|(name, map)| {
                (
                    name.clone(),
                    Shape {
                        map_type: map.map_type(),
                        key_size: map.key_size(),
                        value_size: map.value_size(),
                        flags: map.map_flags(),
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_released_name_keeps_its_shape() {
        for (name, shape) in object_shapes() {
            let row = released_map(&name).unwrap_or_else(|| {
                panic!(
                    "the object defines {name} ({shape:?}), which no release had: add its row to \
                     RELEASED, with the kind of state it holds"
                )
            });
            assert_eq!(
                row.shape, shape,
                "{name} was released with another shape: a release must adopt its neighbours' \
                 pins, so a changed key, value, type or flags is a new map under a new name \
                 (see this module's documentation)"
            );
        }
    }

    #[test]
    fn kept_state_stays_in_every_release() {
        let shapes = object_shapes();
        for row in RELEASED.iter().filter(|row| row.kind == Kind::Kept) {
            assert!(
                shapes.iter().any(|(name, _)| name == row.name),
                "{} holds state no agent can rebuild, so an older release rolled back to would \
                 lose it: keep the map, and put new state beside it",
                row.name
            );
        }
    }

    #[test]
    fn every_map_the_agent_knows_was_released_once() {
        for (position, row) in RELEASED.iter().enumerate() {
            assert!(
                !RELEASED[..position]
                    .iter()
                    .any(|other| other.name == row.name),
                "{} has two rows",
                row.name
            );
        }
        for name in names::ALL_MAPS {
            assert!(released_map(name).is_some(), "{name} has no row");
        }
    }
}
