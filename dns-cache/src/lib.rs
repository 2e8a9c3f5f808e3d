//! The embedded caching DNS forwarder behind `redirector cache`: a small stand-in for CoreDNS or
//! NodeLocal DNSCache on a dev box, in the demo and in the tests. No deployment runs it, so the
//! agent's production build does not contain it (the `redirector` crate's `embedded-cache`
//! feature brings it in).
//!
//! hickory-dns does the DNS work: hickory-server's request and response types and its UDP server,
//! hickory-resolver's forwarding (each zone's servers in order, one timeout per server, a
//! truncated UDP reply asked again over TCP, replies matched to their query) and its answer cache
//! (TTLs counted down, positive and negative lifetimes capped). What is ours is a thin
//! `RequestHandler` (hickory-server) around them (`handler.rs`):
//! - clients outside `allow` get REFUSED, never larger than their query, and nothing is
//!   forwarded for them; a `0.0.0.0` or `::` listener needs an explicit `allow` (`config.rs`);
//! - ANY gets the RFC 8482 answer (`HINFO "RFC8482" ""`), never forwarded;
//! - when every upstream fails, an answer that expired less than `stale_for` ago is served stale
//!   with TTL 30 (RFC 8767, `stale.rs`); else SERVFAIL. An upstream's SERVFAIL or REFUSED is a
//!   failure too, never passed off as an empty answer;
//! - a UDP client without EDNS gets at most 512 bytes (TC beyond), one with EDNS at most what it
//!   announced;
//! - bounds: queries in flight, and TCP connections (each closed after an idle spell) (`server.rs`).
//!
//! Deliberately small: no DNSSEC, no coalescing of identical concurrent queries, no prefetch.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use dns_cache::{CacheConfig, run};
//!
//! let config = CacheConfig::load(std::path::Path::new("/etc/redirector/cache.toml"))?;
//! run(config, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```

pub mod config;
mod handler;
mod server;
mod stale;
#[cfg(test)]
mod tests;
mod upstream;

use std::{future::Future, net::SocketAddr};

pub use config::{
    CacheConfig, CacheConfigError, DEFAULT_ALLOW, DEFAULT_MAX_ENTRIES, DEFAULT_MAX_NEGATIVE_TTL,
    DEFAULT_MAX_TTL, DEFAULT_STALE_FOR, DEFAULT_UPSTREAM_TIMEOUT, NetworkError, Zone,
};
pub use server::CacheServer;

/// Why the cache could not serve.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A listen address could not be bound (in use, not a local address, port below 1024
    /// without `CAP_NET_BIND_SERVICE`, ...).
    #[error("cannot listen on {address} ({protocol})")]
    Bind {
        /// The address from `listen`.
        address: SocketAddr,
        /// "UDP" or "TCP".
        protocol: &'static str,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// Binds every `listen` address (UDP and TCP) and answers DNS until `shutdown` completes; then
/// stops, drops the queries in flight and closes every socket before returning.
///
/// # Errors
///
/// [`CacheError::Bind`] when a listen address cannot be bound; nothing is left open then.
/// Once serving, failures (an upstream down, a client gone) are logged, never returned.
pub async fn run(
    config: CacheConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), CacheError> {
    CacheServer::bind(config).await?.serve(shutdown).await;
    Ok(())
}
