//! Waiting for a drained cache to read everything it was handed: no query left unread as the
//! programs saw it, its UDP receive queues empty, the drain's grace waited out.

use std::time::{Duration, Instant};

use redirector_common::{
    activity::unread_since, counters::PROTOCOL_UDP, datapath::listener_bit, stale::DRAIN_GRACE_NS,
};

use super::DrainError;
use crate::{datapath::Maps, liveness::sockdiag::SocketTable};

/// The drain's grace (`stale::DRAIN_GRACE_NS`), which a wait outlasts.
pub(super) const GRACE: Duration = Duration::from_nanos(DRAIN_GRACE_NS);

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
