//! Which bound sockets are a listener's cache: the key the `post_bind` and `sock_release`
//! programs look up for every socket bound to an address, and the agent fills.

use crate::{addr::NetAddr, listener::MAX_LISTENERS};

/// Entries of `CACHE_BINDS`: per listener an exact and up to two wildcard keys, for UDP and TCP.
pub const MAX_CACHE_BINDS: usize = MAX_LISTENERS * 6;

/// Key of `CACHE_BINDS`: a socket bound to this address and port with this protocol.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct BindKey {
    /// The bound address (IPv4 stored mapped; the unspecified address for a wildcard bind).
    pub addr: NetAddr,
    /// The bound port, network byte order.
    pub port_be: u16,
    /// `PROTOCOL_UDP` or `PROTOCOL_TCP`.
    pub protocol: u8,
    /// Zero.
    pub _padding: u8,
}
const _: () = assert!(size_of::<BindKey>() == 20);

impl BindKey {
    /// The key for a socket bound to `addr:port` (network order) with `protocol`.
    #[inline(always)]
    #[must_use]
    pub const fn new(addr: NetAddr, port_be: u16, protocol: u32) -> Self {
        Self {
            addr,
            port_be,
            protocol: protocol as u8,
            _padding: 0,
        }
    }
}

/// Value of `CACHE_BINDS`: the listeners whose cache such a socket is (bit `id`, see
/// `datapath::listener_bit`).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct BindListeners {
    /// Listener bitmask.
    pub listeners: u64,
}
const _: () = assert!(size_of::<BindListeners>() == 8);

/// Entries of `CACHE_SOCKETS`: live sockets of all caches together.
pub const MAX_CACHE_SOCKETS: usize = 16_384;

/// Value of `CACHE_SOCKETS`, keyed by socket cookie: a counted cache socket. Inserted by
/// `post_bind` (or by the agent for sockets that existed before it), removed by `sock_release`
/// (or by the agent for sockets gone unseen). Whoever removes the entry uncounts the socket, so
/// no socket is ever counted twice or uncounted twice.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CacheSocket {
    /// The listeners whose cache it is (see `datapath::listener_bit`).
    pub listeners: u64,
    /// `PROTOCOL_UDP` or `PROTOCOL_TCP`.
    pub protocol: u32,
    /// `MARKED` when the socket carries a `CACHE_MARKS` mark (`post_bind` set one), else
    /// `UNMARKED` (the agent counted it, or the kernel could not allocate the mark): while any
    /// entry is unmarked, `sock_release` looks up the cookie of every socket closing in the
    /// caches' network namespace.
    pub marked: u32,
}
const _: () = assert!(size_of::<CacheSocket>() == 16);

/// `CacheSocket::marked`: the socket carries a `CACHE_MARKS` mark.
pub const MARKED: u32 = 1;
/// `CacheSocket::marked`: the socket carries no mark.
pub const UNMARKED: u32 = 0;

impl CacheSocket {
    /// Whether the entry counts the same socket for the same listeners as `other` (whoever
    /// marked it).
    #[inline(always)]
    #[must_use]
    pub const fn counts_like(&self, other: &Self) -> bool {
        self.listeners == other.listeners && self.protocol == other.protocol
    }
}

/// Value of `CACHE_MARKS`, the socket-local storage that marks a socket `post_bind` counted, so
/// that `sock_release` tells a cache socket from the node's other sockets with one storage lookup
/// (no cookie fetched, no hash looked up for every close).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CacheMark {
    /// `MARKED`.
    pub marked: u32,
}
const _: () = assert!(size_of::<CacheMark>() == 4);

/// Value of `CACHE_READERS`, the socket-local storage of a socket bound to a cache port: the
/// listeners it is a cache of (none: it is not a cache socket), as `CACHE_SOCKETS` held them in
/// generation `generation` (`DatapathConfig::readers_generation`). `recvmsg` creates it at the
/// socket's first read and reads `CACHE_SOCKETS` again only when the generation moved on.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CacheReader {
    /// The listeners whose cache the socket is (see `datapath::listener_bit`); zero for none.
    pub listeners: u64,
    /// The `DatapathConfig::readers_generation` it was read in.
    pub generation: u32,
    /// Zero.
    pub _padding: u32,
}
const _: () = assert!(size_of::<CacheReader>() == 16);

/// Entries of `CACHE_TASKS`: processes that bound a cache socket. An LRU: the entries of caches
/// long gone age out (a process that exits is never told to the programs).
pub const MAX_CACHE_TASKS: usize = 1024;

/// Value of `CACHE_TASKS`, keyed by the tgid of a process that bound a cache socket (`post_bind`
/// records it): which listeners it serves, and its cgroup then, so that a reused pid in another
/// cgroup is not taken for the cache.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CacheTask {
    /// The listeners whose cache it bound (see `datapath::listener_bit`).
    pub listeners: u64,
    /// `bpf_get_current_cgroup_id` (cgroup v2) when it bound.
    pub cgroup_id: u64,
}
const _: () = assert!(size_of::<CacheTask>() == 16);

/// Whether signal `number` ends a process that does not handle it, as a cache is stopped:
/// `SIGINT`, `SIGQUIT`, `SIGKILL` (also the OOM killer's, and a `SIGTERM` with the default action,
/// which the kernel turns into a group exit) and `SIGTERM`. The same on every Linux architecture
/// redirector builds for.
#[inline(always)]
#[must_use]
pub const fn is_terminating(number: u64) -> bool {
    matches!(number, 2 | 3 | 9 | 15)
}

/// `0.0.0.0` in the shared representation (IPv4-mapped).
pub const IPV4_UNSPECIFIED: NetAddr = NetAddr::from_ipv4_be(0);
/// `::`.
pub const IPV6_UNSPECIFIED: NetAddr = NetAddr { words_be: [0; 4] };

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_of_the_two_families_differ() {
        assert_ne!(IPV4_UNSPECIFIED, IPV6_UNSPECIFIED);
        assert!(IPV4_UNSPECIFIED.is_ipv4());
        assert!(!IPV6_UNSPECIFIED.is_ipv4());
    }

    #[test]
    fn only_the_signals_that_stop_a_cache_are_terminating() {
        for number in [2, 3, 9, 15] {
            assert!(is_terminating(number), "{number}");
        }
        // SIGHUP (a reload), SIGUSR1/2, SIGSTOP, SIGCONT, SIGURG (Go's preemption), SIGCHLD.
        for number in [0, 1, 10, 12, 17, 18, 19, 23] {
            assert!(!is_terminating(number), "{number}");
        }
    }

    #[test]
    fn key_carries_protocol_and_zero_padding() {
        let key = BindKey::new(
            IPV4_UNSPECIFIED,
            53u16.to_be(),
            crate::protocol::PROTOCOL_TCP,
        );
        assert_eq!(key.protocol, 1);
        assert_eq!(key._padding, 0);
    }
}
