//! Everything that crosses the boundary between redirector's kernel programs and its agent.
//!
//! Rules for this crate (both sides compile it, the kernel side for `bpfel-unknown-none`):
//! - every map key and value is `#[repr(C)]` with explicit padding fields and a size assertion,
//!   so both compilers agree on the layout byte for byte;
//! - no Rust enums or `Option` in map values: states are `u32` constants named here;
//! - the byte order of every field is in its name (`_be`: network byte order, as the kernel's
//!   `bpf_sock_addr` holds it); conversion happens once, at the edge, with the helpers here;
//! - logic both sides need (backend selection, the routing truth table) lives here, so it is unit
//!   tested on the host.
#![no_std]

pub mod activity;
pub mod addr;
pub mod binds;
pub mod counters;
pub mod datapath;
pub mod listener;
pub mod names;
pub mod pool;
pub mod protocol;
pub mod reverse;
pub mod stale;
pub mod workloads;

#[cfg(feature = "user")]
mod pod;
#[cfg(feature = "user")]
pub mod settings;

/// The only destination port redirector ever steers: DNS.
pub const DNS_PORT: u16 = 53;

/// A DNS server's address as configuration files write it: `ip:port`, `[ipv6]:port`, or an
/// address alone for port [`DNS_PORT`]. The error is the one for `ip:port`, the form that says
/// the most.
///
/// # Errors
///
/// [`core::net::AddrParseError`] when `text` is neither form.
pub fn parse_dns_server(text: &str) -> Result<core::net::SocketAddr, core::net::AddrParseError> {
    text.parse::<core::net::SocketAddr>().or_else(|with_port| {
        text.parse::<core::net::IpAddr>()
            .map(|ip| core::net::SocketAddr::new(ip, DNS_PORT))
            .map_err(|_| with_port)
    })
}

/// Version of the map layout, recorded in `DATAPATH_CONFIG` by the agent that wrote the pins. It
/// is not bumped any more: from layout 5 on, the layout rule (ARCHITECTURE.md; the released
/// shapes in the agent's `datapath::layout`) keeps every release's pins adoptable by its
/// neighbours, older or newer, so a change of a key or value is a new map under a new name.
/// Pins of a layout before 5 are refused.
pub const LAYOUT_VERSION: u32 = 5;

#[cfg(test)]
mod tests {
    use core::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

    use super::*;

    #[test]
    fn a_dns_server_is_an_address_with_or_without_its_port() {
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 10));
        assert_eq!(
            parse_dns_server("10.0.0.10"),
            Ok(SocketAddr::new(v4, DNS_PORT))
        );
        assert_eq!(
            parse_dns_server("10.0.0.10:5353"),
            Ok(SocketAddr::new(v4, 5353))
        );
        let v6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10));
        assert_eq!(
            parse_dns_server("fd00::10"),
            Ok(SocketAddr::new(v6, DNS_PORT))
        );
        assert_eq!(
            parse_dns_server("[fd00::10]:53"),
            Ok(SocketAddr::new(v6, 53))
        );
        for text in [
            "",
            "example.com",
            "10.0.0.10:",
            "fd00::10:53:x",
            "[fd00::10]",
        ] {
            assert!(parse_dns_server(text).is_err(), "{text:?}");
        }
    }
}
