//! Settings of the datapath as a whole.

/// Entries of `SKIP_CGROUPS`.
pub const MAX_SKIP_CGROUPS: usize = 64;
/// Deepest cgroup level a skipped cgroup may sit at (levels are bits of a `u32` mask).
pub const MAX_CGROUP_LEVEL: u32 = 31;

/// Value of `DATAPATH_CONFIG[0]`.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct DatapathConfig {
    /// Bit `n` set: some skipped cgroup sits at level `n` of the hierarchy (root is level 0). The
    /// programs check the caller's ancestor at each such level only, usually one map lookup.
    pub skip_cgroup_levels: u32,
    /// `LAYOUT_VERSION` of the agent that wrote the maps.
    pub layout_version: u32,
    /// Cookie of the network namespace the caches run in (the node's): only sockets bound there
    /// count as a cache's, so a pod's own DNS server on :53 never keeps a listener "alive".
    pub cache_netns_cookie: u64,
    /// Non-zero while some counted cache socket is `binds::UNMARKED` (the agent counted sockets
    /// that existed before the programs): `sock_release` then looks up every socket closing in
    /// the caches' network namespace by cookie, as it must to uncount those. The agent sets it before it inserts such an entry and
    /// clears it once none is left.
    pub unmarked_cache_sockets: u32,
    /// The generation of the counted cache sockets' listeners: the agent gives it a new value
    /// after each change it makes to `CACHE_SOCKETS` (counting sockets the programs did not see
    /// bind, moving sockets to other listeners) and at every start, and a `binds::CacheReader`
    /// of another generation is read again from `CACHE_SOCKETS`. Zero before #28's second
    /// release (these bytes were padding, always written zero): a program then reads every
    /// socket's listeners once, and older programs never look.
    pub readers_generation: u32,
}
const _: () = assert!(size_of::<DatapathConfig>() == 24);

/// Value of `SKIP_CGROUPS`, keyed by cgroup id (the inode number of its cgroup2 directory).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct SkipCgroup {
    /// Bit `id` set: sockets of this cgroup are not steered for listener `id` (see
    /// [`listener_bit`]).
    pub listeners: u64,
    /// The cgroup's level (root is 0).
    pub level: u32,
    /// Zero.
    pub _padding: u32,
}
const _: () = assert!(size_of::<SkipCgroup>() == 16);

/// The bit of listener `id` in `SkipCgroup::listeners` (no bit for ids past the mask).
#[inline(always)]
#[must_use]
pub const fn listener_bit(id: u32) -> u64 {
    if id < u64::BITS { 1 << id } else { 0 }
}

/// The id of the lowest listener in `mask` (its lowest set bit); 64 for an empty mask. Six
/// comparisons, no loop and no table: the BPF target has no count-trailing-zeros instruction, so
/// the programs walk a mask's listeners with this instead of testing all 64 bits.
#[inline(always)]
#[must_use]
pub const fn lowest_listener(mask: u64) -> u32 {
    if mask == 0 {
        return u64::BITS;
    }
    let bit = mask & mask.wrapping_neg();
    let mut id = 0;
    if bit & 0xffff_ffff_0000_0000 != 0 {
        id += 32;
    }
    if bit & 0xffff_0000_ffff_0000 != 0 {
        id += 16;
    }
    if bit & 0xff00_ff00_ff00_ff00 != 0 {
        id += 8;
    }
    if bit & 0xf0f0_f0f0_f0f0_f0f0 != 0 {
        id += 4;
    }
    if bit & 0xcccc_cccc_cccc_cccc != 0 {
        id += 2;
    }
    if bit & 0xaaaa_aaaa_aaaa_aaaa != 0 {
        id += 1;
    }
    id
}

/// The `skip_cgroup_levels` mask for cgroups at `levels` (levels above `MAX_CGROUP_LEVEL` are
/// rejected by the agent before this is called).
#[must_use]
pub fn level_mask(levels: impl IntoIterator<Item = u32>) -> u32 {
    levels
        .into_iter()
        .filter(|level| *level <= MAX_CGROUP_LEVEL)
        .fold(0, |mask, level| mask | (1 << level))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listener_has_its_own_bit() {
        let max = crate::listener::MAX_LISTENERS as u32;
        assert_eq!(listener_bit(0), 1);
        assert_eq!(listener_bit(max - 1), 1 << 63);
        assert_eq!(listener_bit(max), 0);
    }

    #[test]
    fn the_lowest_listener_of_a_mask_is_its_lowest_bit() {
        for id in 0..64 {
            assert_eq!(lowest_listener(listener_bit(id)), id);
            assert_eq!(lowest_listener(listener_bit(id) | 1 << 63), id);
        }
        assert_eq!(lowest_listener(0b1011_0000), 4);
        assert_eq!(lowest_listener(0), 64);
    }

    #[test]
    fn mask_has_one_bit_per_level() {
        assert_eq!(level_mask([]), 0);
        assert_eq!(level_mask([2, 2, 5]), 0b10_0100);
        assert_eq!(level_mask([0, 31]), 0x8000_0001);
        assert_eq!(level_mask([32]), 0);
    }
}
