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
//!
//! Here a drain done as asked (begun, ended, reported, waited for); which caches a request names
//! is in `caches`, the request and reply on the drain socket in `request`, the wait for a
//! cache to read what it was handed in `wait`.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use redirector_common::listener::{EMPTY_POOL_FAIL, ListenerConfig, Reason, Route};

use super::{
    cache_tasks::{self, Holder},
    health::monotonic_ns,
    sockdiag::{SockDiagError, SocketTable},
};
use crate::datapath::{DatapathError, Maps};

mod caches;
mod request;
mod wait;

use caches::listeners_text;
pub use caches::{CacheDrain, Member, Selection, SelectionError, group};
pub use request::{DEFAULT_SETTLE_MS, DEFAULT_TIMEOUT_MS, DrainReply, DrainRequest};
use wait::GRACE;
pub use wait::{Quiet, wait_quiet};

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
    if !holders.is_empty() {
        return (holders, None);
    }
    // Where the caches' processes are not visible in /proc, or their descriptors cannot be read
    // (the shipped capabilities): the processes the programs saw bind or read those sockets.
    let open = sockets.values().fold(0, |bits, listeners| bits | listeners);
    let recorded = cache_tasks::recorded(maps, open);
    if recorded.is_empty() {
        return (
            Vec::new(),
            Some(
                "no process was seen holding the caches' sockets (none is visible in /proc here, \
                 and the programs have not yet seen a cache bind or read one since the agent \
                 started)"
                    .to_owned(),
            ),
        );
    }
    (recorded, None)
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
