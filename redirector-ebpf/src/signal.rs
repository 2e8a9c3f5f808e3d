//! `raw_tracepoint/signal_deliver`: a cache told to stop moves its DNS before it closes a socket.
//!
//! A cache that gets SIGTERM keeps its sockets until it has shut down (unbound 10-14 ms under load,
//! CoreDNS a whole `lameduck` period), and the socket count fails the listener over only at the
//! last close: queries that reach the sockets in between are lost. `signal_deliver` fires in the
//! receiving task before it acts on the signal (`get_signal`, process context), for a handled
//! SIGTERM as 15 and for SIGKILL, the OOM killer's and an unhandled SIGTERM as 9 on each thread.
//! When the receiver is a process that bound a cache socket (`CACHE_TASKS`, recorded by
//! `post_bind`, in the same cgroup: pids are reused), each of its listeners whose cache still has
//! sockets gets a new `down_epoch`, exactly as the last close records one, and the flip is recorded
//! as `signalled` (`CACHE_ACTIVITY`): from the next syscall on the listener routes upstream, and
//! only the agent's probes, confirming the cache in the new epoch after `probe.signal_hold_ms` (a
//! cache shutting down answers them until its last close), bring it back. A false alarm (an
//! `execve` in a multi-threaded cache shows SIGKILL on its other threads; a signal the cache
//! survives) costs a stay on the upstreams until then.
//!
//! Raw tracepoints (`BPF_RAW_TRACEPOINT_OPEN`, 4.17) need no tracefs; the program runs for every
//! signal on the node, so the number is tested first (Go's runtime sends SIGURG often), and a
//! signal to any other process costs one hash lookup more.

use core::ptr::{addr_of, read_volatile};

use aya_ebpf::{
    helpers::{bpf_get_current_cgroup_id, bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    programs::RawTracePointContext,
};
use redirector_common::{
    activity::{CacheActivity, FLIP_SIGNALLED},
    binds::is_terminating,
    datapath::listener_bit,
    listener::{MAX_LISTENERS, SocketCounts},
};

use crate::{
    activity,
    maps::{CACHE_ACTIVITY, CACHE_HEALTH, CACHE_TASKS, SOCKET_COUNTS},
};

/// Fails over the listeners of the cache process the signal is delivered to, if it is one.
#[inline(always)]
pub fn try_flip_on_signal(ctx: &RawTracePointContext) -> Option<()> {
    // `signal_deliver(int sig, struct kernel_siginfo *info, struct k_sigaction *ka)`.
    let number: u64 = ctx.arg(0);
    if !is_terminating(number & 0xffff_ffff) {
        return None;
    }
    // SAFETY: plain helper calls.
    let (pid_tgid, cgroup_id) =
        unsafe { (bpf_get_current_pid_tgid(), bpf_get_current_cgroup_id()) };
    // SAFETY: entries are written whole.
    let task = unsafe { CACHE_TASKS.get((pid_tgid >> 32) as u32) }?;
    if task.cgroup_id != cgroup_id {
        return None;
    }
    let listeners = task.listeners;
    let mut id = 0;
    while id < MAX_LISTENERS as u32 {
        if listeners & listener_bit(id) != 0
            && let Some(counts) = SOCKET_COUNTS.get_ptr(id)
        {
            // SAFETY: an element of an array map, valid for the program's lifetime. A plain
            // read of `udp` may be stale by a concurrent add, which changes nothing here: a cache
            // with no socket left has had its epoch recorded by its last close.
            if unsafe { read_volatile(addr_of!((*counts).udp)) } > 0
                && let Some(activity) = CACHE_ACTIVITY.get_ptr_mut(id)
                // SAFETY: as above.
                && !unsafe { signal_flip_stands(id, counts, activity) }
            {
                // SAFETY: the listener's own element. The clock is read only for a cache, and is not
                // the coarse one, which tracing programs may not call (it takes a seqlock).
                unsafe { activity::flip(id, activity, FLIP_SIGNALLED, bpf_ktime_get_ns()) };
            }
        }
        id += 1;
    }
    Some(())
}

/// Whether listener `id` already routes upstream for a signal to its cache: its current epoch
/// was begun by a signal, and the probes have not confirmed the cache in it. Such a flip is not
/// repeated: SIGKILL, the OOM killer's and an unhandled SIGTERM are delivered to every thread of
/// the process (a flip per thread would count one stop many times), and a cache may be told to
/// stop twice. Once the probes confirmed the cache in that epoch (a false alarm), a signal
/// flips it again. Two threads on two CPUs may both flip: an epoch more, which routes the same.
///
/// # Safety
///
/// `counts` and `activity` are listener `id`'s elements of `SOCKET_COUNTS` and `CACHE_ACTIVITY`.
#[inline(always)]
unsafe fn signal_flip_stands(
    id: u32,
    counts: *const SocketCounts,
    activity: *const CacheActivity,
) -> bool {
    // SAFETY: the caller's elements, read field by field (each written whole).
    let (epoch, flip_epoch, reason) = unsafe {
        (
            read_volatile(addr_of!((*counts).down_epoch)),
            read_volatile(addr_of!((*activity).flip_epoch)),
            read_volatile(addr_of!((*activity).flip_reason)),
        )
    };
    reason == FLIP_SIGNALLED
        && flip_epoch == epoch
        && CACHE_HEALTH
            .get(id)
            .is_none_or(|health| health.confirmed_epoch != epoch)
}
