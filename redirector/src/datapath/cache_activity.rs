//! The `CACHE_ACTIVITY` map, mapped into the agent's memory: what the programs saw the caches read
//! and leave unread, their flips, and the drains the agent records beside them.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use redirector_common::activity::{CacheActivity, FLIP_DRAINED, FLIP_NONE};

use super::mmapped::MappedArray;

impl MappedArray<CacheActivity> {
    /// A listener's activity, each field read atomically.
    #[must_use]
    pub fn get(&self, id: u32) -> CacheActivity {
        let Some(element) = self.element(id) else {
            return CacheActivity::default();
        };
        let load = |field: *mut u64| {
            // SAFETY: a valid, aligned field of the mapping, changed only whole.
            unsafe { AtomicU64::from_ptr(field) }.load(Ordering::Relaxed)
        };
        // SAFETY: fields of a valid element.
        unsafe {
            CacheActivity {
                first_unread_ns: load(&raw mut (*element).first_unread_ns),
                last_read_ns: load(&raw mut (*element).last_read_ns),
                flip_epoch: load(&raw mut (*element).flip_epoch),
                flip_ns: load(&raw mut (*element).flip_ns),
                flip_reason: AtomicU32::from_ptr(&raw mut (*element).flip_reason)
                    .load(Ordering::Relaxed),
                _padding: 0,
                signalled: load(&raw mut (*element).signalled),
                stalled: load(&raw mut (*element).stalled),
                drained: load(&raw mut (*element).drained),
            }
        }
    }

    /// Clears listener `id`'s stamp of a query handed to the cache and not read yet (as a stall's
    /// flip does): the next query stamps afresh. For a copy of the running map made into a new
    /// one before the new programs run, and only then: the running programs note the cache's
    /// read of that query in the old map, so the copied stamp would age in the new one while the
    /// start probes and attaches, and the new programs would take it for a stall of a cache that
    /// reads. A cache that really stopped reading is moved one limit later than it would have
    /// been, by the new programs' own stamp.
    pub fn forget_unread(&self, id: u32) {
        let Some(element) = self.element(id) else {
            return;
        };
        // SAFETY: a valid, aligned field of the mapping, written whole.
        unsafe { AtomicU64::from_ptr(&raw mut (*element).first_unread_ns) }
            .store(0, Ordering::Relaxed);
    }

    /// Starts listener `id`'s stamps over: no query unread, no read seen (the cache's next read
    /// is its first). For a listener whose cache or liveness changed, and where a stamp may have
    /// been made on another clock.
    pub fn forget_reads(&self, id: u32) {
        let Some(element) = self.element(id) else {
            return;
        };
        // SAFETY: valid, aligned fields of the mapping, each written whole.
        unsafe {
            AtomicU64::from_ptr(&raw mut (*element).first_unread_ns).store(0, Ordering::Relaxed);
            AtomicU64::from_ptr(&raw mut (*element).last_read_ns).store(0, Ordering::Relaxed);
        }
    }

    /// Clears everything of listener `id`: its stamps, its latest flip and its tallies (the id
    /// goes to another listener, or to none).
    pub fn clear(&self, id: u32) {
        self.forget_reads(id);
        let Some(element) = self.element(id) else {
            return;
        };
        // SAFETY: valid, aligned fields of the mapping, each written whole.
        unsafe {
            for field in [
                &raw mut (*element).flip_epoch,
                &raw mut (*element).flip_ns,
                &raw mut (*element).signalled,
                &raw mut (*element).stalled,
                &raw mut (*element).drained,
            ] {
                AtomicU64::from_ptr(field).store(0, Ordering::Relaxed);
            }
            AtomicU32::from_ptr(&raw mut (*element).flip_reason)
                .store(FLIP_NONE, Ordering::Relaxed);
        }
    }

    /// Puts back what a failed start cleared of listener `id` (`clear`, `forget_reads`), as
    /// `was` held it before the start, where the programs made nothing newer since: the tallies
    /// are added back (what the programs counted since stays), the latest flip (a drain's record
    /// with it) comes back unless a flip came since, and the last read seen unless a read came
    /// since. A cleared element is known by its tallies, which only a clear takes down, or by a
    /// flip gone. A query left unread is not stamped again: the programs stamp the next one.
    pub fn put_back(&self, id: u32, was: &CacheActivity) {
        let Some(element) = self.element(id) else {
            return;
        };
        let now = self.get(id);
        let cleared = now.signalled < was.signalled
            || now.stalled < was.stalled
            || now.drained < was.drained
            || (now.flip_epoch == 0 && was.flip_epoch != 0);
        // SAFETY: valid, aligned fields of the mapping, each written whole or atomically.
        unsafe {
            if cleared {
                for (field, tally) in [
                    (&raw mut (*element).signalled, was.signalled),
                    (&raw mut (*element).stalled, was.stalled),
                    (&raw mut (*element).drained, was.drained),
                ] {
                    AtomicU64::from_ptr(field).fetch_add(tally, Ordering::Relaxed);
                }
                if AtomicU64::from_ptr(&raw mut (*element).flip_epoch)
                    .compare_exchange(0, was.flip_epoch, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    AtomicU64::from_ptr(&raw mut (*element).flip_ns)
                        .store(was.flip_ns, Ordering::Relaxed);
                    let _ = AtomicU32::from_ptr(&raw mut (*element).flip_reason).compare_exchange(
                        FLIP_NONE,
                        was.flip_reason,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                }
            }
            let _ = AtomicU64::from_ptr(&raw mut (*element).last_read_ns).compare_exchange(
                0,
                was.last_read_ns,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Records a drain of listener `id` that began `epoch` at `now_ns` (monotonic), as the
    /// programs record their flips.
    pub fn record_drain(&self, id: u32, epoch: u64, now_ns: u64) {
        let Some(element) = self.element(id) else {
            return;
        };
        // SAFETY: valid, aligned fields of the mapping, each written whole.
        unsafe {
            AtomicU64::from_ptr(&raw mut (*element).flip_epoch).store(epoch, Ordering::Relaxed);
            AtomicU64::from_ptr(&raw mut (*element).flip_ns).store(now_ns, Ordering::Relaxed);
            AtomicU32::from_ptr(&raw mut (*element).flip_reason)
                .store(FLIP_DRAINED, Ordering::Relaxed);
            AtomicU64::from_ptr(&raw mut (*element).drained).fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Ends a drain of listener `id` that began `epoch`, if it is still the latest flip: the
    /// record says no more than that a flip happened (the probes may confirm the epoch).
    pub fn end_drain(&self, id: u32, epoch: u64) -> bool {
        let Some(element) = self.element(id) else {
            return false;
        };
        // SAFETY: valid, aligned fields of the mapping.
        unsafe {
            if AtomicU64::from_ptr(&raw mut (*element).flip_epoch).load(Ordering::Relaxed) != epoch
            {
                return false;
            }
            AtomicU32::from_ptr(&raw mut (*element).flip_reason)
                .compare_exchange(
                    FLIP_DRAINED,
                    FLIP_NONE,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        }
    }
}
