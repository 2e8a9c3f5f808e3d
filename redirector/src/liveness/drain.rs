//! Drains: a listener moved upstream for planned work on its cache, before the cache is stopped.
//!
//! A drain begins a new `down_epoch`, recorded as a drain in `CACHE_ACTIVITY`: the programs route
//! upstream from the next syscall, and the agent's probes do not confirm that epoch however well
//! the cache answers. It ends when the cache's next life begins a new epoch (its last socket
//! closes, or it is signalled to stop) and the probes confirm that life, or when an operator ends
//! it. A socket that connected to the cache the moment before the drain may still send there
//! for the drain's grace (`stale::DRAIN_GRACE_NS`). Waiting for a drain means waiting out that
//! grace and until the cache has read every query it was handed and its receive queues are
//! empty, then for the answers it is still working on.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use redirector_common::{
    activity::unread_since, counters::PROTOCOL_UDP, datapath::listener_bit, stale::DRAIN_GRACE_NS,
};

use super::{
    health::monotonic_ns,
    sockdiag::{SockDiagError, SocketTable},
};
use crate::datapath::{DatapathError, Maps};

/// A drain asked of the agent over its drain socket (one JSON line), or done by the CLI itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRequest {
    /// The listener's name.
    pub listener: String,
    /// End a drain instead of beginning one.
    #[serde(default)]
    pub cancel: bool,
    /// Wait until the cache has read what it was handed ([`wait_quiet`]).
    #[serde(default)]
    pub wait: bool,
    /// How long to wait, in ms.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// How long to give the last answers once nothing is unread, in ms.
    #[serde(default = "default_settle_ms")]
    pub settle_ms: u64,
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

/// Does `request` against the maps pinned under `pin_dir`, reading the caches' sockets in the
/// network namespace at `cache_netns` (or the caller's); returns what happened, for people.
///
/// # Errors
///
/// [`DrainError`] for an unknown listener, maps or sockets that cannot be read, or a wait that
/// ran out.
pub fn handle(
    pin_dir: &Path,
    cache_netns: Option<&Path>,
    request: &DrainRequest,
) -> Result<String, DrainError> {
    let maps = Maps::open_pinned(pin_dir)?;
    let (id, _) = maps.listener_named(&request.listener)?;
    let name = &request.listener;
    if request.cancel {
        return Ok(if end(&maps, id)? {
            format!(
                "listener {name}: drain ended; its DNS goes back to the cache once the agent's \
                 probes confirm it"
            )
        } else {
            format!(
                "listener {name}: no drain to end (the cache's next life ended it, or none began)"
            )
        });
    }
    let epoch = begin(&maps, id)?;
    let drained = format!(
        "listener {name}: drained (epoch {epoch}); its DNS goes upstream from now until the \
         cache's next life is confirmed"
    );
    if !request.wait {
        return Ok(drained);
    }
    let mut table = SocketTable::open(cache_netns)?;
    let quiet = wait_quiet(
        &maps,
        &mut table,
        id,
        Duration::from_millis(request.settle_ms),
        Duration::from_millis(request.timeout_ms),
    )?;
    Ok(format!(
        "{drained}\nlistener {name}: the cache read everything it was handed, seen after {} ms \
         (the drain's {} ms grace is waited out); it can be stopped",
        quiet.read_all_after.as_millis(),
        GRACE.as_millis()
    ))
}

/// Why a drain failed.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The maps could not be read or written, or hold no such listener.
    #[error(transparent)]
    Maps(#[from] DatapathError),
    /// The caches' socket tables could not be read.
    #[error("the caches' sockets could not be read")]
    Sockets(#[from] SockDiagError),
    /// The cache still had queries to read when the wait ran out.
    #[error(
        "the cache still had queries unread after {waited:?} ({unread_bytes} bytes queued on its \
         sockets); the listener stays drained (upstream): stopping the cache now loses those \
         queries, so wait longer (--timeout) or look at why the cache does not read"
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

/// Waits until listener `id`'s cache has nothing left unread (the programs saw it read every
/// query handed to it, and its UDP sockets' receive queues in `table` are empty), then `settle`
/// more for the answers to the last ones; gives up after `timeout`. Called as the drain begins,
/// it never finds the cache quiet inside the drain's grace (`stale::DRAIN_GRACE_NS`), in which a
/// socket that connected to the cache the moment before may still hand it a query, nor gives up
/// before the grace is over.
///
/// # Errors
///
/// [`DrainError::Timeout`] when something is still unread at `timeout`; [`DrainError::Maps`] or
/// [`DrainError::Sockets`] when the state cannot be read.
pub fn wait_quiet(
    maps: &Maps,
    table: &mut SocketTable,
    id: u32,
    settle: Duration,
    timeout: Duration,
) -> Result<Quiet, DrainError> {
    let started = Instant::now();
    loop {
        let unread_bytes = unread_bytes(maps, table, id)?;
        let activity = maps.cache_activity(id)?;
        let handed_unread = unread_since(activity.first_unread_ns, activity.last_read_ns).is_some();
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

/// Bytes queued on the UDP sockets counted as listener `id`'s cache.
fn unread_bytes(maps: &Maps, table: &mut SocketTable, id: u32) -> Result<u64, DrainError> {
    let cookies: Vec<u64> = maps
        .cache_sockets()
        .into_iter()
        .filter(|(_, entry)| {
            entry.protocol == PROTOCOL_UDP && entry.listeners & listener_bit(id) != 0
        })
        .map(|(cookie, _)| cookie)
        .collect();
    Ok(table
        .bound_sockets()?
        .iter()
        .filter(|socket| socket.protocol == PROTOCOL_UDP && cookies.contains(&socket.cookie))
        .map(|socket| u64::from(socket.recv_queue))
        .sum())
}
