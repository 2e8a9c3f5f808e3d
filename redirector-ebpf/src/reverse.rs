//! recvmsg and getpeername: show the application the listener it addressed, not the target its
//! socket was steered to (resolvers drop replies from an address they did not ask).

use aya_ebpf::programs::SockAddrContext;
use redirector_common::{
    DNS_PORT,
    addr::port_be,
    counters::{PROTOCOL_UDP, counter_index},
    reverse::{ReverseKey, reply_port_bit},
};

use crate::{
    activity,
    context::{self, Family},
    maps::{LISTENERS, REPLY_PORTS, REVERSE_NAT, STEERED_SOCKS},
    steer::count,
};

/// Which syscall the program sees.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum PeerHook {
    /// `recvmsg(2)` and friends: a datagram's source, read by its socket (perhaps a cache's).
    Recvmsg,
    /// `getpeername(2)`: a connected socket's peer.
    Getpeername,
}

/// What the reply hook did.
pub enum Outcome {
    /// The socket was never steered: nothing to do (the common case).
    NotSteered,
    /// The peer was rewritten to the listener address.
    Translated,
    /// A steered socket heard from a peer with no recorded translation.
    Missed,
}

/// Rewrites the peer address of a reply (recvmsg) or of a connected socket (getpeername) back to
/// the listener when this socket was steered to that peer: from the socket's own storage when the
/// peer is the target it holds (always, for a socket that talks to one target), else from the
/// LRU map.
#[inline(always)]
pub fn try_translate_peer(ctx: &SockAddrContext, family: Family, hook: PeerHook) -> Outcome {
    if hook == PeerHook::Recvmsg {
        activity::note_cache_read(ctx);
    }
    let peer_port_be = context::user_port_be(ctx);
    if !is_reply_port(peer_port_be) {
        return Outcome::NotSteered;
    }
    // SAFETY: the storage belongs to the context's socket, which this program holds.
    let steered = unsafe { STEERED_SOCKS.get_ptr_mut(ctx) };
    if steered.is_null() {
        return Outcome::NotSteered;
    }
    // SAFETY: non-null storage of this socket. A send of another thread may rewrite it meanwhile;
    // a copy torn between two translations matches neither peer and falls to the map.
    let steered = unsafe { context::snapshot(steered) };
    let protocol = context::protocol(ctx).unwrap_or(PROTOCOL_UDP);
    let peer = context::user_addr(ctx, family);
    let (listener, listener_id) = if steered.peer == peer && steered.peer_port_be == peer_port_be {
        (steered.listener, steered.listener_id)
    } else {
        let key = ReverseKey::new(context::socket_cookie(ctx), peer, peer_port_be);
        let Some(translation) = REVERSE_NAT.get_ptr(key) else {
            // A reply straight from a listener (the socket is back on a cache that listens on
            // the listener address) needs no translation and is no miss.
            if peer_port_be == port_be(DNS_PORT) && LISTENERS.get_ptr(peer).is_some() {
                return Outcome::NotSteered;
            }
            count(counter_index(steered.listener_id, protocol), |c| {
                c.reverse_missed += 1;
            });
            return Outcome::Missed;
        };
        // SAFETY: a live LRU element. LRU elements are preallocated and may be recycled at once
        // when evicted; the entry just hit was used last of all, so it is the last candidate for
        // eviction, and a torn copy could at worst show another listener's address (the resolver
        // then retries).
        let translation = unsafe { context::snapshot(translation) };
        (translation.listener, translation.listener_id)
    };
    context::set_user_addr(ctx, family, &listener);
    context::set_user_port_be(ctx, port_be(DNS_PORT));
    count(counter_index(listener_id, protocol), |c| {
        c.reverse_translated += 1;
    });
    Outcome::Translated
}

/// Whether some target the agent installed uses this port (network byte order): replies from
/// any other port were never steered.
#[inline(always)]
fn is_reply_port(port_be: u16) -> bool {
    let (word, bit) = reply_port_bit(port_be);
    REPLY_PORTS.get(word).is_some_and(|ports| *ports & bit != 0)
}
