//! The `SOCKET_COUNTS` map, mapped into the agent's memory: a correction by the agent never erases
//! a bind or release the kernel counted meanwhile.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use redirector_common::{counters::PROTOCOL_UDP, listener::SocketCounts};

use super::mmapped::MappedArray;

impl MappedArray<SocketCounts> {
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

    /// Begins a new epoch for listener `id` (as the programs' flips do) and returns it.
    pub fn new_epoch(&self, id: u32) -> Option<u64> {
        let element = self.element(id)?;
        // SAFETY: a valid, aligned field of the mapping, changed only atomically.
        let before = unsafe {
            AtomicU64::from_ptr(&raw mut (*element).down_epoch).fetch_add(1, Ordering::Relaxed)
        };
        Some(before + 1)
    }
}
