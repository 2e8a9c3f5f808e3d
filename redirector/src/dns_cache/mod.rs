//! An embedded caching DNS forwarder: a small stand-in for CoreDNS or NodeLocal DNSCache on a
//! dev box or in a demo.
//!
//! It listens on UDP and TCP and answers the clients in `allow` (by default loopback, link-local
//! and private addresses; others get REFUSED, never larger than their query). It forwards each
//! question to the upstream servers of the longest matching zone (UDP first, TCP when the reply is
//! truncated, the servers in order, each with a timeout), caches answers for their TTL (negative
//! answers for their SOA minimum, RFC 2308), both capped, within `max_entries` and `max_bytes`
//! (answers over 4096 bytes are not cached), and answers from the cache with the TTLs counted
//! down. When every upstream fails, an answer that expired less than `stale_for` ago is served
//! stale with TTL 30 (RFC 8767); otherwise the client gets SERVFAIL. ANY queries get the RFC 8482
//! answer (`HINFO "RFC8482" ""`) and are not forwarded.
//!
//! Deliberately small: no DNSSEC (queries go upstream without the DO bit, answers are not
//! validated), no coalescing of identical concurrent queries, no prefetch.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use redirector::dns_cache::{CacheConfig, run};
//!
//! let config = CacheConfig::load(std::path::Path::new("/etc/redirector/cache.toml"))?;
//! run(config, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```

mod cache;
mod config;
mod forward;
mod framing;
mod resolver;
mod server;
#[cfg(test)]
mod tests;

use std::{future::Future, net::SocketAddr};

pub use config::{
    CacheConfig, CacheConfigError, Cidr, CidrError, DEFAULT_ALLOW, DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES, DEFAULT_MAX_NEGATIVE_TTL, DEFAULT_MAX_TTL, DEFAULT_STALE_FOR,
    DEFAULT_UPSTREAM_TIMEOUT, MAX_CACHED_MESSAGE_BYTES, Zone,
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
