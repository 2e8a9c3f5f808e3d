//! Reading and writing the `bpf_sock_addr` context.
//!
//! The verifier rewrites every context access into a load from, or store to, the real socket
//! address, and accepts only the exact field offsets and 4-byte widths it knows. Volatile accesses
//! keep the compiler from merging two `user_ip6` words into one 8-byte access, which kernels before
//! 5.x refuse.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{EbpfContext as _, helpers::bpf_get_socket_cookie, programs::SockAddrContext};
use redirector_common::{addr::NetAddr, counters::protocol_row};

/// The address family of the hook a program is attached to (`*4` or `*6`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `connect4`, `sendmsg4`, ...: the context holds `user_ip4`.
    Ipv4,
    /// `connect6`, `sendmsg6`, ...: the context holds `user_ip6`, which may be IPv4-mapped.
    Ipv6,
}

/// The socket's transport as a counter row, or `None` for anything but UDP and TCP (ping sockets
/// and raw sockets pass through the same hooks).
#[inline(always)]
pub fn protocol(ctx: &SockAddrContext) -> Option<u32> {
    // SAFETY: `sock_addr` is the context pointer the kernel passed to the program.
    protocol_row(unsafe { read_volatile(addr_of!((*ctx.sock_addr).protocol)) })
}

/// `user_port`: the port the application named (connect, sendmsg) or is shown (recvmsg,
/// getpeername), network byte order.
#[inline(always)]
pub fn user_port_be(ctx: &SockAddrContext) -> u16 {
    // SAFETY: as in `protocol`. The port occupies the low 16 bits of the 4-byte field.
    (unsafe { read_volatile(addr_of!((*ctx.sock_addr).user_port)) }) as u16
}

/// Sets `user_port` (network byte order).
#[inline(always)]
pub fn set_user_port_be(ctx: &SockAddrContext, port_be: u16) {
    // SAFETY: as in `protocol`; the field is writable in every sock_addr hook we attach.
    unsafe { write_volatile(addr_of_mut!((*ctx.sock_addr).user_port), u32::from(port_be)) };
}

/// The address the application named or is shown, in the shared representation.
#[inline(always)]
pub fn user_addr(ctx: &SockAddrContext, family: Family) -> NetAddr {
    let sock_addr = ctx.sock_addr;
    // SAFETY: as in `protocol`; each read is one 4-byte field or array element.
    unsafe {
        match family {
            Family::Ipv4 => NetAddr::from_ipv4_be(read_volatile(addr_of!((*sock_addr).user_ip4))),
            Family::Ipv6 => NetAddr {
                words_be: [
                    read_volatile(addr_of!((*sock_addr).user_ip6[0])),
                    read_volatile(addr_of!((*sock_addr).user_ip6[1])),
                    read_volatile(addr_of!((*sock_addr).user_ip6[2])),
                    read_volatile(addr_of!((*sock_addr).user_ip6[3])),
                ],
            },
        }
    }
}

/// Sets the address. On an IPv4 hook only an IPv4 address can be written; the caller guarantees
/// that (a listener's targets share its family), and an IPv6 one is ignored rather than
/// truncated. On an IPv6 hook an IPv4 address is written IPv4-mapped, which is what a dual-stack
/// socket expects.
#[inline(always)]
pub fn set_user_addr(ctx: &SockAddrContext, family: Family, addr: &NetAddr) {
    let sock_addr = ctx.sock_addr;
    // SAFETY: as in `protocol`; each write is one 4-byte field or array element.
    unsafe {
        match family {
            Family::Ipv4 => {
                if addr.is_ipv4() {
                    write_volatile(addr_of_mut!((*sock_addr).user_ip4), addr.ipv4_be());
                }
            }
            Family::Ipv6 => {
                write_volatile(addr_of_mut!((*sock_addr).user_ip6[0]), addr.words_be[0]);
                write_volatile(addr_of_mut!((*sock_addr).user_ip6[1]), addr.words_be[1]);
                write_volatile(addr_of_mut!((*sock_addr).user_ip6[2]), addr.words_be[2]);
                write_volatile(addr_of_mut!((*sock_addr).user_ip6[3]), addr.words_be[3]);
            }
        }
    }
}

/// `TCP_ESTABLISHED`: also the state of a connected UDP socket.
const TCP_ESTABLISHED: u32 = 1;

/// True when the socket is connected. A dual-stack socket connected to an IPv4-mapped address
/// passes `sendmsg4` on every send with its connected address filled in; rewriting that datagram
/// would send it somewhere the connected socket never accepts replies from.
#[inline(always)]
pub fn is_connected(ctx: &SockAddrContext) -> bool {
    // SAFETY: `sk` is always set in sock_addr programs (a full socket, readable as `bpf_sock`).
    let state = unsafe {
        let sock = (*ctx.sock_addr).__bindgen_anon_1.sk;
        read_volatile(addr_of!((*sock).state))
    };
    state == TCP_ESTABLISHED
}

/// Whether a connected socket's `sendmsg` goes to its peer (the address the hook sees is the one
/// it connected to), by address: a dual-stack socket connected to an IPv4-mapped address passes
/// `sendmsg4` on every send with its peer filled in, and its IPv4 peer is `dst_ip4`. False for a
/// send with an address of its own (`sendto` on a connected socket).
#[inline(always)]
pub fn sends_to_peer(ctx: &SockAddrContext, family: Family) -> bool {
    let sock_addr = ctx.sock_addr;
    // SAFETY: `sk` is always set in sock_addr programs (a full socket, readable as `bpf_sock`);
    // each read is one 4-byte field or array element.
    unsafe {
        let sock = (*sock_addr).__bindgen_anon_1.sk;
        match family {
            Family::Ipv4 => {
                read_volatile(addr_of!((*sock).dst_ip4))
                    == read_volatile(addr_of!((*sock_addr).user_ip4))
            }
            Family::Ipv6 => {
                user_addr(ctx, family).words_be
                    == [
                        read_volatile(addr_of!((*sock).dst_ip6[0])),
                        read_volatile(addr_of!((*sock).dst_ip6[1])),
                        read_volatile(addr_of!((*sock).dst_ip6[2])),
                        read_volatile(addr_of!((*sock).dst_ip6[3])),
                    ]
            }
        }
    }
}

/// A copy of a map value other CPUs or the agent may be writing: a volatile read, never a
/// reference into shared memory.
///
/// # Safety
///
/// `value` must point to a live map value of type `T`.
#[inline(always)]
pub unsafe fn snapshot<T: Copy>(value: *const T) -> T {
    // SAFETY: guaranteed by the caller.
    unsafe { read_volatile(value) }
}

/// The socket's cookie: unique for the socket's lifetime, never reused.
#[inline(always)]
pub fn socket_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: `bpf_get_socket_cookie` takes the program context in sock_addr programs (4.20+).
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}
