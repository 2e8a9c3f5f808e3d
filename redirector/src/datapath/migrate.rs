//! Filling a map a start created beside a pinned one (another size, or a test's layout bump) with
//! what the pinned one holds: every kind of state (modes, verdicts and their epochs, socket
//! counts and the counted sockets, pools, reply ports, the skip list, translations, per-CPU
//! counters) is copied entry by entry, as bytes of the sizes the kernel reports, so one copy
//! serves every map type but socket storage (which userspace cannot walk; the layout rule keeps
//! those maps, so they are always reused).
//!
//! A start copies once before its programs replace the running ones, and once more after, for
//! the maps the running programs fill on their own ([`refilled_after_swap`]): a translation
//! written between the two copies is not lost. Counters incremented between the first copy and
//! the swap are (microseconds of traffic); socket counts that change then are corrected by the
//! recount that follows every attach.

use std::{os::fd::AsFd as _, path::Path};

use aya::maps::MapInfo;
use redirector_common::names;

use super::{
    DatapathError,
    pins::{MAPS_DIR, STAGED_MAPS_DIR},
    raw,
};

/// What one map's copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    /// Entries written into the new map.
    pub entries: usize,
    /// Entries the new map had no room for (a smaller map; an LRU evicts instead).
    pub dropped: usize,
}

/// Whether the running programs add entries to `name` on their own while a start runs, so that
/// it is copied again once the new programs run (with `BPF_NOEXIST`: never over what they wrote).
#[must_use]
pub fn refilled_after_swap(name: &str) -> bool {
    name == names::MAP_REVERSE_NAT
}

/// Copies every entry of the map pinned at `maps/NAME` into the one at `maps-next/NAME`.
/// `flags`: `raw::BPF_ANY` for the first copy, `raw::BPF_NOEXIST` for the copy after the swap.
pub fn copy(pin_dir: &Path, name: &'static str, flags: u64) -> Result<Copied, DatapathError> {
    let from_path = pin_dir.join(MAPS_DIR).join(name);
    let to_path = pin_dir.join(STAGED_MAPS_DIR).join(name);
    let failed = |path: &Path, source: std::io::Error| DatapathError::Migrate {
        name,
        path: path.to_owned(),
        source,
    };
    let from = raw::open_pinned(&from_path).map_err(|source| failed(&from_path, source))?;
    let to = raw::open_pinned(&to_path).map_err(|source| failed(&to_path, source))?;
    let info = MapInfo::from_pin(&from_path).map_err(|source| DatapathError::InspectPin {
        path: from_path.clone(),
        source,
    })?;
    let key_size = info.key_size() as usize;
    let value_size = info.value_size() as usize;
    let per_cpu = matches!(
        info.map_type(),
        Ok(aya::maps::MapType::PerCpuArray
            | aya::maps::MapType::PerCpuHash
            | aya::maps::MapType::LruPerCpuHash)
    );
    let value_len = if per_cpu {
        let cpus = aya::util::nr_cpus().map_err(|(_, source)| failed(&from_path, source))?;
        value_size.next_multiple_of(8) * cpus
    } else {
        value_size
    };
    let mut copied = Copied::default();
    let mut value = vec![0u8; value_len];
    let mut key: Option<Vec<u8>> = None;
    // A hash map walk restarts from its first key when the key it stands on is deleted (an LRU
    // evicting under traffic): bounded, so that churn cannot keep a start walking.
    let mut steps = 2 * info.max_entries() as usize + 1;
    while let Some(next) = raw::next_key(from.as_fd(), key.as_deref(), key_size)
        .map_err(|source| failed(&from_path, source))?
    {
        if steps == 0 {
            break;
        }
        steps -= 1;
        // An entry deleted between the walk and the read is simply not copied.
        if raw::lookup(from.as_fd(), &next, &mut value)
            .map_err(|source| failed(&from_path, source))?
        {
            match raw::update(to.as_fd(), &next, &value, flags) {
                Ok(()) => copied.entries += 1,
                // Already there (the new programs wrote it), or no room (a smaller array or a
                // full hash map): the new map's content stands.
                Err(error)
                    if matches!(
                        error.raw_os_error(),
                        Some(libc::EEXIST | libc::E2BIG | libc::ENOSPC)
                    ) =>
                {
                    if error.raw_os_error() != Some(libc::EEXIST) {
                        copied.dropped += 1;
                    }
                }
                Err(source) => return Err(failed(&to_path, source)),
            }
        }
        key = Some(next);
    }
    Ok(copied)
}
