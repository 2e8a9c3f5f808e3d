//! The listeners in the maps: writing one whole (its address entry last), removing one, and
//! each listener's pool, the operator's override and the agent's verdict on its cache; the ports
//! replies may come from.

use std::net::{IpAddr, SocketAddr};

use aya::maps::MapError;
use redirector_common::{
    addr::{NetAddr, port_be},
    datapath::listener_bit,
    listener::{
        CacheHealth, LISTENER_NAME_MAX, ListenerConfig, ListenerInfo, ListenerMode, MAX_LISTENERS,
    },
    names,
    pool::{Pool, Target},
    reverse::reply_port_bit,
    settings::{EmptyPoolPolicy, Liveness, Mode},
};

use super::{Maps, checked_id};
use crate::datapath::error::{DatapathError, read, write};

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

    /// A listener's upstream pool.
    pub fn pool(&self, id: u32) -> Result<Pool, DatapathError> {
        let id = checked_id(id)?;
        match self.pools.get(&id, 0) {
            Ok(pool) => Ok(pool),
            Err(MapError::KeyNotFound) => Ok(Pool::EMPTY),
            Err(source) => Err(read(names::MAP_POOLS)(source)),
        }
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
