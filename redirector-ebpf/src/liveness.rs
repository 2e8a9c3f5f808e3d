//! post_bind4/6 and sock_release: count each listener's cache sockets in the kernel, and fail the
//! listener over in the moment its last UDP socket goes (`kill -9`, crash, clean exit alike), with
//! no userspace in the path.
//!
//! cgroup `sock` hooks: `post_bind4`/`post_bind6` since 4.17, `sock_release` since 5.9;
//! `bpf_get_netns_cookie` and `bpf_get_socket_cookie` for them since 5.7 and 5.10,
//! `bpf_sk_storage_get` since 5.9 (f7c6cb1d9728), `bpf_get_current_pid_tgid` and
//! `bpf_get_current_cgroup_id` since 5.7 (the binding process, for the signal program; in
//! sock_addr programs since 5.7 too, for the reading one).

use core::ptr::{self, addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_NOEXIST, BPF_SK_STORAGE_GET_F_CREATE},
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_pid_tgid, bpf_get_netns_cookie,
        bpf_get_socket_cookie, bpf_sk_storage_get,
    },
    programs::SockContext,
};
use aya_log_ebpf::info;
use redirector_common::{
    addr::NetAddr,
    binds::{BindKey, CacheMark, CacheSocket, CacheTask, MARKED, UNMARKED},
    counters::{PROTOCOL_UDP, protocol_row},
    datapath::listener_bit,
    listener::MAX_LISTENERS,
};

use crate::{
    atomic::{add_then_read_i64, add_u64, fetch_add_i64, fetch_or_u64, fetching},
    maps::{CACHE_BINDS, CACHE_MARKS, CACHE_SOCKETS, CACHE_TASKS, DATAPATH_CONFIG, SOCKET_COUNTS},
    workloads,
};

/// The address family of the `post_bind` hook (the verifier lets each read only its own family's
/// address field).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum BindFamily {
    /// `post_bind4`: `src_ip4`.
    Ipv4,
    /// `post_bind6`: `src_ip6` (which may be IPv4-mapped).
    Ipv6,
}

/// The counter row of a socket's protocol; `None` for anything but UDP and TCP.
#[inline(always)]
fn protocol(ctx: &SockContext) -> Option<u32> {
    // SAFETY: `sock` is the context the kernel passed; one whole field.
    protocol_row(unsafe { read_volatile(addr_of!((*ctx.sock).protocol)) })
}

/// `post_bind`: counts a socket just bound to a listener's cache address (or the wildcard) and
/// port, in the caches' network namespace. Binds are rare; every other socket costs one lookup.
#[inline(always)]
pub fn try_count_bind(ctx: &SockContext, family: BindFamily) -> Option<()> {
    let sock = ctx.sock;
    let protocol = protocol(ctx)?;
    // SAFETY: as in `protocol`; each read is one whole field valid in this hook.
    let (port, addr) = unsafe {
        let port = read_volatile(addr_of!((*sock).src_port));
        let addr = match family {
            BindFamily::Ipv4 => NetAddr::from_ipv4_be(read_volatile(addr_of!((*sock).src_ip4))),
            BindFamily::Ipv6 => NetAddr {
                words_be: [
                    read_volatile(addr_of!((*sock).src_ip6[0])),
                    read_volatile(addr_of!((*sock).src_ip6[1])),
                    read_volatile(addr_of!((*sock).src_ip6[2])),
                    read_volatile(addr_of!((*sock).src_ip6[3])),
                ],
            },
        };
        (port, addr)
    };
    // `src_port` is in host byte order, unlike `bpf_sock_addr.user_port`.
    let key = BindKey::new(addr, (port as u16).to_be(), protocol);
    let listeners = CACHE_BINDS.get_ptr(key)?;
    // SAFETY: entries are written whole by the agent.
    let listeners = unsafe { (*listeners).listeners };

    // Sockets of other namespaces (a pod's own DNS server on :53) are not the cache's.
    let config = DATAPATH_CONFIG.get(0)?;
    // SAFETY: plain helper calls on the program's context.
    let (netns, cookie) = unsafe {
        (
            bpf_get_netns_cookie(ctx.as_ptr()),
            bpf_get_socket_cookie(ctx.as_ptr()),
        )
    };
    if netns != config.cache_netns_cookie {
        return None;
    }
    // The mark comes first: once the entry exists, a close must find one or the other. A socket
    // the kernel could not mark is counted unmarked, and the agent's next pass makes releases
    // look it up by cookie.
    let mut mark = CacheMark { marked: MARKED };
    let marked = !cache_mark(ctx, &mut mark, u64::from(BPF_SK_STORAGE_GET_F_CREATE)).is_null();
    let entry = CacheSocket {
        listeners,
        protocol,
        marked: if marked { MARKED } else { UNMARKED },
    };
    // Count, then insert; the loser of the insert (the agent may have seen the socket first)
    // takes its count back. Both sides do it in this order, so an entry never exists for a socket
    // left uncounted, a count reaching zero always means no cache socket is left, and every
    // decrement that reaches it records the death (see `datapath::count_protocol` in the agent).
    add_to_counts(ctx, &entry, 1);
    if CACHE_SOCKETS
        .insert(cookie, entry, u64::from(BPF_NOEXIST))
        .is_err()
    {
        add_to_counts(ctx, &entry, -1);
    }
    record_task(listeners);
    Some(())
}

/// Remembers the current process as a cache of `listeners`, so that a terminating signal
/// delivered to it fails them over (`signal.rs`): the binder of a cache socket (binds are in
/// process context: the current task is the binder), and a cache socket's reader
/// (`activity::reader_listeners`; `recvmsg` runs in the reading task). Two binds of one process on two CPUs (a cache opening its listeners from
/// several threads) must both leave their bits: the entry is created whole only when absent
/// (`BPF_NOEXIST`), and an existing one of the same process gains bits by an atomic OR. A pid
/// reused by another cgroup's process is overwritten. Without fetching atomics (`fetching`),
/// a read then a write: two binds that race may leave one listener's bit unset (the socket count
/// still moves that listener at the cache's last close).
#[inline(always)]
pub fn record_task(listeners: u64) {
    // SAFETY: plain helper calls.
    let (pid_tgid, cgroup_id) =
        unsafe { (bpf_get_current_pid_tgid(), bpf_get_current_cgroup_id()) };
    let tgid = (pid_tgid >> 32) as u32;
    // A cache's own DNS (its upstream queries, their replies) is no workload's.
    workloads::exempt_cache(cgroup_id);
    let task = CacheTask {
        listeners,
        cgroup_id,
    };
    // A full LRU evicts the oldest process; a failed update leaves the socket count as backstop.
    if CACHE_TASKS
        .insert(tgid, task, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        return;
    }
    let Some(known) = CACHE_TASKS.get_ptr_mut(tgid) else {
        // Evicted or removed since: this bind's entry is the one to keep.
        let _ = CACHE_TASKS.insert(tgid, task, 0);
        return;
    };
    // SAFETY: a live entry of a preallocated LRU map, 8-byte aligned; its fields are changed by
    // whole stores and by the atomic OR below only.
    unsafe {
        if read_volatile(addr_of!((*known).cgroup_id)) != cgroup_id {
            let _ = CACHE_TASKS.insert(tgid, task, 0);
            return;
        }
        let bits = addr_of_mut!((*known).listeners);
        if read_volatile(bits) & listeners == listeners {
            return;
        }
        if fetching() {
            fetch_or_u64(bits, listeners);
        } else {
            write_volatile(bits, read_volatile(bits) | listeners);
        }
    }
}

/// `sock_release`: uncounts a counted cache socket; when it was a listener's last UDP socket, the
/// listener is in failover from the next syscall on. Runs for every socket closed on the node:
/// the others cost one field read, one storage lookup and one array lookup. While the agent has
/// counted unmarked sockets (the cache predates the programs), sockets of the caches' network
/// namespace are also looked up by cookie, until that cache's sockets are gone.
#[inline(always)]
pub fn try_uncount_release(ctx: &SockContext) -> Option<()> {
    protocol(ctx)?;
    if cache_mark(ctx, ptr::null_mut(), 0).is_null() {
        let config = DATAPATH_CONFIG.get(0)?;
        if config.unmarked_cache_sockets == 0 {
            return None;
        }
        // SAFETY: plain helper call on the program's context.
        if unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } != config.cache_netns_cookie {
            return None;
        }
    }
    // SAFETY: plain helper call on the program's context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let entry = CACHE_SOCKETS.get_ptr(cookie)?;
    // SAFETY: entries are written whole; copied before the entry goes.
    let entry = unsafe { *entry };
    // Whoever removes the entry uncounts the socket (the agent removes sockets gone unseen).
    CACHE_SOCKETS.remove(cookie).ok()?;
    add_to_counts(ctx, &entry, -1);
    Some(())
}

/// The socket's `CACHE_MARKS` mark; with `BPF_SK_STORAGE_GET_F_CREATE` in `flags`, created from
/// `init` if missing. Null when there is none (or it could not be allocated).
#[inline(always)]
fn cache_mark(ctx: &SockContext, init: *mut CacheMark, flags: u64) -> *mut CacheMark {
    // SAFETY: in cgroup sock programs the helper takes the context itself as the socket
    // (`bpf_sk_storage_get_cg_sock_proto`); the map pointer is the BTF map's address, as aya
    // passes it.
    unsafe {
        bpf_sk_storage_get(
            ptr::from_ref(&CACHE_MARKS).cast_mut().cast(),
            ctx.as_ptr(),
            init.cast(),
            flags,
        )
    }
    .cast::<CacheMark>()
}

/// Adds `delta` to the counts of every listener of `entry`, and records the cache going away for
/// those whose UDP count reached zero.
#[inline(always)]
fn add_to_counts(ctx: &SockContext, entry: &CacheSocket, delta: i64) {
    let mut id = 0;
    while id < MAX_LISTENERS as u32 {
        if entry.listeners & listener_bit(id) != 0
            && let Some(counts) = SOCKET_COUNTS.get_ptr(id)
        {
            let counts = counts.cast_mut();
            // SAFETY: an element of an array map, valid for the program's lifetime and 8-byte
            // aligned; shared with other CPUs and with the agent's mmap, hence atomic adds only.
            unsafe {
                let count = if entry.protocol == PROTOCOL_UDP {
                    addr_of_mut!((*counts).udp)
                } else {
                    addr_of_mut!((*counts).tcp)
                };
                let after = if fetching() {
                    fetch_add_i64(count, delta) + delta
                } else {
                    add_then_read_i64(count, delta)
                };
                if delta < 0 && entry.protocol == PROTOCOL_UDP && after <= 0 {
                    // This release took the last UDP socket: from the next syscall on the
                    // listener is in failover, and only a probe-confirmed verdict in this new
                    // epoch brings it back. Decided on the value the add itself returned, so a
                    // bind racing in right after cannot hide the death (without fetching
                    // atomics, on the sum read just after it: `add_then_read_i64`).
                    add_u64(addr_of_mut!((*counts).down_epoch), 1);
                    info!(
                        ctx,
                        "listener {}: the cache's last UDP socket closed; DNS fails over", id
                    );
                }
            }
        }
        id += 1;
    }
}
