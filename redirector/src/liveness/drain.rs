//! Drains: a cache's listeners moved upstream for planned work on the cache, before it is stopped.
//!
//! A drain covers a cache, not one of its listeners: a cache process is what stops, and a
//! listener left on it loses what it sends there. NodeLocal DNSCache's cache answers on its
//! link-local address and on the kube-dns ClusterIP (two listeners, one `cache` address); AKS
//! LocalDNS's CoreDNS on the node's and the cluster's address (two listeners, each its own
//! `cache` address, one process bound on both). So listeners are one cache's when their `cache`
//! is the same address, or when one process holds cache sockets of both (found in `/proc`, as
//! `cache_tasks` finds them), and a listener named brings every listener of its cache
//! ([`group`], [`Selection`]). Where the processes cannot be read (no cache runs, no `/proc`
//! of the caches' processes), listeners are grouped by address only, and the drain says so.
//!
//! A drain begins a new `down_epoch` for each of those listeners, recorded as a drain in
//! `CACHE_ACTIVITY`: the programs route upstream from the next syscall, and the agent's probes do
//! not confirm that epoch however well the cache answers. It ends when the cache's next life
//! begins a new epoch (its last socket closes, or it is signalled to stop) and the probes confirm
//! that life, or when an operator ends it. A socket that connected to the cache the moment before
//! the drain may still send there for the drain's grace (`stale::DRAIN_GRACE_NS`). Waiting for a
//! drain means waiting out that grace and until the cache has read every query it was handed and
//! its receive queues are empty, then for the answers it is still working on.

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use redirector_common::{
    activity::unread_since,
    counters::PROTOCOL_UDP,
    datapath::listener_bit,
    listener::{EMPTY_POOL_FAIL, ListenerConfig, Reason, Route},
    stale::DRAIN_GRACE_NS,
};

use super::{
    cache_tasks::{self, Holder},
    health::monotonic_ns,
    sockdiag::{SockDiagError, SocketTable},
};
use crate::datapath::{DatapathError, Maps};

/// Which caches a drain moves, as asked (`redirector drain`'s `--listener` and `--all`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// Listeners named: each brings its cache, and so every listener that cache serves (see
    /// [`group`]).
    pub listeners: Vec<String>,
    /// Every cache.
    pub all: bool,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.all {
            f.write_str("every listener")
        } else if self.listeners.is_empty() {
            f.write_str("the one cache")
        } else {
            write!(f, "the cache of {}", listeners_text(&self.listeners))
        }
    }
}

/// A listener as a drain sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its id in the per-listener maps.
    pub id: u32,
    /// Its name.
    pub name: String,
    /// Its cache's address.
    pub cache: SocketAddr,
}

/// One cache a drain moves, and every listener it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheDrain {
    /// The cache's addresses (its listeners' `cache`), in the order of their first listener.
    pub addresses: Vec<SocketAddr>,
    /// Its listeners, in id order.
    pub listeners: Vec<Member>,
    /// The processes seen holding its sockets (none when they were not looked for).
    pub processes: Vec<u32>,
}

impl CacheDrain {
    /// Its listeners' bits (`listener_bit`).
    fn mask(&self) -> u64 {
        self.listeners
            .iter()
            .fold(0, |mask, member| mask | listener_bit(member.id))
    }
}

/// Why a [`Selection`] names no cache.
#[derive(Debug, thiserror::Error)]
pub enum SelectionError {
    /// A listener named is not there.
    #[error(
        "there is no listener {name:?} (the listeners are: {known}); name one of those, and \
         every listener its cache serves is drained with it"
    )]
    UnknownListener {
        /// The name asked for.
        name: String,
        /// The names there are, comma-separated.
        known: String,
    },
    /// Nothing was named, and the listeners have more than one cache.
    #[error(
        "the listeners have {count} caches ({caches}): name the one to drain with --listener \
         NAME (every listener it serves is drained with it), or drain them all with --all"
    )]
    SeveralCaches {
        /// How many.
        count: usize,
        /// Each cache and its listeners.
        caches: String,
    },
    /// There are no listeners.
    #[error("there are no listeners to drain (has the agent started on this node?)")]
    NoListeners,
}

/// The caches of `listeners`, each with every listener it serves, in the order of their first
/// listener. A cache is what stops: two listeners are one cache's when their `cache` is the same
/// address (NodeLocal DNSCache: the link-local address and the kube-dns ClusterIP), or when one
/// process holds cache sockets of both (`holders`: AKS LocalDNS's CoreDNS, bound on the node's
/// and the cluster's cache address), and so on transitively.
#[must_use]
pub fn group(listeners: &[Member], holders: &[Holder]) -> Vec<CacheDrain> {
    let mut sorted = listeners.to_vec();
    sorted.sort_by_key(|member| member.id);
    let mut caches: Vec<CacheDrain> = Vec::new();
    for member in sorted {
        let address = canonical(member.cache);
        let bit = listener_bit(member.id);
        let shares_a_process = |mask: u64| {
            holders
                .iter()
                .any(|holder| holder.listeners & bit != 0 && holder.listeners & mask != 0)
        };
        // Every cache this listener joins becomes one, at the place of the first.
        let joined: Vec<usize> = caches
            .iter()
            .enumerate()
            .filter(|(_, cache)| {
                cache.addresses.contains(&address) || shares_a_process(cache.mask())
            })
            .map(|(at, _)| at)
            .collect();
        let Some((&first, others)) = joined.split_first() else {
            caches.push(CacheDrain {
                addresses: vec![address],
                listeners: vec![member],
                processes: Vec::new(),
            });
            continue;
        };
        for &at in others.iter().rev() {
            let other = caches.remove(at);
            let cache = &mut caches[first];
            cache.listeners.extend(other.listeners);
            for address in other.addresses {
                if !cache.addresses.contains(&address) {
                    cache.addresses.push(address);
                }
            }
        }
        let cache = &mut caches[first];
        cache.listeners.push(member);
        cache.listeners.sort_by_key(|member| member.id);
        if !cache.addresses.contains(&address) {
            cache.addresses.push(address);
        }
    }
    for cache in &mut caches {
        let mask = cache.mask();
        let mut processes: Vec<u32> = holders
            .iter()
            .filter(|holder| holder.listeners & mask != 0)
            .map(|holder| holder.tgid)
            .collect();
        processes.sort_unstable();
        processes.dedup();
        cache.processes = processes;
    }
    caches
}

impl Selection {
    /// The caches this selection names among `listeners`, grouped as [`group`] does with
    /// `holders`, each with every listener it serves.
    ///
    /// # Errors
    ///
    /// [`SelectionError`] for a name that is not there, or no name where the listeners have
    /// several caches.
    pub fn resolve(
        &self,
        listeners: &[Member],
        holders: &[Holder],
    ) -> Result<Vec<CacheDrain>, SelectionError> {
        let mut caches = group(listeners, holders);
        if caches.is_empty() {
            return Err(SelectionError::NoListeners);
        }
        if self.all {
            return Ok(caches);
        }
        if self.listeners.is_empty() {
            if caches.len() == 1 {
                return Ok(caches);
            }
            return Err(SelectionError::SeveralCaches {
                count: caches.len(),
                caches: caches
                    .iter()
                    .map(CacheDrain::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        let mut wanted = 0;
        for name in &self.listeners {
            let member = listeners
                .iter()
                .find(|member| &member.name == name)
                .ok_or_else(|| SelectionError::UnknownListener {
                    name: name.clone(),
                    known: listeners
                        .iter()
                        .map(|member| member.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            wanted |= listener_bit(member.id);
        }
        caches.retain(|cache| cache.mask() & wanted != 0);
        Ok(caches)
    }
}

impl fmt::Display for CacheDrain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addresses: Vec<String> = self.addresses.iter().map(ToString::to_string).collect();
        write!(f, "cache {}", addresses.join(", "))?;
        match self.processes.as_slice() {
            [] => {}
            [process] => write!(f, " (process {process})")?,
            processes => {
                let pids: Vec<String> = processes.iter().map(ToString::to_string).collect();
                write!(f, " (processes {})", pids.join(", "))?;
            }
        }
        let names: Vec<&str> = self
            .listeners
            .iter()
            .map(|member| member.name.as_str())
            .collect();
        write!(f, ": {}", listeners_text(&names))
    }
}

/// `listener a` or `listeners a, b`.
fn listeners_text(names: &[impl AsRef<str>]) -> String {
    let joined = names
        .iter()
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() == 1 {
        format!("listener {joined}")
    } else {
        format!("listeners {joined}")
    }
}

/// One form per address: `[::ffff:a.b.c.d]:53` is the cache `a.b.c.d:53`.
fn canonical(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(address.ip().to_canonical(), address.port())
}

/// A drain asked of the agent over its drain socket (one JSON line), or done by the CLI itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "WireRequest", into = "WireRequest")]
pub struct DrainRequest {
    /// The caches to drain.
    pub selection: Selection,
    /// End a drain instead of beginning one.
    pub cancel: bool,
    /// Wait until the cache has read what it was handed ([`wait_quiet`]).
    pub wait: bool,
    /// How long to wait, in ms.
    pub timeout_ms: u64,
    /// How long to give the last answers once nothing is unread, in ms.
    pub settle_ms: u64,
}

/// A [`DrainRequest`] on the drain socket. Releases before whole-cache drains send and read one
/// name as `listener` (and ignore fields they do not know): the first name goes there too, so
/// that such an agent drains at least that listener, and a request from such a CLI drains the
/// whole cache of the listener it names.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct WireRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    listener: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    listeners: Vec<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    all: bool,
    #[serde(default)]
    cancel: bool,
    #[serde(default)]
    wait: bool,
    #[serde(default = "default_timeout_ms")]
    timeout_ms: u64,
    #[serde(default = "default_settle_ms")]
    settle_ms: u64,
}

impl From<WireRequest> for DrainRequest {
    fn from(wire: WireRequest) -> Self {
        let mut listeners: Vec<String> = Vec::new();
        for name in wire.listener.into_iter().chain(wire.listeners) {
            if !listeners.contains(&name) {
                listeners.push(name);
            }
        }
        Self {
            selection: Selection {
                listeners,
                all: wire.all,
            },
            cancel: wire.cancel,
            wait: wire.wait,
            timeout_ms: wire.timeout_ms,
            settle_ms: wire.settle_ms,
        }
    }
}

impl From<DrainRequest> for WireRequest {
    fn from(request: DrainRequest) -> Self {
        Self {
            listener: request.selection.listeners.first().cloned(),
            listeners: request.selection.listeners,
            all: request.selection.all,
            cancel: request.cancel,
            wait: request.wait,
            timeout_ms: request.timeout_ms,
            settle_ms: request.settle_ms,
        }
    }
}

/// The drain's grace (`stale::DRAIN_GRACE_NS`), which a wait outlasts.
const GRACE: Duration = Duration::from_nanos(DRAIN_GRACE_NS);

/// `DrainRequest::timeout_ms` unless given.
pub const DEFAULT_TIMEOUT_MS: u64 = 10_000;
/// `DrainRequest::settle_ms` unless given.
pub const DEFAULT_SETTLE_MS: u64 = 300;

const fn default_timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}

const fn default_settle_ms() -> u64 {
    DEFAULT_SETTLE_MS
}

/// The agent's answer on its drain socket (one JSON line).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainReply {
    /// Whether the request was done.
    pub ok: bool,
    /// What happened, or what failed and what to do, for people.
    pub message: String,
}

/// Every listener in the maps pinned as `maps`, with its configuration (the liveness its route
/// is decided by, its empty-pool policy).
fn members(maps: &Maps) -> Result<Vec<(Member, ListenerConfig)>, DrainError> {
    let mut found = Vec::new();
    for (id, info) in maps.listeners()? {
        let Some(name) = info.name() else {
            continue;
        };
        // The address entry is written last and removed first: no entry, no listener (yet).
        let Some(config) = maps.listener_config(IpAddr::from(info.addr))? else {
            continue;
        };
        found.push((
            Member {
                id,
                name: name.to_owned(),
                cache: SocketAddr::new(
                    IpAddr::from(config.cache.addr),
                    u16::from_be(config.cache.udp_port_be),
                ),
            },
            config,
        ));
    }
    Ok(found)
}

/// Does `request` against the maps pinned under `pin_dir`, reading the caches' sockets in the
/// network namespace at `cache_netns` (or the caller's); returns what happened, for people.
/// Listeners are grouped into caches by address and by the processes holding the caches'
/// sockets ([`group`]); when those cannot be read, by address only, which the reply says.
///
/// # Errors
///
/// [`DrainError`] for a selection that names no cache, maps or sockets that cannot be read, a
/// listener the drain cannot move, or a wait that ran out.
pub fn handle(
    pin_dir: &Path,
    cache_netns: Option<&Path>,
    request: &DrainRequest,
) -> Result<String, DrainError> {
    let maps = Maps::open_pinned(pin_dir)?;
    let found = members(&maps)?;
    let listeners: Vec<Member> = found.iter().map(|(member, _)| member.clone()).collect();
    let mut table = SocketTable::open(cache_netns);
    let (holders, by_address_only) = match &mut table {
        Ok(table) => cache_holders(&maps, table, cache_netns),
        Err(error) => (
            Vec::new(),
            Some(format!(
                "the caches' sockets could not be read ({})",
                crate::error_chain(error)
            )),
        ),
    };
    let caches = request.selection.resolve(&listeners, &holders)?;
    let mut lines: Vec<String> = Vec::new();
    if let Some(why) = by_address_only {
        lines.push(format!(
            "listeners grouped into caches by their cache address only: {why}; a cache process \
             that answers on several cache addresses is drained whole only when a listener of \
             each is named (or --all)"
        ));
    }
    if request.cancel {
        lines.extend(cancel(&maps, &caches)?);
        return Ok(lines.join("\n"));
    }
    let begun = begin_all(&maps, &caches)?;
    lines.extend(caches.iter().map(|drain| {
        let epochs: Vec<String> = drain
            .listeners
            .iter()
            .filter_map(|member| {
                begun
                    .iter()
                    .find(|(id, _)| *id == member.id)
                    .map(|(_, epoch)| epoch.to_string())
            })
            .collect();
        let (its, epoch) = if drain.listeners.len() == 1 {
            ("its", "epoch")
        } else {
            ("their", "epochs")
        };
        format!(
            "{drain}: drained ({epoch} {}); {its} DNS goes upstream from now until the \
             cache's next life is confirmed",
            epochs.join(", ")
        )
    }));
    lines.extend(without_upstreams(&maps, &found, &caches)?);
    let stuck = on_the_cache(&maps, &found, &caches)?;
    if !stuck.is_empty() {
        return Err(DrainError::NotMoved {
            drained: lines.join("\n"),
            listeners: stuck.join("; "),
        });
    }
    if !request.wait {
        return Ok(lines.join("\n"));
    }
    let ids: Vec<u32> = begun.iter().map(|(id, _)| *id).collect();
    let quiet = wait_quiet(
        &maps,
        &mut table?,
        &ids,
        Duration::from_millis(request.settle_ms),
        Duration::from_millis(request.timeout_ms),
    )?;
    let (subject, it, was) = if caches.len() == 1 {
        ("the cache", "it", "was")
    } else {
        ("the caches", "they", "were")
    };
    lines.push(format!(
        "{subject} read everything {it} {was} handed, seen after {} ms (the drain's {} ms grace \
         is waited out); {it} can be stopped",
        quiet.read_all_after.as_millis(),
        GRACE.as_millis()
    ));
    Ok(lines.join("\n"))
}

/// The processes in the caches' namespace holding the counted cache sockets that `table` shows
/// open; or none, and why, when they cannot be told.
fn cache_holders(
    maps: &Maps,
    table: &mut SocketTable,
    cache_netns: Option<&Path>,
) -> (Vec<Holder>, Option<String>) {
    let bound = match table.bound_sockets() {
        Ok(bound) => bound,
        Err(error) => {
            return (
                Vec::new(),
                Some(format!(
                    "the caches' sockets could not be read ({})",
                    crate::error_chain(&error)
                )),
            );
        }
    };
    let counted: HashMap<u64, u64> = maps
        .cache_sockets()
        .into_iter()
        .map(|(cookie, entry)| (cookie, entry.listeners))
        .collect();
    let sockets: HashMap<u64, u64> = bound
        .iter()
        .filter_map(|socket| Some((u64::from(socket.inode), *counted.get(&socket.cookie)?)))
        .collect();
    if sockets.is_empty() {
        return (
            Vec::new(),
            Some("no cache socket is open, so no cache process runs to group them by".to_owned()),
        );
    }
    let holders = cache_tasks::holders(&sockets, cache_netns);
    if holders.is_empty() {
        return (
            Vec::new(),
            Some(
                "no process was seen holding the caches' sockets (this drain runs where the \
                 caches' processes are not visible in /proc, or cannot read their descriptors)"
                    .to_owned(),
            ),
        );
    }
    (holders, None)
}

/// Ends the drains of `caches`' listeners; says which ended.
fn cancel(maps: &Maps, caches: &[CacheDrain]) -> Result<Vec<String>, DrainError> {
    let mut lines = Vec::new();
    for drain in caches {
        let mut ended = Vec::new();
        let mut standing = Vec::new();
        for member in &drain.listeners {
            if end(maps, member.id)? {
                ended.push(member.name.as_str());
            } else {
                standing.push(member.name.as_str());
            }
        }
        let cache = drain
            .addresses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        if !ended.is_empty() {
            lines.push(format!(
                "cache {cache}: drain ended for {}; DNS goes back to the cache once the agent's \
                 probes confirm it",
                listeners_text(&ended)
            ));
        }
        if !standing.is_empty() {
            lines.push(format!(
                "cache {cache}: no drain to end for {} (the cache's next life ended it, or none \
                 began)",
                listeners_text(&standing)
            ));
        }
    }
    Ok(lines)
}

/// Every listener of `caches` with its configuration in `found` (a listener removed meanwhile
/// is left out).
fn configured<'a>(
    found: &'a [(Member, ListenerConfig)],
    caches: &'a [CacheDrain],
) -> impl Iterator<Item = (&'a Member, &'a ListenerConfig)> {
    caches
        .iter()
        .flat_map(|drain| &drain.listeners)
        .filter_map(|member| {
            found
                .iter()
                .find(|(other, _)| other.id == member.id)
                .map(|(_, config)| (member, config))
        })
}

/// A line for each listener of `caches` with no upstream to take its DNS while the drain
/// stands: its empty-pool policy answers its queries until the cache's next life is confirmed,
/// as it would from the cache's stop without a drain. An operator should know before the stop.
fn without_upstreams(
    maps: &Maps,
    found: &[(Member, ListenerConfig)],
    caches: &[CacheDrain],
) -> Result<Vec<String>, DrainError> {
    let mut lines = Vec::new();
    for (member, config) in configured(found, caches) {
        if maps.pool(member.id)?.len != 0 {
            continue;
        }
        let what = if config.empty_pool_policy == EMPTY_POOL_FAIL {
            "fail at once (empty_pool = \"fail\")"
        } else {
            "go to its address untouched, where nothing may answer (empty_pool = \"pass\")"
        };
        lines.push(format!(
            "warning: listener {} has no upstreams: while the drain stands its queries {what}, \
             as they would once the cache stops; give it upstreams to keep its DNS through the \
             cache's restart",
            member.name
        ));
    }
    Ok(lines)
}

/// The listeners of `caches` that still route to their cache after the drain began, with why
/// and what to do: a drain moves a listener by its epoch, which an operator's override to the
/// cache outranks, and which a listener judged by probes alone does not route by.
fn on_the_cache(
    maps: &Maps,
    found: &[(Member, ListenerConfig)],
    caches: &[CacheDrain],
) -> Result<Vec<String>, DrainError> {
    let mut stuck = Vec::new();
    for (member, config) in configured(found, caches) {
        let (route, reason) = maps.route(member.id, config.liveness)?;
        if route == Route::Upstream {
            continue;
        }
        let name = &member.name;
        stuck.push(if reason == Reason::Override {
            format!(
                "listener {name} is forced to its cache (`redirector state --listener {name} \
                 --set auto` lets the drain move it)"
            )
        } else {
            format!(
                "listener {name} is judged by probes alone (liveness = \"probes\"), whose routes \
                 no drain moves (`redirector state --listener {name} --set upstream` does, until \
                 `--set auto`)"
            )
        });
    }
    Ok(stuck)
}

/// Why a drain failed.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The maps could not be read or written.
    #[error(transparent)]
    Maps(#[from] DatapathError),
    /// The selection names no cache.
    #[error(transparent)]
    Selection(#[from] SelectionError),
    /// The caches' socket tables could not be read.
    #[error("the caches' sockets could not be read")]
    Sockets(#[from] SockDiagError),
    /// A listener of a drained cache still routes to it.
    #[error(
        "{drained}\nbut not every listener of the cache left it, so stopping the cache loses \
         their queries: {listeners}"
    )]
    NotMoved {
        /// What was drained, for people.
        drained: String,
        /// Each listener left on its cache, why, and what to do.
        listeners: String,
    },
    /// The cache still had queries to read when the wait ran out.
    #[error(
        "the cache still had queries unread after {waited:?} ({unread_bytes} bytes queued on its \
         sockets); its listeners stay drained (upstream): stopping the cache now loses those \
         queries, so wait longer (--timeout-ms) or look at why the cache does not read"
    )]
    Timeout {
        /// How long the wait lasted.
        waited: Duration,
        /// Bytes still queued on the cache's UDP sockets.
        unread_bytes: u64,
    },
}

/// Begins a drain of listener `id`; returns the epoch it began.
///
/// # Errors
///
/// [`DrainError::Maps`] when the maps cannot be written.
pub fn begin(maps: &Maps, id: u32) -> Result<u64, DrainError> {
    Ok(maps.drain(id, monotonic_ns())?)
}

/// Begins a drain of every listener of `caches`, one after the other at one instant (a few
/// microseconds apart, before anything waits); returns each listener's id and epoch. All or
/// none: when one cannot be begun, those begun are ended, since a cache half drained would be
/// stopped with queries still steered to it.
///
/// # Errors
///
/// [`DrainError::Maps`] when the maps cannot be written.
pub fn begin_all(maps: &Maps, caches: &[CacheDrain]) -> Result<Vec<(u32, u64)>, DrainError> {
    let now_ns = monotonic_ns();
    let mut begun = Vec::new();
    for member in caches.iter().flat_map(|drain| &drain.listeners) {
        match maps.drain(member.id, now_ns) {
            Ok(epoch) => begun.push((member.id, epoch)),
            Err(error) => {
                for (id, epoch) in begun {
                    // Best effort: the error that stops the drain is the one to report, and an
                    // epoch that cannot be ended here is ended by the cache's next life.
                    let _ended = maps.end_drain(id, epoch);
                }
                return Err(error.into());
            }
        }
    }
    Ok(begun)
}

/// Ends the drain of listener `id` if one is its latest flip: the probes may then confirm the
/// cache. Returns whether a drain was ended.
///
/// # Errors
///
/// [`DrainError::Maps`] when the maps cannot be read or written.
pub fn end(maps: &Maps, id: u32) -> Result<bool, DrainError> {
    let activity = maps.cache_activity(id)?;
    Ok(maps.end_drain(id, activity.flip_epoch)?)
}

/// What a finished wait saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quiet {
    /// From the start of the wait until nothing was left unread.
    pub read_all_after: Duration,
}

/// Waits until the caches of listeners `ids` have nothing left unread (the programs saw them
/// read every query handed to them, and their UDP sockets' receive queues in `table` are empty),
/// then `settle` more for the answers to the last ones; gives up after `timeout`. Called as the
/// drain begins, it never finds the caches quiet inside the drain's grace
/// (`stale::DRAIN_GRACE_NS`), in which a socket that connected to a cache the moment before may
/// still hand it a query, nor gives up before the grace is over.
///
/// # Errors
///
/// [`DrainError::Timeout`] when something is still unread at `timeout`; [`DrainError::Maps`] or
/// [`DrainError::Sockets`] when the state cannot be read.
pub fn wait_quiet(
    maps: &Maps,
    table: &mut SocketTable,
    ids: &[u32],
    settle: Duration,
    timeout: Duration,
) -> Result<Quiet, DrainError> {
    let started = Instant::now();
    loop {
        let unread_bytes = unread_bytes(maps, table, ids)?;
        let mut handed_unread = false;
        for &id in ids {
            let activity = maps.cache_activity(id)?;
            handed_unread |=
                unread_since(activity.first_unread_ns, activity.last_read_ns).is_some();
        }
        if unread_bytes == 0 && !handed_unread && started.elapsed() >= GRACE {
            let read_all_after = started.elapsed();
            std::thread::sleep(settle);
            return Ok(Quiet { read_all_after });
        }
        if started.elapsed() >= timeout.max(GRACE) {
            return Err(DrainError::Timeout {
                waited: started.elapsed(),
                unread_bytes,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Bytes queued on the UDP sockets counted as a cache of listeners `ids`.
fn unread_bytes(maps: &Maps, table: &mut SocketTable, ids: &[u32]) -> Result<u64, DrainError> {
    let mask = ids.iter().fold(0, |mask, &id| mask | listener_bit(id));
    let cookies: Vec<u64> = maps
        .cache_sockets()
        .into_iter()
        .filter(|(_, entry)| entry.protocol == PROTOCOL_UDP && entry.listeners & mask != 0)
        .map(|(cookie, _)| cookie)
        .collect();
    Ok(table
        .bound_sockets()?
        .iter()
        .filter(|socket| socket.protocol == PROTOCOL_UDP && cookies.contains(&socket.cookie))
        .map(|socket| u64::from(socket.recv_queue))
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u32, name: &str, cache: &str) -> Member {
        Member {
            id,
            name: name.to_owned(),
            cache: cache.parse().expect("an address"),
        }
    }

    /// NodeLocal DNSCache's two listeners on one cache, and a third on a cache of its own.
    fn listeners() -> Vec<Member> {
        vec![
            member(0, "local", "169.254.20.10:53"),
            member(1, "other", "169.254.10.10:53"),
            member(2, "cluster-ip", "[::ffff:169.254.20.10]:53"),
        ]
    }

    fn names(caches: &[CacheDrain]) -> Vec<Vec<&str>> {
        caches
            .iter()
            .map(|drain| {
                drain
                    .listeners
                    .iter()
                    .map(|member| member.name.as_str())
                    .collect()
            })
            .collect()
    }

    fn named(names: &[&str]) -> Selection {
        Selection {
            listeners: names.iter().map(|name| (*name).to_owned()).collect(),
            all: false,
        }
    }

    #[test]
    fn a_listener_named_brings_every_listener_of_its_cache() {
        let listeners = listeners();
        let caches = named(&["cluster-ip"]).resolve(&listeners, &[]).unwrap();
        assert_eq!(names(&caches), [["local", "cluster-ip"]]);
        assert_eq!(caches[0].addresses, ["169.254.20.10:53".parse().unwrap()]);
        assert_eq!(
            caches[0].to_string(),
            "cache 169.254.20.10:53: listeners local, cluster-ip"
        );
        let caches = named(&["other"]).resolve(&listeners, &[]).unwrap();
        assert_eq!(names(&caches), [["other"]]);
        assert_eq!(
            caches[0].to_string(),
            "cache 169.254.10.10:53: listener other"
        );
        // Two names of one cache drain it once; names of two caches drain both.
        let caches = named(&["local", "cluster-ip"])
            .resolve(&listeners, &[])
            .unwrap();
        assert_eq!(names(&caches), [["local", "cluster-ip"]]);
        let caches = named(&["other", "local"]).resolve(&listeners, &[]).unwrap();
        assert_eq!(names(&caches), [vec!["local", "cluster-ip"], vec!["other"]]);
    }

    #[test]
    fn no_name_drains_the_one_cache_or_asks_which() {
        let one: Vec<Member> = listeners()
            .into_iter()
            .filter(|member| member.name != "other")
            .collect();
        let caches = Selection::default().resolve(&one, &[]).unwrap();
        assert_eq!(names(&caches), [["local", "cluster-ip"]]);
        let error = Selection::default().resolve(&listeners(), &[]).unwrap_err();
        let said = error.to_string();
        assert!(
            matches!(error, SelectionError::SeveralCaches { count: 2, .. }),
            "{said}"
        );
        assert!(
            said.contains("cache 169.254.20.10:53: listeners local, cluster-ip")
                && said.contains("--all"),
            "{said}"
        );
        let all = Selection {
            listeners: Vec::new(),
            all: true,
        };
        assert_eq!(
            names(&all.resolve(&listeners(), &[]).unwrap()),
            [vec!["local", "cluster-ip"], vec!["other"]]
        );
        assert!(matches!(
            Selection::default().resolve(&[], &[]),
            Err(SelectionError::NoListeners)
        ));
    }

    fn holder(tgid: u32, ids: &[u32]) -> Holder {
        Holder {
            tgid,
            cgroup_id: 1,
            listeners: ids.iter().fold(0, |mask, id| mask | listener_bit(*id)),
        }
    }

    /// AKS LocalDNS: each listener its own cache address, and one CoreDNS bound on both.
    fn aks() -> Vec<Member> {
        vec![
            member(0, "node", "169.254.10.10:53"),
            member(1, "cluster", "169.254.10.11:53"),
        ]
    }

    #[test]
    fn one_process_holding_both_addresses_is_one_cache() {
        // By address alone, two caches: naming one leaves the other on a process about to stop.
        let caches = named(&["node"]).resolve(&aks(), &[]).unwrap();
        assert_eq!(names(&caches), [["node"]]);
        // With the process that holds both, one cache, whichever is named.
        let coredns = [holder(4242, &[0, 1])];
        for name in ["node", "cluster"] {
            let caches = named(&[name]).resolve(&aks(), &coredns).unwrap();
            assert_eq!(names(&caches), [["node", "cluster"]], "{name}");
            assert_eq!(
                caches[0].to_string(),
                "cache 169.254.10.10:53, 169.254.10.11:53 (process 4242): listeners node, cluster"
            );
        }
        // And so a drain with no name finds the one cache.
        let caches = Selection::default().resolve(&aks(), &coredns).unwrap();
        assert_eq!(names(&caches), [["node", "cluster"]]);
        // Workers of one cache (several processes holding its sockets) are all named.
        let workers = [holder(7, &[0, 1]), holder(5, &[0]), holder(9, &[1])];
        let caches = named(&["node"]).resolve(&aks(), &workers).unwrap();
        assert_eq!(caches[0].processes, [5, 7, 9]);
    }

    #[test]
    fn processes_of_their_own_keep_their_caches_apart() {
        let apart = [holder(10, &[0]), holder(11, &[1])];
        let caches = named(&["node"]).resolve(&aks(), &apart).unwrap();
        assert_eq!(names(&caches), [["node"]]);
        assert_eq!(
            caches[0].to_string(),
            "cache 169.254.10.10:53 (process 10): listener node"
        );
        let error = Selection::default().resolve(&aks(), &apart).unwrap_err();
        assert!(
            matches!(error, SelectionError::SeveralCaches { count: 2, .. }),
            "{error}"
        );
    }

    #[test]
    fn addresses_and_processes_join_transitively() {
        // 0 and 2 share an address; a process holds 2's and 3's; 1 stands alone.
        let listeners = vec![
            member(0, "a", "169.254.20.10:53"),
            member(1, "b", "169.254.10.10:53"),
            member(2, "c", "169.254.20.10:53"),
            member(3, "d", "[fd00:53::10]:53"),
        ];
        let holders = [holder(3, &[2, 3])];
        let caches = group(&listeners, &holders);
        assert_eq!(names(&caches), [vec!["a", "c", "d"], vec!["b"]]);
        // The process joins the first and the last listener, through the second.
        let holders = [holder(3, &[3, 1])];
        let caches = group(&listeners, &holders);
        assert_eq!(names(&caches), [vec!["a", "c"], vec!["b", "d"]]);
        let holders = [holder(3, &[3, 1]), holder(4, &[1, 0])];
        let caches = group(&listeners, &holders);
        assert_eq!(names(&caches), [["a", "b", "c", "d"]]);
        assert_eq!(caches[0].processes, [3, 4]);
        assert_eq!(caches[0].addresses.len(), 3, "{}", caches[0]);
    }

    #[test]
    fn an_unknown_name_is_refused_with_the_names_there_are() {
        let error = named(&["local", "cluster"])
            .resolve(&listeners(), &[])
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "there is no listener \"cluster\" (the listeners are: local, other, cluster-ip); name \
             one of those, and every listener its cache serves is drained with it"
        );
    }

    #[test]
    fn the_wire_request_is_read_by_either_release() {
        // A CLI from before whole-cache drains names one listener.
        let old: DrainRequest = serde_json::from_str(
            r#"{"listener":"cluster-ip","cancel":false,"wait":true,"timeout_ms":2500,"settle_ms":300}"#,
        )
        .unwrap();
        assert_eq!(old.selection, named(&["cluster-ip"]));
        assert!(old.wait);
        assert_eq!(old.timeout_ms, 2500);
        // This release's request carries every name, and the first alone as `listener`, which is
        // what an agent from before reads.
        let request = DrainRequest {
            selection: named(&["node", "cluster"]),
            cancel: false,
            wait: true,
            timeout_ms: DEFAULT_TIMEOUT_MS,
            settle_ms: DEFAULT_SETTLE_MS,
        };
        let line = serde_json::to_string(&request).unwrap();
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["listener"], "node", "{line}");
        assert_eq!(value["listeners"], serde_json::json!(["node", "cluster"]));
        assert_eq!(
            serde_json::from_str::<DrainRequest>(&line).unwrap(),
            request
        );
        let all = DrainRequest {
            selection: Selection {
                listeners: Vec::new(),
                all: true,
            },
            ..request
        };
        let line = serde_json::to_string(&all).unwrap();
        assert!(!line.contains("listener"), "{line}");
        assert_eq!(serde_json::from_str::<DrainRequest>(&line).unwrap(), all);
    }
}
