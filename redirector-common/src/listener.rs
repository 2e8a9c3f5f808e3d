//! Listeners: the addresses clients send DNS to, and the state that decides where it goes.

use crate::{addr::NetAddr, pool::Target};

/// Most listeners one datapath serves (ids are `0..MAX_LISTENERS`).
pub const MAX_LISTENERS: usize = 64;
/// Longest listener name kept in `ListenerInfo`, in bytes.
pub const LISTENER_NAME_MAX: usize = 32;

/// `ListenerConfig::empty_pool_policy`: the upstream pool is empty, let the syscall through to
/// the listener address untouched.
pub const EMPTY_POOL_PASS: u32 = 0;
/// `ListenerConfig::empty_pool_policy`: the upstream pool is empty, fail the syscall with
/// `EHOSTUNREACH` at once, so the resolver moves on instead of waiting for a timeout.
pub const EMPTY_POOL_FAIL: u32 = 1;

/// Value of `LISTENERS`, keyed by the listener address (`NetAddr`). Written by the agent only.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ListenerConfig {
    /// Index of this listener in the per-listener maps.
    pub id: u32,
    /// `EMPTY_POOL_PASS` or `EMPTY_POOL_FAIL`.
    pub empty_pool_policy: u32,
    /// Where DNS goes while the cache serves (often the listener address itself, port 53).
    pub cache: Target,
}
const _: () = assert!(size_of::<ListenerConfig>() == 28);

/// `ListenerMode::mode`: follow the cache's health.
pub const MODE_AUTO: u32 = 0;
/// `ListenerMode::mode`: operator override, always the cache.
pub const MODE_CACHE: u32 = 1;
/// `ListenerMode::mode`: operator override, always the upstream pool.
pub const MODE_UPSTREAM: u32 = 2;

/// Value of `LISTENER_MODE`, indexed by listener id: the operator's override. Written by the CLI
/// only, and kept across agent restarts.
///
/// Each listener's state is split by writer (`LISTENER_MODE`, `CACHE_HEALTH`): userspace replaces
/// an array element whole, so two writers of one element would lose each other's updates. Array
/// lookups are inlined by the verifier, so the split costs the programs nothing.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ListenerMode {
    /// `MODE_AUTO`, `MODE_CACHE` or `MODE_UPSTREAM`.
    pub mode: u32,
}
const _: () = assert!(size_of::<ListenerMode>() == 4);

/// `CacheHealth::verdict`: the cache is serving.
pub const HEALTH_UP: u32 = 0;
/// `CacheHealth::verdict`: the cache is not serving.
pub const HEALTH_DOWN: u32 = 1;

/// Value of `CACHE_HEALTH`, indexed by listener id: the agent's judgement of the cache. Written by
/// the agent only.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CacheHealth {
    /// `HEALTH_UP` or `HEALTH_DOWN`.
    pub verdict: u32,
}
const _: () = assert!(size_of::<CacheHealth>() == 4);

/// Where a listener's DNS goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Route {
    /// To `ListenerConfig::cache`.
    Cache,
    /// To a target of the listener's upstream pool.
    Upstream,
}

/// The routing truth table. The operator's override wins; `auto` follows the cache's health. A
/// mode this build does not know counts as `auto`: never a reason to lose DNS.
///
/// | mode       | cache health | route    |
/// |------------|--------------|----------|
/// | `cache`    | any          | cache    |
/// | `upstream` | any          | upstream |
/// | `auto`     | up           | cache    |
/// | `auto`     | down         | upstream |
#[inline(always)]
#[must_use]
pub const fn route(mode: &ListenerMode, health: &CacheHealth) -> Route {
    match mode.mode {
        MODE_CACHE => Route::Cache,
        MODE_UPSTREAM => Route::Upstream,
        _ => {
            if health.verdict == HEALTH_DOWN {
                Route::Upstream
            } else {
                Route::Cache
            }
        }
    }
}

/// Value of `LISTENER_INFO`, indexed by listener id: what the CLI shows. The programs never read
/// it. An all-zero entry is an unused id.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ListenerInfo {
    /// The listener's name, UTF-8, zero-padded.
    pub name: [u8; LISTENER_NAME_MAX],
    /// The listener address (the key of its `LISTENERS` entry).
    pub addr: NetAddr,
    /// 1 when this id is in use.
    pub in_use: u32,
}
const _: () = assert!(size_of::<ListenerInfo>() == 52);

impl ListenerInfo {
    /// The name as text, or `None` when it is not UTF-8.
    #[must_use]
    pub fn name(&self) -> Option<&str> {
        let len = self
            .name
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(self.name.len());
        core::str::from_utf8(&self.name[..len]).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route_of(mode: u32, verdict: u32) -> Route {
        route(&ListenerMode { mode }, &CacheHealth { verdict })
    }

    #[test]
    fn routing_truth_table() {
        assert_eq!(route_of(MODE_CACHE, HEALTH_UP), Route::Cache);
        assert_eq!(route_of(MODE_CACHE, HEALTH_DOWN), Route::Cache);
        assert_eq!(route_of(MODE_UPSTREAM, HEALTH_UP), Route::Upstream);
        assert_eq!(route_of(MODE_UPSTREAM, HEALTH_DOWN), Route::Upstream);
        assert_eq!(route_of(MODE_AUTO, HEALTH_UP), Route::Cache);
        assert_eq!(route_of(MODE_AUTO, HEALTH_DOWN), Route::Upstream);
    }

    #[test]
    fn unknown_mode_is_auto() {
        assert_eq!(route_of(77, HEALTH_UP), Route::Cache);
        assert_eq!(route_of(77, HEALTH_DOWN), Route::Upstream);
    }

    #[test]
    fn zeroed_entries_route_to_the_cache() {
        assert_eq!(
            route(&ListenerMode::default(), &CacheHealth::default()),
            Route::Cache
        );
    }

    #[test]
    fn info_name_stops_at_the_padding() {
        let mut name = [0u8; LISTENER_NAME_MAX];
        name[..4].copy_from_slice(b"node");
        let info = ListenerInfo {
            name,
            addr: NetAddr::default(),
            in_use: 1,
        };
        assert_eq!(info.name(), Some("node"));
    }
}
