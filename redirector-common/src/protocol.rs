//! The two transport protocols redirector steers, numbered as every per-protocol table numbers
//! them (a listener's counter rows, a target's ports, a cache bind's key), and the number of a
//! socket's IP protocol.

/// UDP's number (and counter row).
pub const PROTOCOL_UDP: u32 = 0;
/// TCP's number (and counter row).
pub const PROTOCOL_TCP: u32 = 1;
/// How many there are: rows per listener.
pub const PROTOCOLS: u32 = 2;

/// `IPPROTO_UDP`.
pub const IPPROTO_UDP: u32 = 17;
/// `IPPROTO_TCP`.
pub const IPPROTO_TCP: u32 = 6;

/// The number (`PROTOCOL_*`) of a socket's IP protocol; `None` for anything but UDP and TCP
/// (ping and raw sockets pass through the same hooks).
#[inline(always)]
#[must_use]
pub const fn protocol_row(ip_protocol: u32) -> Option<u32> {
    match ip_protocol {
        IPPROTO_UDP => Some(PROTOCOL_UDP),
        IPPROTO_TCP => Some(PROTOCOL_TCP),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_udp_and_tcp_have_rows() {
        assert_eq!(protocol_row(17), Some(PROTOCOL_UDP));
        assert_eq!(protocol_row(6), Some(PROTOCOL_TCP));
        assert_eq!(protocol_row(1), None);
        assert_eq!(protocol_row(58), None);
    }
}
