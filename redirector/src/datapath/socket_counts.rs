//! The `SOCKET_COUNTS` map, mapped into the agent's memory (`BPF_F_MMAPABLE`, 5.5+): the kernel
//! programs and the agent both change the counts with atomic adds on the same memory, so a
//! correction by the agent never erases a bind or release the kernel counted meanwhile.

use std::{
    os::fd::AsFd as _,
    ptr::NonNull,
    sync::atomic::{AtomicI64, AtomicU64, Ordering},
};

use aya::maps::{Map, MapData, MapError};
use redirector_common::{
    counters::PROTOCOL_UDP,
    listener::{MAX_LISTENERS, SocketCounts},
    names,
};

use super::error::DatapathError;

/// `BPF_F_MMAPABLE`.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// The mapped counts of every listener.
pub struct SharedSocketCounts {
    /// Keeps the map alive while mapped.
    _map: MapData,
    base: NonNull<SocketCounts>,
    len: usize,
}

// SAFETY: the memory is shared with the kernel and only accessed through atomics.
unsafe impl Send for SharedSocketCounts {}
// SAFETY: as above.
unsafe impl Sync for SharedSocketCounts {}

impl std::fmt::Debug for SharedSocketCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedSocketCounts")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl SharedSocketCounts {
    /// Maps `map` (the `SOCKET_COUNTS` array) read-write, after checking that it is the map this
    /// build expects (a pinned map of another build could be smaller, or not mmapable).
    pub(super) fn new(map: Map) -> Result<Self, DatapathError> {
        let layout_error = |source| DatapathError::MapLayout {
            name: names::MAP_SOCKET_COUNTS,
            source,
        };
        let Map::Array(data) = map else {
            return Err(layout_error(MapError::InvalidMapType { map_type: 0 }));
        };
        let info = data.info().map_err(layout_error)?;
        if info.value_size() as usize != size_of::<SocketCounts>()
            || info.max_entries() as usize != MAX_LISTENERS
            || info.map_flags() & BPF_F_MMAPABLE == 0
        {
            return Err(DatapathError::SocketCountsLayout {
                value_size: info.value_size(),
                max_entries: info.max_entries(),
                map_flags: info.map_flags(),
            });
        }
        let len = MAX_LISTENERS;
        let bytes = len * size_of::<SocketCounts>();
        // SAFETY: mapping a BPF_F_MMAPABLE array map's fd, shared, at offset 0; the kernel lays
        // the elements out back to back (24-byte values are already 8-byte multiples).
        let address = unsafe {
            nix::sys::mman::mmap(
                None,
                std::num::NonZeroUsize::new(bytes).expect("the map is not empty"),
                nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_SHARED,
                data.fd().as_fd(),
                0,
            )
        }
        .map_err(|errno| DatapathError::Mmap {
            name: names::MAP_SOCKET_COUNTS,
            source: errno.into(),
        })?;
        Ok(Self {
            _map: data,
            base: address.cast(),
            len,
        })
    }

    fn element(&self, id: u32) -> Option<*mut SocketCounts> {
        ((id as usize) < self.len)
            // SAFETY: in bounds of the mapping.
            .then(|| unsafe { self.base.as_ptr().add(id as usize) })
    }

    /// A listener's counts, each field read atomically.
    #[must_use]
    pub fn get(&self, id: u32) -> SocketCounts {
        let Some(element) = self.element(id) else {
            return SocketCounts::default();
        };
        // SAFETY: valid, aligned fields of the mapping; the kernel only changes them atomically.
        unsafe {
            SocketCounts {
                udp: AtomicI64::from_ptr(&raw mut (*element).udp).load(Ordering::Relaxed),
                tcp: AtomicI64::from_ptr(&raw mut (*element).tcp).load(Ordering::Relaxed),
                down_epoch: AtomicU64::from_ptr(&raw mut (*element).down_epoch)
                    .load(Ordering::Relaxed),
            }
        }
    }

    /// Adds `delta` sockets of `protocol` to listener `id`'s count, as the kernel programs do:
    /// an atomic add, and with `record_death`, when a removal leaves no UDP socket, a new epoch.
    pub fn add(&self, id: u32, protocol: u32, delta: i64, record_death: bool) {
        let Some(element) = self.element(id) else {
            return;
        };
        // SAFETY: valid, aligned fields of the mapping, changed only atomically.
        unsafe {
            let count = if protocol == PROTOCOL_UDP {
                AtomicI64::from_ptr(&raw mut (*element).udp)
            } else {
                AtomicI64::from_ptr(&raw mut (*element).tcp)
            };
            let after = count.fetch_add(delta, Ordering::Relaxed) + delta;
            if record_death && delta < 0 && protocol == PROTOCOL_UDP && after <= 0 {
                AtomicU64::from_ptr(&raw mut (*element).down_epoch).fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for SharedSocketCounts {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped.
        let _ = unsafe {
            nix::sys::mman::munmap(self.base.cast(), self.len * size_of::<SocketCounts>())
        };
    }
}
