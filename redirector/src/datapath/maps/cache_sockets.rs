//! The cache sockets the kernel counts (`CACHE_SOCKETS`, their listeners' counts) and the binds
//! that make a socket a cache's (`CACHE_BINDS`), as the agent corrects them: a socket the
//! programs did not see bind or close, one that changed listeners.

use std::collections::HashMap as StdHashMap;

use aya::maps::MapError;
use redirector_common::{
    binds::{BindKey, BindListeners, CacheSocket, UNMARKED},
    datapath::listener_bit,
    listener::MAX_LISTENERS,
    names,
};

use super::{BPF_EXIST, BPF_NOEXIST, Maps};
use crate::datapath::error::{DatapathError, read, write};

impl Maps {
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
}

/// A `DatapathConfig::readers_generation` no storage is likely to hold: random, not the next of
/// a count, since a rollback writes zero and the release after it would count again from there,
/// meeting storages of its own earlier generations.
pub(super) fn fresh_generation() -> u32 {
    use std::hash::BuildHasher as _;
    let random = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    // The low half: `hash_one` mixes every bit into it.
    random as u32
}
