//! Mmapable array maps (`BPF_F_MMAPABLE`, 5.5+) mapped into the agent's memory: the kernel
//! programs and the agent change their elements field by field with atomic operations on the same
//! memory, so neither ever erases what the other wrote meanwhile (a `bpf_map_update_elem` would
//! replace a whole element).

use std::{os::fd::AsFd as _, ptr::NonNull};

use aya::maps::{Map, MapData, MapError};
use redirector_common::listener::MAX_LISTENERS;

use super::error::DatapathError;

/// `BPF_F_MMAPABLE`.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// An array map of `MAX_LISTENERS` elements of `T`, mapped read-write.
pub struct MappedArray<T> {
    /// Keeps the map alive while mapped.
    _map: MapData,
    name: &'static str,
    base: NonNull<T>,
}

// SAFETY: the memory is shared with the kernel and only accessed through atomics.
unsafe impl<T> Send for MappedArray<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for MappedArray<T> {}

impl<T> std::fmt::Debug for MappedArray<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedArray")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<T> MappedArray<T> {
    /// Maps `map` (the array `name`) read-write, after checking that it is the map this build
    /// expects (a pinned map of another build could be smaller, or not mmapable).
    pub(super) fn new(map: Map, name: &'static str) -> Result<Self, DatapathError> {
        let layout_error = |source| DatapathError::MapLayout { name, source };
        let Map::Array(data) = map else {
            return Err(layout_error(MapError::InvalidMapType { map_type: 0 }));
        };
        let info = data.info().map_err(layout_error)?;
        if info.value_size() as usize != size_of::<T>()
            || info.max_entries() as usize != MAX_LISTENERS
            || info.map_flags() & BPF_F_MMAPABLE == 0
        {
            return Err(DatapathError::MappedLayout {
                name,
                value_size: info.value_size(),
                max_entries: info.max_entries(),
                map_flags: info.map_flags(),
            });
        }
        // SAFETY: mapping a BPF_F_MMAPABLE array map's fd, shared, at offset 0; the kernel lays
        // the elements out back to back (values are 8-byte multiples, as `new`'s callers' types).
        let address = unsafe {
            nix::sys::mman::mmap(
                None,
                std::num::NonZeroUsize::new(Self::bytes()).expect("the map is not empty"),
                nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_SHARED,
                data.fd().as_fd(),
                0,
            )
        }
        .map_err(|errno| DatapathError::Mmap {
            name,
            source: errno.into(),
        })?;
        Ok(Self {
            _map: data,
            name,
            base: address.cast(),
        })
    }

    const fn bytes() -> usize {
        MAX_LISTENERS * size_of::<T>()
    }

    /// Listener `id`'s element, for field-by-field atomic access; `None` past the array.
    pub(super) fn element(&self, id: u32) -> Option<*mut T> {
        ((id as usize) < MAX_LISTENERS)
            // SAFETY: in bounds of the mapping.
            .then(|| unsafe { self.base.as_ptr().add(id as usize) })
    }
}

impl<T> Drop for MappedArray<T> {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped.
        let _ = unsafe { nix::sys::mman::munmap(self.base.cast(), Self::bytes()) };
    }
}
