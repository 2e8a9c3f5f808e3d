//! The upstreams: one hickory-resolver per zone (and one for `default_servers`), each with its
//! own answer cache, configured to forward the way a node cache does.

use std::net::SocketAddr;

use hickory_proto::{rr::Name, xfer::Protocol};
use hickory_resolver::{
    Resolver, TokioResolver,
    config::{
        NameServerConfig, NameServerConfigGroup, ResolveHosts, ResolverConfig, ResolverOpts,
        ServerOrderingStrategy,
    },
    name_server::TokioConnectionProvider,
};

use crate::config::{CacheConfig, Zone, longest_zone};

/// The resolvers, and which names go to which.
#[derive(Debug)]
pub(crate) struct Upstreams {
    /// The zones of the configuration.
    zones: Vec<Zone>,
    /// Their resolvers, in the same order.
    resolvers: Vec<TokioResolver>,
    /// For names outside every zone; `None`: such names are REFUSED.
    default: Option<TokioResolver>,
}

impl Upstreams {
    /// A resolver for each zone of `config` and one for its default servers, if any.
    pub(crate) fn new(config: &CacheConfig) -> Self {
        Self {
            zones: config.zones.clone(),
            resolvers: config
                .zones
                .iter()
                .map(|zone| resolver(&zone.servers, config))
                .collect(),
            default: (!config.default_servers.is_empty())
                .then(|| resolver(&config.default_servers, config)),
        }
    }

    /// The resolver of the longest zone containing `name`, else the default one (as
    /// [`CacheConfig::upstreams_for`] chooses servers).
    pub(crate) fn route(&self, name: &Name) -> Option<&TokioResolver> {
        match longest_zone(&self.zones, name) {
            Some((index, _)) => self.resolvers.get(index),
            None => self.default.as_ref(),
        }
    }
}

/// A resolver asking `servers` in the order given, each once per transport: over UDP, and over
/// TCP when the UDP reply is truncated.
fn resolver(servers: &[SocketAddr], config: &CacheConfig) -> TokioResolver {
    let mut group = NameServerConfigGroup::with_capacity(servers.len() * 2);
    for protocol in [Protocol::Udp, Protocol::Tcp] {
        group.extend(
            servers
                .iter()
                .map(|&server| NameServerConfig::new(server, protocol)),
        );
    }
    let mut options = ResolverOpts::default();
    options.timeout = config.upstream_timeout;
    // One try per server: the next server is the retry.
    options.attempts = 0;
    options.num_concurrent_reqs = 1;
    options.server_ordering_strategy = ServerOrderingStrategy::UserProvidedOrder;
    // Without EDNS the resolver reads 512 bytes of a UDP reply; with it, 1232.
    options.edns0 = true;
    options.cache_size = config.max_entries;
    options.positive_max_ttl = Some(config.max_ttl);
    options.negative_max_ttl = Some(config.max_negative_ttl);
    // A forwarder: every name goes upstream as asked (fully qualified), no hosts file.
    options.ndots = 0;
    options.use_hosts_file = ResolveHosts::Never;
    options.preserve_intermediates = true;
    Resolver::builder_with_config(
        ResolverConfig::from_parts(None, Vec::new(), group),
        TokioConnectionProvider::default(),
    )
    .with_options(options)
    .build()
}
