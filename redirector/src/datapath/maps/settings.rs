//! The datapath-wide settings (`DATAPATH_CONFIG`) and the skipped cgroups (`SKIP_CGROUPS`).

use redirector_common::{
    datapath::{DatapathConfig, SkipCgroup, level_mask},
    names,
};

use super::{Maps, cache_sockets::fresh_generation};
use crate::datapath::error::{DatapathError, read, write};

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

impl Maps {
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

    /// The datapath-wide settings as the programs see them.
    pub fn datapath_config(&self) -> Result<DatapathConfig, DatapathError> {
        self.datapath_config
            .get(&0, 0)
            .map_err(read(names::MAP_DATAPATH_CONFIG))
    }
}
