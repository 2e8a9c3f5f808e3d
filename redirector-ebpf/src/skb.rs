//! The socket of a `cgroup_skb` program's packet, and its socket-local storage.
//!
//! Kernel features: `__sk_buff.sk` and `bpf_sk_fullsock` 5.1; `bpf_sk_storage_get` in
//! `cgroup_skb` programs 5.2.

use core::ptr::{self, addr_of, read_volatile};

use aya_ebpf::{
    bindings::bpf_sock,
    btf_maps::SkStorage,
    helpers::{bpf_sk_fullsock, bpf_sk_storage_get},
    programs::SkBuffContext,
};

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
