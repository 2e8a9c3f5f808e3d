//! redirector's kernel programs.
//!
//! cgroup `sock_addr` hooks (Linux 4.17 connect/sendmsg, 5.2 recvmsg, 5.8 getpeername) steer DNS
//! sent to a listener address: to the cache while it serves, to an upstream target while it does
//! not. There is no NAT: the destination is rewritten before the socket ever routes a packet, and
//! replies are shown to the application as coming from the listener it addressed.
//!
//! A cgroup `skb` egress program (4.10; 5.2 for the socket storage it reads) refuses the next send
//! of a connected DNS socket whose peer is no longer where its listener's route points, so the
//! resolver reconnects and connect steers it to the current route.
//!
//! A cgroup `skb` ingress program notes the queries that reach a cache's socket, for the stall
//! detection (`activity`), and counts the replies each workload receives by rcode class; the
//! steering programs and egress count its queries by route (`workloads`).
//!
//! A raw tracepoint on `signal_deliver` (4.17) fails a cache's listeners over the moment the
//! process that bound its sockets is told to stop, before it closes them.
//!
//! Each entry point is a thin shim: it names its hook and address family and maps the result of a
//! `try_*` function onto the verdict the kernel expects.
#![no_std]
#![no_main]
#![feature(core_intrinsics, asm_experimental_arch)]
#![expect(internal_features, reason = "atomic add intrinsic, see atomic.rs")]

mod activity;
mod atomic;
mod clock;
mod context;
mod liveness;
mod maps;
mod reverse;
mod signal;
mod skb;
mod stale;
mod steer;
mod workloads;

use aya_ebpf::{
    macros::{cgroup_skb, cgroup_sock, cgroup_sock_addr, raw_tracepoint},
    programs::{RawTracePointContext, SkBuffContext, SockAddrContext, SockContext},
};

use crate::{context::Family, reverse::PeerHook, steer::Hook};

/// `cgroup/connect*` and `cgroup/sendmsg*`: let the syscall proceed (with the address as the
/// program left it).
const VERDICT_ALLOW: i32 = 1;
/// `cgroup/connect*` and `cgroup/sendmsg*`: fail the syscall (`EPERM`, or the errno set with
/// `bpf_set_retval`).
const VERDICT_REJECT: i32 = 0;

/// `cgroup/post_bind*` and `cgroup/sock_release`: let the bind stand, let the close proceed.
const VERDICT_SOCK_ALLOW: i32 = 1;

/// The verdict of a connect or sendmsg program.
#[inline(always)]
fn steering_verdict(result: Result<(), steer::Refused>) -> i32 {
    match result {
        Ok(()) => VERDICT_ALLOW,
        Err(steer::Refused::EmptyPool | steer::Refused::RateLimited) => VERDICT_REJECT,
    }
}

/// The verdict of a recvmsg or getpeername program: the kernel accepts only "allow" there.
#[inline(always)]
fn reverse_verdict(_translated: reverse::Outcome) -> i32 {
    VERDICT_ALLOW
}

#[cgroup_sock_addr(connect4)]
pub fn dns_connect4(ctx: SockAddrContext) -> i32 {
    steering_verdict(steer::try_steer(&ctx, Family::Ipv4, Hook::Connect))
}

#[cgroup_sock_addr(connect6)]
pub fn dns_connect6(ctx: SockAddrContext) -> i32 {
    steering_verdict(steer::try_steer(&ctx, Family::Ipv6, Hook::Connect))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn dns_sendmsg4(ctx: SockAddrContext) -> i32 {
    steering_verdict(steer::try_steer(&ctx, Family::Ipv4, Hook::Sendmsg))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn dns_sendmsg6(ctx: SockAddrContext) -> i32 {
    steering_verdict(steer::try_steer(&ctx, Family::Ipv6, Hook::Sendmsg))
}

#[cgroup_sock_addr(recvmsg4)]
pub fn dns_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse_verdict(reverse::try_translate_peer(
        &ctx,
        Family::Ipv4,
        PeerHook::Recvmsg,
    ))
}

#[cgroup_sock_addr(recvmsg6)]
pub fn dns_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse_verdict(reverse::try_translate_peer(
        &ctx,
        Family::Ipv6,
        PeerHook::Recvmsg,
    ))
}

#[cgroup_sock_addr(getpeername4)]
pub fn dns_getpeer4(ctx: SockAddrContext) -> i32 {
    reverse_verdict(reverse::try_translate_peer(
        &ctx,
        Family::Ipv4,
        PeerHook::Getpeername,
    ))
}

#[cgroup_sock_addr(getpeername6)]
pub fn dns_getpeer6(ctx: SockAddrContext) -> i32 {
    reverse_verdict(reverse::try_translate_peer(
        &ctx,
        Family::Ipv6,
        PeerHook::Getpeername,
    ))
}

/// `cgroup_skb/egress`: let the packet go.
const VERDICT_SKB_PASS: i32 = 1;
/// `cgroup_skb/egress`: drop the packet; the sender's `send` fails with `EPERM`.
const VERDICT_SKB_DROP: i32 = 0;

/// The verdict of the egress program.
#[inline(always)]
fn egress_verdict(egress: stale::Egress) -> i32 {
    match egress {
        stale::Egress::Pass => VERDICT_SKB_PASS,
        stale::Egress::Refuse => VERDICT_SKB_DROP,
    }
}

#[cgroup_skb(egress)]
pub fn dns_egress(ctx: SkBuffContext) -> i32 {
    egress_verdict(stale::try_check_egress(&ctx))
}

/// `cgroup_skb/ingress` (4.10; `__sk_buff.sk` and `bpf_sk_fullsock` 5.1, `bpf_sk_storage_get`
/// 5.2): notes a query where it reaches a cache's socket, counts a reply for the workload that
/// receives it, and lets every packet in.
#[cgroup_skb(ingress)]
pub fn dns_ingress(ctx: SkBuffContext) -> i32 {
    activity::note_delivery(&ctx);
    workloads::note_reply(&ctx);
    VERDICT_SKB_PASS
}

/// The verdict of a socket-tracking program: tracking never refuses a bind or a close.
#[inline(always)]
fn tracking_verdict(_tracked: Option<()>) -> i32 {
    VERDICT_SOCK_ALLOW
}

#[cgroup_sock(post_bind4)]
pub fn dns_post_bind4(ctx: SockContext) -> i32 {
    tracking_verdict(liveness::try_count_bind(&ctx, liveness::BindFamily::Ipv4))
}

#[cgroup_sock(post_bind6)]
pub fn dns_post_bind6(ctx: SockContext) -> i32 {
    tracking_verdict(liveness::try_count_bind(&ctx, liveness::BindFamily::Ipv6))
}

#[cgroup_sock(sock_release)]
pub fn dns_release(ctx: SockContext) -> i32 {
    tracking_verdict(liveness::try_uncount_release(&ctx))
}

/// The value a raw tracepoint program returns: the kernel ignores it.
const RAW_TRACEPOINT_DONE: i32 = 0;

/// The verdict of the signal program: it only records.
#[inline(always)]
fn signal_verdict(_flipped: Option<()>) -> i32 {
    RAW_TRACEPOINT_DONE
}

#[raw_tracepoint(tracepoint = "signal_deliver")]
pub fn dns_signal(ctx: RawTracePointContext) -> i32 {
    signal_verdict(signal::try_flip_on_signal(&ctx))
}

/// Never attached (the section names only its program type): the agent runs it with
/// `BPF_PROG_TEST_RUN` to read the tick count, which userspace cannot, when it measures the
/// kernel's tick for the activity stamps. Its answer is its return value (the run's `retval`),
/// so it is declared without `#[raw_tracepoint]`, whose entry point returns 0 whatever the
/// function returns.
#[unsafe(no_mangle)]
#[unsafe(link_section = "raw_tp/signal_deliver")]
pub fn dns_ticks(ctx: *mut core::ffi::c_void) -> u32 {
    clock::ticks_half(&RawTracePointContext::new(ctx))
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // Unreachable in a verified program: the verifier rejects any path that could get here.
    loop {}
}

/// The kernel offers GPL-only helpers only to GPL-compatible programs ("Dual MIT/GPL" is one).
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
