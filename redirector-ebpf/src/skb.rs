//! The packet of a `cgroup_skb` program: its bytes, its socket, and that socket's local storage.
//!
//! Kernel features: direct packet access in `cgroup_skb` programs 4.20; `bpf_skb_load_bytes` 4.5;
//! `__sk_buff.sk` and `bpf_sk_fullsock` 5.1; `bpf_sk_storage_get` in `cgroup_skb` programs 5.2.

use core::ptr::{self, addr_of, read_volatile};

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_sock,
    btf_maps::SkStorage,
    helpers::{bpf_sk_fullsock, bpf_sk_storage_get, bpf_skb_load_bytes},
    programs::SkBuffContext,
};

/// `ETH_P_IP` as `__sk_buff.protocol` holds it (network byte order).
pub const ETH_P_IP_BE: u32 = 0x0800_u16.to_be() as u32;
/// `ETH_P_IPV6`, likewise.
pub const ETH_P_IPV6_BE: u32 = 0x86dd_u16.to_be() as u32;
/// Where an IPv4 header holds its destination.
const IPV4_DESTINATION: usize = 16;
/// Where the IPv6 header holds its destination.
const IPV6_DESTINATION: usize = 24;

/// The full socket the packet is sent from or delivered to; none for a request or time-wait
/// socket.
#[inline(always)]
pub fn full_socket(ctx: &SkBuffContext) -> Option<*mut bpf_sock> {
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer the kernel passed. The verifier wants `sk` checked for null
    // before `bpf_sk_fullsock`, which is null for request and time-wait sockets.
    let sk = unsafe { read_volatile(addr_of!((*skb).__bindgen_anon_2.sk)) };
    if sk.is_null() {
        return None;
    }
    // SAFETY: a non-null socket pointer of the context.
    let sk = unsafe { bpf_sk_fullsock(sk) };
    (!sk.is_null()).then_some(sk)
}

/// `sk`'s element of the socket-local storage `map`, looked up and never created.
#[inline(always)]
pub fn storage<T>(map: &SkStorage<T>, sk: *mut bpf_sock) -> Option<*mut T> {
    // SAFETY: a full socket (`full_socket`), which the helper takes as the socket
    // (`ARG_PTR_TO_BTF_ID_SOCK_COMMON`); no flags: look up, never create. The map pointer is the
    // BTF map's address, as aya passes it.
    let value = unsafe {
        bpf_sk_storage_get(
            ptr::from_ref(map).cast_mut().cast(),
            sk.cast(),
            ptr::null_mut(),
            0,
        )
    }
    .cast::<T>();
    (!value.is_null()).then_some(value)
}

/// The socket's connected peer as the context gives it: the socket's family, its IPv4 address and
/// its IPv6 address (network-order words; a dual-stack socket's IPv4 peer is in both, mapped in
/// the second). Every field is read whichever the family: loads chosen by a branch get merged by
/// the compiler into one load from a computed context offset, which the verifier refuses
/// ("dereference of modified ctx ptr").
#[inline(always)]
pub fn peer(ctx: &SkBuffContext) -> (u32, u32, [u32; 4]) {
    let skb = ctx.skb.skb;
    // SAFETY: context fields of the socket, each one 4-byte load the verifier rewrites.
    unsafe {
        (
            read_volatile(addr_of!((*skb).family)),
            read_volatile(addr_of!((*skb).remote_ip4)),
            [
                read_volatile(addr_of!((*skb).remote_ip6[0])),
                read_volatile(addr_of!((*skb).remote_ip6[1])),
                read_volatile(addr_of!((*skb).remote_ip6[2])),
                read_volatile(addr_of!((*skb).remote_ip6[3])),
            ],
        )
    }
}

/// Whether an egress packet goes to its socket's connected peer (`peer`'s fields): false for a
/// datagram a connected socket sent with an address of its own (`sendto`), which the kernel sends
/// there instead, and which `sendmsg` saw. Compares the packet's destination with the peer, by
/// address (a dual-stack socket's IPv4 packet with its IPv4 peer); true where the packet cannot
/// be read.
#[inline(always)]
pub fn sent_to_peer(ctx: &SkBuffContext, (_, ip4, ip6): (u32, u32, [u32; 4])) -> bool {
    // SAFETY: the context pointer the kernel passed; the verifier rewrites the load.
    let protocol = unsafe { read_volatile(addr_of!((*ctx.skb.skb).protocol)) };
    if protocol == ETH_P_IP_BE {
        read_bytes::<4>(ctx, IPV4_DESTINATION).is_none_or(|to| u32::from_ne_bytes(to) == ip4)
    } else if protocol == ETH_P_IPV6_BE {
        read_bytes::<16>(ctx, IPV6_DESTINATION).is_none_or(|to| {
            let word = |at: usize| u32::from_ne_bytes([to[at], to[at + 1], to[at + 2], to[at + 3]]);
            [word(0), word(4), word(8), word(12)] == ip6
        })
    } else {
        true
    }
}

/// `N` bytes at `offset` of the packet: read in place where they lie in its linear part (direct
/// packet access, bounds checked as the verifier requires), else copied out with
/// `bpf_skb_load_bytes`.
#[inline(always)]
pub fn read_bytes<const N: usize>(ctx: &SkBuffContext, offset: usize) -> Option<[u8; N]> {
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer the kernel passed; the verifier rewrites `data` and `data_end`
    // into the packet's pointers (cgroup_skb programs with CAP_BPF or CAP_SYS_ADMIN, 4.20).
    let (data, data_end) = unsafe {
        (
            u64::from(read_volatile(addr_of!((*skb).data))),
            u64::from(read_volatile(addr_of!((*skb).data_end))),
        )
    };
    // The loads are 32 bits wide and zero-extended, so the compiler would compare the pointers
    // in 32 bits, which the verifier does not follow: each is made an opaque 64-bit value.
    // The start is made opaque too: the bound is checked on the very register that is read,
    // which the verifier needs for a variable offset (it does not relate two sums of the same
    // terms).
    let (start, data_end) = (opaque(opaque(data) + offset as u64), opaque(data_end));
    if start + N as u64 <= data_end {
        // SAFETY: within the packet's linear data, as just checked.
        return Some(unsafe { (start as usize as *const [u8; N]).read_unaligned() });
    }
    let mut bytes = [0_u8; N];
    // SAFETY: the context's skb, a stack buffer of exactly `N` bytes (a constant length, as the
    // verifier requires).
    let copied = unsafe {
        bpf_skb_load_bytes(
            ctx.as_ptr().cast(),
            offset as u32,
            bytes.as_mut_ptr().cast(),
            N as u32,
        )
    };
    (copied == 0).then_some(bytes)
}

/// `value`, hidden from the optimiser: it cannot narrow what it cannot see. One register move
/// (an empty template would give the BPF line info two entries at one instruction, which the
/// kernel refuses).
#[inline(always)]
fn opaque(mut value: u64) -> u64 {
    // SAFETY: a move of the register onto itself: no memory, the value unchanged.
    unsafe {
        core::arch::asm!("{0} = {0}", inout(reg) value, options(nomem, nostack, preserves_flags))
    };
    value
}
