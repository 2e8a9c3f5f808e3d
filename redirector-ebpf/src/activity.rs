//! The cache's own traffic, seen from both ends: a cache that stops reading its queries is moved
//! off in the kernel, and every flip the programs make (a signal, a stall) is recorded with its
//! reason (`redirector_common::activity` has the rule).
//!
//! The queries handed to the cache are noted where a datagram reaches the cache's socket
//! (`cgroup_skb` ingress, in the cache's cgroup: `note_delivery`), never where it leaves a
//! client: a datagram dropped on its way (a NetworkPolicy that allows DNS only to kube-dns pods,
//! a host firewall, a failed send) is no query the cache left unread. The cache's reads
//! are noted by `recvmsg` on a counted cache socket, which fires for every datagram a cache reads
//! with its source address (every DNS server does: it must answer the sender), when the cache
//! runs in the attach cgroup; the socket's listeners come from its socket-local storage
//! (`CACHE_READERS`), filled from `CACHE_SOCKETS` at its first read. A cache whose reads were
//! never seen is never called stalled. Both sides write their stamp at most once a clock tick, so
//! the stamps' cache line is not bounced between the clients' CPUs and the cache's at every
//! query; a read looks up its socket's listeners (its storage) and reads the clock only while a
//! stamp waits for it (`CACHE_PENDING`), about once a tick. A cache socket's first read after
//! each agent start also records the reading process as a cache (`reader_listeners`), for the
//! signal program and the exempt set: the kernel's own view of which process serves, whatever
//! the agent may see (`bpf_get_current_pid_tgid` and `bpf_get_current_cgroup_id` in sock_addr
//! programs, 5.7).
//!
//! Kernel features: the tick count (`clock`; a tick is fine for a limit of tens of ms),
//! `BPF_CMPXCHG` 5.12 (arm64's JIT 5.18; without it the stall detection is off: `fetching`), mmapable arrays 5.5, `bpf_sock_addr.sk` 5.3 (the reading socket's bound
//! port), socket-local storage from sock_addr programs 5.3.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::programs::{SkBuffContext, SockAddrContext};
use redirector_common::{
    activity::{CacheActivity, FLIP_SIGNALLED, FLIP_STALLED, is_stalled, unread_since},
    binds::CacheReader,
    datapath::{listener_bit, lowest_listener},
    listener::MAX_LISTENERS,
    reverse::reply_port_bit,
};

use crate::{
    atomic::{
        add_then_read_i64, add_u64, compare_exchange_u64, fetch_add_i64, fetch_clear_u64,
        fetch_or_u64, fetching,
    },
    clock::coarse_now,
    context, liveness,
    maps::{
        CACHE_ACTIVITY, CACHE_PENDING, CACHE_PORTS, CACHE_READERS, CACHE_SOCKETS, DATAPATH_CONFIG,
        SOCKET_COUNTS, STALL_TIMING,
    },
    skb,
};

/// Runs `$each` (a function) for every listener of the non-empty bitmask `$listeners`. A socket
/// is nearly always one listener's: that one is found in six comparisons. The rare others are
/// walked bit by bit, which the verifier follows in one pass; walking them all by their lowest
/// bit made it try every order of them (ten times the start's verification). A macro, so that
/// each call of `$each` is a direct call of an `#[inline(always)]` function, inlined: passed as
/// an `impl Fn`, a function is called through a shim that LLVM may keep out of line once it grows
/// (`stamp_unread` did), a bpf-to-bpf call into `.text` that every program calling shared code is
/// then charged with (the kernel-support audit).
macro_rules! for_each_listener {
    ($listeners:expr, $each:expr) => {{
        let listeners: u64 = $listeners;
        $each(lowest_listener(listeners));
        let others = listeners & listeners.wrapping_sub(1);
        if others != 0 {
            let mut id = 0;
            while id < MAX_LISTENERS as u32 {
                if others & listener_bit(id) != 0 {
                    $each(id);
                }
                id += 1;
            }
        }
    }};
}

/// Whether `port_be` is a port a cache listens on (`CACHE_PORTS`).
#[inline(always)]
pub fn is_cache_port(port_be: u16) -> bool {
    let (word, bit) = reply_port_bit(port_be);
    CACHE_PORTS.get(word).is_some_and(|ports| *ports & bit != 0)
}

/// On the cache route: whether the cache has left a query unread past its limit. The first
/// program to see the stall flips the listener (a new `down_epoch`, as the last close records
/// one); every program that sees it routes upstream. While the cache reads, this is two array
/// lookups and two loads; the clock is read only while a query waits unread.
#[inline(always)]
pub fn cache_stalled(listener_id: u32) -> bool {
    // Without fetching atomics the stamps cannot be taken back by one CPU alone: the kernel's
    // stall detection is off, and the agent's probes catch a hung cache.
    if !fetching() {
        return false;
    }
    let Some(timing) = STALL_TIMING.get(listener_id) else {
        return false;
    };
    if timing.stall_after_ns == 0 {
        return false;
    }
    let Some(activity) = CACHE_ACTIVITY.get_ptr_mut(listener_id) else {
        return false;
    };
    // SAFETY: an element of an array map, valid for the program's lifetime and 8-byte aligned;
    // other CPUs and the agent's mmap change its fields one by one, so each is read and written
    // whole, never borrowed.
    unsafe {
        let last_read = read_volatile(addr_of!((*activity).last_read_ns));
        if last_read == 0 {
            // No read seen yet: the cache's next one is wanted. A load while the request stands
            // (for good where the reads cannot be seen), an atomic once it was answered.
            want_read(listener_id);
            return false;
        }
        let first_unread = read_volatile(addr_of!((*activity).first_unread_ns));
        let Some(since) = unread_since(first_unread, last_read) else {
            return false;
        };
        let now = coarse_now(timing);
        if !is_stalled(since, now, timing) {
            return false;
        }
        if compare_exchange_u64(addr_of_mut!((*activity).first_unread_ns), since, 0) == since {
            flip(listener_id, activity, FLIP_STALLED, now);
        }
    }
    true
}

/// Asks the cache's reads of listener `listener_id` to look (`CACHE_PENDING`): a load while the
/// request stands, an atomic once it was answered. Not after a stamp this CPU just wrote (that
/// is `ask_for_read`): a bit seen set there may be one a read is clearing at that moment.
#[inline(always)]
fn want_read(listener_id: u32) {
    if let Some(pending) = CACHE_PENDING.get_ptr_mut(0) {
        // SAFETY: an element of an array map, 8-byte aligned; changed by atomics only.
        unsafe {
            if read_volatile(pending) & listener_bit(listener_id) == 0 {
                fetch_or_u64(pending, listener_bit(listener_id));
            }
        }
    }
}

/// Asks the cache's reads of listener `listener_id` to answer a stamp this CPU has just written
/// (or found unanswered): always the atomic, never "the bit is set already". A read clears the
/// bit, then loads the stamp (both ordered by its atomic); a plain load of the bit here may run
/// before this CPU's store of the stamp is visible (a store may pass a later load: x86's store
/// buffer, arm64), see the bit a read is clearing at that moment, and leave a stamp that read
/// missed with no bit: no later read looks, later queries see a stamp waiting and add none,
/// and the cache is called stalled while it reads (issue 47). With the fully ordered atomic
/// here, either the read sees the stamp or the bit outlives its clear. At most once a tick per
/// listener (a stamp is written once a tick).
#[inline(always)]
fn ask_for_read(listener_id: u32) {
    if let Some(pending) = CACHE_PENDING.get_ptr_mut(0) {
        // SAFETY: as in `want_read`.
        unsafe { fetch_or_u64(pending, listener_bit(listener_id)) };
    }
}

/// `cgroup_skb/ingress`: a datagram delivered to a socket of the attach cgroup. When the socket
/// is a cache's (its `CACHE_READERS` storage, filled at its reads, names listeners of the
/// current generation), the first datagram since the cache's last read, in a later clock tick,
/// stamps each of its listeners' activity unread and asks the cache's reads to answer it. A
/// datagram to any other port returns after one field load and one array lookup; to a cache
/// port, after the socket's storage lookup. A cache socket that has not read since the agent
/// started (no storage of the current generation) is not stamped: its first read fills it.
#[inline(always)]
pub fn note_delivery(ctx: &SkBuffContext) {
    if !fetching() {
        return;
    }
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer the kernel passed; the verifier rewrites the load to the
    // receiving socket's bound port (`skc_num`, host byte order).
    let port = unsafe { read_volatile(addr_of!((*skb).local_port)) };
    let (word, bit) = reply_port_bit((port as u16).to_be());
    if CACHE_PORTS.get(word).is_none_or(|ports| *ports & bit == 0) {
        return;
    }
    let Some(reader) = skb::full_socket(ctx).and_then(|sk| skb::storage(&CACHE_READERS, sk)) else {
        return;
    };
    let Some(config) = DATAPATH_CONFIG.get(0) else {
        return;
    };
    // SAFETY: non-null storage of this socket, written whole fields by its reads.
    let listeners = unsafe {
        if read_volatile(addr_of!((*reader).generation)) != config.readers_generation {
            return;
        }
        read_volatile(addr_of!((*reader).listeners))
    };
    if listeners == 0 {
        return;
    }
    for_each_listener!(listeners, stamp_unread);
}

/// A query reached listener `id`'s cache: stamped unread if it is the first since the cache's
/// last read, in a later tick (in the same tick it cannot be told from the queries that read
/// took), and the cache's reads are told to look (after the stamp, ordered: a read that sees the
/// bit sees the stamp). Two CPUs may both stamp. A query that finds a stamp waiting makes sure
/// its bit stands (a load; the atomic only where it was lost): the bit is the only thing that
/// makes a read answer, and whatever cleared it without an answer (an agent writing the map
/// whole, a race this file has not thought of) costs no false stall while queries come.
#[inline(always)]
fn stamp_unread(id: u32) {
    let Some(timing) = STALL_TIMING.get(id) else {
        return;
    };
    if timing.stall_after_ns == 0 {
        return;
    }
    let Some(activity) = CACHE_ACTIVITY.get_ptr_mut(id) else {
        return;
    };
    // SAFETY: as in `cache_stalled`.
    unsafe {
        let last_read = read_volatile(addr_of!((*activity).last_read_ns));
        if last_read == 0 {
            want_read(id);
            return;
        }
        let first_unread = read_volatile(addr_of!((*activity).first_unread_ns));
        if unread_since(first_unread, last_read).is_some() {
            want_read(id);
            return;
        }
        let now = coarse_now(timing);
        if now > last_read {
            write_volatile(addr_of_mut!((*activity).first_unread_ns), now);
            ask_for_read(id);
        }
    }
}

/// `recvmsg`: when the reading socket is a counted cache socket, notes the read for each of its
/// listeners that has a query stamped unread (`CACHE_PENDING`), and, at the socket's first read
/// since the agent started, the reading process as a cache (`reader_listeners`). Any other
/// socket returns after its bound port is checked against `CACHE_PORTS`; a cache's read after
/// its socket's storage lookup, and, while no stamp waits (all but about one a tick under load),
/// one more load.
#[inline(always)]
pub fn note_cache_read(ctx: &SockAddrContext) {
    // SAFETY: `sk` is always set in sock_addr programs (a full socket, readable as `bpf_sock`);
    // `src_port` is its bound port in host byte order.
    let port = unsafe {
        let sock = (*ctx.sock_addr).__bindgen_anon_1.sk;
        read_volatile(addr_of!((*sock).src_port))
    };
    let (word, bit) = reply_port_bit((port as u16).to_be());
    if CACHE_PORTS.get(word).is_none_or(|ports| *ports & bit == 0) {
        return;
    }
    // Every read looks at its socket's listeners, so that the first read of each cache socket
    // records its reader, stamps or not, with or without the fetching atomics.
    let listeners = reader_listeners(ctx);
    // The rest matters only to the stall detection (see `cache_stalled`).
    if listeners == 0 || !fetching() {
        return;
    }
    let Some(pending) = CACHE_PENDING.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: an element of an array map, 8-byte aligned; changed by atomics only.
    let wanted = unsafe { read_volatile(pending) };
    if wanted == 0 {
        return;
    }
    // A bit set after this load is caught by the socket's next read.
    let listeners = listeners & wanted;
    if listeners == 0 {
        return;
    }
    // Cleared before the stamps are read (ordered): a query stamped after this read looked sets
    // the bit again, one stamped before is answered below.
    // SAFETY: as above.
    unsafe { fetch_clear_u64(pending, listeners) };
    for_each_listener!(listeners, note_read);
}

/// The listeners whose cache the reading socket is (zero: none), from its `CACHE_READERS`
/// storage while that is of the current generation; else from `CACHE_SOCKETS` by cookie, kept in
/// the storage for the socket's next reads (created at its first, a non-cache socket's too, so
/// that a DNS server of another namespace on the same port pays one storage lookup as well).
///
/// A cache socket's first read of a generation (every agent start begins one) records the
/// reading process as a cache of those listeners (`liveness::record_task`), as `post_bind`
/// records a binder: the process that serves a socket is known at its reads, in the kernel,
/// whatever pid namespace the agent runs in and whatever it may read of `/proc`. So a cache that
/// was running before the programs, or one that daemonized after binding, is known from its
/// first query after the agent's start on (the agent's first probe is one).
#[inline(always)]
fn reader_listeners(ctx: &SockAddrContext) -> u64 {
    let Some(config) = DATAPATH_CONFIG.get(0) else {
        return 0;
    };
    let generation = config.readers_generation;
    // SAFETY: the storage belongs to the context's socket, which this program holds.
    let reader = unsafe { CACHE_READERS.get_ptr_mut(ctx) };
    // SAFETY: non-null storage of this socket; only this socket's reads write it, whole fields.
    if !reader.is_null() && unsafe { read_volatile(addr_of!((*reader).generation)) } == generation {
        // SAFETY: as above.
        return unsafe { read_volatile(addr_of!((*reader).listeners)) };
    }
    // SAFETY: entries are written whole.
    let listeners = CACHE_SOCKETS
        .get_ptr(context::socket_cookie(ctx))
        .map_or(0, |entry| unsafe { (*entry).listeners });
    if listeners != 0 {
        liveness::record_task(listeners);
    }
    let mut fresh = CacheReader {
        listeners,
        generation,
        _padding: 0,
    };
    // SAFETY: as above; a storage that could not be allocated leaves the next read to look again.
    unsafe {
        if reader.is_null() {
            CACHE_READERS.get_or_insert_ptr_mut(ctx, Some(&mut fresh));
        } else {
            write_volatile(addr_of_mut!((*reader).listeners), listeners);
            write_volatile(addr_of_mut!((*reader).generation), generation);
        }
    }
    listeners
}

/// Records a read of listener `id`'s cache when it answers a query stamped unread (or is the
/// first read seen): only those need the clock, about once a tick under load.
///
/// A cache may read its listener's sockets from several threads at once (CoreDNS's reuseport
/// sockets, each read by its own goroutine on whichever thread Go runs it): two answers race,
/// and the one that loaded the stamps earlier may store its older time over a later one's,
/// taking back the answer to a stamp the other read cleared the bit of. So after its store a
/// read looks again, and asks the next read (the bit) while a stamp is still unread: two
/// loads, once a tick.
#[inline(always)]
fn note_read(id: u32) {
    if let Some(activity) = CACHE_ACTIVITY.get_ptr_mut(id) {
        // SAFETY: as in `cache_stalled`.
        unsafe {
            let last_read = read_volatile(addr_of!((*activity).last_read_ns));
            let first_unread = read_volatile(addr_of!((*activity).first_unread_ns));
            if last_read != 0 && unread_since(first_unread, last_read).is_none() {
                return;
            }
            let Some(timing) = STALL_TIMING.get(id) else {
                return;
            };
            let now = coarse_now(timing);
            if now != last_read {
                write_volatile(addr_of_mut!((*activity).last_read_ns), now);
            }
            let last_read = read_volatile(addr_of!((*activity).last_read_ns));
            let first_unread = read_volatile(addr_of!((*activity).first_unread_ns));
            if unread_since(first_unread, last_read).is_some() {
                ask_for_read(id);
            }
        }
    }
}

/// Fails listener `listener_id` over in the kernel for `reason`, at `now_ns`: a new `down_epoch`
/// (routes upstream from the next syscall until the agent's probes confirm the cache in it) and
/// the record of why, which `status` shows while the epoch lasts.
///
/// # Safety
///
/// `activity` must be the listener's `CACHE_ACTIVITY` element.
#[inline(always)]
pub unsafe fn flip(listener_id: u32, activity: *mut CacheActivity, reason: u32, now_ns: u64) {
    let Some(counts) = SOCKET_COUNTS.get_ptr_mut(listener_id) else {
        return;
    };
    // SAFETY: elements of array maps, 8-byte aligned, shared with other CPUs and the agent's
    // mmap: the epoch is changed by an atomic add only, the record field by field.
    unsafe {
        let epoch = addr_of_mut!((*counts).down_epoch);
        let epoch = if fetching() {
            fetch_add_i64(epoch.cast(), 1) + 1
        } else {
            add_then_read_i64(epoch.cast(), 1)
        };
        write_volatile(addr_of_mut!((*activity).flip_epoch), epoch as u64);
        write_volatile(addr_of_mut!((*activity).flip_ns), now_ns);
        write_volatile(addr_of_mut!((*activity).flip_reason), reason);
        let tally = if reason == FLIP_SIGNALLED {
            addr_of_mut!((*activity).signalled)
        } else {
            addr_of_mut!((*activity).stalled)
        };
        add_u64(tally, 1);
    }
}
