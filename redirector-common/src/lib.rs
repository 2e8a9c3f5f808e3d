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

pub mod addr;
pub mod binds;
pub mod counters;
pub mod datapath;
pub mod listener;
pub mod names;
pub mod pool;
pub mod reverse;
pub mod stale;

#[cfg(feature = "user")]
mod pod;
#[cfg(feature = "user")]
pub mod settings;

/// The only destination port redirector ever steers: DNS.
pub const DNS_PORT: u16 = 53;

/// Version of the map layout defined in this crate. Bump it whenever a key or value changes
/// shape or meaning; the agent refuses to adopt pinned maps of another version.
pub const LAYOUT_VERSION: u32 = 5;
